"""statekv's connector under vLLM's OpenAI-compatible server, driven by the `openai` client as
a user would: token-id prompts to `/v1/completions`, the TTL in `extra_body`, the counters on
`/metrics`, and a restart on the same disk directory.

What vLLM 0.32's server does with the connector's results (`entrypoints/openai/completion/`):
the dict `request_finished` returns is the response's top-level `kv_transfer_params` (of the
first prompt); `usage.prompt_tokens_details.cached_tokens` (vLLM's own prefix hit plus the
connector's tokens) is reported only with `--enable-prompt-tokens-details`; with
`--skip-tokenizer-init` the choice's `text` is empty and `return_token_ids` (in `extra_body`)
puts the generated ids in the choice's `token_ids`.

Two server starts in all (the first serves every test up to the restart), each ~20 s here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from io_actors.vllm.scheduler_side import ERROR_PARAM
from tests.vllm import engine

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
BS = engine.BLOCK_SIZE
PROMPT = engine.prompt_ids(7 * BS + 5, seed=21)        # 7 full blocks
OTHER = engine.prompt_ids(3 * BS + 2, seed=22)         # 3 full blocks
STARTUP_S = 240


class Server:
    """One `python -m vllm.entrypoints.openai.api_server` in a process group of its own."""

    def __init__(self, model_dir: Path, disk_dir: Path, log: Path) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        extra = {"host": 64, "disk": 256, "disk_dir": str(disk_dir)}
        kv = engine.kv_transfer_config("io_actors.vllm.connector", "StateKVConnector", extra,
                                       kv_load_failure_policy="recompute")
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
            "--block-size", str(BS), "--max-model-len", str(engine.MAX_MODEL_LEN),
            "--seed", "0", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(kv),
        ]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   # The engine-core process imports the connector by module path.
                   PYTHONPATH=os.pathsep.join(
                       p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        with open(log, "ab") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        import openai

        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused",
                                    max_retries=0, timeout=120)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"vLLM's server exited ({self.process.returncode}) before it was "
                            f"healthy; its log ends:\n{self.log_tail()}")
            with (contextlib.suppress(OSError),
                  urllib.request.urlopen(f"{self.base}/health", timeout=2) as r):
                if r.status == 200:
                    return
            time.sleep(0.5)
        pytest.fail(f"vLLM's server not healthy within {STARTUP_S} s; its log ends:\n"
                    f"{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        """The log's last lines, after its last error lines (a failed engine's traceback
        runs past a short tail)."""
        text = self.log.read_text(errors="replace")
        errors = [line for line in text.splitlines() if "Error:" in line][-5:]
        return "\n".join([*errors, "...", text[-chars:]]) if errors else text[-chars:]

    def complete(self, prompt: list[int], *, max_tokens: int = 4,
                 kv_transfer_params: dict[str, Any] | None = None) -> Any:
        body: dict[str, Any] = {"return_token_ids": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return self.client.completions.create(model=MODEL, prompt=prompt,
                                              max_tokens=max_tokens, temperature=0,
                                              extra_body=body)

    def metric(self, name: str) -> float:
        """A sample of `/metrics` as Prometheus text serves it (0 if not there yet)."""
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def settle(self, name: str, at_least: float) -> float:
        """Short requests until `/metrics` shows `name` >= at_least: a finished request's
        save runs in the engine's next step, and the server steps only while it has work."""
        value = self.metric(name)
        for _ in range(20):
            if value >= at_least:
                break
            self.complete([1, 2, 3], max_tokens=1)
            value = self.metric(name)
        return value

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        # The engine core and workers share the group: none may outlive the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def tokens(response: Any) -> list[int]:
    ids = response.choices[0].token_ids
    assert ids is not None, response
    return [int(t) for t in ids]


def cached_tokens(response: Any) -> int:
    details = response.usage.prompt_tokens_details
    assert details is not None, response.usage
    return int(details.cached_tokens or 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return engine.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("statekv")


@pytest.fixture(scope="module")
def server(model_dir: Path, disk_dir: Path) -> Iterator[Server]:
    """The first server on `disk_dir`; the restart test stops it."""
    running = Server(model_dir, disk_dir, disk_dir.parent / "server-1.log")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def first(server: Server) -> dict[str, Any]:
    """PROMPT on the first server, computed from scratch, with a TTL statekv takes."""
    response = server.complete(PROMPT, kv_transfer_params={"kv_cache_ttl_seconds": 600})
    return {"tokens": tokens(response), "cached": cached_tokens(response),
            "params": response.kv_transfer_params}


def test_a_completion_with_a_ttl_runs_and_a_bad_ttl_is_reported_in_the_response(
        server: Server, first: dict[str, Any]) -> None:
    assert len(first["tokens"]) == 4 and first["cached"] == 0
    assert first["params"] is None               # nothing refused, nothing to say
    bad = server.complete(OTHER, kv_transfer_params={"kv_cache_ttl_seconds": -1})
    assert len(tokens(bad)) == 4                 # the request itself ran
    params = bad.kv_transfer_params              # the response's top-level field
    assert params is not None and "kv_cache_ttl_seconds" in params[ERROR_PARAM], params
    assert "got -1" in params[ERROR_PARAM]
    assert "kv_cache_ttl_seconds: must be" in server.log.read_text()   # and in the log


def test_metrics_serves_statekvs_counters(server: Server, first: dict[str, Any]) -> None:
    for _ in range(2):                           # earlier requests' saves run first
        server.complete([1, 2, 3], max_tokens=1)
    before = server.metric("vllm:statekv_host_offloads_total")
    server.complete(engine.prompt_ids(2 * BS + 1, seed=23), max_tokens=2)
    after = server.settle("vllm:statekv_host_offloads_total", before + 2)
    assert after == before + 2                   # the new prompt's two full blocks
    # Write-through: every block copied to host is written to disk too.
    assert server.settle("vllm:statekv_spills_completed_total", after) == after


def test_after_a_restart_the_prefix_comes_from_disk_and_the_tokens_are_the_same(
        server: Server, first: dict[str, Any], model_dir: Path, disk_dir: Path) -> None:
    # Every full block of PROMPT on disk before the server goes (the last step's saves
    # would not be: vLLM gives the connector no step after its last request).
    assert server.settle("vllm:statekv_spills_completed_total", 7) >= 7
    server.stop()
    second = Server(model_dir, disk_dir, disk_dir.parent / "server-2.log")
    try:
        again = second.complete(PROMPT)
        disk_hits = second.metric("vllm:statekv_hit_blocks_disk_total")
    finally:
        second.stop()
    assert tokens(again) == first["tokens"]
    assert cached_tokens(again) == 7 * BS        # a fresh vLLM: all of it from statekv's disk
    assert disk_hits == 7
