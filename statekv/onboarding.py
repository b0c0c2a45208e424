"""Onboarding: bringing matched content back to GPU, and the cost gate that decides if to.

Owns the reads in flight (disk -> GPU), the prefetch reads in flight (disk -> host, for
queued requests) and the queued requests' prefetched blocks, the shared-tier fetches in
flight, and the transfer-rate estimates the cost gate weighs (:class:`~statekv.cost.
OnboardCosts`).  It takes a request's matched blocks (GPU hits shared, host hits copied
back, disk hits read, remote hits fetched), and applies every read's and fetch's completion:
waking the requests parked on it, or rewinding them to recompute when it failed.  It is
separate because these are the transfers a request waits for: everything that parks a
request, and everything that lets it go on, is here.
"""

from __future__ import annotations

from statekv.arith import is_live
from statekv.block import Block
from statekv.config import CacheConfig
from statekv.cost import OnboardCosts, cheapest_cut
from statekv.disk_tier import DiskTier
from statekv.errors import InvariantViolation
from statekv.eviction import Eviction
from statekv.ids import PageId, RequestId, TransferId
from statekv.lifecycle import BlockEvent, BlockState
from statekv.messages import (
    CopyHostToGpu,
    FetchBlock,
    PrefetchSlot,
    ReadSlot,
    SlotRead,
    SlotReadFailed,
)
from statekv.outbox import Outbox
from statekv.pools import HostPagePool, PagePool
from statekv.prefix_index import PrefixIndex
from statekv.records import BlockRecords
from statekv.requests import QueuedRecord, Request, RequestTable
from statekv.stats import Counters

_S = BlockState
_E = BlockEvent


