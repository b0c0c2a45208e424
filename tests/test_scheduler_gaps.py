"""The scheduler's paths that the actor mutation run found untested (fuzz/README.md,
"Mutation testing"): the retention journal's backlog and what a close without draining
does with it, a journal append that fails, and an invariant failure inside an API call."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from fuzz.crash import extend_retention, workload_config
from io_actors.actors.scheduler import append_retention
from io_actors.embed import BlockingCache
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.retention_journal import RetentionRecord
from io_actors.tracing.recorder import RecordKind, TraceRecorder
from statekv.errors import InvariantViolation, TransferFailed
from tests.io_helpers import serve, small_config, wait_quiet
from tests.test_io_actors import HoldReads, churn


class HeldJournal(PosixSlotStore):
    """A POSIX store whose retention appends wait at a gate (one append at a time reaches
    it: the scheduler's retention task runs them in order)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.entered = threading.Event()
        self.go = threading.Event()
        self.appended: list[int] = []

    def persist_retention(self, records: Sequence[RetentionRecord]) -> None:
        self.entered.set()
        assert self.go.wait(30), "the test never let the append go"
        super().persist_retention(records)
        self.appended.append(len(records))


def _one_append_held_and_more_queued(
    tmp_path: Path,
) -> tuple[BlockingCache, HeldJournal, int, int]:
    """A cache whose first journal append waits at the gate with `held` records, and
    `queued` more records taken from the core behind it.  (Without write-through: a
    write-through would often carry the lengthened deadline in the slot header itself.)"""
    config = workload_config(tmp_path, retention_write_through=False)
    rank = config.rank_directory()
    assert rank is not None
    store = HeldJournal(rank, config.core_config())
    cache = BlockingCache(config, store=store)
    extend_retention(cache, "x", 0, 30.0, 3600.0)
    wait_quiet(cache)
    assert store.entered.wait(10)
    held = cache.statistics().retention_backlog
    assert held >= 1  # the records the retention task holds in its thread
    # A deadline lengthened while its block is being written is journaled when it lands;
    # one lengthened while the twin is not on disk yet (still cached on host: on a loaded
    # machine the fillers' spills can lag) rides in that spill's header and queues nothing,
    # which failed this set-up once.  Another extension, on new prompts, is tried then.
    queued = 0
    for n in range(1, 4):
        extend_retention(cache, f"y{n}", n, 30.0, 3600.0)
        wait_quiet(cache)
        deadline = time.monotonic() + 5
        while cache.statistics().retention_backlog <= held and time.monotonic() < deadline:
            time.sleep(0.01)
        queued = cache.statistics().retention_backlog - held
        if queued >= 1:
            break
    assert queued >= 1  # waiting behind the held append
    return cache, store, held, queued


def test_held_journal_appends_are_the_retention_backlog_and_a_drained_close_waits_for_them(
    tmp_path: Path,
) -> None:
    cache, store, held, queued = _one_append_held_and_more_queued(tmp_path)
    threading.Timer(0.3, store.go.set).start()
    report = cache.close(drain=True)
    assert report is not None and report.drained
    assert sum(store.appended) == held + queued
    assert cache.statistics().retention_backlog == 0


def test_a_close_without_draining_drops_queued_deadlines_and_says_how_many(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache, store, held, queued = _one_append_held_and_more_queued(tmp_path)
    # The held append is in a thread and finishes; the queued records are dropped.
    threading.Timer(0.3, store.go.set).start()
    with caplog.at_level(logging.WARNING, logger="io_actors.actors.scheduler"):
        cache.close(drain=False)
    assert sum(store.appended) == held
    assert (f"closed with {queued} lengthened deadlines not journaled (a restart keeps the "
            "earlier ones)") in caplog.messages


class FailingJournal:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def persist_retention(self, records: Sequence[RetentionRecord]) -> None:
        raise self.error


def test_a_failed_journal_append_is_logged_with_its_count_and_cause_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    records = [RetentionRecord.__new__(RetentionRecord) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="io_actors.actors.scheduler"):
        append_retention(FailingJournal(TransferFailed("journal", "disk full")), records)
    assert caplog.messages == [
        f"3 lengthened deadlines not journaled: {TransferFailed('journal', 'disk full')}"]
    # Anything but a failed transfer is a bug, and is not swallowed.
    with pytest.raises(ValueError, match="bug"):
        append_retention(FailingJournal(ValueError("bug")), records)


def test_an_invariant_failure_inside_a_call_is_traced_at_the_cache_clock_and_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [123.5]
    recorder = TraceRecorder()
    config = workload_config(tmp_path)
    with BlockingCache(config, recorder=recorder, clock=lambda: now[0]) as cache:
        core = cache._scheduler._core

        def broken(*args: object, **kwargs: object) -> None:
            raise InvariantViolation("block 7: planted")

        monkeypatch.setattr(core, "add_request", broken)
        with pytest.raises(InvariantViolation, match="planted"):
            cache.add_request("r", list(range(9)))
        failed = [r for r in recorder.records() if r.kind is RecordKind.INVARIANT]
        assert len(failed) == 1
        assert (failed[0].actor, failed[0].time) == ("scheduler", 123.5)
        assert "block 7: planted" in (failed[0].detail or "")
        monkeypatch.undo()


def test_transfers_in_flight_names_each_held_read_oldest_first(tmp_path: Path) -> None:
    gate = HoldReads()
    prompt = list(range(13))
    with BlockingCache(small_config(tmp_path), gate=gate) as cache:
        serve(cache, "first", prompt)
        churn(cache, 6)
        assert cache.transfers_in_flight() == ()
        assert cache.add_request("a", prompt).disk_tokens == 12
        deadline = time.monotonic() + 10
        while gate.blocks() < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        held = cache.transfers_in_flight()
        assert len(held) == 3 and list(held) == sorted(set(held))
        gate.release_all()
        assert cache.wait_ready("a", timeout=10)
        assert cache.transfers_in_flight() == ()
        cache.release("a")


def test_the_schedulers_has_request_follows_a_request_from_add_to_release(
    tmp_path: Path,
) -> None:
    """(BlockingCache.wait_ready asks it after a wake-up: a request that left wakes its
    waiter with True.)"""
    with BlockingCache(small_config(tmp_path)) as cache:
        scheduler = cache._scheduler
        assert not scheduler.has_request("a")
        cache.add_request("a", list(range(9)))
        assert scheduler.has_request("a") and not scheduler.has_request("b")
        cache.release("a")
        assert not scheduler.has_request("a")
