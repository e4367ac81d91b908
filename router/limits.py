"""The bounds on every GenerateRequest field the router reads; past any of them a request is refused with
INVALID_ARGUMENT and a message naming the bound (router/validation.py checks them, README's API lists them).

Each bound exists so that no single request costs the router or a worker work or memory out of proportion to
what it can use: a prompt cannot exceed the model's context, so neither can the text it is tokenized from by
much; stop strings are matched against every output token, stop token ids checked at every sampling step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    """Limits of one request besides the model's own (the context length and the vocabulary)."""

    max_request_id_bytes: int = 256
    """UTF-8 bytes of a client-chosen request_id (it goes into every log line and worker message)."""
    max_stop_strings: int = 16
    """Stop strings per request (OpenAI allows 4, vLLM any number: generous, but bounded)."""
    max_stop_bytes: int = 4096
    """UTF-8 bytes of all stop strings together: the matcher holds back that much text per stream."""
    max_stop_token_ids: int = 1024
    """Stop token ids per request: each worker checks them at every sampling step."""
    max_chat_messages: int = 1024
    """Messages of a chat request."""
    prompt_bytes_per_token: int = 32
    """UTF-8 bytes a text or chat (roles and contents) may have per token of the model's context. Text runs 3-6
    bytes a token, so a prompt refused here would have to average over 32 bytes a token to fit; the bound keeps
    the router from tokenizing up to a whole 64 MiB gRPC frame of text only to find it too long."""

    def max_prompt_bytes(self, max_model_len: int) -> int:
        """UTF-8 bytes a text or chat prompt may have for a model with this context length."""
        return self.prompt_bytes_per_token * max_model_len


LIMITS = RequestLimits()
"""The router's limits (README's API section lists them)."""
