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
