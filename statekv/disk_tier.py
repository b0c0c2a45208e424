"""The disk tier: which slot a spill takes, what it displaces, and how long content is kept.

Owns the disk slots and their displacement order (:class:`~statekv.pools.DiskSlots`), the
spills in flight, the arrival stamps of the retention order, and the retention deadlines:
stamping them when a TTL request leaves, letting them run out, and adopting what an earlier
process left on disk (:meth:`DiskTier.restore`).  It is separate because every rule about a
slot -- whether a host victim may be spilled, which content it displaces, when a slot is free
again -- is decided here and nowhere else; the other concerns only file a block that lands on
disk, unfile one that leaves, and free the slot of a read that is done with it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import attrs

from statekv.arith import is_live
from statekv.block import Block
from statekv.config import CacheConfig, is_finite_number
from statekv.errors import InvariantViolation, UsageError
from statekv.hashing import DIGEST_SIZE
from statekv.ids import BlockHash, PageId, SlotId, TransferId
from statekv.lifecycle import COPY_STATES, BlockEvent, BlockState
from statekv.messages import FreeSlot, PersistRetention, WriteSlot
from statekv.outbox import Outbox
from statekv.policies import Policies
from statekv.pools import DiskSlots, HostPagePool
from statekv.prefix_index import PrefixIndex
from statekv.records import BlockRecords
from statekv.requests import Request
from statekv.stats import Counters

_E = BlockEvent


class Refusal(enum.Enum):
    """Why a host victim was dropped instead of spilled."""

    GATE = "the spill mode does not admit it"
    PRESSURE = "best-effort, and the write queue is full (drop-on-pressure)"
    ADMISSION = ("the disk is full of unexpired retained content (protect_unexpired, or the "
                 "victim is best-effort)")
    DISK_BUSY = "every slot has a read or write in flight"


@attrs.frozen(kw_only=True)
class RestoredBlock:
    """One block an index rebuild found on disk, for :meth:`KVCacheManager.restore` to adopt.

    Everything here was stored with the block by the process that spilled it.
    """

    key: BlockHash
    parent_key: BlockHash
    slot: SlotId
    depth: int
    reuse_count: int
    expiry: float | None
    """Retention deadline on the same clock as `now` (wall-clock seconds)."""
    written_at: float
    """When the spill was issued, on the same clock."""
    sequence: int
    """Orders spills issued at the same `written_at`."""


@attrs.define(eq=False, slots=True)
class Write:
    block: Block | None
    """The spilling block, or None once it was recalled to GPU while its write drained."""
    host_page: PageId
    slot: SlotId
    keep_host: bool = False
    """A write-through: when it lands the block keeps its host page (a disk copy)."""
    staged_key: BlockHash | None = None
    """A write-through of content on GPU, from a staging host page (`block` is None): when
    it lands, the content cached under this key adopts the slot if it has no disk copy."""
    staged_expiry: float | None = None
    """The deadline the staged write put in the slot header."""
    staged_parent: BlockHash | None = None
    staged_depth: int = 0
    staged_reuse: int = 0
    """What the slot header says of the staged content besides its key (for a record that
    takes the slot if the content left the cache meanwhile)."""


class DiskTier:
    """Disk slots, spills in flight and retention, for one manager."""

    __slots__ = ("block_bytes", "config", "counters", "host", "index", "outbox", "policies",
                 "records", "seq", "slots", "staged", "writes")

    def __init__(self, config: CacheConfig, policies: Policies, records: BlockRecords,
                 index: PrefixIndex, host: HostPagePool, outbox: Outbox,
                 counters: Counters) -> None:
        self.config = config
        self.block_bytes = config.block_bytes
        self.policies = policies
        self.records = records
        self.index = index
        self.host = host
        self.outbox = outbox
        self.counters = counters
        self.slots = DiskSlots(config.disk_blocks)
        self.writes: dict[TransferId, Write] = {}
        # Keys with a staged write-through in flight (so content is not written twice).
        self.staged: dict[BlockHash, TransferId] = {}
        self.seq = 0

    # ------------------------------------------------------------------ the order

    def next_seq(self) -> int:
        """An arrival stamp for the retention heap: first in, first out among equal keys.
        (The lists order by position and need no stamp.)"""
        self.seq += 1
        return self.seq

    def file(self, block: Block, now: float) -> None:
        """`block` just landed on disk (or came back to it): order it for displacement."""
        self.slots.file(block, now, self.next_seq())

    def keep_copy(self, block: Block) -> None:
        """`block` (RELEASED or ON_HOST, its other page already taken) is evicted while its
        disk copy is valid: it is ON_DISK in its slot, where it is filed already -- no write."""
        self.records.move(block, _E.COPY_KEPT)
        self.counters.spills_saved_by_disk_copy += 1

    def free_slot(self, slot: SlotId) -> None:
        """Nothing uses `slot` any more: empty again, and the actors free it too."""
        self.slots.empty.append(slot)
        self.outbox.commands.append(FreeSlot(slot=slot))

    def expire(self, now: float) -> None:
        """Content whose TTL ran out becomes best-effort."""
        expired = self.slots.expire(now)
        if expired:
            self.counters.expirations += len(expired)

    # ------------------------------------------------------------------ spills

    def spill_refusal(self, victim: Block, now: float) -> Refusal | None:
        """Why `victim` may not be spilled now, or None when it may."""
        placement = self._placement(victim, now)
        return placement if isinstance(placement, Refusal) else None

    def _placement(self, victim: Block, now: float) -> Refusal | Block | None:
        """Why `victim` may not be spilled now; else the block on disk its spill would
        displace, or None where an empty slot takes it.  Decides only: nothing changes.

        Displacing content whose TTL is running is only for content under a TTL itself, and
        only where the admission policy lets it: a best-effort spill never costs a retained
        block its place, even while every best-effort block on disk is busy with a
        transfer."""
        policies = self.policies
        if not policies.spill.admits(victim, now):
            return Refusal.GATE
        live = is_live(victim.expiry, now)
        if policies.pressure.sheds(live, len(self.writes)):
            return Refusal.PRESSURE
        disk = self.slots
        if disk.empty:
            return None
        displaced = disk.next_victim(live and policies.admission.may_displace_live())
        if displaced is not None:
            return displaced
        if disk.next_victim(True) is not None:
            return Refusal.ADMISSION
        return Refusal.DISK_BUSY

    def try_spill(self, victim: Block, now: float, *, keep_host: bool = False
                  ) -> Refusal | None:
        """Start writing `victim` to a disk slot if the disk admits it now (displacing the
        next disk victim if need be), deciding and taking the slot in one pass; else return
        why not, with nothing changed.

        `keep_host`: a write-through of a block that stays on host (see write_landed)."""
        placement = self._placement(victim, now)
        if type(placement) is Refusal:  # not isinstance: an enum's costs 4x on this path
            return placement
        slot = self._take_slot(placement)  # type: ignore[arg-type]  # Block | None here
        host_page = victim.host_page
        assert host_page is not None
        tid = self.outbox.new_transfer()
        self.writes[tid] = Write(block=victim, host_page=host_page, slot=slot,
                                 keep_host=keep_host)
        victim.disk_slot = slot
        victim.transfer = tid
        self.records.move(victim, _E.SPILL_STARTED)
        self._issue(tid, victim, host_page, slot, now)
        return None

    def spill(self, victim: Block, now: float, *, keep_host: bool = False) -> None:
        """try_spill for a caller that checked :meth:`spill_refusal` already."""
        refusal = self.try_spill(victim, now, keep_host=keep_host)
        if refusal is not None:
            raise InvariantViolation(f"spilling {victim!r}, which the disk refuses: "
                                     f"{refusal.value}")

    def write_through_staged(self, block: Block, staging_page: PageId, now: float) -> None:
        """Start writing the content of `block` (on GPU, its bytes just copied into
        `staging_page` in command order) to a disk slot; the block itself does not change.
        The caller checked :meth:`spill_refusal`."""
        key = block.key
        assert key is not None and key not in self.staged
        placement = self._placement(block, now)
        if isinstance(placement, Refusal):
            raise InvariantViolation(f"writing {block!r} through, which the disk refuses: "
                                     f"{placement.value}")
        slot = self._take_slot(placement)
        tid = self.outbox.new_transfer()
        self.writes[tid] = Write(block=None, host_page=staging_page, slot=slot,
                                 staged_key=key, staged_expiry=block.expiry,
                                 staged_parent=block.parent_key, staged_depth=block.depth,
                                 staged_reuse=block.reuse_count)
        self.staged[key] = tid
        self._issue(tid, block, staging_page, slot, now)

    def _take_slot(self, displaced: Block | None) -> SlotId:
        """An empty slot (`displaced` None), else `displaced`'s: the content there goes."""
        disk = self.slots
        if displaced is None:
            return disk.empty.pop()
        disk.unfile(displaced)
        slot = displaced.disk_slot
        assert slot is not None
        displaced.disk_slot = None  # the slot passes straight to the new spill
        self.counters.displacements += 1
        if displaced.state is BlockState.ON_DISK:
            self.records.discard(displaced, _E.DROPPED)
        else:
            # A disk copy of a block on GPU or host: only the copy goes.
            self.records.move(displaced, _E.COPY_DISPLACED)
        return slot

    def _issue(self, tid: TransferId, block: Block, host_page: PageId, slot: SlotId,
               now: float) -> None:
        key = block.key
        assert key is not None
        self.outbox.writes.append(
            WriteSlot(
                transfer=tid, block=block.id, key=key, host_page=host_page, slot=slot,
                retained=is_live(block.expiry, now), parent=block.parent_key,
                depth=block.depth, reuse_count=block.reuse_count, expiry=block.expiry,
                issued_at=now,
            )
        )
        self.counters.spills += 1

    def write_landed(self, write: Write, now: float) -> None:
        c = self.counters
        c.spills_completed += 1
        c.bytes_written += self.block_bytes
        block = write.block
        if write.keep_host and block is not None:
            # A write-through: still a host hit, now with a disk copy (a later eviction
            # from host writes nothing: COPY_KEPT).
            block.transfer = None
            self.records.move(block, _E.COPY_WRITTEN)
            self.file(block, now)
            self.host.evictable.push(block)
            return
        self.host.give_back(write.host_page)
        if block is None:
            key = write.staged_key
            if key is not None:
                del self.staged[key]
                if self._adopt(key, write, now):
                    return
            # Recalled to GPU while the write drained (or staged content that left the
            # cache, or has a disk copy by now): the bytes in the slot belong to no block.
            self.free_slot(write.slot)
            return
        block.host_page = None
        block.transfer = None
        self.records.move(block, _E.SPILL_LANDED)
        self.file(block, now)

    def _adopt(self, key: BlockHash, write: Write, now: float) -> bool:
        """A staged write-through landed: content no longer cached takes the slot with a
        free record (on disk only, as after a spill); the content cached under `key` takes
        the slot as its disk copy if it is on GPU or host with none (matched by key, not by
        record: any block of this key holds these bytes) and its deadline is at least the
        one the slot header holds (content cached again since, with a shorter stamp or
        none, must not come back from a restart with the old one).  A deadline that grew
        meanwhile reaches the slot header."""
        block = self.index.blocks.get(key)
        written = write.staged_expiry
        if block is None:
            # Left the cache while its write was in flight: it is on disk now, as a spill.
            parent = write.staged_parent
            assert parent is not None
            block = self.records.free.pop()
            block.depth = write.staged_depth
            block.reuse_count = write.staged_reuse
            block.expiry = written
            block.disk_slot = write.slot
            self.index.add(block, key, parent)
            self.records.move(block, _E.STAGED_LANDED)
            self.file(block, now)
            return True
        if (block.disk_slot is not None or block.state not in COPY_STATES
                or block.expiry is None or written is None or block.expiry < written):
            return False
        block.disk_slot = write.slot
        self.records.move(block, _E.COPY_ADOPTED)
        self.file(block, now)
        if block.expiry > written:
            self.outbox.commands.append(
                PersistRetention(slot=write.slot, key=key, expiry=block.expiry))
        return True

    def write_failed(self, write: Write) -> None:
        self.counters.spill_failures += 1
        self.free_slot(write.slot)
        if write.staged_key is not None:
            del self.staged[write.staged_key]
        block = write.block
        if block is None:
            self.host.give_back(write.host_page)
            return
        # The bytes are still in the host page: the block stays cached on host.
        block.disk_slot = None
        block.transfer = None
        self.records.move(block, _E.SPILL_FAILED)
        self.host.evictable.push(block)

    # ------------------------------------------------------------------ retention

    def stamp_retention(self, req: Request, expiry: float, now: float) -> None:
        """Keep the request's full blocks until `expiry` (never shortening a stamp).

        A block the request computed after another request had committed the same content
        is a private duplicate; the stamp goes to the cached twin, wherever it is now -- on
        disk it is re-filed in the retention order at once.  A stamped block that has a disk
        slot (on disk, being spilled or read back) was written with an earlier deadline in
        its slot header: a PersistRetention makes the new one survive a restart.  So does a
        block on GPU or host that keeps a disk copy, re-filed in the retention order as an
        ON_DISK block is.
        """
        for target in self.index.committed_content(req):
            self.extend_retention(target, expiry, now)

    def extend_retention(self, target: Block, expiry: float, now: float) -> None:
        """Keep cached `target` until `expiry` (never shortening its stamp); a block with a
        disk slot is re-filed in the retention order at once (on disk, or on GPU or host with
        a disk copy) and its slot's deadline persisted."""
        if target.expiry is not None and target.expiry >= expiry:
            return
        slot = target.disk_slot
        if slot is not None and (target.state is BlockState.ON_DISK
                                 or target.state in COPY_STATES):
            self.slots.unfile(target)
            target.expiry = expiry
            self.file(target, now)
        else:
            target.expiry = expiry
        key = target.key
        if slot is not None and key is not None:
            self.outbox.commands.append(PersistRetention(slot=slot, key=key, expiry=expiry))

    def check_restore(self, blocks: object) -> set[int]:
        """Validate what :meth:`restore` is given (changing nothing); returns its slots."""
        if isinstance(blocks, str | bytes) or not isinstance(blocks, Sequence):
            raise UsageError("blocks", "must be a sequence of RestoredBlock")
        slots: set[int] = set()
        keys: set[bytes] = set()
        for i, entry in enumerate(blocks):
            self._check_restored(i, entry, slots, keys)
        return slots

    def restore(self, blocks: Sequence[RestoredBlock], slots: set[int], now: float) -> None:
        """Adopt blocks checked by :meth:`check_restore`, each ON_DISK in its slot.

        The displacement order is rebuilt as if the blocks had stayed: best-effort content
        first, in the order it became best-effort (when it was written, or when its deadline
        passed -- also while the process was down), a deeper block before its prefix among
        equals; then content whose deadline is still running, by
        :func:`~statekv.arith.retention_order`.  A deadline never lies beyond
        ``max_ttl_seconds`` from `now`, whatever the disk says: no request of this cache can
        ask for more (a header written under a larger maximum, or by anyone else who can
        write the disk, is cut to it).
        """
        latest = now + self.config.max_ttl_seconds
        by_slot = sorted(
            (attrs.evolve(e, expiry=latest) if e.expiry is not None and e.expiry > latest
             else e for e in blocks),
            key=lambda e: e.slot)
        live = [e for e in by_slot if is_live(e.expiry, now)]
        best_effort = [e for e in by_slot if not is_live(e.expiry, now)]

        def became_best_effort(e: RestoredBlock) -> tuple[float, float, int, int]:
            expired_at = e.expiry if e.expiry is not None else -math.inf
            return (max(e.written_at, expired_at), e.written_at, e.sequence, -e.depth)

        best_effort.sort(key=became_best_effort)
        live.sort(key=lambda e: (e.written_at, e.sequence))
        records, index = self.records, self.index
        fresh: list[Block] = []
        for entry in [*best_effort, *live]:
            block = records.free.pop()
            fresh.append(block)
            block.depth = entry.depth
            block.reuse_count = entry.reuse_count
            block.expiry = entry.expiry
            block.disk_slot = entry.slot
            index.add(block, entry.key, entry.parent_key)
        records.move_all(fresh, _E.RESTORED)
        for block in fresh:
            self.file(block, now)
        disk = self.slots
        disk.empty = [slot for slot in disk.empty if slot not in slots]
        self.counters.restored_blocks += len(fresh)

    def _check_restored(
        self, i: int, entry: object, slots: set[int], keys: set[bytes]
    ) -> None:
        where = f"blocks[{i}]"
        if not isinstance(entry, RestoredBlock):
            raise UsageError("blocks", f"{where} is not a RestoredBlock: {entry!r:.80}")
        hashes: tuple[tuple[str, object], ...] = (
            ("key", entry.key), ("parent_key", entry.parent_key)
        )
        for field, digest in hashes:
            if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
                raise UsageError(field, f"{where}: must be a BlockHash, got {digest!r:.80}")
        slot: object = entry.slot
        disk_blocks = self.config.disk_blocks
        if isinstance(slot, bool) or not isinstance(slot, int) or not (
            0 <= slot < disk_blocks
        ):
            raise UsageError(
                "slot", f"{where}: must be a slot in [0, {disk_blocks}), got {slot!r}"
            )
        if slot in slots:
            raise UsageError("slot", f"{where}: slot {slot} restored twice")
        assert isinstance(slot, int)
        if entry.key in keys:
            raise UsageError("key", f"{where}: key restored twice")
        counts: tuple[tuple[str, object], ...] = (
            ("depth", entry.depth), ("reuse_count", entry.reuse_count),
            ("sequence", entry.sequence),
        )
        for field, value in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(field, f"{where}: must be an integer >= 0, got {value!r}")
        if entry.expiry is not None and not is_finite_number(entry.expiry):
            raise UsageError("expiry", f"{where}: must be finite seconds or None")
        if not is_finite_number(entry.written_at):
            raise UsageError("written_at", f"{where}: must be finite seconds")
        slots.add(slot)
        keys.add(entry.key)
