"""Small integer tables for this package's CUDA kernels, read from pinned host memory.

The batched kernels (page copies, page checksums) take a table per launch: which pages, and
where each result goes.  A kernel can read pinned host memory through its mapped address (it
is mapped into the device's address space under unified addressing), so the table needs no
copy to the device of its own -- only to stay unchanged until the kernel has run.

Each launch once built its tables as new pinned tensors (``torch.tensor(...,
pin_memory=True)``) and copied them to the device.  On the serving thread, with the copy
stream busy, those small allocations and copies were the largest part of a cache call's
dispatch: py-spy over a 4k-history pressure-3 sweep point on an H100 found about a quarter
of the serving thread's dispatch samples on that one line.  torch's pinned allocator can
hand a block back only once the stream work recorded against it has passed, and queries
every such pending block as it allocates.  Here a table is a reused buffer: written from
Python through a numpy view, handed back when the event recorded after its kernel has passed.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Final

import torch

CAPACITY: Final = 1024
"""Entries of one reused buffer (8 KiB).  A longer table gets a pinned buffer of its own,
which is dropped, not reused, once its kernel has run."""


class PinnedTables:
    """Reusable pinned int64 tables, one per kernel launch in flight.  Thread safe."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self._capacity = capacity
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._busy: collections.deque[tuple[torch.cuda.Event, torch.Tensor]] = (
            collections.deque())
        self.allocated = 0
        """Pinned buffers made so far (reused ones are not counted again)."""

    def table(self, values: Sequence[int]) -> torch.Tensor:
        """A pinned int64 tensor whose first ``len(values)`` entries are `values`.  The caller
        launches its kernel on a stream and then calls :meth:`launched` with that stream;
        until then the table is its own."""
        n = len(values)
        with self._lock:
            busy = self._busy
            while busy and busy[0][0].query():  # type: ignore[no-untyped-call]
                _event, done = busy.popleft()
                if done.numel() == self._capacity:
                    self._free.append(done)
            buffer = self._free.pop() if self._free and n <= self._capacity else None
            if buffer is None:
                self.allocated += 1
        if buffer is None:
            buffer = torch.empty(max(n, self._capacity), dtype=torch.int64, pin_memory=True)
        buffer.numpy()[:n] = values
        return buffer

    def launched(self, table: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """The kernel that reads `table` is enqueued on `stream`: the table is reused once
        the stream has passed it."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        with self._lock:
            self._busy.append((event, table))

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._busy)
