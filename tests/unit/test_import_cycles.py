"""The import graph of pdserve, read from the sources with ast: no cycle among modules, whether or not imports
inside functions count, and no router module reaches torch through any import, lazy ones included (the router
runs on hosts without it)."""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_packaging import REPO_ROOT, package_dirs

Graph = dict[str, set[str]]


def package_modules() -> dict[str, Path]:
    """Module name -> source file of every pdserve module (pdserve.core.messages -> core/messages.py)."""
    modules = {}
    for root, folder in package_dirs().items():
        for path in (REPO_ROOT / folder).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT / folder).with_suffix("").parts
            modules[".".join((root, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return modules


def imported_names(node: ast.AST, module: str, is_package: bool, lazy: bool) -> Iterator[str]:
    """Dotted names a module's code imports: `import a.b` gives a.b, `from a import b` gives a.b and a (b may be a
    module or a name in a). lazy: also imports inside functions. Never those under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (n for c in child.orelse for n in imported_names(c, module, is_package, lazy))
            continue
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not lazy:
            continue
        if isinstance(child, ast.Import):
            yield from (alias.name for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            base = _absolute(child, module, is_package)
            yield base
            yield from (f"{base}.{alias.name}" for alias in child.names)
        else:
            yield from imported_names(child, module, is_package, lazy)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
    return ".".join([*parts, *([node.module] if node.module else [])])


def import_graph(lazy: bool) -> tuple[Graph, Graph]:
    """(module -> the pdserve modules it imports, module -> the outside top-level packages it imports)."""
    modules = package_modules()
    inside: Graph = {}
    outside: Graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        names = set(imported_names(tree, name, path.name == "__init__.py", lazy))
        inside[name] = {n for n in names if n in modules and n != name}
        outside[name] = {n.split(".")[0] for n in names if n and n.split(".")[0] != "pdserve"}
    return inside, outside


def find_cycle(graph: Graph) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_the_graph_reads_imports_at_module_level_only() -> None:
    eager, _ = import_graph(lazy=False)
    assert "pdserve.kvtransfer.shm" in eager["pdserve.kvtransfer.factory"]
    assert "pdserve.kernels.block_copy" not in eager["pdserve.kvtransfer.cuda_ipc"]  # a lazy import (CUDA only)
    lazy, _ = import_graph(lazy=True)
    assert "pdserve.kernels.block_copy" in lazy["pdserve.kvtransfer.cuda_ipc"]


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [({"a": {"b"}, "b": {"c"}, "c": set()}, None), ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "c", "b", "a"])],
)
def test_find_cycle_names_the_modules_of_a_cycle(graph: Graph, cycle: list[str] | None) -> None:
    found = find_cycle(graph)
    assert (found is None) == (cycle is None)
    assert found is None or sorted(set(found)) == sorted(set(cycle or []))


@pytest.mark.parametrize("lazy", [False, True])
def test_no_import_cycle_among_pdserve_modules(lazy: bool) -> None:
    """None through module-level imports, and none either when imports inside functions count."""
    graph, _ = import_graph(lazy=lazy)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_router_never_imports_torch() -> None:
    inside, outside = import_graph(lazy=True)
    reached = {name: [name] for name in inside if name.startswith("pdserve.router")}
    todo = list(reached)
    while todo:
        name = todo.pop()
        for dep in sorted(inside[name] - reached.keys()):
            reached[dep] = [*reached[name], dep]
            todo.append(dep)
    torch_users = [" -> ".join(path) for name, path in sorted(reached.items()) if "torch" in outside[name]]
    assert not torch_users, "router modules reach torch:\n" + "\n".join(torch_users)
