#!/usr/bin/env bash
# The test command: sets everything up on a fresh machine, then runs lint, types and the test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -m gpu, or a test path).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup_env.sh test
. .venv/bin/activate
ruff check .
ruff format --check .
# mypy reads pdserve through links named as the installed package (pyproject.toml [tool.mypy])
mkdir -p build/typecheck/pdserve
for pkg in core kernels kvtransfer router prefill_worker decode_worker proto; do
  ln -sfn "../../../$pkg" "build/typecheck/pdserve/$pkg"
done
mypy
exec python -m pytest -q "$@"
