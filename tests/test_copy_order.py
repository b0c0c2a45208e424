"""Which copy batches a step waits for (PageCopyLedger), and scattered page copies.

The ledger's bookkeeping runs on any machine: its events here complete when the test says
so, in record order, the way batches complete on one CUDA stream.  The byte tests run on the
CPU and, with STATEKV_TEST_DEVICE=cuda, through the scattered-page kernel on the GPU, where
a stress overlaps copies with compute-stream reads and writes of the same pages.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from io_actors.embed import BlockingCache
from io_actors.memory.copy_order import PageCopyLedger
from io_actors.memory.pools import KVPools, TorchCopyEngine
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError, UsageError
from statekv.ids import PageId
from tests.io_helpers import check_pages, compute, small_config

DEVICE = os.environ.get("STATEKV_TEST_DEVICE", "cpu")
"""The GPU machine runs these on CUDA (STATEKV_TEST_DEVICE=cuda)."""


class Lanes:
    """Events of a few in-order streams: each event is (lane, n), and lane L's batch n
    completes only after that lane's earlier batches."""

    def __init__(self, lanes: int = 1) -> None:
        self.completed = [0] * lanes
        self.count = [0] * lanes

    def next(self, lane: int = 0) -> tuple[int, int]:
        self.count[lane] += 1
        return (lane, self.count[lane])

    def done(self, event: tuple[int, int]) -> bool:
        lane, n = event
        return n <= self.completed[lane]

    def finish(self, lane: int, upto: int | None = None) -> None:
        self.completed[lane] = self.count[lane] if upto is None else upto


def ledger(pages: int = 8, lanes: int = 1) -> tuple[PageCopyLedger[tuple[int, int]], Lanes]:
    streams = Lanes(lanes)
    return PageCopyLedger(pages, streams.done, host_pages=pages, lanes=lanes), streams


def test_a_step_waits_for_the_batch_that_filled_its_pages_and_not_for_later_ones() -> None:
    book, lanes = ledger()
    first = lanes.next()
    assert book.record(0, [0, 1], [3], first) == 1
    book.record(0, [5], [4], lanes.next())  # a spill out of another page, after the step's
    assert book.wait_for([1, 2]) == [first]
    book.check_invariants()
    # Batch 2 touched none of the step's pages: waiting for batch 1 covered nothing of it.
    assert book.statistics().pending == 2
    assert book.wait_for([0, 1, 2]) == []  # already waited for


def test_a_step_waits_once_per_lane_for_the_newest_of_its_batches() -> None:
    book, lanes = ledger()
    book.record(0, [0], [], lanes.next())
    book.record(0, [3], [], lanes.next())
    third = lanes.next()
    book.record(0, [1], [], third)
    assert book.wait_for([0, 1]) == [third]  # batch 3 runs after 1 on its lane: one wait
    assert book.wait_for([3]) == []  # batch 2 came before 3 on the lane: covered
    stats = book.statistics()
    assert (stats.waits, stats.waits_skipped) == (1, 1)
    book.check_invariants()


def test_a_spill_on_another_lane_never_delays_a_step_that_does_not_touch_its_pages() -> None:
    book, lanes = ledger(lanes=2)
    book.record(0, [4, 5, 6], [0, 1, 2], lanes.next(0))  # a big spill on lane 0
    recall = lanes.next(1)
    book.record(1, [1], [7], recall)  # the step's recall on lane 1
    assert book.wait_for([1, 2]) == [recall]
    assert book.idlest_lane() in (0, 1)


def test_a_spill_out_of_a_page_makes_the_step_that_reuses_it_wait() -> None:
    # GPU -> host out of page 4: the page may have been freed and handed to a request whose
    # step writes into it.
    book, lanes = ledger()
    spill = lanes.next()
    book.record(0, [4], [0], spill)
    assert book.wait_for([2, 4]) == [spill]


def test_a_step_on_pages_of_two_lanes_waits_for_both() -> None:
    book, lanes = ledger(lanes=3)
    a, b = lanes.next(0), lanes.next(2)
    book.record(0, [1], [], a)
    book.record(2, [2], [], b)
    book.record(1, [7], [], lanes.next(1))
    assert book.wait_for([1, 2, 3]) == [a, b]


@pytest.mark.parametrize(("second_gpu", "second_host"), [([3], [6]), ([5], [2])],
                         ids=["shares-gpu-page", "shares-host-page"])
