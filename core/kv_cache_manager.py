"""Per-request KV block bookkeeping on top of the block pool: prefix matching, allocation, caching.

The scheduler calls this; it never touches tensors except the small last_logits clones it keeps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.core.block_pool import BlockPool, hash_block_tokens, hash_full_blocks
from pdserve.core.request import Request


class BlockCopy(NamedTuple):
    """Copy the K/V of block src into block dst before the next forward (copy-on-write)."""

    src: int
    dst: int


@dataclass(slots=True)
class CachedLogits:
    """A whole prompt's last_logits row, and its greedy token once known on the host."""

    row: torch.Tensor  # [vocab], on the device: a small clone, never a view of a batch's logits
    greedy_token: int | None = None
    """argmax(row), set when a plain greedy request has sampled this row: a later plain greedy hit takes its
    first token from here with no device work at all (no kernel, no sync)."""


class LogitsCache:
    """LRU map from a whole prompt's final block hash to its CachedLogits."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, CachedLogits] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> CachedLogits | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: int, row: torch.Tensor, greedy_token: int | None = None) -> None:
        # NOTE: a clone, so the cache never pins the batch's logits tensor.
        self._entries[key] = CachedLogits(row.detach().clone(), greedy_token)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


class KVCacheManager:
    """Allocates, shares and frees the KV blocks of requests."""

    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool, max_cached_logits: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.logits = LogitsCache(max_cached_logits if enable_caching else 0)
        self._deferred: list[tuple[Request, torch.Tensor, int | None]] = []
        """Prompts computed by the last pass whose commit waits for flush() (see defer_prompt_commit)."""
        self._to_free: list[Request] = []
        """Finished requests whose blocks flush() frees (see defer_free)."""

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit(self, req: Request) -> CachedLogits | None | bool:
        """Match req's tokens against the cache and allocate blocks for all of them.

        Returns False when the pool lacks room (nothing changed); otherwise sets req.num_computed_tokens
        and returns the cached last_logits entry on a whole-prompt hit (no forward needed) or None.
        """
        matched, logits = self._match(req) if self.enable_caching else ([], None)
        num_new = self.blocks_needed(req.num_tokens) - len(matched)
        if not self._fits(matched, num_new):
            return False
        self.pool.touch(matched)
        req.block_ids.extend(matched)
        req.block_ids.extend(self.pool.allocate(num_new))
        full_hit = logits is not None
        req.num_computed_tokens = req.num_tokens if full_hit else len(matched) * self.block_size
        req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
        req.num_registered_blocks = min(len(matched), req.num_tokens // self.block_size)
        req.tail_shared = full_hit and req.num_tokens % self.block_size != 0
        return logits

    def adopt(self, req: Request, num_computed: int) -> int | None:
        """Give req blocks for its first num_computed tokens, whose KV was computed elsewhere (a handoff).

        Full blocks found in the prefix cache are shared (touched); the rest, the partial tail included, are
        allocated. Sets req.num_computed_tokens and returns how many leading blocks are shared, or None when
        the pool lacks room (nothing changed). The caller fills the blocks after the shared ones, then calls
        cache_full_blocks.
        NOTE: only the computed tokens' full blocks are matched: decode writes into the partial tail, and the
        last token's KV does not exist yet.
        """
        num_full = num_computed // self.block_size
        matched = self.pool.match_prefix(self._extend_hashes(req, num_full)) if self.enable_caching else []
        num_new = self.blocks_needed(num_computed) - len(matched)
        if not self._fits(matched, num_new):
            return None
        self.pool.touch(matched)
        req.block_ids.extend(matched)
        req.block_ids.extend(self.pool.allocate(num_new))
        req.num_computed_tokens = num_computed
        req.num_registered_blocks = len(matched)
        return len(matched)

    def _fits(self, matched: list[int], num_new: int) -> bool:
        """Whether num_new blocks can be allocated once matched are touched.

        NOTE: a free cached block in matched leaves the free queue when touched, so it is not free for num_new.
        """
        num_reusable = self.pool.num_unheld(matched)
        return num_new <= self.pool.num_free_blocks - num_reusable

    def _match(self, req: Request) -> tuple[list[int], CachedLogits | None]:
        """Longest cached run of req's blocks, and last_logits when every token (tail too) is cached.

        NOTE: hashes are extended (doubling) only while every block so far is cached: a miss hashes one block
        before its pass and the rest when its blocks are committed, after its first token went out."""
        num_full = req.num_tokens // self.block_size
        end = min(num_full, max(1, len(req.block_hashes)))
        while True:
            hashes = self._extend_hashes(req, end)
            matched = self.pool.match_prefix(hashes)
            if len(matched) < len(hashes) or end == num_full:
                break
            end = min(num_full, 2 * end)
        logits = None
        if len(matched) == len(hashes):
            final_hash, tail_block = self._final_hash(req), None
            logits = self.logits.get(final_hash)
            if logits is not None and req.num_tokens % self.block_size:
                tail_block = self.pool.lookup(final_hash)
                logits = logits if tail_block is not None else None
            if tail_block is not None:
                matched = [*matched, tail_block]
        if logits is None and len(matched) * self.block_size >= req.num_tokens:
            matched = matched[:-1]  # NOTE: at least one token must run through the model to get logits
        return matched, logits

    def ensure_slots(self, req: Request, num_new_tokens: int, copies: list[BlockCopy]) -> bool:
        """Make blocks ready for req's next num_new_tokens positions; False if the pool is out of blocks."""
        if not req.tail_shared and req.num_computed_tokens + num_new_tokens <= len(req.block_ids) * self.block_size:
            return True  # NOTE: the common decode step: the last block has room
        needed = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        needed += 1 if req.tail_shared else 0
        if needed > self.pool.num_free_blocks:
            return False
        if req.tail_shared:
            dst = self.pool.allocate(1)[0]
            copies.append(BlockCopy(req.block_ids[-1], dst))
            self.pool.free([req.block_ids[-1]])
            req.block_ids[-1] = dst
            req.blocks_epoch += 1
            req.tail_shared = False
            needed -= 1
        if needed > 0:
            req.block_ids.extend(self.pool.allocate(needed))
        return True

    def commit(self, req: Request, last_logits: torch.Tensor | None, greedy_token: int | None = None) -> None:
        """After a forward pass: offer newly full blocks to the prefix cache; when the prompt has just been
        computed, cache its last_logits row (with greedy_token: its argmax, when the caller knows it) and its
        partial tail block too."""
        if not self.enable_caching:
            return
        self.cache_full_blocks(req)
        just_prefilled = req.num_computed_tokens == len(req.token_ids) == req.num_prompt_tokens
        if last_logits is None or not just_prefilled:
            return
        self._cache_prompt_end(req, last_logits, greedy_token)

    def defer_prompt_commit(self, req: Request, last_logits: torch.Tensor, greedy_token: int | None) -> None:
        """commit() of a prompt the last pass has just computed, held until flush(): the caller sends the first
        token first (registering a long prompt's blocks and caching its row would delay it).

        Call it before the sampled token is appended. flush() must run before the next forward pass (last_logits
        is a view of that pass's logits) and before the next scheduling round; free() runs it first, so no
        block returns to the pool unregistered.
        """
        assert req.num_computed_tokens == len(req.token_ids) == req.num_prompt_tokens, "not a prompt just computed"
        if self.enable_caching:
            self._deferred.append((req, last_logits, greedy_token))

    def defer_free(self, req: Request) -> None:
        """free() of a finished request, held until flush(): a step's outputs go out before its finished requests'
        blocks return (251 blocks: ~50-70 us of an H100 host's time after a 4000-token prefill's token)."""
        self._to_free.append(req)

    def flush(self) -> None:
        """The deferred prompt commits, in order, then the deferred frees."""
        deferred, self._deferred = self._deferred, []
        for req, last_logits, greedy_token in deferred:
            self.cache_full_blocks(req)
            self._cache_prompt_end(req, last_logits, greedy_token)
        to_free, self._to_free = self._to_free, []
        for req in to_free:
            self.free(req)

    def _cache_prompt_end(self, req: Request, last_logits: torch.Tensor, greedy_token: int | None) -> None:
        """The prompt's last_logits row and its partial tail block, under the hash of the whole prompt."""
        num_prompt = req.num_prompt_tokens
        final_hash = self._final_hash(req, num_prompt)
        if num_prompt % self.block_size:
            req.tail_shared = self.pool.cache_block(req.block_ids[(num_prompt - 1) // self.block_size], final_hash)
        self.logits.put(final_hash, last_logits, greedy_token)

    def cache_full_blocks(self, req: Request) -> None:
        """Offer req's computed full blocks not offered yet to the prefix cache.

        NOTE: only once their KV is written (a handed-off request's: once its copy is done, Engine.start_adopted):
        a registered block is found by other requests, which read it without recomputing.
        """
        num_full = req.num_computed_tokens // self.block_size
        if not self.enable_caching or num_full <= req.num_registered_blocks:
            return  # NOTE: hashes are extended only when a block fills
        hashes = self._extend_hashes(req, num_full)
        first = req.num_registered_blocks
        self.pool.cache_blocks(req.block_ids[first:num_full], hashes[first:num_full])
        req.num_registered_blocks = num_full

    def free(self, req: Request) -> None:
        """Release req's blocks, tail first, so a shared prefix outlives its private suffix in the LRU."""
        if self._deferred:
            self.flush()
        self.pool.free(req.block_ids[::-1])
        req.block_ids.clear()
        req.blocks_epoch += 1
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.tail_shared = False

    def full_block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """req's first num_blocks chained block hashes, hashing what req.block_hashes lacks."""
        return self._extend_hashes(req, num_blocks)[:num_blocks]

    def _extend_hashes(self, req: Request, num_blocks: int | None = None) -> list[int]:
        """req.block_hashes extended to its first num_blocks full blocks (default: every full block).

        NOTE: commit asks only for computed blocks: a token still being sampled (the engine's placeholder
        while a decode step is in flight) must never enter a hash.
        """
        bs, hashes = self.block_size, req.block_hashes
        start, end = len(hashes), req.num_tokens // bs if num_blocks is None else num_blocks
        if end > start:  # NOTE: one conversion of the new tokens to bytes, not one per block
            hashes.extend(hash_full_blocks(req.tokens(start * bs, end * bs), bs, hashes[-1] if hashes else None))
        return hashes

    def _final_hash(self, req: Request, num_tokens: int | None = None) -> int:
        """Hash of req's first num_tokens tokens (default: all): the last full block's hash, or the partial tail
        chained on it."""
        n = req.num_tokens if num_tokens is None else num_tokens
        num_full = n // self.block_size
        hashes = self._extend_hashes(req, num_full)
        if n % self.block_size == 0:
            return hashes[num_full - 1]
        parent = hashes[num_full - 1] if num_full else None
        return hash_block_tokens(parent, req.tokens(num_full * self.block_size, n))
