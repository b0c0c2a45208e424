"""Messages between the core and the actors: plain frozen data carrying ids, never objects.

Commands are imperative (the core tells an actor to do something); completions are past
tense (an actor reports what happened).  The core emits commands into an outbox that the
scheduler actor drains with ``take_commands()``; actors feed completions back with
``handle(event, now)``.

Ordering contract for whoever executes commands (the actors, or a test harness):

1. Commands are executed in the order they are taken.
2. ``CopyGpuToHost`` and ``CopyHostToGpu`` are stream ordered: they run in command order on
   one copy stream, before any later forward pass that touches either page.  They cannot
   fail and report no completion.
3. A ``WriteSlot`` reads its host page only after every earlier copy into that page has
   completed on the device (the page may have just been filled by a ``CopyGpuToHost``);
   copies into other pages are no concern of its.
4. A ``ReadSlot`` writes its GPU page only after every earlier command has completed on the
   device (the page may have just been emptied by a ``CopyGpuToHost``), and reports
   ``SlotRead`` only once its bytes are complete on the device.
5. At most one read or write is in flight per slot: the core never issues a second one
   before the first has reported back.
6. ``PersistRetention`` is ordered against nothing and reports nothing: it is taken with
   the copies and ``FreeSlot`` commands, in the order decided, and may run at any later time.
7. A ``PrefetchSlot`` (a disk -> host read for a queued request) writes its host page only
   after every earlier command has completed on the device (the page may have just been the
   source of a ``CopyHostToGpu``), and reports ``SlotRead`` only once its bytes are complete
   in the host page.  It reports with the same completions as a ``ReadSlot``.

8. A ``PublishBlock`` reads its host page at its place in the command order, after every
   earlier copy has completed on the device, and copies it before any later command runs:
   the page belongs to the local tiers again as soon as the command was taken.  It reports
   nothing (a publish that fails or is shed is the shared tier's loss only).
9. A ``FetchBlock`` (shared tier -> GPU) writes its GPU page only after every earlier command
   has completed on the device, never with bytes that were not verified, and reports
   ``SlotRead`` (landed) or ``SlotReadFailed`` (missing, evicted, corrupt, unavailable), in
   a ``BatchFinished`` for its ``FetchBlocks``, like a ``ReadSlot``.
10. Beneath an engine (statekv.engine_tiers), ``CopyEngineToHost`` and ``CopyHostToEngine``
   are stream ordered as the GPU <-> host copies are: the engine page of a
   ``CopyEngineToHost`` is the engine's and stays allocated until the copy has run (the
   engine keeps a finished request's blocks until its save is reported done), and a
   ``CopyHostToEngine`` runs before the forward pass that reads its engine page.
11. A ``LoadSlot`` (disk -> engine page) writes its engine page only with verified bytes and
   reports ``SlotRead`` or ``SlotReadFailed`` in a ``BatchFinished`` for its ``LoadSlots``;
   several loads may read one slot at once (never while a write to it is in flight).

Batches. Disk transfers travel in batches: the core emits ``WriteSlots`` (a round of spills),
``ReadSlots`` (a run of disk hits), ``PrefetchSlots`` (a queued request's disk blocks) and
``FetchBlocks`` (a run of shared-tier hits), each holding up to
``CacheConfig.max_batch_blocks`` per-block records, after every copy and ``FreeSlot`` of the
same ``take_commands()`` (a transfer may only wait for more of the copy stream than it must,
never for less, so moving it behind later copies keeps rules 3, 4 and 6). An actor executes a
batch as one vector I/O and reports one ``BatchFinished`` holding one outcome per record, in
the batch's order: a batch that partly fails reports the blocks that landed as landed and the
rest as failed, and the core applies each outcome exactly as it would a lone completion.  A
batch is data, never a hidden state: each block's state in the lifecycle table means what it
means for a lone transfer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs

from statekv.ids import BlockHash, BlockId, PageId, SlotId, TransferId

# --- commands -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CopyGpuToHost:
    """Copy one block's KV from a GPU page into a pinned host page (GPU eviction)."""

    block: BlockId
    gpu_page: PageId
    host_page: PageId


