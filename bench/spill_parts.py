"""Where a spill's span goes: bench.io's timed spill, taken apart.

    python -m bench.spill_parts [--block-mib 0.25] [--blocks 2048] [--device cuda] [--runs 3]

Each run opens a fresh cache of bench.io's transfer shape, pushes req1 to host and times
req3's arrival until every spill landed (bench.io's spill phase), then writes the same pages
through the slot store alone in the same batches.  It prints how long req3's call took (the
core's evictions, the copies enqueued), when the first disk write started, the rate over
the writes' own span, and the writers' time in their jobs against their time in the store's
``write_many``: the spill's gap to the store alone splits into the start (before the first
write) and the writes themselves.  A diagnostic: it wraps SlotWriter.execute and
PosixSlotStore.write_many to time them, and writes no results file.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import io as bench_io
from bench.flags import (
    OneLineParser,
    device_name,
    existing_directory,
    int_at_least,
    positive_number,
)
from io_actors.actors import writer_pool
from io_actors.embed import BlockingCache
from io_actors.storage import posix

Span = tuple[str, float, float]
"""(what, start, end) of one timed call, perf_counter seconds."""


class Spans:
    """The timed calls of every thread, from `watch` until `restore`."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._restore: list[Callable[[], None]] = []

    def watch(self, owner: Any, name: str, what: str) -> None:
        real = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                end = time.perf_counter()
                with self._lock:
                    self.spans.append((what, start, end))

        setattr(owner, name, timed)
        self._restore.append(lambda: setattr(owner, name, real))

    def restore(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()

    def of(self, what: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s[0] == what]

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()


def _total(spans: Sequence[Span]) -> float:
    return sum(end - start for _what, start, end in spans)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.spill_parts",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-mib", type=positive_number, default=0.25)
    parser.add_argument("--blocks", type=int_at_least(1), default=2048)
    parser.add_argument("--threads", type=int_at_least(1), default=4)
    parser.add_argument("--batch-blocks", type=int_at_least(1), default=16)
    parser.add_argument("--device", type=device_name, default="auto")
    parser.add_argument("--runs", type=int_at_least(1), default=3)
    parser.add_argument("--dir", type=existing_directory, default=None,
                        help="where the data files go (a temporary directory in it)")
    args = parser.parse_args(argv)
    shape = argparse.Namespace(
        blocks=args.blocks, block_mib=args.block_mib, block_size=16, threads=args.threads,
        device=args.device, backend="posix", batch_blocks=args.batch_blocks,
        compute_waits="all")
    spans = Spans()
    spans.watch(writer_pool.SlotWriter, "execute", "job")
    spans.watch(posix.PosixSlotStore, "write_many", "write_many")
    try:
        with tempfile.TemporaryDirectory(prefix="statekv-spill-parts-",
                                         dir=args.dir) as tmp:
            for run in range(args.runs):
                _one_run(args, shape, Path(tmp) / f"run{run}", spans, run)
    finally:
        spans.restore()
    return 0


def _one_run(args: argparse.Namespace, shape: argparse.Namespace, directory: Path,
             spans: Spans, run: int) -> None:
    config = bench_io._transfer_config(shape, directory)
    gb = args.blocks * config.block_bytes / 1e9
    with BlockingCache(config) as cache:
        bench_io._fill(cache, "req1", 0, args.blocks, ttl=3600.0)
        bench_io._fill(cache, "req2", 10_000_000, 2 * args.blocks)
        spans.clear()
        start = time.perf_counter()
        bench_io._fill(cache, "req3", 20_000_000, args.blocks, write_bytes=False)
        called = time.perf_counter()
        bench_io._wait(lambda: cache.statistics().cache.writes_in_flight == 0)
        end = time.perf_counter()
    jobs, writes = spans.of("job"), spans.of("write_many")
    first = min(s[1] for s in writes)
    last = max(s[2] for s in writes)
    span, written = end - start, last - first
    print(f"spill {run}: {gb / span:.2f} GB/s over {span * 1e3:.1f} ms; req3's call "
          f"{(called - start) * 1e3:.1f} ms; first write at {(first - start) * 1e3:.1f} ms; "
          f"the writes' span {written * 1e3:.1f} ms = {gb / written:.2f} GB/s; writers in jobs "
          f"{_total(jobs) / (args.threads * span):.2f} of the span, "
          f"{_total(jobs) / (args.threads * written):.2f} of the writes' span; "
          f"write_many {_total(writes) / len(writes) * 1e3:.2f} ms a batch of "
          f"{len(writes)}", flush=True)
    spans.clear()
    rates = bench_io.store_write_rates(bench_io._transfer_config(shape, directory / "store"),
                                       args.blocks)
    alone = spans.of("write_many")
    print(f"  store alone, same batches: fresh slots {rates['store_fresh_gb_per_s']:.2f}, "
          f"over them again {rates['store_consecutive_gb_per_s']:.2f} GB/s; write_many "
          f"{_total(alone) / len(alone) * 1e3:.2f} ms a batch", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
