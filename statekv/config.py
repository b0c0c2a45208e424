"""The one frozen configuration of the core, validated when it is built.

Every invalid value raises :class:`~statekv.errors.ConfigError` naming the field, at
construction: a config that exists is a config that is valid.  Environment variables and
command-line flags are read once, at the entry points, into this record -- never deep in the
code.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Final, TypeGuard

import attrs

from statekv.errors import ConfigError, UsageError


class SpillMode(enum.Enum):
    """Which host-tier victims are written to disk instead of dropped."""

    ALL = "all"
    """Every victim that holds reusable content."""
    RETAINED_ONLY = "retained_only"
    """Only blocks whose request asked for a TTL that has not expired."""
    REUSED = "reused"
    """Only blocks reused at least `spill_min_reuse` times."""


DTYPE_BYTES: Final[dict[str, int]] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}
"""Bytes per element of the KV dtypes a layout may name."""

MAX_BLOCK_SIZE: Final = 4096
MAX_PRIORITY_LEVELS: Final = 64
DEFAULT_MAX_TTL_SECONDS: Final = 30 * 24 * 3600.0


def is_finite_number(value: object) -> TypeGuard[int | float]:
    """Whether `value` is an int or a float (never a bool) with a finite float value.

    An int too large for a float is not: ``math.isfinite`` raises OverflowError on it, and
    any arithmetic with the clock would too.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_now(now: object, last: float) -> float:
    """The caller's clock as a float; UsageError("now") when it is not a finite number or
    went backwards (the core never reads a clock of its own)."""
    # Every call of the API checks its clock: a finite float that did not go back (x - x is
    # 0.0 exactly when x is finite) is the common case, and answered first.
    if type(now) is float and now - now == 0.0 and now >= last:
        return now
    if not is_finite_number(now):
        raise UsageError("now", f"must be a finite number of seconds, got {now!r}")
    if now < last:
        raise UsageError("now", f"clock went backwards: {now!r} < {last!r}")
    return float(now)


def check_ttl_seconds(ttl: object, max_ttl_seconds: float) -> float | None:
    """A request's ``ttl_seconds``: None (and 0) for best-effort content, else seconds in
    (0, max_ttl_seconds]; UsageError("ttl_seconds") otherwise."""
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise UsageError("ttl_seconds", f"must be a number of seconds or None, got {ttl!r}")
    if not is_finite_number(ttl) or ttl < 0:
        raise UsageError("ttl_seconds", f"must be finite and >= 0, got {ttl!r}")
    if ttl > max_ttl_seconds:
        raise UsageError("ttl_seconds", f"{ttl!r} exceeds max_ttl_seconds={max_ttl_seconds}")
    return float(ttl) if ttl > 0 else None


