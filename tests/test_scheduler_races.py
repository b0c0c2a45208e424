"""Three races of the scheduler, each held open deterministically (no thread timing).

1. A release between the blocking facade's `is_ready` (caller's thread) and the waiter it
   hands to the trio thread: the waiter finds the request gone and must return, not raise
   inside a trio system task (which killed the actor, and with it the cache).
2. With `synchronous_io=True` and a shared tier, a fetch issued in the same call as a
   synchronous spill must still be scheduled.
3. Every field the scheduler's threads share changes under the scheduler's lock.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from io_actors.actors.scheduler import Scheduler
from io_actors.embed import BlockingCache
from statekv.messages import Completion
from tests.io_helpers import BLOCK_SIZE, compute, serve, small_config, wait_quiet
from tests.redis_cluster import LocalRedisCluster
from tests.test_io_actors import HoldReads, churn


class _TokenSpy:
    """A TrioToken that says when a callback was queued (the facade's hand-over)."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self.queued = threading.Event()

    def run_sync_soon(self, fn: Callable[..., object], *args: object) -> None:
        self._token.run_sync_soon(fn, *args)
        self.queued.set()


class HoldReadsUntilOpened(HoldReads):
    """Holds read completions until `open` (then lets every later one through)."""

    opened = False

    async def hold(self, completion: Completion) -> None:
        if not self.opened:
            await super().hold(completion)

    def open(self) -> None:
        self.opened = True
        if self.token is not None:
            self.release_all()


def _hold_trio_thread(cache: BlockingCache) -> threading.Event:
    """Block the cache's trio thread until the returned event is set."""
    token = cache._token
    assert token is not None
    running, go = threading.Event(), threading.Event()

    def blocker() -> None:
        running.set()
        assert go.wait(30), "the test never let the trio thread go"

    token.run_sync_soon(blocker)
    assert running.wait(10)
    return go


def test_a_release_while_wait_ready_hands_over_returns_and_the_cache_lives(
    tmp_path: Path,
) -> None:
    prompt = list(range(13))
    hold = HoldReadsUntilOpened()
    with BlockingCache(small_config(tmp_path), gate=hold) as cache:
        serve(cache, "first", prompt)
        churn(cache, 6)
        match = cache.add_request("parked", prompt)
        assert match.disk_tokens == 12 and not cache.is_ready("parked")
        # The window: wait_ready saw the request parked on this side, and its waiter is
        # queued for the trio thread, which is held until the request was released.
        go = _hold_trio_thread(cache)
        real_token = cache._token
        assert real_token is not None
        spy = _TokenSpy(real_token)
        cache._token = spy  # type: ignore[assignment]
        answer: list[bool] = []
        waiter = threading.Thread(target=lambda: answer.append(cache.wait_ready("parked", 10)))
        waiter.start()
        assert spy.queued.wait(10)
        cache._token = real_token
        cache.release("parked")
        go.set()
        waiter.join(15)
        assert answer == [True]  # gone is an answer
        hold.open()
        wait_quiet(cache)
        # The actor is alive: the cache serves, and closes cleanly.
        serve(cache, "after", prompt)
        cache.check_invariants()
    assert cache.close_report is not None


def test_async_wait_ready_returns_for_a_request_released_before_it_ran(
    tmp_path: Path,
) -> None:
    from io_actors.embed import open_cache

    prompt = list(range(13))

    async def main() -> None:
        hold = HoldReadsUntilOpened()
        async with open_cache(small_config(tmp_path), gate=hold) as cache:
            for i in range(7):
                rid = f"r{i}"
                tokens = prompt if i == 0 else [10_000 + 100 * i + t for t in range(17)]
                cache.add_request(rid, tokens)
                compute(cache, rid, tokens)
                cache.release(rid)
                while cache.statistics().cache.writes_in_flight:
                    await trio.sleep(0.001)
            for rid in ("released-first", "released-while-waiting"):
                match = cache.add_request(rid, prompt)
                assert match.disk_tokens == 12 and not cache.is_ready(rid)
            cache.release("released-first")
            with trio.fail_after(10):
                await cache.wait_ready("released-first")  # gone: at once
            async with trio.open_nursery() as nursery:
                done = trio.Event()

                async def waiter() -> None:
                    await cache.wait_ready("released-while-waiting")
                    done.set()

                nursery.start_soon(waiter)
                await trio.testing.wait_all_tasks_blocked()
                assert not done.is_set()
                cache.release("released-while-waiting")
                with trio.fail_after(10):
                    await done.wait()
            hold.open()

    trio.run(main)


@pytest.fixture
def namespace() -> str:
    return f"s{uuid.uuid4().hex[:12]}"


def test_a_fetch_issued_with_a_synchronous_spill_is_scheduled(
    tmp_path: Path, redis_cluster: LocalRedisCluster, namespace: str,
) -> None:
    def config(directory: Path) -> Any:
        return small_config(directory, model_fingerprint="model-a",
                            remote_url=redis_cluster.url, remote_namespace=namespace,
                            remote_timeout_s=0.5)

    prompt = [(7 * i + 3) % 97 for i in range(3 * BLOCK_SIZE + 1)]
    with BlockingCache(config(tmp_path / "a")) as a:
        serve(a, "a", prompt)
        churn(a, 6)  # the prompt's blocks leave A's GPU: published
        wait_quiet(a)
    assert a.close_report is not None and a.close_report.drained
    # Host room for the GPU's victims, whose own host victims are written to disk inline.
    with BlockingCache(attrs.evolve(config(tmp_path / "b"), host=4), synchronous_io=True) as b:
        for i in range(3):  # fill B's GPU and host with its own cached content
            serve(b, f"own{i}", [50_000 + 100 * i + t for t in range(4 * BLOCK_SIZE + 1)])
        spills = b.statistics().cache.spills
        match = b.add_request("b", prompt)
        # The same call made room on the GPU for the fetched pages: a spill ran inline.
        assert b.statistics().cache.spills > spills
        assert match.remote_tokens == 3 * BLOCK_SIZE, match
        assert b.wait_ready("b", timeout=10)
        stats = b.statistics().cache
        assert stats.fetches_completed == 3 and stats.fetch_failures == 0
        assert b.request_status("b").num_computed_tokens == 3 * BLOCK_SIZE
        b.release("b")
        b.check_invariants()


# --- 3: one rule for the fields the scheduler's threads share --------------------------


class _OwnedLock:
    """A lock that knows which thread holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.release()

    def locked(self) -> bool:
        return self._lock.locked()


SHARED_FIELDS = ("_fetches_busy", "_retention_busy", "_slots_discarded", "_wake_pending",
                 "_retention")
"""The scheduler's fields that the API threads and the trio thread both change."""


@pytest.fixture
def unlocked_changes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every scheduler built in the test checks that each shared field changes only while
    its lock is held by the changing thread; the violations are listed."""
    violations: list[str] = []
    for name in SHARED_FIELDS:
        store = f"_checked{name}"

        def get(self: Scheduler, store: str = store) -> object:
            return getattr(self, store)

        def set_(self: Scheduler, value: object, name: str = name, store: str = store) -> None:
            lock = self.__dict__.get("_lock")
            if isinstance(lock, _OwnedLock) and lock.owner != threading.get_ident():
                violations.append(f"{name} changed on {threading.current_thread().name} "
                                  "without the scheduler's lock")
            object.__setattr__(self, store, value)

        monkeypatch.setattr(Scheduler, name, property(get, set_), raising=False)
    original_init = Scheduler.__init__

    def init(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._lock = _OwnedLock()  # type: ignore[assignment]

    monkeypatch.setattr(Scheduler, "__init__", init)
    yield violations


def test_every_shared_scheduler_field_changes_under_the_lock(
    tmp_path: Path, redis_cluster: LocalRedisCluster, namespace: str,
    unlocked_changes: list[str],
) -> None:
    """Fetches, spills, frees and retention appends all run: none of their counters
    changes without the lock (a lost update of the fetch counter would hang close())."""
    def config(directory: Path) -> Any:
        return small_config(directory, model_fingerprint="model-a",
                            remote_url=redis_cluster.url, remote_namespace=namespace,
                            remote_timeout_s=0.5)

    prompt = [(5 * i + 2) % 89 for i in range(3 * BLOCK_SIZE + 1)]
    with BlockingCache(config(tmp_path / "a")) as a:
        serve(a, "a", prompt, ttl_seconds=600)
        churn(a, 6)
        wait_quiet(a)
    with BlockingCache(config(tmp_path / "b")) as b:
        match = b.add_request("b", prompt)
        assert match.remote_tokens == 3 * BLOCK_SIZE
        assert b.wait_ready("b", timeout=10)
        compute(b, "b", prompt)
        b.release("b")
        churn(b, 4, start=3000)  # B's own content: spills, frees, no more fetches
        b.check_invariants()
        assert b.statistics().cache.fetches_completed == 3
    assert unlocked_changes == []
