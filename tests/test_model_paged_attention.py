"""The paged decoder against a dense reference, and the page-table discipline it relies on."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from models import (
    Chunk,
    ModelConfig,
    PagedDecoder,
    generate_weight,
    greedy,
    preset,
)
from statekv.config import KVLayout
from statekv.errors import ConfigError, UsageError

BS = 16
NUM_BLOCKS = 48
ATOL = 2e-4  # fp32: GEMMs of different row counts may round differently


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return preset("tiny")


@pytest.fixture(scope="module")
def model(config: ModelConfig) -> PagedDecoder:
    return PagedDecoder(config)


@pytest.fixture(scope="module", params=[False, True], ids=["decodes-per-chunk", "decodes-batched"])
def either_model(config: ModelConfig, request: pytest.FixtureRequest) -> PagedDecoder:
    """Both ways of running one-token chunks (the default depends on the device)."""
    return PagedDecoder(config, batch_decodes=request.param)


def tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=g).tolist()]


def nan_pool(model: PagedDecoder) -> torch.Tensor:
    # NaN everywhere a sequence has not written: reading any such slot poisons the output.
    return model.new_pool(NUM_BLOCKS, BS, fill=float("nan"))


def prefill_in_chunks(
    model: PagedDecoder, pool: torch.Tensor, prompt: list[int], table: list[int], sizes: list[int]
) -> torch.Tensor:
    out = []
    start = 0
    for size in sizes:
        step = model.forward(
            pool, [Chunk(token_ids=prompt[start : start + size], start=start, block_table=table)],
            all_logits=True,
        )
        assert step.logits is not None
        out.append(step.logits[0])
        start += size
    assert start == len(prompt)
    return torch.cat(out)


def greedy_decode(
    model: PagedDecoder, pool: torch.Tensor, tables: list[list[int]], first: list[int],
    lengths: list[int], steps: int,
) -> list[list[int]]:
    """Decode several sequences together, one batch per step; returns each one's tokens."""
    out = [[t] for t in first]
    for _ in range(steps):
        chunks = [
            Chunk(token_ids=[seq[-1]], start=n + len(seq) - 1, block_table=table)
            for seq, n, table in zip(out, lengths, tables, strict=True)
        ]
        for seq, t in zip(out, greedy(model.forward(pool, chunks).last_logits), strict=True):
            seq.append(t)
    return out


# ---------------------------------------------------------------------------- correctness