@attrs.frozen(kw_only=True)
class CopyHostToGpu:
    """Copy one block's KV from a pinned host page into a GPU page (host prefix hit)."""

    block: BlockId
    host_page: PageId
    gpu_page: PageId


@attrs.frozen(kw_only=True)
class WriteSlot:
    """Write one block's KV from a host page to a disk slot (spill); report SlotWritten."""

    transfer: TransferId
    block: BlockId
    key: BlockHash
    host_page: PageId
    slot: SlotId
    retained: bool
    """The block carries an unexpired TTL: a write that must never be shed."""
    # What the slot header stores so that a later process can restore the block (None /
    # zero where a caller has no chain to give: such a slot is reclaimed, never restored).
    parent: BlockHash | None = None
    """Key of the previous block of the chain (the root key for a first block)."""
    depth: int = 0
    reuse_count: int = 0
    expiry: float | None = None
    """The block's retention deadline, on the core's clock (wall-clock seconds)."""
    issued_at: float = 0.0
    """The core's `now` when it issued the write."""


@attrs.frozen(kw_only=True)
class ReadSlot:
    """Read one block's KV from a disk slot into a GPU page (onboard); report SlotRead."""

    transfer: TransferId
    block: BlockId
    key: BlockHash
    slot: SlotId
    gpu_page: PageId


@attrs.frozen(kw_only=True)
class PrefetchSlot:
    """Read one block's KV from a disk slot into a pinned host page (prefetch for a queued
    request); report SlotRead or SlotReadFailed."""

    transfer: TransferId
    block: BlockId
    key: BlockHash
    slot: SlotId
    host_page: PageId


@attrs.frozen(kw_only=True)
class FetchBlock:
    """Fetch one block's value from the shared tier into a GPU page; report SlotRead."""

    transfer: TransferId
    block: BlockId
    key: BlockHash
    gpu_page: PageId


@attrs.frozen(kw_only=True)
class PublishBlock:
    """Offer one block, whose bytes are in a host page, for publishing to the shared tier.

    The spill-mode policy already admitted it; the publisher may still shed it under
    pressure.  No completion.
    """

    block: BlockId
    key: BlockHash
    host_page: PageId
    parent: BlockHash
    depth: int
    reuse_count: int
    expiry: float | None
    """The block's retention deadline on the core's clock (None: best-effort)."""


@attrs.frozen(kw_only=True)
class FreeSlot:
    """The slot's content left the cache; its bytes must never be served again."""

    slot: SlotId


@attrs.frozen(kw_only=True)
class PersistRetention:
    """Make a lengthened retention deadline of a block that has a disk slot survive a restart.

    The slot header holds the deadline the block was spilled with; this one is later.  No
    completion, and no order against the slot's transfers: a record whose slot holds other
    content by the time it is replayed is inert (specs/disk_persistence.md).
    """

    slot: SlotId
    key: BlockHash
    expiry: float
    """The new deadline, on the core's clock (wall-clock seconds)."""


@attrs.frozen(kw_only=True)
class WriteSlots:
    """Write a run of blocks to their slots as one vector I/O; report one BatchFinished."""

    writes: tuple[WriteSlot, ...]

    @property
    def transfer(self) -> TransferId:
        """The batch's name: its first transfer (a batch is never empty)."""
        return self.writes[0].transfer


@attrs.frozen(kw_only=True)
class ReadSlots:
    """Read a run of blocks from their slots as one vector I/O; report one BatchFinished."""

    reads: tuple[ReadSlot, ...]

    @property
    def transfer(self) -> TransferId:
        """The batch's name: its first transfer (a batch is never empty)."""
        return self.reads[0].transfer


@attrs.frozen(kw_only=True)
class PrefetchSlots:
    """Prefetch a run of blocks into host pages as one vector I/O; report one BatchFinished
    (of SlotRead / SlotReadFailed outcomes)."""

    reads: tuple[PrefetchSlot, ...]

    @property
    def transfer(self) -> TransferId:
        """The batch's name: its first transfer (a batch is never empty)."""
        return self.reads[0].transfer


