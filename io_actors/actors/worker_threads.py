"""Dedicated worker threads that serve jobs for a trio actor.

Blocking file and CUDA work must never run on the trio thread.  Each pool owns N OS threads
of its own (not trio's shared thread cache) because a worker keeps per-thread state -- a
pinned staging buffer and a CUDA stream -- and because closing a pool must leave no thread
behind.

Flow of one job::

    trio: pump task  --(SimpleQueue)-->  worker thread: execute(job) -> Completion
    worker thread    --(token.run_sync_soon)-->  trio: results channel -> deliver task

The pump hands a job to the threads only when one is idle (a trio semaphore of N), so jobs
waiting for a thread stay in the pool's bounded trio channel, where the sender feels the
backpressure.  A thread never waits for the trio thread: it reports with run_sync_soon and
goes back to its queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

import attrs
import trio

from io_actors.actors.foreground import Foreground
from io_actors.actors.gate import CompletionGate
from statekv.messages import Completion, SlotReadFailed, SlotWriteFailed, outcomes

log = logging.getLogger(__name__)

JobT = TypeVar("JobT")
JobT_contra = TypeVar("JobT_contra", contravariant=True)


class WorkerCrashed(RuntimeError):
    """A worker thread raised instead of reporting a completion: a bug, fatal to the cache."""


@attrs.frozen
class _Crash:
    error: BaseException


class Worker(Protocol[JobT_contra]):
    """Per-thread executor: built in its thread, runs jobs there, closed there."""

    def execute(self, job: JobT_contra) -> Completion: ...

    def close(self) -> None: ...


@attrs.frozen(kw_only=True)
class PoolStatistics:
    """Counters of one worker pool.  A job is one batch (WriteSlots / ReadSlots); the
    outcomes are counted per block transfer."""

    workers: int
    queued: int
    """Jobs accepted by the pool and waiting for a thread."""
    in_flight: int
    """Jobs a thread is executing (or whose completion is being reported)."""
    completed: int
    """Block transfers reported as landed."""
    failed: int
    """Block transfers reported as failed (their outcome says why)."""
    dropped_at_close: int
    """Jobs that were queued when the pool was closed without draining."""
    busy_seconds: float
    """Seconds the threads spent executing jobs, summed over threads: against the wall time
    times ``workers``, how busy the pool was (the rest is waiting for work)."""


class WorkerThreads(Generic[JobT]):
    """An actor: N threads executing jobs from one bounded queue, reporting completions.

    `submit` waits while the queue is full (the caller feels the backpressure);
    `submit_nowait` raises trio.WouldBlock instead.  Each completion passes the gate, then
    goes to `report` (the scheduler).  With a `foreground`, a thread waits its turn before
    it starts a job and before it reports one: the Python around the I/O runs while the
    serving thread waits for its GPU (io_actors.actors.foreground).
    """

    def __init__(
        self,
        name: str,
        *,
        workers: int,
        queue_depth: int,
        make_worker: Callable[[int], Worker[JobT]],
        gate: CompletionGate,
        report: Callable[[Completion], Awaitable[None]],
        foreground: Foreground | None = None,
    ) -> None:
        self.name = name
        self._foreground = foreground
        self.workers = workers
        self._make_worker = make_worker
        self._gate = gate
        self._report = report
        self._send, self._recv = trio.open_memory_channel[JobT](queue_depth)
        self._queue: queue.SimpleQueue[JobT | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._queued = 0
        self._in_flight = 0
        self._completed = 0
        self._failed = 0
        self._dropped = 0
        self._busy_seconds = [0.0] * workers
        """Seconds each thread spent in execute(): written by that thread only."""
        self._idle = trio.Semaphore(workers)
        self._results_send, self._results_recv = trio.open_memory_channel[
            Completion | _Crash
        ](float("inf"))
        self._exited = 0
        self._all_exited = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stopped = False

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            workers=self.workers, queued=self._queued, in_flight=self._in_flight,
            completed=self._completed, failed=self._failed, dropped_at_close=self._dropped,
            busy_seconds=sum(self._busy_seconds),
        )

    @property
    def busy(self) -> int:
        """Jobs accepted and not yet reported; none once `run` has returned: a pool stopped by
        a crashed worker (or cancelled) reports nothing more, and whoever waits for its jobs
        (the scheduler's close) must not wait for ever."""
        if self._stopped:
            return 0
        return self._queued + self._in_flight

    async def submit(self, job: JobT) -> None:
        """Queue a job, waiting while the queue is full."""
        self._queued += 1
        try:
            await self._send.send(job)
        except BaseException:
            self._queued -= 1
            raise

    def submit_nowait(self, job: JobT) -> None:
        """Queue a job; raises trio.WouldBlock when the queue is full."""
        self._send.send_nowait(job)
        self._queued += 1

    def close_queue(self, *, drop_queued: bool) -> list[JobT]:
        """Accept no more jobs; with `drop_queued`, take back those no thread started."""
        dropped: list[JobT] = []
        if drop_queued:
            while True:
                try:
                    dropped.append(self._recv.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
            self._queued -= len(dropped)
            self._dropped += len(dropped)
        self._send.close()
        return dropped

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve jobs until the queue is closed and drained, then stop every thread."""
        self._token = trio.lowlevel.current_trio_token()
        for i in range(self.workers):
            thread = threading.Thread(
                target=self._thread_main, args=(i,), name=f"statekv-{self.name}-{i}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._deliver_results)
                task_status.started()
                try:
                    async with self._recv:
                        async for job in self._recv:
                            await self._idle.acquire()
                            self._queued -= 1
                            self._in_flight += 1
                            self._queue.put(job)
                finally:
                    for _ in self._threads:
                        self._queue.put(None)
                    with trio.CancelScope(shield=True):
                        await self._all_exited.wait()
                        for thread in self._threads:
                            thread.join()
                        self._results_send.close()
        finally:
            self._stopped = True

    def _thread_main(self, index: int) -> None:
        token = self._token
        assert token is not None
        try:
            worker = self._make_worker(index)
        except BaseException:
            log.exception("%s worker %d could not start", self.name, index)
            token.run_sync_soon(self._thread_exited)
            raise
        wait_turn = self._foreground.wait_turn if self._foreground is not None else None
        busy = self._busy_seconds
        try:
            while True:
                job = self._queue.get()
                if job is None:
                    return
                if wait_turn is not None:
                    wait_turn()
                began = time.perf_counter()
                try:
                    result: Completion | _Crash = worker.execute(job)
                except BaseException as exc:
                    # A worker reports I/O failures as completions; anything else is a bug,
                    # and it must stop the cache loudly rather than leave a transfer that
                    # never reports back.
                    log.exception("%s worker %d crashed on %r", self.name, index, job)
                    result = _Crash(exc)
                busy[index] += time.perf_counter() - began
                if wait_turn is not None:
                    # The report wakes the trio thread, which applies it to the core.
                    wait_turn()
                token.run_sync_soon(self._results_send.send_nowait, result)
        finally:
            try:
                worker.close()
            finally:
                token.run_sync_soon(self._thread_exited)

    def _thread_exited(self) -> None:
        self._exited += 1
        if self._exited == self.workers:
            self._all_exited.set()

    async def _deliver_results(self) -> None:
        async with trio.open_nursery() as nursery:
            async for result in self._results_recv:
                self._idle.release()
                if isinstance(result, _Crash):
                    raise WorkerCrashed(f"a {self.name} worker crashed") from result.error
                # One task per completion: a gate may hold some while others are reported.
                nursery.start_soon(self._deliver_one, result)

    async def _deliver_one(self, result: Completion) -> None:
        try:
            await self._gate.hold(result)
            await self._report(result)
        finally:
            self._in_flight -= 1
            for outcome in outcomes(result):
                if isinstance(outcome, SlotWriteFailed | SlotReadFailed):
                    self._failed += 1
                else:
                    self._completed += 1