def test_paged_prefill_matches_dense_reference(model: PagedDecoder) -> None:
    prompt = tokens(70, seed=1)
    table = [17, 3, 40, 9, 22]  # scattered, out of order
    step = model.forward(nan_pool(model), [Chunk(token_ids=prompt, start=0, block_table=table)],
                         all_logits=True)
    assert step.logits is not None
    ref = model.reference_logits(prompt)
    torch.testing.assert_close(step.logits[0], ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(step.last_logits[0], ref[-1], atol=ATOL, rtol=0)
    assert ref.std() > 0.5  # the random weights give non-degenerate logits


def test_chunked_prefill_matches_one_shot(model: PagedDecoder) -> None:
    prompt = tokens(83, seed=2)
    table = list(range(10, 16))
    one_shot = prefill_in_chunks(model, nan_pool(model), prompt, table, [83])
    # Boundaries inside and on block edges, and a one-token chunk in the middle.
    chunked = prefill_in_chunks(model, nan_pool(model), prompt, table, [5, 11, 16, 1, 29, 21])
    torch.testing.assert_close(chunked, one_shot, atol=ATOL, rtol=0)
    assert greedy(chunked[-1:]) == greedy(one_shot[-1:])


def test_cached_prefix_in_other_pages_gives_same_logits_and_tokens(
    either_model: PagedDecoder,
) -> None:
    model = either_model
    prompt = tokens(75, seed=3)
    cached_blocks = 3
    pool = nan_pool(model)
    full_table = [0, 1, 2, 3, 4, 5]
    full = model.forward(pool, [Chunk(token_ids=prompt, start=0, block_table=full_table)])

    # The first three full blocks come "from the cache" into different pages.
    reuse_table = [30, 25, 41, 7, 8, 9]
    pool[torch.tensor(reuse_table[:cached_blocks])] = pool[torch.tensor(full_table[:cached_blocks])]
    start = cached_blocks * BS
    reused = model.forward(
        pool, [Chunk(token_ids=prompt[start:], start=start, block_table=reuse_table)]
    )
    torch.testing.assert_close(reused.last_logits, full.last_logits, atol=ATOL, rtol=0)
    first = greedy(full.last_logits)
    assert greedy(reused.last_logits) == first

    # Both sequences decode side by side in one batch: same tokens.
    a, b = greedy_decode(
        model, pool, [full_table, reuse_table], first * 2, [len(prompt)] * 2, steps=12
    )
    assert a == b


def test_mixed_batch_matches_each_chunk_alone(either_model: PagedDecoder) -> None:
    model = either_model
    p1, p2, p3 = tokens(40, seed=4), tokens(33, seed=5), tokens(20, seed=6)
    t1, t2, t3 = [1, 2, 3], [10, 11, 12], [20, 21]
    pool = nan_pool(model)
    model.forward(pool, [Chunk(token_ids=p1[:39], start=0, block_table=t1)])
    model.forward(pool, [Chunk(token_ids=p2[:17], start=0, block_table=t2)])
    batch = [
        Chunk(token_ids=p1[39:], start=39, block_table=t1),       # decode
        Chunk(token_ids=p2[17:], start=17, block_table=t2),       # rest of a prefill
        Chunk(token_ids=p3, start=0, block_table=t3),             # a fresh prefill
    ]
    together = model.forward(pool.clone(), batch).last_logits
    alone = torch.cat([model.forward(pool.clone(), [c]).last_logits for c in batch])
    torch.testing.assert_close(together, alone, atol=ATOL, rtol=0)
    refs = torch.stack([model.reference_logits(p)[-1] for p in (p1, p2, p3)])
    torch.testing.assert_close(together, refs, atol=ATOL, rtol=0)


def test_decode_steps_are_deterministic(either_model: PagedDecoder) -> None:
    model = either_model
    prompt = tokens(37, seed=7)
    runs = []
    for _ in range(2):
        pool = nan_pool(model)
        table = [5, 6, 7, 8]
        first = model.forward(pool, [Chunk(token_ids=prompt, start=0, block_table=table)])
        seqs = greedy_decode(model, pool, [table], greedy(first.last_logits), [37], steps=10)
        runs.append((first.last_logits, seqs, pool))
    assert runs[0][1] == runs[1][1]
    assert torch.equal(runs[0][0], runs[1][0])
    # Positions [0, 47) were written: bit-identical KV (the rest is still NaN).
    for page, upto in ((5, BS), (6, BS), (7, 47 - 2 * BS)):
        assert torch.equal(runs[0][2][page, :, :, :upto], runs[1][2][page, :, :, :upto])


def test_pages_of_other_sequences_are_never_read(either_model: PagedDecoder) -> None:
    model = either_model
    px, py = tokens(45, seed=8), tokens(50, seed=9)
    tx, ty = [4, 5, 6], [30, 31, 32, 33]
    pool = nan_pool(model)
    model.forward(pool, [
        Chunk(token_ids=px, start=0, block_table=tx),
        Chunk(token_ids=py, start=0, block_table=ty),
    ])
    clean = pool.clone()
    # Poison every page but X's: Y's written pages included.
    others = torch.tensor([p for p in range(NUM_BLOCKS) if p not in tx])
    pool[others] = float("nan")
    step = model.forward(pool, [Chunk(token_ids=[7], start=45, block_table=tx)])
    ref = model.forward(clean, [Chunk(token_ids=[7], start=45, block_table=tx)])
    assert torch.isfinite(step.last_logits).all()
    assert torch.equal(step.last_logits, ref.last_logits)
    # Decodes of different context lengths, padded together when batched, stay finite too.
    pool[torch.tensor(ty)] = clean[torch.tensor(ty)]
    batch = [Chunk(token_ids=[1], start=46, block_table=tx),
             Chunk(token_ids=[2], start=50, block_table=ty)]
    assert torch.isfinite(model.forward(pool, batch).last_logits).all()


def test_attention_never_runs_with_cudnn_enabled(
    either_model: PagedDecoder, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # cuDNN's SDPA compiles an execution plan for each new shape, and a serving loop's shapes
    # are new every step: the forward pass must keep it out, for prefill and decode calls.
    seen: list[bool] = []
    real = PagedDecoder._sdpa_attend

    def spy(self: PagedDecoder, *args: Any) -> torch.Tensor:
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())  # type: ignore[no-untyped-call]
        return real(self, *args)

    monkeypatch.setattr(PagedDecoder, "_sdpa_attend", spy)
    model = either_model
    pool = nan_pool(model)
    prompts = [tokens(40, seed=20), tokens(21, seed=21)]
    tables = [[0, 1, 2], [5, 6]]
    step = model.forward(pool, [Chunk(token_ids=p, start=0, block_table=t)
                                for p, t in zip(prompts, tables, strict=True)])
    greedy_decode(model, pool, tables, greedy(step.last_logits), [40, 21], steps=2)
    assert seen and not any(seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels are CUDA's")
@pytest.mark.parametrize("batch_decodes", [False, True],
                         ids=["decodes-per-chunk", "decodes-batched"])
def test_attention_runs_on_fused_kernels_alone_on_cuda(
    batch_decodes: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With only flash and memory-efficient attention allowed, SDPA raises where a call would
    # need the math fallback, which repeats each KV head over its query group and the whole
    # context: the serving loop's decode steps ran at twice their time that way.  A GQA
    # shape (8 query heads per KV head), bf16, prefill from scratch, a chunk after a cached
    # prefix, and a batch of decodes of different lengths.
    from torch.nn.attention import SDPBackend

    import models.model as model_module

    monkeypatch.setattr(model_module, "_ATTENTION_BACKENDS",
                        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    model = PagedDecoder(preset("8b-class", num_layers=1, vocab_size=512), device="cuda",
                         batch_decodes=batch_decodes)
    pool = model.new_pool(NUM_BLOCKS, BS, fill=float("nan"))
    prompts = [tokens(40, seed=30), tokens(29, seed=31)]
    tables = [[0, 1, 2], [5, 6, 7]]
    model.forward(pool, [Chunk(token_ids=p[:24], start=0, block_table=t)
                         for p, t in zip(prompts, tables, strict=True)])
    step = model.forward(pool, [Chunk(token_ids=p[24:], start=24, block_table=t)
                                for p, t in zip(prompts, tables, strict=True)])
    seqs = greedy_decode(model, pool, tables, greedy(step.last_logits), [40, 29], steps=3)
    # The last decode's logits against the dense reference of the whole sequence.
    chunks = [Chunk(token_ids=[seq[-1]], start=len(p) + len(seq) - 1, block_table=t)
              for p, seq, t in zip(prompts, seqs, tables, strict=True)]
    last = model.forward(pool, chunks).last_logits
    for row, (p, seq) in enumerate(zip(prompts, seqs, strict=True)):
        ref = model.reference_logits(p + seq)[-1]
        assert torch.isfinite(last[row]).all()
        assert (last[row].float() - ref.float()).abs().max() < 0.1 * ref.float().abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device ordering is CUDA's")
@pytest.mark.parametrize("batch_decodes", [False, True],
                         ids=["decodes-per-chunk", "decodes-batched"])
def test_a_forward_pass_is_queued_behind_busy_streams_without_waiting_for_them(
    batch_decodes: bool,
) -> None:
    # The cache orders each forward pass after its page copies, so the compute stream is
    # often still busy when a step begins.  Queuing a pass must not wait for that work: a
    # copy of the pass's indices from pageable memory did, and the serving thread stalled
    # behind other requests' transfers.  A long sleep kernel stands for that work; the pass
    # must be queued while the sleep still runs, then give the same logits as on an idle
    # stream.
    model = PagedDecoder(preset("tiny"), device="cuda", batch_decodes=batch_decodes)
    pool = model.new_pool(NUM_BLOCKS, BS, fill=0.0)
    prompts = [tokens(40, seed=40), tokens(29, seed=41)]
    tables = [[0, 1, 2], [5, 6, 7]]
    model.forward(pool, [Chunk(token_ids=p, start=0, block_table=t)
                         for p, t in zip(prompts, tables, strict=True)])
    decodes = [Chunk(token_ids=[7], start=len(p), block_table=t)
               for p, t in zip(prompts, tables, strict=True)]
    prefill = [Chunk(token_ids=prompts[0][:24], start=0, block_table=[9, 10])]
    for chunks in (decodes, prefill):
        # On an idle stream first (which also builds whatever the shape needs once).
        idle = model.forward(pool, chunks).last_logits.clone()
        torch.cuda.synchronize()
        sleep_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        # About a second of GPU time.
        torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]
        sleep_done.record()
        step = model.forward(pool, chunks)
        waited = sleep_done.query()  # type: ignore[no-untyped-call]
        assert not waited, "the forward pass waited for queued GPU work"
        torch.cuda.synchronize()
        # The same pass (it rewrites the same KV rows with the same values).
        torch.testing.assert_close(step.last_logits, idle, atol=1e-5, rtol=0)


def test_flex_backend_matches_dense_reference(config: ModelConfig) -> None:
    flex = PagedDecoder(config, attention="flex")
    p1, p2 = tokens(40, seed=10), tokens(20, seed=11)
    pool = nan_pool(flex)
    flex.forward(pool, [Chunk(token_ids=p1[:24], start=0, block_table=[3, 4, 5])])
    step = flex.forward(pool, [
        Chunk(token_ids=p1[24:], start=24, block_table=[3, 4, 5]),
        Chunk(token_ids=p2, start=0, block_table=[9, 10]),
    ], all_logits=True)
    assert step.logits is not None
    torch.testing.assert_close(step.logits[0], flex.reference_logits(p1)[24:], atol=ATOL, rtol=0)
    torch.testing.assert_close(step.logits[1], flex.reference_logits(p2), atol=ATOL, rtol=0)


def test_bfloat16_model_stays_close_to_its_reference() -> None:
    model = PagedDecoder(preset("tiny", dtype="bfloat16"))
    prompt = tokens(50, seed=12)
    step = model.forward(nan_pool(model),
                         [Chunk(token_ids=prompt, start=0, block_table=[1, 2, 3, 4])])
    ref = model.reference_logits(prompt)[-1:]
    assert torch.isfinite(step.last_logits).all()
    assert (step.last_logits - ref).abs().max() < 0.1 * ref.abs().max()


def _thread_all_reduce(size: int) -> list[Callable[[torch.Tensor], None]]:
    barrier = threading.Barrier(size)
    parts: list[torch.Tensor | None] = [None] * size

    def for_rank(rank: int) -> Callable[[torch.Tensor], None]:
        def all_reduce(x: torch.Tensor) -> None:
            parts[rank] = x.clone()
            barrier.wait()
            total = torch.stack([p for p in parts if p is not None]).sum(0)  # rank order
            barrier.wait()
            x.copy_(total)

        return all_reduce

    return [for_rank(r) for r in range(size)]


def test_tensor_parallel_ranks_reproduce_the_whole_model(
    config: ModelConfig, model: PagedDecoder
) -> None:
    prompt = tokens(30, seed=13)
    reducers = _thread_all_reduce(2)
    ranks = [
        PagedDecoder(config, tp_rank=r, tp_size=2, all_reduce=reducers[r]) for r in range(2)
    ]
    assert ranks[0].pool_shape(4, BS)[4] == config.num_kv_heads // 2
    results: list[torch.Tensor | None] = [None, None]

    def run(rank: int) -> None:
        pool = ranks[rank].new_pool(4, BS)
        step = ranks[rank].forward(pool, [Chunk(token_ids=prompt, start=0, block_table=[0, 1])])
        results[rank] = step.last_logits

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    whole = model.forward(model.new_pool(4, BS),
                          [Chunk(token_ids=prompt, start=0, block_table=[0, 1])]).last_logits
    for r in results:
        assert r is not None
        torch.testing.assert_close(r, whole, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------- weights, config


def test_weights_are_a_function_of_seed_and_index_only() -> None:
    kw = {"std": 0.5, "dtype": torch.float32, "device": torch.device("cpu")}
    full = generate_weight(7, "w", (12, 10), **kw)  # type: ignore[arg-type]
    part = generate_weight(7, "w", (12, 10), rows=(3, 9), cols=(2, 7), **kw)  # type: ignore[arg-type]
    assert torch.equal(part, full[3:9, 2:7])
    assert not torch.equal(full, generate_weight(8, "w", (12, 10), **kw))  # type: ignore[arg-type]
    bound = 0.5 * 3**0.5
    assert full.abs().max() <= bound
    big = generate_weight(7, "big", (256, 256), **kw)  # type: ignore[arg-type]
    assert abs(big.std().item() - 0.5) < 0.02 and abs(big.mean().item()) < 0.02


def test_weight_generator_is_pinned() -> None:
    # If this fails, the weights a seed names changed: bump WEIGHTS_VERSION, or KV persisted
    # on disk for the old weights would be served for the new ones.
    w = generate_weight(0, "embed", (2, 3), std=1.0, dtype=torch.float32,
                        device=torch.device("cpu"))
    assert [round(x, 6) for x in w.flatten().tolist()] == PINNED_WEIGHTS
    assert preset("tiny").fingerprint() == PINNED_TINY_FINGERPRINT


PINNED_WEIGHTS = [0.660653, -0.435369, -1.194292, -0.499851, -0.658578, 0.950209]
PINNED_TINY_FINGERPRINT = "statekv-decoder-v1-e514eeacc334b67673fa180b6917827b"


def test_models_from_one_config_are_identical(config: ModelConfig) -> None:
    a, b = PagedDecoder(config), PagedDecoder(config)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    other = PagedDecoder(preset("tiny", seed=1))
    assert not torch.equal(a.embed, other.embed)


def test_fingerprint_names_the_weights(config: ModelConfig) -> None:
    assert config.fingerprint() == preset("tiny").fingerprint()
    assert config.fingerprint() != preset("tiny", seed=1).fingerprint()
    assert config.fingerprint() != preset("tiny", num_layers=3).fingerprint()
    # 500000 and 500000.0 are the same weights.
    base: dict[str, Any] = {"vocab_size": 8, "hidden": 8, "ffn": 8, "num_layers": 1, "num_heads": 2,
            "num_kv_heads": 1, "head_dim": 4}
    assert (ModelConfig(rope_theta=500000, **base).fingerprint()
            == ModelConfig(rope_theta=500000.0, **base).fingerprint())


def test_kv_layout_matches_the_pool_and_splits_across_ranks(
    config: ModelConfig, model: PagedDecoder
) -> None:
    layout = config.kv_layout()
    assert layout == KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    page = model.new_pool(2, BS)[0]
    assert page.is_contiguous()
    assert page.numel() * page.element_size() == layout.block_bytes(BS)
    assert config.kv_layout(tp_size=2).num_kv_heads == 1
    big = preset("70b-class", num_layers=2)
    assert big.kv_layout(8).num_kv_heads == 1
    assert big.kv_bytes_per_token() == 2 * 2 * 8 * 128 * 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"dtype": "int8"}, "dtype"),
        ({"hidden": 0}, "hidden"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"rms_eps": -1.0}, "rms_eps"),
        ({"seed": -1}, "seed"),
        ({"vocab_size": True}, "vocab_size"),
    ],
)
def test_bad_model_config_names_the_field(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"vocab_size": 8, "hidden": 8, "ffn": 8, "num_layers": 1,
                               "num_heads": 4, "num_kv_heads": 2, "head_dim": 4}
    base.update(kwargs)
    with pytest.raises(ConfigError) as info:
        ModelConfig(**base)  # type: ignore[arg-type]
    assert info.value.field == field


