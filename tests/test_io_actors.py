"""Integration tests of the actors over real files and real torch copies (CPU tensors here;
the same code path runs with CUDA on the GPU machine)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import trio

from io_actors.embed import BlockingCache, open_cache
from statekv.messages import (
    Completion,
    is_read,
    outcomes,
)
from tests.io_helpers import (
    check_pages,
    compute,
    serve,
    small_config,
    wait_quiet,
    wait_ready,
)


class HoldReads:
    """A completion gate that holds every read completion until released."""

    def __init__(self) -> None:
        self.held: list[tuple[Completion, trio.Event]] = []
        self.token: trio.lowlevel.TrioToken | None = None

    def blocks(self) -> int:
        """Block reads held (a batch holds several)."""
        return sum(len(outcomes(completion)) for completion, _event in self.held)

    async def hold(self, completion: Completion) -> None:
        if is_read(completion):
            self.token = trio.lowlevel.current_trio_token()
            event = trio.Event()
            self.held.append((completion, event))
            await event.wait()

    def release_all(self) -> None:
        assert self.token is not None
        held, self.held = self.held, []
        for _completion, event in held:
            self.token.run_sync_soon(event.set)


def churn(cache: BlockingCache, rounds: int, start: int = 1000) -> None:
    """Serve never-seen prompts, waiting for spills to land, to push content to disk."""
    for i in range(rounds):
        serve(cache, f"churn{start + i}", [start * 10 + i * 100 + t for t in range(17)])
        wait_quiet(cache)


def test_spill_then_onboard_returns_identical_kv(tmp_path: Path) -> None:
    prompt = list(range(13))  # three full blocks of 4 and one token
    with BlockingCache(small_config(tmp_path)) as cache:
        serve(cache, "first", prompt)
        churn(cache, 6)
        match = cache.add_request("again", prompt)
        assert match.disk_tokens == 12, match
        wait_ready(cache, "again")
        check_pages(cache, "again", prompt, 3)
        cache.release("again")
        stats = cache.statistics()
        assert stats.cache.onboards_completed == 3
        assert stats.cache.bytes_read == 3 * cache.config.block_bytes
        assert stats.cache.io_errors == 0
        cache.check_invariants()


def test_release_during_onboard_keeps_the_page_until_the_read_lands(tmp_path: Path) -> None:
    gate = HoldReads()
    prompt = list(range(13))
    with BlockingCache(small_config(tmp_path), gate=gate) as cache:
        serve(cache, "first", prompt)
        churn(cache, 6)
        match = cache.add_request("again", prompt)
        assert match.disk_tokens == 12
        # Wait until the reads have really been done and their completions are held.
        for _ in range(5000):
            if gate.blocks() == 3:
                break
            threading.Event().wait(0.001)
        assert gate.blocks() == 3
        cache.release("again")
        stats = cache.statistics().cache
        assert stats.reads_in_flight == 3
        states = dict(stats.blocks_by_state)
        assert states["ONBOARDING"] == 3
        cache.check_invariants()
        gate.release_all()
        wait_quiet(cache)
        # The content landed and is cached on GPU: a new request shares it.
        match = cache.add_request("third", prompt)
        assert match.gpu_tokens == 12
        check_pages(cache, "third", prompt, 3)
        cache.release("third")
        cache.check_invariants()


def test_close_with_reads_in_flight_reports_and_leaves_no_threads(tmp_path: Path) -> None:
    gate = HoldReads()
    prompt = list(range(13))
    cache = BlockingCache(small_config(tmp_path), gate=gate)
    serve(cache, "first", prompt)
    churn(cache, 6)
    cache.add_request("again", prompt)
    for _ in range(5000):
        if gate.blocks() == 3:
            break
        threading.Event().wait(0.001)
    gate.release_all()  # completions may be reported while closing
    report = cache.close(drain=True)
    assert report is not None
    assert report.writes_dropped == 0 and report.reads_dropped == 0
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("statekv-")]
    assert leftover == []


def test_cache_without_disk_serves_from_gpu_and_host(tmp_path: Path) -> None:
    config = small_config(tmp_path, disk=0, reserved_host=0, disk_dir=None)
    prompt = list(range(9))
    with BlockingCache(config) as cache:
        serve(cache, "first", prompt)
        for i in range(3):
            serve(cache, f"other{i}", [500 + i * 50 + t for t in range(9)])
        match = cache.add_request("again", prompt)
        assert match.matched_tokens == 8
        assert match.ready
        check_pages(cache, "again", prompt, 2)
        cache.release("again")
        assert cache.statistics().writer is None


def test_async_api_waits_for_onboard(tmp_path: Path) -> None:
    prompt = list(range(13))

    async def main() -> None:
        async with open_cache(small_config(tmp_path)) as cache:
            serve_async = cache
            serve_async.add_request("first", prompt)
            compute(serve_async, "first", prompt)
            serve_async.release("first")
            for i in range(6):
                rid = f"c{i}"
                tokens = [10_000 + i * 100 + t for t in range(17)]
                cache.add_request(rid, tokens)
                compute(cache, rid, tokens)
                cache.release(rid)
                while cache.statistics().cache.writes_in_flight:
                    await trio.sleep(0.001)
            match = cache.add_request("again", prompt)
            assert match.disk_tokens == 12
            with trio.fail_after(10):
                await cache.wait_ready("again")
            check_pages(cache, "again", prompt, 3)
            cache.release("again")
        assert cache.close_report is not None
        assert cache.close_report.drained

    trio.run(main)


def test_bad_disk_directory_is_a_config_error(tmp_path: Path) -> None:
    from statekv.errors import ConfigError

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ConfigError) as info:
        BlockingCache(small_config(not_a_dir))
    assert "disk" in str(info.value)


def test_kv_pool_layout_matches_the_config(tmp_path: Path) -> None:
    with BlockingCache(small_config(tmp_path)) as cache:
        layout = cache.config.layout
        assert cache.kv_pool.shape == (
            cache.config.gpu_blocks, layout.num_layers, 2, cache.config.block_size,
            layout.num_kv_heads, layout.head_dim,
        )
        assert cache.kv_pool.dtype == torch.float32


def test_synchronous_io_mode_serves_identical_kv_without_pools(tmp_path: Path) -> None:
    """The naive design the benchmarks compare against: disk I/O inside the cache calls."""
    prompt = list(range(13))
    with BlockingCache(small_config(tmp_path), synchronous_io=True) as cache:
        serve(cache, "first", prompt)
        churn(cache, 6)
        match = cache.add_request("again", prompt)
        assert match.disk_tokens == 12
        assert cache.is_ready("again")  # the reads ran inside add_request
        check_pages(cache, "again", prompt, 3)
        cache.release("again")
        stats = cache.statistics()
        assert stats.writer is None and stats.reader is None
        assert stats.cache.onboards_completed == 3
        cache.check_invariants()
