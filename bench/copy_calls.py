"""An admission's page copies through the copy engine, each way it can run them, against a
plain pinned H2D copy of the same bytes in the same run.

    python -m bench.copy_calls [--block-kib 128] [--pages 512] [--batch-pages 64] [--write]

The shape is the one an admission into a full GPU makes (issue 25's pressure-3 knee): each
recalled block's GPU page is first evicted to host, and the next eviction lands in the host
page the recall before it just read (the spill reserve hands it straight back), so the
copies alternate direction at every page and each reads a page an earlier one wrote --
`--batch-pages` recalls (twice as many copies) a dispatch, pages shuffled so that no two
merge into one copy.  Ways, on the same pools:

* calls   one engine call per run of one direction (what the scheduler did before copy_runs);
* engine  the whole dispatch as one ``copy_runs`` call, the engine's own choice;
* dma     one call, one DMA per run (``gather_kernel=False``; CUDA with cupy only);
* passes  one call as its stash and moves kernels (``gather_kernel=True``; likewise);
* batched the same passes, each one call of the driver's batched memcpy on the copy engines
          (``batch_dma=True``; where the driver has it: CUDA 12.8 and later).

Each way: the rate (both directions' bytes over the wall time until the copies are done,
best of --repeat passes after an untimed one) against one pinned H2D copy of the same bytes,
and the serving thread's time inside the engine's calls per copy, against the "calls" way's
in the same run.  On a CPU device the copies are synchronous memcpy and the limit a host
memcpy: the figures there check the bench, not the GPU's launch costs.
"""

from __future__ import annotations

import datetime as dt
import random
import sys
import time
from collections.abc import Sequence

import torch

from bench.flags import OneLineParser, device_name, int_at_least, results_tag
from bench.io import host_to_device_limit
from bench.results_files import machine_name, source_commit, write_new_results
from io_actors.embed import resolve_device
from io_actors.memory.pools import KVPools, TorchCopyEngine
from io_actors.storage.interfaces import CopyRun
from statekv.config import CacheConfig, KVLayout
from statekv.errors import ConfigError
from statekv.ids import PageId

BLOCK_SIZE = 16


def admission_runs(pages: int, batch: int, seed: int) -> list[list[CopyRun]]:
    """The dispatches of admissions into a full GPU of `pages` pages, `batch` recalls each:
    per recall, the GPU page's block out to a host page (the host page the previous recall
    read, or a free one for the first), then a host block in.  Host pages: 2 x `pages`."""
    rng = random.Random(seed)
    gpu = list(range(pages))
    rng.shuffle(gpu)
    sources = list(range(pages, 2 * pages))  # host pages holding the blocks recalled
    rng.shuffle(sources)
    free = list(range(pages))  # host pages free for the first eviction of each dispatch
    calls: list[list[CopyRun]] = []
    for first in range(0, pages, batch):
        runs: list[CopyRun] = []
        into = PageId(free[first])
        for k in range(first, min(first + batch, pages)):
            page, source = PageId(gpu[k]), PageId(sources[k])
            runs.append((False, [(page, into)]))
            runs.append((True, [(source, page)]))
            into = source
        calls.append(runs)
    return calls


def _pass(engine: TorchCopyEngine, calls: Sequence[Sequence[CopyRun]], per_run: bool
          ) -> tuple[float, float]:
    """(wall seconds until every copy is done, seconds inside the engine's calls)."""
    start = time.perf_counter()
    inside = 0.0
    for runs in calls:
        entered = time.perf_counter()
        if per_run:
            for to_gpu, pairs in runs:
                engine.copy_pages(pairs, to_gpu=to_gpu)
        else:
            engine.copy_runs(runs)
        inside += time.perf_counter() - entered
    engine.fence().wait()
    return time.perf_counter() - start, inside