def test_bad_presets_and_splits_name_the_field(config: ModelConfig) -> None:
    with pytest.raises(ConfigError) as info:
        preset("7b")
    assert info.value.field == "name"
    with pytest.raises(ConfigError) as info:
        config.kv_layout(tp_size=3)
    assert info.value.field == "tp_size"
    with pytest.raises(ConfigError) as info:
        PagedDecoder(config, tp_rank=2, tp_size=2, all_reduce=lambda x: None)
    assert info.value.field == "tp_rank"
    with pytest.raises(ConfigError) as info:
        PagedDecoder(config, tp_size=2)  # no all_reduce, no torch.distributed
    assert info.value.field == "tp_size"
    with pytest.raises(ConfigError) as info:
        PagedDecoder(config, attention="paged")  # type: ignore[arg-type]
    assert info.value.field == "attention"


# ---------------------------------------------------------------------------- bad batches


@pytest.mark.parametrize(
    ("chunks", "field"),
    [
        ([Chunk(token_ids=[1, 512], start=0, block_table=[0])], "chunks[0].token_ids"),
        ([Chunk(token_ids=[1, -1], start=0, block_table=[0])], "chunks[0].token_ids"),
        ([Chunk(token_ids=[1.5], start=0, block_table=[0])], "chunks[0].token_ids"),  # type: ignore[list-item]
        ([Chunk(token_ids=[], start=0, block_table=[0])], "chunks[0].token_ids"),
        ([Chunk(token_ids=[1], start=-1, block_table=[0])], "chunks[0].start"),
        ([Chunk(token_ids=[1] * 17, start=0, block_table=[0])], "chunks[0].block_table"),
        ([Chunk(token_ids=[1], start=0, block_table=[NUM_BLOCKS])], "chunks[0].block_table"),
        ([Chunk(token_ids=[1], start=16, block_table=[3, 3])], "chunks[0].block_table"),
        (
            [Chunk(token_ids=[1], start=0, block_table=[0]),
             Chunk(token_ids=[2], start=16, block_table=[5, 0])],
            "chunks[0].block_table",  # chunk 0 writes page 0, which chunk 1 reads
        ),
        ([], "chunks"),
    ],
)
def test_bad_chunks_name_the_field(
    model: PagedDecoder, chunks: list[Chunk], field: str
) -> None:
    pool = model.new_pool(NUM_BLOCKS, BS)
    before = pool.clone()
    with pytest.raises(UsageError) as info:
        model.forward(pool, chunks)
    assert info.value.field == field
    assert torch.equal(pool, before)  # nothing written


def test_shared_prefix_pages_may_be_read_by_several_chunks(model: PagedDecoder) -> None:
    prompt = tokens(40, seed=14)
    pool = nan_pool(model)
    model.forward(pool, [Chunk(token_ids=prompt[:32], start=0, block_table=[0, 1])])
    step = model.forward(pool, [
        Chunk(token_ids=prompt[32:], start=32, block_table=[0, 1, 2]),
        Chunk(token_ids=prompt[32:], start=32, block_table=[0, 1, 3]),
    ])
    assert torch.equal(step.last_logits[0], step.last_logits[1])


@pytest.mark.parametrize(
    "pool",
    [
        torch.zeros(4, 2, 2, BS, 2, 8),             # wrong head_dim
        torch.zeros(4, 2, 2, BS, 2, 16, dtype=torch.bfloat16),
        torch.zeros(4, 2, 2, BS, 2, 32)[..., :16],   # not contiguous
    ],
)
def test_bad_pool_is_refused(model: PagedDecoder, pool: torch.Tensor) -> None:
    with pytest.raises(UsageError) as info:
        model.forward(pool, [Chunk(token_ids=[1], start=0, block_table=[0])])
    assert info.value.field == "pool"
