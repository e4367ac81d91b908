"""Text <-> token ids for the router, without torch: the `tokenizers` library plus the model's Jinja chat template.

IncrementalDetokenizer turns a stream of token ids into text deltas that never end inside a UTF-8 character;
StopStringMatcher trims a stop string (and whatever follows it) from that text, even across token boundaries.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from pdserve.core.messages import TokenIds

REPLACEMENT_CHAR = "\ufffd"
"""What a decoder yields for bytes that are not (yet) a whole UTF-8 character."""
DETOKENIZE_CONTEXT = 5
"""Prompt tokens decoded ahead of the output, so the first output token gets its leading space right."""


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template refused the messages."""


class RouterTokenizer:
    """The model's tokenizer and chat template; thread-safe and stateless after construction."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special_tokens: Mapping[str, str]) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self._template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> RouterTokenizer:
        """Load tokenizer.json, and the chat template from chat_template.jinja or tokenizer_config.json."""
        path = Path(model_dir)
        config = _read_json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else _config_template(config)
        return cls(Tokenizer.from_file(str(path / "tokenizer.json")), template, _special_tokens(config))

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (with the tokenizer's own special tokens, e.g. a BOS, if it adds any)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The chat as the model's template renders it, ending with the assistant's generation prompt."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send text or token ids")
        plain = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        try:
            return self._template.render(messages=plain, add_generation_prompt=True, **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        # NOTE: the template writes the special tokens itself, so the tokenizer must not add any (as in HF).
        return list(self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def detokenizer(self, prompt_ids: TokenIds) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """Output text delta by delta (vLLM's prefix/read offsets): decode a short window of ids twice, with and
    without the new ones, and emit the difference once it no longer ends in a broken character."""

    def __init__(self, tokenizer: RouterTokenizer, prompt_ids: TokenIds) -> None:
        self.tokenizer = tokenizer
        self.token_ids = [int(t) for t in prompt_ids[-DETOKENIZE_CONTEXT:]]  # NOTE: Python ints, an array's too
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.num_context = len(self.token_ids)

    def step(self, token_id: int) -> str:
        """Text the new token completes ('' while it ends inside a UTF-8 character)."""
        self.token_ids.append(token_id)
        return self._advance()

    def extend(self, token_ids: Sequence[int]) -> str:
        """Text several new tokens complete, in one pass: the same text as stepping through them one by one."""
        self.token_ids.extend(token_ids)
        return self._advance() if token_ids else ""

    def flush(self) -> str:
        """At the end of the stream: held-back text, minus a trailing broken character."""
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return text[len(prefix) :].rstrip(REPLACEMENT_CHAR) if len(text) > len(prefix) else ""

    def _advance(self) -> str:
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return text[len(prefix) :]


class StopStringMatcher:
    """Finds the first stop string in streamed text. Text that could be the start of a stop string is held
    back until it is either part of one (dropped with everything after) or cannot be (released)."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Text safe to emit now; sets `stopped` once a stop string is seen (nothing is emitted after)."""
        if self.stopped:
            return ""
        text = self.pending + delta
        hit = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            self.pending, self.stopped = "", True
            return text[:hit]
        keep = self._partial_suffix(text)
        self.pending = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of the stream: the held-back text (it can no longer become a stop string)."""
        text, self.pending = self.pending, ""
        return text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = min(len(text), max((len(s) for s in self.stops), default=1) - 1)
        for k in range(longest, 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


def _compile_template(source: str) -> jinja2.Template:
    """A sandboxed environment with the helpers Hugging Face chat templates expect."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant tokens for training): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # NOTE: like transformers: no HTML escaping (unlike jinja's own tojson).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _config_template(config: Mapping[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates (use "default")."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as strings, the names templates read them under."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    return out
