"""GPU and host eviction: where a page comes from when none is empty.

Owns the GPU and host page pools with their eviction orders, and the order of PREFETCHED
blocks (host pages holding a guess, reclaimed newest first).  It decides which cached block
leaves a tier and where it goes: a GPU victim is copied to host (and offered to the shared
tier) or dropped; a host victim is spilled (the disk tier says whether it may be) or dropped.
A victim that keeps a valid disk copy (statekv.lifecycle, "Inclusive disk tier") is neither
dropped nor written again: it becomes ON_DISK in the slot it already owns.
Blocks enter the GPU order here too, when the last request holding them lets go.  It is
separate because every page that is taken, evicted or given back passes through these few
methods, and the cascade GPU -> host -> disk reads top to bottom in one place.
"""

from __future__ import annotations

from statekv.arith import is_live
from statekv.block import Block
from statekv.config import CacheConfig
from statekv.disk_tier import DiskTier, Refusal
from statekv.errors import InvariantViolation
from statekv.ids import BlockHash, PageId
from statekv.lifecycle import BlockEvent, BlockState
from statekv.messages import CopyGpuToHost, PublishBlock
from statekv.orderings import BlockList
from statekv.outbox import Outbox
from statekv.policies import Policies
from statekv.pools import HostPagePool, PagePool
from statekv.prefix_index import PrefixIndex
from statekv.records import BlockRecords
from statekv.requests import Request
from statekv.stats import Counters

_S = BlockState
_E = BlockEvent

# What one write-through attempt did (Eviction._write_through_one).
_WRITTEN, _SKIPPED, _IGNORED = object(), object(), object()


