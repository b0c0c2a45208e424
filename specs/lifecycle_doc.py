"""Generate ``specs/lifecycle.md`` from the transition table in ``statekv.lifecycle``.

    python -m specs.lifecycle_doc          # rewrite specs/lifecycle.md
    python -m specs.lifecycle_doc --check  # exit 1 if the committed file is stale

The table is the single source of truth; this document is derived from it, and
``tests/test_lifecycle.py`` fails when the committed document and the table disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

from statekv.lifecycle import EVENT_MEANINGS, TRANSITIONS, BlockEvent, BlockState

DOC_PATH = Path(__file__).with_name("lifecycle.md")

INVARIANTS = """\
## Invariants

Checked by `KVCacheManager.check_invariants()` after every step of the fuzz suite.

1. **One state.** Every block record is in exactly one state of the table above; a state
   changes only through an entry of the table, and any other event raises
   `IllegalTransition`.
2. **Storage follows the state.** A block owns a GPU page exactly in ON_GPU, RELEASED,
   ONBOARDING, FETCHING and ERROR; a host page exactly in ON_HOST, SPILLING, PREFETCHING and
   PREFETCHED (and in ONBOARDING when it is a prefetch an admitted request took over); a disk
   slot in SPILLING, ON_DISK, ONBOARDING, PREFETCHING and PREFETCHED always, and in ON_GPU,
   RELEASED and ON_HOST when it keeps a valid disk copy (never in any other state); a
   transfer id
   exactly in SPILLING, ONBOARDING, PREFETCHING and FETCHING.
3. **Nothing is owned twice, nothing is lost.** Every GPU page, host page and disk slot is
   owned by exactly one of: a block, a free list, or a write whose block was recalled to GPU
   while it drained.
4. **A read in flight pins its storage.** An ONBOARDING block keeps its GPU page and its disk
   slot until its read reports back, whoever releases it meanwhile; no free list and no
   displacement order contains it.  A FETCHING block keeps its GPU page the same way until
   its fetch reports.
5. **Holders.** A block's reference count equals the number of live requests holding it;
   ON_GPU blocks have at least one holder, RELEASED blocks none. A request's pending-read
   count equals the number of its blocks in ONBOARDING or FETCHING, and it is ready exactly
   when that count is zero.
6. **Prefix index.** A block has a key exactly when the index maps that key to it. Cached
   states (RELEASED, ON_HOST, SPILLING, ON_DISK) and FETCHING always have a key; FREE and
   ERROR never do.
   Only full blocks are keyed; a partially filled block is private to its request.
7. **Eviction orders.** The GPU evictable order holds exactly the RELEASED blocks, the host
   order exactly the ON_HOST blocks, the disk orders exactly the ON_DISK blocks and the
   blocks with a disk copy (so no slot a read or write is in flight on is displaceable), and
   the
   prefetched order (reclaimed newest first) exactly the PREFETCHED blocks.
8. **Deadlines.** The retention heap holds exactly the ON_DISK blocks and disk copies
   whose TTL is running at
   the manager's current time; best-effort disk content is in the FIFO, never in the heap.
9. **Reserve.** The host reserve never exceeds its target, and no host page is free while the
   reserve is below it (a returning page refills the reserve first).
10. **Prefetch.** A block's queued requests (prefetchers) are exactly the queued requests
    that asked for it and have not been admitted or left; only PREFETCHING and PREFETCHED
    blocks have any, and a PREFETCHED block always has one (the last one leaving sends it
    back to ON_DISK). A queued request is never also an admitted one.
"""

PROSE = """\
## Reading the diagram

Transitions driven by the serving loop: ALLOCATED (a request needs a page for new tokens),
ACQUIRED (a prefix hit on content that is on GPU or already being read), RELEASED /
DISCARDED (the last holder lets go). Transitions driven by memory pressure: OFFLOADED (GPU
victim copied to host), SPILL_STARTED (host victim written to disk), DROPPED (content leaves
the cache). Transitions driven by the actors' completions: SPILL_LANDED, SPILL_FAILED,
READ_LANDED, READ_FAILED. RECALLED is a prefix hit on content in a host page (also while its
spill write drains: the page is intact until the write reports back). RESTORED happens only
when a cache opens on a slot directory an earlier process left: each slot the index rebuild
accepts (specs/disk_persistence.md) takes a free record straight to ON_DISK.

