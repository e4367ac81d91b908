"""Turn a batch of logits into next tokens, and decide when a request stops.

NOTE: a request's sampling state is only (params, eos_token_ids, num_generated). Seeded requests draw
their noise from a generator re-seeded with mix(seed, num_generated) on every step, so a decode process
can resume a stream that a prefill process started without any generator state crossing over.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from pdserve.core.messages import TokenLogprob
from pdserve.core.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

FinishReason = Literal["stop", "length"]

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


@dataclass
class SamplingState:
    """Per-request sampling state. Small and plain so it can be handed from a prefill process to a
    decode process: (params, eos_token_ids, num_generated) is all there is; no torch.Generator is kept."""

    params: SamplingParams
    """How the request samples and when it stops."""
    eos_token_ids: tuple[int, ...]
    """The model's end-of-sequence token ids."""
    num_generated: int = 0
    """New tokens generated so far (the first token counts)."""

    def stop_ids(self) -> frozenset[int]:
        """Token ids that finish the request: eos ids (unless ignore_eos) and params.stop_token_ids."""
        return _stop_ids(self.params.ignore_eos, self.eos_token_ids, self.params.stop_token_ids)

    def needs_stop_mask(self) -> bool:
        """Whether the next token must not be a stop id (fewer than min_tokens exist yet)."""
        return self.num_generated < self.params.min_tokens

    def plain_greedy(self) -> bool:
        """Whether the next token is the argmax of its logits row as it is (greedy, no stop id masked)."""
        return self.params.greedy and not self.needs_stop_mask()

    def check_stop(self, token_id: int) -> FinishReason | None:
        """Record one generated token (num_generated += 1) and say whether the request is done:
        'stop' if token_id is a stop id and num_generated >= min_tokens, 'length' if
        num_generated >= max_tokens, else None. 'stop' wins over 'length' when both apply."""
        self.num_generated += 1
        if self.num_generated >= self.params.min_tokens and token_id in self.stop_ids():
            return "stop"
        if self.num_generated >= self.params.max_tokens:
            return "length"
        return None


@functools.lru_cache(maxsize=1024)
def _stop_ids(ignore_eos: bool, eos_token_ids: tuple[int, ...], stop_token_ids: tuple[int, ...]) -> frozenset[int]:
    return frozenset(stop_token_ids if ignore_eos else eos_token_ids + stop_token_ids)


def _splitmix64(x: int) -> int:
    z = (x + _GOLDEN64) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def step_seed(seed: int, num_generated: int) -> int:
    """The generator seed for a seeded request's step num_generated; in [0, 2**63)."""
    return _splitmix64((_splitmix64(seed) + num_generated) & _MASK64) >> 1


class TokenLogprobs(NamedTuple):
    """Log-probabilities of one sampled batch's rows that asked for them (token_logprobs)."""

    rows: list[int]
    """Batch rows that asked, ascending."""
    num_top: list[int]
    """Each such row's top_logprobs."""
    chosen: torch.Tensor  # [m] float32: each row's sampled token
    top_ids: torch.Tensor  # [m, max(num_top)] int64, most likely first
    top_logprobs: torch.Tensor  # [m, max(num_top)] float32

    def entries(self, batch: int) -> list[TokenLogprob | None]:
        """Per batch row, its (logprob, top ids, top logprobs), None for rows that did not ask; reads the
        tensors on the host (a sync if they are on a device)."""
        out: list[TokenLogprob | None] = [None] * batch
        chosen, ids, logprobs = self.chosen.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        for j, (row, k) in enumerate(zip(self.rows, self.num_top, strict=True)):
            out[row] = (chosen[j], ids[j][:k], logprobs[j][:k])
        return out