def is_utf8_encodable(value: str) -> bool:
    """Whether `value` has a UTF-8 encoding (lone surrogates have none): keys hash it."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _int_in(field: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"must be an integer, got {value!r}")
    if value < low:
        raise ConfigError(field, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ConfigError(field, f"must be <= {high}, got {value}")
    return value


def _check_int(low: int, high: int | None = None) -> Any:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        _int_in(attribute.name, value, low, high)

    return check


def _check_bool(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, f"must be True or False, got {value!r}")


PUBLISH_ON: Final = ("eviction", "release")
"""When content is offered to the shared tier (CacheConfig.publish_on)."""


def _check_publish_on(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in PUBLISH_ON:
        raise ConfigError("publish_on", f"must be one of {', '.join(PUBLISH_ON)}, got "
                                        f"{value!r}")


def _to_spill_mode(value: object) -> SpillMode:
    if isinstance(value, SpillMode):
        return value
    try:
        return SpillMode(value)
    except ValueError:
        known = ", ".join(m.value for m in SpillMode)
        raise ConfigError("spill_mode", f"unknown spill mode {value!r} (known: {known})") from None


@attrs.frozen(kw_only=True)
class KVLayout:
    """The shape of one block's KV bytes: layers x {K, V} x tokens x kv-heads x head-dim."""

    num_layers: int = attrs.field(validator=_check_int(1, 4096))
    num_kv_heads: int = attrs.field(validator=_check_int(1, 4096))
    head_dim: int = attrs.field(validator=_check_int(1, 4096))
    dtype: str = attrs.field(default="bfloat16")

    @dtype.validator
    def _check_dtype(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if value not in DTYPE_BYTES:
            raise ConfigError("dtype", f"unknown dtype {value!r} (known: {sorted(DTYPE_BYTES)})")

    def block_bytes(self, block_size: int) -> int:
        """Bytes of KV one block of `block_size` tokens holds."""
        return (
            self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim
            * DTYPE_BYTES[self.dtype]
        )


@attrs.frozen(kw_only=True)
class CacheConfig:
    """Sizes and policies of one cache (one rank's shard)."""

    block_size: int = attrs.field(validator=_check_int(1, MAX_BLOCK_SIZE))
    """Tokens per block."""
    gpu_blocks: int = attrs.field(validator=_check_int(1))
    """Pages in the GPU pool."""
    host_blocks: int = attrs.field(default=0, validator=_check_int(0))
    """Pages in the pinned host pool available to GPU evictions."""
    reserved_host_blocks: int = attrs.field(default=0, validator=_check_int(0))
    """Extra host pages handed out while a spilling victim drains (one out, one in)."""
    disk_blocks: int = attrs.field(default=0, validator=_check_int(0))
    """Disk slots (0 disables the disk tier)."""
    layout: KVLayout = attrs.field(
        factory=lambda: KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")
    )
    spill_mode: SpillMode = attrs.field(default=SpillMode.ALL, converter=_to_spill_mode)
    spill_min_reuse: int = attrs.field(default=1, validator=_check_int(1))
    """With SpillMode.REUSED: spill only blocks reused at least this many times."""
    protect_unexpired: bool = attrs.field(default=False, validator=_check_bool)
    """A disk full of live TTLs refuses new spills instead of displacing them."""
    drop_on_pressure: bool = attrs.field(default=False, validator=_check_bool)
    """Shed best-effort spills while `write_queue_depth` writes are in flight."""
    write_queue_depth: int = attrs.field(default=64, validator=_check_int(1))
    """In-flight spills at which the write path counts as under pressure."""
    max_batch_blocks: int = attrs.field(default=16, validator=_check_int(1, 1024))
    """Blocks per disk batch (WriteSlots / ReadSlots): more means fewer calls per byte,
    fewer means more batches for the writer and reader threads to share."""
    priority_levels: int = attrs.field(default=4, validator=_check_int(1, MAX_PRIORITY_LEVELS))
    """Request priorities are 0 .. priority_levels-1; higher priority is evicted later."""
    max_ttl_seconds: float = attrs.field(default=DEFAULT_MAX_TTL_SECONDS)
    """The largest ttl_seconds a request may ask for."""
    model_fingerprint: str = attrs.field(default="")
    """Names the weights the KV was computed with; part of every block key."""
    reclaim_prefetched_first: bool = attrs.field(default=True, validator=_check_bool)
    """A GPU victim that needs a host page takes a prefetched block's page before evicting
    host content (True: a prefetch never costs cached content anything); False: only when
    evicting host victims yields no page now (prefetches then survive a full host tier that
    is still spilling, at the price of cached host content going to disk sooner)."""
    cost_aware_onboarding: bool = attrs.field(default=True, validator=_check_bool)
    """Recompute a run of disk hits instead of reading it back when the reported disk read
    rate and prefill rate say recomputing is faster (statekv.cost); until both have been
    reported, disk hits are always read."""
    retention_write_through: bool = attrs.field(default=False, validator=_check_bool)
    """Write content stamped with a TTL to disk when its request is released, keeping it
    where it is (a GPU block is copied through a host page; a host block keeps its page):
    the disk copy is inclusive, so a later eviction writes nothing, and a crash loses only
    the writes in flight.  As far as slots, host pages and ``write_queue_depth`` allow at
    that moment; what cannot be written then is counted in ``write_throughs_skipped`` and
    written as earlier writes complete (``write_throughs_retried``), else spilled on
    eviction as before, or at a clean close."""
    shared_tier: bool = attrs.field(default=False, validator=_check_bool)
    """A shared tier (specs/remote_tier.md) is attached: blocks offloaded to host are offered
    for publishing (PublishBlock) when the spill mode admits them, and add_request may match
    past the local tiers against keys the remote fetcher found (``remote_keys``)."""
    publish_on: str = attrs.field(default="eviction", validator=_check_publish_on)
    """With a shared tier, when content is offered for publishing (only what the spill mode
    admits): "eviction" -- each time its GPU copy is evicted to host (the shared tier holds
    what a replica is letting go of); "release" -- as soon as the request that computed or
    matched it is released (content on GPU copied into a host page free at that moment;
    what finds none is offered at its eviction), so another replica is served a prompt this
    one has just answered; once offered, not again while it stays cached."""

    @max_ttl_seconds.validator
    def _check_max_ttl(self, _attribute: attrs.Attribute[float], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError("max_ttl_seconds", f"must be a number, got {value!r}")
        if not is_finite_number(value) or value <= 0:
            raise ConfigError("max_ttl_seconds", f"must be finite and > 0, got {value!r}")

    @model_fingerprint.validator
    def _check_fingerprint(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if not isinstance(value, str):
            raise ConfigError("model_fingerprint", f"must be a string, got {value!r}")
        if not is_utf8_encodable(value):
            raise ConfigError("model_fingerprint", f"must be encodable as UTF-8, got {value!r}")

    @layout.validator
    def _check_layout(self, _attribute: attrs.Attribute[KVLayout], value: object) -> None:
        if not isinstance(value, KVLayout):
            raise ConfigError("layout", f"must be a KVLayout, got {value!r}")

    def __attrs_post_init__(self) -> None:
        # Content reaches disk only as a victim of the host tier's own pages: reserved pages
        # alone are never filled (they are handed out only by a spill), so they do not count.
        if self.disk_blocks > 0 and self.host_blocks == 0:
            raise ConfigError(
                "disk_blocks",
                "a disk tier needs a host tier to spill from (host_blocks >= 1)",
            )
        if self.reserved_host_blocks > 0 and self.disk_blocks == 0:
            raise ConfigError(
                "reserved_host_blocks", "reserved host blocks serve spills: needs disk_blocks >= 1"
            )

    @property
    def block_bytes(self) -> int:
        """Bytes of KV in one block."""
        return self.layout.block_bytes(self.block_size)
