"""statekv's actors, transfer backends and embedding facades.

The pure core (``statekv``) decides; this package does: a trio scheduler actor that owns the
core, a writer pool and a reader pool of dedicated threads, the POSIX (O_DIRECT) and kvikio
slot stores, the torch memory pools, and the two ways to embed the cache:
:func:`open_cache` for trio programs and :class:`BlockingCache` for synchronous loops.

The modules at this level are the facades users import (``embed``, ``config``, ``metrics``
and the names below); the rest is in layers, each importing only those below it:
``tensor_parallel/`` (above the facades), ``actors/``, ``memory/``, then ``storage/`` and
``tracing/`` on the core.  Each subpackage's docstring says what it owns.
"""

from io_actors.actors.scheduler import CloseReport, SystemStatistics
from io_actors.config import StateKVConfig
from io_actors.embed import AsyncCache, BlockingCache, CacheAPI, open_cache

__all__ = [
    "AsyncCache",
    "BlockingCache",
    "CacheAPI",
    "CloseReport",
    "StateKVConfig",
    "SystemStatistics",
    "open_cache",
]
