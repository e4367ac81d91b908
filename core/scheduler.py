"""Continuous batching: which requests run in the next forward pass and with how many tokens."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.core.config import SchedulerConfig
from pdserve.core.kv_cache_manager import BlockCopy, CachedLogits, KVCacheManager
from pdserve.core.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    """num_tokens of req, starting at req.num_computed_tokens, run in this pass."""

    req: Request
    num_tokens: int
    samples: bool = field(init=False)
    """The chunk reaches the last token, so its logits give the next token (as scheduled)."""

    def __post_init__(self) -> None:
        self.samples = self.req.num_computed_tokens + self.num_tokens == len(self.req.token_ids)


@dataclass
class StepPlan:
    """What one engine step does."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    """Token ranges for the forward pass (empty: no forward pass)."""
    cached_hits: list[tuple[Request, CachedLogits]] = field(default_factory=list)
    """Whole-prompt hits: the first token comes from these cached last_logits entries."""
    copies: list[BlockCopy] = field(default_factory=list)
    """Copy-on-write block copies to run before the forward pass."""
    preempted: list[Request] = field(default_factory=list)
    """Requests sent back to waiting (their blocks freed; they recompute later)."""

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Owns the waiting queue and the running set; the model runner only sees StepPlans."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_adopted = 0
        """Requests adopted and not started (their KV is being copied in): they hold blocks and count toward
        max_num_seqs, but are not scheduled."""
        self._prefilling: dict[bytes, Request] = {}  # prompt token ids (ids_key) -> the request computing them

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_seqs(self) -> int:
        """Sequences counted against max_num_seqs: the running and the adopted ones."""
        return len(self.running) + self.num_adopted

    def adopt(self, req: Request) -> None:
        req.status = RequestStatus.ADOPTED
        self.num_adopted += 1

    def start_adopted(self, req: Request) -> None:
        if req.status is not RequestStatus.ADOPTED:
            raise ValueError(f"request {req.request_id!r} is {req.status.value}, not adopted")
        self.num_adopted -= 1
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def schedule(self) -> StepPlan:
        if self._prefilling:
            self._prefilling = {k: r for k, r in self._prefilling.items() if self._still_prefilling(r)}
        plan = StepPlan()
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        # NOTE: decodes (one-token chunks) lead the pass, the attention backend's mixed split (kernels/attention.py
        # MixedSplit) runs them as a decode batch; a stable sort keeps each group's order
        plan.chunks.sort(key=lambda c: c.num_tokens != 1)
        return plan

    def _chunk_len(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        return min(n, self.config.prefill_chunk_size) if self.config.prefill_chunk_size else n

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk_len(req, budget)
            while not self.kv.ensure_slots(req, n, plan.copies):
                victim = self.running.pop()  # NOTE: the newest request yields first
                self._preempt(victim, plan)
                if victim is req:
                    return budget
            plan.chunks.append(ScheduledChunk(req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        held: list[Request] = []  # NOTE: copies of a prompt still being prefilled; they keep their queue places
        while self.waiting and self.num_seqs() < self.config.max_num_seqs:
            req = self.waiting[0]
            if budget <= 0:
                break
            if self._being_prefilled(req):
                held.append(self.waiting.popleft())
                continue
            hit = self.kv.admit(req)
            if hit is False:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if isinstance(hit, CachedLogits):
                plan.cached_hits.append((req, hit))
                continue
            if self.kv.enable_caching:
                self._prefilling[ids_key(req)] = req
            n = self._chunk_len(req, budget)
            plan.chunks.append(ScheduledChunk(req, n))
            budget -= n
        self.waiting.extendleft(reversed(held))

    def _being_prefilled(self, req: Request) -> bool:
        """In-flight dedup: another request with these very token ids is computing its prompt now. This one
        waits and then takes the whole-prompt hit that request leaves in the prefix cache (one prefill, not
        several). Only with prefix caching; schedule() drops entries whose prompt is done, finished or preempted."""
        if not self.kv.enable_caching or not self._prefilling:
            return False
        leader = self._prefilling.get(ids_key(req))
        return leader is not None and self._still_prefilling(leader)

    @staticmethod
    def _still_prefilling(req: Request) -> bool:
        return req.status is RequestStatus.RUNNING and req.num_computed_tokens < req.num_prompt_tokens

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.kv.free(req)  # NOTE: now, not deferred: the request that yields frees blocks this schedule needs
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        plan.chunks = [c for c in plan.chunks if c.req is not req]
        plan.preempted.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Take req out of the queues; its blocks are freed by the next kv.flush() (KVCacheManager.defer_free)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.ADOPTED:
            self.num_adopted -= 1
        self.kv.defer_free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason


def ids_key(req: Request) -> bytes:
    """req's token ids as one bytes key (their int64 values): hashed far faster than a tuple of ints, on the path
    of every prefill's admission."""
    ids = req.tokens(0, req.num_tokens)
    return (ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=np.int64)).tobytes()
