"""`pdserve-plan`: predict each layout's goodput per GPU for a workload and SLO from a GPU profile, recommend one.

    pdserve-plan --profile bench/results/profile-h100.json --workload long-input --slo ttft:1000,tpot:15 [--gpus 2]
    pdserve-plan --profile P.json --workload jsonl --dataset-path lengths.jsonl --slo ttft:2000,tpot:50 --json
    pdserve-plan ... --launch-flags     # the recommended layout's pdserve-cluster flags, one a line

The model (docs/planner.md): a discrete-event simulation of each layout on the profiled step times
(simulate.py), bisected for the highest Poisson rate at which 90% of requests meet every SLO (search.py). The
layouts with tensor-parallel workers (layouts.py) join the comparison for each TP size the profile has.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from pdserve.router.benchmark.lengths import WORKLOADS, workload_named
from pdserve.router.plan.layouts import DEFAULT_CHUNKS, layouts_for
from pdserve.router.plan.profile import Profile
from pdserve.router.plan.search import SLO_KINDS, LayoutResult, PlanConfig, Trace, find_goodput
from pdserve.router.plan.simulate import SimConfig, StepCost

BREAKS = {
    "ttft": "TTFT breaks first: prompts wait for prefill ({where})",
    "tpot": "TPOT breaks first: decode steps grow too long ({where})",
    "itl_p99": "ITL p99 breaks first: single steps stall decodes ({where})",
    "e2el": "E2E latency breaks first ({where})",
}
WHERE = {
    ("colocated", "ttft"): "behind decodes and other prompts' chunks",
    ("colocated", "tpot"): "prefill chunks ride in decode steps",
    ("colocated", "itl_p99"): "a prefill chunk stretches the step it rides in",
    ("disaggregated", "ttft"): "the prefill workers are saturated",
    ("disaggregated", "tpot"): "the decode batch this rate implies",
    ("disaggregated", "itl_p99"): "the decode batch this rate implies",
}


def parse_slo(text: str) -> dict[str, float]:
    """Parse "ttft:1000,tpot:15" into {"ttft": 1000.0, "tpot": 15.0} (ms); kinds as bench-serving's --goodput."""
    slos = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        kind, _, ms = item.partition(":")
        if kind not in SLO_KINDS or not ms:
            raise ValueError(f"bad SLO {item!r}: want KIND:MS with KIND in {SLO_KINDS}")
        slos[kind] = float(ms)
    if not slos:
        raise ValueError("no SLO given")
    return slos


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve-plan", description="Pick the prefill:decode layout for a workload/SLO.")
    p.add_argument("--profile", required=True, help="profile JSON (scripts/profile_layout.py)")
    p.add_argument("--workload", required=True, help=f"one of {', '.join(WORKLOADS)}, or jsonl (--dataset-path)")
    p.add_argument("--dataset-path", default=None, help="jsonl: one {input_len, output_len} a line")
    p.add_argument("--slo", required=True, help="e.g. ttft:1000,tpot:15 (ms; also itl_p99, e2el)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to lay out (default: the profile's)")
    p.add_argument("--chunks", default=",".join(map(str, DEFAULT_CHUNKS)), help="colocated prefill chunk sizes")
    p.add_argument("--mps-split", default="50/50", help="SM percent prefill/decode on a shared GPU")
    p.add_argument("--max-num-seqs", type=int, default=128, help="sequences a decode worker runs at once")
    p.add_argument("--max-model-len", type=int, default=None, help="cut prompts to fit (default: the profile's)")
    p.add_argument("--target", type=float, default=0.9, help="attainment the goodput rate must reach")
    p.add_argument("--warmup-s", type=float, default=10.0, help="simulated seconds of arrivals before the window")
    p.add_argument("--duration-s", type=float, default=20.0, help="simulated window whose arrivals are scored")
    p.add_argument("--seed", type=int, default=0)
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--launch-flags", action="store_true", help="print the recommended pdserve-cluster flags")
    return p


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Every layout's prediction, the recommendation and the reasoning, as the --json document."""
    profile = Profile.read(args.profile)
    slos = parse_slo(args.slo)
    sampler = workload_named(args.workload, args.dataset_path)
    num_gpus = args.gpus or profile.num_gpus
    split = tuple(int(x) for x in args.mps_split.split("/"))
    config = PlanConfig(args.warmup_s, args.duration_s, target=args.target, seed=args.seed,
                        sim=SimConfig(args.max_num_seqs))  # fmt: skip
    max_len = args.max_model_len or profile.model.get("max_model_len")
    trace = Trace(sampler, config.seed, max_len)
    cost = StepCost(profile)
    chunks = tuple(int(c) for c in args.chunks.split(","))
    layouts = layouts_for(num_gpus, chunks, (split[0], split[1]), profile.tp_sizes)
    results = [find_goodput(layout, cost, trace, slos, config) for layout in layouts]
    rows = [result_json(r, args.max_num_seqs) for r in results]
    best = max(results, key=lambda r: (r.goodput_per_gpu, r.layout.kind == "colocated"))
    colocated = max((r for r in results if r.layout.kind == "colocated"), key=lambda r: r.goodput_per_gpu)
    ratio = best.goodput_per_gpu / colocated.goodput_per_gpu if colocated.goodput_per_gpu > 0 else None
    return {
        "profile": {"path": args.profile, "gpu": profile.gpu, "model": dict(profile.model),
                    "tp_sizes": list(profile.tp_sizes)},
        "num_gpus": num_gpus,
        "workload": {"name": sampler.name, "source": sampler.source, "mean_input_len": trace.mean_input_len,
                     "mean_output_len": trace.mean_output_len, "max_model_len": max_len},
        "slos_ms": slos,
        "target_attainment": config.target,
        "window_s": {"warmup": config.warmup_s, "duration": config.duration_s},
        "layouts": rows,
        "recommended": best.layout.name if best.goodput > 0 else None,
        "best_colocated": colocated.layout.name,
        "ratio_to_best_colocated": ratio,
        "cluster_flags": best.layout.cluster_flags(args.max_num_seqs) if best.goodput > 0 else None,
    }  # fmt: skip