class Eviction:
    """The GPU and host tiers' pages, their eviction orders and the cascade between them."""

    __slots__ = ("counters", "disk", "gpu", "has_disk", "has_host", "host", "outbox",
                 "policies", "prefetched", "publish_on_release", "reclaim_first", "records",
                 "shared", "write_backlog", "write_depth")

    def __init__(self, config: CacheConfig, policies: Policies, records: BlockRecords,
                 gpu: PagePool, host: HostPagePool, disk: DiskTier, outbox: Outbox,
                 counters: Counters) -> None:
        self.policies = policies
        self.records = records
        self.gpu = gpu
        self.host = host
        self.disk = disk
        self.outbox = outbox
        self.counters = counters
        self.has_host = config.host_blocks + config.reserved_host_blocks > 0
        self.has_disk = config.disk_blocks > 0
        self.shared = config.shared_tier
        self.reclaim_first = config.reclaim_prefetched_first
        self.write_depth = config.write_queue_depth
        self.publish_on_release = config.shared_tier and config.publish_on == "release"
        # The PREFETCHED blocks in landing order (the newest is reclaimed first: its request
        # is the furthest from admission).
        self.prefetched = BlockList()
        # Retained content a release could not write through then, by key, oldest first
        # (an insertion-ordered dict as an ordered set; retry_write_throughs drains it).
        self.write_backlog: dict[BlockHash, None] = {}

    # ------------------------------------------------------------------ giving blocks back

    def let_go(self, req: Request, blocks: list[Block]) -> None:
        """`req` stops holding `blocks` (tail first, so tails are evicted first)."""
        rid = req.id
        priority = req.priority
        cached: list[Block] = []
        on_gpu = _S.ON_GPU  # a local: this loop runs once per block of every release
        for block in reversed(blocks):
            state = block.state
            if state is not on_gpu and rid in block.waiters:
                block.waiters.remove(rid)
            refs = block.ref_count - 1
            block.ref_count = refs
            if refs:
                continue
            block.priority = priority
            if state is on_gpu:
                if block.key is not None:
                    cached.append(block)
                else:
                    self.records.discard(block, _E.DISCARDED)
            elif state is _S.ONBOARDING or state is _S.FETCHING or state is _S.ERROR:
                # ONBOARDING and FETCHING keep their GPU page until the transfer lands (then
                # RELEASED); an ERROR block is discarded by the failure handler once nobody
                # holds it.
                pass
            else:
                raise InvariantViolation(f"request {rid!r} held {block!r}")
        if cached:
            self.records.move_all(cached, _E.RELEASED)
            self.gpu.evictable.push_all(cached, priority)

    def write_through(self, req: Request, index: PrefixIndex, now: float) -> None:
        """`req` was released with a TTL: write its retained content that has no disk copy
        to disk now, in prefix order, keeping it where it is (retention_write_through).

        A block on host is spilled keeping its page (COPY_WRITTEN when it lands).  A block
        on GPU is copied into a staging host page, had as for a GPU victim (its host copy's
        page, if it has one: no copy then), and written from there (the block does not
        change; COPY_ADOPTED when it lands), never through the last host page a GPU victim
        could have.  Each write must be one the disk admits (spill_refusal), and at most
        ``write_queue_depth`` writes are in flight.  What cannot be written now is counted
        (write_throughs_skipped) and joins the write-through backlog, retried in order as
        writes complete (retry_write_throughs); eviction or the flush at close write
        whatever the backlog has not reached by then."""
        backlog = self.write_backlog
        for target in index.committed_content(req):
            if self._write_through_one(target, now) is _SKIPPED:
                self.counters.write_throughs_skipped += 1
                assert target.key is not None
                backlog[target.key] = None

    def retry_write_throughs(self, index: PrefixIndex, now: float) -> None:
        """A write completed (a place in the queue, maybe a host page, came free): write the
        backlog's retained content, oldest first, until the queue is full again.  Entries
        whose content left, expired, reached disk or is on its way there are dropped."""
        backlog = self.write_backlog
        if not backlog:
            return
        depth, disk = self.write_depth, self.disk
        for key in list(backlog):
            target = index.blocks.get(key)
            outcome = _IGNORED if target is None else self._write_through_one(target, now)
            if outcome is _SKIPPED:
                if len(disk.writes) >= depth:
                    return  # no room: the next completion retries
                continue  # refused now (a slot, a host page): kept for later
            del backlog[key]
            if outcome is _WRITTEN:
                self.counters.write_throughs_retried += 1

    def _write_through_one(self, target: Block, now: float) -> object:
        """Write `target` through if it is retained content with no disk copy on GPU or
        host; returns _WRITTEN, _SKIPPED (it should be, but cannot be now) or _IGNORED."""
        disk = self.disk
        if target.disk_slot is not None or not is_live(target.expiry, now):
            return _IGNORED
        if target.key in disk.staged:
            return _IGNORED  # a write-through of it is in flight already
        state = target.state
        on_gpu = state is _S.RELEASED or state is _S.ON_GPU
        if not on_gpu and state is not _S.ON_HOST:
            return _IGNORED  # on its way to disk already, or not cached here
        if len(disk.writes) >= self.write_depth:
            return _SKIPPED
        c = self.counters
        if not on_gpu:
            if disk.try_spill(target, now, keep_host=True) is not None:
                return _SKIPPED
            self.host.evictable.remove(target)
            c.write_throughs += 1
            return _WRITTEN
        # Staging never takes the last host page a GPU victim could have (an empty one,
        # or one evicting host content yields): on a small host tier, the page the
        # staging holds until its write lands would otherwise cost the next GPU victim
        # -- retained content among them -- its place on host.
        host = self.host
        if host.free_count() + host.evictable.size + self.prefetched.size < 2:
            return _SKIPPED
        if target.host_page is not None:
            # Its host copy is the staging page: no GPU -> host copy to make.
            if disk.spill_refusal(target, now) is not None:
                return _SKIPPED
            disk.write_through_staged(target, host.forget_copy(target), now)
            c.write_throughs += 1
            return _WRITTEN
        page = self.take_host_page(now, for_prefetch=False)
        if page is None:
            return _SKIPPED
        if disk.spill_refusal(target, now) is not None:
            host.give_back(page)
            return _SKIPPED
        gpu_page = target.gpu_page
        assert gpu_page is not None
        self.outbox.commands.append(
            CopyGpuToHost(block=target.id, gpu_page=gpu_page, host_page=page))
        disk.write_through_staged(target, page, now)
        c.write_throughs += 1
        return _WRITTEN

    # ------------------------------------------------------------------ finding pages

    def take_gpu_pages(self, count: int, now: float) -> list[PageId]:
        """`count` empty GPU pages for one allocation, evicting as `count` take_gpu_page
        calls would (the same victims, pages, records and transitions, in the same order).

        Callers check `obtainable()` first.  Empty pages go first, taken as one slice; the
        victims are then popped from the GPU order as one run (nothing a victim's way down
        does puts a block back in that order, so the run is what `count` pops would take).
        With no host tier every victim is dropped (no host copy, no disk copy either: both
        need a host tier) in one pass.  With a host tier each victim's way down depends on
        the host pages and slots the one before it left, so they go down one at a time, in
        eviction order.
        """
        empty = self.gpu.empty
        have = min(count, len(empty))
        pages = empty[len(empty) - have:]
        del empty[len(empty) - have:]
        pages.reverse()  # the order of `have` pops from the stack's end
        rest = count - have
        if not rest:
            return pages
        victims = self.gpu.evictable.pop_run(rest)
        if self.has_host:
            down = self.evict_gpu_victim
            pages += [down(victim, now) for victim in victims]
            return pages
        for victim in victims:
            page = victim.gpu_page
            assert page is not None
            pages.append(page)
            victim.gpu_page = None
        self.counters.gpu_evictions += rest
        self.records.discard_all(victims, _E.DROPPED)
        return pages

    def take_gpu_page(self, now: float) -> PageId:
        """An empty GPU page, evicting the coldest cached block if need be.

        Callers check `obtainable()` first, so a page is always found.
        """
        gpu = self.gpu
        if gpu.empty:
            return gpu.empty.pop()
        return self.evict_gpu_victim(gpu.evictable.pop(), now)

    def evict_gpu_victim(self, victim: Block, now: float) -> PageId:
        """Take `victim` (just out of the GPU order) off its GPU page and return the page:
        to host onto its host copy, or copied into a host page, or to its disk copy, or
        dropped."""
        page = victim.gpu_page
        assert page is not None
        victim.gpu_page = None
        c = self.counters
        c.gpu_evictions += 1
        host_page = victim.host_page
        if host_page is not None:
            # Its host copy holds the same bytes: it moves to host onto that page, no copy.
            del self.host.copies[victim]
            self.records.move(victim, _E.OFFLOADED)
            self.host.evictable.push(victim)
            c.host_offloads += 1
            c.offloads_saved_by_host_copy += 1
            if self.shared and not (victim.published and self.publish_on_release):
                self.offer_publish(victim, host_page, now)
            return page
        if self.has_host:
            host_page = self.take_host_page(now, for_prefetch=False)
            if host_page is not None:
                self.outbox.commands.append(
                    CopyGpuToHost(block=victim.id, gpu_page=page, host_page=host_page)
                )
                victim.host_page = host_page
                self.records.move(victim, _E.OFFLOADED)
                self.host.evictable.push(victim)
                c.host_offloads += 1
                # (Offered at its release already, under publish_on="release": once is
                # enough while it stays cached.)
                if self.shared and not (victim.published and self.publish_on_release):
                    self.offer_publish(victim, host_page, now)
                return page
            c.offloads_skipped += 1
        if victim.disk_slot is not None:
            self.disk.keep_copy(victim)  # still on disk: nothing is lost
        else:
            self.records.discard(victim, _E.DROPPED)
        return page

    def publish_released(self, req: Request, index: PrefixIndex, now: float) -> None:
        """publish_on="release": offer `req`'s committed content to the shared tier now,
        in prefix order, each block once while it stays cached.  Content on GPU is copied
        into a host page that is free now and given back at once (a publish copies its
        page at offer, in command order, so the page is free again right after); content on
        host is offered from its page.  What finds no free page, or is elsewhere (on disk,
        in flight), is offered at its eviction as with publish_on="eviction"."""
        host = self.host
        for target in index.committed_content(req):
            if target.published:
                continue
            state = target.state
            if state is _S.ON_HOST or state is _S.SPILLING:
                page = target.host_page
                assert page is not None
                self.offer_publish(target, page, now)
            elif (state is _S.RELEASED or state is _S.ON_GPU) and target.host_page is not None:
                self.offer_publish(target, target.host_page, now)  # from its host copy
            elif (state is _S.RELEASED or state is _S.ON_GPU) and host.free_count():
                page = host.take_free()
                assert page is not None
                gpu_page = target.gpu_page
                assert gpu_page is not None
                self.outbox.commands.append(
                    CopyGpuToHost(block=target.id, gpu_page=gpu_page, host_page=page))
                self.offer_publish(target, page, now)
                host.give_back(page)

    def offer_publish(self, block: Block, host_page: PageId, now: float) -> None:
        """Offer a block just copied into `host_page` to the shared tier, when the spill mode
        admits it (the same gate as a spill: one policy decides what leaves the GPU tier's
        reach).  Placed right after its copy in the outbox: the publisher copies the page at
        that point of the command order, before a later command may reuse it."""
        key, parent = block.key, block.parent_key
        if key is None or parent is None:
            return  # private content is never shared
        if not self.policies.spill.admits(block, now):
            self.counters.publishes_not_admitted += 1
            return
        # A deadline that passed makes the content best-effort: published without expiry.
        expiry = block.expiry if is_live(block.expiry, now) else None
        self.outbox.commands.append(PublishBlock(
            block=block.id, key=key, host_page=host_page, parent=parent, depth=block.depth,
            reuse_count=block.reuse_count, expiry=expiry,
        ))
        block.published = True
        self.counters.publishes_offered += 1

    def take_host_page(self, now: float, *, for_prefetch: bool) -> PageId | None:
        """A host page for a GPU victim or a prefetch: an empty one, else (for a GPU victim)
        the newest prefetched block's, else from evicting host victims -- or, with
        ``reclaim_prefetched_first`` off, the prefetched page only after the host victims
        yielded none.

        Prefetched pages go first by default because giving one back costs nothing (the
        bytes are still on disk) and a prefetch is only a guess about a request that has not
        run yet.  A victim that spills keeps its page until the write lands; the caller then
        gets a reserved page, or the next victim is tried.  A prefetch never takes another's
        page and evicts at most one host victim: a guess must not spill the whole host tier
        looking for a page (the spill's page comes back when it lands, for the next call).
        None when no page can be had now.
        """
        host = self.host
        page = host.take_free()
        if page is not None:
            return page
        if for_prefetch:
            evictable = host.evictable
            return self.evict_host_victim(evictable.pop(), now) if evictable.size else None
        if self.reclaim_first and self.prefetched.tail is not None:
            return self.reclaim_prefetched(now)
        evictable = host.evictable
        while evictable.size:
            victim = evictable.pop()
            page = self.evict_host_victim(victim, now)
            if page is not None:
                return page
        if self.prefetched.tail is not None:
            return self.reclaim_prefetched(now)
        return None

    def reclaim_prefetched(self, now: float) -> PageId:
        """The newest prefetched block goes back to disk only; its host page is returned."""
        newest = self.prefetched.tail
        assert newest is not None
        self.prefetched.remove(newest)
        self.counters.prefetches_reclaimed += 1
        return self.give_up_prefetch(newest, now)

    def give_up_prefetch(self, block: Block, now: float) -> PageId:
        """PREFETCHED -> ON_DISK (out of every order already): returns its host page, which
        the caller gives back or passes on."""
        page = block.host_page
        assert page is not None
        block.host_page = None
        block.prefetchers.clear()
        self.records.move(block, _E.PREFETCH_CANCELLED)
        self.disk.file(block, now)
        return page

    # ------------------------------------------------------------------ a clean close

    def flush_retained(self, now: float) -> tuple[int, int]:
        """Start writing down content whose TTL runs and that is on no disk yet, as far as
        host pages and slots allow now; returns (how many such blocks are left to write, on
        GPU or host with no write in flight; how many this call moved on: spilled, or
        copied from GPU to host).  For a clean close, when nothing will be served
        again: a retained block on host is spilled; one on GPU is copied to a free host page
        first -- made free by dropping best-effort host content, whose next home would be
        the disk the retained content needs (it is lost at exit either way).  The caller
        calls again as writes land and give their host pages back."""
        left = moved = 0
        host, disk = self.host, self.disk

        def retained(block: Block) -> bool:
            # (Content whose staged write-through is in flight is being written.)
            return (block.disk_slot is None and block.key is not None
                    and block.key not in disk.staged and is_live(block.expiry, now))

        if self.has_disk:
            for block in [b for b in host.evictable if retained(b)]:
                if disk.try_spill(block, now) is None:
                    host.evictable.remove(block)
                    moved += 1
                else:
                    left += 1
        for block in [b for b in self.gpu.evictable if retained(b)]:
            copied = block.host_page is not None  # its host copy: nothing to copy
            page: PageId | None = (host.forget_copy(block) if copied
                                   else self._free_host_page_for_flush(now))
            left += 1
            if page is None:
                continue
            self.gpu.evictable.remove(block)
            gpu_page = block.gpu_page
            assert gpu_page is not None
            block.gpu_page = None
            self.gpu.empty.append(gpu_page)
            if not copied:
                self.outbox.commands.append(
                    CopyGpuToHost(block=block.id, gpu_page=gpu_page, host_page=page))
            block.host_page = page
            self.records.move(block, _E.OFFLOADED)
            host.evictable.push(block)   # the next call spills it
            moved += 1
        return left, moved

    def _free_host_page_for_flush(self, now: float) -> PageId | None:
        host = self.host
        page = host.take_free()
        if page is not None:
            return page
        for victim in list(host.evictable):
            if victim.disk_slot is not None:
                host.evictable.remove(victim)
                page = victim.host_page
                assert page is not None
                victim.host_page = None
                self.disk.keep_copy(victim)
                return page
            if not is_live(victim.expiry, now):
                host.evictable.remove(victim)
                page = victim.host_page
                assert page is not None
                victim.host_page = None
                self.counters.host_drops += 1
                self.records.discard(victim, _E.DROPPED)
                return page
        return None

    def evict_host_victim(self, victim: Block, now: float) -> PageId | None:
        """Spill `victim` to disk or drop it; return the host page this frees now, if any.

        A victim whose disk copy is valid is neither: it is on disk already (no write), and
        its page is free at once.  Nor is content whose staged write-through is in flight
        spilled again: it is dropped from host, and is on disk when that write lands
        (STAGED_LANDED) -- two writes of one key would leave two slots holding it if the
        process died before the second one's slot was freed.
        """
        c = self.counters
        page = victim.host_page
        assert page is not None
        if victim.disk_slot is not None:
            victim.host_page = None
            self.disk.keep_copy(victim)
            return page
        if self.has_disk and victim.key in self.disk.staged:
            c.host_drops += 1
            victim.host_page = None
            self.records.discard(victim, _E.DROPPED)
            return page
        if self.has_disk:
            refusal = self.disk.try_spill(victim, now)
            if refusal is None:
                host = self.host
                return host.reserved.pop() if host.reserved else None
            if refusal is Refusal.GATE:
                c.gate_drops += 1
            elif refusal is Refusal.PRESSURE:
                c.pressure_drops += 1
            elif refusal is Refusal.ADMISSION:
                c.admission_refusals += 1
            else:
                c.disk_busy_refusals += 1
        c.host_drops += 1
        victim.host_page = None
        self.records.discard(victim, _E.DROPPED)
        return page
