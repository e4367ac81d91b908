"""Serving metrics with vLLM's names and definitions (`vllm/benchmarks/serve.py`), from plain per-request records.

TTFT = first response - send; E2EL = last response - send; TPOT = (E2EL - TTFT) / (output_tokens - 1) for requests
with more than one output token; ITL = gaps between consecutive responses of a request, pooled over requests.
Failed requests are counted and left out of every latency and token figure.

Beyond vLLM's: `ttft_outside` = TTFT minus the server's own arrival -> first token (timings.first_token_ms, the
router's handler start to the token leaving the prefill worker), i.e. the gRPC call's way in plus the first token's
way back through the router to the client: where a front end that falls behind shows (requests without server
timings are left out).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SLO_KINDS = ("ttft", "tpot", "e2el", "itl_p99")
LATENCIES = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


@dataclass(frozen=True)
class RequestRecord:
    """What one request did; times are seconds since the benchmark started."""

    index: int
    """Position in the workload (closed-loop requests follow the open-loop ones)."""
    tag: str
    """The spec's tag."""
    send_time: float
    """When the request was sent."""
    end_time: float
    """When its stream ended (last response, or the error)."""
    response_times: tuple[float, ...] = ()
    """Arrival time of each response."""
    response_tokens: tuple[int, ...] = ()
    """Token ids in each response."""
    input_tokens: int = 0
    """usage.prompt_tokens."""
    cached_tokens: int = 0
    """usage.cached_prompt_tokens."""
    expected_output_len: int = 0
    """max_tokens asked for."""
    finish_reason: str = ""
    """stop / length / abort, from the last response."""
    error: str | None = None
    """None when the request succeeded, else "CODE: details"."""
    server_timings: dict[str, float] = field(default_factory=dict)
    """The last response's timings (ms)."""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.response_times)

    @property
    def output_tokens(self) -> int:
        return sum(self.response_tokens)

    @property
    def ttft(self) -> float:
        return self.response_times[0] - self.send_time

    @property
    def e2el(self) -> float:
        return self.response_times[-1] - self.send_time

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    @property
    def ttft_outside(self) -> float | None:
        """TTFT minus the server's arrival -> first token (seconds); None without server timings."""
        server_ms = self.server_timings.get("first_token_ms", 0.0)
        return self.ttft - server_ms / 1e3 if server_ms > 0 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.response_times, self.response_times[1:], strict=False)]


def parse_percentiles(text: str) -> list[float]:
    """Parse "50,90,95,99" into [50.0, 90.0, 95.0, 99.0]."""
    values = [float(p) for p in text.split(",") if p.strip()]
    if not all(0 <= p <= 100 for p in values):
        raise ValueError(f"percentiles must be in [0, 100]: {text!r}")
    return values


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "e2el:2000"] -> {"ttft": 500.0, "e2el": 2000.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        kind, _, ms = item.partition(":")
        if kind not in SLO_KINDS or not ms:
            raise ValueError(f"bad goodput SLO {item!r}: want KIND:MS with KIND in {SLO_KINDS}")
        slos[kind] = float(ms)
    return slos


def percentile_name(p: float) -> str:
    """vLLM's spelling: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def summarize(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pNN of values (seconds) in ms, keyed as vLLM: mean_ttft_ms, p99_ttft_ms, ...; 0 when empty."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = ms.size == 0
    out = {
        f"mean_{name}_ms": 0.0 if empty else float(np.mean(ms)),
        f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
        f"std_{name}_ms": 0.0 if empty else float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{percentile_name(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def slo_value(record: RequestRecord, kind: str) -> float:
    """The request's figure (seconds) an SLO of `kind` bounds; itl_p99 is the p99 of its own ITLs (0 without)."""
    if kind == "ttft":
        return record.ttft
    if kind == "tpot":
        return record.tpot or 0.0
    if kind == "e2el":
        return record.e2el
    itls = record.itls
    return float(np.percentile(itls, 99)) if itls else 0.0


def meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Every given SLO (ms) holds (vLLM's --goodput); a request with one output token has TPOT 0 (as vLLM)."""
    return all(slo_value(record, kind) * 1000.0 <= limit for kind, limit in slos.items())


def benchmark_duration(records: Sequence[RequestRecord]) -> float:
    """First send to the last stream end (seconds)."""
    if not records:
        return 0.0
    return max(r.end_time for r in records) - min(r.send_time for r in records)


def compute_metrics(
    records: Sequence[RequestRecord],
    percentiles: Sequence[float] = (50, 90, 95, 99),
    slos: Mapping[str, float] | None = None,
    duration: float | None = None,
) -> dict[str, Any]:
    """vLLM's result metrics; duration defaults to benchmark_duration(records)."""
    done = [r for r in records if r.ok]
    duration = benchmark_duration(records) if duration is None else duration
    per_s = 1.0 / duration if duration > 0 else 0.0
    total_in, total_out = sum(r.input_tokens for r in done), sum(r.output_tokens for r in done)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) * per_s,
        "request_goodput": sum(meets_slos(r, slos) for r in done) * per_s if slos else None,
        "output_throughput": total_out * per_s,
        "total_token_throughput": (total_in + total_out) * per_s,
    }
    out.update(summarize("ttft", [r.ttft for r in done], percentiles))
    out.update(summarize("tpot", [t for r in done if (t := r.tpot) is not None], percentiles))
    out.update(summarize("itl", [g for r in done for g in r.itls], percentiles))
    out.update(summarize("e2el", [r.e2el for r in done], percentiles))
    out.update(summarize("ttft_outside", [t for r in done if (t := r.ttft_outside) is not None], percentiles))
    return out


