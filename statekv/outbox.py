"""The outbox: the commands the core decided, waiting for the actors, and the transfer ids.

Owns the ordered list of single commands (copies, FreeSlots, publishes, retention updates)
and the disk and shared-tier transfers waiting to be packed into batches, plus the counter
that names every transfer.  It is separate because the order in which commands leave is a
contract of its own (:mod:`statekv.messages`): whoever decides a command only appends it
here, and :meth:`Outbox.take` alone decides how they are packed.
"""

from __future__ import annotations

from typing import cast

from statekv.ids import TransferId
from statekv.messages import (
    Command,
    FetchBlock,
    FetchBlocks,
    LoadSlot,
    LoadSlots,
    PrefetchSlot,
    PrefetchSlots,
    ReadSlot,
    ReadSlots,
    WriteSlot,
    WriteSlots,
)


class Outbox:
    """Commands in the order they were decided, and transfers waiting to be batched."""

    __slots__ = ("commands", "fetches", "last_transfer", "loads", "prefetches", "reads",
                 "writes")

    def __init__(self) -> None:
        self.commands: list[Command] = []
        # Disk and shared-tier transfers wait here until take() packs them into batches.
        self.writes: list[WriteSlot] = []
        self.reads: list[ReadSlot] = []
        self.prefetches: list[PrefetchSlot] = []
        self.fetches: list[FetchBlock] = []
        self.loads: list[LoadSlot] = []
        self.last_transfer = 0

    def new_transfer(self) -> TransferId:
        self.last_transfer += 1
        return TransferId(self.last_transfer)

    def new_transfers(self, count: int) -> list[TransferId]:
        """`count` new_transfer calls' ids, in order, for a run of transfers."""
        first = self.last_transfer + 1
        self.last_transfer += count
        return cast("list[TransferId]", list(range(first, first + count)))  # NewType: ints

    def take(self, max_batch_blocks: int) -> list[Command]:
        """Everything the actors must do, in order; the outbox is empty afterwards.

        Copies and FreeSlots come first, in the order they were decided; then the spills and
        the reads, packed into batches of at most `max_batch_blocks` (see
        :mod:`statekv.messages` for why that order keeps the ordering contract).
        """
        out = self.commands
        self.commands = []
        size = max_batch_blocks
        writes = self.writes
        if writes:
            self.writes = []
            out.extend(
                WriteSlots(writes=tuple(writes[i : i + size]))
                for i in range(0, len(writes), size)
            )
        reads = self.reads
        if reads:
            self.reads = []
            out.extend(
                ReadSlots(reads=tuple(reads[i : i + size])) for i in range(0, len(reads), size)
            )
        prefetches = self.prefetches
        if prefetches:
            self.prefetches = []
            out.extend(
                PrefetchSlots(reads=tuple(prefetches[i : i + size]))
                for i in range(0, len(prefetches), size)
            )
        fetches = self.fetches
        if fetches:
            self.fetches = []
            out.extend(
                FetchBlocks(reads=tuple(fetches[i : i + size]))
                for i in range(0, len(fetches), size)
            )
        loads = self.loads
        if loads:
            self.loads = []
            out.extend(_load_batches(loads, size))
        return out


def _load_batches(loads: list[LoadSlot], size: int) -> list[LoadSlots]:
    """Loads packed in order into batches of at most `size`, each naming a slot once: two
    requests may load one block in one step, and a vectored read names each slot once."""
    batches: list[LoadSlots] = []
    batch: list[LoadSlot] = []
    slots: set[int] = set()
    for load in loads:
        if len(batch) == size or load.slot in slots:
            batches.append(LoadSlots(reads=tuple(batch)))
            batch, slots = [], set()
        batch.append(load)
        slots.add(load.slot)
    batches.append(LoadSlots(reads=tuple(batch)))
    return batches
