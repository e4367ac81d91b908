"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.core.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask for per token (SamplingParams.top_logprobs)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    temperature: float = 1.0
    """0 means greedy; > 0 scales the logits before sampling."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; in (0, 1]."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch."""
    max_tokens: int = 16
    """Most new tokens to generate (the first token counts)."""
    min_tokens: int = 0
    """Stop tokens are masked until this many new tokens exist."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that finish the request (kept in the output)."""
    ignore_eos: bool = False
    """Do not stop on the model's end-of-sequence tokens."""
    logprobs: bool = False
    """Return each generated token's log-probability (core.sampler.token_logprobs says of which logits)."""
    top_logprobs: int = 0
    """With logprobs: also this many most likely tokens at each position, 0 to MAX_TOP_LOGPROBS."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise InvalidRequestError("temperature must be a number")
        if self.temperature < 0 or math.isinf(self.temperature):
            raise InvalidRequestError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be > 0, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: set logprobs to true")
        for tid in self.stop_token_ids:
            if not 0 <= tid < vocab_size:
                raise InvalidRequestError(f"stop token id {tid} outside the vocabulary [0, {vocab_size})")
