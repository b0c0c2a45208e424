"""The README's examples run as written: the embedding example (leaving nothing behind), and
the server examples against `statekv serve` (on a free port rather than 8000)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_cli import popen_with_ctrl_c

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_example_runs_and_cleans_up(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    # Its temporary directory goes under tmp_path, which must be empty again afterwards
    # (the example once left a 72 MiB slot file behind).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert isinstance(namespace["disk_dir"], str)
    assert namespace["disk_dir"].startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def _fenced(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """`statekv serve` as the README starts it, on a free port instead of 8000."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    statekv = Path(sys.executable).parent / "statekv"
    server = popen_with_ctrl_c(
        [str(statekv), "serve", "--port", str(port), "--device", "cpu",
         "--disk-dir", str(tmp_path_factory.mktemp("slots")), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None, server.communicate()[1]
            assert time.monotonic() < deadline, "statekv serve did not start"
            time.sleep(0.1)
        yield port
    finally:
        server.send_signal(signal.SIGINT)
        _out, err = server.communicate(timeout=60)
        assert server.returncode == 130, err
        assert "Traceback" not in err


def test_the_readme_openai_example_runs(readme_server: int,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    (example,) = [block for block in _fenced("python") if "OpenAI(" in block]
    code = example.replace("127.0.0.1:8000", f"127.0.0.1:{readme_server}")
    exec(compile(code, str(README), "exec"), {"__name__": "readme_openai"})
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2
    (first_prompt, first_cached), (_second_prompt, second_cached) = (
        (int(a), int(b)) for a, b in lines)
    assert first_cached == 0 and second_cached >= first_prompt // 2


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_the_readme_curl_example_runs(readme_server: int) -> None:
    (example,) = [block for block in _fenced("sh") if "curl" in block]
    script = example.replace("127.0.0.1:8000", f"127.0.0.1:{readme_server}")
    done = subprocess.run(["bash", "-eo", "pipefail", "-c", script], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    completion, _end = json.JSONDecoder().raw_decode(done.stdout)
    assert completion["usage"]["completion_tokens"] == 8
    assert 'statekv_prompt_tokens_total{model_name="statekv-tiny",tier="disk"}' in done.stdout


def test_the_readme_configuration_example_runs(tmp_path: Path) -> None:
    """The Configuration section's serve.toml and shell lines, as written but for the slot
    directory and the port: the server reports the blocks its comments say, and the context
    length the environment gave over the file's."""
    (config,) = _fenced("toml")
    (shell,) = [block for block in _fenced("sh") if "--config serve.toml" in block]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    assert 'disk_dir = "/var/cache/statekv"' in config and "port = 8000" in config
    (tmp_path / "serve.toml").write_text(
        config.replace("/var/cache/statekv", str(tmp_path / "slots"))
        .replace("port = 8000", f"port = {port}"))
    # This source tree's command (an installed `statekv` may be another tree's), run in the
    # directory of serve.toml as the example is.
    command = f"exec {sys.executable} -c 'import sys; from serve.cli import main; sys.exit(main())'"
    script = shell.replace("statekv serve", f"{command} serve")
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("STATEKV_")}
    env["PYTHONPATH"] = str(README.parent)
    server = popen_with_ctrl_c(["bash", "-ec", script], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert server.stdout is not None
    try:
        first = server.stdout.readline()
        assert first.startswith(f"statekv serve: statekv-tiny (tiny) on "
                                f"http://127.0.0.1:{port}/v1"), first + server.communicate()[1]
        blocks = {int(n) for n in re.findall(r"# (\d+) (?:blocks|slots)", config)}
        assert blocks == {8192, 1024, 128, 32768}
        assert "GPU 8192 blocks, host 1024+128, disk 32768 blocks of 16 tokens" in first, first
        (model,) = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"]
        assert model["max_model_len"] == 4096  # STATEKV_MAX_MODEL_LEN over the file's 2048
    finally:
        server.send_signal(signal.SIGINT)
        _out, err = server.communicate(timeout=60)
    assert server.returncode == 130, err
    # --log-level warning over the file's info: uvicorn's startup lines are not printed.
    assert "Application startup complete" not in err and "Traceback" not in err, err
