"""A call's page copies as a stash pass and a moves pass (io_actors.memory.copy_passes).

Pages hold labels: the passes, applied pass by pass with each pass's copies in any order,
must leave every page as the copies applied one at a time would, and each host page's
checksum must be read from a page holding its final label.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from io_actors.memory.copy_passes import GPU, HOST, SCRATCH, CopyPasses, Page, plan_passes

GPU_PAGES = 5
HOST_PAGES = 5

_copy = st.one_of(
    st.tuples(st.tuples(st.just(GPU), st.integers(0, GPU_PAGES - 1)),
              st.tuples(st.just(HOST), st.integers(0, HOST_PAGES - 1))),
    st.tuples(st.tuples(st.just(HOST), st.integers(0, HOST_PAGES - 1)),
              st.tuples(st.just(GPU), st.integers(0, GPU_PAGES - 1))),
)


def _start() -> dict[Page, str]:
    return {**{(GPU, g): f"g{g}" for g in range(GPU_PAGES)},
            **{(HOST, h): f"h{h}" for h in range(HOST_PAGES)}}


def _one_at_a_time(copies: list[tuple[Page, Page]]) -> dict[Page, str]:
    pages = _start()
    for src, dst in copies:
        pages[dst] = pages[src]
    return pages


def _run(segments: list[CopyPasses], shuffle: random.Random) -> dict[Page, str]:
    """The passes as a kernel would run them: within a pass, in no defined order (here a
    shuffled one), each copy reading what the page held before the pass."""
    pages = _start()
    for seg in segments:
        stash = list(seg.stash)
        shuffle.shuffle(stash)
        for src, slot in stash:
            pages[(SCRATCH, slot)] = pages[src]
        for holder, host in seg.checksums:
            assert holder[0] in (GPU, SCRATCH)  # the checksum kernel reads device pages
            pages[("sum", host)] = pages[holder]  # type: ignore[index]
        before = dict(pages)
        moves = list(seg.moves)
        shuffle.shuffle(moves)
        for src, dst in moves:
            assert pages[src] == before[src]  # no move reads a page a move wrote
            pages[dst] = pages[src]
    return pages


@settings(max_examples=400, deadline=None)
@given(copies=st.lists(_copy, max_size=24), scratch=st.integers(0, 6),
       seed=st.integers(0, 2**16))
def test_the_passes_leave_every_page_as_the_copies_one_at_a_time(
    copies: list[tuple[Page, Page]], scratch: int, seed: int,
) -> None:
    segments = plan_passes(copies, scratch)
    expected = _one_at_a_time(copies)
    got = _run(segments, random.Random(seed))
    assert {p: v for p, v in got.items() if p[0] in (GPU, HOST)} == expected
    assert sum(seg.copies for seg in segments) == len(copies)
    for seg in segments:
        assert len(seg.stash) <= scratch or seg.copies == 1
        assert len({slot for _p, slot in seg.stash}) == len(seg.stash)
        assert [slot for _p, slot in seg.stash] == list(range(len(seg.stash)))
        destinations = [dst for _src, dst in seg.moves]
        assert len(set(destinations)) == len(destinations)
        assert not {src for src, _dst in seg.moves} & set(destinations)


@settings(max_examples=400, deadline=None)
@given(copies=st.lists(_copy, max_size=24), scratch=st.integers(0, 6))
def test_every_host_page_filled_gets_the_checksum_of_its_final_bytes(
    copies: list[tuple[Page, Page]], scratch: int,
) -> None:
    segments = plan_passes(copies, scratch)
    got = _run(segments, random.Random(0))
    expected = _one_at_a_time(copies)
    filled = {dst[1] for _src, dst in copies if dst[0] == HOST}
    # The last segment to fill a host page sets its checksum (stream order).
    assert {host for seg in segments for _h, host in seg.checksums} == filled
    for host in filled:
        assert got[("sum", host)] == expected[(HOST, host)]  # type: ignore[index]


def test_an_admission_alternating_evictions_and_recalls_is_one_stash_and_one_move_pass(
) -> None:
    # Evict g0 to h0, recall h1 into g0, evict g1 into h1 (the page the recall just read),
    # recall h2 into g1: the chain of an admission into a full GPU.
    copies = [((GPU, 0), (HOST, 0)), ((HOST, 1), (GPU, 0)),
              ((GPU, 1), (HOST, 1)), ((HOST, 2), (GPU, 1))]
    [seg] = plan_passes(copies, 8)
    assert seg.stash == (((GPU, 0), 0), ((HOST, 1), 1), ((GPU, 1), 2))
    assert seg.moves == (((SCRATCH, 0), (HOST, 0)), ((SCRATCH, 1), (GPU, 0)),
                         ((SCRATCH, 2), (HOST, 1)), ((HOST, 2), (GPU, 1)))
    assert seg.checksums == (((SCRATCH, 0), 0), ((SCRATCH, 2), 1))


def test_copies_without_a_hazard_need_no_scratch() -> None:
    copies = [((GPU, 0), (HOST, 0)), ((GPU, 1), (HOST, 1)), ((HOST, 2), (GPU, 2))]
    [seg] = plan_passes(copies, 0)
    assert seg.stash == ()
    assert seg.moves == tuple((src, dst) for src, dst in copies)


def test_a_page_copied_away_and_back_is_not_moved_but_still_checksummed() -> None:
    # h0 -> g0 -> h0: h0 ends with its own bytes; its checksum is read from a stashed copy.
    [seg] = plan_passes([((HOST, 0), (GPU, 0)), ((GPU, 0), (HOST, 0))], 4)
    assert seg.moves == (((SCRATCH, 0), (GPU, 0)),)
    assert seg.checksums == (((SCRATCH, 0), 0),)


def test_a_stash_larger_than_the_scratch_splits_the_call_in_order() -> None:
    copies = [((GPU, 0), (HOST, 0)), ((HOST, 1), (GPU, 0)),
              ((GPU, 1), (HOST, 1)), ((HOST, 2), (GPU, 1))]
    segments = plan_passes(copies, 1)
    assert [seg.copies for seg in segments] == [2, 2]
    assert all(len(seg.stash) <= 1 for seg in segments)
    with pytest.raises(ValueError, match="scratch_pages"):
        plan_passes(copies, -1)
