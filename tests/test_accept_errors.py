"""`statekv serve` short of file descriptors: asyncio's accept errors are rate-limited."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serve.accept_errors import (
    ACCEPT_ERROR,
    ACCEPT_RETRY_FAILED,
    AcceptErrorLimit,
    accept_errors_limited,
)

REPO = Path(__file__).resolve().parent.parent


def record(msg: str, exc: bool = True) -> logging.LogRecord:
    info = (OSError, OSError(24, "Too many open files"), None) if exc else None
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, info)


def test_the_first_accept_error_passes_then_one_per_interval_with_a_count() -> None:
    now = [0.0]
    limit = AcceptErrorLimit(10.0, clock=lambda: now[0])
    first = record(ACCEPT_ERROR)
    assert limit.filter(first) and first.exc_info is not None  # the traceback, once
    for t in range(1, 10):
        now[0] = float(t)
        assert not limit.filter(record(ACCEPT_ERROR))
    assert limit.held_back == 9
    now[0] = 10.5
    again = record(ACCEPT_ERROR)
    assert limit.filter(again)
    assert again.exc_info is None and "9 more" in again.getMessage()
    assert limit.filter(record("something else entirely"))  # other records untouched


def test_the_filter_is_on_asyncios_logger_only_while_serving() -> None:
    logger = logging.getLogger("asyncio")
    with accept_errors_limited() as limit:
        assert limit in logger.filters
    assert limit not in logger.filters


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_NOFILE semantics of Linux")
def test_a_server_out_of_file_descriptors_logs_a_few_lines_not_megabytes(
    tmp_path: Path,
) -> None:
    """The real server under a descriptor limit it reaches once it listens: clients keep
    connecting for a few seconds; its log stays small."""
    limit_script = (
        "import resource, sys, socket\n"
        "from serve.cli import main\n"
        "import serve.server as server\n"
        "real = server._serve_until_stopped\n"
        "def tight(*args, **kwargs):\n"
        "    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "    import os; used = len(os.listdir('/proc/self/fd'))\n"
        "    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 40, hard))\n"
        "    return real(*args, **kwargs)\n"
        "server._serve_until_stopped = tight\n"
        "sys.exit(main())\n"
    )
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        process = subprocess.Popen(
            [sys.executable, "-c", limit_script, "serve", "--port", "0", "--host",
             "127.0.0.1", "--disk-blocks", "64"], cwd=REPO, text=True,
            stdout=subprocess.PIPE, stderr=err, env={**os.environ, "TMPDIR": str(tmp_path)},
        )
        assert process.stdout is not None
        try:
            line = process.stdout.readline()
            assert "http://127.0.0.1:" in line, line
            port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
            held: list[socket.socket] = []
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
                except OSError:
                    time.sleep(0.05)
            for s in held:
                s.close()
        finally:
            process.terminate()
            process.wait(60)
    text = log.read_text()
    assert text.count(ACCEPT_ERROR) >= 1, text[-2000:]
    assert text.count(ACCEPT_RETRY_FAILED) <= 3
    assert len(text) < 50_000, f"{len(text)} bytes of log"
