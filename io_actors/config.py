"""The user-facing configuration: the core's sizes and policies plus the I/O side.

Sizes may be given in blocks (an int) or in bytes (a string with a unit: ``"8 GiB"``,
``"512MB"``, ``"1.5 TiB"``); bytes are converted to whole blocks of this layout's block size,
rounding down.  Every invalid value raises :class:`statekv.errors.ConfigError` naming the
field.  Environment variables and command-line flags are read by the entry points (the CLI)
into this record, never deeper.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Final

import attrs

from io_actors.memory.page_copies import COMPUTE_WAITS
from io_actors.memory.pools import COPY_KERNEL
from io_actors.storage.cluster_url import MAX_TIMEOUT_S, parse_cluster_url
from statekv.config import CacheConfig, KVLayout, SpillMode, is_utf8_encodable
from statekv.errors import ConfigError

_UNITS: Final[dict[str, int]] = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*$")

BACKENDS: Final = ("posix", "kvikio")
DEVICES: Final = ("auto", "cpu", "cuda")
DISK_SYNC: Final = ("none", "data")
"""Durability policies of spilled slots (specs/disk_persistence.md)."""


def _to_disk_dir(value: object) -> Path | None:
    # Path("") is Path("."): an empty string would quietly put slot files in the working
    # directory.
    if value is None:
        return None
    if isinstance(value, Path):
        text = str(value) if str(value) != "." or value.parts else ""
    elif isinstance(value, str):
        text = value
    else:
        raise ConfigError("disk_dir", f"must be a path, got {value!r}")
    if not text.strip():
        raise ConfigError("disk_dir", "must be a directory path, got an empty string")
    if "\x00" in text:
        raise ConfigError("disk_dir", f"must not contain a NUL character, got {text!r}")
    return Path(text)


def size_in_bytes(field: str, text: str, *, hint: str = "e.g. '512 MiB', '8 GiB'") -> int:
    """The bytes a size string names: a number (a fraction allowed) and a unit, binary (KiB,
    MiB, GiB, TiB) or decimal (KB, MB, GB, TB), or B; rounded down to whole bytes.  A bare
    number has no unit and is refused: it could as well mean blocks."""
    match = _SIZE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(field, f"cannot read size {text!r} ({hint})")
    number = float(match.group(1))
    if not math.isfinite(number):
        raise ConfigError(field, f"size {text!r} is not finite")
    return int(number * _UNITS[match.group(2).lower()])


def blocks_from_size(field: str, value: object, block_bytes: int) -> int:
    """Whole blocks in `value`: an int counts blocks, a string with a unit counts bytes."""
    if isinstance(value, bool):
        raise ConfigError(field, f"must be a block count or a size like '8 GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(field, f"must be >= 0 blocks, got {value}")
        return value
    if isinstance(value, str):
        return size_in_bytes(field, value, hint="use blocks, or e.g. '512 MiB', '8 GiB'"
                             ) // block_bytes
    raise ConfigError(field, f"must be a block count or a size like '8 GiB', got {value!r}")


CORE_SIZE_FIELDS: Final = {
    "gpu_blocks": "gpu", "host_blocks": "host", "reserved_host_blocks": "reserved_host",
    "disk_blocks": "disk",
}
"""The core's size fields (blocks) -> the StateKVConfig fields the user set (blocks or bytes)."""


def public_size_error(exc: ConfigError) -> ConfigError:
    """`exc` naming StateKVConfig's size fields instead of the core's, in its field and in its
    message (same class)."""
    field = CORE_SIZE_FIELDS.get(exc.field, exc.field)
    message = re.sub(r"\b(" + "|".join(CORE_SIZE_FIELDS) + r")\b",
                     lambda m: CORE_SIZE_FIELDS[m.group(1)], exc.message)
    if field == exc.field and message == exc.message:
        return exc
    return type(exc)(field, message)


def _nonzero_size(value: object) -> bool:
    """Whether `value` is a size string naming more than zero bytes."""
    match = _SIZE.match(value) if isinstance(value, str) else None
    return match is not None and float(match.group(1)) > 0


def _size_field(default: int | str = 0) -> Any:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(attribute.name, f"must be blocks or a size string, got {value!r}")

    return attrs.field(default=default, validator=check)


def _positive_int(low: int, high: int) -> Any:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(
                attribute.name, f"must be an integer in [{low}, {high}], got {value!r}"
            )

    return check


def check_device_name(value: object) -> None:
    """raises: ConfigError("device") unless `value` names a device the cache can run on
    ("auto", "cpu", "cuda" or "cuda:N"); whether this machine has it is checked at open."""
    if value not in DEVICES and not (
        isinstance(value, str) and re.fullmatch(r"cuda:[0-9]{1,3}", value)
    ):
        raise ConfigError("device", f"unknown device {value!r} (known: {DEVICES}, or cuda:N)")


