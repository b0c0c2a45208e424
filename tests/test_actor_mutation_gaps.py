"""Tests that answer mutants of the actors which survived the rest of the suite
(fuzz/README.md, "Mutation testing"): the worker pools' counters, thread names and crash
paths, and what closing does with a thread that is still busy.

The pools are driven directly, in trio, with an executor of the test's own: `Worker` is the
pools' seam (the writer and reader pools pass theirs), and only through it can a test make a
thread block, raise, or report a failed transfer at a moment it chooses.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import trio

from io_actors.actors.gate import OpenGate
from io_actors.actors.reader_pool import ReadJob, SlotReader
from io_actors.actors.worker_threads import WorkerCrashed, WorkerThreads
from io_actors.actors.writer_pool import WriteJob, WriterPool
from io_actors.embed import BlockingCache, resolve_device
from io_actors.memory.host_checksums import HostChecksums
from io_actors.storage.buffers import host_view, page_aligned_buffer
from io_actors.storage.faults import Fault, FaultPlan, FaultRule, FaultyStore, Op
from io_actors.storage.index_journal import INDEX_FILE
from io_actors.storage.interfaces import BatchOutcome, SlotIO
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.slot_format import SlotMeta, payload_checksum
from statekv.errors import ConfigError, TransferFailed, UsageError
from statekv.ids import BlockHash, BlockId, PageId, SlotId, TransferId
from statekv.messages import (
    BatchFinished,
    Completion,
    PrefetchSlot,
    PrefetchSlots,
    ReadSlot,
    ReadSlots,
    SlotRead,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    TransferOutcome,
    WriteSlot,
    WriteSlots,
    outcomes,
)
from tests.io_helpers import check_pages, serve, small_config, wait_quiet, wait_ready
from tests.test_io_actors import HoldReads, churn

Job = tuple[str, int]
"""("ok" | "fail" | "crash" | "block", transfer): what the executor does with the job."""


class Executor:
    """Reports each job as its kind says; "block" jobs wait for `release`."""

    def __init__(self, index: int, started: list[int], release: threading.Event,
                 closed: list[int]) -> None:
        self.index = index
        self._release = release
        self._closed = closed
        started.append(index)

    def execute(self, job: Job) -> Completion:
        kind, transfer = job
        if kind == "crash":
            raise ValueError(f"job {transfer} is broken")
        if kind == "block":
            self._release.wait(10)
        if kind == "sleep":
            time.sleep(0.05)
        outcome: TransferOutcome = (
            SlotWriteFailed(transfer=TransferId(transfer), cause="no space")
            if kind == "fail" else SlotWritten(transfer=TransferId(transfer))
        )
        return BatchFinished(outcomes=(outcome, SlotWritten(transfer=TransferId(transfer + 1))))

    def close(self) -> None:
        self._closed.append(self.index)


class Harness:
    def __init__(self, workers: int = 2, queue_depth: int = 4, *,
                 broken: bool = False) -> None:
        self.started: list[int] = []
        self.closed: list[int] = []
        self.release = threading.Event()
        self.reported: list[Completion] = []

        def make(index: int) -> Executor:
            if broken:
                raise OSError(f"no staging buffer for worker {index}")
            return Executor(index, self.started, self.release, self.closed)

        async def report(completion: Completion) -> None:
            self.reported.append(completion)

        self.pool: WorkerThreads[Job] = WorkerThreads(
            "tester", workers=workers, queue_depth=queue_depth, make_worker=make,
            gate=OpenGate(), report=report,
        )

    def statistics(self) -> tuple[int, int, int, int, int, int]:
        s = self.pool.statistics()
        return (s.workers, s.queued, s.in_flight, s.completed, s.failed, s.dropped_at_close)

    async def until(self, condition: object) -> None:
        with trio.fail_after(10):
            while not condition():  # type: ignore[operator]
                await trio.sleep(0.001)


def _pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("statekv-tester-")]


def test_pool_statistics_count_each_transfer_and_each_dropped_job() -> None:
    h = Harness(workers=1, queue_depth=2)
    assert h.statistics() == (1, 0, 0, 0, 0, 0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.pool.run)
            # Every thread is named after its pool and is a daemon: it must never keep the
            # interpreter alive, and a leak check finds it by name.
            threads = _pool_threads()
            assert sorted(t.name for t in threads) == ["statekv-tester-0"]
            assert all(t.daemon for t in threads)
            await h.pool.submit(("ok", 10))
            await h.pool.submit(("fail", 20))
            await h.pool.submit(("fail", 25))
            await h.until(lambda: len(h.reported) == 3)
            await h.until(lambda: h.pool.busy == 0)
            assert h.statistics() == (1, 0, 0, 4, 2, 0)
            assert h.started == [0]
            # One job blocks the thread, one waits in the pump for it, two in the queue.
            await h.pool.submit(("block", 30))
            await h.until(lambda: h.statistics()[2] == 1)
            await h.pool.submit(("ok", 40))
            h.pool.submit_nowait(("ok", 50))
            h.pool.submit_nowait(("ok", 51))
            assert h.statistics()[1:3] == (3, 1)
            # A submit that waits for room and is cancelled is not counted.
            with trio.move_on_after(0.05):
                await h.pool.submit(("ok", 60))
            assert h.statistics()[1:3] == (3, 1)
            assert h.pool.busy == 4
            dropped = h.pool.close_queue(drop_queued=True)
            assert dropped == [("ok", 50), ("ok", 51)]
            assert h.statistics()[1:] == (1, 1, 4, 2, 2)
            h.release.set()
        # The pump had taken job 40 before the close: it runs.
        assert h.statistics() == (1, 0, 0, 8, 2, 2)
        assert h.closed == [0]

    trio.run(main)
    assert _pool_threads() == []


def test_busy_seconds_sum_the_threads_time_in_their_jobs() -> None:
    h = Harness(workers=2, queue_depth=8)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.pool.run)
            assert h.pool.statistics().busy_seconds == 0.0
            started = time.monotonic()
            for transfer in range(0, 80, 10):
                await h.pool.submit(("sleep", transfer))
            await h.until(lambda: h.pool.busy == 0)
            wall = time.monotonic() - started
            busy = h.pool.statistics().busy_seconds
            # Eight jobs of at least 50 ms each, on two threads.
            assert 0.4 <= busy <= 2 * wall, (busy, wall)
            h.pool.close_queue(drop_queued=False)

    trio.run(main)


def test_submit_nowait_counts_every_job() -> None:
    h = Harness(workers=1, queue_depth=4)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.pool.run)
            await h.pool.submit(("block", 1))
            await h.until(lambda: h.statistics()[2] == 1)
            for transfer in (10, 20, 30):
                h.pool.submit_nowait(("ok", transfer))
            assert h.pool.busy == 4
            h.release.set()
            await h.until(lambda: h.pool.busy == 0)
            assert h.statistics() == (1, 0, 0, 8, 0, 0)
            h.pool.close_queue(drop_queued=False)

    trio.run(main)


def test_a_worker_that_raises_stops_the_pool_loudly(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(workers=2)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.pool.run)
            await h.pool.submit(("crash", 7))
            await trio.sleep_forever()

    # A group or the error itself, depending on trio's nurseries: the leaves are checked.
    with (caplog.at_level(logging.ERROR, logger="io_actors.actors.worker_threads"),
          pytest.raises(BaseException) as info):
        trio.run(main)
    crashes = [exc for exc in _leaves(info.value) if isinstance(exc, WorkerCrashed)]
    assert len(crashes) == 1
    assert str(crashes[0]) == "a tester worker crashed"
    assert isinstance(crashes[0].__cause__, ValueError)
    assert str(crashes[0].__cause__) == "job 7 is broken"
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("tester worker ") and m.endswith(" crashed on ('crash', 7)")
               for m in messages), messages
    assert h.reported == []
    assert _pool_threads() == []


# The thread re-raises the executor's error after logging it (threading.excepthook prints it).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_that_cannot_start_is_logged_and_the_pool_still_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(workers=2, broken=True)

    async def main() -> None:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(h.pool.run)
                h.pool.close_queue(drop_queued=True)

    with caplog.at_level(logging.ERROR, logger="io_actors.actors.worker_threads"):
        trio.run(main)
    messages = sorted(r.getMessage() for r in caplog.records)
    assert messages == ["tester worker 0 could not start", "tester worker 1 could not start"]
    assert _pool_threads() == []


def test_cancelling_the_pool_still_waits_for_its_busy_thread() -> None:
    """A thread owns its staging buffer and stream: the pool's run must not return (even
    when cancelled) while a thread still executes a job."""
    h = Harness(workers=1)

    async def main() -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(h.pool.run)
                await h.pool.submit(("block", 1))
                await h.until(lambda: h.statistics()[2] == 1)
                threading.Timer(0.2, h.release.set).start()
                started = time.monotonic()
                scope.cancel()
        assert time.monotonic() - started >= 0.15
        assert _pool_threads() == []
        assert h.closed == [0]

    trio.run(main)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def test_the_cache_runs_named_pools_whose_counts_match_the_cores(tmp_path: Path) -> None:
    prompt = list(range(13))
    with BlockingCache(small_config(tmp_path, writers=2, readers=3)) as cache:
        names = sorted(t.name for t in threading.enumerate()
                       if t.name.startswith(("statekv-writer-", "statekv-reader-")))
        assert names == ["statekv-reader-0", "statekv-reader-1", "statekv-reader-2",
                         "statekv-writer-0", "statekv-writer-1"]
        serve(cache, "first", prompt)
        churn(cache, 6)
        cache.add_request("again", prompt)
        wait_ready(cache, "again")
        cache.release("again")
        wait_quiet(cache)
        stats = cache.statistics()
        assert stats.writer is not None and stats.reader is not None
        assert (stats.writer.workers, stats.reader.workers) == (2, 3)
        assert stats.cache.spills_completed > 0
        assert stats.writer.completed == stats.cache.spills_completed
        assert stats.reader.completed == stats.cache.onboards_completed == 3
        assert stats.writer.failed == stats.reader.failed == 0
        assert stats.spill_backlog == 0


def test_a_crashed_writer_stops_the_cache_loudly_instead_of_hanging_its_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store that raises something other than an I/O error is a bug: the cache must stop
    and say so.  It used to hang instead: close waited for ever for the crashed job's report,
    which the stopped pool would never send."""
    config = small_config(tmp_path)
    directory = config.rank_directory()
    assert directory is not None
    store = PosixSlotStore(directory, config.core_config(), direct_io=False)

    def broken(writes: object) -> object:
        raise RuntimeError("a bug in the store")

    monkeypatch.setattr(store, "write_many", broken)
    raised: list[BaseException] = []

    def scenario() -> None:
        cache = BlockingCache(config, store=store)
        try:
            # New prompts push blocks to disk; the first spill crashes the writer, and once
            # the cache has stopped, calls are refused.
            deadline = time.monotonic() + 10
            with pytest.raises(UsageError, match="closed"):
                for i in range(10**6):
                    serve(cache, f"r{i}", [i * 100 + t for t in range(17)])
                    assert time.monotonic() < deadline, "the cache kept serving"
        finally:
            try:
                cache.close()
            except BaseException as exc:
                raised.append(exc)

    thread = threading.Thread(target=scenario, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the cache hung after its writer crashed"
    store.close()
    assert len(raised) == 1
    crashes = [exc for exc in _leaves(raised[0]) if isinstance(exc, WorkerCrashed)]
    assert [str(exc) for exc in crashes] == ["a writer worker crashed"]
    assert isinstance(crashes[0].__cause__, RuntimeError)


class RecordingGate:
    """Reports every completion at once, and keeps it."""

    def __init__(self) -> None:
        self.seen: list[Completion] = []

    async def hold(self, completion: Completion) -> None:
        self.seen.append(completion)


def test_a_failed_transfer_reports_and_logs_its_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    config = small_config(tmp_path, gpu=4, host=1, reserved_host=1, disk=16, writers=1,
                          readers=1)
    directory = config.rank_directory()
    assert directory is not None
    plan = FaultPlan(rules=(FaultRule(op=Op.WRITE, fault=Fault.ENOSPC, nth=1),
                            FaultRule(op=Op.READ, fault=Fault.EIO, nth=1)))
    store = FaultyStore(PosixSlotStore(directory, config.core_config()), plan)
    gate = RecordingGate()
    prompt = list(range(9))
    try:
        with caplog.at_level(logging.WARNING, logger="io_actors"), \
                BlockingCache(config, store=store, gate=gate) as cache:
            for i in range(4):
                serve(cache, f"churn{i}", [1000 + 100 * i + t for t in range(9)])
                wait_quiet(cache)
            serve(cache, "first", prompt)
            wait_quiet(cache)
            for i in range(2):
                serve(cache, f"more{i}", [5000 + 100 * i + t for t in range(9)])
                wait_quiet(cache)
            cache.add_request("again", prompt)
            wait_ready(cache, "again")
            cache.release("again")
            wait_quiet(cache)
    finally:
        store.close()
    failed = [o for c in gate.seen for o in outcomes(c)
              if isinstance(o, SlotWriteFailed | SlotReadFailed)]
    # Each failed transfer carries the store's error as its cause, and is logged with its
    # block and slot.
    assert [type(o) for o in failed] == [SlotWriteFailed, SlotReadFailed]
    write_cause = re.fullmatch(
        r"slot (\d+): write failed: \[Errno 28\] No space left on device \(injected\)",
        failed[0].cause)
    read_cause = re.fullmatch(
        r"slot (\d+): read failed: \[Errno 5\] Input/output error \(injected\)",
        failed[1].cause)
    assert write_cause is not None and read_cause is not None, failed
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("io_actors.")
                and r.name.endswith("_pool")]
    assert len(messages) == 2, messages
    assert re.fullmatch(rf"spill of block \d+ to slot {write_cause[1]} failed: "
                        rf"{re.escape(failed[0].cause)}", messages[0]), messages
    assert re.fullmatch(rf"onboard of block \d+ from slot {read_cause[1]} failed: "
                        rf"{re.escape(failed[1].cause)}", messages[1]), messages


