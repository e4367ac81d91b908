"""The profile the planner reads (scripts/profile_layout.py writes it): a worker's prefill time vs prompt length
and decode step time vs batch and context, interpolated piecewise-linearly and extrapolated from the last two
points (a prompt or batch beyond the profile costs what the last segment's slope says). The top level holds a
one-GPU worker's costs (TP 1); the optional "tp" section the same costs of a worker of each larger TP size.

    {"version": 1, "gpu": "NVIDIA H100 80GB HBM3", "num_gpus": 2, "model": {...},
     "prefill": {"budget": 4096, "points": [{"tokens": 512, "ms": 31.0}, ...]},
     "decode": {"points": [{"batch": 1, "context": 512, "ms": 7.1}, ...]},   # a full batch x context grid
     "kv_capacity_tokens": 400000, "handoff": {"fixed_ms": 1.0, "ms_per_token": 0.0},
     "tp": {"2": {"prefill": {...}, "decode": {...}, "kv_capacity_tokens": 900000}}}   # optional
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1
ROLES = ("prefill", "decode")
"""The roles an "mps_slowdown" section measures (its other keys, such as the command, are not read)."""
TP_SECTION_KEYS = ("prefill", "decode", "kv_capacity_tokens")
"""What a "tp" section entry measures with a worker of its TP size; the rest (GPU, model, handoff, MPS slowdown)
comes from the top level."""


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through sorted xs; beyond either end, the nearest segment's line (>= 0)."""
    if len(xs) == 1:
        return float(ys[0])
    k = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class Profile:
    """Measured costs of one worker of tp_size GPUs (the top level: one GPU), and of the other TP sizes profiled."""

    gpu: str
    """The GPU's name (torch.cuda.get_device_name), or cpu."""
    num_gpus: int
    """GPUs the planner lays out by default."""
    prefill_tokens: tuple[int, ...]
    """Prompt lengths measured, ascending."""
    prefill_ms: tuple[float, ...]
    """Time to the first token of one prompt of each length, alone on the worker."""
    prefill_budget: int
    """Token budget of one prefill step (max_num_batched_tokens) the prompts were measured with."""
    decode_batches: tuple[int, ...]
    """Decode batch sizes measured, ascending."""
    decode_contexts: tuple[int, ...]
    """Context lengths (tokens per sequence) measured, ascending."""
    decode_ms: tuple[tuple[float, ...], ...]
    """[batch][context] time of one decode step."""
    kv_capacity_tokens: int | None = None
    """KV tokens one worker holds on its GPU; None: unlimited."""
    handoff_fixed_ms: float = 1.0
    """Prefill -> decode handoff of a request: fixed part (its messages)."""
    handoff_ms_per_token: float = 0.0
    """Handoff: part per prompt token, the decode GPU's copy of the KV (the request joins the batch after it:
    simulate.DecodeWorker)."""
    model: Mapping[str, Any] = field(default_factory=dict)
    """What was profiled (shape name, dtype, max_model_len, ...), for the report."""
    mps_slowdown: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    """Measured step-time factor of a role ("prefill", "decode") at an MPS SM share in percent, alone on the GPU;
    where missing, 1 / share (exact for compute-bound steps, pessimistic for memory-bound decode steps)."""
    mps_with_other: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    """The same factor while the other role runs on the rest of the GPU (its SMs and memory bandwidth busy);
    where measured, it stands for the role on a shared GPU."""
    chunk_points: tuple[tuple[int, int, float], ...] = ()
    """(tokens, prefix, ms): one pass of a `tokens`-token piece of a prompt whose first `prefix` tokens are cached
    (profile_layout.py --chunks, at TP 1; every chunk size has prefix 0); () when not profiled."""
    tp_size: int = 1
    """GPUs (TP ranks) of the worker these costs are of."""
    by_tp: Mapping[int, Profile] = field(default_factory=dict)
    """The top level's costs of a worker of each larger TP size profiled (each with tp_size set, by_tp empty)."""

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        """TP sizes whose costs this profile has, ascending."""
        return tuple(sorted({self.tp_size, *self.by_tp}))

    def at_tp(self, tp_size: int) -> Profile:
        """The costs of a worker of tp_size GPUs; ValueError when that size was not profiled."""
        if tp_size == self.tp_size:
            return self
        if tp_size not in self.by_tp:
            raise ValueError(
                f"the profile has no costs at TP {tp_size} (it has TP {', '.join(map(str, self.tp_sizes))}): "
                f"scripts/profile_layout.py --tp {tp_size} --out PROFILE adds them"
            )
        return self.by_tp[tp_size]

    def prefill_time(self, tokens: float) -> float:
        """ms of a prefill step of `tokens` tokens (whole prompts, or chunks of them)."""
        return interpolate(self.prefill_tokens, self.prefill_ms, tokens)

    def prefix_cost(self, tokens: int, prefix: int) -> float:
        """ms a pass of `tokens` prompt tokens costs beyond prefill_time(tokens) because the prompt's first `prefix`
        tokens are cached (its attention reads them too). From the chunk points: a chunk's time at this prefix less
        its time at prefix 0, interpolated in prefix, then in chunk size (0 at 0 tokens; sizes measured at prefix 0
        alone left out), over the TP size (the heads split evenly over the ranks). Without them, from whole prompts:
        prefill_time(prefix + tokens) less prefill_time(prefix) and prefill_time(tokens), which over a prompt's
        chunks adds up to its measured time."""
        if prefix <= 0 or tokens <= 0:
            return 0.0
        sizes = sorted({c for c, p, _ in self.chunk_points if p > 0})  # NOTE: a size at prefix 0 alone says nothing
        if not sizes:
            joint = self.prefill_time(prefix + tokens) - self.prefill_time(prefix)
            return max(0.0, joint - self.prefill_time(tokens))
        extra = [self._chunk_extra(c, prefix) for c in sizes]
        return interpolate([0, *sizes], [0.0, *extra], tokens) / self.tp_size

    def chunk_pass_extra(self, tokens: float) -> float:
        """ms a colocated pass of `tokens` tokens carrying a prompt chunk costs beyond prefill_time(tokens): the chunk
        points at prefix 0 (passes of an engine whose step budget is the chunk size, as a colocated worker's) less
        prefill_time at each size (>= 0), interpolated in tokens and held at the measured ends. 0 without chunk
        points, and at a TP size other than 1 (the chunk points are TP 1's, prefill_time this size's)."""
        if not self.chunk_points or self.tp_size != 1:
            return 0.0
        alone = sorted((c, max(0.0, ms - self.prefill_time(c))) for c, p, ms in self.chunk_points if p == 0)
        sizes = [c for c, _ in alone]
        return interpolate(sizes, [extra for _, extra in alone], min(max(tokens, sizes[0]), sizes[-1]))

    def _chunk_extra(self, tokens: int, prefix: int) -> float:
        points = sorted((p, ms) for c, p, ms in self.chunk_points if c == tokens)
        base = points[0][1]
        return interpolate([p for p, _ in points], [ms - base for _, ms in points], prefix)

    def decode_time(self, batch: float, context: float) -> float:
        """ms of one decode step of `batch` sequences of `context` tokens each (bilinear in the grid)."""
        per_context = [interpolate(self.decode_batches, col, batch) for col in zip(*self.decode_ms, strict=True)]
        return interpolate(self.decode_contexts, per_context, context)

    def slowdown(self, role: str, sm_share: float) -> float:
        """Factor on a role's step times when its worker runs on sm_share (0-1] of the GPU's SMs, the rest of it
        another role's worker: measured with that worker busy where the profile has it (its nearest shares
        between), else measured alone."""
        if sm_share >= 1.0:
            return 1.0
        busy = self.mps_with_other.get(role, {})
        if busy:  # NOTE: held at the nearest measured share beyond either end (no line through 100%: busy there too)
            shares = sorted(busy)
            share = min(max(sm_share, shares[0] / 100), shares[-1] / 100)
            return max(1.0, interpolate([s / 100 for s in shares], [busy[s] for s in shares], share))
        measured = self.mps_slowdown.get(role, {})
        if not measured:
            return 1.0 / sm_share
        shares = sorted(measured)
        return interpolate([s / 100 for s in shares] + [1.0], [measured[s] for s in shares] + [1.0], sm_share)

    def handoff_time(self, prompt_len: int) -> float:
        return self.handoff_fixed_ms + self.handoff_ms_per_token * prompt_len

    @classmethod
    def from_json(cls, data: Mapping[str, Any], tp_size: int = 1) -> Profile:
        """Parse the profile document (its "tp" section too); ValueError on a bad version or a decode grid with
        holes."""
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r}: this planner reads {PROFILE_VERSION}")
        by_tp = {int(size): cls.from_json(doc, int(size)) for size, doc in tp_documents(data).items()}
        pre = sorted((int(p["tokens"]), float(p["ms"])) for p in data["prefill"]["points"])
        grid = {(int(p["batch"]), int(p["context"])): float(p["ms"]) for p in data["decode"]["points"]}
        batches, contexts = sorted({b for b, _ in grid}), sorted({c for _, c in grid})
        if len(grid) != len(batches) * len(contexts):
            raise ValueError("profile decode points must cover every batch x context pair")
        handoff = data.get("handoff", {})
        return cls(
            gpu=str(data["gpu"]), num_gpus=int(data.get("num_gpus", 1)),
            prefill_tokens=tuple(t for t, _ in pre), prefill_ms=tuple(ms for _, ms in pre),
            prefill_budget=int(data["prefill"].get("budget", max(t for t, _ in pre))),
            decode_batches=tuple(batches), decode_contexts=tuple(contexts),
            decode_ms=tuple(tuple(grid[b, c] for c in contexts) for b in batches),
            kv_capacity_tokens=data.get("kv_capacity_tokens"),
            handoff_fixed_ms=float(handoff.get("fixed_ms", 1.0)),
            handoff_ms_per_token=float(handoff.get("ms_per_token", 0.0)),
            model=dict(data.get("model", {})),
            mps_slowdown=_by_role(data.get("mps_slowdown", {})),
            mps_with_other=_by_role(data.get("mps_slowdown", {}).get("with_other", {})),
            chunk_points=chunk_points(data.get("chunks", {}).get("points", [])),
            tp_size=tp_size, by_tp=by_tp,
        )  # fmt: skip

    @classmethod
    def read(cls, path: str | Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))

    def to_json(self) -> dict[str, Any]:
        """The document from_json reads."""
        decode = [
            {"batch": b, "context": c, "ms": self.decode_ms[i][j]}
            for i, b in enumerate(self.decode_batches)
            for j, c in enumerate(self.decode_contexts)
        ]
        return {
            "version": PROFILE_VERSION, "gpu": self.gpu, "num_gpus": self.num_gpus, "model": dict(self.model),
            "prefill": {"budget": self.prefill_budget,
                        "points": [{"tokens": t, "ms": ms} for t, ms in zip(self.prefill_tokens, self.prefill_ms,
                                                                             strict=True)]},
            "decode": {"points": decode},
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "handoff": {"fixed_ms": self.handoff_fixed_ms, "ms_per_token": self.handoff_ms_per_token},
            "mps_slowdown": {role: {str(k): v for k, v in by.items()} for role, by in self.mps_slowdown.items()}
            | ({"with_other": {role: {str(k): v for k, v in by.items()} for role, by in self.mps_with_other.items()}}
               if self.mps_with_other else {}),
            **({"chunks": {"points": [{"tokens": c, "prefix": p, "ms": ms} for c, p, ms in self.chunk_points]}}
               if self.chunk_points else {}),
        } | self._tp_json()  # fmt: skip

    def _tp_json(self) -> dict[str, Any]:
        if not self.by_tp:
            return {}
        return {"tp": {str(n): {k: p.to_json()[k] for k in TP_SECTION_KEYS} for n, p in sorted(self.by_tp.items())}}

    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens a second of full-budget steps (the prefill side's ceiling)."""
        return self.prefill_budget / self.prefill_time(self.prefill_budget) * 1e3

    def decode_tokens_per_s(self, batch: int, context: float) -> float:
        """Output tokens a second at this batch and context (the decode side's ceiling there)."""
        return batch / max(self.decode_time(batch, context), 1e-9) * 1e3


def _by_role(section: Mapping[str, Any]) -> dict[str, dict[int, float]]:
    """An MPS section's factors per role and share (its other keys, e.g. the command, left out)."""
    return {role: {int(k): float(v) for k, v in by.items()} for role, by in section.items() if role in ROLES}


def chunk_points(points: Sequence[Mapping[str, Any]]) -> tuple[tuple[int, int, float], ...]:
    """The "chunks" points, sorted; ValueError when a chunk size lacks its prefix-0 point."""
    out = tuple(sorted((int(p["tokens"]), int(p["prefix"]), float(p["ms"])) for p in points))
    if missing := {c for c, _, _ in out} - {c for c, p, _ in out if p == 0}:
        raise ValueError(f'profile "chunks": chunk sizes {sorted(missing)} have no point at prefix 0')
    return out


def tp_documents(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each "tp" section entry as a whole profile document: the top level with the entry's costs in place;
    ValueError on a TP size below 2 or an entry without prefill or decode points."""
    top = {k: v for k, v in data.items() if k not in (*TP_SECTION_KEYS, "tp")}
    out = {}
    for size, section in data.get("tp", {}).items():
        if int(size) < 2 or not {"prefill", "decode"} <= section.keys():
            raise ValueError(f'profile "tp" entry {size!r}: want a TP size > 1 with its own prefill and decode')
        out[size] = top | {k: section[k] for k in TP_SECTION_KEYS if k in section}
    return out
