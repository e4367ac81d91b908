"""KVCacheManager's prefix matching hashes no further than the cache can match."""

from __future__ import annotations

import numpy as np

from pdserve.core.block_pool import BlockPool
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.request import Request
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams

BLOCK = 4


def request(request_id: str, ids: list[int]) -> Request:
    state = SamplingState(SamplingParams(), ())
    return Request(request_id, ids, len(ids), state, token_array=np.asarray(ids, dtype=np.int64))


def computed(kv: KVCacheManager, req: Request) -> None:
    """As after its prefill pass: every prompt token computed, its full blocks offered to the cache."""
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


def test_a_miss_hashes_one_block_before_its_pass_and_the_rest_at_commit() -> None:
    pool = BlockPool(64)
    kv = KVCacheManager(pool, BLOCK, enable_caching=True, max_cached_logits=4)
    a = request("a", list(range(40)))  # 10 full blocks
    assert kv.admit(a) is None and a.num_computed_tokens == 0
    assert len(a.block_hashes) == 1
    computed(kv, a)
    assert len(a.block_hashes) == 10 and pool.num_cached_blocks == 10


def test_a_partial_hit_hashes_by_doubling_up_to_the_first_miss() -> None:
    pool = BlockPool(64)
    kv = KVCacheManager(pool, BLOCK, enable_caching=True, max_cached_logits=4)
    a = request("a", list(range(40)))
    kv.admit(a)
    computed(kv, a)
    b = request("b", [*range(16), 999, *range(17, 40)])  # the first 4 blocks shared, the 5th differs
    assert kv.admit(b) is None
    assert b.num_computed_tokens == 16 and b.block_ids[:4] == a.block_ids[:4]
    assert len(b.block_hashes) == 8  # 1, 2, 4 blocks all cached; of 8, the 5th missed
    c = request("c", list(range(40)))  # every block cached (no logits): all but the last block reused
    kv.admit(c)
    assert c.num_computed_tokens == 36 and c.block_ids[:9] == a.block_ids[:9] and len(c.block_hashes) == 10
