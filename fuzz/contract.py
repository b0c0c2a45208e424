"""The command contract of ``statekv.messages``, checked on the stream of commands and
completions as they happen -- independently of the core's own bookkeeping.

The core's ``check_invariants`` verifies its structures against each other; this checker
verifies what the core *tells the actors to do*, which is what would hurt real bytes:

* at most one transfer per slot: a spill never claims a slot whose read (or write) is in
  flight, and two writes to one slot never race;
* a read names the content that the last landed write put in its slot, so a prefix-tree
  entry never points at recycled bytes;
* a slot is never freed while a transfer on it is in flight;
* a GPU page with a read in flight is never the source or destination of a copy, nor the
  destination of a second read: it is not on any free list until the read lands;
* a host page with a prefetch read in flight is never the source or destination of a copy,
  the source of a write, nor the destination of a second prefetch: the read may still write
  into it until it reports back;
* disk transfers come in batches (``WriteSlots`` / ``ReadSlots`` / ``PrefetchSlots``) of 1 to
  ``max_batch_blocks`` records, after every copy and FreeSlot of the same take; a batch's
  completion reports one outcome per record of that batch, in order;
* a PersistRetention names a slot that holds its key, or whose write or read in flight is of
  its key (a record for other content would be inert at replay: a core bug all the same).

Every harness feeds it the commands in the order the core emitted them and the completions in
the order the core applied them.
"""

from __future__ import annotations

from collections.abc import Iterable

from statekv.ids import BlockHash, PageId, SlotId, TransferId
from statekv.messages import (
    BatchFinished,
    BlockCommand,
    Command,
    Completion,
    CopyGpuToHost,
    CopyHostToGpu,
    FetchBlock,
    FetchBlocks,
    FreeSlot,
    LoadSlots,
    PersistRetention,
    PrefetchSlot,
    PrefetchSlots,
    PublishBlock,
    ReadSlot,
    ReadSlots,
    SlotRead,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    TransferOutcome,
    WriteSlot,
    WriteSlots,
)


class ContractViolation(AssertionError):
    """The core asked the actors for something that could corrupt or lose KV."""


