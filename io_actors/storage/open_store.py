"""Slot-store backends: POSIX files (any machine) and kvikio (CUDA machines).

:func:`open_slot_store` picks one by name.  Both share the data file layout and the slot
format, so a directory written by one is readable by the other.
"""

from __future__ import annotations

import os
from typing import Final

import torch

from io_actors.storage.interfaces import SlotStore
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import rank_dir
from statekv.config import CacheConfig
from statekv.errors import ConfigError

__all__ = ["BACKENDS", "PosixSlotStore", "open_slot_store", "public_config_error", "rank_dir"]

BACKENDS: Final = ("posix", "kvikio")


def open_slot_store(
    kind: str,
    directory: str | os.PathLike[str],
    config: CacheConfig,
    *,
    persist: bool = True,
    sync_writes: bool = False,
    mac_key: bytes | None = None,
    owned_from: str | os.PathLike[str] | None = None,
) -> SlotStore:
    """Open the slot store `kind` ("posix" or "kvikio") on `directory`.

    raises: ConfigError("kind") for an unknown kind, or for "kvikio" where CUDA or kvikio is
    missing; ConfigError("directory") / ("disk_blocks") / ("mac_key") from the store itself.
    These name the store's parameters: :func:`public_config_error` renames them to the
    fields of StateKVConfig.
    """
    if kind == "posix":
        return PosixSlotStore(directory, config, persist=persist, sync_writes=sync_writes,
                              mac_key=mac_key, owned_from=owned_from)
    if kind == "kvikio":
        if not torch.cuda.is_available():
            raise ConfigError(
                "kind", "the kvikio backend needs CUDA, and CUDA is not available here; "
                "use backend='posix'"
            )
        from io_actors.storage.kvikio_store import KvikioSlotStore

        return KvikioSlotStore(directory, config, persist=persist, sync_writes=sync_writes,
                               mac_key=mac_key, owned_from=owned_from)
    raise ConfigError("kind", f"unknown slot store {kind!r} (known: {', '.join(BACKENDS)})")


PUBLIC_FIELDS: Final = {
    "directory": "disk_dir",
    "disk_blocks": "disk",
    "kind": "backend",
    "mac_key": "disk_mac_key",
    "sync_writes": "disk_sync",
}
"""A store's parameter name -> the StateKVConfig field the user set."""


def public_config_error(exc: ConfigError) -> ConfigError:
    """`exc` naming the public field (same class, same message)."""
    public = PUBLIC_FIELDS.get(exc.field)
    return exc if public is None else exc.renamed(public)
