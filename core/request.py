"""One generation request as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from pdserve.core.sampler import SamplingState

NO_TOKENS = np.zeros(0, dtype=np.int64)
NO_TOKENS.flags.writeable = False


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    ADOPTED = "adopted"
    """Handed off here, its KV still being copied in: holds its blocks, neither scheduled nor preemptible."""
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token ids, KV blocks and progress of one request. Owned by the scheduler."""

    request_id: str
    token_ids: list[int]
    """Prompt followed by the generated tokens (appended in place)."""
    num_prompt_tokens: int
    sampling: SamplingState
    block_ids: list[int] = field(default_factory=list)
    """Block table: block_ids[i] holds positions [i * block_size, (i + 1) * block_size)."""
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of the full blocks of token_ids (computed or not), extended as tokens arrive."""
    blocks_epoch: int = 0
    """NOTE: bumped whenever block_ids change other than by appending (freed, or a shared tail replaced), so
    a holder of a copy of the block table knows when appending the new ids is not enough."""
    num_registered_blocks: int = 0
    """Leading full blocks already offered to the prefix cache."""
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at admission (usage reporting)."""
    tail_shared: bool = False
    """NOTE: the last block is registered in the prefix cache and must be copied before it is written."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    token_array: np.ndarray = field(default_factory=lambda: NO_TOKENS)
    """token_ids[:len(token_array)] as int64, made once by the engine (admission check, adopt): passes and prefix
    hashes slice it instead of converting the list (4000 ids: ~60 us a conversion). Empty if never made."""

    def id_array(self) -> np.ndarray:  # [num_tokens] int64
        """Every token id in one array: token_array and the ids after it (a prompt of 4000 ids and its first
        token pack for a handoff in 7 us this way, 68 us from the list on the CPU VM)."""
        n = len(self.token_array)
        if n == len(self.token_ids):
            return self.token_array
        return np.concatenate([self.token_array, np.array(self.token_ids[n:], dtype=np.int64)])

    def tokens(self, start: int, end: int) -> np.ndarray | list[int]:
        """token_ids[start:end]: a view of token_array when it holds them."""
        return self.token_array[start:end] if end <= len(self.token_array) else self.token_ids[start:end]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