def metrics_by_tag(
    records: Sequence[RequestRecord], percentiles: Sequence[float], slos: Mapping[str, float] | None = None
) -> dict[str, dict[str, Any]]:
    """compute_metrics per tag; NOTE: throughputs use the whole run's duration, so they add up to the overall."""
    duration = benchmark_duration(records)
    tags = sorted({r.tag for r in records})
    return {t: compute_metrics([r for r in records if r.tag == t], percentiles, slos, duration) for t in tags}


def record_json(record: RequestRecord) -> dict[str, Any]:
    """One request for --save-detailed: the record plus its derived latencies (ms)."""
    out = asdict(record)
    out.update(ok=record.ok, output_tokens=record.output_tokens)
    if record.ok:
        tpot = record.tpot
        out.update(ttft_ms=record.ttft * 1e3, e2el_ms=record.e2el * 1e3, tpot_ms=None if tpot is None else tpot * 1e3)
    return out


def record_from_json(data: Mapping[str, Any]) -> RequestRecord:
    """The inverse of record_json (to re-plot a saved --save-detailed run)."""
    names = RequestRecord.__dataclass_fields__
    fields = {k: v for k, v in data.items() if k in names}
    fields["response_times"] = tuple(fields.get("response_times", ()))
    fields["response_tokens"] = tuple(fields.get("response_tokens", ()))
    return RequestRecord(**fields)


def build_report(
    config: Mapping[str, Any],
    records: Sequence[RequestRecord],
    percentiles: Sequence[float],
    slos: Mapping[str, float] | None,
    detailed: bool,
) -> dict[str, Any]:
    """The --result-json document: config, metrics, metrics_by_tag and (detailed) requests."""
    report: dict[str, Any] = {
        "config": dict(config),
        "metrics": compute_metrics(records, percentiles, slos),
        "metrics_by_tag": metrics_by_tag(records, percentiles, slos),
    }
    if detailed:
        report["requests"] = [record_json(r) for r in records]
    return report


def _line(label: str, value: Any) -> str:
    return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}"


def format_table(
    metrics: Mapping[str, Any], percentiles: Sequence[float], title: str = "Serving Benchmark Result"
) -> str:
    """A result table laid out like vLLM's benchmark_serving."""
    lines = [f"{' ' + title + ' ':=^50}"]
    lines += [
        _line("Successful requests:", metrics["completed"]),
        _line("Failed requests:", metrics["failed"]),
        _line("Benchmark duration (s):", metrics["duration"]),
        _line("Total input tokens:", metrics["total_input_tokens"]),
        _line("Total generated tokens:", metrics["total_output_tokens"]),
        _line("Request throughput (req/s):", metrics["request_throughput"]),
    ]
    if metrics.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", metrics["request_goodput"]))
    lines += [
        _line("Output token throughput (tok/s):", metrics["output_throughput"]),
        _line("Total Token throughput (tok/s):", metrics["total_token_throughput"]),
    ]
    for name, header, short in LATENCIES:
        lines.append(f"{header:-^50}")
        lines += [_line(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"])]
        lines += [_line(f"Median {short} (ms):", metrics[f"median_{name}_ms"])]
        for p in percentiles:
            pn = percentile_name(p)
            lines.append(_line(f"P{pn} {short} (ms):", metrics[f"p{pn}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