@attrs.frozen(kw_only=True)
class StateKVConfig:
    """Everything needed to open a cache on one rank."""

    layout: KVLayout = attrs.field()
    block_size: int = 16
    gpu: int | str = _size_field()
    """GPU pool: blocks or bytes."""
    host: int | str = _size_field(0)
    """Pinned host pool: blocks or bytes."""
    reserved_host: int | str = _size_field(0)
    """Extra host pages handed to spills while their victims drain."""
    disk: int | str = _size_field(0)
    """Disk tier: blocks (slots) or bytes; 0 disables it."""
    disk_dir: Path | None = attrs.field(default=None, converter=_to_disk_dir)
    """Where slot files live; each rank and namespace gets its own subdirectory."""
    persist: bool = attrs.field(default=True)
    """Keep spilled blocks across restarts: a cache opened on a directory with slots from an
    earlier process serves them (index rebuild).  False wipes the directory's slots at open."""
    disk_sync: str = attrs.field(default="none")
    """"none": a landed spill survives a crash of the process (kill -9), and a power loss
    may lose recent spills, detected and never served; "data": every spill is fdatasync'ed
    before it counts as landed, so it survives power loss too."""
    disk_mac_key: bytes | None = attrs.field(default=None, repr=False)
    """A 16-64 byte key: every slot is signed with keyed BLAKE2b, and a slot whose MAC fails
    is never served.  For a disk that other users can write.  Never stored on disk."""
    backend: str = attrs.field(default="posix")
    device: str = attrs.field(default="auto")
    compute_waits: str = attrs.field(default="all")
    """What a forward pass waits for on the cache's copy stream (CUDA only): "all" (the
    default) -- every GPU <-> host copy enqueued before it; "pages" -- only the copies of the
    pages its batch reads or writes, so a step never waits for a spill or onboard of other
    requests' pages.  "pages" asks every forward pass, and any other GPU work that touches
    the KV pool, to announce its pages first with ``BlockingCache.order_forward_after_copies``
    (the serving loop does); work that does not could read a page before its copy landed."""
    copy_kernel: str = attrs.field(default="auto")
    """How GPU <-> host page copies run (CUDA with cupy): "auto" (the default) -- a call of
    small pages as kernels (a call's runs under 384 KiB on average: its copies in both
    directions as two kernels; a batch of one direction under 1 MiB: one kernel), and
    larger ones as one DMA per run of consecutive pages; "on" -- always kernels; "off" --
    always DMAs.  "on" where the kernels cannot run (no CUDA, no cupy, no pinned host pool)
    is a ConfigError."""
    writers: int = attrs.field(default=2, validator=_positive_int(1, 256))
    readers: int = attrs.field(default=2, validator=_positive_int(1, 256))
    write_queue_depth: int = attrs.field(default=64, validator=_positive_int(1, 1 << 20))
    spill_mode: SpillMode | str = SpillMode.ALL
    spill_min_reuse: int = 1
    protect_unexpired: bool = False
    drop_on_pressure: bool = False
    priority_levels: int = 4
    max_batch_blocks: int = 16
    """Blocks per disk batch: one vector I/O and one report per batch (CacheConfig)."""
    max_ttl_seconds: float = 30 * 24 * 3600.0
    model_fingerprint: str = ""
    cost_aware_onboarding: bool = True
    """Recompute a run of disk hits instead of reading it when the measured disk read rate
    and the reported prefill rate say that is faster (statekv.cost)."""
    reclaim_prefetched_first: bool = True
    """GPU victims take prefetched pages before evicting host content (CacheConfig)."""
    retention_write_through: bool = True
    """Write content released with a TTL to disk at its release, keeping it on GPU or host
    (CacheConfig.retention_write_through): retained content survives a crash once its write
    lands, not only once it is evicted.  False: it reaches disk when evicted, or at a clean
    close."""
    rank: int = attrs.field(default=0, validator=_positive_int(0, 1 << 16))
    namespace: str = attrs.field(default="target")
    """Separates caches that must never share slot files (a draft model's from the target's)."""
    remote_url: str | None = attrs.field(default=None)
    """The shared tier (specs/remote_tier.md): a Redis Cluster's startup nodes,
    ``redis://[user@]host:port[,...]`` (``rediss://`` for TLS); None (the default) for no
    shared tier.  Every replica pointed at one cluster shares blocks (same model fingerprint,
    layout, block size, salt and LoRA).  Read by redis-py's URL parser; a password does not
    go in the URL (``remote_password``)."""
    remote_secret: bytes | None = attrs.field(default=None, repr=False)
    """16-64 secret bytes, the same on every replica, required with a shared tier: every
    value published is signed with a key derived from it and ``remote_namespace`` (keyed
    BLAKE2b), and a value without a valid MAC -- forged by anyone who can reach the cluster,
    or of another deployment -- is never served.  Never stored or logged."""
    remote_password: str | None = attrs.field(default=None, repr=False)
    """The cluster's AUTH password (the ACL user's, with ``user@`` in the URL).  Read from a
    file or the environment at the entry point; never logged."""
    remote_tls_ca_file: Path | None = attrs.field(default=None)
    """CA certificates to check the cluster's TLS certificates with (``rediss://``); None:
    the system's."""
    remote_namespace: str = attrs.field(default="statekv")
    """Prefix of every key in the cluster: deployments sharing a cluster keep theirs apart."""
    remote_timeout_s: float = attrs.field(default=1.0)
    """Bound on every network wait of the shared tier (a dead master costs at most two)."""
    publish_on: str = attrs.field(default="release")
    """When the shared tier is offered content (CacheConfig.publish_on): "release" (the
    default) -- as soon as its request is released, so another replica is served a prompt
    this one has just answered; "eviction" -- only when its GPU copy is evicted to host."""
    remote_queue_depth: int | None = attrs.field(default=None)
    """Publishes waiting before best-effort ones are shed (with drop_on_pressure); twice this
    refuses every publish.  None: write_queue_depth.  What is published is the spill mode's
    choice."""

    @remote_url.validator
    def _check_remote_url(self, _attribute: attrs.Attribute[str | None], value: object) -> None:
        if value is not None:
            parse_cluster_url(value, field="remote_url")

    @remote_secret.validator
    def _check_remote_secret(self, _attribute: attrs.Attribute[bytes | None],
                             value: object) -> None:
        if value is not None and (not isinstance(value, bytes) or not 16 <= len(value) <= 64):
            raise ConfigError(
                "remote_secret", "must be None or a secret of 16-64 bytes (bytes, not text)"
            )

    @remote_password.validator
    def _check_remote_password(self, _attribute: attrs.Attribute[str | None],
                               value: object) -> None:
        if value is not None and (not isinstance(value, str) or not value
                                  or not is_utf8_encodable(value)):
            raise ConfigError("remote_password", "must be None or a non-empty text password")

    @remote_tls_ca_file.validator
    def _check_remote_tls_ca_file(self, _attribute: attrs.Attribute[Path | None],
                                  value: object) -> None:
        if value is not None and not isinstance(value, Path):
            raise ConfigError("remote_tls_ca_file", f"must be a pathlib.Path or None, got "
                              f"{value!r}")

    @remote_namespace.validator
    def _check_remote_namespace(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if (not isinstance(value, str) or not value or len(value) > 64
                or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in value)):
            raise ConfigError("remote_namespace", "must be 1-64 ASCII letters, digits, '-', "
                              f"'_' or '.', got {value!r}")

    @remote_timeout_s.validator
    def _check_remote_timeout(self, _attribute: attrs.Attribute[float], value: object) -> None:
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S):
            raise ConfigError("remote_timeout_s",
                              f"must be seconds in (0, {MAX_TIMEOUT_S}], got {value!r}")

    @remote_queue_depth.validator
    def _check_remote_queue_depth(self, _attribute: attrs.Attribute[int | None],
                                  value: object) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= 1 << 20):
            raise ConfigError("remote_queue_depth",
                              f"must be None or an integer in [1, {1 << 20}], got {value!r}")

    @persist.validator
    def _check_persist(self, _attribute: attrs.Attribute[bool], value: object) -> None:
        if not isinstance(value, bool):
            raise ConfigError("persist", f"must be True or False, got {value!r}")

    @disk_sync.validator
    def _check_disk_sync(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if value not in DISK_SYNC:
            raise ConfigError("disk_sync", f"unknown policy {value!r} (known: {DISK_SYNC})")

    @compute_waits.validator
    def _check_compute_waits(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if value not in COMPUTE_WAITS:
            raise ConfigError("compute_waits", f"must be one of {COMPUTE_WAITS}, got "
                              f"{value!r}")

    @copy_kernel.validator
    def _check_copy_kernel(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if value not in COPY_KERNEL:
            raise ConfigError("copy_kernel", f"must be one of {COPY_KERNEL}, got {value!r}")

    @disk_mac_key.validator
    def _check_mac_key(self, _attribute: attrs.Attribute[bytes | None], value: object) -> None:
        if value is not None and (not isinstance(value, bytes) or not 16 <= len(value) <= 64):
            raise ConfigError(
                "disk_mac_key", "must be None or a key of 16-64 bytes (bytes, not text)"
            )

    @backend.validator
    def _check_backend(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if value not in BACKENDS:
            raise ConfigError("backend", f"unknown backend {value!r} (known: {BACKENDS})")

    @device.validator
    def _check_device(self, _attribute: attrs.Attribute[str], value: object) -> None:
        check_device_name(value)

    @namespace.validator
    def _check_namespace(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value):
            raise ConfigError("namespace", f"must be 1-64 of [A-Za-z0-9_-], got {value!r}")

    @layout.validator
    def _check_layout(self, _attribute: attrs.Attribute[KVLayout], value: object) -> None:
        if not isinstance(value, KVLayout):
            raise ConfigError("layout", f"must be a statekv.KVLayout, got {value!r}")

    def __attrs_post_init__(self) -> None:
        # Building the core config validates every core field and the sizes.
        if _nonzero_size(self.disk) and not blocks_from_size("disk", self.disk, self.block_bytes):
            # A disk asked for but too small for one block is a mistake, not "no disk tier".
            raise ConfigError(
                "disk", f"{self.disk!r} holds no slot of one {self.block_bytes}-byte "
                "block: give at least one block, or 0 for no disk tier"
            )
        core = self.core_config()
        if core.disk_blocks and self.disk_dir is None:
            raise ConfigError("disk_dir", "a disk tier needs a directory")
        # Content is keyed by the fingerprint: an empty one would let a process serving other
        # weights be served this one's KV, from the same disk_dir after a restart or from the
        # shared tier at once.  Neither can be detected from the bytes, so it is refused here.
        if not self.model_fingerprint:
            if core.disk_blocks and self.persist:
                raise ConfigError(
                    "model_fingerprint", "persist=True reuses disk content across processes: "
                    "name the weights (model name and revision, or a hash of the checkpoint), "
                    "or set persist=False"
                )
            if self.remote_url is not None:
                raise ConfigError(
                    "model_fingerprint", "a shared tier (remote_url) serves content across "
                    "replicas: name the weights (model name and revision, or a hash of the "
                    "checkpoint)"
                )
        if self.remote_url is not None and self.remote_secret is None:
            # Anyone who can reach the cluster could otherwise replace cached KV, and a
            # value's checksums are no defence: they can be recomputed.
            raise ConfigError(
                "remote_secret", "a shared tier must be authenticated: give 16-64 secret "
                "bytes, the same on every replica (statekv serve: --remote-secret-file or "
                "STATEKV_REMOTE_SECRET)"
            )
        if self.remote_tls_ca_file is not None and self.remote_url is None:
            raise ConfigError("remote_tls_ca_file", "is for a shared tier (remote_url)")

    @property
    def block_bytes(self) -> int:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or not (
            1 <= self.block_size <= 4096
        ):
            raise ConfigError("block_size", f"must be an integer in [1, 4096], got "
                                            f"{self.block_size!r}")
        return self.layout.block_bytes(self.block_size)

    def core_config(self) -> CacheConfig:
        """The pure core's config, sizes converted to blocks.  Its errors name the field of
        this config that the user set (`disk`, not the core's `disk_blocks`)."""
        try:
            return self._core_config()
        except ConfigError as exc:
            raise public_size_error(exc) from None

    def _core_config(self) -> CacheConfig:
        bb = self.block_bytes
        gpu = blocks_from_size("gpu", self.gpu, bb)
        if gpu < 1:
            raise ConfigError("gpu", f"{self.gpu!r} holds no block of {bb} bytes")
        return CacheConfig(
            block_size=self.block_size,
            gpu_blocks=gpu,
            host_blocks=blocks_from_size("host", self.host, bb),
            reserved_host_blocks=blocks_from_size("reserved_host", self.reserved_host, bb),
            disk_blocks=blocks_from_size("disk", self.disk, bb),
            layout=self.layout,
            spill_mode=self.spill_mode,
            spill_min_reuse=self.spill_min_reuse,
            protect_unexpired=self.protect_unexpired,
            drop_on_pressure=self.drop_on_pressure,
            retention_write_through=self.retention_write_through,
            write_queue_depth=self.write_queue_depth,
            priority_levels=self.priority_levels,
            max_batch_blocks=self.max_batch_blocks,
            max_ttl_seconds=self.max_ttl_seconds,
            model_fingerprint=self.model_fingerprint,
            cost_aware_onboarding=self.cost_aware_onboarding,
            reclaim_prefetched_first=self.reclaim_prefetched_first,
            shared_tier=self.remote_url is not None,
            publish_on=self.publish_on,
        )

    def rank_directory(self) -> Path | None:
        """This rank's own slot directory: <disk_dir>/<namespace>/rank_<rank>."""
        if self.disk_dir is None:
            return None
        return self.disk_dir / self.namespace / f"rank_{self.rank}"
