"""Slot-store backends: POSIX files (any machine) and kvikio (CUDA machines).

:func:`open_slot_store` picks one by name.  Both share the data file layout and the slot
format, so a directory written by one is readable by the other.
"""

from __future__ import annotations

import os
from typing import Final

import torch

from io_actors.backends.posix import PosixSlotStore, rank_dir
from io_actors.interfaces import SlotStore
from statekv.config import CacheConfig
from statekv.errors import ConfigError

__all__ = ["BACKENDS", "PosixSlotStore", "open_slot_store", "rank_dir"]

BACKENDS: Final = ("posix", "kvikio")


def open_slot_store(
    kind: str, directory: str | os.PathLike[str], config: CacheConfig
) -> SlotStore:
    """Open the slot store `kind` ("posix" or "kvikio") on `directory`.

    raises: ConfigError("kind") for an unknown kind, or for "kvikio" where CUDA or kvikio is
    missing; ConfigError("directory") / ("disk_blocks") from the store itself.
    """
    if kind == "posix":
        return PosixSlotStore(directory, config)
    if kind == "kvikio":
        if not torch.cuda.is_available():
            raise ConfigError(
                "kind", "the kvikio backend needs CUDA, and CUDA is not available here; "
                "use kind='posix'"
            )
        from io_actors.backends.kvikio_store import KvikioSlotStore

        return KvikioSlotStore(directory, config)
    raise ConfigError("kind", f"unknown slot store {kind!r} (known: {', '.join(BACKENDS)})")
