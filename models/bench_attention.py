"""Time the paged-attention backends on one mixed batch.

Run ``python -m statekv_models.bench_attention [--variants ...] [--decodes N]``.

The batch mixes what a continuous-batching step holds: a fresh prefill, a prefill after a
cached prefix and many decodes.  Timings are of whole forward passes (so they include the
projections every backend shares): wall time (median, minimum) and process CPU time (median)
over interleaved rounds; "metadata" is the per-pass preparation alone (for flex it includes
building the block mask); "1st call" includes compilation for the compiled flex backend.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from .config import preset
from .model import Chunk, PagedDecoder


def _batch(
    vocab: int, block_size: int, decodes: int, *, seed: int
) -> tuple[list[Chunk], int]:
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in torch.randint(0, vocab, (n,), generator=g).tolist()]

    next_page = 0

    def pages(n: int) -> list[int]:
        nonlocal next_page
        out = list(range(next_page, next_page + n))
        next_page += n
        return out

    bs = block_size
    chunks = [
        Chunk(token_ids=tokens(256), start=0, block_table=pages(-(-256 // bs))),
        Chunk(token_ids=tokens(128), start=512, block_table=pages(-(-640 // bs))),
    ]
    for j in range(decodes):
        ctx = 300 + (300 * j) // max(1, decodes - 1)
        chunks.append(Chunk(token_ids=tokens(1), start=ctx - 1, block_table=pages(-(-ctx // bs))))
    return chunks, next_page


def _once(model: PagedDecoder, pool: torch.Tensor, chunks: list[Chunk]) -> tuple[float, float]:
    """Wall and CPU milliseconds of one forward pass."""
    w0, c0 = time.perf_counter(), time.process_time()
    model.forward(pool, chunks)
    return (time.perf_counter() - w0) * 1e3, (time.process_time() - c0) * 1e3


def _prepare_ms(model: PagedDecoder, pool: torch.Tensor, chunks: list[Chunk]) -> float:
    t0 = time.perf_counter()
    model._prepare(pool, chunks)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decodes", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--variants", nargs="+", default=["sdpa", "sdpa-batched"],
        choices=["sdpa", "sdpa-batched", "flex", "flex-compiled"],
        help="run the flex ones apart: their large allocations (eager) and spinning OpenMP "
        "threads (compiled) slow whatever runs next",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = preset("tiny")
    chunks, npages = _batch(config.vocab_size, args.block_size, args.decodes, seed=0)
    print(
        f"tiny model, {torch.get_num_threads()} threads, block size {args.block_size}: "
        f"2 prefill chunks (256 new; 128 new after 512 cached) + {args.decodes} decodes "
        f"(contexts 300-600)"
    )
    variants: list[tuple[str, PagedDecoder]] = []
    for key in args.variants:
        if key == "sdpa":
            variants.append(
                ("gather + SDPA, one call per chunk", PagedDecoder(config, batch_decodes=False))
            )
        elif key == "sdpa-batched":
            variants.append(
                ("gather + SDPA, decodes in one padded call",
                 PagedDecoder(config, batch_decodes=True))
            )
        elif key == "flex":
            variants.append(
                ("packed gather + flex_attention (eager)", PagedDecoder(config, attention="flex"))
            )
        else:
            variants.append(
                ("packed gather + flex_attention (compiled)",
                 PagedDecoder(config, attention="flex-compiled"))
            )
    pools = [model.new_pool(npages, args.block_size) for _, model in variants]
    first = [
        _once(model, pool, chunks)[0] for (_, model), pool in zip(variants, pools, strict=True)
    ]
    for (_, model), pool in zip(variants, pools, strict=True):
        for _ in range(2):
            model.forward(pool, chunks)
    # Rounds interleave the variants so that a noisy neighbour slows them all alike.
    wall: list[list[float]] = [[] for _ in variants]
    cpu: list[list[float]] = [[] for _ in variants]
    prep: list[list[float]] = [[] for _ in variants]
    for _ in range(args.repeats):
        for j, ((_, model), pool) in enumerate(zip(variants, pools, strict=True)):
            w, c = _once(model, pool, chunks)
            wall[j].append(w)
            cpu[j].append(c)
            prep[j].append(_prepare_ms(model, pool, chunks))
    # CPU time is the steadier figure on a shared machine: other processes stretch wall time.
    print(f"  {'variant':44s} {'wall med':>9s} {'wall min':>9s} {'cpu med':>9s} "
          f"{'metadata':>9s} {'1st call':>9s}")
    for j, (name, _) in enumerate(variants):
        print(
            f"  {name:44s} {statistics.median(wall[j]):7.2f}ms {min(wall[j]):7.2f}ms "
            f"{statistics.median(cpu[j]):7.2f}ms {statistics.median(prep[j]):7.2f}ms "
            f"{first[j]:7.0f}ms"
        )

if __name__ == "__main__":
    main()
