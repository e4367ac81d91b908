"""The in-process engine: add requests, step, collect outputs, abort. Workers and tests drive it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pdserve.core.block_pool import BlockPool
from pdserve.core.config import EngineConfig
from pdserve.core.errors import InvalidRequestError
from pdserve.core.kv_cache_manager import CachedLogits, KVCacheManager
from pdserve.core.messages import TokenIds, TokenLogprob
from pdserve.core.model_runner import KVAllocator, ModelRunner, is_decode_pass
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sampler import HostLogprobs, Sampler, SamplingState, TokenLogprobs, token_logprobs
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import Scheduler, StepPlan
from pdserve.kernels.attention import AttentionBackend


class RequestOutput(NamedTuple):
    """What one step produced for one request (a NamedTuple: one is built per request per step)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    """One per new token, for a request whose params ask (SamplingParams.logprobs)."""


@dataclass
class EngineStats:
    """Counters the tests and metrics read."""

    num_prefill_tokens_computed: int = 0
    """Prompt tokens that went through the model (cache hits excluded)."""
    num_cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests prefilled here (the prefix cache's query tokens)."""
    num_full_hits: int = 0
    """Requests whose first token came from cached last_logits, with no forward pass."""
    num_preemptions: int = 0
    """Requests sent back to waiting for lack of KV blocks."""


class Adoption(NamedTuple):
    """Where an adopted request's KV goes: its first num_shared blocks were found in the local prefix cache
    and are shared, not copied; dst are fresh blocks for the KV of its computed blocks num_shared,
    num_shared + 1, ... in order."""

    dst: list[int]
    num_shared: int

    def sources(self, src_block_ids: Sequence[int]) -> list[int]:
        """The blocks to copy from, given the source's blocks of all the computed tokens (in order)."""
        return list(src_block_ids[self.num_shared : self.num_shared + len(self.dst)])


def _id_list(ids: TokenIds) -> list[int]:
    """A request's own list of Python ints (an array's elements converted, not numpy scalars)."""
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)


def _adopted_request(request_id: str, ids: TokenIds, num_prompt_tokens: int, sampling: SamplingState) -> Request:
    """A handed-off request: its list of ids, and all but its last id (the token its first pass reads) as its
    array."""
    return Request(request_id, _id_list(ids), num_prompt_tokens, sampling, token_array=_int64_array(ids[:-1]))


def _entries(logprobs: TokenLogprobs | None, batch: int) -> list[TokenLogprob | None]:
    """Per row of a sampled batch, its logprobs entry (None for every row when no row asked)."""
    return [None] * batch if logprobs is None else logprobs.entries(batch)


def _int64_array(ids: TokenIds) -> np.ndarray:
    """[len(ids)] int64; TypeError / OverflowError for ids that are not integers (an array of another kind too)."""
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"token ids of dtype {ids.dtype}")
        return ids.astype(np.int64)
    return np.fromiter(ids, np.int64, len(ids))


PLACEHOLDER = -1
"""Stands in token_ids for a token sampled by the in-flight step until the host reads it."""


class InFlightStep(NamedTuple):
    """A launched decode step whose sampled tokens the host has not read yet."""

    reqs: list[Request]
    """Requests in row order."""
    rows: dict[Request, int]
    """Row of each request (where the next step gathers its input token from on the device)."""
    indices: list[int]
    """Where each request's placeholder sits in its token_ids."""
    tokens: torch.Tensor  # [len(reqs)] int64, host (pinned on CUDA)
    done: torch.cuda.Event | None
    """Recorded after the copies to `tokens` and `logprobs`; None on CPU (the copies were synchronous)."""
    logprobs: TokenLogprobs | None
    """Host copies of the rows that asked (HostLogprobs); None when none did."""


