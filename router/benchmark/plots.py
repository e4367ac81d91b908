"""PNG figures of a benchmark run (matplotlib, Agg backend): TTFT and ITL CDFs, latency over time, by tag."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pdserve.router.benchmark.metrics import RequestRecord  # noqa: E402

PLOT_FILES = ("ttft_cdf.png", "itl_cdf.png", "latency_over_time.png")


def _by_tag(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    tags: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.ok:
            tags.setdefault(r.tag, []).append(r)
    return dict(sorted(tags.items()))


def _cdf(values_ms: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    xs = np.sort(np.asarray(values_ms, dtype=np.float64))
    return xs, np.arange(1, xs.size + 1) / max(xs.size, 1)


def plot_cdf(series: dict[str, list[float]], xlabel: str, path: Path) -> None:
    """One step line per tag (values in ms)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for tag, values in series.items():
        if values:
            xs, ys = _cdf(values)
            ax.step(xs, ys, where="post", label=f"{tag} (n={len(values)})")
    ax.set(xlabel=xlabel, ylabel="fraction of samples", ylim=(0, 1.02))
    _save(fig, [ax], ax if series else None, path)


def plot_latency_over_time(groups: dict[str, list[RequestRecord]], path: Path) -> None:
    """Per-request TTFT (top) and E2EL (bottom) against send time, one colour per tag."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for i, (tag, recs) in enumerate(groups.items()):
        colour = f"C{i % 10}"
        starts = [r.send_time for r in recs]
        top.scatter(starts, [r.ttft * 1e3 for r in recs], s=8, color=colour, label=tag)
        bottom.scatter(starts, [r.e2el * 1e3 for r in recs], s=8, color=colour, label=tag)
    top.set(ylabel="TTFT (ms)")
    bottom.set(ylabel="E2EL (ms)", xlabel="send time (s since start)")
    _save(fig, [top, bottom], top if groups else None, path)


def _save(fig: Any, axes: Sequence[Any], legend_on: Any, path: Path) -> None:
    """Grid on every axis, a legend on legend_on (None: no legend), then write and close the figure."""
    for ax in axes:
        ax.grid(alpha=0.3)
    if legend_on is not None:
        legend_on.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(records: Sequence[RequestRecord], out_dir: str | Path) -> list[Path]:
    """Write PLOT_FILES into out_dir (created); their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _by_tag(records)
    paths = [out / name for name in PLOT_FILES]
    plot_cdf({t: [r.ttft * 1e3 for r in rs] for t, rs in groups.items()}, "TTFT (ms)", paths[0])
    plot_cdf({t: [g * 1e3 for r in rs for g in r.itls] for t, rs in groups.items()}, "ITL (ms)", paths[1])
    plot_latency_over_time(groups, paths[2])
    return paths
