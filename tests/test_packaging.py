"""The wheel and the sdist build, and the wheel works in a fresh virtual environment.

The fresh environment gets the CPU build of torch first, as the Makefile installs it (a bare
`torch` requirement would pull a multi-GB CUDA build); the wheel's other dependencies come
from the package index.  Everything then runs from a directory outside the repository, so
nothing is imported from the source tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCH_CPU = "torch==2.13.0"
"""The Makefile's pin (see its comment)."""


def run(*args: str | Path, cwd: Path, timeout: float = 900) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False, env=env)
    assert done.returncode == 0, f"{args}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_venv_and_runs(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # No isolation: the test extra's setuptools builds it, with nothing to download.
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, REPO, cwd=REPO)
    (wheel,) = dist.glob("statekv-*.whl")
    (sdist,) = dist.glob("statekv-*.tar.gz")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("statekv/manager.py", "io_actors/tracing/trace_view.html",
                   "io_actors/metrics.py", "io_actors/actors/scheduler.py",
                   "io_actors/memory/pools.py",
                   "io_actors/storage/posix.py", "io_actors/tensor_parallel/agreement.py",
                   "statekv_models/serving_loop.py", "statekv_serve/cli.py",
                   "statekv_serve/server.py", "statekv_serve/py.typed"):
        assert module in names
    assert not any(name.startswith(("models/", "serve/", "tests/")) for name in names)
    with tarfile.open(sdist) as archive:
        members = {m.name.partition("/")[2] for m in archive.getmembers()}
    assert {"pyproject.toml", "README.md", "serve/cli.py", "models/demo.py"} <= members

    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    run(python, "-m", "pip", "install", "-q", TORCH_CPU, cwd=outside)
    run(python, "-m", "pip", "install", "-q", wheel, cwd=outside)

    statekv = env_dir / "bin" / "statekv"
    assert run(statekv, "--version", cwd=outside).strip() == "statekv 0.1.0"
    trace = outside / "run.jsonl"
    report = run(statekv, "demo", "--users", "2", "--rounds", "2", "--system-tokens", "16",
                 "--question-tokens", "8", "--answer-tokens", "4", "--trace", trace,
                 cwd=outside)
    assert "PASS: 4/4" in report
    assert "wrote" in run(statekv, "trace", "view", trace, cwd=outside)  # packaged page
    assert (outside / "run.html").read_text().startswith("<!DOCTYPE html>")
    where = run(python, "-c", (
        "import io_actors.metrics, statekv, statekv_models, statekv_serve.server\n"
        "from io_actors import BlockingCache, StateKVConfig\n"
        "print(statekv.__file__)"), cwd=outside)
    assert Path(where.strip()).is_relative_to(env_dir)