class _Done:
    """The fence of copies that have all happened (a CPU copy engine's)."""

    def wait(self) -> None:
        return None


def _as_int32(crc: int) -> int:
    """How HostChecksums.table holds an unsigned 32-bit checksum (a signed int32 entry)."""
    return crc - 2**32 if crc >= 2**31 else crc


def test_the_writer_stores_the_checksum_computed_by_the_copy(tmp_path: Path) -> None:
    """With CUDA, the copy that fills a host page also computes its checksum (HostChecksums):
    the writer must store that value, not compute its own.  A wrong one makes the slot fail
    its check when read back -- so a slot written with a deliberately wrong value proves
    which one was stored."""
    core = small_config(tmp_path).core_config()
    store = PosixSlotStore(tmp_path / "slots", core, direct_io=False)
    pages = [page_aligned_buffer(store.payload_len) for _ in range(3)]
    crcs: list[int] = []
    # Seeds whose checksums (CRC-32C) come out one of each sign as an int32 for the first two.
    for seed, page in zip((0, 2, 1), pages, strict=True):
        page.copy_(torch.randint(0, 256, (store.payload_len,), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(seed)))
        crcs.append(payload_checksum(host_view(page)))
    # One checksum of each sign as an int32, and a wrong one for the last page.
    assert min(crcs[:2]) < 2**31 <= max(crcs[:2]), crcs
    checksums = HostChecksums(torch.tensor([_as_int32(crcs[0]), _as_int32(crcs[1]),
                                            _as_int32(crcs[2] ^ 0x1)], dtype=torch.int32))
    checksums.computed([PageId(0), PageId(1), PageId(2)])
    keys = [BlockHash(bytes([i + 1]) * 32) for i in range(3)]
    reported: list[Completion] = []

    async def report(completion: Completion) -> None:
        reported.append(completion)

    pool = WriterPool(store, lambda page: pages[page], checksums=checksums, workers=1,
                      queue_depth=1, gate=OpenGate(), report=report)
    command = WriteSlots(writes=tuple(
        WriteSlot(transfer=TransferId(10 + i), block=BlockId(i), key=keys[i],
                  host_page=PageId(i), slot=SlotId(i), retained=False)
        for i in range(3)))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            await pool.submit(WriteJob(command, _Done()))
            pool.close_queue(drop_queued=False)

    trio.run(main)
    try:
        assert [outcomes(c) for c in reported] == [tuple(
            SlotWritten(transfer=TransferId(10 + i)) for i in range(3))]
        for i in range(2):
            back = page_aligned_buffer(store.payload_len)
            store.read(SlotId(i), keys[i], back)
            assert torch.equal(back, pages[i])
        with pytest.raises(TransferFailed, match="checksum"):
            store.read(SlotId(2), keys[2], page_aligned_buffer(store.payload_len))
    finally:
        store.close()