@attrs.frozen(kw_only=True)
class FetchBlocks:
    """Fetch a run of blocks from the shared tier; report one BatchFinished (of SlotRead /
    SlotReadFailed outcomes)."""

    reads: tuple[FetchBlock, ...]

    @property
    def transfer(self) -> TransferId:
        """The batch's name: its first transfer (a batch is never empty)."""
        return self.reads[0].transfer


@attrs.frozen(kw_only=True)
class CopyEngineToHost:
    """Beneath an engine: copy the engine's page `engine_page` into host page `host_page`
    (stream ordered, no completion)."""

    block: BlockId
    engine_page: int
    host_page: PageId


@attrs.frozen(kw_only=True)
class CopyHostToEngine:
    """Beneath an engine: copy host page `host_page` into the engine's page `engine_page`
    (stream ordered, no completion)."""

    block: BlockId
    host_page: PageId
    engine_page: int


@attrs.frozen(kw_only=True)
class LoadSlot:
    """Beneath an engine: read `slot` (expected to hold `key`) into the engine's page
    `engine_page`, verified."""

    transfer: TransferId
    block: BlockId
    key: BlockHash
    slot: SlotId
    engine_page: int


@attrs.frozen(kw_only=True)
class LoadSlots:
    """Read a run of disk blocks into engine pages; report one BatchFinished."""

    reads: tuple[LoadSlot, ...]

    @property
    def transfer(self) -> TransferId:
        """The batch's name: its first transfer (a batch is never empty)."""
        return self.reads[0].transfer


Command = (CopyGpuToHost | CopyHostToGpu | WriteSlots | ReadSlots | PrefetchSlots | FreeSlot
           | PersistRetention | FetchBlocks | PublishBlock | CopyEngineToHost
           | CopyHostToEngine | LoadSlots)
"""What the core emits (``take_commands``)."""

BlockCommand = (CopyGpuToHost | CopyHostToGpu | WriteSlot | ReadSlot | PrefetchSlot | FreeSlot
                | PersistRetention | FetchBlock | PublishBlock | CopyEngineToHost
                | CopyHostToEngine | LoadSlot)
"""One block's part of a command: batches opened up (``per_block``)."""

# --- completions ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SlotWritten:
    """A WriteSlot completed: every byte is in the slot."""

    transfer: TransferId


@attrs.frozen(kw_only=True)
class SlotWriteFailed:
    """A WriteSlot failed (I/O error, short write, no space)."""

    transfer: TransferId
    cause: str


@attrs.frozen(kw_only=True)
class SlotRead:
    """A ReadSlot completed: the bytes are verified and complete on the device."""

    transfer: TransferId


@attrs.frozen(kw_only=True)
class SlotReadFailed:
    """A ReadSlot failed (I/O error, short read, header or checksum mismatch)."""

    transfer: TransferId
    cause: str


TransferOutcome = SlotWritten | SlotWriteFailed | SlotRead | SlotReadFailed
"""What happened to one block's transfer."""


@attrs.frozen(kw_only=True)
class BatchFinished:
    """A WriteSlots or ReadSlots finished: one outcome per record, in the batch's order."""

    outcomes: tuple[TransferOutcome, ...]

    @property
    def transfer(self) -> TransferId:
        """The batch's name: its first transfer (the batch command's ``transfer``)."""
        return self.outcomes[0].transfer


Completion = TransferOutcome | BatchFinished
"""What an actor feeds back (``handle``)."""


def per_block(commands: Iterable[Command | BlockCommand]) -> Iterator[BlockCommand]:
    """The commands with every batch opened into its per-block records, in order."""
    for cmd in commands:
        if isinstance(cmd, WriteSlots):
            yield from cmd.writes
        elif isinstance(cmd, ReadSlots | PrefetchSlots | FetchBlocks | LoadSlots):
            yield from cmd.reads
        else:
            yield cmd


def outcomes(completion: Completion) -> tuple[TransferOutcome, ...]:
    """The per-transfer outcomes a completion reports."""
    if isinstance(completion, BatchFinished):
        return completion.outcomes
    return (completion,)


def is_read(completion: Completion) -> bool:
    """Whether a completion reports reads (a batch holds one kind only)."""
    first = completion.outcomes[0] if isinstance(completion, BatchFinished) else completion
    return isinstance(first, SlotRead | SlotReadFailed)
