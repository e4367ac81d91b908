"""The goodput table's files (bench_goodput.py): where a (layout, workload) pair keeps its rates, summaries and
rescored summaries, what is left to run, and table.json / table.md built from what --out holds."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.router.benchmark.sweep import DEFAULT_TARGET, summary
from pdserve.router.benchmark.sweep_plots import write_sweep_plots
from pdserve.router.plan.layouts import Layout

RATE_KEYS = ("request_rate", "num_requests", "num_good", "slo_attainment", "slo_attainment_by_kind", "goodput",
             "goodput_per_gpu", "request_throughput_per_gpu", "metrics")  # fmt: skip
"""A rate's figures (sweep.rate_result) in its JSON, beside its config, tags and records."""


def layout_tag(name: str) -> str:
    """A layout name as a folder name: 1P(tp2):1D(tp2)-shared -> 1P-tp2_1D-tp2-shared."""
    return name.replace(":", "_").replace("(", "-").replace(")", "")


def predicted(plan: dict[str, Any], layout: str) -> dict[str, Any]:
    return next(row for row in plan["layouts"] if row["layout"] == layout)  # type: ignore[no-any-return]


# --- files of a pair -------------------------------------------------------------------------------------------------


def pair_dir(out: Path, layout: str) -> Path:
    return out / "sweeps" / layout_tag(layout)


def summary_path(out: Path, layout: str, workload: str) -> Path:
    return pair_dir(out, layout) / f"{workload}.json"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def pair_done(out: Path, layout: str, workload: str) -> bool:
    doc = read_json(summary_path(out, layout, workload)) or {}
    return bool(doc.get("bench_goodput", {}).get("complete"))


def layout_error(out: Path, layout: str) -> str | None:
    return (read_json(pair_dir(out, layout) / "error.json") or {}).get("error")


def remaining_pairs(out: Path, layouts: Sequence[str], workloads: Sequence[str]) -> list[tuple[str, str]]:
    """(layout, workload) pairs not done, in table order, those of layouts that failed to run last."""
    pairs = [(layout, w) for layout in layouts for w in workloads if not pair_done(out, layout, w)]
    return sorted(pairs, key=lambda pair: layout_error(out, pair[0]) is not None)


def measured_rates(out: Path, layout: str, workload: str) -> dict[float, Path]:
    """The rates whose detailed JSON is in the pair's folder."""
    found = {}
    for path in pair_dir(out, layout).glob(f"{workload}.rate-*.json"):
        doc = read_json(path)
        if doc is not None and "requests" in doc:
            found[float(doc["request_rate"])] = path
    return found


def kept_runs(out: Path, layout: str, workload: str, tag: str) -> dict[float, dict[str, Any]]:
    """The runs an earlier call scored under SLO `tag` whose rates' detailed JSONs are not here (a device call
    carries --out without them; a later session has only what was committed): kept as they were scored."""
    here = measured_rates(out, layout, workload)
    doc = read_json(pair_dir(out, layout) / f"{workload}.{tag}.json") or {}
    return {float(r["request_rate"]): r for r in doc.get("runs", []) if float(r["request_rate"]) not in here}


def scored_rates(out: Path, layout: str, workload: str) -> set[float]:
    """The pair's rates measured so far: those whose detailed JSON is here and those its summary lists."""
    rows = ((read_json(summary_path(out, layout, workload)) or {}).get("sweep") or {}).get("rates", [])
    return set(measured_rates(out, layout, workload)) | {float(r["request_rate"]) for r in rows}


def merge_rates(
    out: Path, layout: Layout, workload: str, slo: dict[str, float], kept: dict[float, dict[str, Any]]
) -> dict[str, Any]:
    """The pair's summary (sweep_run.sweep_report's shape) from its rates' JSONs and the kept runs (kept_runs),
    scored under slo."""
    docs = [json.loads(p.read_text()) for _, p in sorted(measured_rates(out, layout.name, workload).items())]
    runs = sorted([{k: d[k] for k in RATE_KEYS} for d in docs] + list(kept.values()), key=lambda r: r["request_rate"])
    config = docs[0]["config"] if docs else read_json(summary_path(out, layout.name, workload))["config"]  # type: ignore[index]
    sweep = summary(runs, slo, layout.num_gpus, layout.name, DEFAULT_TARGET)
    return {"config": config, "sweep": sweep, "runs": runs}


# --- the table -------------------------------------------------------------------------------------------------------


