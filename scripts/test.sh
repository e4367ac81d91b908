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
bash scripts/package_links.sh build/typecheck  # what mypy reads (pyproject.toml [tool.mypy])
mypy
exec python -m pytest -q "$@"
