#!/usr/bin/env python3
"""MoE decode and prefill (issue 36): the engine on the Qwen3-30B-A3B shape (seeded dummy bf16 weights), its decode
step beside the HBM floor, and transformers on the same config, same GPU, same process.

    python scripts/bench_moe.py --out bench/results/moe_qwen3_30b_a3b_h200.json
    python scripts/bench_moe.py --layers 12 --out /tmp/moe.json              # a quick run: 12 of 48 layers
    python scripts/bench_moe.py --shape mixtral-8x7b --layers 16 --out /tmp/mixtral.json
    python scripts/bench_moe.py --smoke --out /tmp/moe_smoke.json            # tiny shapes on CPU, no timing claims

1. Decode: `--batches` sequences (1 and 64) of `--context` prompt tokens all decoding; engine.step() wall times
   (median_tpot_ms: a static batch's step interval is every sequence's TPOT and ITL) and, where the runner holds
   CUDA graphs, the GPU time of one graph replay. The HBM floor of a step is the bytes it must read / bandwidth:
   every non-expert weight (attention, norms, routers, lm_head; the embedding's rows of the batch), the distinct
   experts the step's routing selects in each layer, and the KV cache. Experts are counted from the routing
   observed in one eager step of the same batch (forward hooks on the routers) and, beside it, from the
   expectation under uniform routing, E * (1 - (1 - k/E)^batch). Bandwidth: nominal peak from a table by GPU
   name, and the copy bandwidth measured here ((read + write) bytes of a large device-to-device copy / time).
2. Prefill: one `--prefill-tokens` prompt, first token on the host (ttft_ms); transformers' forward of the same
   length (last position's logits). Then transformers' decode step at batch 1 on a `--context` cache.
The engine is loaded, measured and freed (del, gc, empty_cache) before transformers is loaded: the bf16 shape is
~61 GB, two copies fit no GPU. transformers gets the same config.json with its own seeded initialization (timings
follow shapes, not values); sdpa attention, no torch.compile, its default experts implementation (in the JSON).
`--layers N` keeps the first N layers of the shape (floors and memory scale with it).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from bench_decode import replay_ms
from torch import nn

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.model_runner import kv_bytes_per_block
from pdserve.core.models import mixtral, qwen3_moe
from pdserve.core.models.moe import MoeArgs
from pdserve.core.sampling_params import SamplingParams

MOE_SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b")
TINY: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=32, moe_intermediate_size=32, num_experts=8, num_local_experts=8, num_experts_per_tok=2,
    vocab_size=512, max_position_embeddings=512, bos_token_id=1, eos_token_id=1,
)  # fmt: skip
"""--smoke's overrides of either shape (a family ignores the fields it lacks)."""
PEAK_HBM_TBPS = (("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35))
"""Nominal HBM bandwidth (TB/s) by the first name part found in the GPU's name ("H100" alone: SXM, HBM3)."""
COPY_MIB = {"cuda": 2048, "cpu": 64}
"""Size of the copy that measures bandwidth, by device (made before any model: nothing else holds memory)."""
MEMORY_MARGIN = 6 << 30
"""Bytes beyond weights and KV pool a model needs (activations, graphs, workspaces, the CUDA context)."""


@dataclass(frozen=True)
class Setup:
    """What runs where, at which sizes (the GPU defaults or --smoke's CPU ones)."""

    device: str
    """cuda (bf16, CUDA graphs as the runner takes them) or cpu (--smoke: float32, eager)."""
    shape: str
    """A name in make_bench_model.SHAPES (one of MOE_SHAPES)."""
    overrides: dict[str, Any]
    """Fields replaced in the shape's config (--layers; --smoke's tiny sizes)."""
    batches: tuple[int, ...]
    """Sequences decoding at once, one timing each."""
    context: int
    """Prompt tokens of every decoding sequence (and of transformers' decode cache)."""
    prefill_tokens: int
    """Tokens of the prefilled prompt."""
    warmup_steps: int
    """Decode steps run untimed once every sequence decodes."""
    steps: int
    """Timed decode steps per batch."""
    repeats: int
    """Timed prefills per system."""

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.device == "cuda" else "float32"

    @property
    def max_tokens(self) -> int:
        """Every decoding request's output budget: more than it generates. The first requests of a batch decode
        while the others prefill, one prompt per pass at least, so up to max(batches) tokens before timing."""
        return self.warmup_steps + self.steps + max(self.batches) + 8


def make_setup(args: argparse.Namespace) -> Setup:
    overrides = dict(TINY) if args.smoke else {}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.smoke:
        return Setup("cpu", args.shape, overrides, (1, 4), 24, 64, 2, 4, 2)
    batches = tuple(int(b) for b in args.batches.split(","))
    return Setup(
        "cuda", args.shape, overrides, batches, args.context, args.prefill_tokens, 10, args.steps, args.repeats
    )


def write_model(shape: str, out: Path, overrides: dict[str, Any]) -> Path:
    """A config.json of a make_bench_model shape with fields replaced (those the family has)."""
    from make_bench_model import SHAPES
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    known = AutoConfig.for_model(model_type).to_dict()
    spec |= {k: v for k, v in overrides.items() if k in known or k in spec}
    AutoConfig.for_model(model_type, **spec).save_pretrained(out)
    return out


def moe_args(cfg: ModelConfig) -> MoeArgs:
    return (mixtral if cfg.arch == "mixtral" else qwen3_moe).moe_args(cfg.hf_config)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stats(metric: str, times_ms: list[float]) -> dict[str, float]:
    """vLLM's names: mean_/median_/p90_/p99_/min_{metric}_ms."""
    arr = np.asarray(times_ms)
    out = {"mean": arr.mean(), "median": np.median(arr), "p90": np.percentile(arr, 90)}
    out |= {"p99": np.percentile(arr, 99), "min": arr.min()}
    return {f"{k}_{metric}_ms": round(float(v), 4) for k, v in out.items()}


# --- memory and bandwidth ------------------------------------------------------------------------------------


def weight_bytes_estimate(cfg: ModelConfig) -> int:
    """Bytes of the model's weights from its config (attention, experts, routers, embedding and lm_head)."""
    moe, h, hd = moe_args(cfg), cfg.hidden_size, cfg.head_dim
    attention = 2 * h * cfg.num_heads * hd + 2 * h * cfg.num_kv_heads * hd
    experts = moe.num_experts * 3 * moe.intermediate_size * h + h * moe.num_experts
    tables = 1 if getattr(cfg.hf_config, "tie_word_embeddings", False) else 2
    params = cfg.num_layers * (attention + experts) + tables * cfg.vocab_size * h
    return params * torch.empty((), dtype=cfg.torch_dtype).element_size()


class NotEnoughMemory(RuntimeError):
    """The GPU cannot hold a model of this shape: the message says how much it needs and has."""


def check_memory(device: torch.device, need: int, what: str) -> None:
    """NotEnoughMemory when the GPU's free memory cannot hold `need` bytes."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if need > free:
        raise NotEnoughMemory(
            f"{what} needs ~{need / 2**30:.1f} GiB, {torch.cuda.get_device_name(device)} has {free / 2**30:.1f} of "
            f"{total / 2**30:.1f} GiB free: cut the depth with --layers N (weights scale with it)"
        )


def nominal_peak_tbps(gpu: str) -> float | None:
    return next((tbps for name, tbps in PEAK_HBM_TBPS if name in gpu), None)


def copy_tbps(device: torch.device, num_bytes: int, repeats: int = 10) -> float:
    """(read + write) bytes per second of a device-to-device copy of num_bytes, in TB/s."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    tbps = 2 * num_bytes * repeats / (time.perf_counter() - start) / 1e12
    del src, dst
    free(device)  # NOTE: the caching allocator would keep both buffers from the models' memory checks
    return tbps


# --- the engine ----------------------------------------------------------------------------------------------


def make_engine(folder: Path, setup: Setup) -> Engine:
    model = ModelConfig.from_pretrained(folder, dtype=setup.dtype, load_format="dummy")
    batch, block = max(setup.batches), 16
    per_seq = -(-(setup.context + setup.max_tokens + 1) // block) + 1
    num_blocks = max(batch * per_seq, setup.prefill_tokens // block + 2) + 16
    cache = CacheConfig(block_size=block, num_blocks=num_blocks, enable_prefix_caching=False)
    scheduler = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(setup.prefill_tokens, setup.context))
    cfg = EngineConfig(model, cache, scheduler, device=setup.device)
    device = torch.device(setup.device)
    check_memory(device, weight_bytes_estimate(model) + num_blocks * kv_bytes_per_block(cfg) + MEMORY_MARGIN, "pdserve")
    try:
        return Engine(cfg)
    except torch.OutOfMemoryError as exc:
        raise NotEnoughMemory(f"pdserve ran out of GPU memory starting {setup.shape}: cut it with --layers N") from exc


class RouterHooks:
    """Forward hooks on every MoE layer's router (`...layers.{i}.mlp.gate`): the logits of the passes run while
    attached, by layer. CUDA graph replays run no hooks: attach around an eager pass."""

    def __init__(self, model: nn.Module, num_experts: int) -> None:
        self.logits: dict[int, torch.Tensor] = {}
        self.handles = []
        for name, module in model.named_modules():
            found = re.search(r"layers\.(\d+)\.mlp\.gate$", name)
            if found and isinstance(module, nn.Linear) and module.out_features == num_experts:
                self.handles.append(module.register_forward_hook(self._keep(int(found[1]))))

    def _keep(self, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            self.logits[layer] = output.detach()  # [num_tokens, num_experts]

        return hook

    def distinct_experts(self, top_k: int) -> dict[int, int]:
        """Per layer, the experts any token of the last pass was routed to (softmax is monotonic: top-k logits)."""
        return {
            layer: int(logits.topk(top_k, dim=-1).indices.unique().numel()) for layer, logits in self.logits.items()
        }

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def observed_routing(engine: Engine, top_k: int) -> dict[int, int]:
    """Distinct experts per layer of one decode step of the running batch, run eagerly with router hooks.

    NOTE: the runner's decode graphs are set aside for that one step (a replay runs no hooks) and put back."""
    runner = engine.runner
    hooks, graphs = RouterHooks(runner.model, moe_args(engine.config.model).num_experts), runner.graphs
    runner.graphs = None
    try:
        engine.step()
    finally:
        runner.graphs = graphs
        hooks.remove()
    return hooks.distinct_experts(top_k)


def graph_step_ms(engine: Engine, batch: int) -> float | None:
    """GPU time (ms) of one captured decode step of `batch` (bench_decode.replay_ms); None: no graph holds it."""
    graphs = engine.runner.graphs
    if graphs is None or batch > graphs.max_size:
        return None
    sync(engine.runner.device)
    return round(replay_ms(engine, batch, repeats=50), 4)


def start_batch(engine: Engine, batch: int, setup: Setup) -> list[str]:
    """`batch` requests of setup.context random tokens, prefilled until every one decodes."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=setup.max_tokens, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(
            rid, torch.randint(0, engine.config.model.vocab_size, (setup.context,), generator=gen).tolist(), params
        )
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step())
    return ids


def decode_batch(engine: Engine, batch: int, setup: Setup) -> dict[str, Any]:
    """engine.step() wall times while `batch` sequences decode, the graph replay's GPU time, the routing."""
    device = engine.runner.device
    ids = start_batch(engine, batch, setup)
    for _ in range(setup.warmup_steps):
        engine.step()
    times = []
    for _ in range(setup.steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    sync(device)
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(f"{len(engine.scheduler.running)} of {batch} sequences still decode after the timed steps")
    row: dict[str, Any] = {"sequences_running": len(engine.scheduler.running), **stats("tpot", times)}
    row["output_tok_per_s"] = round(batch / (row["median_tpot_ms"] / 1e3), 1)
    row["graph_replay_ms"] = graph_step_ms(engine, batch)
    row["distinct_experts_observed"] = observed_routing(engine, moe_args(engine.config.model).top_k)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return row


def prefill(engine: Engine, setup: Setup) -> dict[str, Any]:
    """One prompt of setup.prefill_tokens, max_tokens 1: time to its first token on the host, and the whole call
    (with the flush that frees its blocks)."""
    device, vocab = engine.runner.device, engine.config.model.vocab_size
    gen = torch.Generator().manual_seed(1)
    # NOTE: int32 arrays, as a prefill worker unpacks them from a GenerateCmd; made before any clock starts
    prompts = itertools.cycle(
        [torch.randint(0, vocab, (setup.prefill_tokens,), generator=gen).int().numpy() for _ in range(4)]
    )
    one, counter = SamplingParams(temperature=0.0, max_tokens=1), itertools.count()
    ttft, calls = [], []
    for i in range(setup.repeats + 3):
        sync(device)
        start = time.perf_counter()
        engine.add_request(f"prefill-{next(counter)}", next(prompts), one)
        while not engine.step():
            pass
        first = time.perf_counter()
        engine.flush_commits()
        sync(device)
        if i >= 3:  # NOTE: the first calls compile and allocate
            ttft.append((first - start) * 1e3)
            calls.append((time.perf_counter() - start) * 1e3)
    return {"tokens": setup.prefill_tokens, **stats("ttft", ttft), "median_call_ms": round(statistics.median(calls), 4)}


# --- the HBM floor ---------------------------------------------------------------------------------------------


class StepBytes(NamedTuple):
    """What a decode step reads from the engine's weights, apart from its experts and KV."""

    always: int
    """Every non-expert weight (attention, norms, routers, dense MLPs, lm_head; a tied embedding whole)."""
    embedding_row: int
    """Bytes of one row of an untied embedding table (each sequence reads its token's); 0 when tied."""
    expert: dict[int, int]
    """Bytes of one expert of each MoE layer (its gate, up and down projections)."""
    kv_per_token: int
    """KV bytes of one token in every layer (K and V)."""


def step_bytes(engine: Engine) -> StepBytes:
    """From the engine's parameters: `.experts.` ones per layer, an untied `embed_tokens` by row, the rest whole."""
    model, num_experts = engine.runner.model, moe_args(engine.config.model).num_experts
    names = dict(model.named_parameters())
    tied = not any(name.startswith("lm_head") for name in names)
    always, row, expert = 0, 0, dict[int, int]()
    for name, param in names.items():
        size = param.numel() * param.element_size()
        if ".experts." in name:
            layer = int(re.search(r"layers\.(\d+)\.", name)[1])  # type: ignore[index]
            expert[layer] = expert.get(layer, 0) + size // num_experts
        elif name.endswith("embed_tokens.weight") and not tied:
            row = size // param.shape[0]
        else:
            always += size
    kv = kv_bytes_per_block(engine.config) // engine.config.cache.block_size
    return StepBytes(always, row, expert, kv)


def uniform_distinct(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts of `batch` tokens each routed to top_k of num_experts uniformly at random."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def hbm_floor(
    sizes: StepBytes, batch: int, experts: dict[int, float], kv_tokens: float, tbps: dict[str, float | None]
) -> dict[str, Any]:
    """The bytes one decode step of `batch` must read (`experts`: distinct experts per layer) and its time (ms)
    at each bandwidth."""
    parts = {
        "non_expert_weights": sizes.always + batch * sizes.embedding_row,
        "experts": round(sum(n * sizes.expert[layer] for layer, n in experts.items())),
        "kv_cache": round(batch * kv_tokens * sizes.kv_per_token),
    }
    total = sum(parts.values())
    floors = {f"floor_ms_{k}": None if v is None else round(total / (v * 1e12) * 1e3, 4) for k, v in tbps.items()}
    return {"bytes": parts | {"total": total}, **floors}


def batch_floor(
    sizes: StepBytes, moe: MoeArgs, row: dict[str, Any], batch: int, kv_tokens: float, tbps: dict[str, float | None]
) -> dict[str, Any]:
    """One batch's floors with the experts of the observed routing and with the uniform expectation, and the
    step time over the observed floors."""
    observed, uniform = row["distinct_experts_observed"], uniform_distinct(moe.num_experts, moe.top_k, batch)
    floor = hbm_floor(sizes, batch, observed, kv_tokens, tbps)
    out = {
        "mean_kv_tokens_per_sequence": kv_tokens,
        "distinct_experts_per_layer": {
            "observed_mean": round(statistics.mean(observed.values()), 2),
            "uniform_expected": round(uniform, 2),
        },
        "observed_routing": floor,
        "uniform_routing": hbm_floor(sizes, batch, dict.fromkeys(sizes.expert, uniform), kv_tokens, tbps),
    }
    for name, ms in floor.items():
        if name.startswith("floor_ms_") and ms:
            out[f"median_tpot_over_{name}"] = round(row["median_tpot_ms"] / ms, 3)
    return out  # fmt: skip


def floors(engine: Engine, decode: dict[str, Any], setup: Setup, tbps: dict[str, float | None]) -> dict[str, Any]:
    sizes, moe = step_bytes(engine), moe_args(engine.config.model)
    kv_tokens = setup.context + setup.warmup_steps + setup.steps / 2  # NOTE: the timed steps' mean length
    return {str(b): batch_floor(sizes, moe, decode[str(b)], b, kv_tokens, tbps) for b in setup.batches}


# --- transformers ----------------------------------------------------------------------------------------------


def load_transformers(folder: Path, setup: Setup) -> Any:
    """AutoModelForCausalLM from the config.json, built and initialized on the device (seeded), sdpa attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(setup.device)
    cfg = ModelConfig.from_pretrained(folder, dtype=setup.dtype, load_format="dummy")
    check_memory(device, weight_bytes_estimate(cfg) + MEMORY_MARGIN, "transformers")
    torch.manual_seed(0)
    try:
        with device:
            hf_config = AutoConfig.from_pretrained(folder)
            model = AutoModelForCausalLM.from_config(hf_config, dtype=cfg.torch_dtype, attn_implementation="sdpa")
    except torch.OutOfMemoryError as exc:
        raise NotEnoughMemory(
            f"transformers ran out of GPU memory loading {setup.shape}: cut it with --layers N"
        ) from exc
    return model.eval()


def hf_prefill(model: Any, setup: Setup) -> dict[str, Any]:
    """The forward of one prompt (the last position's logits): transformers' time to a first token's logits."""
    device = torch.device(setup.device)
    ids = torch.randint(0, model.config.vocab_size, (1, setup.prefill_tokens), device=device)
    times = []
    with torch.inference_mode():
        for i in range(setup.repeats + 3):
            sync(device)
            start = time.perf_counter()
            model(ids, logits_to_keep=1)
            sync(device)
            if i >= 3:
                times.append((time.perf_counter() - start) * 1e3)
    return {"tokens": setup.prefill_tokens, **stats("ttft", times)}


def hf_decode(model: Any, setup: Setup) -> dict[str, Any]:
    """Greedy one-token forwards at batch 1 on a DynamicCache of setup.context tokens (generate's loop, timed per
    step with a sync, as generate syncs on its stopping criteria)."""
    device = torch.device(setup.device)
    ids = torch.randint(0, model.config.vocab_size, (1, setup.context), device=device)
    times = []
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # NOTE: 5.24
    with torch.inference_mode():
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, token = out[key], out.logits[:, -1:].argmax(-1)  # token: [1, 1]
        for i in range(setup.warmup_steps + setup.steps):
            sync(device)
            start = time.perf_counter()
            out = model(token, **{key: cache}, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            sync(device)
            if i >= setup.warmup_steps:
                times.append((time.perf_counter() - start) * 1e3)
    return {"1": {"sequences_running": 1, **stats("tpot", times)}}


def free(device: torch.device) -> dict[str, float]:
    """Collect what was dropped and give cached blocks back; GiB still allocated (CUDA)."""
    gc.collect()
    if device.type != "cuda":
        return {}
    torch.cuda.empty_cache()
    return {"allocated_gib_after_free": round(torch.cuda.memory_allocated(device) / 2**30, 3)}


# --- the run ---------------------------------------------------------------------------------------------------


def run_engine(folder: Path, setup: Setup, tbps: dict[str, float | None]) -> dict[str, Any]:
    engine = make_engine(folder, setup)
    runner = engine.runner
    part: dict[str, Any] = {"decode_graphs": runner.graphs is not None}
    part["prefill_graphs"] = runner.prefill_graphs is not None
    part["startup_s"] = {k: round(v, 2) for k, v in runner.startup_s.items()}
    part["decode"] = {str(b): decode_batch(engine, b, setup) for b in setup.batches}
    part["prefill"] = prefill(engine, setup)
    part["hbm_floor"] = floors(engine, part["decode"], setup, tbps)
    del engine, runner
    return part | free(torch.device(setup.device))


def run_transformers(folder: Path, setup: Setup) -> dict[str, Any]:
    import transformers

    model = load_transformers(folder, setup)
    part: dict[str, Any] = {"version": transformers.__version__, "attn_implementation": "sdpa"}
    get_experts = getattr(model, "get_experts_implementation", None)
    part["experts_implementation"] = get_experts() if get_experts else None
    part["prefill"] = hf_prefill(model, setup)
    part["decode"] = hf_decode(model, setup)
    del model
    return part | free(torch.device(setup.device))


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """transformers' time / ours: prefill TTFT and the batch-1 decode step."""
    ours, theirs = result["pdserve"], result["transformers"]
    out = {"prefill_ttft": theirs["prefill"]["median_ttft_ms"] / ours["prefill"]["median_ttft_ms"]}
    if "1" in ours["decode"]:
        out["decode_tpot_batch1"] = theirs["decode"]["1"]["median_tpot_ms"] / ours["decode"]["1"]["median_tpot_ms"]
    return {k: round(v, 3) for k, v in out.items()}


def triton_version() -> str | None:
    try:
        import triton  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        return None
    return str(triton.__version__)


def header(setup: Setup, folder: Path, tbps: dict[str, float | None]) -> dict[str, Any]:
    cfg = json.loads((folder / "config.json").read_text())
    gpu = torch.cuda.get_device_name() if setup.device == "cuda" else "cpu"
    smoke = " (--smoke: tiny shapes on CPU, no timing claims)" if setup.device == "cpu" else ""
    fields = ("model_type", "num_hidden_layers", *sorted(set(TINY) - {"bos_token_id", "eos_token_id"}))
    return {
        "what": f"MoE decode step (HBM floor beside it) and prefill, pdserve vs transformers, {setup.shape} shape, "
        f"dummy weights, {setup.dtype}{smoke}",
        "gpu": gpu,
        "command": shlex.join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda,
        "setup": {k: v for k, v in asdict(setup).items()} | {"dtype": setup.dtype},
        "model": {k: cfg[k] for k in fields if k in cfg},
        "layers_cut": setup.overrides.get("num_hidden_layers") if setup.device == "cuda" else None,
        "bandwidth_TBps": tbps | {"nominal_source": "table by GPU name (nominal peak, not measured)",
                                  "measured_copy_source": f"(read + write) bytes / time of a {COPY_MIB[setup.device]}"
                                                          " MiB device-to-device copy"},
    }  # fmt: skip


def print_table(result: dict[str, Any]) -> None:
    for name in ("pdserve", "transformers"):
        part = result.get(name, {})
        for batch, row in part.get("decode", {}).items():
            print(f"{name:12s} decode batch {batch:>3s}: {row['median_tpot_ms']:9.3f} ms/step", end="")
            floor = part.get("hbm_floor", {}).get(batch, {}).get("observed_routing", {})
            print("".join(f"  {k[9:]} {v} ms" for k, v in floor.items() if k.startswith("floor_ms_") and v))
        if "prefill" in part:
            print(f"{name:12s} prefill {part['prefill']['tokens']} tokens: {part['prefill']['median_ttft_ms']:9.3f} ms")
    if "error" in result:
        print(result["error"], file=sys.stderr)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=MOE_SHAPES, default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, float32, eager: runs end to end")
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--batches", default="1,64", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of each decoding sequence")
    p.add_argument("--prefill-tokens", type=int, default=4000)
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per batch")
    p.add_argument("--repeats", type=int, default=10, help="timed prefills per system")
    p.add_argument("--no-transformers", action="store_true", help="the engine alone")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    setup = make_setup(args)
    if setup.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (--smoke runs on CPU)", file=sys.stderr)
        return 2
    device = torch.device(setup.device)
    folder = write_model(setup.shape, Path(tempfile.mkdtemp(prefix="bench_moe_")), setup.overrides)
    gpu = torch.cuda.get_device_name() if setup.device == "cuda" else "cpu"
    tbps = {
        "nominal": nominal_peak_tbps(gpu),
        "measured_copy": round(copy_tbps(device, COPY_MIB[setup.device] << 20), 3),
    }
    result = header(setup, folder, tbps)
    try:
        result["pdserve"] = run_engine(folder, setup, tbps)
        if not args.no_transformers:
            result["transformers"] = run_transformers(folder, setup)
            result["transformers_time_over_pdserve"] = ratios(result)
    except NotEnoughMemory as exc:
        result["error"] = f"{exc}{f' ({exc.__cause__})' if exc.__cause__ else ''}"
    except Exception:
        result["error"] = traceback.format_exc()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