class CommandContract:
    """Transfers in flight and slot contents, as the command stream describes them."""

    def __init__(self, max_batch_blocks: int | None = None) -> None:
        self.max_batch_blocks = max_batch_blocks
        """The largest batch the core may emit (None: not checked)."""
        self.batches: dict[TransferId, tuple[TransferId, ...]] = {}
        """Batches in flight: each one's transfers, in order, by the batch's name."""
        self.writes: dict[TransferId, WriteSlot] = {}
        self.reads: dict[TransferId, ReadSlot] = {}
        self.busy: dict[SlotId, TransferId] = {}
        self.slot_content: dict[SlotId, BlockHash] = {}
        """What each slot holds according to the writes that landed."""
        self.read_pages: dict[PageId, TransferId] = {}
        """GPU pages that a read in flight is filling."""
        self.prefetches: dict[TransferId, PrefetchSlot] = {}
        self.prefetch_pages: dict[PageId, TransferId] = {}
        """Host pages that a prefetch read in flight is filling."""
        self.fetches: dict[TransferId, FetchBlock] = {}
        """Shared-tier fetches in flight (their GPU pages are in `read_pages` too)."""
        self.failed_writes = 0
        self.failed_reads = 0

    def commands(self, commands: Iterable[Command]) -> None:
        seen_batch = False
        for batch in commands:
            if isinstance(batch, WriteSlots | ReadSlots | PrefetchSlots | FetchBlocks):
                items: tuple[WriteSlot | ReadSlot | PrefetchSlot | FetchBlock, ...] = (
                    batch.writes if isinstance(batch, WriteSlots) else batch.reads
                )
                limit = self.max_batch_blocks
                if not items or (limit is not None and len(items) > limit):
                    raise ContractViolation(f"a batch of {len(items)} records: {batch}")
                self.batches[batch.transfer] = tuple(item.transfer for item in items)
                seen_batch = True
                for item in items:
                    self._block_command(item)
            elif isinstance(batch, LoadSlots):
                raise ContractViolation(f"{batch}: only a core beneath an engine loads")
            elif seen_batch:
                raise ContractViolation(f"{batch} comes after a disk batch of the same take")
            else:
                self._block_command(batch)

    def _block_command(self, cmd: BlockCommand) -> None:
        if isinstance(cmd, WriteSlot):
            self._host_page_idle(cmd.host_page, cmd)
            self._claim(cmd.slot, cmd.transfer, cmd)
            self.writes[cmd.transfer] = cmd
        elif isinstance(cmd, PrefetchSlot):
            self._host_page_idle(cmd.host_page, cmd)
            self._claim(cmd.slot, cmd.transfer, cmd)
            held = self.slot_content.get(cmd.slot)
            if held != cmd.key:
                raise ContractViolation(
                    f"{cmd} prefetches a slot that holds other content ({_short(held)})"
                )
            self.prefetch_pages[cmd.host_page] = cmd.transfer
            self.prefetches[cmd.transfer] = cmd
        elif isinstance(cmd, ReadSlot):
            self._claim(cmd.slot, cmd.transfer, cmd)
            held = self.slot_content.get(cmd.slot)
            if held != cmd.key:
                raise ContractViolation(
                    f"{cmd} reads a slot that holds other content ({_short(held)})"
                )
            if cmd.gpu_page in self.read_pages:
                raise ContractViolation(
                    f"{cmd} targets GPU page {cmd.gpu_page}, which read "
                    f"{self.read_pages[cmd.gpu_page]} is still filling"
                )
            self.read_pages[cmd.gpu_page] = cmd.transfer
            self.reads[cmd.transfer] = cmd
        elif isinstance(cmd, FetchBlock):
            if cmd.gpu_page in self.read_pages:
                raise ContractViolation(
                    f"{cmd} targets GPU page {cmd.gpu_page}, which transfer "
                    f"{self.read_pages[cmd.gpu_page]} is still filling"
                )
            self.read_pages[cmd.gpu_page] = cmd.transfer
            self.fetches[cmd.transfer] = cmd
        elif isinstance(cmd, PublishBlock):
            self._host_page_idle(cmd.host_page, cmd)
        elif isinstance(cmd, PersistRetention):
            moving = self.busy.get(cmd.slot)
            transfer = (self.writes.get(moving) or self.reads.get(moving)
                        if moving is not None else None)
            holds = transfer.key if transfer is not None else self.slot_content.get(cmd.slot)
            if holds != cmd.key:
                raise ContractViolation(
                    f"{cmd} names a slot that holds other content ({_short(holds)})"
                )
        elif isinstance(cmd, FreeSlot):
            if cmd.slot in self.busy:
                raise ContractViolation(
                    f"slot {cmd.slot} freed while transfer {self.busy[cmd.slot]} is in flight"
                )
            self.slot_content.pop(cmd.slot, None)
        elif isinstance(cmd, CopyGpuToHost | CopyHostToGpu):
            if cmd.gpu_page in self.read_pages:
                raise ContractViolation(
                    f"{cmd} touches GPU page {cmd.gpu_page} while read "
                    f"{self.read_pages[cmd.gpu_page]} is filling it"
                )
            self._host_page_idle(cmd.host_page, cmd)
        else:
            raise ContractViolation(f"unknown command {cmd!r}")

    def _host_page_idle(self, page: PageId, cmd: BlockCommand) -> None:
        if page in self.prefetch_pages:
            raise ContractViolation(
                f"{cmd} touches host page {page} while prefetch "
                f"{self.prefetch_pages[page]} is filling it"
            )

    def _claim(self, slot: SlotId, transfer: TransferId, cmd: BlockCommand) -> None:
        if slot in self.busy:
            raise ContractViolation(
                f"{cmd} claims slot {slot} while transfer {self.busy[slot]} is in flight on it"
            )
        self.busy[slot] = transfer

    def completion(self, completion: Completion) -> None:
        if isinstance(completion, BatchFinished):
            expected = self.batches.pop(completion.transfer, None)
            got = tuple(item.transfer for item in completion.outcomes)
            if expected != got:
                raise ContractViolation(
                    f"batch completion names transfers {got}, the batch was {expected}"
                )
            for item in completion.outcomes:
                self._outcome(item)
            return
        self._outcome(completion)

    def _outcome(self, completion: TransferOutcome) -> None:
        tid = completion.transfer
        if isinstance(completion, SlotWritten | SlotWriteFailed):
            write = self.writes.pop(tid, None)
            if write is None:
                raise ContractViolation(f"{completion} completes no write in flight")
            del self.busy[write.slot]
            if isinstance(completion, SlotWritten):
                self.slot_content[write.slot] = write.key
            else:
                self.failed_writes += 1
                self.slot_content.pop(write.slot, None)
        elif isinstance(completion, SlotRead | SlotReadFailed) and tid in self.prefetches:
            prefetch = self.prefetches.pop(tid)
            del self.busy[prefetch.slot]
            del self.prefetch_pages[prefetch.host_page]
            if isinstance(completion, SlotReadFailed):
                self.failed_reads += 1
        elif isinstance(completion, SlotRead | SlotReadFailed) and tid in self.fetches:
            fetch = self.fetches.pop(tid)
            del self.read_pages[fetch.gpu_page]
            if isinstance(completion, SlotReadFailed):
                self.failed_reads += 1
        elif isinstance(completion, SlotRead | SlotReadFailed):
            read = self.reads.pop(tid, None)
            if read is None:
                raise ContractViolation(f"{completion} completes no read in flight")
            del self.busy[read.slot]
            del self.read_pages[read.gpu_page]
            if isinstance(completion, SlotReadFailed):
                self.failed_reads += 1
        else:
            raise ContractViolation(f"unknown completion {completion!r}")

    def quiet(self) -> bool:
        return not self.writes and not self.reads and not self.prefetches and not self.fetches


def _short(key: BlockHash | None) -> str:
    return "nothing" if key is None else key.hex()[:12]