def test_a_page_a_prefetch_filled_is_written_with_its_own_checksum(tmp_path: Path) -> None:
    """A host page a prefetch read filled holds bytes no copy checksummed: its entry is the
    earlier content's.  Content prefetched, recalled with a host copy, evicted back onto it
    and spilled once its disk copy is displaced is written from that page; the slot must read
    back (the entry trusted there writes a header that disagrees with the payload)."""
    core = small_config(tmp_path).core_config()
    store = PosixSlotStore(tmp_path / "slots", core, direct_io=False)
    n = store.payload_len
    hosts = [page_aligned_buffer(n)]
    earlier = torch.arange(n, dtype=torch.int64).remainder(241).to(torch.uint8)
    hosts[0].copy_(earlier)      # what a GPU -> host copy brought, and checksummed
    checksums = HostChecksums(torch.tensor([_as_int32(payload_checksum(host_view(earlier)))],
                                           dtype=torch.int32))
    checksums.computed([PageId(0)])
    data = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)
    key = BlockHash(b"k" * 32)
    store.write(SlotId(3), key, data)
    reader = SlotReader(store, lambda page: hosts[page], lambda blocks: page_aligned_buffer(
        blocks * n), torch.device("cpu"), 1, host_page=lambda page: hosts[page],
        checksums=checksums)
    reported: list[Completion] = []

    async def report(completion: Completion) -> None:
        reported.append(completion)

    pool = WriterPool(store, lambda page: hosts[page], checksums=checksums, workers=1,
                      queue_depth=1, gate=OpenGate(), report=report)
    spill = WriteSlots(writes=(WriteSlot(transfer=TransferId(2), block=BlockId(7), key=key,
                                         host_page=PageId(0), slot=SlotId(5), retained=False),))

    async def write_back() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            await pool.submit(WriteJob(spill, _Done()))
            pool.close_queue(drop_queued=False)

    try:
        prefetch = PrefetchSlots(reads=(PrefetchSlot(
            transfer=TransferId(1), block=BlockId(7), key=key, slot=SlotId(3),
            host_page=PageId(0)),))
        assert outcomes(reader.execute(ReadJob(prefetch, _Done()))) == (
            SlotRead(transfer=TransferId(1)),)
        assert torch.equal(hosts[0], data)
        trio.run(write_back)
        assert [outcomes(c) for c in reported] == [(SlotWritten(transfer=TransferId(2)),)]
        back = page_aligned_buffer(n)
        store.read(SlotId(5), key, back)
        assert torch.equal(back, data)
    finally:
        store.close()


