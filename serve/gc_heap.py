"""The start-up heap, frozen while the server serves.

A full (oldest-generation) collection of the cyclic garbage collector walks every tracked
object of the process while holding the interpreter lock, so every thread stops for it: the
engine's step, the cache's threads, the HTTP loop.  In a server started in-process on the
CPU machine (BENCHMARKS.md, the collector's pauses) the start-up left about 394,000 tracked
objects, and a full collection took 159-194 ms; with them frozen, 0.2-2.0 ms.  With the disk
tier busy the cache's threads make enough short-lived containers to set one off now and
then: the sweep's (d) points on an H100 had one full collection of 155-257 ms in four of
five points, each a stall of every request in flight.

The objects made at start-up -- modules, the model's weights' wrappers, the cache's block
records -- live as long as the server, so the collector can gain nothing by walking them.
:func:`startup_heap_frozen` moves them out of its generations (``gc.freeze()``) once the
server is built, as vLLM's engine does after its own start-up, and gives them back at
shutdown, so that what the server made can be freed when it is done (an embedding process,
or a test, that starts another one after it).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Collect once, then freeze every tracked object until the block ends."""
    # One full collection first: garbage left by the start-up would otherwise be frozen
    # with the rest and never freed.
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
