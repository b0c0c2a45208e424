"""The block records and their states: the only code that moves a block through the table.

Owns the fixed set of :class:`~statekv.block.Block` records, the free list they are taken
from and given back to, the count of records in each state, and the context every
transition is traced with (the caller's clock and the request that caused it).  It is
separate because every other concern changes states, and each of them must do it the same
way: through :data:`statekv.lifecycle.TRANSITIONS`, counted and traced here.

Giving a record back (:meth:`BlockRecords.discard`) also lives here: the content leaves the
prefix index and the pages it still owns go back to their pools, whichever concern decided
it leaves (an eviction, a displacement, a failed transfer).
"""

from __future__ import annotations

import math

from statekv.block import Block
from statekv.errors import IllegalTransition, InvariantViolation
from statekv.ids import BlockId, RequestId
from statekv.lifecycle import TRANSITIONS, BlockEvent, BlockState
from statekv.pools import HostPagePool, PagePool
from statekv.prefix_index import PrefixIndex
from statekv.trace import TraceSink

# The transition table regrouped by event, built once from TRANSITIONS (never by hand): a
# move looks up `_NEXT[event][state]`, one small dict keyed by an int, instead of building a
# (state, event) tuple to hash for every block -- a quarter of a batch transition's cost.
_NEXT: dict[BlockEvent, dict[BlockState, BlockState]] = {event: {} for event in BlockEvent}
for (_state, _event), _next in TRANSITIONS.items():
    _NEXT[_event][_state] = _next
del _state, _event, _next


class BlockRecords:
    """Every block record of one manager, made once and recycled through `free`."""

    __slots__ = ("all", "cause", "free", "gpu", "host", "index", "now", "state_counts",
                 "trace")

    def __init__(self, count: int, index: PrefixIndex, gpu: PagePool, host: HostPagePool,
                 trace: TraceSink | None) -> None:
        # Every live block owns at least one page or slot, so `count` records suffice.
        self.all = [Block(BlockId(i)) for i in range(count)]
        self.free = list(reversed(self.all))
        self.state_counts = [0] * len(BlockState)
        self.state_counts[BlockState.FREE] = count
        self.index = index
        self.gpu = gpu
        self.host = host
        self.trace = trace
        self.now = -math.inf
        """The caller's clock at the current call (the core never reads one)."""
        self.cause: RequestId | None = None
        """The request whose call is making the transitions, for the trace."""

    def move(self, block: Block, event: BlockEvent) -> None:
        """Change a block's state through the table (the only place a state changes)."""
        old = block.state
        new = _NEXT[event].get(old)
        if new is None:
            raise IllegalTransition(block.id, old.name, event.name)
        block.state = new
        counts = self.state_counts
        counts[old] -= 1
        counts[new] += 1
        if self.trace is not None:
            self.trace.record(self.now, block.id, self.cause, old, new, event)

    def move_all(self, blocks: list[Block], event: BlockEvent) -> None:
        """move for a run of blocks, in order (one call instead of one per block on hot
        paths; the trace gets the same records, in the same order)."""
        row = _NEXT[event]
        counts = self.state_counts
        trace = self.trace
        if trace is None:
            # Apart from the traced loop, so that the run pays no per-block trace test; and
            # row[old], not row.get(old): a subscript costs less than a method call, and in
            # this loop only the table can raise KeyError (the counts are a list).
            block: Block | None = None
            old = BlockState.FREE
            try:
                for block in blocks:
                    old = block.state
                    new = row[old]
                    block.state = new
                    counts[old] -= 1
                    counts[new] += 1
            except KeyError:
                assert block is not None
                raise IllegalTransition(block.id, old.name, event.name) from None
            return
        step = row.get
        now, cause, record = self.now, self.cause, trace.record
        for block in blocks:
            old = block.state
            traced = step(old)
            if traced is None:
                raise IllegalTransition(block.id, old.name, event.name)
            block.state = traced
            counts[old] -= 1
            counts[traced] += 1
            record(now, block.id, cause, old, traced, event)

    def discard(self, block: Block, event: BlockEvent) -> None:
        """The content leaves the cache: unindex it, free the GPU or host page it still owns
        (a GPU block's host copy included).

        Never a disk slot: whoever takes a block off disk (displacement, a landed or failed
        read) frees or passes on its slot first, since only it knows whether a transfer still
        uses the slot.
        """
        if block.disk_slot is not None or block.transfer is not None:
            raise InvariantViolation(f"discarding {block!r} with a disk slot or a transfer")
        self.move(block, event)
        self.index.remove(block)
        if block.gpu_page is not None:
            self.gpu.empty.append(block.gpu_page)
        if block.host_page is not None:
            host = self.host
            if block in host.copies:  # a GPU block's host copy (HostPagePool)
                del host.copies[block]
            host.give_back(block.host_page)
        # Back to a FREE record's defaults.  Holders, waiters and the heap position are
        # already cleared whenever a block is discarded (check_invariants verifies it).
        block.gpu_page = block.host_page = None
        block.expiry = None
        block.reuse_count = block.depth = block.priority = 0
        block.published = False
        self.free.append(block)

    def discard_all(self, blocks: list[Block], event: BlockEvent) -> None:
        """discard for a run of blocks, in one pass per step: the same checks, transitions
        (traced in order), unindexing, pages given back and defaults, and the records go
        back to `free` in the run's order (the next allocation takes them as it would have).
        """
        for block in blocks:
            if block.disk_slot is not None or block.transfer is not None:
                raise InvariantViolation(f"discarding {block!r} with a disk slot or a transfer")
        self.move_all(blocks, event)
        self.index.remove_all(blocks)
        empty = self.gpu.empty
        host = self.host
        for block in blocks:
            if block.gpu_page is not None:
                empty.append(block.gpu_page)
                block.gpu_page = None
            if block.host_page is not None:
                if block in host.copies:
                    del host.copies[block]
                host.give_back(block.host_page)
                block.host_page = None
            block.expiry = None
            block.reuse_count = block.depth = block.priority = 0
            block.published = False
        self.free += blocks
