"""The serving thread's turn at the interpreter.

A serving loop on a GPU spends most of a step's CPU time in Python: its scheduling, its cache
calls, and launching the forward pass -- hundreds of torch calls, each of which lets go of the
interpreter lock and must take it back.  When one of the cache's threads (the trio thread
applying completions, a writer building a batch's headers, a reader reporting) takes the lock
at one of those hand-overs, the serving thread waits for that thread's whole burst of Python:
a few microseconds of launch become tens or hundreds, and the disk tier is felt as a slower
step even though no byte of its I/O is on the serving thread's path.

So the serving thread *holds the foreground* while it works (``held()``), and the cache's
threads, at their yield points (``wait_turn()``), wait until it lets go: when the serving
thread waits for the GPU (the token readback) or is between steps.  A yield point is only
ever where the thread holds no lock and no one waits for it, and the wait is bounded
(``max_wait_s``): a serving thread that never lets go (a CPU device, where the pass itself is
the CPU work) delays the cache's work by that much at a time, never stops it.

The I/O itself never waits here: a read or write runs in C without the interpreter lock.  Only
the Python around it -- building a batch, reporting it, applying it to the core -- is
deferred.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import attrs

MAX_WAIT_S = 0.01
"""How long a cache thread waits for the serving thread to let go before it goes on anyway:
longer than a busy step's launch on the GPU machine (about 8 ms), short enough that a loop
which never waits for its GPU still has its spills and reads applied within a step or two."""


@attrs.frozen(kw_only=True)
class ForegroundStatistics:
    holds: int
    """Times the serving thread took the foreground."""
    yields: int
    """Times a cache thread found the foreground held and waited."""
    timeouts: int
    """Of those, waits that ran out before the serving thread let go."""


class Foreground:
    """Whether the serving thread is working now; a cache thread waits its turn."""

    def __init__(self, max_wait_s: float = MAX_WAIT_S) -> None:
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be positive, got {max_wait_s!r}")
        self._max_wait_s = max_wait_s
        self._free = threading.Event()
        self._free.set()
        self._lock = threading.Lock()
        self._holders = 0
        self._holds = 0
        self._yields = 0
        self._timeouts = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The caller's thread works in the foreground until the block ends (nestable, and
        several threads may hold it at once: it is free when the last one lets go)."""
        with self._lock:
            self._holders += 1
            self._holds += 1
            self._free.clear()
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if not self._holders:
                    self._free.set()

    @property
    def is_held(self) -> bool:
        return not self._free.is_set()

    def wait_turn(self) -> None:
        """A cache thread's yield point: returns at once when no one holds the foreground,
        else when it is let go or after ``max_wait_s``.  Never call it holding a lock the
        serving thread may take."""
        if self._free.is_set():
            return
        let_go = self._free.wait(self._max_wait_s)
        with self._lock:
            self._yields += 1
            if not let_go:
                self._timeouts += 1

    def statistics(self) -> ForegroundStatistics:
        with self._lock:
            return ForegroundStatistics(holds=self._holds, yields=self._yields,
                                        timeouts=self._timeouts)