def measure(block_kib: int, pages: int, batch: int, repeat: int, device: str
            ) -> tuple[dict[str, tuple[float, float]], float, int]:
    """Per way (rate GB/s, enqueue us per copy), the H2D limit in GB/s, and the page bytes."""
    dev = resolve_device(device)
    head_dim = 64
    elements = block_kib * 1024 // 4  # float32
    per_head = 2 * BLOCK_SIZE * head_dim
    layout = KVLayout(num_layers=max(1, elements // (per_head * 4)), num_kv_heads=4,
                      head_dim=head_dim, dtype="float32")
    pools = KVPools(CacheConfig(block_size=BLOCK_SIZE, gpu_blocks=pages,
                                host_blocks=2 * pages, layout=layout), dev)
    nbytes = pools.block_nbytes
    pools.gpu.view(torch.uint8).fill_(1)
    pools.host.view(torch.uint8).fill_(2)
    engines: dict[str, tuple[TorchCopyEngine, bool]] = {}
    engines["calls"] = (TorchCopyEngine(pools), True)
    engines["engine"] = (TorchCopyEngine(pools), False)
    if engines["engine"][0].gather_kernel_available:
        engines["dma"] = (TorchCopyEngine(pools, gather_kernel=False), False)
        engines["passes"] = (TorchCopyEngine(pools, gather_kernel=True), False)
        try:
            engines["batched"] = (TorchCopyEngine(pools, gather_kernel=True, batch_dma=True),
                                  False)
        except ConfigError as exc:
            print(f"no batched way: {exc}")
    calls = admission_runs(pages, batch, seed=0)
    copies = 2 * pages
    best: dict[str, tuple[float, float]] = {way: (float("inf"), float("inf"))
                                            for way in engines}
    for rep in range(repeat + 1):
        # Interleaved, the order turned each pass: no way always runs on a warmer device.
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for way in order:
            engine, per_run = engines[way]
            wall, inside = _pass(engine, calls, per_run)
            if rep:  # the first pass compiles the kernels
                best[way] = (min(best[way][0], wall), min(best[way][1], inside))
    limit = host_to_device_limit(copies * nbytes, dev)
    return ({way: (copies * nbytes / wall / 1e9, inside / copies * 1e6)
             for way, (wall, inside) in best.items()}, limit, nbytes)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.copy_calls",
                           description=__doc__.split("\n\n")[0])
    n1 = int_at_least(1)
    parser.add_argument("--block-kib", type=n1, default=128,
                        help="bytes of one page (one block's KV), in KiB")
    parser.add_argument("--pages", type=n1, default=512, help="recalls in all")
    parser.add_argument("--batch-pages", type=n1, default=64, help="recalls a dispatch")
    parser.add_argument("--repeat", type=n1, default=5)
    parser.add_argument("--device", type=device_name, default="auto")
    parser.add_argument("--machine", default=None,
                        help="the results file's machine name (default: from the device)")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--tag", type=results_tag, default=None)
    args = parser.parse_args(argv)
    if args.block_kib * 1024 % (2 * BLOCK_SIZE * 64 * 4 * 4):
        parser.error(f"--block-kib: {args.block_kib} KiB is not a whole number of layers "
                     f"of {2 * BLOCK_SIZE * 64 * 4 * 4 // 1024} KiB")
    ways, limit, nbytes = measure(args.block_kib, args.pages, args.batch_pages, args.repeat,
                                  args.device)
    device = resolve_device(args.device)
    machine = args.machine or machine_name(device)
    limit_name = "pinned H2D copy" if device.type == "cuda" else "host memcpy"
    print(f"{machine}: {args.pages} recalls into evicted pages, {args.batch_pages} a "
          f"dispatch, pages of {nbytes // 1024} KiB; limit {limit:.2f} GB/s ({limit_name})")
    base = ways["calls"][1]
    figures: dict[str, dict[str, object]] = {}
    for way, (rate, enqueue) in ways.items():
        print(f"  {way:7s} {rate:7.2f} GB/s = {rate / limit:5.2f}x   enqueue "
              f"{enqueue:7.2f} us a copy = {enqueue / base:5.2f}x of one call a run")
        figures[f"exchange_{way}"] = {
            "value": round(rate, 3), "unit": "GB/s", "limit": round(limit, 3),
            "limit_name": f"{limit_name}, same run", "ratio": round(rate / limit, 3)}
        figures[f"exchange_{way}_enqueue"] = {
            "value": round(enqueue, 3), "unit": "us a copy", "limit": round(base, 3),
            "limit_name": "one engine call a run, same run", "ratio": round(enqueue / base, 3)}
    if args.write:
        today = dt.date.today()
        out = write_new_results("copy_calls", machine, today, {
            "bench": "copy_calls", "machine": machine, "date": today.isoformat(),
            "commit": source_commit(),
            "command": "python -m bench.copy_calls " + " ".join(sys.argv[1:] if argv is None
                                                                else argv),
            "page_bytes": nbytes, "figures": figures,
        }, tag=args.tag)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