def result_json(result: LayoutResult, max_num_seqs: int) -> dict[str, Any]:
    layout, knee = result.layout, result.at_knee
    breaks = result.breaks_first
    why = BREAKS[breaks].format(where=WHERE.get((layout.kind, breaks), "")) if breaks else ""
    if result.goodput == 0 and result.over is not None:
        why = f"misses the SLO even at a trickle ({result.over.attainment:.0%} attain it): " + why
    return {
        "layout": layout.name,
        "kind": layout.kind,
        "num_gpus": layout.num_gpus,
        "tp": {"prefill": layout.prefill_tp if layout.prefill else None, "decode": layout.decode_tp},
        "goodput": result.goodput,
        "goodput_per_gpu": result.goodput_per_gpu,
        "p90_ttft_ms": knee.p90_ttft_ms if knee else None,
        "p90_tpot_ms": knee.p90_tpot_ms if knee else None,
        "breaks_first": breaks,
        "why": why,
        "cluster_flags": layout.cluster_flags(max_num_seqs),
    }


def format_plan(doc: dict[str, Any]) -> str:
    """The table, the recommendation and its reasoning."""
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in doc["slos_ms"].items())
    w = doc["workload"]
    width = max(16, *(len(r["layout"]) for r in doc["layouts"]))
    lines = [
        f"{doc['profile']['gpu']} x {doc['num_gpus']}, workload {w['name']} (mean {w['mean_input_len']:.0f} in / "
        f"{w['mean_output_len']:.0f} out), {slos}, {doc['target_attainment']:.0%} attainment",
        f"{'layout':<{width}} {'req/s':>8} {'/GPU':>8} {'p90 TTFT':>9} {'p90 TPOT':>9}  why it stops there",
    ]
    for r in doc["layouts"]:
        ttft = f"{r['p90_ttft_ms']:9.0f}" if r["p90_ttft_ms"] is not None else f"{'-':>9}"
        tpot = f"{r['p90_tpot_ms']:9.1f}" if r["p90_tpot_ms"] is not None else f"{'-':>9}"
        lines.append(
            f"{r['layout']:<{width}} {r['goodput']:8.2f} {r['goodput_per_gpu']:8.2f} {ttft} {tpot}  {r['why']}"
        )
    if doc["recommended"] is None:
        lines.append("recommended: none: no layout meets the SLO at any rate (loosen it, or see why above)")
        return "\n".join(lines)
    ratio = doc["ratio_to_best_colocated"]
    vs = f"{ratio:.2f}x the best colocated ({doc['best_colocated']})" if ratio else "colocated meets no rate"
    lines.append(f"recommended: {doc['recommended']} ({vs})")
    lines.append("start it: scripts/launch_cluster.sh " + " ".join(doc["cluster_flags"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        doc = plan(args)
    except (ValueError, OSError, KeyError) as exc:
        parser.error(str(exc))
    if args.launch_flags:
        if doc["cluster_flags"] is None:
            print("pdserve-plan: no layout meets the SLO at any rate", file=sys.stderr)
            return 1
        print("\n".join(doc["cluster_flags"]))
    elif args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(format_plan(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
