"""router.tokenizer: chat templates as transformers renders them, UTF-8-safe incremental detokenization, stop
strings across token boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.router.tokenizer import REPLACEMENT_CHAR, ChatTemplateError, RouterTokenizer, StopStringMatcher

CHATS = [
    [{"role": "user", "content": "Tell me a joke."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello! ¿Qué tal?"},
        {"role": "user", "content": "日本語で答えて"},
    ],
]
MULTIBYTE_TEXT = "Héllo 👋🏽 wörld — 日本語 🎉🧑‍🚀! naïve café"


@pytest.mark.parametrize("chat", CHATS, ids=["user", "system", "multi-turn"])
def test_chat_rendering_matches_transformers(tokenizer: RouterTokenizer, smollm2_dir: Path, chat: list) -> None:
    from transformers import AutoTokenizer  # NOTE: the test may import transformers; router code may not

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.render_chat(chat) == expected
    assert tokenizer.encode_chat(chat) == hf(expected, add_special_tokens=False)["input_ids"]
    assert tokenizer.encode(MULTIBYTE_TEXT) == hf(MULTIBYTE_TEXT)["input_ids"]


def test_template_from_tokenizer_config_has_hf_helpers(tokenizer: RouterTokenizer) -> None:
    template = (
        "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}"
        "{% generation %}{% if add_generation_prompt %}>{% endif %}{% endgeneration %}"
    )
    t = RouterTokenizer(tokenizer.tokenizer, template, {"bos_token": "<s>"})
    assert t.render_chat([{"role": "user", "content": "<é>"}]) == '<s>{"role": "user", "content": "<é>"}>'
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        t.render_chat([{"role": "bad", "content": ""}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        RouterTokenizer(tokenizer.tokenizer, None, {}).render_chat(CHATS[0])


def test_template_sandbox_refuses_python_internals(tokenizer: RouterTokenizer) -> None:
    t = RouterTokenizer(tokenizer.tokenizer, "{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        t.render_chat(CHATS[0])


def test_incremental_detokenization_equals_full_decode_and_never_yields_a_broken_char(
    tokenizer: RouterTokenizer,
) -> None:
    prompt = tokenizer.encode_chat(CHATS[0])
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    detok = tokenizer.detokenizer(prompt)
    deltas = [detok.step(t) for t in ids]
    tail = detok.flush()
    assert "".join(deltas) + tail == tokenizer.decode(ids) == MULTIBYTE_TEXT
    assert not any(REPLACEMENT_CHAR in d for d in [*deltas, tail])
    assert deltas.count("") >= 4  # the emoji span several byte-level tokens: the text was held back


@pytest.mark.parametrize("size", [2, 3, 7, 1000])
def test_detokenizing_several_tokens_at_once_gives_the_same_text(tokenizer: RouterTokenizer, size: int) -> None:
    prompt = tokenizer.encode_chat(CHATS[0])
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    detok = tokenizer.detokenizer(prompt)
    deltas = [detok.extend(ids[i : i + size]) for i in range(0, len(ids), size)]
    tail = detok.flush()
    assert "".join(deltas) + tail == MULTIBYTE_TEXT
    assert not any(REPLACEMENT_CHAR in d for d in [*deltas, tail])


def test_flush_drops_a_dangling_partial_character(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode("ok 🎉")
    detok = tokenizer.detokenizer([])
    text = "".join(detok.step(t) for t in ids[:-1]) + detok.flush()
    assert text.startswith("ok") and REPLACEMENT_CHAR not in text


def test_detokenizer_keeps_the_leading_space_after_the_prompt(tokenizer: RouterTokenizer) -> None:
    prompt, output = tokenizer.encode("The answer is"), tokenizer.encode(" forty two")
    detok = tokenizer.detokenizer(prompt)
    assert "".join(detok.step(t) for t in output) == " forty two"


def _feed_in_chunks(stops: list[str], text: str, size: int) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = "".join(matcher.feed(text[i : i + size]) for i in range(0, len(text), size))
    stopped = matcher.stopped
    return (out if stopped else out + matcher.flush()), stopped


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_stop_string_is_trimmed_with_everything_after_it_across_chunks(size: int) -> None:
    assert _feed_in_chunks(["STOP", "END"], "one two STOP three END", size) == ("one two ", True)
    assert _feed_in_chunks(["<|im_end|>"], "abc<|im_e<|im_end|>x", size) == ("abc<|im_e", True)
    assert _feed_in_chunks(["xyz"], "no stop here xy", size) == ("no stop here xy", False)


def test_text_that_could_start_a_stop_string_is_held_back() -> None:
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xab") == "x"
    assert matcher.feed("d") == "abd"
    assert matcher.feed("ab") == ""
    assert matcher.feed("c tail") == "" and matcher.stopped
    assert matcher.feed("more") == ""


def test_stop_strings_spanning_token_boundaries_are_found(tokenizer: RouterTokenizer) -> None:
    text = "Sure 👍 here you go.\n\nUser: next"
    ids = tokenizer.encode(text)
    detok, matcher = tokenizer.detokenizer([]), StopStringMatcher(["\n\nUser:"])
    out, num_fed = "", 0
    while not matcher.stopped:
        out += matcher.feed(detok.step(ids[num_fed]))
        num_fed += 1
    assert out == "Sure 👍 here you go."
    assert num_fed < len(ids)


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
