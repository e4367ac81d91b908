#!/usr/bin/env bash
# Makes DIR/pdserve/{core,kernels,...}: links to the checkout's folders under the installed package's names
# (pyproject.toml's package-dir), for tools that cannot follow the editable install (mypy) and GPU hosts
# where pdserve is not installed (put DIR on PYTHONPATH).   Usage: scripts/package_links.sh DIR
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$1/pdserve"
for pkg in core kernels kvtransfer router prefill_worker decode_worker proto; do
  ln -sfn "$root/$pkg" "$1/pdserve/$pkg"
done
