"""Waiters on the async API, started by the system machine on parked requests.

A serving loop that cannot poll ``is_ready`` waits: a trio program through
``open_cache(...).wait_ready`` (the :class:`~io_actors.embed.AsyncCache` that the blocking
facade itself runs on its trio thread), a synchronous one through
``BlockingCache.wait_ready``.  The system machine starts either kind on a request whose
onboard reads are held at the gate, then releases the reads one at a time, in any order,
some failing, and releases or cancels requests; what a waiter sees when it wakes must be one
of:

* **ready**, and every block it has computed byte-identical to the KV written for its prefix
  (a read that failed rewound it: fewer computed tokens, never a wrong byte);
* **gone**: the request was released while it waited.

Anything else is recorded as a problem: a waiter that wakes while its request is still parked
(an early return), a facade that says False for a request that is ready or gone.  Two more
failures are found without waiting for a wake-up that never comes: a request that is ready or
gone while the scheduler still holds a registration for it is a missed wake-up
(:meth:`Waiters.missed`), and the machine is not quiet until every waiter whose request is
ready or gone has woken (:meth:`Waiters.all_woken`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import attrs
import torch
import trio

from fuzz.driver import Driver
from io_actors.embed import BlockingCache
from statekv.arith import blocks_for_tokens
from statekv.ids import RequestId

JOIN_TIMEOUT = 10.0
"""Seconds a blocking waiter may take to return once its cache closed."""


@attrs.define
class Waiter:
    rid: str
    blocking: bool
    """Through BlockingCache.wait_ready (a thread) rather than the async API (a trio task)."""
    woke: bool = False
    outcome: str | None = None
    """"ready", "gone", or "closed" (its cache closed while it waited)."""


class Waiters:
    """Every waiter started on one cache, and what each saw when it woke."""

    def __init__(self, driver: Driver, notify: Callable[[], None]) -> None:
        self._d = driver
        # The cache itself, not the driver's (a failed example's clean-up lets go of it while
        # a blocking waiter may still be returning), and weakly: the leak check must see its
        # memory go when the driver lets go of it.
        self._cache = weakref.ref(driver.api)
        self._notify = notify
        self.all: list[Waiter] = []
        self.problems: list[str] = []
        self._threads: list[threading.Thread] = []

    def _api(self) -> BlockingCache:
        cache = self._cache()
        assert cache is not None, "a waiter outlived its cache"
        return cache

    def start(self, rid: str, *, blocking: bool) -> None:
        waiter = Waiter(rid, blocking)
        self.all.append(waiter)
        if blocking:
            thread = threading.Thread(target=self._block, args=(waiter,), name="fuzz-waiter",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
            return
        token = self._api()._token
        assert token is not None
        token.run_sync_soon(trio.lowlevel.spawn_system_task, self._wait_async, waiter)

    async def _wait_async(self, waiter: Waiter) -> None:
        cache = self._api().async_cache
        assert cache is not None
        try:
            await cache.wait_ready(waiter.rid)
        except trio.Cancelled:
            self._woke(waiter, "closed")  # the cache's trio loop ended under it
            raise
        except BaseException as exc:  # a system task must not crash the cache's loop
            self._woke(waiter, f"raised {exc!r}")
            self.problems.append(f"wait_ready({waiter.rid}) raised {exc!r}")
            return
        self._observe(waiter, None)

    def _block(self, waiter: Waiter) -> None:
        try:
            returned = self._api().wait_ready(waiter.rid)
        except BaseException as exc:
            self._woke(waiter, f"raised {exc!r}")
            self.problems.append(f"BlockingCache.wait_ready({waiter.rid}) raised {exc!r}")
            return
        self._observe(waiter, returned)

    def _observe(self, waiter: Waiter, returned: bool | None) -> None:
        """What the waiter sees as it wakes, under the scheduler's lock."""
        d = self._d
        cache = self._cache()
        if cache is None:  # a failed example cleaned up: nothing to check
            self._woke(waiter, "closed")
            return
        scheduler = cache._scheduler
        with scheduler._lock:
            core = scheduler._core
            gone = not core.has_request(waiter.rid)
            ready = not gone and core.is_ready(waiter.rid)
            if scheduler._closed and not (gone or ready):
                self._woke(waiter, "closed")
                return
            via = "BlockingCache.wait_ready" if waiter.blocking else "wait_ready"
            if not (gone or ready):
                self.problems.append(f"{via}({waiter.rid}) returned while the request is "
                                     "still parked")
            if returned is not None and returned != (gone or ready):
                self.problems.append(f"{via}({waiter.rid}) returned {returned} for a request "
                                     f"that is {'gone' if gone else 'ready'}")
            req = d.live.get(waiter.rid)
            if ready and req is not None:
                if d.device == "cuda":
                    torch.cuda.synchronize()
                status = core.request_status(waiter.rid)
                table = core.block_table(waiter.rid)
                for i in range(blocks_for_tokens(status.num_computed_tokens, d.block_size)):
                    if not torch.equal(d.page(table[i]).cpu(),
                                       d.payloads.bytes_of(req.serials[i])):
                        self.problems.append(f"{via}({waiter.rid}) woke to block {i} holding "
                                             "bytes other than its KV")
        self._woke(waiter, "gone" if gone else "ready")

    def _woke(self, waiter: Waiter, outcome: str) -> None:
        waiter.outcome = outcome
        waiter.woke = True
        self._notify()

    # ------------------------------------------------------------------ the machine's checks

    def _parked(self) -> dict[str, int]:
        """Waiters not woken yet, by request."""
        out: dict[str, int] = {}
        for waiter in self.all:
            if not waiter.woke:
                out[waiter.rid] = out.get(waiter.rid, 0) + 1
        return out

    def missed(self) -> list[str]:
        """Requests ready or gone that the scheduler still holds a waiter for (call under the
        scheduler's lock): those waiters will never be woken."""
        scheduler = self._api()._scheduler
        core = scheduler._core
        return [rid for rid in scheduler._ready_waiters
                if not core.has_request(rid) or core.is_ready(rid)]

    def all_woken(self) -> bool:
        """Whether every waiter is where it should be: woken if its request is ready or gone,
        registered with the scheduler if it is parked (call under the scheduler's lock)."""
        scheduler = self._api()._scheduler
        core = scheduler._core
        for rid, count in self._parked().items():
            if not core.has_request(rid) or core.is_ready(rid):
                return False  # woken by now, on its way to observe
            if len(scheduler._ready_waiters.get(RequestId(rid), [])) < count:
                return False  # not registered yet
        return True

    def check(self) -> None:
        assert not self.problems, self.problems

    def join(self) -> None:
        """After the cache closed: every blocking waiter returned."""
        for thread in self._threads:
            thread.join(JOIN_TIMEOUT)
            assert not thread.is_alive(), "BlockingCache.wait_ready did not return at close"
