"""The serving thread's foreground: while it holds it, the cache's threads keep their Python
(starting a batch, reporting it, applying it to the core) for when it lets go -- within a
bound, so a loop that never lets go still has its disk work done."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
import trio

from io_actors.actors.foreground import Foreground
from io_actors.actors.gate import OpenGate
from io_actors.actors.worker_threads import WorkerThreads
from io_actors.embed import BlockingCache
from models import serving_loop
from models.config import preset
from models.model import PagedDecoder
from models.model import greedy as real_greedy
from models.serving_loop import Cache, ServeRequest, ServingLoop
from statekv.errors import UsageError
from statekv.ids import TransferId
from statekv.messages import BatchFinished, Completion, SlotWritten
from tests.io_helpers import compute, small_config, wait_quiet
from tests.test_serving_prefetch import serving_config

LONG = 60.0
"""A bound no test reaches: what these tests see is the let-go, not the timeout."""


def _held(fg: Foreground) -> bool:
    return fg.is_held


def test_a_cache_thread_waits_until_every_holder_lets_go() -> None:
    fg = Foreground(max_wait_s=LONG)
    fg.wait_turn()  # free: returns at once, and is not counted as a wait
    passed = threading.Event()

    def cache_thread() -> None:
        fg.wait_turn()
        passed.set()

    with fg.held():
        with fg.held():  # nested, or a second serving thread
            thread = threading.Thread(target=cache_thread)
            thread.start()
            assert not passed.wait(0.1)
        assert _held(fg)
        assert not passed.wait(0.1)
    thread.join(5)
    assert passed.is_set()
    assert not _held(fg)
    stats = fg.statistics()
    assert (stats.holds, stats.yields, stats.timeouts) == (2, 1, 0)


def test_a_foreground_never_let_go_delays_a_cache_thread_by_the_bound_only() -> None:
    fg = Foreground(max_wait_s=0.05)
    with fg.held():
        began = time.monotonic()
        fg.wait_turn()
        waited = time.monotonic() - began
    assert 0.04 <= waited < 5
    assert fg.statistics().timeouts == 1


@pytest.mark.parametrize("bound", [0, -1.0, float("nan")])
def test_the_bound_must_be_positive(bound: float) -> None:
    with pytest.raises(ValueError, match="max_wait_s"):
        Foreground(max_wait_s=bound)


class _Executor:
    """Records when a job starts; a job waits for `finish` before it returns."""

    def __init__(self, started: list[int], finish: threading.Event) -> None:
        self._started, self._finish = started, finish

    def execute(self, job: int) -> Completion:
        self._started.append(job)
        assert self._finish.wait(10)
        return BatchFinished(outcomes=(SlotWritten(transfer=TransferId(job)),))

    def close(self) -> None:
        return None


def _pool(fg: Foreground, started: list[int], finish: threading.Event,
          reported: list[Completion]) -> WorkerThreads[int]:
    async def report(completion: Completion) -> None:
        reported.append(completion)

    return WorkerThreads("fgtest", workers=1, queue_depth=4,
                         make_worker=lambda _i: _Executor(started, finish), gate=OpenGate(),
                         report=report, foreground=fg)


async def _until(condition: Any) -> None:
    with trio.fail_after(10):
        while not condition():
            await trio.sleep(0.001)


def test_a_pool_thread_starts_and_reports_a_job_only_once_the_foreground_is_let_go() -> None:
    fg = Foreground(max_wait_s=LONG)
    started: list[int] = []
    reported: list[Completion] = []
    finish = threading.Event()
    pool = _pool(fg, started, finish, reported)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            # Held before the job is queued: the thread does not start it.
            with fg.held():
                await pool.submit(1)
                await trio.sleep(0.2)
                assert started == []
            await _until(lambda: started == [1])
            # Held while the job's I/O runs: the I/O finishes, its report waits.
            with fg.held():
                finish.set()
                await trio.sleep(0.2)
                assert reported == []
            await _until(lambda: len(reported) == 1)
            pool.close_queue(drop_queued=False)

    trio.run(main)
    assert fg.statistics().timeouts == 0


def test_a_pool_under_a_foreground_never_let_go_still_runs_every_job() -> None:
    fg = Foreground(max_wait_s=0.02)
    started: list[int] = []
    reported: list[Completion] = []
    finish = threading.Event()
    finish.set()
    pool = _pool(fg, started, finish, reported)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            with fg.held():
                for job in range(3):
                    await pool.submit(job)
                await _until(lambda: len(reported) == 3)
            pool.close_queue(drop_queued=False)

    trio.run(main)
    assert started == [0, 1, 2]
    assert fg.statistics().timeouts >= 3


def test_spills_are_handed_to_the_disk_only_after_the_serving_thread_lets_go(
        tmp_path: Path) -> None:
    """End to end: the serving thread's calls queue spills; while it holds the foreground the
    cache's trio thread does not move them to the writers, and nothing lands."""
    with BlockingCache(small_config(tmp_path)) as cache:
        fg = cache._scheduler.foreground
        fg._max_wait_s = LONG
        with cache.foreground():
            for i in range(6):  # 12 blocks through 8 GPU pages and 2 host pages
                tokens = list(range(1000 * i, 1000 * i + 8))
                cache.add_request(f"r{i}", tokens)
                compute(cache, f"r{i}", tokens)
                cache.release(f"r{i}")
            queued = cache.statistics()
            time.sleep(0.2)
            held = cache.statistics()
        assert queued.cache.writes_in_flight > 0
        assert held.cache.bytes_written == 0 and held.writer is not None
        assert held.writer.in_flight == 0 and held.writer.completed == 0
        wait_quiet(cache)
        landed = cache.statistics()
        assert landed.cache.bytes_written > 0
        assert landed.foreground is not None and landed.foreground.timeouts == 0


