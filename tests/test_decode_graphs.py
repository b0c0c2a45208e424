"""Decode-only passes as CUDA graph replays: padded to a bucket, the same logits and the same
pool bytes as the ordinary pass.

On the CPU machine the padded pass runs eagerly (``capture=False``): what is checked there is
the padding's arithmetic, which is what a graph replays; the CUDA tests check the graphs."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from models import Chunk, PagedDecoder, greedy, preset
from models.decode_graphs import (
    MIN_WIDTH_STEP,
    DecodeGraphs,
    bucket_batch,
    bucket_width,
)
from statekv.errors import ConfigError

BS = 16
NUM_BLOCKS = 64
ATOL = 2e-4  # fp32: GEMMs of different row counts may round differently

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are CUDA's")


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 512, (n,), generator=g).tolist()]


def padded_eager(model: PagedDecoder, **kwargs: int) -> DecodeGraphs:
    """The model's decode-only passes through the padded path, run eagerly."""
    graphs = DecodeGraphs(model._decode_body, device=model.device, capture=False, **kwargs)
    model._decode_graphs = graphs
    return graphs


def prefilled(model: PagedDecoder, lengths: list[int], seed: int = 0
              ) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """A NaN pool with one prompt of each length prefilled into its own scattered pages."""
    pool = model.new_pool(NUM_BLOCKS, BS, fill=float("nan"))
    prompts = [tokens(n, seed=seed + i) for i, n in enumerate(lengths)]
    tables, page = [], NUM_BLOCKS - 1
    for n in lengths:
        need = -(-(n + 8) // BS)  # room for a few decodes
        tables.append(list(range(page, page - need, -1)))
        page -= need
    model.forward(pool, [Chunk(token_ids=p, start=0, block_table=t)
                         for p, t in zip(prompts, tables, strict=True)])
    return pool, prompts, tables


def decodes(prompts: list[list[int]], tables: list[list[int]], new: list[int],
            done: int = 0) -> list[Chunk]:
    return [Chunk(token_ids=[t], start=len(p) + done, block_table=table)
            for p, table, t in zip(prompts, tables, new, strict=True)]


# ---------------------------------------------------------------------------- buckets


@given(st.integers(1, 1 << 16))
def test_a_context_bucket_holds_the_context_with_at_most_a_quarter_more(width: int) -> None:
    span = bucket_width(width)
    assert width <= span
    assert span % MIN_WIDTH_STEP == 0
    assert span <= width * 5 // 4 or span - width < MIN_WIDTH_STEP
    # Widths of one bucket share its graph: rounding is idempotent.
    assert bucket_width(span) == span


@given(st.integers(1, 1 << 12))
def test_a_batch_bucket_is_the_next_power_of_two(n: int) -> None:
    size = bucket_batch(n)
    assert size & (size - 1) == 0 and n <= size < 2 * n


# ---------------------------------------------------------------------------- padded pass


@pytest.mark.parametrize("lengths", [[20], [20, 37, 50], [33, 17, 64, 9, 45]],
                         ids=["one", "three-of-four", "five-of-eight"])
def test_the_padded_decode_pass_gives_the_ordinary_logits_and_pool_bytes(
    lengths: list[int],
) -> None:
    plain = PagedDecoder(preset("tiny"), batch_decodes=True)
    padded = PagedDecoder(preset("tiny"), batch_decodes=True)
    graphs = padded_eager(padded)
    pool, prompts, tables = prefilled(plain, lengths)
    pool_padded = pool.clone()
    new = [7 + i for i in range(len(lengths))]
    for step in range(3):
        chunks = decodes(prompts, tables, new, done=step)
        want = plain.forward(pool, chunks).last_logits
        got = padded.forward(pool_padded, chunks).last_logits
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        # Padding decodes wrote nothing: every byte of the pool, NaNs included, is the
        # ordinary pass's (up to the rounding of the real rows' own K/V).
        torch.testing.assert_close(pool_padded, pool, atol=ATOL, rtol=0, equal_nan=True)
        assert torch.equal(pool_padded.isnan(), pool.isnan())
        # Every row of the padded pass is finite, the padding decodes' dropped logits too:
        # padding reads only rows the model wrote, never the pool's stale (NaN) bytes.
        assert all(torch.isfinite(entry.output).all() for entry in graphs._graphs.values())
        new = greedy(want)
    assert graphs.statistics().replayed == 3
    assert graphs.statistics().eager == 0


def test_padding_writes_back_the_parking_rows_bytes_exactly() -> None:
    # Three decodes in a bucket of four: the padding decode's K/V write lands on a row the
    # batch only reads.  Every byte outside the three real write rows must be unchanged,
    # bit for bit.
    model = PagedDecoder(preset("tiny"), batch_decodes=True)
    padded_eager(model)
    pool, prompts, tables = prefilled(model, [20, 37, 50])
    before = pool.clone()
    model.forward(pool, decodes(prompts, tables, [1, 2, 3]))
    written = torch.zeros(pool.shape[0], pool.shape[3], dtype=torch.bool)
    for p, table in zip(prompts, tables, strict=True):
        written[table[len(p) // BS], len(p) % BS] = True
    keep = ~written[:, None, None, :, None, None].expand_as(pool)
    assert torch.equal(pool[keep].isnan(), before[keep].isnan())
    assert torch.equal(pool[keep].nan_to_num(), before[keep].nan_to_num())
    assert torch.isfinite(pool[~keep]).all()


def test_the_parking_row_skips_a_decode_with_no_earlier_position() -> None:
    # The first decode is a one-token prompt (position 0: its write is the only row it
    # reads), the second has a context: padding parks on the second's position 0.
    plain = PagedDecoder(preset("tiny"), batch_decodes=True)
    padded = PagedDecoder(preset("tiny"), batch_decodes=True)
    graphs = padded_eager(padded)
    pool, _prompts, tables = prefilled(plain, [30])
    pool_padded = pool.clone()
    chunks = [Chunk(token_ids=[5], start=0, block_table=[0]),
              Chunk(token_ids=[9], start=30, block_table=tables[0])]
    want = plain.forward(pool, chunks).last_logits
    got = padded.forward(pool_padded, chunks).last_logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(pool_padded, pool, atol=ATOL, rtol=0, equal_nan=True)
    assert graphs.statistics().replayed == 1


def test_one_token_prompts_alone_run_the_ordinary_pass() -> None:
    # No decode reads a row it does not write: nowhere to park padding writes.
    model = PagedDecoder(preset("tiny"), batch_decodes=True)
    graphs = padded_eager(model)
    pool = model.new_pool(NUM_BLOCKS, BS, fill=float("nan"))
    out = model.forward(pool, [Chunk(token_ids=[5], start=0, block_table=[0]),
                               Chunk(token_ids=[6], start=0, block_table=[1])])
    assert torch.isfinite(out.last_logits).all()
    stats = graphs.statistics()
    assert (stats.replayed, stats.eager) == (0, 1)


def test_prefills_and_all_logits_take_the_ordinary_pass() -> None:
    model = PagedDecoder(preset("tiny"), batch_decodes=True)
    graphs = padded_eager(model)
    pool, prompts, tables = prefilled(model, [20, 37])
    model.forward(pool, decodes(prompts, tables, [1, 2]), all_logits=True)
    mixed = [Chunk(token_ids=[1], start=21, block_table=tables[0]),
             Chunk(token_ids=[4, 5], start=38, block_table=tables[1])]
    model.forward(pool, mixed)
    stats = graphs.statistics()
    assert (stats.replayed, stats.eager) == (0, 0)


def test_more_decodes_than_the_largest_bucket_run_the_ordinary_pass() -> None:
    model = PagedDecoder(preset("tiny"), batch_decodes=True)
    graphs = padded_eager(model, max_batch=2)
    pool, prompts, tables = prefilled(model, [20, 21, 22])
    model.forward(pool, decodes(prompts, tables, [1, 2, 3]))
    assert graphs.statistics().eager == 1


def test_the_least_recently_used_graph_makes_room() -> None:
    model = PagedDecoder(preset("tiny"), batch_decodes=True)
    graphs = padded_eager(model, max_graphs=2)
    pool, prompts, tables = prefilled(model, [20, 37, 50])
    model.forward(pool, decodes(prompts[:1], tables[:1], [1]))    # (1, 32)
    model.forward(pool, decodes(prompts[:2], tables[:2], [1, 2]))  # (2, 48)
    model.forward(pool, decodes(prompts[:1], tables[:1], [1]))    # (1, 32) again
    model.forward(pool, decodes(prompts, tables, [1, 2, 3]))      # (4, 64): drops (2, 48)
    stats = graphs.statistics()
    assert (stats.replayed, stats.dropped, stats.kept) == (4, 1, 2)


def test_cuda_graphs_are_refused_where_they_cannot_run() -> None:
    with pytest.raises(ConfigError, match="cuda_graphs: decode graphs need attention='sdpa'"):
        PagedDecoder(preset("tiny"), attention="flex", cuda_graphs=True)
    with pytest.raises(ConfigError, match=r"cuda_graphs: decode graphs need .* batched"):
        PagedDecoder(preset("tiny"), batch_decodes=False, cuda_graphs=True)
    with pytest.raises(ConfigError, match="cuda_graphs: CUDA graphs need a CUDA device"):
        PagedDecoder(preset("tiny"), batch_decodes=True, cuda_graphs=True)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        PagedDecoder(preset("tiny"), cuda_graphs=1)  # type: ignore[arg-type]
    assert PagedDecoder(preset("tiny")).decode_graph_statistics() is None
    with pytest.raises(ConfigError, match="cuda_graphs"):
        PagedDecoder(preset("tiny"), cuda_graphs=None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- on CUDA


def cuda_pair(layers: int | None = None) -> tuple[PagedDecoder, PagedDecoder]:
    """A model replaying graphs and one running the same padded pass eagerly."""
    config = preset("8b-class", num_layers=2, vocab_size=512) if layers else preset("tiny")
    graphed = PagedDecoder(config, device="cuda", cuda_graphs=True)
    eager = PagedDecoder(config, device="cuda", batch_decodes=True)
    padded_eager(eager)
    return graphed, eager


def written_rows(pool: torch.Tensor, chunks: list[Chunk]) -> torch.Tensor:
    """[pages, block_size]: the positions the chunks' new tokens write."""
    mask = torch.zeros(pool.shape[0], pool.shape[3], dtype=torch.bool)
    for chunk in chunks:
        mask[chunk.block_table[chunk.start // BS], chunk.start % BS] = True
    return mask


@cuda
@pytest.mark.parametrize("layers", [None, 2], ids=["tiny", "8b-class-2-layers"])
def test_a_graph_replays_the_padded_pass(layers: int | None) -> None:
    # The same kernels on the same inputs; cuBLAS may pick another algorithm inside a
    # capture, so the logits are compared within rounding, not bit for bit.  What padding
    # must never do -- write a row that no real decode writes -- is checked bit for bit.
    graphed, eager = cuda_pair(layers)
    assert graphed.decode_graph_statistics() is not None
    pool, prompts, tables = prefilled(eager, [20, 37, 50, 9, 61])
    pool_graphed = pool.clone()
    new = [3, 4, 5, 6, 7]
    for step in range(6):  # contexts cross a bucket edge (64) on the way
        chunks = decodes(prompts, tables, new, done=step)
        before = pool_graphed.clone()
        want = eager.forward(pool, chunks).last_logits
        got = graphed.forward(pool_graphed, chunks).last_logits
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert (got - want).abs().max() <= 1e-4 + 0.02 * want.abs().max()
        keep = ~written_rows(pool, chunks)[:, None, None, :, None, None].expand_as(pool)
        keep = keep.to(pool.device)
        assert torch.equal(pool_graphed[keep].isnan(), before[keep].isnan())
        assert torch.equal(pool_graphed[keep].nan_to_num(), before[keep].nan_to_num())
        assert torch.isfinite(pool_graphed[~keep]).all()
        new = greedy(want)
    stats = graphed.decode_graph_statistics()
    assert stats is not None
    assert stats.replayed == 6 and stats.captured == 2 and stats.eager == 0


@cuda
def test_graph_logits_match_the_unpadded_pass_and_the_reference() -> None:
    graphed = PagedDecoder(preset("tiny"), device="cuda", cuda_graphs=True)
    plain = PagedDecoder(preset("tiny"), device="cuda")
    pool, prompts, tables = prefilled(plain, [20, 37, 50])
    pool_graphed = pool.clone()
    new = [3, 4, 5]
    seqs = [[t] for t in new]
    for step in range(4):
        chunks = decodes(prompts, tables, new, done=step)
        want = plain.forward(pool, chunks).last_logits
        got = graphed.forward(pool_graphed, chunks).last_logits
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        new = greedy(want)
        for seq, t in zip(seqs, new, strict=True):
            seq.append(t)
    for row, (p, seq) in enumerate(zip(prompts, seqs, strict=True)):
        ref = graphed.reference_logits(p + seq[:-1])[-1]
        torch.testing.assert_close(got[row], ref, atol=ATOL, rtol=0)


@cuda
def test_a_replays_logits_are_not_overwritten_by_the_next_replay() -> None:
    graphed, _ = cuda_pair()
    pool, prompts, tables = prefilled(graphed, [20, 37])
    first = graphed.forward(pool, decodes(prompts, tables, [1, 2])).last_logits
    kept = first.clone()
    graphed.forward(pool, decodes(prompts, tables, [3, 4], done=1))
    assert torch.equal(first, kept)


@cuda
def test_capture_goes_on_while_other_threads_copy_and_wait_on_their_streams() -> None:
    # The cache's threads enqueue page copies on their own streams and wait on events while
    # the serving thread captures: a global capture mode would fail on their calls.
    graphed, eager = cuda_pair()
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(1 << 20, pin_memory=True)
    stop = threading.Event()
    errors: list[BaseException] = []

    def copier() -> None:
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        try:
            while not stop.is_set():
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    host.copy_(dst, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                event.record(stream)
                event.synchronize()
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=copier)
    thread.start()
    try:
        pool, prompts, tables = prefilled(eager, [20, 37, 50])
        pool_graphed = pool.clone()
        for lengths in ([1], [1, 2], [1, 2, 3]):
            n = len(lengths)
            chunks = decodes(prompts[:n], tables[:n], lengths)
            want = eager.forward(pool, chunks).last_logits
            got = graphed.forward(pool_graphed, chunks).last_logits
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    finally:
        stop.set()
        thread.join()
    assert not errors
    stats = graphed.decode_graph_statistics()
    assert stats is not None and stats.captured == 3


@cuda
def test_a_replay_is_queued_behind_busy_streams_without_waiting_for_them() -> None:
    # As the ordinary pass (test_model_paged_attention): the cache orders each pass after
    # its page copies, so the compute stream is often busy when a step begins; queuing a
    # replay, its inputs' upload included, must not wait for that work.
    graphed, _ = cuda_pair()
    pool, prompts, tables = prefilled(graphed, [20, 37, 50])
    chunks = decodes(prompts, tables, [1, 2, 3])
    idle = graphed.forward(pool, chunks).last_logits  # captures
    torch.cuda.synchronize()
    sleep_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # about a second
    sleep_done.record()
    step = graphed.forward(pool, chunks)
    assert not sleep_done.query(), "the replay waited for queued GPU work"  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    # The same step again: it rewrites the same KV rows with the same values.
    assert torch.equal(step.last_logits, idle)
    stats = graphed.decode_graph_statistics()
    assert stats is not None and (stats.captured, stats.replayed) == (1, 2)
