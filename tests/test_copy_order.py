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
from statekv.errors import UsageError
from statekv.ids import PageId
from tests.io_helpers import check_pages, compute, small_config

DEVICE = os.environ.get("STATEKV_TEST_DEVICE", "cpu")
"""The GPU machine runs these on CUDA (STATEKV_TEST_DEVICE=cuda)."""


class StreamOfBatches:
    """Events of one in-order stream: batch k completes only after every batch before it."""

    def __init__(self) -> None:
        self.completed = 0

    def done(self, event: int) -> bool:
        return event <= self.completed


def ledger(pages: int = 8) -> tuple[PageCopyLedger[int], StreamOfBatches]:
    stream = StreamOfBatches()
    return PageCopyLedger(pages, stream.done), stream


def test_a_step_waits_for_the_batch_that_filled_its_pages_and_not_for_later_ones() -> None:
    book, _stream = ledger()
    first = book.record([0, 1], event=1)
    book.record([5], event=2)  # a spill out of another page, after the step's batch
    assert first == 1
    assert book.wait_for([1, 2]) == 1
    book.check_invariants()
    # Batch 2 touched none of the step's pages: waiting for batch 1 settled nothing of it.
    assert book.statistics().pending == 1
    assert book.wait_for([0, 1, 2]) is None  # already waited for


def test_a_step_waits_once_for_the_newest_of_its_batches() -> None:
    book, _stream = ledger()
    book.record([0], event=1)
    book.record([3], event=2)
    book.record([1], event=3)
    assert book.wait_for([0, 1]) == 3  # batch 3 runs after 1 on the stream: one wait
    assert book.wait_for([3]) is None  # batch 2 came before 3: covered
    stats = book.statistics()
    assert (stats.waits, stats.waits_skipped, stats.pending) == (1, 1, 0)
    book.check_invariants()


def test_a_spill_out_of_a_page_makes_the_step_that_reuses_it_wait() -> None:
    # GPU -> host out of page 4: the page may have been freed and handed to a request whose
    # step writes into it.
    book, _stream = ledger()
    book.record([4], event=1)
    assert book.wait_for([2, 4]) == 1


def test_completed_batches_need_no_wait_and_leave_the_pending_list() -> None:
    book, stream = ledger()
    for event in range(1, 5):
        book.record([event], event=event)
    stream.completed = 3
    assert book.wait_for([1, 2, 3]) is None
    assert book.statistics().pending == 1
    assert book.wait_for([4]) == 4
    stream.completed = 4
    book.record([0], event=5)  # retires what completed meanwhile
    book.check_invariants()
    assert book.statistics().pending == 1


def test_untouched_pages_never_wait() -> None:
    book, _stream = ledger()
    book.record([0, 1], event=1)
    assert book.wait_for([6, 7]) is None
    assert book.wait_for([]) is None
    assert book.statistics().waits == 0


def test_waiting_for_everything_settles_every_batch() -> None:
    book, _stream = ledger()
    book.record([0], event=1)
    book.record([1], event=2)
    book.settle_all()
    assert book.wait_for([0, 1]) is None
    book.check_invariants()


@pytest.mark.parametrize("pages", [[8], [-1], ["0"]], ids=["past-end", "negative", "not-int"])
def test_a_page_outside_the_pool_is_a_usage_error(pages: list[object]) -> None:
    book, _stream = ledger()
    book.record([0], event=1)
    with pytest.raises(UsageError) as info:
        book.wait_for(pages)  # type: ignore[arg-type]
    assert info.value.field == "pages"


def test_random_histories_wait_for_exactly_the_newest_unsettled_batch_of_the_pages() -> None:
    # Against a direct restatement: the step must wait iff some page's last batch is neither
    # complete nor covered by an earlier wait, and then for the newest such batch.
    rng = random.Random(5)
    for _trial in range(50):
        book, stream = ledger(16)
        last = [0] * 16
        covered = 0
        for seq in range(1, 60):
            touched = rng.sample(range(16), rng.randint(1, 4))
            book.record(touched, event=seq)
            for page in touched:
                last[page] = seq
            if rng.random() < 0.3:
                stream.completed = rng.randint(stream.completed, seq)
            step = rng.sample(range(16), rng.randint(0, 6))
            newest = max((last[p] for p in step), default=0)
            expected = newest if newest > max(covered, stream.completed) else None
            assert book.wait_for(step) == expected
            if expected is not None:
                covered = expected
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
def test_compute_reads_and_writes_of_copied_pages_wait_for_their_copies_only() -> None:
    """A stress: each round queues a long compute job, then (behind it, as the copy stream
    waits for compute) a spill of some pages and a recall into others, then a 'step' that
    reads the recalled pages and overwrites the spilled ones right away on the compute
    stream.  Without the per-page waits the step would run beside the copies and see stale
    bytes or clobber the spill's source."""
    pages = 32
    pools = engine_pools(pages, layers=16)  # 128 KiB pages
    engine = TorchCopyEngine(pools)
    assert engine.statistics().copy_path == "scattered-page kernel", (
        engine.statistics().kernel_refused)
    compute = torch.cuda.current_stream()
    rng = random.Random(3)
    x = torch.randn(1024, 1024, device="cuda")
    for round_ in range(20):
        engine.fence().wait()
        host = fill_pages(pools.host, 300 + round_)
        gpu = fill_pages(pools.gpu, 400 + round_)
        torch.cuda.synchronize()
        for _ in range(8):  # the previous step, still running when the copies are enqueued
            x = x @ x
            x = x / x.norm()
        order = rng.sample(range(pages), pages)
        spilled, recalled = order[:12], order[12:24]
        # Host pages apart: a recall from a page the spill fills would read the spill.
        host_order = rng.sample(range(pages), 24)
        spill_to, recall_from = host_order[:12], host_order[12:]
        engine.copy_pages([(PageId(g), PageId(h)) for g, h in zip(spilled, spill_to,
                                                                 strict=True)], to_gpu=False)
        engine.copy_pages([(PageId(h), PageId(g)) for h, g in zip(recall_from, recalled,
                                                                 strict=True)], to_gpu=True)
        step_pages = [PageId(p) for p in spilled + recalled]
        engine.order_pages_before_compute(step_pages)
        with torch.cuda.stream(compute):
            gpu_bytes = pools.gpu.view(pages, -1).view(torch.uint8)
            read = gpu_bytes[recalled].clone()
            gpu_bytes[spilled] = 0  # the step writes into the pages a spill just emptied
        engine.fence().wait()
        torch.cuda.synchronize()
        assert torch.equal(read.cpu(), host[recall_from]), f"round {round_}: stale recall"
        assert torch.equal(as_bytes(pools.host)[spill_to], gpu[spilled]), (
            f"round {round_}: the step overwrote a page before its spill copied it")
    stats = engine.statistics()
    assert stats.compute_waits >= 1 and stats.kernel_batches >= 40
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
