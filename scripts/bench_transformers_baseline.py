#!/usr/bin/env python3
"""The serving benchmark's datasets run through Hugging Face transformers `generate`, in static batches.

Every request arrives at t=0; batches of --batch-size run in order (left padded, greedy, exactly the batch's
longest output length). A LogitsProcessor timestamps every generation step, so a request's first token is its
batch's first step and its token times are the batch's steps up to its own output length. Same metrics
(router.benchmark.metrics) and the same JSON shape as pdserve-bench-serving.

    python scripts/bench_transformers_baseline.py --model models/smollm2 --device cuda --dtype bfloat16 \\
        --dataset shared-prefix --num-prompts 256 --batch-size 32 --result-json bench/results/hf_intent.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from pdserve.router.benchmark import datasets as ds
from pdserve.router.benchmark.cli import add_dataset_args, build_specs, print_report, run_config_json, write_json
from pdserve.router.benchmark.metrics import RequestRecord, build_report, parse_goodput, parse_percentiles
from pdserve.router.model_info import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StepTimer(LogitsProcessor):
    """Records perf_counter() at every generation step (after a CUDA sync); scores pass through unchanged."""

    def __init__(self, sync_cuda: bool) -> None:
        self.sync_cuda = sync_cuda
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.sync_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="transformers generate on the serving benchmark's datasets")
    p.add_argument("--model", required=True, help="model folder (config.json; weights unless --dummy)")
    p.add_argument("--dummy", action="store_true", help="random weights from the config (seeded by --seed)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    add_dataset_args(p)
    p.set_defaults(request_rate=float("inf"), burstiness=1.0)  # NOTE: every request arrives at t=0
    p.add_argument("--no-warmup", action="store_true", help="skip the 2-token warmup generate")
    p.add_argument("--percentiles", default="50,90,95,99")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KIND:MS")
    p.add_argument("--result-json", default=None)
    p.add_argument("--save-detailed", action="store_true")
    p.add_argument("--plot", default=None, metavar="DIR")
    args = p.parse_args(argv)
    if args.output_len is None:
        args.output_len = "30" if args.dataset == "shared-prefix" else "128"
    return args


def load_model(args: argparse.Namespace) -> PreTrainedModel:
    dtype = DTYPES[args.dtype]
    if args.dummy:
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model.to(args.device).eval()


def left_padded(batch: Sequence[ds.RequestSpec], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask, both [batch, longest prompt], padding on the left."""
    width = max(s.prompt_len for s in batch)
    ids = [[pad_id] * (width - s.prompt_len) + list(s.prompt_ids) for s in batch]
    mask = [[0] * (width - s.prompt_len) + [1] * s.prompt_len for s in batch]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def generate_steps(
    model: PreTrainedModel, batch: Sequence[ds.RequestSpec], new_tokens: int, pad_id: int
) -> list[float]:
    """Run one static batch greedily for exactly new_tokens steps; the perf_counter() time of each step."""
    ids, mask = left_padded(batch, pad_id, str(model.device))
    timer = StepTimer(sync_cuda=model.device.type == "cuda")
    with torch.no_grad():
        model.generate(  # type: ignore[operator]
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            pad_token_id=pad_id, logits_processor=LogitsProcessorList([timer]),
        )  # fmt: skip
    return timer.times


def run_batches(
    model: PreTrainedModel, specs: Sequence[ds.RequestSpec], batch_size: int, pad_id: int
) -> list[RequestRecord]:
    """Every request sent at t=0; batches in order; one record per request."""
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    for start in range(0, len(specs), batch_size):
        batch = specs[start : start + batch_size]
        steps = [t - t0 for t in generate_steps(model, batch, max(s.output_len for s in batch), pad_id)]
        for i, spec in enumerate(batch, start):
            times = tuple(steps[: spec.output_len])
            records.append(
                RequestRecord(i, spec.tag, 0.0, times[-1], times, (1,) * len(times), spec.prompt_len, 0,
                              spec.output_len, "length")
            )  # fmt: skip
    return records


def model_json(spec: ModelSpec) -> dict[str, Any]:
    """The "model" section of the config, as pdserve-bench-serving writes it from GetModelInfo."""
    names = ("model_name", "vocab_size", "max_model_len", "block_size", "eos_token_ids")
    return dict(
        zip(names, (spec.name, spec.vocab_size, spec.max_model_len, None, list(spec.eos_token_ids)), strict=True)
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    spec = ModelSpec.from_dir(args.model)
    specs = build_specs(args, ds.VocabInfo(spec.vocab_size, spec.eos_token_ids))
    model = load_model(args)
    pad_id = spec.eos_token_ids[0] if spec.eos_token_ids else 0
    if not args.no_warmup:
        generate_steps(model, specs[: args.batch_size], 2, pad_id)
    records = run_batches(model, specs, args.batch_size, pad_id)
    config = run_config_json(args, argv, "transformers", model_json(spec))
    config.update(batch_size=args.batch_size, device=args.device, dtype=args.dtype, dummy=args.dummy)
    percentiles = parse_percentiles(args.percentiles)
    report = build_report(config, records, percentiles, parse_goodput(args.goodput), args.save_detailed)
    print_report(report, percentiles)
    if args.result_json:
        write_json(report, args.result_json)
    if args.plot:
        from pdserve.router.benchmark.plots import write_plots

        write_plots(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