Prefetch (a request waiting for admission asks for its disk blocks ahead of time):
PREFETCH_STARTED issues a disk -> host read into a host page; PREFETCH_LANDED leaves the bytes
in the page *and* on disk (the slot is kept); the admitted request takes a PREFETCHED block
as a host hit (RECALLED, which frees the slot as an onboard would) or, while the read is
still in flight, takes it over as its onboard (PREFETCHING ACQUIRED -> ONBOARDING: no second
read; a host -> GPU copy follows the landing). PREFETCH_CANCELLED returns a PREFETCHED block
to ON_DISK for free, when every queued request that wanted it left or when a GPU victim
needs its host page; PREFETCH_FAILED drops content whose prefetch read failed.

Inclusive disk tier (a full block is immutable, so its slot stays valid when it moves up):
READ_LANDED and the RECALLED of a PREFETCHED block keep the slot as the block's *disk copy*
(ON_GPU, RELEASED or ON_HOST with a slot), filed for displacement as ON_DISK content of its
retention class.  COPY_KEPT: evicting such a block (from host, or from GPU with no host
page) makes it ON_DISK in that slot with no write. COPY_DISPLACED: a spill takes the slot;
the block stays where it is and a later eviction spills it again normally.

The shared tier (specs/remote_tier.md): the remote fetcher looks up the keys past a prompt's
local match (`remote_candidates`) in the cluster and hands those found to `add_request`;
FETCH_STARTED takes a free record and a GPU page for each block of the leading run and issues
a fetch; other requests matching it meanwhile wait on it (FETCHING ACQUIRED); FETCH_LANDED
serves verified bytes; FETCH_FAILED (a key missing, evicted or expired since the lookup, a
corrupt, foreign or unauthenticated value, a master that does not answer) sends the block to
ERROR, and every request holding it recomputes from it. Publishing is not a state: a
`PublishBlock` follows the GPU -> host copy of an admitted offload in the command order, and
the publisher copies the host page right there.

GPU <-> host copies are stream ordered and need no completion; disk reads and writes are
asynchronous, which is why SPILLING, ONBOARDING, PREFETCHING and FETCHING are states of
their own.

## Batches

Disk transfers travel in batches (`WriteSlots`, `ReadSlots`: up to `max_batch_blocks`
records, after every copy and FreeSlot of the same `take_commands()`), and an actor reports a
batch with one `BatchFinished` holding one outcome per record, in the batch's order. A batch
has no state of its own: each block of it took SPILL_STARTED or READ_STARTED when it was
issued and takes SPILL_LANDED / SPILL_FAILED or READ_LANDED / READ_FAILED from its own
outcome, exactly as a lone transfer would. A batch that partly fails therefore publishes the
blocks that landed and fails the others; a release, a recall or a displacement that touches a
block of a batch in flight follows the table for that block alone. `handle()` checks a batch
whole (every transfer in flight, of one kind, named once) before it applies any of it.
"""


def render() -> str:
    lines = [
        "# Block lifecycle",
        "",
        "<!-- Generated by `python -m specs.lifecycle_doc` from statekv/lifecycle.py."
        " Do not edit. -->",
        "",
        "```mermaid",
        "stateDiagram-v2",
        "    [*] --> FREE",
    ]
    for (state, event), nxt in TRANSITIONS.items():
        lines.append(f"    {state.name} --> {nxt.name} : {event.name}")
    lines += ["```", "", "## Transition table", "", "| from | event | to |", "| --- | --- | --- |"]
    for (state, event), nxt in TRANSITIONS.items():
        lines.append(f"| {state.name} | {event.name} | {nxt.name} |")
    lines += ["", "## States", ""]
    for state in BlockState:
        events = sorted(e.name for (s, e) in TRANSITIONS if s is state)
        lines.append(f"- `{state.name}`: leaves or stays on {', '.join(events) or 'nothing'}")
    lines += ["", "## Events", ""]
    for event in BlockEvent:
        sources = sorted(s.name for (s, e) in TRANSITIONS if e is event)
        lines.append(
            f"- `{event.name}` (from {', '.join(sources)}): {EVENT_MEANINGS[event]}"
        )
    lines += ["", PROSE, INVARIANTS]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = DOC_PATH.read_text() if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH} is stale: run python -m specs.lifecycle_doc", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
