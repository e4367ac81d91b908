"""A discrete-event simulation of one layout serving Poisson arrivals, step by step, with step times from the
profile (pdserve's engine runs one forward pass per step; this replays its scheduling on the profiled costs).
Every worker's step times, step budget and KV capacity are the profile's at its TP size (Profile.at_tp); the
handoff's are the top level's, whatever the TP sizes on either side.

- Prefill worker: FCFS; each step takes up to `budget` prompt tokens from the queue's head (a long prompt spans
  steps) and lasts prefill_time(tokens) plus each piece's prefix cost (profile.py prefix_cost: its attention over
  the prompt's earlier tokens), times its MPS slowdown (profile.slowdown). A prompt's last step gives its first
  token; the decode side gets it after the handoff's fixed part (its messages).
- Decode worker: continuous batching. A step runs every running sequence and lasts decode_time(batch, mean
  context) x slowdown; a waiting request joins at a step boundary while the batch is under max_num_seqs and its KV
  (prompt + output tokens) fits the worker's capacity; then its pull (the handoff's per-token part, the copy of
  its KV) runs beside the steps, after the pulls before it (one copy stream), holding its KV room, and it joins the
  batch at the first step boundary after the copy is done, as pdserve's decode worker starts an adopted request
  (decode_worker/worker.py).
- Colocated worker: each step runs the decodes plus up to `chunk - decodes` prompt tokens (chunked prefill,
  decodes first as pdserve's scheduler does); a mixed step lasts the decode step plus the chunk's marginal
  prefill cost, decode_time(B, ctx) + prefill_time(c + B) - prefill_time(B) (one forward pass reads the weights
  once for both), plus the chunk's prefix cost, plus what a pass carrying a chunk costs beyond a whole prompt's
  pass of as many tokens (profile.py chunk_pass_extra: the chunk points at prefix 0 were measured on an engine of
  the colocated worker's step budget; prefill_time on the prefill worker's).
Routing: prefill to the least queued tokens x slowdown, decode and colocated to the fewest requests x slowdown.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.router.plan.layouts import Layout, WorkerSlot
from pdserve.router.plan.profile import Profile

CONTEXT_BUCKET = 64
"""Decode step times are looked up per this many tokens of mean context (a cache key, not a model choice)."""


@dataclass(slots=True)
class SimRequest:
    """One request's life in the simulation (seconds)."""

    arrival: float
    prompt_len: int
    output_len: int
    first_token: float = math.nan
    done: float = math.nan
    step_ends: list[float] | None = None
    """The decoding worker's step end times (for ITL)."""
    first_step: int = -1
    """Index in step_ends of the step that made its second token."""

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.done - self.first_token) / (self.output_len - 1) if self.output_len > 1 else 0.0

    def itl_p99(self) -> float:
        """p99 of its gaps between tokens (0 with one token)."""
        if self.output_len <= 1 or self.step_ends is None:
            return 0.0
        times = np.asarray([self.first_token, *self.step_ends[self.first_step : self.first_step + self.output_len - 1]])
        return float(np.percentile(np.diff(times), 99))


