"""Recording every lifecycle transition.

The block records (:mod:`statekv.records`) call ``sink.record(...)`` once per transition
when a sink is attached; with no sink the cost is one ``is None`` test per transition.
:class:`RingTrace` keeps the last N records in a preallocated ring (bounded memory however
long the process runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import attrs

from statekv.ids import BlockId, RequestId
from statekv.lifecycle import BlockEvent, BlockState


@attrs.frozen(kw_only=True)
class TransitionRecord:
    """One block changed state."""

    time: float
    block: BlockId
    request: RequestId | None
    """The request whose call caused it, when one did."""
    from_state: BlockState
    to_state: BlockState
    event: BlockEvent


class TraceSink(Protocol):
    """Receives every transition, in order."""

    def record(
        self,
        time: float,
        block: BlockId,
        request: RequestId | None,
        from_state: BlockState,
        to_state: BlockState,
        event: BlockEvent,
    ) -> None: ...


class RingTrace:
    """The last `capacity` transitions, oldest first."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            from statekv.errors import ConfigError

            raise ConfigError("capacity", f"must be an integer >= 1, got {capacity!r}")
        self._ring: list[tuple[float, BlockId, RequestId | None, BlockState, BlockState,
                               BlockEvent] | None] = [None] * capacity
        self._next = 0
        self.recorded = 0
        """Transitions seen since creation (those older than `capacity` are overwritten)."""

    def record(
        self,
        time: float,
        block: BlockId,
        request: RequestId | None,
        from_state: BlockState,
        to_state: BlockState,
        event: BlockEvent,
    ) -> None:
        ring = self._ring
        ring[self._next] = (time, block, request, from_state, to_state, event)
        self._next = (self._next + 1) % len(ring)
        self.recorded += 1

    def __len__(self) -> int:
        return min(self.recorded, len(self._ring))

    def records(self) -> Iterator[TransitionRecord]:
        """The kept records, oldest first."""
        ring = self._ring
        n = len(ring)
        start = self._next if self.recorded >= n else 0
        for i in range(len(self)):
            item = ring[(start + i) % n]
            assert item is not None
            time, block, request, from_state, to_state, event = item
            yield TransitionRecord(
                time=time, block=block, request=request, from_state=from_state,
                to_state=to_state, event=event,
            )
