"""``kv_connector_extra_config`` -> StateKVConfig, every error naming the key the user set.

The layout, block size and GPU pool come from vLLM (the model, its cache config, the KV
cache the engine allocated); the tiers come from the user's extra config.  Every key is a
StateKVConfig field of the same name and meaning (README, "Embedding it"), plus
``disk_mac_key`` given as hex (JSON has no bytes).  An unknown key is an error, never
ignored: a misspelt ``dsik`` would otherwise run without the disk tier the user asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Final

from io_actors.config import StateKVConfig
from statekv.config import KVLayout
from statekv.errors import ConfigError

PREFIX: Final = "kv_connector_extra_config"

TIER_KEYS: Final = frozenset({
    "host", "reserved_host", "disk", "disk_dir", "persist", "disk_sync", "disk_mac_key",
    "backend", "writers", "readers", "write_queue_depth", "spill_mode", "spill_min_reuse",
    "protect_unexpired", "drop_on_pressure", "max_batch_blocks", "max_ttl_seconds",
    "model_fingerprint", "cost_aware_onboarding", "namespace",
})
"""The StateKVConfig fields a user sets through the extra config."""

CONNECTOR_KEYS: Final = frozenset({"write_through"})
"""Keys of the connector itself (not StateKVConfig fields)."""

DEFAULT_RESERVED_HOST: Final = 8
"""Host pages handed to spills while their victims drain, when a disk tier is set and the
user named none (a disk tier needs at least one)."""


def named(field: str) -> str:
    return f"{PREFIX}.{field}"


def connector_config(
    extra: Mapping[str, object] | None,
    *,
    layout: KVLayout,
    block_size: int,
    gpu_blocks: int,
    rank: int,
    default_fingerprint: str,
) -> StateKVConfig:
    """The StateKVConfig of one rank of the connector.

    raises: ConfigError naming ``kv_connector_extra_config.<key>`` for a key the user set
    (unknown, missing or invalid), or the vLLM setting the layout came from.
    """
    extra = {k: v for k, v in (extra or {}).items() if k not in CONNECTOR_KEYS}
    for key in extra:
        if key not in TIER_KEYS:
            known = ", ".join(sorted(TIER_KEYS | CONNECTOR_KEYS))
            raise ConfigError(named(str(key)), f"unknown key (known: {known})")
    if "host" not in extra:
        raise ConfigError(named("host"), "required: the pinned host tier's size, in blocks or "
                          "bytes (e.g. \"4 GiB\"); every saved block is copied there first")
    fields: dict[str, object] = dict(extra)
    mac = fields.get("disk_mac_key")
    if mac is not None:
        if not isinstance(mac, str):
            raise ConfigError(named("disk_mac_key"), "must be a hex string of 16-64 bytes")
        try:
            fields["disk_mac_key"] = bytes.fromhex(mac)
        except ValueError:
            raise ConfigError(named("disk_mac_key"),
                              "must be a hex string of 16-64 bytes") from None
    if isinstance(fields.get("disk_dir"), str):
        fields["disk_dir"] = Path(str(fields["disk_dir"]))
    has_disk = fields.get("disk", 0) not in (0, "0", None)
    if has_disk and "reserved_host" not in fields:
        fields["reserved_host"] = DEFAULT_RESERVED_HOST
    fields.setdefault("model_fingerprint", default_fingerprint)
    try:
        config = StateKVConfig(layout=layout, block_size=block_size, gpu=gpu_blocks,
                               rank=rank, device="cpu", **fields)  # type: ignore[arg-type]
        config.core_config()
    except ConfigError as exc:
        if exc.field in TIER_KEYS:
            raise exc.renamed(named(exc.field)) from None
        raise  # the layout, block size or pool vLLM gave
    except TypeError as exc:  # a value attrs could not even pass to a validator
        raise ConfigError(PREFIX, str(exc)) from None
    return config


def write_through_policy(extra: Mapping[str, object] | None) -> str:
    """``write_through``: which saved blocks are written to disk at once (statekv.engine_tiers):
    "all" (the default: everything a restart should find), "retained" (only blocks saved
    with a TTL) or "none" (a block reaches disk when the host tier evicts it)."""
    from statekv.engine_tiers import WRITE_THROUGH

    value = (extra or {}).get("write_through", "all")
    if value not in WRITE_THROUGH:
        raise ConfigError(named("write_through"),
                          f"must be one of {', '.join(WRITE_THROUGH)}, got {value!r}")
    return str(value)
