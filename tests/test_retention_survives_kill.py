"""README, "What survives a restart": content released with a TTL is written to disk at its
release while it stays on GPU, so a kill -9 right after that write landed loses none of it --
the next process serves it from disk, with its deadline -- and without the write-through
(``retention_write_through=False``) the same kill loses it, which is why it is the default.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fuzz.crash import BLOCK_SIZE, serve_checked, workload_config
from io_actors.embed import BlockingCache

PROMPT = [7_000_000 + t for t in range(4 * BLOCK_SIZE + 1)]
TTL = 3600.0

CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from fuzz.crash import serve_checked, workload_config
    from io_actors.embed import BlockingCache

    through = sys.argv[2] == "on"
    config = workload_config(Path(sys.argv[1]), gpu=12, host=8, disk=16,
                             retention_write_through=through)
    cache = BlockingCache(config)
    prompt = [int(t) for t in sys.argv[3].split(",")]
    assert serve_checked(cache, "paid", prompt, float(sys.argv[4])) == 0
    deadline = time.monotonic() + 30
    while through and cache.statistics().cache.spills_completed < 4:
        assert time.monotonic() < deadline, cache.statistics().cache
        time.sleep(0.01)
    states = sorted({b.state.name for b in cache.cached_blocks()})
    print("released", ",".join(states), flush=True)
    time.sleep(600)
""")


def _serve_then_kill(directory: Path, through: bool) -> tuple[str, float]:
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), "on" if through else "off",
         ",".join(map(str, PROMPT)), str(TTL)],
        stdout=subprocess.PIPE, text=True, cwd=root,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        released_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert line.startswith("released "), line
    return line.split()[1], released_at


@pytest.mark.parametrize("through", [True, False], ids=["write-through", "without"])
def test_retained_content_on_gpu_survives_kill_9_once_its_write_landed(
    tmp_path: Path, through: bool
) -> None:
    directory = tmp_path / "cache"
    states, released_at = _serve_then_kill(directory, through)
    # When the child was killed the content was still on GPU (no eviction wrote it).
    assert states == "RELEASED"
    with BlockingCache(workload_config(directory, gpu=12, host=8, disk=16)) as cache:
        restored = cache.statistics().cache.restored_blocks
        match = cache.add_request("again", PROMPT)
        cache.release("again")
        if not through:
            assert (restored, match.disk_tokens) == (0, 0)
            return
        assert restored == 4
        assert match.disk_tokens == 4 * BLOCK_SIZE
        # Served with the right bytes, and the deadline of the paid promise kept.
        assert serve_checked(cache, "check", PROMPT, None) == 0
        expiries = {b.expiry for b in cache.cached_blocks() if b.expiry is not None}
        assert len(expiries) == 1
        (expiry,) = expiries
        assert released_at - 60 < expiry - TTL < released_at + 1
