"""A server short of file descriptors logs each failed accept once per interval, not per try.

When the process runs out of file descriptors (or kernel buffers), asyncio's accept loop
logs "socket.accept() out of system resource" with a full traceback every time it retries
(ACCEPT_RETRY_DELAY, one second, per listening socket and per waiting connection): measured
with 48 descriptors, 29 MB of log in 17 s, burying the line that says what is wrong.  This
filter, installed on asyncio's logger by `statekv serve` for the life of the server, lets the
first such record through with its traceback, then at most one per `interval` seconds,
without the traceback and with the count of those held back.

The same goes for the retries asyncio schedules after each failed accept (one per try, up to
the listen backlog per wake-up): when the server shuts down, its listening socket is closed
under thousands of them, and each logs "Exception in callback
BaseSelectorEventLoop._start_serving(...)" with a traceback (14,187 of them, 22 MB, in one
four-second run with 40 descriptors to spare).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ACCEPT_ERROR = "socket.accept() out of system resource"
"""The start of asyncio's message (asyncio/selector_events.py)."""
ACCEPT_RETRY_FAILED = "Exception in callback BaseSelectorEventLoop._start_serving"
"""How asyncio reports a scheduled accept retry that failed (the socket closed under it)."""
LIMITED = (ACCEPT_ERROR, ACCEPT_RETRY_FAILED)


class AcceptErrorLimit(logging.Filter):
    """Rate-limits asyncio's accept-error records, each kind of :data:`LIMITED` on its own;
    every other record passes untouched."""

    def __init__(self, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    @property
    def held_back(self) -> int:
        """Records dropped since the last one of their kind was logged."""
        return sum(self._held.values())

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        kind = next((k for k in LIMITED if text.startswith(k)), None)
        if kind is None:
            return True
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        if last is not None:
            record.msg = (f"{kind} (again; {self._held.get(kind, 0)} more in the last "
                          f"{now - last:.0f} s; raise the file descriptor limit)")
            record.args = None
            record.exc_info = None
            record.exc_text = None
        self._last[kind] = now
        self._held[kind] = 0
        return True


@contextmanager
def accept_errors_limited(interval: float = 10.0) -> Iterator[AcceptErrorLimit]:
    """Inside: asyncio's accept errors are rate-limited (the filter is removed after)."""
    limit = AcceptErrorLimit(interval)
    logger = logging.getLogger("asyncio")
    logger.addFilter(limit)
    try:
        yield limit
    finally:
        logger.removeFilter(limit)