def test_a_batch_on_another_lane_waits_for_the_last_batch_on_each_shared_page(
    second_gpu: list[int], second_host: list[int],
) -> None:
    """A shared GPU page: spilled then recalled into, or recalled into then spilled.  A
    shared host page: spilled into then recalled from, or recalled from then spilled into."""
    book, lanes = ledger(lanes=2)
    first = lanes.next(0)
    book.record(0, [3], [2], first)
    assert book.lane_waits_for(1, second_gpu, second_host) == [first]
    second = lanes.next(1)
    book.record(1, second_gpu, second_host, second)
    # And back: lane 0 touching those pages again waits for lane 1's batch.
    assert book.lane_waits_for(0, [3], [2]) == [second]
    assert book.statistics().lane_waits == 2
    book.check_invariants()


def test_a_batch_sharing_no_page_waits_for_no_other_lane() -> None:
    book, lanes = ledger(lanes=2)
    book.record(0, [0, 1], [0, 1], lanes.next(0))
    assert book.lane_waits_for(1, [2], [3]) == []
    assert book.lane_waits_for(0, [0], [0]) == []  # its own lane: in order already


def test_completed_batches_need_no_wait_and_leave_the_pending_list() -> None:
    book, lanes = ledger()
    events = [lanes.next() for _ in range(4)]
    for page, event in enumerate(events):
        book.record(0, [page], [], event)
    lanes.finish(0, upto=3)
    assert book.wait_for([0, 1, 2]) == []
    assert book.statistics().pending == 1
    assert book.wait_for([3]) == [events[3]]
    lanes.finish(0)
    book.record(0, [5], [], lanes.next())  # retires what completed meanwhile
    book.check_invariants()
    assert book.statistics().pending == 1


def test_the_idlest_lane_takes_the_next_batch() -> None:
    book, lanes = ledger(lanes=3)
    book.record(0, [0], [], lanes.next(0))
    book.record(1, [1], [], lanes.next(1))
    assert book.idlest_lane() == 2
    lanes.finish(0)
    assert book.idlest_lane() == 0


def test_untouched_pages_never_wait() -> None:
    book, lanes = ledger()
    book.record(0, [0, 1], [], lanes.next())
    assert book.wait_for([6, 7]) == []
    assert book.wait_for([]) == []
    assert book.statistics().waits == 0


def test_waiting_for_everything_settles_every_batch() -> None:
    book, lanes = ledger(lanes=2)
    book.record(0, [0], [], lanes.next(0))
    book.record(1, [1], [], lanes.next(1))
    book.settle_all()
    assert book.wait_for([0, 1]) == []
    book.check_invariants()


@pytest.mark.parametrize("pages", [[8], [-1], ["0"]], ids=["past-end", "negative", "not-int"])
@pytest.mark.parametrize("pending", [True, False], ids=["in-flight", "idle"])
def test_a_page_outside_the_pool_is_a_usage_error(pages: list[object], pending: bool) -> None:
    book, lanes = ledger()
    book.record(0, [0], [], lanes.next())
    if not pending:
        lanes.finish(0)
    with pytest.raises(UsageError) as info:
        book.wait_for(pages)  # type: ignore[arg-type]
    assert info.value.field == "pages"


def test_random_histories_wait_for_exactly_the_newest_uncovered_batch_per_lane() -> None:
    """Against a direct restatement: per lane, the step (or a lane) must wait for the newest
    batch among its pages' last batches that is neither complete nor already waited for."""
    rng = random.Random(5)
    for _trial in range(40):
        lanes_n = rng.randint(1, 3)
        book, lanes = ledger(16, lanes_n)
        last_gpu = [(0, 0)] * 16  # (lane, n) of each page's last batch; n 0: none
        last_host = [(0, 0)] * 16
        waited = {c: [0] * lanes_n for c in range(-1, lanes_n)}

        def expected(consumer: int, lasts: list[tuple[int, int]], lanes: Lanes = lanes,
                     waited: dict[int, list[int]] = waited) -> dict[int, int]:
            need: dict[int, int] = {}
            for lane, n in lasts:
                if n == 0 or lane == consumer or n <= max(lanes.completed[lane],
                                                          waited[consumer][lane]):
                    continue
                need[lane] = max(need.get(lane, 0), n)
            return need

        for _step in range(60):
            lane = rng.randrange(lanes_n)
            gpu = rng.sample(range(16), rng.randint(1, 4))
            host = rng.sample(range(16), rng.randint(0, 4))
            need = expected(lane, [last_gpu[p] for p in gpu] + [last_host[p] for p in host])
            got = book.lane_waits_for(lane, gpu, host)
            assert got == [(other, n) for other, n in sorted(need.items())]
            for other, n in need.items():
                waited[lane][other] = n
            event = lanes.next(lane)
            book.record(lane, gpu, host, event)
            for p in gpu:
                last_gpu[p] = event
            for p in host:
                last_host[p] = event
            if rng.random() < 0.3:
                done = rng.randrange(lanes_n)
                lanes.finish(done, rng.randint(lanes.completed[done], lanes.count[done]))
            step = rng.sample(range(16), rng.randint(0, 6))
            need = expected(-1, [last_gpu[p] for p in step])
            assert book.wait_for(step) == [(other, n) for other, n in sorted(need.items())]
            for other, n in need.items():
                waited[-1][other] = n
            book.check_invariants()


