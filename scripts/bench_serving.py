#!/usr/bin/env python3
"""Serving benchmark against a running router; the same as `pdserve-bench-serving` (see router/benchmark/cli.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.benchmark.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
