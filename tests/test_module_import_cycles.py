"""No import cycle between the modules of any package (read statically with `ast`).

tests/test_dependency_graph.py checks the packages' declared dependencies;
this checks the modules inside each package. Every import counts: at module
level, under `if TYPE_CHECKING:` and inside a function. A cycle hidden in a
function or behind TYPE_CHECKING is still two modules that each need the
other; the fix is a third module both depend on, never a deferred import.

An edge goes from a module to the module it names: `from a.b import c` is an
edge to `a.b.c` when that is a module, else to `a.b`. The parent packages
that Python initialises on the way (`a/__init__.py`) are not edges: a package
`__init__` that re-exports its submodules would otherwise make a cycle of
every submodule that imports a sibling.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

Graph = dict[str, set[str]]


def _module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _target(name: str, modules: set[str]) -> str | None:
    """The longest prefix of the dotted `name` that is one of `modules`."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names one import statement may refer to (most specific first per alias)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        # Relative: level 1 is the module's own package.
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{alias.name}" for alias in node.names]


def import_graph(src: Path) -> Graph:
    """Module -> the modules under `src` it imports, anywhere in its body."""
    files = {_module_name(src, p): p for p in sorted(src.rglob("*.py"))}
    modules = set(files)
    graph: Graph = {m: set() for m in modules}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported(node, module, path.name == "__init__.py"):
                target = _target(name, modules)
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None if `graph` is acyclic (iterative DFS)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def _package_srcs() -> list[Path]:
    srcs = sorted(p / "src" for p in (ROOT / "packages").iterdir() if (p / "src").is_dir())
    return [*srcs, ROOT / "kernels" / "src"]


@pytest.mark.parametrize("src", _package_srcs(), ids=lambda p: p.parent.name)
def test_package_modules_import_no_cycle(src: Path) -> None:
    graph = import_graph(src)
    assert len(graph) > 1, f"no modules found under {src}"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    "back_edge",
    [
        "from pkg.a import A\n",
        "import pkg.a\n",
        "from . import a\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        "def f() -> None:\n    from .a import A\n",
    ],
    ids=["from", "import", "relative", "type-checking", "function-local"],
)
def test_every_kind_of_import_closes_a_cycle(tmp_path: Path, back_edge: str) -> None:
    src = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n",
            "pkg/a.py": "from pkg.sub.b import B\nA = 1\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": back_edge.replace("from . import a", "from .. import a").replace(
                "from .a import", "from ..a import"
            )
            + "B = 2\n",
        },
    )
    assert find_cycle(import_graph(src)) == ["pkg.a", "pkg.sub.b", "pkg.a"]


def test_parent_package_and_stdlib_imports_are_not_edges(tmp_path: Path) -> None:
    src = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\nfrom pkg.b import B\n",
            "pkg/a.py": "import os\nA = 1\n",
            "pkg/b.py": "from pkg.a import A\nB = A\n",
        },
    )
    graph = import_graph(src)
    assert graph == {"pkg": {"pkg.a", "pkg.b"}, "pkg.a": set(), "pkg.b": {"pkg.a"}}
    assert find_cycle(graph) is None
