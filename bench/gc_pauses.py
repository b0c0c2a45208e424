"""How long the cyclic garbage collector stopped every thread during a timed run.

A collection holds the interpreter lock from start to end, so the serving thread's step
waits for it whichever thread set it off; a full (oldest-generation) collection walks every
tracked object of the process -- about 280,000 after importing torch and this package, 122-124
ms each on the H100 machine's CPU (2026-12-06), none once they are frozen (``gc.freeze()``).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

from serve.gc_heap import startup_heap_frozen


class GcPauses:
    """The cyclic collector's runs from now until :meth:`stop`, from any thread: each one
    holds the interpreter lock throughout, so every thread waits for it."""

    def __init__(self) -> None:
        self.collections = 0
        self.total = 0.0
        self.full: list[float] = []
        """Seconds of each full (oldest-generation) collection."""
        self._started: dict[int, float] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = now
            return
        began = self._started.pop(thread, None)
        if began is None:
            return
        self.collections += 1
        self.total += now - began
        if info["generation"] == 2:
            self.full.append(now - began)

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


@contextlib.contextmanager
def collector_watched(*, freeze: bool) -> Iterator[GcPauses]:
    """The collector's runs over the block.  With `freeze`, the generations are frozen first,
    as a server does once it has started (vLLM's engine does the same): the objects made so
    far -- torch's, the model's, the cache's -- leave them, so a full collection walks only
    what came after; they are given back after the block (serve.gc_heap, the server's own)."""
    with startup_heap_frozen() if freeze else contextlib.nullcontext():
        pauses = GcPauses()
        try:
            yield pauses
        finally:
            pauses.stop()
