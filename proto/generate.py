"""Regenerate the Python code of proto/pdserve/v1/pdserve.proto (run from anywhere).

    python proto/generate.py [--out DIR]

The include root is the repository root, so the .proto is known as "proto/pdserve/v1/pdserve.proto"; protoc
names the modules after that path (`proto.pdserve.v1`), and they are renamed to where pdserve installs them
(`pdserve.proto.pdserve.v1`, pyproject.toml's package-dir). Output lands in DIR/proto/pdserve/v1/ (DIR
defaults to the repository root, i.e. in place).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ("proto/pdserve/v1/pdserve.proto",)
PROTOC_MODULE = "proto.pdserve.v1"
INSTALLED_MODULE = "pdserve.proto.pdserve.v1"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpc_tools) into out_dir; the generated files' paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    for proto in PROTO_FILES:
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(ROOT / proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    written = sorted(p for proto in PROTO_FILES for p in (out_dir / proto).parent.glob("*_pb2*.py*"))
    for path in written:
        text = path.read_text()
        text = text.replace(f"from {PROTOC_MODULE} import", f"from {INSTALLED_MODULE} import")
        path.write_text(text.replace(f"'{PROTOC_MODULE}.", f"'{INSTALLED_MODULE}."))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out.resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
