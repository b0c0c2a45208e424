"""How `statekv serve` ends on SIGTERM: as an exception, so that every `finally` runs.

uvicorn shuts down gracefully on SIGTERM and then raises the signal again, once it has put
back the handler it found.  With Python's default handler the process would die right there,
before the cache is closed and the server's temporary directory removed.  With this one the
signal becomes :class:`Terminated`, which unwinds the server and reaches the command, which
exits 143 (128 + SIGTERM) with one line.  Kept apart from the server so that the command can
catch it without importing the server's optional dependencies.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Terminated(Exception):
    """SIGTERM ended the server (after its graceful shutdown)."""


def _raise_terminated(_sig: int, _frame: Any) -> None:
    raise Terminated


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside: SIGTERM raises Terminated (in the main thread); the old handler after."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
