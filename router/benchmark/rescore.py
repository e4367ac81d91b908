"""Score a finished goodput sweep again under other SLOs, from its per-rate JSONs (run with --save-detailed): the
load does not depend on the SLO, so one sweep per layout and workload serves every SLO.

    python -m pdserve.router.benchmark.rescore bench/out/long-input-1p1d.json --goodput ttft:2000 tpot:50 \\
        --out bench/out/long-input-1p1d-loose.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.router.benchmark.metrics import parse_goodput, record_from_json
from pdserve.router.benchmark.sweep import Window, format_summary, rate_result, summary
from pdserve.router.benchmark.sweep_run import rate_path


def rescore(
    summary_path: str | Path, slos: dict[str, float], scored: Mapping[float, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The sweep's summary document with every rate scored under `slos`; ValueError without saved requests.

    scored: runs already scored under these very SLOs, by rate, taken as they are for rates whose per-rate JSON
    is gone (an earlier session's rates, kept in its rescored summary)."""
    doc = json.loads(Path(summary_path).read_text())
    sweep_args, old = doc["config"]["sweep"], doc["sweep"]
    window = Window(float(sweep_args["warmup"]), float(sweep_args["duration"]))
    results = []
    for row in old["rates"]:
        rate = row["request_rate"]
        path = rate_path(summary_path, rate)
        if not path.exists():
            if scored is None or float(rate) not in scored:
                raise ValueError(f"{summary_path}: rate {rate:g} has neither its JSON ({path.name}) nor a scored run")
            results.append(scored[float(rate)])
            continue
        per_rate = json.loads(path.read_text())
        if "requests" not in per_rate:
            raise ValueError(f"{summary_path}: rerun the sweep with --save-detailed to rescore it")
        records = [record_from_json(r) for r in per_rate["requests"]]
        results.append(rate_result(rate, records, window, slos, old["num_gpus"]))
    new = summary(results, slos, old["num_gpus"], old["layout"], old["target_attainment"])
    return {"config": doc["config"] | {"rescored_from": str(summary_path)}, "sweep": new, "runs": results}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Score a goodput sweep under other SLOs.")
    p.add_argument("summary", help="the sweep's --result-json")
    p.add_argument("--goodput", nargs="+", required=True, metavar="KIND:MS")
    p.add_argument("--out", default=None, help="write the rescored summary here")
    args = p.parse_args(argv)
    doc = rescore(args.summary, parse_goodput(args.goodput))
    print(format_summary(doc["sweep"]))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
