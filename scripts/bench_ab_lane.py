#!/usr/bin/env python3
"""One lane of a side-by-side A/B of two trees: the Llama-3-8B shape (dummy bf16 weights) as 1 prefill + 1 decode
worker on two GPUs of their own, bench_serving_suite's warm-up, then the goodput table's long-input workload at
each --rates rate (bench_serving_suite.run_bench: the report plus the decode worker's step intervals). The tree is
whatever `pdserve` is on PYTHONPATH (a tree's scripts/package_links.sh DIR, that DIR first); the lanes of the
trees run at once, each on its own GPUs and port, so they share the host:

    git archive BASE core kernels kvtransfer router prefill_worker decode_worker proto scripts/package_links.sh \
        | (mkdir -p build/ab-base && tar -x -C build/ab-base)                                  # here
    bash build/ab-base/scripts/package_links.sh /tmp/pkg-base; bash scripts/package_links.sh /tmp/pkg-new  # GPU host
    PYTHONPATH=/tmp/pkg-base:... python3 scripts/bench_ab_lane.py --label base --gpus 0,1 --port 50200 --out $OUT/base &
    PYTHONPATH=/tmp/pkg-new:... python3 scripts/bench_ab_lane.py --label new --gpus 2,3 --port 50300 --out $OUT/new

NOTE: NVLink multicast stays off in everything started here (bench_tp_serving.MULTICAST_OFF).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import bench_serving_suite as suite
from bench_tp_serving import MULTICAST_OFF
from make_bench_model import write_bench_model

import pdserve.core

LOAD = ["--dataset", "long-input", "--warmup", "10", "--duration", "20", "--drain-timeout", "30"]
LOAD += ["--goodput", "ttft:1000", "tpot:15", "--num-gpus", "2", "--client-processes", "4"]
"""The goodput table's long-input sweep at one rate (bench_goodput.py), scored under its tight TPOT SLO."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True)
    p.add_argument("--gpus", required=True, help="prefill GPU, decode GPU")
    p.add_argument("--port", type=int, required=True, help="gRPC port (HTTP on the next)")
    p.add_argument("--rates", default="4.21,6.73")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ.update(MULTICAST_OFF)
    suite.PORT, suite.HTTP_PORT = args.port, args.port + 1
    out = Path(args.out)
    prefill_gpu, decode_gpu = args.gpus.split(",")
    model = write_bench_model("llama-8b", Path(os.environ.get("TMPDIR", "/tmp")) / f"ab-model-{args.label}")
    flags = ["--dtype", "bfloat16", "--load-format", "dummy", "--max-num-seqs", "128", "--metrics-port", "0"]
    flags += ["--prefill", "1", "--decode", "1", "--prefill-gpus", prefill_gpu, "--decode-gpus", decode_gpu]
    loads = [(f"long-input-{rate}", [*LOAD, "--request-rate", rate]) for rate in args.rates.split(",")]
    suite.with_cluster(model, out, args.label, flags, loads)
    tree = Path(pdserve.core.__file__).resolve().parents[1]
    meta = {"label": args.label, "pdserve": str(tree), "argv": sys.argv, "gpu": suite.gpu_name()}
    (out / "lane.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
