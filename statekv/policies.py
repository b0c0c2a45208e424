"""Policies chosen once, from the config, instead of flags tested on the hot path.

* A :class:`SpillPolicy` decides whether a host-tier victim is worth writing to disk.
* A :class:`PressurePolicy` decides whether a spill is shed while the write path is busy.
* A :class:`DiskAdmission` decides whether a spill may displace unexpired retained content.
* A :class:`FetchCost` decides whether a fetch from the shared tier beats recompute.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from statekv.arith import is_live
from statekv.block import Block
from statekv.config import CacheConfig, SpillMode, is_finite_number
from statekv.errors import ConfigError


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


@attrs.frozen(kw_only=True)
class FetchCost:
    """Whether fetching blocks from the shared tier beats recomputing them (prefill).

    Fetching n blocks costs one round trip plus their bytes at the network rate;
    recomputing them costs their tokens at the prefill rate.  Rates are measured by the
    deployment (bench.remote measures the fetch rate); the core only compares.
    """

    network_bytes_per_s: float
    prefill_tokens_per_s: float
    round_trip_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        for field in ("network_bytes_per_s", "prefill_tokens_per_s"):
            value = getattr(self, field)
            if not is_finite_number(value) or value <= 0:
                raise ConfigError(field, f"must be a finite number > 0, got {value!r}")
        if not is_finite_number(self.round_trip_s) or self.round_trip_s < 0:
            raise ConfigError("round_trip_s",
                              f"must be a finite number >= 0, got {self.round_trip_s!r}")

    def fetch_beats_recompute(self, blocks: int, block_bytes: int, block_tokens: int) -> bool:
        if blocks <= 0:
            return False
        fetch_s = self.round_trip_s + blocks * block_bytes / self.network_bytes_per_s
        return fetch_s < blocks * block_tokens / self.prefill_tokens_per_s
