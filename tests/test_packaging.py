"""The wheel and the sdist build, and the wheel works in a fresh virtual environment.

The fresh environment gets the CPU build of torch first, as the Makefile installs it (a bare
`torch` requirement would pull a multi-GB CUDA build); the wheel's other dependencies come
from the package index.  Everything then runs from a directory outside the repository, so
nothing is imported from the source tree.  The wheel goes in without extras first (the
library and the demo run, `statekv serve` names its extra), then with the `serve` extra.

The library also imports here with the server's dependencies hidden (a finder that refuses
them), so a new hard import of FastAPI below the server fails in the quick run too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCH_CPU = "torch==2.13.0"
"""The Makefile's pin (see its comment)."""
SERVE_HINT = "pip install 'statekv[serve]'"
EXTRAS = {"metrics", "serve", "redis", "bench", "vllm", "cu12", "cu13", "test"}
SERVER_ONLY = ("fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "rich")
"""What the `serve` and `metrics` extras bring (and FastAPI's own parts)."""

HIDE_SERVER = f"""
import sys

class HideServer:
    # Stands first on sys.meta_path: an import of these fails as if they were not installed.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {SERVER_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, HideServer())
for name in list(sys.modules):
    assert name.partition(".")[0] not in {SERVER_ONLY!r}, name
"""
"""A prelude for `python -c`: what follows it runs as without the extras."""


def run(*args: str | Path, cwd: Path, timeout: float = 900,
        status: int = 0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False, env=env)
    assert done.returncode == status, (
        f"{args}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def assert_serve_hint(done: subprocess.CompletedProcess[str]) -> None:
    """`statekv serve` without its extra: one line naming the extra, no traceback."""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("statekv serve: error: ") and line.endswith(SERVE_HINT), line
    assert done.stdout == ""


def test_the_library_imports_without_the_servers_dependencies(tmp_path: Path) -> None:
    done = run(sys.executable, "-c", HIDE_SERVER + """
import tempfile

import io_actors, io_actors.vllm.settings, statekv, statekv_models
from io_actors import BlockingCache, StateKVConfig
from statekv import KVLayout

with tempfile.TemporaryDirectory() as disk_dir:
    config = StateKVConfig(
        layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32"),
        block_size=4, gpu=8, host=8, reserved_host=2, disk=16, disk_dir=disk_dir,
        model_fingerprint="packaging-test")
    with BlockingCache(config) as cache:
        cache.add_request("r", list(range(10)))
        cache.release("r")
try:
    import io_actors.metrics
except ModuleNotFoundError as exc:
    print(exc)
""", cwd=tmp_path)
    assert done.stdout.strip() == ("io_actors.metrics needs prometheus-client "
                                   "(prometheus_client is not installed): "
                                   "pip install 'statekv[metrics]'")


def test_serve_without_its_extra_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    command = HIDE_SERVER + "from statekv_serve.cli import main\nsys.exit(main(sys.argv[1:]))"
    assert_serve_hint(run(sys.executable, "-c", command, "serve", cwd=tmp_path, status=2))
    # --help needs nothing from the extra, and says what the command needs.
    assert SERVE_HINT in " ".join(
        run(sys.executable, "-c", command, "serve", "--help", cwd=tmp_path).stdout.split())


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_venv_and_runs(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # No isolation: the test extra's setuptools builds it, with nothing to download.
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, REPO, cwd=REPO)
    (wheel,) = dist.glob("statekv-*.whl")
    (sdist,) = dist.glob("statekv-*.tar.gz")
    names = set(zipfile.ZipFile(wheel).namelist())
    (metadata_file,) = (n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = Parser().parsestr(zipfile.ZipFile(wheel).read(metadata_file).decode())
    assert set(metadata.get_all("Provides-Extra") or []) == EXTRAS
    requires = metadata.get_all("Requires-Dist") or []
    plain = [r for r in requires if "extra ==" not in r]
    assert not [r for r in plain if r.startswith(("fastapi", "uvicorn", "prometheus", "rich"))]
    serve = {r.partition(";")[0].strip() for r in requires if 'extra == "serve"' in r}
    assert {"fastapi>=0.110", "uvicorn>=0.29", "statekv[metrics]"} <= serve
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

    # No extras: nothing of the server's is installed, and what needs none of it runs.
    absent = run(python, "-c", "import importlib.util as u; "
                 f"print([m for m in {SERVER_ONLY!r} if u.find_spec(m)])", cwd=outside)
    assert absent.stdout.strip() == "[]"
    statekv = env_dir / "bin" / "statekv"
    assert run(statekv, "--version", cwd=outside).stdout.strip() == "statekv 0.1.0"
    trace = outside / "run.jsonl"
    report = run(statekv, "demo", "--users", "2", "--rounds", "2", "--system-tokens", "16",
                 "--question-tokens", "8", "--answer-tokens", "4", "--trace", trace,
                 cwd=outside)
    assert "PASS: 4/4" in report.stdout
    assert "wrote" in run(statekv, "trace", "view", trace, cwd=outside).stdout  # packaged page
    assert (outside / "run.html").read_text().startswith("<!DOCTYPE html>")
    assert_serve_hint(run(statekv, "serve", cwd=outside, status=2))

    run(python, "-m", "pip", "install", "-q", f"{wheel}[serve]", cwd=outside)
    where = run(python, "-c", (
        "import io_actors.metrics, statekv, statekv_models, statekv_serve.server\n"
        "from io_actors import BlockingCache, StateKVConfig\n"
        "print(statekv.__file__)"), cwd=outside)
    assert Path(where.stdout.strip()).is_relative_to(env_dir)
