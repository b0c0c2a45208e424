"""Policies chosen once, from the config, instead of flags tested on the hot path.

* A :class:`SpillPolicy` decides whether a host-tier victim is worth writing to disk.
* A :class:`PressurePolicy` decides whether a spill is shed while the write path is busy.
* A :class:`DiskAdmission` decides whether a spill may displace unexpired retained content.

Whether a fetch from the shared tier beats recompute is a running estimate, not a policy:
``statekv.cost``, with the disk's.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from statekv.arith import is_live
from statekv.block import Block
from statekv.config import CacheConfig, SpillMode


class SpillPolicy(Protocol):
    """Whether a host victim holding reusable content is written to disk."""

    def admits(self, block: Block, now: float) -> bool: ...


@attrs.frozen
class SpillAll:
    """Every victim with reusable content."""

    def admits(self, block: Block, now: float) -> bool:
        return True


@attrs.frozen
class SpillRetainedOnly:
    """Only content whose request asked for a TTL that is still running."""

    def admits(self, block: Block, now: float) -> bool:
        return is_live(block.expiry, now)


@attrs.frozen
class SpillReused:
    """Only content reused at least `min_reuse` times (the counter survives tier moves)."""

    min_reuse: int

    def admits(self, block: Block, now: float) -> bool:
        return block.reuse_count >= self.min_reuse


class PressurePolicy(Protocol):
    """Whether a spill is shed because `in_flight` writes are already queued."""

    def sheds(self, retained: bool, in_flight: int) -> bool: ...


@attrs.frozen
class QueueOnPressure:
    """Never shed: a full write queue applies backpressure to spills (in the actors)."""

    def sheds(self, retained: bool, in_flight: int) -> bool:
        return False


@attrs.frozen
class ShedBestEffortOnPressure:
    """Shed best-effort spills at the gate when the queue is full; never a retained one."""

    depth: int

    def sheds(self, retained: bool, in_flight: int) -> bool:
        return not retained and in_flight >= self.depth


class DiskAdmission(Protocol):
    """Whether a new spill may displace retained content that has not expired."""

    def may_displace_live(self) -> bool: ...


@attrs.frozen
class DisplaceInExpiryOrder:
    """A full disk displaces retained content, earliest deadline first."""

    def may_displace_live(self) -> bool:
        return True


@attrs.frozen
class ProtectUnexpired:
    """A full disk of live TTLs refuses new spills (counted) instead of displacing them."""

    def may_displace_live(self) -> bool:
        return False


@attrs.frozen(kw_only=True)
class Policies:
    spill: SpillPolicy
    pressure: PressurePolicy
    admission: DiskAdmission

    @classmethod
    def from_config(cls, config: CacheConfig) -> Policies:
        spill: SpillPolicy
        if config.spill_mode is SpillMode.ALL:
            spill = SpillAll()
        elif config.spill_mode is SpillMode.RETAINED_ONLY:
            spill = SpillRetainedOnly()
        else:
            spill = SpillReused(config.spill_min_reuse)
        pressure: PressurePolicy = (
            ShedBestEffortOnPressure(config.write_queue_depth)
            if config.drop_on_pressure
            else QueueOnPressure()
        )
        admission: DiskAdmission = (
            ProtectUnexpired() if config.protect_unexpired else DisplaceInExpiryOrder()
        )
        return cls(spill=spill, pressure=pressure, admission=admission)