# --- bytes through the copy engine ------------------------------------------------------------


def engine_pools(pages: int, *, layers: int = 4) -> KVPools:
    # 16 tokens x 2 heads x 64 x bf16 x 2 (K, V) = 8 KiB per layer.
    layout = KVLayout(num_layers=layers, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    return KVPools(CacheConfig(block_size=16, gpu_blocks=pages, host_blocks=pages,
                               layout=layout), DEVICE)


def fill_pages(pool: torch.Tensor, seed: int) -> torch.Tensor:
    """Random bytes into every page of `pool`; returns them (on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (pool.shape[0], pool[0].numel() * pool.element_size()),
                         dtype=torch.uint8, generator=gen)
    pool.view(pool.shape[0], -1).view(torch.uint8).copy_(data)
    return data


def as_bytes(pool: torch.Tensor) -> torch.Tensor:
    return pool.view(pool.shape[0], -1).view(torch.uint8).cpu()


def test_random_scattered_page_sets_land_byte_for_byte_in_both_directions() -> None:
    pages = 24
    pools = engine_pools(pages)
    engine = TorchCopyEngine(pools)
    if DEVICE == "cuda":
        stats = engine.statistics()
        assert stats.copy_path == "scattered-page kernel", (
            f"the scattered-page kernel is not in use: {stats.kernel_refused}")
    rng = random.Random(11)
    for trial in range(12):
        host = fill_pages(pools.host, 100 + trial)
        gpu = fill_pages(pools.gpu, 200 + trial)
        engine.fence().wait()
        count = rng.randint(1, pages)
        sources = rng.sample(range(pages), count)
        targets = rng.sample(range(pages), count)
        engine.copy_pages([(PageId(s), PageId(t)) for s, t in zip(sources, targets,
                                                                  strict=True)], to_gpu=True)
        engine.fence().wait()
        landed = as_bytes(pools.gpu)
        expected = gpu.clone()
        for s, t in zip(sources, targets, strict=True):
            expected[t] = host[s]
        assert torch.equal(landed, expected), f"trial {trial}: host -> GPU"
        gpu = landed
        sources = rng.sample(range(pages), count)
        targets = rng.sample(range(pages), count)
        engine.copy_pages([(PageId(s), PageId(t)) for s, t in zip(sources, targets,
                                                                  strict=True)], to_gpu=False)
        engine.fence().wait()
        expected = host.clone()
        for s, t in zip(sources, targets, strict=True):
            expected[t] = gpu[s]
        assert torch.equal(as_bytes(pools.host), expected), f"trial {trial}: GPU -> host"
    if DEVICE == "cuda":
        assert engine.statistics().kernel_batches > 0


def test_a_step_taking_untouched_pages_issues_no_wait() -> None:
    pools = engine_pools(8)
    engine = TorchCopyEngine(pools)
    engine.copy_pages([(PageId(0), PageId(1)), (PageId(3), PageId(5))], to_gpu=False)
    before = engine.statistics()
    engine.order_pages_before_compute([PageId(2), PageId(4)])
    after = engine.statistics()
    assert after.compute_waits == before.compute_waits
    if DEVICE == "cuda":
        assert after.compute_waits_skipped == before.compute_waits_skipped + 1
    engine.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lanes", [1, 4])
def test_compute_reads_and_writes_of_copied_pages_wait_for_their_copies_only(
    lanes: int,
) -> None:
    """A stress: each round queues a long compute job (the previous step, still running),
    then behind it (each lane waits for compute) a spill of pages A, a recall into pages B,
    a recall of what the spill just wrote back into the pages A themselves (in another
    order: a host page read after the spill wrote it, a GPU page written after the spill
    read it -- on another lane when there are several), and a spill of pages E; then a
    'step' that reads A and B and overwrites E right away on the compute stream.  Without
    the per-page waits the step would run beside the copies, and without the waits between
    lanes the copies would run beside each other: stale or clobbered bytes."""
    pages = 32
    pools = engine_pools(pages, layers=16)  # 128 KiB pages
    engine = TorchCopyEngine(pools, lanes=lanes)
    assert engine.statistics().copy_path == "scattered-page kernel", (
        engine.statistics().kernel_refused)
    compute = torch.cuda.current_stream()
    rng = random.Random(3)
    # Long enough (milliseconds) that every lane is still waiting for it when the round's
    # last batch is enqueued: the batches' cross-lane waits are then certain to be needed.
    x = torch.randn(4096, 4096, device="cuda")
    for round_ in range(20):
        engine.fence().wait()
        host = fill_pages(pools.host, 300 + round_)
        gpu = fill_pages(pools.gpu, 400 + round_)
        torch.cuda.synchronize()
        for _ in range(8):
            x = x @ x
            x = x / x.norm()
        order = rng.sample(range(pages), pages)
        a, b, e = order[:8], order[8:16], order[16:24]
        host_order = rng.sample(range(pages), 24)
        h1, h2, h3 = host_order[:8], host_order[8:16], host_order[16:]
        back = rng.sample(a, 8)  # host page h1[i] comes back into GPU page back[i]

        def batch(pairs: list[tuple[int, int]], *, to_gpu: bool) -> None:
            engine.copy_pages([(PageId(s), PageId(d)) for s, d in pairs], to_gpu=to_gpu)

        batch(list(zip(a, h1, strict=True)), to_gpu=False)
        batch(list(zip(h2, b, strict=True)), to_gpu=True)
        batch(list(zip(h1, back, strict=True)), to_gpu=True)
        batch(list(zip(e, h3, strict=True)), to_gpu=False)
        engine.order_pages_before_compute([PageId(p) for p in a + b + e])
        with torch.cuda.stream(compute):
            gpu_bytes = pools.gpu.view(pages, -1).view(torch.uint8)
            read_b = gpu_bytes[b].clone()
            read_back = gpu_bytes[back].clone()
            gpu_bytes[e] = 0  # the step writes into the pages a spill just emptied
        engine.fence().wait()
        torch.cuda.synchronize()
        assert torch.equal(read_b.cpu(), host[h2]), f"round {round_}: stale recall"
        assert torch.equal(read_back.cpu(), gpu[a]), (
            f"round {round_}: a page recalled from a spill's host page is not the spill's")
        landed = as_bytes(pools.host)
        assert torch.equal(landed[h1], gpu[a]), f"round {round_}: spill of A"
        assert torch.equal(landed[h3], gpu[e]), (
            f"round {round_}: the step overwrote a page before its spill copied it")
    stats = engine.statistics()
    assert stats.compute_waits >= 1 and stats.kernel_batches >= 80
    assert stats.lanes == lanes
    if lanes > 1:
        assert stats.lane_waits >= 1
    engine.check_invariants()


def test_each_block_table_orders_the_compute_stream_once_and_recalled_pages_hold_their_kv(
    tmp_path: Path,
) -> None:
    """Through the cache: r1's blocks go to host when r2 takes their GPU pages (a spill out
    of pages r2 then writes), and come back when r1's prompt returns (a recall into pages
    the next step reads); every block table taken asks the copy engine once."""
    with BlockingCache(small_config(tmp_path, disk=0, host=4, reserved_host=0)) as cache:
        bs = cache.config.block_size
        first = list(range(2 * bs + 1))
        cache.add_request("r1", first)
        compute(cache, "r1", first)
        cache.release("r1")
        second = list(range(1000, 1000 + 7 * bs + 1))  # every GPU page
        cache.add_request("r2", second)

        def asked() -> int:
            copies = cache.statistics().copies
            assert copies is not None
            return copies.compute_waits + copies.compute_waits_skipped

        before = asked()
        compute(cache, "r2", second)  # takes r2's block table once
        assert asked() == before + 1
        cache.release("r2")
        assert cache.statistics().cache.hit_tokens_host == 0
        match = cache.add_request("r1b", first)
        assert match.host_tokens == 2 * bs, match
        check_pages(cache, "r1b", first, blocks=2)
        copies = cache.statistics().copies
        assert copies is not None and copies.batches >= 2
        if DEVICE == "cuda":
            assert copies.copy_path == "scattered-page kernel", copies.kernel_refused


@pytest.mark.parametrize("lanes", [0, 17, True, 2.0])
def test_a_bad_lane_count_is_a_config_error(lanes: object) -> None:
    with pytest.raises(ConfigError) as info:
        TorchCopyEngine(engine_pools(4), lanes=lanes)  # type: ignore[arg-type]
    assert info.value.field == "lanes"