class ReadsIntoPages:
    """The POSIX store, declared able to read straight into the destination pages (as the
    kvikio store reads into GPU memory): the reader then skips its staging buffers.  On a
    CPU device the "GPU" pages are host memory, which the POSIX store fills directly."""

    device_reads = True

    def __init__(self, inner: PosixSlotStore) -> None:
        self.inner = inner
        self.read_into: list[torch.Tensor] = []

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        self.read_into += [item.buffer for item in reads]
        return self.inner.read_many(reads)

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        return self.inner.write_many(writes)

    def write(self, slot: SlotId, key: BlockHash, src: torch.Tensor,
              meta: SlotMeta | None = None) -> None:
        self.inner.write(slot, key, src, meta)

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        self.inner.read(slot, key, dst)

    def discard(self, slot: SlotId) -> None:
        self.inner.discard(slot)

    def close(self) -> None:
        self.inner.close()


def test_a_store_with_device_reads_fills_the_pages_without_staging(tmp_path: Path) -> None:
    core = small_config(tmp_path).core_config()
    posix = PosixSlotStore(tmp_path / "slots", core, direct_io=False)
    store = ReadsIntoPages(posix)
    n = store.inner.payload_len
    data = [torch.randint(0, 256, (n,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    keys = [BlockHash(bytes([i + 1]) * 32) for i in range(2)]
    try:
        assert store.write_many([SlotIO(SlotId(i), keys[i], data[i]) for i in range(2)]) == [
            None, None]
        pages = [page_aligned_buffer(n) for _ in range(3)]
        staging_asked: list[int] = []

        def new_staging(blocks: int) -> torch.Tensor:
            staging_asked.append(blocks)
            return page_aligned_buffer(blocks * n)

        reader = SlotReader(store, lambda page: pages[page], new_staging, torch.device("cpu"),
                            2)
        assert staging_asked == []
        # Slot 1 is read under a key it does not hold: that block fails, the other lands.
        command = ReadSlots(reads=(
            ReadSlot(transfer=TransferId(5), block=BlockId(0), key=keys[0], slot=SlotId(0),
                     gpu_page=PageId(2)),
            ReadSlot(transfer=TransferId(6), block=BlockId(1), key=keys[0], slot=SlotId(1),
                     gpu_page=PageId(0)),
        ))
        completion = reader.execute(ReadJob(command, _Done()))
        got = outcomes(completion)
        assert got[0] == SlotRead(transfer=TransferId(5))
        assert isinstance(got[1], SlotReadFailed) and got[1].transfer == TransferId(6)
        assert [b.data_ptr() for b in store.read_into] == [pages[2].data_ptr(),
                                                           pages[0].data_ptr()]
        assert torch.equal(pages[2], data[0])
        # A reader given no host pool refuses a prefetch, by name.
        prefetch = PrefetchSlots(reads=(PrefetchSlot(
            transfer=TransferId(7), block=BlockId(0), key=keys[0], slot=SlotId(0),
            host_page=PageId(0)),))
        with pytest.raises(RuntimeError) as info:
            reader.execute(ReadJob(prefetch, _Done()))
        assert str(info.value) == "this reader has no host pool: it cannot prefetch"
    finally:
        posix.close()


def test_each_waiter_wakes_when_its_reads_land_and_not_before(tmp_path: Path) -> None:
    """Two requests parked on the same onboard reads: an unrelated call wakes neither, and
    the completion that makes both ready wakes both."""
    gate = HoldReads()
    prompt = list(range(13))
    with BlockingCache(small_config(tmp_path), gate=gate) as cache:
        serve(cache, "first", prompt)
        churn(cache, 6)
        assert cache.add_request("a", prompt).disk_tokens == 12
        cache.add_request("b", prompt)
        assert not cache.is_ready("a") and not cache.is_ready("b")
        deadline = time.monotonic() + 10
        while gate.blocks() < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert gate.blocks() == 3
        woke: dict[str, bool] = {}
        waiters = [threading.Thread(target=lambda rid=rid: woke.update(
            {rid: cache.wait_ready(rid, timeout=10)})) for rid in ("a", "b")]
        for waiter in waiters:
            waiter.start()
        time.sleep(0.2)
        cache.add_request("other", [9000 + t for t in range(6)])
        cache.release("other")
        time.sleep(0.2)
        assert woke == {}, "a waiter woke before its reads landed"
        gate.release_all()
        for waiter in waiters:
            waiter.join(15)
        assert woke == {"a": True, "b": True}
        check_pages(cache, "a", prompt, 3)
        check_pages(cache, "b", prompt, 3)
        cache.release("a")
        cache.release("b")


def test_statistics_read_the_store_inside_a_wrapper(tmp_path: Path) -> None:
    config = small_config(tmp_path)
    directory = config.rank_directory()
    assert directory is not None
    posix = PosixSlotStore(directory, config.core_config(), direct_io=False)
    store = FaultyStore(posix, FaultPlan())
    try:
        with BlockingCache(config, store=store) as cache:
            serve(cache, "first", list(range(13)))
            churn(cache, 3)
            stats = cache.statistics()
            assert stats.store == posix.statistics()
            assert stats.store is not None and stats.store.writes > 0
    finally:
        store.close()


def test_prefetch_and_append_tokens_pass_every_argument_through(tmp_path: Path) -> None:
    prompt = list(range(13))
    with BlockingCache(small_config(tmp_path, host=4)) as cache:
        assert "statekv-trio" in [t.name for t in threading.enumerate()]
        serve(cache, "first", prompt, cache_salt="tenant", lora_id=3)
        churn(cache, 6)
        # Under another salt or adapter the same tokens are other blocks: nothing to read.
        for other in ({"cache_salt": "tenant"}, {"lora_id": 3}):
            got = cache.prefetch("other", prompt, **other)
            assert got.started_tokens + got.shared_tokens + got.cached_tokens == 0, got
            cache.release("other")
        fetched = 0
        for _ in range(20):
            got = cache.prefetch("q", prompt, cache_salt="tenant", lora_id=3)
            fetched = got.started_tokens + got.shared_tokens
            if fetched == 12:
                break
            wait_quiet(cache)
        assert fetched == 12
        cache.release("q")
        wait_quiet(cache)
        # Decode tokens reach the request through the facade.
        cache.add_request("d", [500, 501, 502])
        cache.allocate_nowait("d", 3)
        cache.commit("d", 3)
        cache.append_tokens("d", [503, 504])
        assert cache.request_status("d").num_tokens == 5
        cache.release("d")


def test_a_restart_logs_what_the_index_rebuild_found(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    config = small_config(tmp_path)
    with BlockingCache(config) as cache:
        serve(cache, "first", list(range(13)))
        churn(cache, 6)
        wait_quiet(cache)
        restored = cache.statistics().cache.spills_completed
    directory = config.rank_directory()
    assert directory is not None and restored > 0
    messages: list[str] = []
    for _opening in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="io_actors.embed"), BlockingCache(config):
            pass
        messages += [r.getMessage() for r in caplog.records if r.name == "io_actors.embed"]
        # Without its index journal, the next open reads every slot header.
        (directory / INDEX_FILE).unlink()
    blocks = messages[0].split(": ", 1)[1].split(" blocks restored")[0]
    assert int(blocks) > 0
    assert messages == [
        f"disk index rebuilt from {source}: {blocks} blocks restored; reclaimed 0 foreign, "
        "0 corrupt, 0 unauthenticated, 0 duplicate, 0 beyond capacity slots; 0 old files"
        for source in ("the index journal", "the slot headers")
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_cuda_on_a_machine_without_it_is_a_config_error_naming_device() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError) as info:
            resolve_device(name)
        assert info.value.field == "device"
        assert str(info.value) == "device: CUDA was asked for but torch sees no GPU"


def test_a_failed_prefetch_read_is_reported_and_logged_as_a_prefetch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    core = small_config(tmp_path).core_config()
    store = PosixSlotStore(tmp_path / "slots", core, direct_io=False)
    n = store.payload_len
    hosts = [page_aligned_buffer(n) for _ in range(2)]
    rates: list[tuple[int, float]] = []
    reader = SlotReader(store, lambda page: hosts[page], lambda blocks: page_aligned_buffer(
        blocks * n), torch.device("cpu"), 2, host_page=lambda page: hosts[page],
        measured=lambda nbytes, seconds: rates.append((nbytes, seconds)))
    data = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)
    store.write(SlotId(3), BlockHash(b"k" * 32), data)
    try:
        command = PrefetchSlots(reads=(
            PrefetchSlot(transfer=TransferId(1), block=BlockId(7), key=BlockHash(b"k" * 32),
                         slot=SlotId(3), host_page=PageId(1)),
            PrefetchSlot(transfer=TransferId(2), block=BlockId(8), key=BlockHash(b"x" * 32),
                         slot=SlotId(4), host_page=PageId(0)),
        ))
        with caplog.at_level(logging.WARNING, logger="io_actors.actors.reader_pool"):
            got = outcomes(reader.execute(ReadJob(command, _Done())))
    finally:
        store.close()
    assert got[0] == SlotRead(transfer=TransferId(1))
    assert isinstance(got[1], SlotReadFailed)
    assert torch.equal(hosts[1], data)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert messages[0].startswith("prefetch of block 8 from slot 4 failed: slot 4: "), messages
    # The batch's landed bytes and the store call's duration (seconds of this call, not a
    # clock reading) feed the core's disk read-rate estimate.
    assert len(rates) == 1 and rates[0][0] == n
    assert 0 < rates[0][1] < 60