class Onboarding:
    """Reads, prefetches and fetches in flight, and the decisions that start them."""

    __slots__ = ("block_bytes", "block_size", "cost_aware", "costs", "counters", "disk",
                 "eviction", "fetches", "gpu", "host", "index", "outbox", "prefetch_reads",
                 "queued", "queued_reading", "queued_records", "reads", "records", "requests")

    def __init__(self, config: CacheConfig, records: BlockRecords, index: PrefixIndex,
                 requests: RequestTable, eviction: Eviction, disk: DiskTier, outbox: Outbox,
                 counters: Counters) -> None:
        self.block_size = config.block_size
        self.block_bytes = config.block_bytes
        self.cost_aware = config.cost_aware_onboarding
        self.records = records
        self.index = index
        self.requests = requests
        self.eviction = eviction
        self.gpu: PagePool = eviction.gpu
        self.host: HostPagePool = eviction.host
        self.disk = disk
        self.outbox = outbox
        self.counters = counters
        self.costs = OnboardCosts()
        self.reads: dict[TransferId, Block] = {}
        # Prefetch: reads into host pages in flight, and the blocks each queued request
        # asked for (the PREFETCHED ones are in the eviction's order: their pages are the
        # host tier's to reclaim).
        self.prefetch_reads: dict[TransferId, Block] = {}
        # A request's blocks as an insertion-ordered set: a block reclaimed (or failed) and
        # prefetched again by a later call of the same request is listed once.
        self.queued: dict[RequestId, dict[Block, None]] = {}
        # The record each queued request's last prefetch call made (its keys), for its next
        # call with the same arguments (QueuedRecord); gone with its `queued` entry.
        self.queued_records: dict[RequestId, QueuedRecord] = {}
        # Per queued request, its blocks in PREFETCHING (it is among their prefetchers): the
        # serving loop asks each step while they are in flight, so the count is kept, not
        # walked.  Raised where a request joins a read, lowered at the read's three exits
        # (landed, failed, taken over by an admission); gone with its `queued` entry.
        self.queued_reading: dict[RequestId, int] = {}
        # The shared tier: fetches in flight.
        self.fetches: dict[TransferId, Block] = {}

    # ------------------------------------------------------------------ the cost gate

    def cost_cut(
        self, req: Request, matched: list[Block], remote: int
    ) -> tuple[list[Block], int, int, int]:
        """Where to end the match so that the request is fastest: returns the local blocks to
        take, how many disk blocks were left to recompute, the remote blocks to fetch and how
        many remote blocks were left to recompute.

        Ending the match at a block means recomputing every matched token from there on (a
        request's computed tokens are a prefix), so the candidates are the starts of the runs
        of disk blocks and of the remote run (which follows the local blocks), each costing
        the transfers before it plus a prefill of the rest; no cut costs every transfer.  A
        tier whose rate was never reported costs nothing (its blocks are always taken).  Ties
        keep the longer match.
        """
        if not self.cost_aware or not (matched or remote):
            return matched, 0, remote, 0
        costs = self.costs
        disk_rate = costs.disk_bytes_per_second
        net_rate = costs.network_bytes_per_second if remote else None
        per_token = costs.prefill_seconds_per_token(req.num_tokens)
        if per_token is None or (disk_rate is None and net_rate is None):
            return matched, 0, remote, 0
        on_disk = _S.ON_DISK
        n_local = len(matched)
        # kind of each candidate block: 0 local (free), 1 disk read, 2 remote fetch
        kinds = [1 if disk_rate is not None and b.state is on_disk else 0 for b in matched]
        kinds += [2 if net_rate is not None else 0] * remote
        total_disk = kinds.count(1)
        total_remote = kinds.count(2)
        if not total_disk and not total_remote:
            return matched, 0, remote, 0
        best = cheapest_cut(kinds, block_bytes=self.block_bytes, block_size=self.block_size,
                            disk_rate=disk_rate, net_rate=net_rate, per_token=per_token)
        skipped_disk = sum(1 for b in matched[best:] if b.state is on_disk)
        kept_remote = max(0, best - n_local)
        if (skipped_disk or kept_remote < remote) and costs.probe_due(
                bool(skipped_disk), kept_remote < remote):
            self.counters.cost_probes += 1
            return matched, 0, remote, 0  # read anyway: a fresh measurement (cost.py)
        return matched[:best], skipped_disk, kept_remote, remote - kept_remote

    # ------------------------------------------------------------------ taking a match

    def take_matched(
        self, req: Request, matched: list[Block], remote: int
    ) -> tuple[int, int, int]:
        """Acquire matched blocks, bringing host and disk ones back to GPU, then start
        fetching the `remote` blocks that follow them from the shared tier.

        Returns the hits by tier the bytes came from: (GPU, host, disk).
        """
        # First take every matched block out of the eviction orders, so that evictions
        # made below to find GPU pages can never pick one of them.
        released, on_gpu = _S.RELEASED, _S.ON_GPU
        if not remote and all(b.state is released or b.state is on_gpu for b in matched):
            return self.take_gpu_hits(req, matched), 0, 0
        gpu_evictable = self.gpu.evictable
        for block in matched:
            state = block.state
            if state is _S.RELEASED:
                gpu_evictable.remove(block)
            elif state is _S.ON_HOST:
                self.host.evictable.remove(block)
            elif state is _S.ON_DISK:
                self.disk.slots.unfile(block)
            elif state is _S.PREFETCHED:
                self.eviction.prefetched.remove(block)  # no GPU eviction may reclaim it
        move = self.records.move
        now = self.records.now
        gpu_hits = host_hits = disk_hits = retained_hits = 0
        i, count = 0, len(matched)
        while i < count:
            block = matched[i]
            state = block.state
            if state is _S.ON_DISK:
                # A run of blocks only on disk (the common tail of a long history) is read
                # back in one pass: nothing between their reads changes the pools.
                end = i + 1
                while end < count and matched[end].state is _S.ON_DISK:
                    end += 1
                run = matched[i:end]
                retained_hits += self.start_reads(req, run)
                disk_hits += len(run)
                i = end
                continue
            i += 1
            block.reuse_count += 1
            if state is _S.RELEASED or state is _S.ON_GPU:
                move(block, _E.ACQUIRED)
                gpu_hits += 1
            elif state is _S.ONBOARDING:
                move(block, _E.ACQUIRED)
                block.waiters.append(req.id)
                req.pending += 1
                disk_hits += 1
                retained_hits += is_live(block.expiry, now)
            elif state is _S.FETCHING:
                # Another request's fetch of this content is in flight: wait for it too.
                move(block, _E.ACQUIRED)
                block.waiters.append(req.id)
                req.pending += 1
                self.counters.hit_blocks_remote += 1
            elif state is _S.ON_HOST or state is _S.SPILLING or state is _S.PREFETCHED:
                self.recall(block)
                host_hits += 1
            elif state is _S.PREFETCHING:
                retained_hits += is_live(block.expiry, now)
                self.take_over_prefetch(req, block)
                disk_hits += 1
            else:
                raise InvariantViolation(f"matched {block!r} in state {state.name}")
            block.ref_count += 1
            req.blocks.append(block)
            page = block.gpu_page
            assert page is not None
            req.pages.append(page)
        for _ in range(remote):
            self.start_fetch(req, len(req.blocks))
        bs = self.block_size
        req.num_computed = (len(matched) + remote) * bs
        req.committed = len(matched) + remote
        c = self.counters
        c.hit_blocks_gpu += gpu_hits
        c.hit_blocks_host += host_hits
        c.hit_blocks_disk += disk_hits
        c.hit_blocks_disk_retained += retained_hits
        return gpu_hits, host_hits, disk_hits

    def take_gpu_hits(self, req: Request, matched: list[Block]) -> int:
        """The common case of take_matched: every matched block is already on GPU."""
        released = _S.RELEASED
        # The evictable ones leave the GPU order in one call (the order they leave in does
        # not change what is left).
        evictable = [block for block in matched if block.state is released]
        if evictable:
            self.gpu.evictable.remove_all(evictable)
        for block in matched:
            block.reuse_count += 1
            block.ref_count += 1
        req.pages += [block.gpu_page for block in matched]  # type: ignore[misc]  # set on GPU
        self.records.move_all(matched, _E.ACQUIRED)
        req.blocks.extend(matched)
        n = len(matched)
        req.num_computed = n * self.block_size
        req.committed = n
        self.counters.hit_blocks_gpu += n
        return n

    def recall(self, block: Block) -> None:
        """Copy a host-resident block back to a GPU page (also while its spill drains).

        The host page stays the block's host copy where the host tier would only have put it
        on its empty list (HostPagePool.keep_copy): the bytes are immutable, so evicting the
        block again later needs no copy.  Not while a spill drains: the write owns the page
        until it lands."""
        page = self.eviction.take_gpu_page(self.records.now)
        host_page = block.host_page
        assert host_page is not None
        self.outbox.commands.append(
            CopyHostToGpu(block=block.id, host_page=host_page, gpu_page=page)
        )
        block.host_page = None
        block.gpu_page = page
        if block.state is _S.SPILLING:
            # The writer still reads the intact host page: the write finishes on its own and
            # then frees the page and the slot, which no block points at any more.
            assert block.transfer is not None
            self.disk.writes[block.transfer].block = None
            block.disk_slot = None
            block.transfer = None
        else:
            if self.host.keep_copy(block, host_page):
                self.counters.host_copies_kept += 1
            if block.state is _S.PREFETCHED:
                # The slot is kept, as an onboard keeps it: a disk copy, filed for
                # displacement once the block is on GPU.
                block.prefetchers.clear()
                self.counters.prefetch_hits += 1
                self.records.move(block, _E.RECALLED)
                self.disk.file(block, self.records.now)
                self.counters.host_recalls += 1
                return
        self.records.move(block, _E.RECALLED)
        self.counters.host_recalls += 1

    def take_over_prefetch(self, req: Request, block: Block) -> None:
        """`req` matched a block whose prefetch read is in flight: it becomes the request's
        onboard (parked until it lands, then copied host -> GPU), with no second read."""
        page = self.eviction.take_gpu_page(self.records.now)
        tid = block.transfer
        assert tid is not None
        self.reads[tid] = self.prefetch_reads.pop(tid)
        block.gpu_page = page
        self.prefetch_read_ended(block)
        block.prefetchers.clear()
        self.records.move(block, _E.ACQUIRED)
        block.waiters.append(req.id)
        req.pending += 1
        c = self.counters
        c.onboards += 1
        c.prefetches_taken_over += 1

    def start_fetch(self, req: Request, position: int) -> None:
        """Fetch `req`'s block at `position` (a key the shared tier holds, cached nowhere
        here) into a fresh record and GPU page; `req` is parked until it lands.

        The record is indexed at once, as an ONBOARDING block is: a request matching the same
        content meanwhile waits for this fetch instead of issuing a second one.
        """
        page = self.eviction.take_gpu_page(self.records.now)  # first: may free a record
        block = self.records.free.pop()
        key = req.keys[position]
        parent = req.keys[position - 1] if position else req.root
        block.depth = position
        block.reuse_count = 1
        block.gpu_page = page
        self.index.add(block, key, parent)
        tid = self.outbox.new_transfer()
        self.outbox.fetches.append(FetchBlock(transfer=tid, block=block.id, key=key,
                                              gpu_page=page))
        self.fetches[tid] = block
        block.transfer = tid
        self.records.move(block, _E.FETCH_STARTED)
        block.waiters.append(req.id)
        block.ref_count = 1
        req.pending += 1
        req.blocks.append(block)
        req.pages.append(page)
        c = self.counters
        c.fetches += 1
        c.hit_blocks_remote += 1

    def start_reads(self, req: Request, run: list[Block]) -> int:
        """Read a run of disk blocks (ON_DISK, out of the displacement order, matched in
        this order) back into GPU pages and acquire them for `req`, parked until they land;
        returns how many hold content whose TTL runs.

        One pass for the run: its pages are taken in one call (the victims, pages and
        transitions `len(run)` page-at-a-time evictions would make, in the same order:
        nothing a read's start does changes the pools), and the blocks move together."""
        records = self.records
        now = records.now
        pages = self.eviction.take_gpu_pages(len(run), now)
        outbox = self.outbox
        reads_out = outbox.reads
        reads = self.reads
        rid = req.id
        retained = 0
        transfers = outbox.new_transfers(len(run))
        for block, page, transfer in zip(run, pages, transfers, strict=True):
            slot = block.disk_slot
            key = block.key
            assert slot is not None and key is not None
            reads_out.append(
                ReadSlot(transfer=transfer, block=block.id, key=key, slot=slot, gpu_page=page))
            reads[transfer] = block
            block.transfer = transfer
            block.gpu_page = page
            block.waiters.append(rid)
            block.reuse_count += 1
            block.ref_count += 1
            retained += is_live(block.expiry, now)
        records.move_all(run, _E.READ_STARTED)
        n = len(run)
        req.pending += n
        req.blocks += run
        req.pages += pages
        self.counters.onboards += n
        return retained

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, rid: RequestId, matched: list[Block],
                 now: float) -> tuple[int, int, int, int]:
        """Start the disk -> host reads of the queued request `rid`'s matched blocks.

        Returns the blocks (started, shared, cached, unfetched), as PrefetchStarted counts
        them.
        """
        blocks = self.queued.setdefault(rid, {})
        reading = self.queued_reading
        started = shared = cached = unfetched = 0
        disk = self.disk
        for i, block in enumerate(matched):
            state = block.state
            if rid in block.prefetchers:
                shared += 1  # asked for by an earlier call of this request
            elif state is _S.PREFETCHING or state is _S.PREFETCHED:
                block.prefetchers.append(rid)
                blocks[block] = None
                shared += 1
                if state is _S.PREFETCHING:
                    reading[rid] = reading.get(rid, 0) + 1
            elif state is _S.ON_DISK:
                # Out of the displacement order first: finding a host page may spill a
                # host victim, and that spill must not displace this block.
                disk.slots.unfile(block)
                page = self.eviction.take_host_page(now, for_prefetch=True)
                if page is None:
                    disk.file(block, now)
                    unfetched = sum(1 for b in matched[i:] if b.state is _S.ON_DISK)
                    break
                self.start_prefetch(block, page)
                block.prefetchers.append(rid)
                blocks[block] = None
                started += 1
                reading[rid] = reading.get(rid, 0) + 1
            elif state is _S.FREE or state is _S.ERROR:
                break  # dropped by the evictions above: the chain ends here
            else:
                cached += 1
        return started, shared, cached, unfetched

    def start_prefetch(self, block: Block, host_page: PageId) -> None:
        """Read an ON_DISK block (already out of the displacement order) into `host_page`."""
        slot = block.disk_slot
        key = block.key
        assert slot is not None and key is not None
        tid = self.outbox.new_transfer()
        self.outbox.prefetches.append(
            PrefetchSlot(transfer=tid, block=block.id, key=key, slot=slot, host_page=host_page)
        )
        self.prefetch_reads[tid] = block
        block.transfer = tid
        block.host_page = host_page
        self.records.move(block, _E.PREFETCH_STARTED)
        self.counters.prefetches += 1

    def end_prefetch(self, rid: RequestId, now: float) -> None:
        """The queued request `rid` was admitted or left: it no longer wants its prefetched
        blocks.  A PREFETCHED block nobody else wants goes back to disk only; one whose read
        is in flight keeps its page until the read lands (then goes back the same way)."""
        self.queued_records.pop(rid, None)
        self.queued_reading.pop(rid, None)
        for block in reversed(self.queued.pop(rid)):
            prefetchers = block.prefetchers
            if rid not in prefetchers:
                continue  # taken by a request, reclaimed or failed meanwhile
            prefetchers.remove(rid)
            if not prefetchers and block.state is _S.PREFETCHED:
                self.eviction.prefetched.remove(block)
                self.host.give_back(self.eviction.give_up_prefetch(block, now))
                self.counters.prefetches_cancelled += 1

    # ------------------------------------------------------------------ completions

    def in_flight(self, tid: TransferId) -> bool:
        """Whether `tid` is a read, prefetch or fetch this concern is waiting for."""
        return tid in self.reads or tid in self.prefetch_reads or tid in self.fetches

    def complete(self, event: SlotRead | SlotReadFailed, now: float) -> None:
        """Apply one checked read, prefetch or fetch outcome."""
        tid = event.transfer
        if tid in self.reads:
            block = self.reads.pop(tid)
            if isinstance(event, SlotRead):
                self.read_landed(block, now)
            else:
                self.read_failed(block)
        elif tid in self.fetches:
            block = self.fetches.pop(tid)
            if isinstance(event, SlotRead):
                self.fetch_landed(block)
            else:
                self.fetch_failed(block)
        else:
            block = self.prefetch_reads.pop(tid)
            if isinstance(event, SlotRead):
                self.prefetch_landed(block, now)
            else:
                self.prefetch_failed(block)

    def prefetch_landed(self, block: Block, now: float) -> None:
        c = self.counters
        c.prefetches_completed += 1
        c.bytes_read += self.block_bytes
        block.transfer = None
        self.records.move(block, _E.PREFETCH_LANDED)
        self.prefetch_read_ended(block)
        if block.prefetchers:
            self.eviction.prefetched.append(block)
        else:
            # Every queued request that wanted it left while the read was in flight.
            self.host.give_back(self.eviction.give_up_prefetch(block, now))
            c.prefetches_cancelled += 1

    def prefetch_failed(self, block: Block) -> None:
        """Never serve the bytes: the content leaves the cache (queued requests that wanted
        it will recompute it)."""
        self.counters.prefetch_failures += 1
        slot = block.disk_slot
        assert slot is not None
        block.disk_slot = None
        block.transfer = None
        self.disk.free_slot(slot)
        self.prefetch_read_ended(block)
        block.prefetchers.clear()
        self.records.discard(block, _E.PREFETCH_FAILED)

    def prefetch_read_ended(self, block: Block) -> None:
        """`block`'s prefetch read ends (landed, failed or taken over): it no longer counts
        as in flight for the queued requests that wanted it."""
        reading = self.queued_reading
        for rid in block.prefetchers:
            reading[rid] -= 1

    def read_landed(self, block: Block, now: float) -> None:
        """The bytes are on GPU, and still in the slot: the block keeps it as a disk copy
        (filed for displacement as a landing spill is), so that evicting it again writes
        nothing and a restart finds it."""
        c = self.counters
        c.onboards_completed += 1
        c.bytes_read += self.block_bytes
        host_page = block.host_page
        if host_page is not None:
            # A prefetch taken over by an admitted request: its bytes landed in the host page.
            gpu_page = block.gpu_page
            assert gpu_page is not None
            self.outbox.commands.append(
                CopyHostToGpu(block=block.id, host_page=host_page, gpu_page=gpu_page)
            )
            block.host_page = None
            self.host.give_back(host_page)
        assert block.disk_slot is not None
        block.transfer = None
        self.records.move(block, _E.READ_LANDED)
        self.disk.file(block, now)
        self.requests.wake_waiters(block)
        if block.ref_count == 0:
            self.records.move(block, _E.RELEASED)
            self.gpu.evictable.push(block)

    def read_failed(self, block: Block) -> None:
        """Never publish the bytes: every waiting request falls back to recompute."""
        c = self.counters
        c.onboard_failures += 1
        if block.host_page is not None:  # a prefetch taken over: its page is never read
            self.host.give_back(block.host_page)
            block.host_page = None
        slot = block.disk_slot
        assert slot is not None
        block.disk_slot = None
        block.transfer = None
        self.disk.free_slot(slot)
        self.records.move(block, _E.READ_FAILED)
        self.index.remove(block)
        live = self.requests.live
        for rid in list(block.waiters):
            req = live[rid]
            self.rewind(req, req.blocks.index(block))
        if block.ref_count == 0:
            self.records.discard(block, _E.DISCARDED)

    def fetch_landed(self, block: Block) -> None:
        c = self.counters
        c.fetches_completed += 1
        c.bytes_fetched += self.block_bytes
        block.transfer = None
        self.records.move(block, _E.FETCH_LANDED)
        self.requests.wake_waiters(block)
        if block.ref_count == 0:
            self.records.move(block, _E.RELEASED)
            self.gpu.evictable.push(block)

    def fetch_failed(self, block: Block) -> None:
        """Never serve the bytes: every waiting request recomputes from this block."""
        self.counters.fetch_failures += 1
        block.transfer = None
        self.records.move(block, _E.FETCH_FAILED)
        self.index.remove(block)
        live = self.requests.live
        for rid in list(block.waiters):
            req = live[rid]
            self.rewind(req, req.blocks.index(block))
        if block.ref_count == 0:
            self.records.discard(block, _E.DISCARDED)

    def rewind(self, req: Request, position: int) -> None:
        """Drop `req`'s blocks from `position` on: it recomputes them."""
        was_parked = req.pending > 0
        dropped = req.blocks[position:]
        for block in dropped:
            if req.id in block.waiters:  # ONBOARDING, or the ERROR block being failed
                req.pending -= 1
        del req.blocks[position:]
        del req.pages[position:]
        req.num_computed = min(req.num_computed, position * self.block_size)
        req.committed = min(req.committed, position)
        records = self.records
        records.cause = req.id
        try:
            self.eviction.let_go(req, dropped)
        finally:
            records.cause = None
        if was_parked and req.pending == 0:
            self.requests.parked -= 1
        self.counters.requests_fallen_back += 1
