#!/usr/bin/env python3
"""One layer's causal prefill attention of a 4000-token prompt (the issue-4 Llama shape: 32 heads, 8 KV heads,
head_dim 64, bf16): pdserve's Triton kernel against torch SDPA's backends (flash, cuDNN, memory-efficient), same
process, warm L2; microseconds per call, TFLOP/s and max error against an fp32 reference. Prints JSON.

    python scripts/bench_attention_sdpa.py > bench/results/prefill_attention_vs_sdpa.json
"""

import functools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.kernels.prefill_attention import paged_prefill_attention

N, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4000, 32, 8, 64, 16
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def time_us(fn: Callable[[], object], iters: int = 50) -> float:
    """Mean microseconds per call (CUDA events), after 5 warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Callable[[], object], torch.Tensor]:
    """The Triton prefill kernel over one sequence of new tokens (no cached prefix): the call and its output."""
    blocks = -(-N // BLOCK_SIZE)
    cache = torch.zeros(2, blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=q.dtype)
    tables = torch.arange(1, blocks + 1, device="cuda", dtype=torch.int32)[None]
    starts = torch.tensor([0, N], device="cuda", dtype=torch.int32)
    lens = torch.tensor([N], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    return lambda: paged_prefill_attention(q, k, v, cache, tables, starts, lens, N, HEAD_DIM**-0.5, out=out), out


def main() -> None:
    torch.manual_seed(0)
    q = torch.randn(N, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)  # [tokens, heads, head_dim]
    k, v = (torch.randn(N, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, tokens, head_dim]
    ke, ve = kt.repeat_interleave(HEADS // KV_HEADS, 1), vt.repeat_interleave(HEADS // KV_HEADS, 1)
    ref = F.scaled_dot_product_attention(qt.float(), ke.float(), ve.float(), is_causal=True)[0].transpose(0, 1)
    call, out = ours(q, k, v)
    res: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "ours_triton_us": time_us(call)}
    res["ours_triton_max_err"] = (out.float() - ref).abs().max().item()
    for name, backend in BACKENDS.items():
        for label, (key, value, gqa) in (("gqa", (kt, vt, True)), ("expanded", (ke, ve, False))):
            try:
                with sdpa_kernel(backend):
                    fn = functools.partial(
                        F.scaled_dot_product_attention, qt, key, value, is_causal=True, enable_gqa=gqa
                    )
                    o = fn()
                    res[f"sdpa_{name}_{label}_us"] = time_us(fn)
                res[f"sdpa_{name}_{label}_max_err"] = (o[0].transpose(0, 1).float() - ref).abs().max().item()
            except RuntimeError as exc:
                res[f"sdpa_{name}_{label}_us"] = f"error: {str(exc)[:120]}"
    flops = 4 * N * N / 2 * HEAD_DIM * HEADS  # causal: half the score matrix, QK^T and PV
    for key_, us in list(res.items()):
        if key_.endswith("_us") and isinstance(us, float):
            res[key_[:-3] + "_tflops"] = round(flops / (us * 1e-6) / 1e12, 1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
