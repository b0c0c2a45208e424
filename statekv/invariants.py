"""The structural invariants of the core, checked from outside every concern.

Owns nothing: it reads every concern's data and verifies that they agree -- each page and
slot has exactly one owner, each block's fields and order memberships match its state, the
index, the requests' tables and the transfers in flight point at each other consistently.
It is separate because it is the one reader of everything, and far too slow for a hot path
(the fuzz machines and the tests call it after every step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from statekv.arith import is_live
from statekv.block import Block
from statekv.config import CacheConfig
from statekv.errors import InvariantViolation
from statekv.ids import BlockHash, PageId, RequestId, SlotId, TransferId
from statekv.lifecycle import COPY_STATES, BlockState

if TYPE_CHECKING:
    from statekv.disk_tier import DiskTier
    from statekv.eviction import Eviction
    from statekv.onboarding import Onboarding
    from statekv.prefix_index import PrefixIndex
    from statekv.records import BlockRecords
    from statekv.requests import RequestTable

_S = BlockState


def check_invariants(
    config: CacheConfig, records: BlockRecords, index: PrefixIndex, requests: RequestTable,
    eviction: Eviction, disk: DiskTier, onboarding: Onboarding,
    loads: Mapping[TransferId, Block] | None = None,
) -> None:
    """Verify every structural invariant; raises InvariantViolation.  Not for the hot path.

    `loads`: beneath an engine (statekv.engine_tiers), the reads into engine pages in flight;
    each one holds its LOADING block (``ref_count``), and the GPU pool is the engine's (none
    of statekv's pages are GPU pages).
    """
    gpu, host = eviction.gpu, eviction.host
    cfg = config
    gpu_owner: dict[PageId, Block | str] = {}
    host_owner: dict[PageId, Block | str] = {}
    slot_owner: dict[SlotId, Block | str] = {}

    def own(table: dict[int, Block | str], item: int, who: Block | str, what: str) -> None:
        if item in table:
            raise InvariantViolation(f"{what} {item} owned by {table[item]!r} and {who!r}")
        table[item] = who

    for page in gpu.empty:
        own(gpu_owner, page, "gpu-empty", "GPU page")  # type: ignore[arg-type]
    for page in [*host.empty, *host.reserved]:
        own(host_owner, page, "host-free", "host page")  # type: ignore[arg-type]
    for slot in disk.slots.empty:
        own(slot_owner, slot, "disk-empty", "slot")  # type: ignore[arg-type]
    for tid, write in disk.writes.items():
        if write.block is None:
            own(host_owner, write.host_page, f"write {tid}", "host page")  # type: ignore[arg-type]
            own(slot_owner, write.slot, f"write {tid}", "slot")  # type: ignore[arg-type]
        elif write.block.transfer != tid or write.block.state is not _S.SPILLING:
            raise InvariantViolation(f"write {tid} points at {write.block!r}")
    for tid, block in onboarding.reads.items():
        if block.transfer != tid or block.state is not _S.ONBOARDING:
            raise InvariantViolation(f"read {tid} points at {block!r}")
    for tid, block in onboarding.prefetch_reads.items():
        if block.transfer != tid or block.state is not _S.PREFETCHING:
            raise InvariantViolation(f"prefetch {tid} points at {block!r}")
    for tid, block in onboarding.fetches.items():
        if block.transfer != tid or block.state is not _S.FETCHING:
            raise InvariantViolation(f"fetch {tid} points at {block!r}")
    wanted: dict[int, list[RequestId]] = {}
    reading: dict[RequestId, int] = {}
    for rid, listed in onboarding.queued.items():
        if rid in requests.live:
            raise InvariantViolation(f"request {rid!r} is both admitted and queued")
        reading[rid] = 0
        for block in listed:
            if rid in block.prefetchers:
                wanted.setdefault(block.id, []).append(rid)
                reading[rid] += block.state is _S.PREFETCHING

    counts = [0] * len(BlockState)
    held: dict[int, int] = {}
    for tid, block in (loads or {}).items():
        if block.state is not _S.LOADING:
            raise InvariantViolation(f"load {tid} points at {block!r}")
        held[block.id] = held.get(block.id, 0) + 1
    waiting: dict[int, list[RequestId]] = {}
    for req in requests.live.values():
        if len(req.pages) != len(req.blocks):
            raise InvariantViolation(f"request {req.id!r}: block table out of step")
        pending = 0
        for i, block in enumerate(req.blocks):
            held[block.id] = held.get(block.id, 0) + 1
            if req.pages[i] != block.gpu_page:
                raise InvariantViolation(f"request {req.id!r}: page {i} is stale")
            if block.state is _S.ONBOARDING or block.state is _S.FETCHING:
                pending += 1
                waiting.setdefault(block.id, []).append(req.id)
            elif block.state is not _S.ON_GPU:
                raise InvariantViolation(f"request {req.id!r} holds {block!r}")
            if block.key is not None and i < len(req.keys) and block.key != req.keys[i]:
                raise InvariantViolation(f"request {req.id!r}: block {i} has another key")
        if pending != req.pending:
            raise InvariantViolation(
                f"request {req.id!r}: pending={req.pending}, {pending} blocks in flight"
            )
        if req.num_computed > len(req.blocks) * cfg.block_size:
            raise InvariantViolation(f"request {req.id!r}: computed tokens without pages")
    parked = sum(1 for r in requests.live.values() if r.pending)
    if parked != requests.parked:
        raise InvariantViolation(f"parked gauge {requests.parked} but {parked} parked")

    gpu_lru = set(map(id, gpu.evictable))
    host_lru = set(map(id, host.evictable))
    unmarked = set(map(id, disk.slots.unmarked))
    retained = set(map(id, disk.slots.retained))
    prefetched = set(map(id, eviction.prefetched))
    free_records = set(map(id, records.free))
    if len(free_records) != len(records.free):
        raise InvariantViolation("a record is on the free list twice")
    now = records.now
    for block in records.all:
        st = block.state
        counts[st] += 1
        if block.ref_count != held.get(block.id, 0):
            raise InvariantViolation(
                f"{block!r}: ref_count {block.ref_count}, held {held.get(block.id, 0)}"
            )
        if sorted(block.waiters) != sorted(waiting.get(block.id, [])):
            raise InvariantViolation(f"{block!r}: waiters {block.waiters} disagree")
        if sorted(block.prefetchers) != sorted(wanted.get(block.id, [])):
            raise InvariantViolation(f"{block!r}: prefetchers {block.prefetchers} disagree")
        if block.prefetchers and st not in (_S.PREFETCHING, _S.PREFETCHED):
            raise InvariantViolation(f"{block!r}: wanted by a prefetch in state {st.name}")
        if st is _S.PREFETCHED and not block.prefetchers:
            raise InvariantViolation(f"{block!r}: prefetched for no queued request")
        expect_gpu = st in (_S.ON_GPU, _S.RELEASED, _S.ONBOARDING, _S.ERROR, _S.FETCHING)
        # An ONBOARDING block may own a host page: a prefetch taken over (the page lands
        # the read; the pool accounting below checks that it is not owned twice).
        # A block on GPU may own a host page: its host copy (HostPagePool.copies).
        host_copy = block in host.copies
        expect_host = st in (_S.ON_HOST, _S.SPILLING, _S.PREFETCHING, _S.PREFETCHED) or (
            st is _S.ONBOARDING and block.host_page is not None
        ) or host_copy
        if host_copy and (st not in (_S.ON_GPU, _S.RELEASED) or block.key is None):
            raise InvariantViolation(f"{block!r}: a host copy in state {st.name}")
        # A copy state may own a slot: the block's valid disk copy (lifecycle).
        has_copy = st in COPY_STATES and block.disk_slot is not None
        expect_slot = has_copy or st in (_S.SPILLING, _S.ON_DISK, _S.ONBOARDING,
                                         _S.PREFETCHING, _S.PREFETCHED, _S.LOADING)
        expect_transfer = st in (_S.SPILLING, _S.ONBOARDING, _S.PREFETCHING, _S.FETCHING)
        for what, value, expected in (
            ("gpu_page", block.gpu_page, expect_gpu),
            ("host_page", block.host_page, expect_host),
            ("disk_slot", block.disk_slot, expect_slot),
            ("transfer", block.transfer, expect_transfer),
        ):
            if (value is not None) != expected:
                raise InvariantViolation(f"{block!r}: {what}={value} in state {st.name}")
        if block.gpu_page is not None:
            own(gpu_owner, block.gpu_page, block, "GPU page")  # type: ignore[arg-type]
        if block.host_page is not None:
            own(host_owner, block.host_page, block, "host page")  # type: ignore[arg-type]
        if block.disk_slot is not None:
            own(slot_owner, block.disk_slot, block, "slot")  # type: ignore[arg-type]
        if (id(block) in free_records) != (st is _S.FREE):
            raise InvariantViolation(f"{block!r}: free list membership wrong")
        if (id(block) in gpu_lru) != (st is _S.RELEASED):
            raise InvariantViolation(f"{block!r}: GPU evictable membership wrong")
        if (id(block) in host_lru) != (st is _S.ON_HOST):
            raise InvariantViolation(f"{block!r}: host evictable membership wrong")
        # The disk orders hold the ON_DISK blocks and the disk copies, nothing with a
        # transfer on its slot: so a spill never displaces a slot a read or write uses.
        on_disk = id(block) in unmarked or id(block) in retained
        if on_disk != (st is _S.ON_DISK or has_copy):
            raise InvariantViolation(f"{block!r}: disk order membership wrong")
        if has_copy and block.key is None:
            raise InvariantViolation(f"{block!r}: a disk copy of private content")
        if (id(block) in prefetched) != (st is _S.PREFETCHED):
            raise InvariantViolation(f"{block!r}: prefetched order membership wrong")
        if id(block) in retained and not is_live(block.expiry, now):
            raise InvariantViolation(f"{block!r}: expired but still in the deadline set")
        if id(block) in unmarked and is_live(block.expiry, now):
            raise InvariantViolation(f"{block!r}: live TTL filed as best-effort")
        if st in (_S.RELEASED, _S.ON_HOST, _S.SPILLING, _S.ON_DISK, _S.PREFETCHING,
                  _S.PREFETCHED, _S.FETCHING) and block.key is None:
            raise InvariantViolation(f"{block!r}: cached without a key")
        if st in (_S.FREE, _S.ERROR) and block.key is not None:
            raise InvariantViolation(f"{block!r}: indexed in state {st.name}")
        if st is _S.FREE and (block.heap_pos != -1 or block.expiry is not None
                              or block.reuse_count or block.waiters or block.prefetchers
                              or block.prev or block.next
                              or block.disk_prev or block.disk_next):
            raise InvariantViolation(f"{block!r}: a free record kept old fields")
        if block.key is not None and index.blocks.get(block.key) is not block:
            raise InvariantViolation(f"{block!r}: key not indexed to it")
        if st is _S.RELEASED and block.ref_count:
            raise InvariantViolation(f"{block!r}: released but held")
        if st is _S.ON_GPU and not block.ref_count:
            raise InvariantViolation(f"{block!r}: on GPU with no holder")
        if st is _S.LOADING and not block.ref_count:
            raise InvariantViolation(f"{block!r}: loading with no read in flight")
    if counts != records.state_counts:
        raise InvariantViolation(f"state counts {records.state_counts} but found {counts}")
    # After the blocks' own checks, which name a broken prefetch link more precisely.
    for rid, found in reading.items():
        counted = onboarding.queued_reading.get(rid, 0)
        if counted != found:
            raise InvariantViolation(f"queued request {rid!r}: {counted} prefetch reads "
                                     f"counted in flight, {found} found")
    if not onboarding.queued_reading.keys() <= onboarding.queued.keys():
        raise InvariantViolation("prefetch reads counted for a request no longer queued")
    # Every page and slot has exactly one owner, and nothing else is owned: a lost id
    # or a stray one (None, an id past the pool) is as wrong as a doubly owned one.
    host_total = cfg.host_blocks + cfg.reserved_host_blocks
    gpu_total = 0 if loads is not None else cfg.gpu_blocks
    for what, owned, total in (("GPU pages", gpu_owner, gpu_total),
                               ("host pages", host_owner, host_total),
                               ("slots", slot_owner, cfg.disk_blocks)):
        if owned.keys() != set(range(total)):
            missing = sorted(set(range(total)) - owned.keys())
            stray = [item for item in owned if item not in range(total)]
            raise InvariantViolation(
                f"{total} {what}: owned {len(owned)}, unowned {missing}, stray {stray}"
            )
    if len(host.reserved) > host.reserve_target:
        raise InvariantViolation("host reserve above its target")
    if host.free_count() and len(host.reserved) < host.reserve_target:
        raise InvariantViolation("a free host page sits outside an unfilled reserve")
    children: dict[BlockHash, int] = {}
    for key, block in index.blocks.items():
        if block.key != key:
            raise InvariantViolation(f"index maps a key to {block!r} with another key")
        assert block.parent_key is not None
        children[block.parent_key] = children.get(block.parent_key, 0) + 1
    if children != index.children:
        raise InvariantViolation("child counts disagree with the index")
    gpu.evictable.check()
    host.evictable.check()
    disk.slots.check()
    eviction.prefetched.check()
    unqueued = set(onboarding.queued_records) - set(onboarding.queued)
    if unqueued:
        raise InvariantViolation(f"prefetch records kept for requests not queued: {unqueued}")