def measured_cell(sweep: dict[str, Any], predicted_per_gpu: float) -> dict[str, Any]:
    """A layout's measured goodput per GPU from its rescored sweep: the interpolated knee / GPUs where measured
    rates lie on either side of it ("="), the highest rate where it met the SLO (">="), the lowest rate where no
    rate did ("<"); the planner's error where bracketed."""
    knee, rows, gpus = sweep["knee"], sweep["rates"], sweep["num_gpus"]
    if knee["rate"] is None:
        bound, per_gpu = "<", rows[0]["request_rate"] / gpus
    elif knee["rate"] == rows[-1]["request_rate"]:
        bound, per_gpu = ">=", knee["rate"] / gpus
    else:
        bound, per_gpu = "=", knee["interpolated"] / gpus
    error = (predicted_per_gpu - per_gpu) / per_gpu if bound == "=" and per_gpu > 0 else None
    return {"bound": bound, "goodput_per_gpu": per_gpu, "knee_rate": knee["rate"], "prediction_error": error,
            "rates": [[r["request_rate"], r["slo_attainment"]] for r in rows]}  # fmt: skip


def table_cell(out: Path, layout: Layout, workload: str, tag: str, plan: dict[str, Any]) -> dict[str, Any]:
    """One row of a workload x SLO table: the prediction, and the measurement or why there is none."""
    row = {"layout": layout.name, "kind": layout.kind, "predicted_goodput_per_gpu": predicted(plan, layout.name)
           ["goodput_per_gpu"]}  # fmt: skip
    doc = read_json(pair_dir(out, layout.name) / f"{workload}.{tag}.json")
    if doc is None:
        error = layout_error(out, layout.name)
        return row | {"status": f"failed: {error}" if error else "not run"}
    status = "done" if pair_done(out, layout.name, workload) else "partial"
    return row | {"status": status, "gpu": doc["bench_goodput"]["gpu"]} | measured_cell(doc["sweep"], row[
        "predicted_goodput_per_gpu"])  # fmt: skip


def rank(row: dict[str, Any], key: str) -> float:
    """The row's value of key; a "<" measurement (no rate met the SLO) ranks as 0."""
    return 0.0 if row.get("bound") == "<" else float(row[key])


def best(rows: list[dict[str, Any]], key: str, kind: str | None = None) -> dict[str, Any] | None:
    """The row of the highest key among those of kind that have one, or None."""
    return max((r for r in rows if r.get(key) is not None and kind in (None, r["kind"])),
               key=lambda r: rank(r, key), default=None)  # fmt: skip


