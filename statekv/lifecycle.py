"""The block lifecycle: every state a block can be in, and every way it can change.

Theory of operation
-------------------
A *block* is one record of KV content: a node of the prefix tree (a full block, keyed by its
chained hash) or a private block of one request (a partly filled last block, or a duplicate of
content that is already cached).  Its *storage* (a GPU page, a pinned host page, a disk slot)
comes from per-tier pools; the block points at where its bytes are now, and moving between
tiers changes those pointers and the state, never the block's place in the tree.

Everything that affects a block's lifecycle lives here: the states, the events, and the
literal table ``TRANSITIONS`` mapping ``(state, event) -> next state``.  A block's state
changes only through this table, in :mod:`statekv.records` (the contracts of
:func:`next_state` state its safety properties); an event that the table does not list for the
block's current state raises :class:`~statekv.errors.IllegalTransition` -- it is never a
silent no-op.  The specification in ``specs/lifecycle.md`` (diagram and invariants) is
generated from this table, and a test fails when the two disagree.

States, and what storage a block in each state owns:

==========  =====================================================  ===========================
state       meaning                                                storage owned
==========  =====================================================  ===========================
FREE        the record is unused                                   none
ON_GPU      held by at least one request                           GPU page (+ host copy)
RELEASED    on GPU, no holder; cached content, evictable           GPU page (+ host copy)
ON_HOST     evicted from GPU into pinned host memory               host page
SPILLING    host -> disk write in flight                           host page + disk slot
ON_DISK     on disk only                                           disk slot
ONBOARDING  disk -> GPU read in flight                             disk slot + GPU page
ERROR       its read failed: never served, freed by last holder    GPU page
PREFETCHING disk -> host read in flight for a queued request          disk slot + host page
PREFETCHED  on disk and in a host page, kept for a queued request  disk slot + host page
FETCHING    shared tier -> GPU fetch in flight                     GPU page
LOADING     disk -> engine read in flight (beneath an engine)      disk slot
==========  =====================================================  ===========================

Inclusive disk tier.  A full block is immutable, so the copy in its disk slot stays valid
when the block moves up: a block in a *copy state* (ON_GPU, RELEASED, ON_HOST) may also own
the disk slot holding its bytes (``disk_slot`` set: "has a disk copy").  The slot stays the
disk tier's to reclaim: the block is filed in the displacement order exactly as an ON_DISK
block of the same retention class would be (best-effort FIFO, or the deadline heap while its
TTL runs; the disk order uses its own links, so it is in a GPU or host order at the same
time), it expires there, and a lengthened deadline reaches its slot header
(PersistRetention).  A copy is made by a disk read that lands (READ_LANDED: the slot is
kept, re-filed as a landing spill is) and by a host hit on a PREFETCHED block (RECALLED);
it ends in one of three ways:

* COPY_KEPT: the block is evicted from GPU (no host page) or from host while its copy is
  valid -- it becomes ON_DISK in its slot, at its place in the order, with no write
  (``spills_saved_by_disk_copy`` counts them);
* COPY_DISPLACED: a spill displaces the slot (the next victim of the displacement order is
  a copy) -- the block stays where it is, only ``disk_slot`` is cleared, the slot passes
  straight to the spill as any displaced slot does, and a later eviction spills it again
  normally;
* the slot stays with the block when it is onboarded again (ON_DISK -> ONBOARDING).

A copy is also made by a *retention write-through* (``retention_write_through``): when a
request with a TTL is released, its content on GPU is copied into a staging host page (stream
ordered, so the GPU page is free to change right after) and written from there; the write
belongs to no block while it is in flight (the block has no disk slot yet, so nothing trusts
the slot early), and when it lands the content is looked up by key: still cached on GPU or
host with no disk copy, it adopts the slot (COPY_ADOPTED); no longer cached (a GPU victim
that found no host page, since staging uses host pages too), a free record takes the slot
and the content is on disk only (FREE -> ON_DISK, STAGED_LANDED: nothing retained is lost to
the staging); cached again under a shorter deadline, or on its way to disk by another write,
the slot is freed.  Content
on host is written through as a beneath-an-engine block is (COPY_WRITTEN, below).

So a restart finds the content: the slot is never freed (no FreeSlot, so the index journal
keeps its record) while a copy is kept.

Inclusive host tier.  The same holds one tier up: a block recalled to GPU from host (RECALLED
from ON_HOST or PREFETCHED) keeps the host page it came from as its *host copy*
(``host_page`` set in ON_GPU or RELEASED; ``HostPagePool.copies``), unless the page is owed to
the spill reserve, which it then refills.  A host copy's page is as free as an empty one: it
is handed out after the empty pages and before any cached content is evicted (oldest copy
first), and taking it only forgets the copy -- no transition, the block stays on GPU.  So the
host tier holds exactly what it held without copies.  While it lasts: OFFLOADED moves the
block onto that page with no GPU -> host copy; a write-through stages from it (no copy), and
a publish at release offers it from it.  Not after a recall from SPILLING: the write owns
the page until it lands (planted bug ``host-copy-of-a-draining-spill``).

The shared tier (specs/remote_tier.md) adds one state.  Its content is not the cache's: a
request's prefix is matched past the local tiers only against keys the remote fetcher found
in the cluster just before ``add_request``, and a record is taken for such a block only when
its fetch starts (FREE -> FETCHING, with a GPU page).  There is no record for "known
remotely" (every record must own a page or a slot, which is what bounds the record count),
and no state for a publish: a publish copies its host page at offer, in command order, so the
page is the local tiers' again as soon as the command was taken.

A *prefetch* brings a queued request's disk blocks into host pages before it is admitted, so
that its onboard is a host -> GPU copy when it runs.  Prefetched content stays on disk (the
slot is kept) until a request takes it, so giving a prefetched page back (the queued request
left, or the host tier needs the page: prefetched pages are the first reclaimed) is free and
returns the block to ON_DISK.  When a request is admitted while a prefetch of its block is
still in flight, the block becomes ONBOARDING (the read is already issued; it then also owns
the host page it lands in, and a host -> GPU copy follows the landing).

Beneath an engine (statekv.engine_tiers: vLLM's prefix cache owns the GPU).  The GPU pages
are the engine's: no block of statekv is ever ON_GPU, RELEASED, ONBOARDING or FETCHING, and
the tiers hold inclusive copies of what the engine computed.  Three events and one state
serve it.  SAVED takes a free record into ON_HOST when an engine block it does not hold
yet is copied into a host page (from there, the usual spill path, or a *write-through*: the
spill starts at once and, when it lands, COPY_WRITTEN leaves the block on host with a disk
copy -- so content reaches disk while it is still a host hit).  COPIED_OUT is a
prefix hit served from a host page into an engine block: the host copy stays (the engine's
copy is the engine's to evict), so the block stays where it is.  A hit on disk content is
a read into an engine block: ON_DISK -> LOADING (out of the displacement order, so no spill
can take the slot under the read), and back to ON_DISK in its slot when the last read of it
lands, or FREE when a read failed (the content is never served again).  Several requests
may read one block at once: each read is counted in ``ref_count``, and only the first start
and the last end are transitions.

GPU <-> host copies are *stream ordered*: the actor executes them, in command order, before
any later work that touches either page, so they need no completion event.  Disk reads and
writes run on worker pools and report back; that is why SPILLING and ONBOARDING exist.

Why each state owns what it owns (each row is a race the design rules out):

* ONBOARDING keeps its GPU page even when its last holder releases it: the page cannot return
  to a free list while the read may still write into it.
* ONBOARDING keeps its disk slot until the read lands: no spill can claim the slot and
  overwrite the bytes before they are read.
* SPILLING keeps its host page until the write lands: the writer reads from it.
* PREFETCHING keeps its host page and its disk slot until the read lands, even when the
  queued request that asked for it leaves: the read may still write into the page.
* PREFETCHING and PREFETCHED are in no displacement order: a spill never takes their slot.
* FETCHING keeps its GPU page even when its last holder releases it, as ONBOARDING does; a
  fetch that fails (missing, evicted, expired, corrupt, unavailable) goes to ERROR and is
  never served.
* ON_DISK -> FREE (displacement) removes the block from the prefix tree in the same step, so
  the tree never points at a slot whose bytes were recycled.
* A copy is displaced only through the displacement order, which holds no block with a
  transfer on its slot: ONBOARDING, SPILLING, PREFETCHING and PREFETCHED are not copy
  states, so no spill overwrites a slot a read is in flight on, and a slot holding one
  block's copy is owned by that block (check_invariants), never free and never a write's.
* COPY_DISPLACED clears ``disk_slot`` in the same step, so no later eviction trusts a copy
  whose slot was rewritten (COPY_KEPT needs ``disk_slot``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from statekv.errors import IllegalTransition


class BlockState(enum.IntEnum):
    """Where a block's bytes are and what may happen to it next.

    An IntEnum so that the transition lookup hashes in C (a plain Enum's __hash__ is Python
    code and costs three times as much on the hot path); values are disjoint from
    BlockEvent's so that a state never compares equal to an event.
    """

    FREE = 0
    ON_GPU = 1
    RELEASED = 2
    ON_HOST = 3
    SPILLING = 4
    ON_DISK = 5
    ONBOARDING = 6
    ERROR = 7
    PREFETCHING = 8
    PREFETCHED = 9
    FETCHING = 10
    LOADING = 11


class BlockEvent(enum.IntEnum):
    """Something that happens to one block (meanings in EVENT_MEANINGS)."""

    ALLOCATED = 100
    ACQUIRED = 101
    RELEASED = 102
    DISCARDED = 103
    OFFLOADED = 104
    DROPPED = 105
    RECALLED = 106
    SPILL_STARTED = 107
    SPILL_LANDED = 108
    SPILL_FAILED = 109
    READ_STARTED = 110
    READ_LANDED = 111
    READ_FAILED = 112
    RESTORED = 113
    PREFETCH_STARTED = 114
    PREFETCH_LANDED = 115
    PREFETCH_CANCELLED = 116
    PREFETCH_FAILED = 117
    FETCH_STARTED = 118
    FETCH_LANDED = 119
    FETCH_FAILED = 120
    COPY_KEPT = 121
    COPY_DISPLACED = 122
    SAVED = 123
    COPIED_OUT = 124
    LOAD_STARTED = 125
    LOAD_LANDED = 126
    LOAD_FAILED = 127
    COPY_WRITTEN = 128
    COPY_ADOPTED = 129
    STAGED_LANDED = 130


EVENT_MEANINGS: Final[Mapping[BlockEvent, str]] = {
    BlockEvent.ALLOCATED: (
        "A free record takes an empty GPU page for a request's new tokens."
    ),
    BlockEvent.ACQUIRED: (
        "A request's prefix matched the block (another holder)."
    ),
    BlockEvent.RELEASED: (
        "The last holder let go and the content is reusable: the block becomes evictable."
    ),
    BlockEvent.DISCARDED: (
        "The last holder let go of content that is not reusable (private or failed)."
    ),
    BlockEvent.OFFLOADED: (
        "Evicted from GPU: its bytes were copied into a host page, or are in its host copy "
        "already (no copy)."
    ),
    BlockEvent.DROPPED: (
        "Evicted from its lowest tier (or displaced from disk): the content leaves the cache."
    ),
    BlockEvent.RECALLED: (
        "A prefix hit on a block whose bytes are in a host page: copied host -> GPU; the "
        "page stays its host copy (not while a spill drains, nor when the reserve is short)."
    ),
    BlockEvent.SPILL_STARTED: (
        "Evicted from host: a host -> disk write was issued."
    ),
    BlockEvent.SPILL_LANDED: (
        "The write completed; the bytes are on disk."
    ),
    BlockEvent.SPILL_FAILED: (
        "The write failed; the bytes are still in the host page, so the block stays on host."
    ),
    BlockEvent.READ_STARTED: (
        "A prefix hit on a disk block: a disk -> GPU read was issued."
    ),
    BlockEvent.READ_LANDED: (
        "The read completed and the bytes are complete on the device."
    ),
    BlockEvent.READ_FAILED: (
        "The read failed (I/O error, short read, checksum): the bytes are never served."
    ),
    BlockEvent.RESTORED: (
        "At open, a free record adopts a slot an earlier process spilled (index rebuild)."
    ),
    BlockEvent.PREFETCH_STARTED: (
        "A queued request asked for the block ahead of admission: a disk -> host read was "
        "issued into a host page."
    ),
    BlockEvent.PREFETCH_LANDED: (
        "The prefetch read completed: the bytes are in the host page (and still on disk)."
    ),
    BlockEvent.PREFETCH_CANCELLED: (
        "No queued request wants the prefetched block any more, or the host tier reclaimed "
        "its page: the page is given back and the block is on disk only again."
    ),
    BlockEvent.PREFETCH_FAILED: (
        "The prefetch read failed (I/O error, short read, checksum): the bytes are never "
        "served and the content leaves the cache."
    ),
    BlockEvent.FETCH_STARTED: (
        "A request's prefix continues in the shared tier: a free record takes a GPU page and "
        "a fetch of the block's value was issued into it."
    ),
    BlockEvent.FETCH_LANDED: (
        "The fetch completed: the value was verified and the bytes are complete on the device."
    ),
    BlockEvent.FETCH_FAILED: (
        "The fetch failed (missing, evicted or expired key, corrupt or foreign value, the "
        "master unavailable): the bytes are never served."
    ),
    BlockEvent.COPY_KEPT: (
        "Evicted from GPU or host while its disk copy is valid: no write, the block is on "
        "disk only, in its slot and at its place in the displacement order."
    ),
    BlockEvent.COPY_DISPLACED: (
        "A spill took the slot holding the disk copy of a block that is on GPU or host: the "
        "copy is gone, the block stays where it is."
    ),
    BlockEvent.COPY_WRITTEN: (
        "A write-through landed: the bytes are on disk and the block keeps its host page "
        "(on host with a disk copy, filed in the displacement order)."
    ),
    BlockEvent.COPY_ADOPTED: (
        "A write-through of content on GPU (copied into a staging host page when its TTL was "
        "stamped) landed while the content is still cached on GPU or host with no disk "
        "copy: the slot becomes its disk copy, filed in the displacement order."
    ),
    BlockEvent.STAGED_LANDED: (
        "A write-through of content on GPU landed after the content left the GPU and host "
        "tiers (evicted with no host page, or dropped): a free record takes the slot, and "
        "the content is on disk, as after a spill."
    ),
    BlockEvent.SAVED: (
        "Beneath an engine: a full block the engine computed, which the cache does not hold, "
        "is copied from the engine's page into a host page a free record takes."
    ),
    BlockEvent.COPIED_OUT: (
        "Beneath an engine: a prefix hit on a block in a host page is copied into the "
        "engine's page; the host copy stays."
    ),
    BlockEvent.LOAD_STARTED: (
        "Beneath an engine: a prefix hit on a disk block; a disk -> engine read was issued "
        "(another read of a block already loading is counted, not a new state)."
    ),
    BlockEvent.LOAD_LANDED: (
        "The last read of a loading block landed (verified, complete in the engine's "
        "pages): the block is on disk only again, in its slot."
    ),
    BlockEvent.LOAD_FAILED: (
        "The last read of a loading block returned and one of its reads failed (I/O error, "
        "short read, checksum): the content leaves the cache and is never served."
    ),
}


S = BlockState
E = BlockEvent

TRANSITIONS: Final[Mapping[tuple[BlockState, BlockEvent], BlockState]] = {
    (S.FREE, E.ALLOCATED): S.ON_GPU,
    (S.FREE, E.RESTORED): S.ON_DISK,
    (S.ON_GPU, E.ACQUIRED): S.ON_GPU,
    (S.ON_GPU, E.RELEASED): S.RELEASED,
    (S.ON_GPU, E.DISCARDED): S.FREE,
    (S.RELEASED, E.ACQUIRED): S.ON_GPU,
    (S.RELEASED, E.OFFLOADED): S.ON_HOST,
    (S.RELEASED, E.DROPPED): S.FREE,
    (S.ON_HOST, E.RECALLED): S.ON_GPU,
    (S.ON_HOST, E.SPILL_STARTED): S.SPILLING,
    (S.ON_HOST, E.DROPPED): S.FREE,
    (S.SPILLING, E.SPILL_LANDED): S.ON_DISK,
    (S.SPILLING, E.SPILL_FAILED): S.ON_HOST,
    (S.SPILLING, E.RECALLED): S.ON_GPU,
    (S.ON_DISK, E.READ_STARTED): S.ONBOARDING,
    (S.ON_DISK, E.DROPPED): S.FREE,
    (S.ONBOARDING, E.ACQUIRED): S.ONBOARDING,
    (S.ONBOARDING, E.READ_LANDED): S.ON_GPU,
    (S.ONBOARDING, E.READ_FAILED): S.ERROR,
    (S.ERROR, E.DISCARDED): S.FREE,
    (S.ON_DISK, E.PREFETCH_STARTED): S.PREFETCHING,
    (S.PREFETCHING, E.PREFETCH_LANDED): S.PREFETCHED,
    (S.PREFETCHING, E.PREFETCH_FAILED): S.FREE,
    (S.PREFETCHING, E.ACQUIRED): S.ONBOARDING,
    (S.PREFETCHED, E.RECALLED): S.ON_GPU,
    (S.PREFETCHED, E.PREFETCH_CANCELLED): S.ON_DISK,
    (S.FREE, E.FETCH_STARTED): S.FETCHING,
    (S.FETCHING, E.ACQUIRED): S.FETCHING,
    (S.FETCHING, E.FETCH_LANDED): S.ON_GPU,
    (S.FETCHING, E.FETCH_FAILED): S.ERROR,
    (S.RELEASED, E.COPY_KEPT): S.ON_DISK,
    (S.ON_HOST, E.COPY_KEPT): S.ON_DISK,
    (S.ON_GPU, E.COPY_DISPLACED): S.ON_GPU,
    (S.RELEASED, E.COPY_DISPLACED): S.RELEASED,
    (S.ON_HOST, E.COPY_DISPLACED): S.ON_HOST,
    (S.FREE, E.SAVED): S.ON_HOST,
    (S.ON_HOST, E.COPIED_OUT): S.ON_HOST,
    (S.SPILLING, E.COPIED_OUT): S.SPILLING,
    (S.ON_DISK, E.LOAD_STARTED): S.LOADING,
    (S.LOADING, E.LOAD_STARTED): S.LOADING,
    (S.LOADING, E.LOAD_LANDED): S.ON_DISK,
    (S.LOADING, E.LOAD_FAILED): S.FREE,
    (S.SPILLING, E.COPY_WRITTEN): S.ON_HOST,
    (S.ON_GPU, E.COPY_ADOPTED): S.ON_GPU,
    (S.RELEASED, E.COPY_ADOPTED): S.RELEASED,
    (S.ON_HOST, E.COPY_ADOPTED): S.ON_HOST,
    (S.FREE, E.STAGED_LANDED): S.ON_DISK,
}
"""The single source of truth for the block lifecycle."""

del S, E

COPY_STATES: Final = frozenset({BlockState.ON_GPU, BlockState.RELEASED, BlockState.ON_HOST})
"""States in which a block may also own a valid disk copy (``disk_slot`` set, filed in the
displacement order); the only states with a COPY_KEPT, COPY_DISPLACED or COPY_ADOPTED
row."""

# A read in flight ends only by landing or failing: never straight to a free list.
_READ_IN_FLIGHT_EXITS: Final = frozenset({BlockState.ONBOARDING, BlockState.ON_GPU,
                                          BlockState.ERROR})
# A fetch in flight keeps its GPU page the same way: it lands or fails, never freed.
_FETCH_IN_FLIGHT_EXITS: Final = frozenset({BlockState.FETCHING, BlockState.ON_GPU,
                                           BlockState.ERROR})
# A prefetch in flight keeps its host page and slot: it lands, fails, or an admitted request
# takes it over as an onboard.
_PREFETCH_IN_FLIGHT_EXITS: Final = frozenset({BlockState.PREFETCHED, BlockState.FREE,
                                              BlockState.ONBOARDING})
# A write in flight keeps its host page: it lands, fails back to host, is recalled, or is
# copied out to an engine (the page is only read).
_WRITE_IN_FLIGHT_EXITS: Final = frozenset({BlockState.ON_DISK, BlockState.ON_HOST,
                                           BlockState.ON_GPU, BlockState.SPILLING})
# A read into an engine's pages keeps its slot until the last read returns: it lands back on
# disk, or the content leaves; never a free list under a read still in flight.
_LOAD_IN_FLIGHT_EXITS: Final = frozenset({BlockState.LOADING, BlockState.ON_DISK,
                                          BlockState.FREE})


# A record leaves FREE for a new request's page, to adopt a slot found at open, or for a
# fetch from the shared tier, nothing else.
_LEAVES_FREE: Final = frozenset({BlockEvent.ALLOCATED, BlockEvent.RESTORED,
                                 BlockEvent.FETCH_STARTED, BlockEvent.SAVED,
                                 BlockEvent.STAGED_LANDED})
# Bytes are on disk only once a write landed, or when an index rebuild at open found them
# there (in a slot whose header, checksums and fingerprint were checked; restore is FREE-only),
# or when a prefetched copy is given up (the slot was kept all along, never rewritten).
# Or when a block with a valid disk copy is evicted (the copy was read from the slot or
# prefetched from it, and the slot kept since).
# Or when the last read of a block into an engine's pages lands (the slot was kept).
# Or when a write-through lands for content no longer cached (the write landed, as a spill's).
_ENTERS_ON_DISK: Final = frozenset({BlockEvent.SPILL_LANDED, BlockEvent.RESTORED,
                                    BlockEvent.PREFETCH_CANCELLED, BlockEvent.COPY_KEPT,
                                    BlockEvent.LOAD_LANDED, BlockEvent.STAGED_LANDED})
# A block becomes RELEASED only by its release (a RELEASED block losing its copy stays one).
_STAYS_OR_ENTERS_RELEASED: Final = frozenset({BlockEvent.RELEASED, BlockEvent.COPY_DISPLACED,
                                              BlockEvent.COPY_ADOPTED})
# Losing or gaining a disk copy changes where nothing else is.
_COPY_EVENTS: Final = frozenset({BlockEvent.COPY_KEPT, BlockEvent.COPY_DISPLACED,
                                 BlockEvent.COPY_ADOPTED})
# Content leaves the cache only by being dropped, discarded, or failing its prefetch read.
_ENTERS_FREE: Final = frozenset({BlockEvent.DROPPED, BlockEvent.DISCARDED,
                                 BlockEvent.PREFETCH_FAILED, BlockEvent.LOAD_FAILED})
# Serving a host page to an engine moves nothing.
_COPIES_OUT: Final = frozenset({BlockEvent.COPIED_OUT})


def next_state(block: int, state: BlockState, event: BlockEvent) -> BlockState:
    """The state a block moves to when `event` happens in `state`.

    The contracts below are safety properties of the table that CrossHair checks over
    every (state, event) pair: the races of the seed, stated as facts about the table.

    pre: isinstance(state, BlockState) and isinstance(event, BlockEvent)
    raises: IllegalTransition
    post: (state, event) in TRANSITIONS and __return__ == TRANSITIONS[(state, event)]
    post: __return__ is not BlockState.FREE or event in _ENTERS_FREE
    post: state is not BlockState.FREE or event in _LEAVES_FREE
    post: event is not BlockEvent.RESTORED or state is BlockState.FREE
    post: state is not BlockState.ONBOARDING or __return__ in _READ_IN_FLIGHT_EXITS
    post: state is not BlockState.FETCHING or __return__ in _FETCH_IN_FLIGHT_EXITS
    post: __return__ is not BlockState.FETCHING or state in (BlockState.FREE, BlockState.FETCHING)
    post: state is not BlockState.SPILLING or __return__ in _WRITE_IN_FLIGHT_EXITS
    post: state is not BlockState.PREFETCHING or __return__ in _PREFETCH_IN_FLIGHT_EXITS
    post: __return__ is not BlockState.PREFETCHING or state is BlockState.ON_DISK
    post: __return__ is not BlockState.ON_DISK or event in _ENTERS_ON_DISK
    post: __return__ is not BlockState.RELEASED or event in _STAYS_OR_ENTERS_RELEASED
    post: event not in _COPY_EVENTS or state in COPY_STATES
    post: event is not BlockEvent.COPY_DISPLACED or __return__ is state
    post: event is not BlockEvent.COPY_ADOPTED or __return__ is state
    post: event is not BlockEvent.COPY_KEPT or __return__ is BlockState.ON_DISK
    post: state is not BlockState.ERROR or __return__ is BlockState.FREE
    post: state is not BlockState.LOADING or __return__ in _LOAD_IN_FLIGHT_EXITS
    post: __return__ is not BlockState.LOADING or state in (BlockState.ON_DISK, BlockState.LOADING)
    post: event not in _COPIES_OUT or __return__ is state
    post: event is not BlockEvent.SAVED or state is BlockState.FREE
    """
    nxt = TRANSITIONS.get((state, event))
    if nxt is None:
        raise IllegalTransition(block, state.name, event.name)
    return nxt


def allowed_events(state: BlockState) -> frozenset[BlockEvent]:
    """Every event the table allows in `state`."""
    return frozenset(e for (s, e) in TRANSITIONS if s is state)