class _Watched:
    """Wraps the model or the cache and notes, for each call named, whether the foreground
    was held."""

    def __init__(self, target: Any, fg: Foreground, names: set[str], seen: list[str]) -> None:
        self._target, self._fg, self._names, self._seen = target, fg, names, seen

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name not in self._names:
            return value

        def watched(*args: Any, **kwargs: Any) -> Any:
            self._seen.append(f"{name} {'held' if self._fg.is_held else 'free'}")
            return value(*args, **kwargs)
        return watched


def test_the_serving_loop_holds_the_foreground_except_while_it_waits_for_the_logits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = PagedDecoder(preset("tiny"))
    seen: list[str] = []
    with BlockingCache(serving_config(tmp_path, model)) as real:
        fg = real._scheduler.foreground

        def greedy(logits: Any) -> list[int]:
            seen.append(f"readback {'held' if fg.is_held else 'free'}")
            return real_greedy(logits)

        monkeypatch.setattr(serving_loop, "greedy", greedy)
        loop = ServingLoop(cast(PagedDecoder, _Watched(model, fg, {"forward"}, seen)),
                           cast(Cache, _Watched(real, fg, {"add_request", "commit"}, seen)),
                           hold_foreground=True)
        loop.submit(ServeRequest(request_id="a", prompt=tuple(range(1, 10)), max_new_tokens=3))
        loop.drain()
        stats = loop.statistics()
        passes = stats.prefill_steps.steps + stats.decode_steps.steps
        # Once before the pass and once for the commits; a step with nothing to run ends
        # inside the first.
        assert fg.statistics().holds == stats.steps + passes
    assert set(seen) == {"add_request held", "forward held", "commit held", "readback free"}
    assert seen.count("readback free") == passes


def test_on_a_cpu_the_loop_holds_no_foreground_unless_told(tmp_path: Path) -> None:
    model = PagedDecoder(preset("tiny"))
    with BlockingCache(serving_config(tmp_path, model)) as cache:
        loop = ServingLoop(model, cache)
        assert loop.hold_foreground is False  # the pass is the CPU's work: no wait to give
        loop.submit(ServeRequest(request_id="a", prompt=tuple(range(1, 10)), max_new_tokens=2))
        loop.drain()
        stats = cache.statistics().foreground
        assert stats is not None and stats.holds == 0
        with pytest.raises(UsageError, match="hold_foreground"):
            ServingLoop(model, cache, hold_foreground=cast(bool, "yes"))