def ratio(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The best disaggregated and best colocated row by key, and the ratio of their values."""
    col, dis = best(rows, key, "colocated"), best(rows, key, "disaggregated")
    top = rank(col, key) if col else 0.0
    return {"best_colocated": col and col["layout"], "best_disaggregated": dis and dis["layout"],
            "ratio": rank(dis, key) / top if dis and top > 0 else None}  # fmt: skip


def build_table(out: Path, layouts: list[Layout], ctx_plans: dict[str, dict[str, dict[str, Any]]],
                slos: dict[str, dict[str, float]], header: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """table.json: per workload x SLO, every layout's row, the planner's choice and the two ratios."""
    tables, commands = [], [inv["command"] for inv in (read_json(out / "run.json") or {}).get("invocations", [])]
    for workload, plans in ctx_plans.items():
        for tag, plan in plans.items():
            rows = [table_cell(out, layout, workload, tag, plan) for layout in layouts]
            chosen = plan["recommended"]
            tables.append({
                "workload": workload, "lengths": plan["workload"], "slo": tag, "slos_ms": slos[tag], "rows": rows,
                "recommended": chosen,
                "recommended_predicted_per_gpu": chosen and predicted(plan, chosen)["goodput_per_gpu"],
                "measured_best": (best(rows, "goodput_per_gpu") or {}).get("layout"),
                "measured": ratio(rows, "goodput_per_gpu"), "predicted": ratio(rows, "predicted_goodput_per_gpu"),
            })  # fmt: skip
            commands.append(plan["command"])
            for layout in layouts:
                doc = read_json(pair_dir(out, layout.name) / f"{workload}.{tag}.json") or {}
                commands += doc.get("bench_goodput", {}).get("commands", [])
    gpus = sorted({r["gpu"] for t in tables for r in t["rows"] if "gpu" in r})
    complete = all(r["status"] == "done" for t in tables for r in t["rows"])
    return {**header, "measured_on": gpus, "complete": complete, "tables": tables,
            "commands": list(dict.fromkeys(commands))}  # fmt: skip


def write_plots(out: Path, layouts: list[Layout], table: dict[str, Any]) -> list[Path]:
    """plots/WORKLOAD.SLO/: attainment and goodput per GPU vs rate, one line per layout measured ([] without
    matplotlib)."""
    paths = []
    for t in table["tables"]:
        docs = [read_json(pair_dir(out, layout.name) / f"{t['workload']}.{t['slo']}.json") for layout in layouts]
        sweeps = [doc["sweep"] for doc in docs if doc is not None]
        if sweeps:
            paths += write_sweep_plots(sweeps, out / "plots" / f"{t['workload']}.{t['slo']}", t["workload"])
    return paths


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def row_md(r: dict[str, Any]) -> str:
    predicted = fmt(r["predicted_goodput_per_gpu"])
    if "bound" not in r:
        return f"| {r['layout']} | {r['status']} | | {predicted} | | |"
    bound = "" if r["bound"] == "=" else r["bound"] + " "
    rates = ", ".join(f"{rate:g}: {a:.0%}" for rate, a in r["rates"]) + ("" if r["status"] == "done" else " (partial)")
    return (f"| {r['layout']} | {bound}{fmt(r['goodput_per_gpu'])} | {fmt(r['knee_rate'], 'g')} | {predicted} | "
            f"{fmt(r['prediction_error'], '+.0%')} | {rates} |")  # fmt: skip


TABLE_HEAD = ("| layout | measured req/s/GPU | highest rate met | predicted req/s/GPU | error | rate: attainment |",
              "|---|---|---|---|---|---|")  # fmt: skip
TABLE_NOTE = (
    "Goodput: the rate at which 90% of requests meet every SLO, interpolated between the measured rates, per GPU "
    "(>=: every rate measured met it; <: none did). Error: (predicted - measured) / measured. Under each table: its "
    "plots (attainment and goodput per GPU vs rate, one line per layout), and each measured row's sweep and its "
    "rescoring under the table's SLO."
)


def files_md(t: dict[str, Any]) -> list[str]:
    """The files of one table (workload and SLO): its plots, and the sweep and its rescoring of each measured row."""
    tag = f"{t['workload']}.{t['slo']}"
    plots = [f"plots/{tag}/{name}.png" for name in ("attainment_vs_rate", "goodput_per_gpu_vs_rate")]
    measured = [f"sweeps/{layout_tag(r['layout'])}/{t['workload']}" for r in t["rows"] if r.get("rates")]
    sweeps = [f"{pair}{suffix}.json" for pair in measured for suffix in ("", f".{t['slo']}")]
    return ["", "Files: " + ", ".join(f"`{f}`" for f in [*plots, *sweeps]) + "."]


def table_md(table: dict[str, Any]) -> str:
    """table.md: one table per workload and SLO, then every command."""
    settings = table["settings"]
    lines = [f"# Goodput per GPU on {table['num_gpus']} GPUs", "",
             f"Measured on {', '.join(table['measured_on']) or 'nothing yet'}; profile {table['profile']} "
             f"({table['profile_gpu']}); written on {table['gpu']} {table['date']}; complete: {table['complete']}. "
             f"Each rate: {settings['warmup_s']:g} s warm-up, {settings['duration_s']:g} s window.",
             "", TABLE_NOTE]  # fmt: skip
    for t in table["tables"]:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in t["slos_ms"].items())
        w = t["lengths"]
        lines += ["", f"## {t['workload']}, {slos}", "", f"Mean {w['mean_input_len']:.0f} in / "
                  f"{w['mean_output_len']:.0f} out (prompts cut to {w['max_model_len']} tokens with their output).",
                  "", *TABLE_HEAD, *(row_md(r) for r in t["rows"]), ""]  # fmt: skip
        m, p = t["measured"], t["predicted"]
        chosen = f"{t['recommended']} ({fmt(t['recommended_predicted_per_gpu'])}/GPU predicted)"
        lines.append(f"Planner recommends {chosen if t['recommended'] else 'none: no layout meets the SLO'}; "
                     f"measured best: {t['measured_best'] or 'not run'}.")  # fmt: skip
        lines.append(f"Best disaggregated / best colocated: measured {m['best_disaggregated']} / "
                     f"{m['best_colocated']} = {fmt(m['ratio'], '.2f')}; predicted {p['best_disaggregated']} / "
                     f"{p['best_colocated']} = {fmt(p['ratio'], '.2f')}.")  # fmt: skip
        lines += files_md(t)
    return "\n".join([*lines, "", "## Commands", "", "```", *table["commands"], "```", ""])