class HostLogprobs:
    """Pinned host copies of TokenLogprobs for a step whose host reads them later (the engine's overlapped
    decode steps): two sets used in turn, so a launch never overwrites the set of the step still to be read."""

    def __init__(self, max_rows: int, pin: bool) -> None:
        size = max_rows * MAX_TOP_LOGPROBS
        self._sets = [
            (
                torch.zeros(max_rows, dtype=torch.float32, pin_memory=pin),
                torch.zeros(size, dtype=torch.int64, pin_memory=pin),
                torch.zeros(size, dtype=torch.float32, pin_memory=pin),
            )
            for _ in "ab"
        ]

    def copy(self, lp: TokenLogprobs) -> TokenLogprobs:
        """lp with its tensors copied (asynchronously from a device) into the next set; read them once the
        copies are done (an event recorded after this)."""
        chosen, ids, logprobs = self._sets[0]
        self._sets.reverse()
        m, k = lp.top_ids.shape
        # NOTE: flat prefixes viewed as [m, k] are contiguous, so each copy is one asynchronous memcpy
        top_ids, top_logprobs = ids[: m * k].view(m, k), logprobs[: m * k].view(m, k)
        chosen[:m].copy_(lp.chosen, non_blocking=True)
        top_ids.copy_(lp.top_ids, non_blocking=True)
        top_logprobs.copy_(lp.top_logprobs, non_blocking=True)
        return lp._replace(chosen=chosen[:m], top_ids=top_ids, top_logprobs=top_logprobs)


def _resolve_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class Sampler:
    """Picks one token per row of a logits batch: greedy, or temperature / top-k / top-p sampling."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        """device: where logits will live. seed: seeds the generator of unseeded random rows
        (from os.urandom when None)."""
        self.device = _resolve_device(device)
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        self._rng = torch.Generator(device=self.device)
        self._rng.manual_seed(seed)
        # NOTE: re-seeded per seeded row with step_seed(seed, num_generated); holds no request state.
        self._seeded_rng = torch.Generator(device=self.device)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """logits: [batch, vocab] (any float dtype; work in float32). Returns [batch] int64 token ids on
        logits.device. Does not modify logits or states (the caller calls check_stop after)."""
        self._check_inputs(logits, states)
        if all(s.plain_greedy() for s in states):
            return logits.argmax(dim=-1)  # [batch]
        needs_mask = any(s.needs_stop_mask() for s in states)
        all_greedy = all(s.params.greedy for s in states)
        x = logits.float()  # [batch, vocab]
        if needs_mask:
            x = _mask_stop_ids(x, states)
        if all_greedy:
            return x.argmax(dim=-1)
        return self._sample_mixed(x, states)

    def _check_inputs(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [batch={len(states)}, vocab], got {tuple(logits.shape)}")
        if logits.device != self.device:
            raise ValueError(f"logits on {logits.device}, sampler on {self.device}")

    def _sample_mixed(self, x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)  # [batch]
        greedy = [i for i, s in enumerate(states) if s.params.greedy]
        rand = [i for i, s in enumerate(states) if not s.params.greedy]
        if greedy:
            g = torch.tensor(greedy, device=x.device)
            out[g] = x[g].argmax(dim=-1)
        r = torch.tensor(rand, device=x.device)
        out[r] = self._sample_random(x[r], [states[i] for i in rand])
        return out

    def _sample_random(self, x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """x: [n, vocab] float32, every row with temperature > 0. Returns [n] int64."""
        temps = torch.tensor([s.params.temperature for s in states], device=x.device)  # [n]
        x = x / temps[:, None]  # [n, vocab]
        x = _apply_top_k_top_p(x, states)
        probs = torch.softmax(x, dim=-1)  # [n, vocab]
        q = self._draw_noise(states, x.shape[1])  # [n, vocab]
        # Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) picks token i with probability p_i.
        return (probs / q).argmax(dim=-1)

    def _draw_noise(self, states: Sequence[SamplingState], vocab: int) -> torch.Tensor:
        """Exp(1) noise [n, vocab]: per-row seeded generators for seeded rows, the shared one otherwise."""
        q = torch.empty(len(states), vocab, dtype=torch.float32, device=self.device)
        unseeded = [i for i, s in enumerate(states) if s.params.seed is None]
        if unseeded:
            u = torch.tensor(unseeded, device=self.device)
            q[u] = torch.empty(len(unseeded), vocab, device=self.device).exponential_(generator=self._rng)
        for i, s in enumerate(states):
            if s.params.seed is not None:
                self._seeded_rng.manual_seed(step_seed(s.params.seed, s.num_generated))
                q[i].exponential_(generator=self._seeded_rng)
        # NOTE: keep q > 0 so that a zero-probability token scores 0, never 0/0.
        return q.clamp_min_(torch.finfo(torch.float32).tiny)


def _mask_stop_ids(x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """A copy of x with each row's stop ids at -inf while that row is below min_tokens."""
    vocab = x.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if s.needs_stop_mask():
            ids = [t for t in s.stop_ids() if 0 <= t < vocab]
            rows += [i] * len(ids)
            cols += ids
    x = x.clone()
    if rows:
        x[torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)] = float("-inf")
    return x


