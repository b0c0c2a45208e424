"""Closing the cache accounts for every transfer exactly once (plain pytest, no machine).

A stalled store holds the only writer thread inside its write, so every later spill backs
up: one job in the writer queue, one taken by the pool's pump (waiting for a free thread),
one in the spill feeder's ``submit()`` (waiting for room in the queue), the rest in the
spill backlog.  Closing without draining must then drop exactly what no thread started and
report as finished exactly what the threads completed, each job counted once.  Batches of
one block keep jobs and block transfers the same count here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import trio

from io_actors.embed import BlockingCache
from io_actors.storage.interfaces import BatchOutcome, SlotIO, SlotStore
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.slot_format import SlotMeta
from statekv.ids import BlockHash, SlotId
from tests.io_helpers import compute, small_config

WAIT = 10.0
"""Seconds any state this test waits for may take to appear (it takes milliseconds)."""


class StalledStore:
    """A real store whose writes block until :meth:`go_on` (a disk that stopped answering)."""

    def __init__(self, inner: SlotStore) -> None:
        self._inner = inner
        self._go = threading.Event()
        self.writes_started = 0

    @property
    def device_reads(self) -> bool:
        return self._inner.device_reads

    def go_on(self) -> None:
        self._go.set()

    def write(self, slot: SlotId, key: BlockHash, src: torch.Tensor,
              meta: SlotMeta | None = None) -> None:
        self.writes_started += 1
        self._go.wait()
        self._inner.write(slot, key, src, meta)

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        self._inner.read(slot, key, dst)

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        self.writes_started += 1
        self._go.wait()
        return self._inner.write_many(writes)

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        return self._inner.read_many(reads)

    def discard(self, slot: SlotId) -> None:
        self._inner.discard(slot)

    def close(self) -> None:
        self._go.set()
        self._inner.close()


def _until(what: str, done: object) -> None:
    assert callable(done)
    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.001)


def test_close_counts_the_job_in_the_feeders_submit_once(tmp_path: Path) -> None:
    config = small_config(tmp_path, gpu=8, host=3, reserved_host=2, writers=1, readers=1,
                          write_queue_depth=1, max_batch_blocks=1)
    directory = config.rank_directory()
    assert directory is not None
    store = StalledStore(PosixSlotStore(directory, config.core_config(), direct_io=False))
    cache = BlockingCache(config, store=store)
    try:
        # Fresh full-GPU requests, one after another: each evicts the last one's blocks to
        # host, and host pages spill to disk; nothing lands, so spills pile up.
        for i in range(6):
            tokens = [1000 + 100 * i + t for t in range(31)]
            cache.add_request(f"r{i}", tokens)
            compute(cache, f"r{i}", tokens)
            cache.release(f"r{i}")
        spills = config.core_config().host_blocks + config.core_config().reserved_host_blocks
        # Reached: every host page is SPILLING -- one write stalled in the thread, one in the
        # queue, one held by the pool's pump, one in the feeder's submit(), one backed up.
        _until("five spills backed up behind the stalled write", lambda: (
            (s := cache.statistics()).cache.writes_in_flight == spills
            and s.writer is not None and s.writer.in_flight == 1 and s.writer.queued == 3
            and store.writes_started == 1))
        stats = cache.statistics()
        assert stats.writer is not None
        # Each write counted in one place only: in a thread, queued in the pool (the queue,
        # the pump, the feeder's submit), or backed up behind them.
        assert stats.writer.in_flight + stats.writer.queued + stats.spill_backlog == spills
        assert stats.spill_backlog == 1

        closing: list[object] = []
        closer = threading.Thread(target=lambda: closing.append(cache.close(drain=False)))
        closer.start()
        # The stalled write goes on once the close has started dropping what is queued.
        _until("the close under way", lambda: cache._scheduler._closed)
        store.go_on()
        closer.join(WAIT)
        assert not closer.is_alive(), "the close hung"
        report = cache.close_report
        assert report is not None and closing == [report]

        after = cache.statistics().cache
        # Independent counts: what the core applied, and what it still waits for.
        landed = after.spills_completed + after.spill_failures
        assert landed == 2  # the stalled write, and the pump's job, which got its thread
        assert after.writes_in_flight == 3  # the queue's, the feeder's and the backlog's
        assert report.writes_finished_during_close == landed
        assert report.writes_dropped == after.writes_in_flight
        assert report.reads_dropped == report.reads_finished_during_close == 0
        assert not report.drained
    finally:
        store.go_on()
        cache.close(drain=False)
        store.close()


def test_a_spill_that_landed_before_its_feeder_resumed_is_not_counted_dropped(
    tmp_path: Path,
) -> None:
    """Once the feeder's submit() has put a job in the queue, a worker may start it and even
    finish it before the feeder task runs again (trio orders ready tasks as it likes).  A
    close in that window counts the job as landed; it must not count it as dropped too."""
    config = small_config(tmp_path, gpu=8, host=3, reserved_host=2, writers=1, readers=1,
                          write_queue_depth=1, max_batch_blocks=1)
    directory = config.rank_directory()
    assert directory is not None
    store = StalledStore(PosixSlotStore(directory, config.core_config(), direct_io=False))
    cache = BlockingCache(config, store=store)
    writer = cache._scheduler._writer
    assert writer is not None
    # The window, held open: the submit that waited for room in the queue (the fourth: one
    # job in the thread, one held by the pool's pump, one in the queue) returns only when
    # the test lets it.
    feeder_may_resume = threading.Event()
    submits_done = 0
    submit = writer.submit

    async def submit_then_wait(job: Any) -> None:
        nonlocal submits_done
        await submit(job)
        submits_done += 1
        while submits_done == 4 and not feeder_may_resume.is_set():
            await trio.sleep(0.001)

    writer.submit = submit_then_wait  # type: ignore[method-assign]
    try:
        for i in range(6):
            tokens = [1000 + 100 * i + t for t in range(31)]
            cache.add_request(f"r{i}", tokens)
            compute(cache, f"r{i}", tokens)
            cache.release(f"r{i}")
        spills = config.core_config().host_blocks + config.core_config().reserved_host_blocks
        _until("spills backed up behind the stalled write", lambda: (
            cache.statistics().cache.writes_in_flight == spills and store.writes_started == 1))
        # Every job but the last lands; the feeder's first submit has returned and the
        # feeder is held in the window, with the last job still behind it.
        store.go_on()
        _until("all but one spill landed", lambda: (
            (s := cache.statistics()).cache.spills_completed == spills - 1
            and s.writer is not None and s.writer.in_flight == s.writer.queued == 0))
        assert submits_done == 4

        closing: list[object] = []
        closer = threading.Thread(target=lambda: closing.append(cache.close(drain=False)))
        closer.start()
        _until("the close under way", lambda: cache._scheduler._closed)
        feeder_may_resume.set()
        closer.join(WAIT)
        assert not closer.is_alive(), "the close hung"
        report = cache.close_report
        assert report is not None and closing == [report]
        after = cache.statistics().cache
        assert after.writes_in_flight == 1  # the backlog's last job, never submitted
        assert report.writes_dropped == after.writes_in_flight
    finally:
        feeder_may_resume.set()
        store.go_on()
        cache.close(drain=False)
        store.close()