class Engine:
    """Continuous-batching engine over one model and one paged KV cache.

    Decode steps overlap the host with the device: a pure decode pass is launched (forward, sampling, and an
    asynchronous copy of the tokens to pinned memory) before the host reads the previous step's tokens, so the
    device runs step n + 1 while the host stops, streams and schedules around step n. The next step takes
    the tokens it has not read yet straight from the device (DecodeBatch.sampled); token_ids hold PLACEHOLDER
    there meanwhile. A request that finished at step n has run once more in step n + 1; that token is
    dropped. Any other pass (prefill chunks, cache hits, copies, preemptions, seeded or min_tokens sampling,
    whose sampling state must count the unread token) first reads the in-flight step, then runs in order.
    Outputs of a decode step therefore arrive one step() call later.
    """

    def __init__(
        self, config: EngineConfig, backend: AttentionBackend | None = None, kv_allocator: KVAllocator | None = None
    ) -> None:
        self.config = config
        self.runner = ModelRunner(config, backend, kv_allocator)
        self.pool = BlockPool(self.runner.num_blocks)
        cache = config.cache
        self.kv = KVCacheManager(self.pool, cache.block_size, cache.enable_prefix_caching, cache.max_cached_logits)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler(self.runner.device)
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}
        self._in_flight: InFlightStep | None = None
        pin = self.runner.device.type == "cuda"
        # NOTE: two host buffers: a launch must not overwrite the tokens of the step still to be read
        rows = config.scheduler.max_num_seqs
        self._host_tokens = [torch.zeros(rows, dtype=torch.int64, pin_memory=pin) for _ in "ab"]
        self._host_logprobs = HostLogprobs(rows, pin)

    @property
    def num_adopted(self) -> int:
        """Requests adopted and not started yet (their KV is being copied in)."""
        return self.scheduler.num_adopted

    @property
    def num_forward_calls(self) -> int:
        return self.runner.num_forward_calls

    def add_request(
        self, request_id: str, prompt_token_ids: TokenIds, params: SamplingParams, num_generated: int = 0
    ) -> None:
        """Queue a request; raises InvalidRequestError for a request that can never run.

        num_generated > 0 resumes a request that moved here (request migration): the last num_generated of
        prompt_token_ids are its tokens so far; they are computed like the prompt, count toward max_tokens
        and min_tokens, and its outputs carry on at that index (a preempted request's recompute, in effect)."""
        token_array = self._validate(request_id, prompt_token_ids, params)
        if not 0 <= num_generated < min(len(prompt_token_ids), params.max_tokens):
            raise InvalidRequestError(
                f"num_generated {num_generated} for a {len(prompt_token_ids)}-token input and max_tokens "
                f"{params.max_tokens}"
            )
        state = SamplingState(params, self.config.model.eos_token_ids, num_generated)
        num_prompt = len(prompt_token_ids) - num_generated
        req = Request(request_id, _id_list(prompt_token_ids), num_prompt, state, token_array=token_array)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _validate(self, request_id: str, prompt: TokenIds, params: SamplingParams) -> np.ndarray:
        """The prompt as an int64 array [len(prompt)] once every check passed."""
        m = self.config.model
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if len(prompt) == 0:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt) >= m.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens; the model's context is {m.max_model_len} "
                "and at least one must be left to generate"
            )
        try:  # NOTE: one conversion, then the range check on the array: half the time of builtin min and max
            ids = _int64_array(prompt)
        except (TypeError, ValueError, OverflowError) as exc:
            msg = f"token ids must be integers in the vocabulary [0, {m.vocab_size}): {exc}"
            raise InvalidRequestError(msg) from None
        if ids.min() < 0 or ids.max() >= m.vocab_size:
            bad = ids[(ids < 0) | (ids >= m.vocab_size)][0]
            raise InvalidRequestError(f"token id {bad} outside the vocabulary [0, {m.vocab_size})")
        needed = self.kv.blocks_needed(len(prompt) + 1)
        if needed > self.pool.num_blocks - 1:
            raise InvalidRequestError(f"the prompt needs {needed} KV blocks; the pool has {self.pool.num_blocks - 1}")
        params.validate(m.vocab_size)
        return ids

    def detach(self, request_id: str) -> Request:
        """Take a running request out of the engine WITHOUT freeing its blocks: the caller now owns one
        reference on each of req.block_ids (a prefill worker leases them to a decode worker) and must give
        them back with release_blocks. Call it right after the step that produced the request's output."""
        req = self.requests.pop(request_id)
        self.scheduler.running.remove(req)
        req.status = RequestStatus.FINISHED
        return req

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop references taken by detach (tail first, like any free)."""
        self.kv.flush()
        self.pool.free(list(block_ids)[::-1])

    def flush_commits(self) -> None:
        """Offer the prompts the last step computed to the prefix cache (their blocks, tail and last_logits), then
        free the blocks of the requests it finished.

        step() returns a prompt's first token (and a request's last) before this, so callers send it out first,
        then call this; the next step() (or a free of the request's blocks) does it otherwise.
        """
        self.kv.flush()

    def adopt(
        self,
        request_id: str,
        token_ids: TokenIds,
        num_prompt_tokens: int,
        sampling: SamplingState,
        block_hashes: Sequence[int] = (),
    ) -> Adoption | None:
        """Add a request whose KV for all but the last token was computed elsewhere (a handoff).

        Full blocks of that KV already in the local prefix cache are shared; blocks are allocated for the
        rest and returned (see Adoption). None when there is no room (nothing changed; adopted requests count
        toward max_num_seqs). The request holds its blocks without being scheduled until start_adopted: the
        caller copies the KV into them and calls it once the copy has finished; abort it instead after a failed
        copy, or to stop it, but only once no copy writes its blocks any more (they are freed at once).
        block_hashes: those full blocks' hashes as the sender computed them (computed_block_hashes), or () to
        hash them here; InvalidRequestError for a count that does not match.
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        num_full = (len(token_ids) - 1) // self.config.cache.block_size
        if block_hashes and len(block_hashes) != num_full:
            raise InvalidRequestError(f"{len(block_hashes)} block hashes for {num_full} full blocks")
        if self.scheduler.num_seqs() >= self.config.scheduler.max_num_seqs:
            return None
        req = _adopted_request(request_id, token_ids, num_prompt_tokens, sampling)
        if self.kv.enable_caching:
            req.block_hashes = list(block_hashes)
        num_shared = self.kv.adopt(req, len(token_ids) - 1)
        if num_shared is None:
            return None
        self.requests[request_id] = req
        self.scheduler.adopt(req)
        return Adoption(req.block_ids[num_shared:], num_shared)

    def computed_block_hashes(self, req: Request) -> list[int]:
        """Chained hashes of req's full blocks whose KV is computed: what a decode worker adopting it matches its
        prefix cache with (HandoffCmd.block_hashes); [] without prefix caching. The commit reuses them."""
        if not self.kv.enable_caching:
            return []
        return self.kv.full_block_hashes(req, req.num_computed_tokens // self.config.cache.block_size)

    def start_adopted(self, request_id: str) -> None:
        """Schedule an adopted request whose KV copy has finished (it decodes from the next step on), and offer
        its copied full blocks to the prefix cache, so later handoffs and prompts share them."""
        req = self.requests[request_id]
        self.scheduler.start_adopted(req)
        self.kv.cache_full_blocks(req)

    def has_unfinished(self) -> bool:
        """Requests are queued or running, or a step's tokens are still to be read (call step())."""
        return self.scheduler.has_work() or self._in_flight is not None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        self.kv.flush()
        return self._output(req, [])

    def step(self) -> list[RequestOutput]:
        """One scheduling round and at most one forward pass; outputs of the pass, or of the previous decode
        pass when this one is a decode pass that overlaps it (see the class docstring)."""
        self.kv.flush()
        plan = self.scheduler.schedule()
        self.stats.num_preemptions += len(plan.preempted)
        if self._overlaps(plan):
            launched = self._launch_decode(plan)
            outputs = self._read_in_flight()
            self._in_flight = launched
            return outputs
        outputs = self._read_in_flight()
        if outputs:  # NOTE: requests that the read just finished leave the plan
            plan.chunks = [c for c in plan.chunks if c.req.status is not RequestStatus.FINISHED]
        sampled, rows, known = self._run(plan)
        outputs += [self._accept(req, token, None, None) for req, token in known]
        if not sampled:
            return outputs
        states = [r.sampling for r, _ in sampled]
        sampled_tokens = self.sampler.sample(rows, states)  # [n] on the device
        logprobs = _entries(token_logprobs(rows, states, sampled_tokens), len(sampled))
        tokens = sampled_tokens.tolist()
        # NOTE: only a prompt's first token may cache its logits row; other rows are never sliced out.
        return outputs + [
            self._accept(req, token, rows[i] if hit is None and req.num_output_tokens == 0 else None, hit, logprobs[i])
            for i, ((req, hit), token) in enumerate(zip(sampled, tokens, strict=True))
        ]

    def _overlaps(self, plan: StepPlan) -> bool:
        """A pure decode pass whose sampling does not depend on how many tokens the host has read."""
        if plan.cached_hits or plan.copies or plan.preempted or not plan.chunks or not is_decode_pass(plan.chunks):
            return False
        # NOTE: a first token (a 1-token prompt's pass looks like a decode) comes out of the step that computed
        # it: a prefill worker detaches the request on it, and must not see the request run a second pass first
        if any(c.req.num_output_tokens == 0 for c in plan.chunks):
            return False
        states = (c.req.sampling for c in plan.chunks)
        return all(s.params.seed is None and s.num_generated >= s.params.min_tokens for s in states)

    def _launch_decode(self, plan: StepPlan) -> InFlightStep:
        """Forward + sampling of a decode pass, tokens copied to the host asynchronously; no host sync."""
        reqs = [c.req for c in plan.chunks]
        prev = self._in_flight
        sampled_rows = None if prev is None else [prev.rows.get(req, -1) for req in reqs]
        logits = self.runner.execute(plan, sampled_rows)  # [n, vocab]
        states = [req.sampling for req in reqs]
        tokens = self.sampler.sample(logits, states)  # [n] on the device
        n = len(reqs)
        self.runner.decode_batch.sampled[:n].copy_(tokens)
        host = self._host_tokens[0][:n]
        self._host_tokens.reverse()
        host.copy_(tokens, non_blocking=True)
        logprobs = token_logprobs(logits, states, tokens)
        if logprobs is not None:
            logprobs = self._host_logprobs.copy(logprobs)
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()
            done.record()
        indices = []
        for req in reqs:
            req.num_computed_tokens += 1
            indices.append(len(req.token_ids))
            req.token_ids.append(PLACEHOLDER)
        return InFlightStep(reqs, {req: i for i, req in enumerate(reqs)}, indices, host, done, logprobs)

    def _read_in_flight(self) -> list[RequestOutput]:
        """Wait for the in-flight step's tokens and accept them; finished or aborted requests drop theirs."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        if step.done is not None:
            step.done.synchronize()
        outputs = []
        logprobs = _entries(step.logprobs, len(step.reqs))
        for i, (req, index, token) in enumerate(zip(step.reqs, step.indices, step.tokens.tolist(), strict=True)):
            if req.status is RequestStatus.FINISHED:
                continue
            req.token_ids[index] = token
            self.kv.commit(req, None)
            outputs.append(self._stop_or_continue(req, token, index + 1, logprobs[i]))
        return outputs

    def _run(
        self, plan: StepPlan
    ) -> tuple[list[tuple[Request, CachedLogits | None]], torch.Tensor, list[tuple[Request, int]]]:
        """Forward pass + cached hits -> the requests that sample now with their hit (None: computed by this
        pass), their logits rows in the same order, and the hits whose first token is already known."""
        sampled: list[tuple[Request, CachedLogits | None]] = []
        known: list[tuple[Request, int]] = []
        parts: list[torch.Tensor] = []
        if plan.chunks:
            parts.append(self.runner.execute(plan))
            for chunk in plan.chunks:
                req, samples = chunk.req, chunk.samples
                self.stats.num_prefill_tokens_computed += max(
                    0, min(chunk.num_tokens, req.num_prompt_tokens - req.num_computed_tokens)
                )
                req.num_computed_tokens += chunk.num_tokens
                if samples:
                    sampled.append((req, None))
                else:
                    self.kv.commit(req, None)
        for req, hit in plan.cached_hits:
            self.stats.num_full_hits += 1
            # NOTE: a request that asks for logprobs samples the hit's row again (the same token) to compute them
            if hit.greedy_token is not None and req.sampling.plain_greedy() and not req.sampling.params.logprobs:
                known.append((req, hit.greedy_token))
                continue
            sampled.append((req, hit))
            parts.append(hit.row[None])
        if len(parts) == 1:
            return sampled, parts[0], known
        return sampled, torch.cat(parts) if parts else torch.empty(0), known

    def _accept(
        self, req: Request, token: int, row: torch.Tensor | None, hit: CachedLogits | None,
        logprob: TokenLogprob | None = None,
    ) -> RequestOutput:  # fmt: skip
        """Cache what the pass computed (a plain greedy token with its row or hit), append the sampled token,
        finish the request if it stopped."""
        greedy = token if req.sampling.plain_greedy() else None
        if hit is not None and greedy is not None:
            hit.greedy_token = greedy
        if row is not None and req.num_computed_tokens == len(req.token_ids) == req.num_prompt_tokens:
            self.kv.defer_prompt_commit(req, row, greedy)  # NOTE: registered by flush_commits, after the token
        else:
            self.kv.commit(req, row, greedy)
        tokens = req.token_ids
        if len(tokens) == req.num_prompt_tokens:
            self.stats.num_cached_prompt_tokens += req.num_cached_tokens
            self.stats.num_prompt_tokens += req.num_prompt_tokens
        tokens.append(token)
        return self._stop_or_continue(req, token, len(tokens), logprob)

    def _stop_or_continue(
        self, req: Request, token: int, num_tokens: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """Count a token that is now token_ids[num_tokens - 1] (its logprob, if the request asked); finish the
        request if it stopped."""
        reason = req.sampling.check_stop(token)
        if reason is None and num_tokens >= self.config.model.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(req, reason)
            del self.requests[req.request_id]
        return self._output(req, [token], num_tokens, None if logprob is None else [logprob])

    def _output(
        self, req: Request, new_tokens: list[int], num_tokens: int | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:  # fmt: skip
        """num_tokens: the request's tokens through the last new one (default: all of token_ids)."""
        done = req.status is RequestStatus.FINISHED
        return RequestOutput(
            req.request_id,
            new_tokens,
            done,
            req.finish_reason if done else None,
            req.num_prompt_tokens,
            (len(req.token_ids) if num_tokens is None else num_tokens) - req.num_prompt_tokens,
            req.num_cached_tokens,
            logprobs,
        )

    def generate(self, prompts: Sequence[TokenIds], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion; the generated token ids of each, in order."""
        ids = [f"gen-{len(self.requests)}-{i}-{id(prompts)}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        self.flush_commits()
        return [results[rid] for rid in ids]