def token_logprobs(logits: torch.Tensor, states: Sequence[SamplingState], tokens: torch.Tensor) -> TokenLogprobs | None:
    """The log-probabilities of the rows whose params ask (SamplingParams.logprobs), None when none does
    (and then nothing runs). logits, states: what Sampler.sample took; tokens: [batch] what it returned.

    A row's distribution is the one sample() drew from: log_softmax of its float32 logits with the stop ids
    masked while below min_tokens, divided by its temperature (1 for greedy), before top-k / top-p.
    """
    rows = [i for i, s in enumerate(states) if s.params.logprobs]
    if not rows:
        return None
    asked = [states[i] for i in rows]
    x = logits.float()  # [batch, vocab]
    if len(rows) < len(states):
        index = _device_tensor(rows, torch.int64, x.device)
        x, tokens = x.index_select(0, index), tokens.index_select(0, index)  # [m, vocab], [m]
    if any(s.needs_stop_mask() for s in asked):
        x = _mask_stop_ids(x, asked)
    temps = [1.0 if s.params.greedy else s.params.temperature for s in asked]
    if any(t != 1.0 for t in temps):
        x = x / _device_tensor(temps, torch.float32, x.device)[:, None]  # NOTE: the division _sample_random does
    logp = torch.log_softmax(x, dim=-1)  # [m, vocab]
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)  # [m]
    num_top = [s.params.top_logprobs for s in asked]
    top_logprobs, top_ids = logp.topk(max(num_top), dim=-1)  # [m, k] each, most likely first
    return TokenLogprobs(rows, num_top, chosen, top_ids, top_logprobs)


def _device_tensor(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values on device without waiting for it (pinned and asynchronous on CUDA)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _apply_top_k_top_p(x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """x: [n, vocab] scaled logits. Returns a copy with tokens outside each row's top-k and then its
    top-p nucleus at -inf; x itself when no row restricts either."""
    n, vocab = x.shape
    ks = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in states]
    # top_p >= 1 is off; 2.0 can never be reached by a cumulative probability, whatever the rounding.
    ps = [s.params.top_p if s.params.top_p < 1.0 else 2.0 for s in states]
    use_k = any(k < vocab for k in ks)
    use_p = any(p < 1.0 for p in ps)
    if not (use_k or use_p):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)  # [n, vocab] each
    if use_k:
        top_k = torch.tensor(ks, device=x.device)  # [n]
        rank = torch.arange(vocab, device=x.device)  # [vocab]
        sorted_x = sorted_x.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    if use_p:
        top_p = torch.tensor(ps, dtype=torch.float32, device=x.device)  # [n]
        sorted_probs = torch.softmax(sorted_x, dim=-1)  # [n, vocab]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, vocab]
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False  # the top token is always kept
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
