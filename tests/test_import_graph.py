"""The repository's modules import each other without circles, and io_actors/'s layers only
import downward.

The graph is built from the source alone (``ast``, nothing imported), so a lazy import in a
branch no test runs counts as much as one at the top of a module.  Its nodes are the modules
of the repository's packages (statekv, io_actors, models, serve, fuzz, bench, specs, tests);
an arrow goes from a module to each repository module it imports, at module level or inside
a function.  Two kinds of import are left out, on purpose:

* imports under ``if TYPE_CHECKING:``: they never run, and exist precisely so that two
  modules can name each other's types without importing each other at run time;
* the packages Python initialises on the way to a module (``import io_actors.storage.posix``
  also runs ``io_actors/__init__.py`` and ``io_actors/storage/__init__.py``): the arrow goes to
  the module named.  ``io_actors/__init__.py`` re-exports the facades, which import the layers
  below; counting the parent packages would make that a circle with every module below it.
  ``from io_actors.storage import posix`` is an arrow to io_actors.storage.posix.

models/ and serve/ are installed as statekv_models and statekv_serve; imports of either name
are arrows to the same modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("statekv", "io_actors", "models", "serve", "fuzz", "bench", "specs", "tests")
INSTALLED_AS = {"statekv_models": "models", "statekv_serve": "serve"}


# ---------------------------------------------------------------------- the graph


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def repository_modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the packages: dotted name -> file."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(path, root)] = path
    return found


def _canonical(name: str) -> str:
    top, dot, rest = name.partition(".")
    return INSTALLED_AS.get(top, top) + dot + rest


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, except those under `if TYPE_CHECKING:` (their else runs)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(source: str, own: str, known: Iterable[str], *,
                     is_package: bool = False, filename: str = "<test>") -> set[str]:
    """The modules of `known` that the module `own` imports (see the module docstring)."""
    modules = set(known)

    def resolve(name: str) -> str | None:
        name = _canonical(name)
        while name and name not in modules:  # `import a.b.c` of a non-module: its package
            name = name.rpartition(".")[0]
        return name or None

    found: set[str] = set()
    for node in _import_nodes(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            targets = [resolve(alias.name) for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                package = own if is_package else own.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            base = _canonical(base)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                       else resolve(base) for alias in node.names]
        found.update(t for t in targets if t is not None and t != own)
    return found


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    modules = repository_modules(root)
    return {
        name: imported_modules(path.read_text(), name, modules,
                               is_package=path.name == "__init__.py", filename=str(path))
        for name, path in modules.items()
    }


def import_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm,
    iterative), as the modules in import order with the first repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    edges = {node: sorted(set(targets) & set(graph)) for node, targets in graph.items()}
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return [_circle_in(group, edges) for group in groups]


def _circle_in(group: list[str], edges: Mapping[str, list[str]]) -> list[str]:
    """A shortest circle from the group's first module back to itself (breadth first)."""
    members = set(group)
    start = group[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in edges[node]:
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{group} is not strongly connected")


GRAPH = import_graph()


def test_the_graph_covers_every_package_and_sees_lazy_imports() -> None:
    assert {name.partition(".")[0] for name in GRAPH} == set(PACKAGES)
    assert "io_actors.storage.posix" in GRAPH["io_actors.storage.open_store"]
    # open_slot_store imports the kvikio store inside the function, where kvikio is asked for.
    assert "io_actors.storage.kvikio_store" in GRAPH["io_actors.storage.open_store"]
    assert "io_actors.embed" in GRAPH["serve.engine"] | GRAPH["models.serving_loop"]


def test_no_module_imports_itself_through_others() -> None:
    cycles = import_cycles(GRAPH)
    assert cycles == [], "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# ---------------------------------------------------------------------- the check itself


KNOWN = ["a", "a.b", "a.c", "a.d", "p", "p.q", "statekv_like"]


@pytest.mark.parametrize(("source", "own", "expected"), [
    ("import a.b", "a.c", {"a.b"}),
    ("from a import b", "a.c", {"a.b"}),
    ("from a.b import thing", "a.c", {"a.b"}),
    ("from a import thing", "a.c", {"a"}),
    ("from . import b", "a.c", {"a.b"}),
    ("from .b import thing", "a.c", {"a.b"}),
    ("from .. import q", "p.x.y", {"p.q"}),
    ("def f():\n    import a.b\n", "a.c", {"a.b"}),
    ("import a.b.nonmodule", "a.c", {"a.b"}),
    ("import os, attrs", "a.c", set()),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\n", "a.c", set()),
    ("import typing\nif typing.TYPE_CHECKING:\n    import a.b\nelse:\n    import a.d\n",
     "a.c", {"a.d"}),
])
def test_imports_are_read_as_arrows(source: str, own: str, expected: set[str]) -> None:
    assert imported_modules(source, own, KNOWN) == expected


def test_installed_names_are_the_same_modules() -> None:
    assert imported_modules("from statekv_serve import cli", "models.demo",
                            ["serve", "serve.cli"]) == {"serve.cli"}


def test_a_planted_circle_is_found_and_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# ---------------------------------------------------------------------- io_actors' layers


FACADES = frozenset({"io_actors", "io_actors.config", "io_actors.embed", "io_actors.metrics"})
"""The modules users import, at the top of the package."""
SUBPACKAGES = ("actors", "memory", "storage", "tensor_parallel", "tracing", "vllm")
MAY_IMPORT: Mapping[str, frozenset[str]] = {
    "io_actors.storage": frozenset({"statekv"}),
    "io_actors.tracing": frozenset({"statekv"}),
    "io_actors.memory": frozenset({"io_actors.storage", "statekv"}),
    "io_actors.actors": frozenset({"io_actors.memory", "io_actors.storage", "io_actors.tracing",
                                   "statekv"}),
    "facades": frozenset({"io_actors.actors", "io_actors.memory", "io_actors.storage",
                          "io_actors.tracing", "statekv"}),
    "io_actors.tensor_parallel": frozenset({"facades", "io_actors.actors", "io_actors.memory",
                                            "io_actors.storage", "io_actors.tracing",
                                            "statekv"}),
    "io_actors.vllm": frozenset({"facades", "io_actors.tensor_parallel", "io_actors.actors",
                                 "io_actors.memory", "io_actors.storage", "io_actors.tracing",
                                 "statekv"}),
}
"""Each layer of io_actors/ and the layers below it that it may import (its own always).

Bottom to top: storage (bytes at rest, and the interfaces the actors call them through) and
tracing, side by side on the core; the memory pools, which implement storage's copy-engine
interface and hold page-aligned host buffers; the actors; the facades; tensor-parallel
agreement, which wraps a facade per rank; the vLLM connector, over all of them.  The
subpackages' docstrings say the same."""


def layer_of(module: str) -> str | None:
    """The io_actors layer of `module`, "statekv" for the core, None for anything else."""
    if module == "statekv" or module.startswith("statekv."):
        return "statekv"
    if module in FACADES:
        return "facades"
    parts = module.split(".")
    if parts[0] == "io_actors" and len(parts) >= 2 and parts[1] in SUBPACKAGES:
        return f"io_actors.{parts[1]}"
    return None


def upward_imports(graph: Mapping[str, Iterable[str]]) -> list[str]:
    found: list[str] = []
    for module, targets in sorted(graph.items()):
        own = layer_of(module)
        if own is None or own == "statekv":
            continue
        for target in sorted(targets):
            layer = layer_of(target)
            if layer is not None and layer != own and layer not in MAY_IMPORT[own]:
                found.append(f"{module} ({own}) imports {target} ({layer})")
    return found


def test_every_module_of_io_actors_is_in_a_layer() -> None:
    io_modules = [m for m in GRAPH if m.partition(".")[0] == "io_actors"]
    assert [m for m in io_modules if layer_of(m) is None] == []
    assert {layer_of(m) for m in io_modules} == set(MAY_IMPORT)


def test_the_layers_of_io_actors_only_import_downward() -> None:
    assert upward_imports(GRAPH) == []


def test_each_layer_says_what_it_owns_and_may_import() -> None:
    for name in SUBPACKAGES:
        init = REPO / "io_actors" / name / "__init__.py"
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree)
        assert doc and "import" in doc, f"{init}: no docstring naming what it may import"
        # Importing one module of a layer must not load the whole layer.
        assert not any(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(tree)), init


@pytest.mark.parametrize(("module", "target"), [
    ("io_actors.storage.posix", "io_actors.memory.pools"),
    ("io_actors.storage.record_file", "io_actors.tracing.recorder"),
    ("io_actors.tracing.recorder", "io_actors.storage.slot_format"),
    ("io_actors.memory.pools", "io_actors.actors.scheduler"),
    ("io_actors.actors.scheduler", "io_actors.embed"),
    ("io_actors.embed", "io_actors.tensor_parallel.agreement"),
])
def test_a_planted_upward_import_is_caught(module: str, target: str) -> None:
    assert upward_imports({module: {target}}) != []


@pytest.mark.parametrize(("module", "target"), [
    ("io_actors.memory.pools", "io_actors.storage.interfaces"),
    ("io_actors.actors.scheduler", "io_actors.tracing.recorder"),
    ("io_actors.embed", "io_actors.actors.scheduler"),
    ("io_actors.tensor_parallel.agreement", "io_actors.embed"),
    ("io_actors.storage.posix", "io_actors.storage.posix_open"),
])
def test_downward_imports_pass(module: str, target: str) -> None:
    assert upward_imports({module: {target}}) == []
