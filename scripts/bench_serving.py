#!/usr/bin/env python3
"""Serving benchmark against a running router; the same as `pdserve-bench-serving` (see router/benchmark/cli.py)."""

import sys

from pdserve.router.benchmark.cli import main

if __name__ == "__main__":
    sys.exit(main())
