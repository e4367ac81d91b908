"""pdserve installs as one import package: every subpackage folder is listed in pyproject.toml, the wheel holds
`pdserve/` and its dist-info only (the generated gRPC code and every module included, entry points into
pdserve), and an installed pdserve puts no `core`, `kernels` or `proto` on the import path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_FILES = ("pdserve_pb2.py", "pdserve_pb2_grpc.py", "pdserve.proto")
COMMANDS = ("pdserve-client", "pdserve-bench-serving", "pdserve-status", "pdserve-prepare-model")


def pyproject() -> dict:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def package_dirs() -> dict[str, str]:
    """Each root package -> its folder (pdserve.core -> core)."""
    return pyproject()["tool"]["setuptools"]["package-dir"]


def package_folder(package: str) -> Path:
    """A listed package's folder, through package-dir (pdserve.core.models -> core/models)."""
    roots = package_dirs()
    root = max((r for r in roots if package == r or package.startswith(r + ".")), key=len)
    rest = package[len(root) :].lstrip(".")
    return REPO_ROOT / roots[root] / Path(*rest.split("."))


def source_modules(folder: Path) -> list[Path]:
    return sorted(p.relative_to(folder) for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_subpackage_folder_is_listed_and_every_listed_package_exists() -> None:
    listed = pyproject()["tool"]["setuptools"]["packages"]
    found = {
        ".".join((root, *init.parent.relative_to(REPO_ROOT / folder).parts))
        for root, folder in package_dirs().items()
        for init in (REPO_ROOT / folder).rglob("__init__.py")
    }
    assert found == set(listed)
    assert all((package_folder(package) / "__init__.py").is_file() for package in listed)


def build_wheel(tmp_path: Path) -> zipfile.ZipFile:
    """The wheel built from a copy of the repo's files and package folders (the build leaves the checkout as is)."""
    src = tmp_path / "src"
    src.mkdir()
    for path in REPO_ROOT.iterdir():
        if path.is_file():
            shutil.copy2(path, src / path.name)
    for folder in package_dirs().values():
        shutil.copytree(REPO_ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    subprocess.run(argv, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("pdserve-*.whl")
    return zipfile.ZipFile(wheel)


def test_wheel_holds_pdserve_only_with_every_module_and_the_commands(tmp_path: Path) -> None:
    with build_wheel(tmp_path) as wheel:
        names = set(wheel.namelist())
        dist_info = f"pdserve-{pyproject()['project']['version']}.dist-info"
        assert {name.split("/")[0] for name in names} == {"pdserve", dist_info}
        assert {f"pdserve/proto/pdserve/v1/{name}" for name in PROTO_FILES} <= names
        for root, folder in package_dirs().items():
            for module in source_modules(REPO_ROOT / folder):
                assert "/".join((*root.split("."), *module.parts)) in names
        entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    scripts = dict(line.split(" = ") for line in entry_points.splitlines() if " = " in line)
    for command in COMMANDS:
        target = scripts[command].split(":")[0]
        assert target.startswith("pdserve.") and target.replace(".", "/") + ".py" in names, scripts[command]


CHILD = """
import importlib
import json

where = {}
for name in ("core", "kernels", "kvtransfer", "router", "prefill_worker", "decode_worker", "proto", "pdserve.router"):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        where[name] = []
        continue
    where[name] = [p for p in [getattr(module, "__file__", None), *getattr(module, "__path__", [])] if p]
print(json.dumps(where))
"""


def test_only_pdserve_resolves_to_the_repo_outside_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    where = {name: [Path(p).resolve() for p in paths] for name, paths in json.loads(proc.stdout).items()}
    in_repo = {name for name, paths in where.items() if any(p.is_relative_to(REPO_ROOT) for p in paths)}
    assert in_repo == {"pdserve.router"}
