"""The core is sans-IO: statekv/ imports only the standard library and attrs.

Every module of the package is parsed and its syntax tree walked, so the rule holds for code
paths that no test runs (a lazy import inside a rarely taken branch counts too).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import statekv

PACKAGE_DIR = Path(statekv.__file__).parent
MODULES = sorted(PACKAGE_DIR.glob("*.py"))

THIRD_PARTY_ALLOWED = frozenset({"attrs"})
FORBIDDEN_MODULES = frozenset({
    "trio", "torch", "threading", "_thread", "asyncio", "socket", "subprocess", "random",
    "time", "multiprocessing", "concurrent", "selectors", "secrets", "signal",
})
FORBIDDEN_ATTRIBUTES = frozenset({
    ("os", "environ"), ("os", "environb"), ("os", "getenv"), ("os", "putenv"),
    ("os", "open"), ("io", "open"), ("datetime", "now"), ("datetime", "utcnow"),
    ("datetime", "today"), ("date", "today"),
})
FORBIDDEN_CALLS = frozenset({"open", "input", "breakpoint"})


def _top(name: str) -> str:
    return name.partition(".")[0]


def violations(source: str, filename: str = "<test>") -> list[str]:
    """Every layering rule `source` breaks, as readable lines."""
    tree = ast.parse(source, filename)
    found: list[str] = []

    def check_module(name: str, line: int) -> None:
        top = _top(name)
        if top in FORBIDDEN_MODULES:
            found.append(f"{filename}:{line}: imports {name}")
        elif top == "statekv" or top in THIRD_PARTY_ALLOWED:
            pass
        elif top not in sys.stdlib_module_names:
            found.append(f"{filename}:{line}: imports third-party {name}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check_module(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside the package
                continue
            assert node.module is not None
            check_module(node.module, node.lineno)
            for alias in node.names:
                if (_top(node.module), alias.name) in FORBIDDEN_ATTRIBUTES:
                    found.append(f"{filename}:{node.lineno}: imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Attribute):
            # `os.environ`, and `datetime.datetime.now` by its last two names.
            base = node.value
            owner = base.id if isinstance(base, ast.Name) else (
                base.attr if isinstance(base, ast.Attribute) else None
            )
            if (owner, node.attr) in FORBIDDEN_ATTRIBUTES:
                found.append(f"{filename}:{node.lineno}: uses {owner}.{node.attr}")
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in FORBIDDEN_CALLS | {"__import__"}
        ):
            found.append(f"{filename}:{node.lineno}: calls {node.func.id}()")
    return found


def test_the_package_has_the_modules_this_test_walks() -> None:
    names = {path.stem for path in MODULES}
    assert {"__init__", "manager", "lifecycle", "pools", "hashing", "config"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_module_imports_only_stdlib_and_attrs_and_does_no_io(path: Path) -> None:
    assert violations(path.read_text(), path.name) == []


@pytest.mark.parametrize(
    "source",
    [
        "import trio",
        "import torch.cuda",
        "from threading import Lock",
        "import asyncio",
        "import socket",
        "import subprocess",
        "import random",
        "from random import random as r",
        "import time",
        "from time import monotonic",
        "import os\nx = os.environ['A']",
        "import os\nx = os.getenv('A')",
        "from os import environ",
        "import datetime\nx = datetime.datetime.now()",
        "with open('x') as f:\n    pass",
        "import numpy",
        "from cupy import ndarray",
        "import multiprocessing.pool",
        "from concurrent.futures import ThreadPoolExecutor",
        "m = __import__('trio')",
    ],
)
def test_layering_check_catches_a_planted_violation(source: str) -> None:
    assert violations(source) != []


@pytest.mark.parametrize(
    "source",
    [
        "import attrs",
        "import hashlib, math, enum",
        "from collections.abc import Sequence",
        "from statekv.errors import UsageError",
        "from . import ids",
        "from __future__ import annotations",
        "import os.path",
    ],
)
def test_layering_check_accepts_what_the_core_may_use(source: str) -> None:
    assert violations(source) == []


def test_importing_the_core_loads_no_io_framework() -> None:
    """Run in a fresh interpreter: nothing the core imports pulls in an I/O framework."""
    modules = ", ".join(repr(f"statekv.{p.stem}") for p in MODULES if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        f"for name in [{modules}]:\n"
        "    importlib.import_module(name)\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=PACKAGE_DIR.parent,
    ).stdout.split()
    loaded = {_top(name) for name in out}
    assert "statekv" in loaded
    assert loaded.isdisjoint({"trio", "torch", "asyncio", "socket", "subprocess", "random",
                              "numpy", "cupy", "kvikio", "io_actors"})


# ---------------------------------------------------------------------- the layers above


REPO = PACKAGE_DIR.parent
LAYERS = {"statekv": 0, "io_actors": 1, "models": 2, "serve": 3}
"""Bottom to top: the core, the actors, the model and serving loop, the command and server.
A module may import its own layer and the layers below, never one above."""
INSTALLED_AS = {"statekv_models": "models", "statekv_serve": "serve"}
"""models/ and serve/ are installed under these names."""


def _layer_of(name: str) -> str | None:
    top = _top(name)
    top = INSTALLED_AS.get(top, top)
    return top if top in LAYERS else None


def upward_references(source: str, own: str, filename: str = "<test>") -> list[str]:
    """Imports of a layer above `own`, and strings naming one (an import by name, as
    importlib.import_module("statekv_models.demo") would make, hides from import
    statements)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.partition(".")[0] in INSTALLED_AS else []
        for name in names:
            layer = _layer_of(name)
            if layer is not None and LAYERS[layer] > LAYERS[own]:
                found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {own} reaches up "
                             f"into {layer} ({name})")
    return found


LAYER_MODULES = [(layer, path) for layer in LAYERS if layer != "statekv"
                 for path in sorted((REPO / layer).rglob("*.py"))]


@pytest.mark.parametrize(("layer", "path"), LAYER_MODULES,
                         ids=lambda x: str(x.relative_to(REPO)) if isinstance(x, Path) else x)
def test_no_module_reaches_up_a_layer(layer: str, path: Path) -> None:
    assert upward_references(path.read_text(), layer, path.name) == []


def test_every_layer_is_walked() -> None:
    walked = {layer for layer, _path in LAYER_MODULES}
    assert walked == {"io_actors", "models", "serve"}
    assert any(path.name == "cli.py" for layer, path in LAYER_MODULES if layer == "serve")


@pytest.mark.parametrize(("source", "own"), [
    ("import models", "io_actors"),
    ("from statekv_models.demo import run", "io_actors"),
    ("import importlib\nimportlib.import_module('statekv_models.demo')", "io_actors"),
    ("from serve.cli import main", "models"),
    ("from statekv_serve import server", "io_actors"),
    ("x = 'statekv_serve.cli:main'", "models"),
])
def test_the_layer_check_catches_a_planted_upward_reference(source: str, own: str) -> None:
    assert upward_references(source, own) != []


@pytest.mark.parametrize(("source", "own"), [
    ("from io_actors.embed import BlockingCache", "models"),
    ("from statekv_models import demo", "serve"),
    ("from models import serving_loop", "serve"),
    ("from statekv.errors import UsageError", "io_actors"),
    ("from . import engine", "serve"),
])
def test_the_layer_check_accepts_downward_imports(source: str, own: str) -> None:
    assert upward_references(source, own) == []
