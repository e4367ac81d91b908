"""Goodput sweep figures from one or more sweep summaries, one line per layout: SLO attainment vs request rate
(with the target) and goodput per GPU vs request rate. matplotlib is optional (the `bench` extra): without it
nothing is drawn and a line says so."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SWEEP_PLOT_FILES = ("attainment_vs_rate.png", "goodput_per_gpu_vs_rate.png")


def load_sweeps(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The "sweep" section of each summary JSON, its layout label defaulting to the file's stem."""
    sweeps = []
    for path in paths:
        sweep = dict(json.loads(Path(path).read_text())["sweep"])
        sweep["layout"] = sweep.get("layout") or Path(path).stem
        sweeps.append(sweep)
    return sweeps


def _series(sweep: Mapping[str, Any], key: str) -> tuple[list[float], list[float]]:
    rows = sorted(sweep["rates"], key=lambda r: r["request_rate"])
    return [r["request_rate"] for r in rows], [r[key] for r in rows]


def write_sweep_plots(sweeps: Sequence[Mapping[str, Any]], out_dir: str | Path, what: str = "") -> list[Path]:
    """SWEEP_PLOT_FILES into out_dir (created), titled `what` and the SLOs; their paths, or [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sweep plots skipped: matplotlib is not installed (pip install 'pdserve[bench]')", file=sys.stderr)
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in SWEEP_PLOT_FILES]
    specs = (("slo_attainment", "SLO attainment"), ("goodput_per_gpu", "goodput per GPU (req/s)"))
    for path, (key, ylabel) in zip(paths, specs, strict=True):
        fig, ax = plt.subplots(figsize=(6, 4))
        for sweep in sweeps:
            xs, ys = _series(sweep, key)
            ax.plot(xs, ys, marker="o", label=f"{sweep['layout']} ({sweep['num_gpus']} GPU)")
        if key == "slo_attainment" and sweeps:
            ax.axhline(sweeps[0]["target_attainment"], color="grey", linestyle="--", linewidth=1)
            ax.set_ylim(0, 1.02)
        slos = ", ".join(f"{k} {v:g} ms" for k, v in (sweeps[0]["slos_ms"] if sweeps else {}).items())
        ax.set(xlabel="request rate (req/s)", ylabel=ylabel, title=", ".join(filter(None, (what, slos))) or None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return paths