class StepCost:
    """The profile's step times in seconds, memoized."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._decode: dict[tuple[int, int], float] = {}
        self._prefill: dict[int, float] = {}
        self._prefix: dict[tuple[int, int], float] = {}
        self._chunk_pass: dict[int, float] = {}
        self._by_tp: dict[int, StepCost] = {profile.tp_size: self}

    def at_tp(self, tp_size: int) -> StepCost:
        """The step times of a worker of tp_size GPUs (ValueError when the profile has none)."""
        if tp_size not in self._by_tp:
            self._by_tp[tp_size] = StepCost(self.profile.at_tp(tp_size))
        return self._by_tp[tp_size]

    def prefill(self, tokens: int) -> float:
        if tokens not in self._prefill:
            self._prefill[tokens] = self.profile.prefill_time(tokens) / 1e3
        return self._prefill[tokens]

    def prefix(self, tokens: int, prefix: int) -> float:
        """What a piece of `tokens` prompt tokens costs for the `prefix` tokens of its prompt before it (s)."""
        key = (tokens, prefix // CONTEXT_BUCKET)
        if key not in self._prefix:
            self._prefix[key] = self.profile.prefix_cost(tokens, key[1] * CONTEXT_BUCKET) / 1e3
        return self._prefix[key]

    def chunk_pass(self, tokens: int) -> float:
        """What a colocated pass of `tokens` tokens costs beyond prefill(tokens) for carrying a chunk (s)."""
        if tokens not in self._chunk_pass:
            self._chunk_pass[tokens] = self.profile.chunk_pass_extra(tokens) / 1e3
        return self._chunk_pass[tokens]

    def pull(self, prompt_len: int) -> float:
        """The decode GPU's copy of a handed-off prompt's KV (s): the handoff's per-token part."""
        return self.profile.handoff_ms_per_token * prompt_len / 1e3

    def decode(self, batch: int, context: float) -> float:
        key = (batch, int(context) // CONTEXT_BUCKET)
        if key not in self._decode:
            self._decode[key] = self.profile.decode_time(batch, (key[1] + 0.5) * CONTEXT_BUCKET) / 1e3
        return self._decode[key]

    def mixed(self, prefill_tokens: int, batch: int, context: float, prefix_cost: float) -> float:
        """A colocated step: prefill_tokens of prompts beside `batch` decodes (module docstring)."""
        if prefill_tokens == 0:
            return self.decode(batch, context)
        extra = self.chunk_pass(prefill_tokens + batch) + prefix_cost
        if batch == 0:
            return self.prefill(prefill_tokens) + extra
        chunk = max(0.0, self.prefill(prefill_tokens + batch) - self.prefill(batch))
        return self.decode(batch, context) + chunk + extra


class PrefillWorker:
    """FCFS steps of the profile's token budget; calls on_first_token(req) at the end of a prompt's last step."""

    def __init__(self, cost: StepCost, share: float, on_first_token: Callable[[SimRequest], None]):
        self.cost, self.budget, self.on_first_token = cost, cost.profile.prefill_budget, on_first_token
        self.slow = cost.profile.slowdown("prefill", share)
        self.queue: deque[list[Any]] = deque()  # [request, prompt tokens still to run]
        self.queued_tokens = 0
        self.now = 0.0

    def add(self, req: SimRequest, t: float) -> None:
        if not self.queue:
            self.now = max(self.now, t)
        self.queue.append([req, req.prompt_len])
        self.queued_tokens += req.prompt_len

    def advance_to(self, t: float) -> None:
        """Run every step that starts before t."""
        while self.queue and self.now < t:
            tokens, prefix_cost, finished = take_chunk(self.queue, self.budget, self.cost)
            self.now += (self.cost.prefill(tokens) + prefix_cost) * self.slow
            self.queued_tokens -= tokens
            for req in finished:
                self.queue.popleft()
                req.first_token = self.now
                self.on_first_token(req)


@dataclass
class BatchState:
    """A worker's running sequences: finish heap, context sum, KV in use, step clock."""

    heap: list[tuple[int, int, SimRequest]] = field(default_factory=list)
    """(step of its last token, order, request)."""
    num_running: int = 0
    context_sum: int = 0
    kv_used: int = 0
    step: int = 0
    step_ends: list[float] = field(default_factory=list)

    def admit(
        self, waiting: deque[SimRequest], num_admitted: int, max_num_seqs: int, kv_capacity: int
    ) -> SimRequest | None:
        """The head of waiting, popped with its KV (prompt + output) reserved, if it fits beside the running and
        num_admitted other admitted requests (the first always fits); else None."""
        if not waiting or self.num_running + num_admitted >= max_num_seqs:
            return None
        need = waiting[0].prompt_len + waiting[0].output_len
        if (self.num_running or num_admitted) and self.kv_used + need > kv_capacity:
            return None
        self.kv_used += need
        return waiting.popleft()

    def start(self, req: SimRequest, first_step: int) -> None:
        """req decodes from first_step on (its first token already out)."""
        req.step_ends, req.first_step = self.step_ends, first_step
        heapq.heappush(self.heap, (first_step + req.output_len - 2, id(req), req))
        self.num_running += 1
        self.context_sum += req.prompt_len + 1

    def end_step(self, now: float) -> None:
        """Every running sequence got a token at `now`; the finished leave."""
        self.step_ends.append(now)
        self.context_sum += self.num_running
        while self.heap and self.heap[0][0] == self.step:
            req = heapq.heappop(self.heap)[2]
            req.done = now
            self.num_running -= 1
            self.context_sum -= req.prompt_len + req.output_len
            self.kv_used -= req.prompt_len + req.output_len
        self.step += 1


class DecodeWorker:
    """Continuous batching of handed-off requests."""

    def __init__(self, cost: StepCost, share: float, max_num_seqs: int, kv_capacity: int | None):
        self.cost, self.max_num_seqs = cost, max_num_seqs
        self.slow = cost.profile.slowdown("decode", share)
        self.kv_capacity = kv_capacity or sys_maxsize()
        self.waiting: deque[SimRequest] = deque()
        self.batch = BatchState()
        self.now = 0.0
        self.copying: list[tuple[float, SimRequest]] = []
        """Admitted requests whose KV is being copied in, with the time the copy is done."""
        self.copies_done = 0.0
        """When the last copy issued is done (the next one starts after it)."""

    @property
    def load(self) -> float:
        return (self.batch.num_running + len(self.copying) + len(self.waiting)) * self.slow

    def add(self, req: SimRequest, t: float) -> None:
        if not self.batch.num_running and not self.waiting and not self.copying:
            self.now = max(self.now, t)
        self.waiting.append(req)

    def advance_to(self, t: float) -> None:
        batch = self.batch
        while (batch.num_running or self.waiting or self.copying) and self.now < t:
            self._admit()
            for copied in [c for c in self.copying if c[0] <= self.now]:
                self.copying.remove(copied)
                batch.start(copied[1], batch.step)
            if not batch.num_running:  # NOTE: idle until a copy is done (or t)
                self.now = min([t, *(done for done, _ in self.copying)])
                continue
            step = self.cost.decode(batch.num_running, batch.context_sum / batch.num_running) * self.slow
            self.now += step
            batch.end_step(self.now)

    def _admit(self) -> None:
        """Adopt waiting requests while there is room: their copies start now."""
        while (
            req := self.batch.admit(self.waiting, len(self.copying), self.max_num_seqs, self.kv_capacity)
        ) is not None:
            self.copies_done = max(self.now, self.copies_done) + self.cost.pull(req.prompt_len)
            self.copying.append((self.copies_done, req))


class ColocatedWorker:
    """Chunked prefill beside the decodes, in one engine."""

    def __init__(self, cost: StepCost, share: float, chunk: int, max_num_seqs: int, kv_capacity: int | None):
        self.cost, self.chunk, self.max_num_seqs = cost, chunk, max_num_seqs
        self.slow = cost.profile.slowdown("decode", share)
        self.kv_capacity = kv_capacity or sys_maxsize()
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: deque[list[Any]] = deque()  # [request, prompt tokens still to run]
        self.batch = BatchState()
        self.now = 0.0

    @property
    def load(self) -> float:
        return (self.batch.num_running + len(self.prefilling) + len(self.waiting)) * self.slow

    def add(self, req: SimRequest, t: float) -> None:
        if not (self.batch.num_running or self.prefilling or self.waiting):
            self.now = max(self.now, t)
        self.waiting.append(req)

    def _admit(self) -> None:
        while (
            req := self.batch.admit(self.waiting, len(self.prefilling), self.max_num_seqs, self.kv_capacity)
        ) is not None:
            self.prefilling.append([req, req.prompt_len])

    def advance_to(self, t: float) -> None:
        batch = self.batch
        while (batch.num_running or self.prefilling or self.waiting) and self.now < t:
            self._admit()
            tokens, prefix_cost, finished = take_chunk(
                self.prefilling, max(0, self.chunk - batch.num_running), self.cost
            )
            decodes = batch.num_running
            context = batch.context_sum / decodes if decodes else 0.0
            self.now += self.cost.mixed(tokens, decodes, context, prefix_cost) * self.slow
            batch.end_step(self.now)
            for req in finished:
                self.prefilling.popleft()
                req.first_token = self.now
                if req.output_len > 1:
                    batch.start(req, batch.step)
                else:
                    req.done = self.now
                    batch.kv_used -= req.prompt_len + req.output_len


def take_chunk(entries: deque[list[Any]], budget: int, cost: StepCost) -> tuple[int, float, list[SimRequest]]:
    """One step's prompt tokens, FCFS from entries ([request, prompt tokens still to run], decremented in place) up
    to budget: (tokens, what their prompts' earlier tokens add (StepCost.prefix), the requests whose prompt this step
    finishes, in order)."""
    tokens, prefix_cost, finished = 0, 0.0, []
    for entry in entries:
        if budget == 0:
            break
        n = min(entry[1], budget)
        prefix_cost += cost.prefix(n, entry[0].prompt_len - entry[1])
        entry[1] -= n
        budget, tokens = budget - n, tokens + n
        if entry[1] == 0:
            finished.append(entry[0])
    return tokens, prefix_cost, finished


def sys_maxsize() -> int:
    return 1 << 62


def kv_tokens(cost: StepCost, slot: WorkerSlot) -> int | None:
    """KV tokens the worker in slot holds: its TP size's capacity times its share of it."""
    capacity = cost.at_tp(slot.tp_size).profile.kv_capacity_tokens
    return None if capacity is None else int(capacity * slot.kv_share)


@dataclass(frozen=True)
class SimConfig:
    """Batching limits of the simulated workers."""

    max_num_seqs: int = 128
    """Sequences a decode (or colocated) worker runs at once."""


def make_requests(arrivals: np.ndarray, prompt_lens: np.ndarray, output_lens: np.ndarray) -> list[SimRequest]:
    return [SimRequest(float(t), int(i), int(o)) for t, i, o in zip(arrivals, prompt_lens, output_lens, strict=True)]


def _feed(workers: Sequence[Any], events: Sequence[tuple[float, SimRequest]], pick: Callable[[Any], float]) -> None:
    """Hand each (time, request) in time order to the worker with the least pick(worker), then drain them."""
    for t, req in events:
        for w in workers:
            w.advance_to(t)
        min(workers, key=pick).add(req, t)
    for w in workers:
        w.advance_to(math.inf)


def simulate(layout: Layout, cost: StepCost, requests: list[SimRequest], sim: SimConfig) -> list[SimRequest]:
    """Run the requests (arrival-ordered) through the layout; the same list, with their times filled in."""
    profile = cost.profile
    arrivals = [(r.arrival, r) for r in requests]
    if layout.kind == "colocated":
        assert layout.chunk is not None
        workers = [
            ColocatedWorker(cost.at_tp(s.tp_size), s.sm_share, layout.chunk, sim.max_num_seqs, kv_tokens(cost, s))
            for s in layout.decode
        ]
        _feed(workers, arrivals, lambda w: w.load)
        return requests
    handed: list[tuple[float, SimRequest]] = []

    def first_token(req: SimRequest) -> None:
        if req.output_len > 1:
            handed.append((req.first_token + profile.handoff_fixed_ms / 1e3, req))  # NOTE: the copy: DecodeWorker
        else:
            req.done = req.first_token

    prefill = [PrefillWorker(cost.at_tp(s.tp_size), s.sm_share, first_token) for s in layout.prefill]
    _feed(prefill, arrivals, lambda w: w.queued_tokens * w.slow)
    decode = [
        DecodeWorker(cost.at_tp(s.tp_size), s.sm_share, sim.max_num_seqs, kv_tokens(cost, s)) for s in layout.decode
    ]
    _feed(decode, sorted(handed, key=lambda e: e[0]), lambda w: w.load)
    return requests
