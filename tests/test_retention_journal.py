"""A retention deadline extended after the block's slot was written survives a restart.

The slot header holds the deadline the block was spilled with; a later request with a longer
TTL that matched the same content lengthens it while the block is on disk.  That extension is
appended to the retention journal next to the data file and replayed at open.
"""

from __future__ import annotations

from pathlib import Path

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from statekv.ids import BlockHash
from statekv.lifecycle import BlockState
from tests.io_helpers import compute, serve, small_config, wait_quiet, wait_ready

TTL_A = 600.0
TTL_B = 7200.0
PROMPT = [7000 + t for t in range(9)]
"""Two full blocks of 4 tokens, and one token more."""


def fillers(n: int) -> list[list[int]]:
    return [[100 * (p + 1) + t for t in range(17)] for p in range(n)]


def extend_on_disk(cfg: StateKVConfig) -> dict[BlockHash, float]:
    """Spill PROMPT's blocks with TTL_A, then extend them to TTL_B while they are on disk
    (another request's private duplicate, released with the longer TTL, stamps its cached
    twin).  Returns the extended deadlines, by key."""
    with BlockingCache(cfg) as cache:
        cache.add_request("a", PROMPT, ttl_seconds=TTL_A)
        cache.add_request("b", PROMPT, ttl_seconds=TTL_B)
        compute(cache, "a", PROMPT)
        compute(cache, "b", PROMPT)  # committed after "a": "b"'s blocks stay private
        cache.release("a")
        first = {blk.key: blk.expiry for blk in cache.cached_blocks()
                 if blk.expiry is not None}
        assert len(first) == 2
        for i, tokens in enumerate(fillers(6)):
            serve(cache, f"f{i}", tokens)
            wait_quiet(cache)
        states = {blk.key: blk.state for blk in cache.cached_blocks()}
        assert all(states[key] is BlockState.ON_DISK for key in first), states
        cache.release("b")
        wait_quiet(cache)
        extended = {blk.key: blk.expiry for blk in cache.cached_blocks() if blk.key in first}
        for key, expiry in extended.items():
            assert expiry is not None and expiry > first[key] + (TTL_B - TTL_A) / 2
        cache.check_invariants()
    return {key: expiry for key, expiry in extended.items() if expiry is not None}


def test_an_extended_deadline_of_a_block_on_disk_survives_a_clean_restart(
    tmp_path: Path,
) -> None:
    cfg = small_config(tmp_path, gpu=8, host=1, reserved_host=1, disk=32)
    extended = extend_on_disk(cfg)
    with BlockingCache(cfg) as cache:
        restored = {blk.key: blk for blk in cache.cached_blocks()}
        for key, expiry in extended.items():
            assert restored[key].state is BlockState.ON_DISK
            assert restored[key].expiry == expiry
        # ... and the block is served from its slot, byte for byte.
        match = cache.add_request("again", PROMPT)
        wait_ready(cache, "again")
        assert match.disk_tokens == 8
        cache.release("again")
