"""The environment of a Python process a test starts: this one's, with the repository root first on PYTHONPATH
(so the child imports `tests.*` helpers as the parent does)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**overrides: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **overrides}
