"""Where the cache's threads spend a benchmark phase: seconds per named phase, per thread kind.

A deterministic profile of every thread started while it is installed (the cache's trio
thread, writer and reader workers), through ``threading.setprofile``: Python's per-thread
profile hook sees every call and return, Python or C, so a blocking system call, a CRC in C
or a lock wait is attributed to the phase that made it.  cProfile cannot do this on
Python 3.12, where it is one interpreter-wide profiler (sys.monitoring) that mixes the
threads' stacks.  Only the functions named in :data:`PHASES` open a phase; time is exclusive
per phase (a fence wait inside a writer's job counts as the wait, not as the job), and a
thread's time outside every named phase counts as its "other".  The hook costs about a
microsecond per call, paid by every thread: the phase runs slower profiled, so the
benchmark's figures come from an unprofiled run and this says only where the time goes.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

import torch
import trio

from io_actors.actors.scheduler import Scheduler
from io_actors.actors.worker_threads import WorkerThreads
from io_actors.actors.writer_pool import SlotWriter
from io_actors.memory import pools
from io_actors.storage import slot_format
from io_actors.storage.index_journal import IndexJournal
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.retention_journal import RetentionJournal
from models.model import PagedDecoder, greedy
from models.serving_loop import ServingLoop
from statekv.manager import KVCacheManager


def _code(function: Callable[..., Any]) -> CodeType:
    return function.__code__


PHASES: dict[CodeType | str, str] = {
    # writer workers
    _code(SlotWriter.execute): "job (Python: batch setup, outcomes)",
    _code(pools._EventFence.wait): "fence wait (GPU -> host copy, checksum kernel)",
    _code(slot_format.payload_checksum): "checksum on the CPU",
    _code(slot_format.SlotHeader.pack_into): "header packing",
    _code(PosixSlotStore._check_batch): "batch checks",
    _code(IndexJournal.before_write): "index journal",
    _code(IndexJournal.landed): "index journal",
    _code(RetentionJournal.slot_written): "retention journal",
    _code(PosixSlotStore._read_run): "read run (Python, verify)",
    "pwritev": "pwritev syscall",
    "preadv": "preadv syscall",
    "fdatasync": "fdatasync",
    "crc32c": "checksum on the CPU",
    "crc32": "checksum on the CPU",
    "SimpleQueue.get": "idle: waiting for a job",
    _code(torch.cuda.Stream.synchronize): "CUDA stream synchronize",
    "lock.acquire": "lock waits",
    "lock.__enter__": "lock waits",
    _code(trio.lowlevel.TrioToken.run_sync_soon): "hand-off to the trio thread",
    # the trio thread
    _code(Scheduler._apply_completions): "apply completions (scheduler)",
    _code(KVCacheManager.handle): "core: handle completions",
    _code(Scheduler._dispatch_locked): "dispatch the core's commands",
    _code(Scheduler._pump): "move handed-over work into the pools",
    _code(Scheduler._feed_spills): "feed spills to the writer queue",
    _code(WorkerThreads.submit): "feed spills to the writer queue",
    _code(WorkerThreads.run): "hand jobs to worker threads",
    _code(WorkerThreads._deliver_results): "deliver worker results",
    _code(WorkerThreads._deliver_one): "deliver worker results",
    "epoll.poll": "idle: waiting for events",
    # the calling thread (the serving loop's, or the benchmark's)
    _code(KVCacheManager.allocate_nowait): "core: allocate (evictions)",
    _code(KVCacheManager.add_request): "core: add_request",
    _code(KVCacheManager.commit): "core: commit",
    _code(KVCacheManager.release): "core: release",
    _code(KVCacheManager.take_commands): "core: take commands",
    _code(pools.TorchCopyEngine.copy_pages): "copy engine: enqueue page copies",
    _code(pools.TorchCopyEngine.fence): "copy engine: fence",
    "sleep": "idle: sleeping (polling)",
    _code(Scheduler.block_table): "block table (orders the compute stream)",
    # a serving loop on the calling thread
    _code(PagedDecoder.forward): "model forward (kernel launches)",
    _code(ServingLoop._schedule): "loop: schedule (allocate pages)",
    _code(ServingLoop._advance): "loop: commit, append, release",
    _code(ServingLoop._admit): "loop: admit",
    _code(ServingLoop._unpark): "loop: un-park",
    _code(greedy): "loop: greedy sampling (waits for the GPU)",
}
"""The functions that open a phase: Python functions by code object (a renamed one fails at
import), C functions by their qualified name."""


def _kind(name: str) -> str:
    for prefix, kind in (("statekv-writer", "writer"), ("statekv-reader", "reader"),
                         ("statekv-trio", "trio")):
        if name.startswith(prefix):
            return kind
    return "caller" if threading.current_thread() is threading.main_thread() else "other"


class _Thread:
    """One thread's open phases (exclusive time goes to the innermost)."""

    def __init__(self, kind: str, totals: dict[tuple[str, str], float]) -> None:
        self.kind = kind
        self.totals = totals
        self.stack: list[tuple[object, object, str]] = []
        self.phase = "other"
        self.since = time.perf_counter()

    def enter(self, frame: object, key: object, phase: str) -> None:
        now = time.perf_counter()
        self.totals[self.kind, self.phase] += now - self.since
        self.stack.append((frame, key, self.phase))
        self.phase, self.since = phase, now

    def leave(self) -> None:
        now = time.perf_counter()
        self.totals[self.kind, self.phase] += now - self.since
        _frame, _key, self.phase = self.stack.pop()
        self.since = now

    def close(self) -> None:
        now = time.perf_counter()
        self.totals[self.kind, self.phase] += now - self.since
        self.since = now


class PhaseProfile:
    """Install with :meth:`threads_started_inside`; read :meth:`breakdown` afterwards."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, str], float] = collections.defaultdict(float)
        self._threads: list[_Thread] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self.wall_s = 0.0
        self._start = time.perf_counter()
        self._stopped = False

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if self._stopped:
            return
        state: _Thread | None = getattr(self._local, "state", None)
        if state is None:
            state = _Thread(_kind(threading.current_thread().name), self._totals)
            self._local.state = state
            with self._lock:
                self._threads.append(state)
        if event == "call":
            phase = PHASES.get(frame.f_code)
            if phase is not None:
                state.enter(frame, None, phase)
        elif event == "return":
            if state.stack and state.stack[-1][0] is frame and state.stack[-1][1] is None:
                state.leave()
        elif event == "c_call":
            phase = PHASES.get(getattr(arg, "__qualname__", ""))
            if phase is not None:
                state.enter(frame, arg, phase)
        elif state.stack and state.stack[-1][0] is frame and state.stack[-1][1] is arg:
            state.leave()  # c_return / c_exception of the C call that opened the phase

    def restart(self) -> None:
        """Count from now on only (the threads stay profiled): the window of interest
        begins after the threads were started and the scene was set."""
        now = time.perf_counter()
        with self._lock:
            self._totals.clear()
            for state in self._threads:
                state.since = now
            self._start = now

    @contextlib.contextmanager
    def threads_started_inside(self) -> Iterator[PhaseProfile]:
        """Profile the calling thread and every thread started inside the block, until the
        block ends."""
        self._start = time.perf_counter()
        self._stopped = False
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)  # and the calling thread: the cache calls run there
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            self.stop()

    def stop(self) -> None:
        """Stop counting (the first call counts; the hook may stay installed a while)."""
        now = time.perf_counter()
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.wall_s = now - self._start
            for state in self._threads:
                state.close()

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Seconds per phase, per thread kind (summed over the kind's threads), largest
        first; each kind's "threads" entry says how many threads it had."""
        out: dict[str, dict[str, float]] = {}
        counts = collections.Counter(state.kind for state in self._threads)
        for (kind, phase), seconds in sorted(self._totals.items(), key=lambda kv: -kv[1]):
            out.setdefault(kind, {"threads": float(counts[kind])})[phase] = round(seconds, 4)
        return out


def print_breakdown(title: str, profile: PhaseProfile) -> None:
    print(f"{title}: {profile.wall_s:.3f} s wall, time per phase (thread-seconds, summed "
          "over each kind's threads)")
    for kind, phases in profile.breakdown().items():
        threads = int(phases["threads"])
        total = sum(v for k, v in phases.items() if k != "threads") or 1.0
        print(f"  {kind} ({threads} threads):")
        for phase, seconds in phases.items():
            if phase != "threads":
                print(f"    {phase:<48}{seconds:8.3f} s  {seconds / total:6.1%}")

