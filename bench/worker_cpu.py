"""The interpreter time the cache's disk workers spend per block, against the disk's own
time per block in the same run.

    python -m bench.worker_cpu [--block-kib 256] [--blocks 1024] [--batch 16] [--repeat 5]
                               [--dir /tmp] [--machine cpu] [--write [--tag TAG]]

Why: every profile of the busy serving step and of the spill on a GPU machine (BENCHMARKS.md)
found the writer, reader and serving threads taking turns at one interpreter lock.  What a
worker does per block in Python is time no other thread of the process can run Python, so
it is measured here on its own, where the CPU machine measures it as well as a GPU one.

One slot store (posix backend, O_DIRECT where the filesystem allows) in a scratch
directory, one thread, `--blocks` slots in batches of `--batch`, each pass after one
untimed pass (so every slot was written once: the steady state of a tier that overwrites):

* **raw write**: the system calls a spill batch makes, bare -- one ``pwritev`` per run of
  consecutive slots, of each slot's header block, payload and padding, from the same host
  pages at the same offsets, with no statekv code between them;
* **spill writer**: ``SlotWriter.execute`` over ``WriteSlots`` batches as the scheduler
  sends them (restore metadata, payload checksums given, as the GPU copy supplies them),
  into the same slots;
* **raw read**: one ``preadv`` per run into the same pages, and each payload's CRC-32C (a
  read cannot skip its check);
* **prefetch reader**: ``SlotReader.execute`` over ``PrefetchSlots`` batches (disk ->
  host pages, every slot verified).

For each, wall time and the thread's CPU time per block, the best of `--repeat` passes,
raw and statekv passes interleaved.  The figure per path is statekv's own CPU per block (the
worker's CPU less the raw pass's) as a share of the raw pass's wall time per block: the
fraction of one interpreter the workers hold while they keep the disk busy (a share of 0.25
means four worker threads at disk speed would need the whole interpreter between them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import functools
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import attrs
import torch

from bench.flags import OneLineParser, existing_directory, int_at_least, results_tag
from bench.results_files import source_commit, write_new_results
from io_actors.actors.reader_pool import ReadJob, SlotReader
from io_actors.actors.writer_pool import SlotWriter, WriteJob
from io_actors.config import StateKVConfig
from io_actors.memory.pools import _DoneFence
from io_actors.storage.buffers import host_view, page_aligned_buffer
from io_actors.storage.open_store import open_slot_store
from io_actors.storage.posix_open import DATA_FILE
from io_actors.storage.slot_format import HEADER_SIZE, payload_checksum, slot_nbytes
from statekv.config import KVLayout
from statekv.ids import BlockHash, BlockId, PageId, SlotId, TransferId
from statekv.messages import (
    BatchFinished,
    Completion,
    PrefetchSlot,
    PrefetchSlots,
    SlotRead,
    SlotWritten,
    WriteSlot,
    WriteSlots,
)

_O_DIRECT: Final = getattr(os, "O_DIRECT", 0)
_LAYER_BYTES: Final = 2 * 16 * 8 * 128 * 2


@attrs.frozen(kw_only=True)
class Pass:
    """One timed pass over every block."""

    wall_us: float
    """Wall time per block, microseconds."""
    cpu_us: float
    """The thread's CPU time per block (user and system), microseconds."""


def _timed(blocks: int, run: Callable[[], None]) -> Pass:
    wall, cpu = time.perf_counter(), time.thread_time()
    run()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    return Pass(wall_us=wall / blocks * 1e6, cpu_us=cpu / blocks * 1e6)


def _best(passes: Sequence[Pass]) -> Pass:
    """The pass with the least CPU time: what the code costs when nothing else intervenes."""
    return min(passes, key=lambda p: p.cpu_us)


def _key(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(32, "little"))


class _Bench:
    def __init__(self, directory: Path, *, block_bytes: int, blocks: int, batch: int) -> None:
        self.blocks = blocks
        self.batch = batch
        self.block_bytes = block_bytes
        # Llama-8B-like layers (8 kv heads x 128, bf16, 16 tokens a block: 64 KiB a layer),
        # as bench.io's layout_for.
        config = StateKVConfig(
            layout=KVLayout(num_layers=block_bytes // _LAYER_BYTES, num_kv_heads=8,
                            head_dim=128, dtype="bfloat16"),
            block_size=16, gpu=1, host=blocks, disk=blocks, disk_dir=directory, device="cpu",
            writers=1, readers=1, max_batch_blocks=batch, model_fingerprint="bench-worker-cpu",
        )
        core = config.core_config()
        assert core.block_bytes == block_bytes, (core.block_bytes, block_bytes)
        rank_dir = config.rank_directory()
        assert rank_dir is not None
        self.store = open_slot_store(config.backend, rank_dir, core, persist=False)
        pool = page_aligned_buffer(blocks * block_bytes)
        pool.random_(0, 256)
        self.pages = [pool[i * block_bytes : (i + 1) * block_bytes] for i in range(blocks)]
        crcs = [payload_checksum(host_view(page)) for page in self.pages]
        self.slot_bytes = slot_nbytes(block_bytes)
        pad = self.slot_bytes - HEADER_SIZE - block_bytes
        self._headers = page_aligned_buffer(batch * HEADER_SIZE)
        self._pad = page_aligned_buffer(pad)
        self._fd = os.open(rank_dir / DATA_FILE, os.O_RDWR)
        self.direct = self._try_direct()

        class _Checksums:
            def of(self, page: PageId) -> int:
                return crcs[page]

        page_of: Callable[[PageId], torch.Tensor] = self.pages.__getitem__
        self.writer = SlotWriter(self.store, page_of, _Checksums())  # type: ignore[arg-type]
        self.reader = SlotReader(self.store, page_of, page_aligned_buffer,
                                 self.pages[0].device, batch, host_page=page_of)
        self._sequence = 0

    def _try_direct(self) -> bool:
        if not _O_DIRECT:
            return False
        try:
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | _O_DIRECT)
            os.preadv(self._fd, [host_view(self._headers)[:HEADER_SIZE]], 0)
        except OSError:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags)
            return False
        return True

    def close(self) -> None:
        os.close(self._fd)
        self.store.close()

    def _runs(self) -> list[range]:
        return [range(i, min(i + self.batch, self.blocks))
                for i in range(0, self.blocks, self.batch)]

    def _iov(self, run: range) -> list[memoryview]:
        headers, pad = host_view(self._headers), host_view(self._pad)
        iov: list[memoryview] = []
        for n, slot in enumerate(run):
            iov += [headers[n * HEADER_SIZE : (n + 1) * HEADER_SIZE], host_view(self.pages[slot])]
            if len(pad):
                iov.append(pad)
        return iov

    def raw_write(self) -> None:
        for run in self._runs():
            iov = self._iov(run)
            assert os.pwritev(self._fd, iov, run[0] * self.slot_bytes) == len(run) * self.slot_bytes

    def raw_read(self) -> None:
        for run in self._runs():
            iov = self._iov(run)
            assert os.preadv(self._fd, iov, run[0] * self.slot_bytes) == len(run) * self.slot_bytes
            for slot in run:
                payload_checksum(host_view(self.pages[slot]))

    def write_jobs(self) -> list[WriteJob]:
        jobs = []
        for run in self._runs():
            writes = []
            for slot in run:
                self._sequence += 1
                writes.append(WriteSlot(
                    transfer=TransferId(self._sequence), block=BlockId(slot), key=_key(slot),
                    host_page=PageId(slot), slot=SlotId(slot), retained=True,
                    parent=_key(slot + self.blocks), depth=slot + 1, reuse_count=1,
                    expiry=2e9, issued_at=1.7e9))
            jobs.append(WriteJob(WriteSlots(writes=tuple(writes)), _DoneFence()))
        return jobs

    def read_jobs(self) -> list[ReadJob]:
        jobs = []
        for run in self._runs():
            reads = []
            for slot in run:
                self._sequence += 1
                reads.append(PrefetchSlot(transfer=TransferId(self._sequence),
                                          block=BlockId(slot), key=_key(slot),
                                          slot=SlotId(slot), host_page=PageId(slot)))
            jobs.append(ReadJob(PrefetchSlots(reads=tuple(reads)), _DoneFence()))
        return jobs

    def write(self, jobs: list[WriteJob]) -> None:
        for job in jobs:
            _check_landed(self.writer.execute(job), SlotWritten)

    def read(self, jobs: list[ReadJob]) -> None:
        for job in jobs:
            _check_landed(self.reader.execute(job), SlotRead)


def _check_landed(result: Completion, landed: type) -> None:
    """A pass that failed a block measured something else: stop the run."""
    if not isinstance(result, BatchFinished) or not all(
        isinstance(outcome, landed) for outcome in result.outcomes
    ):
        raise RuntimeError(f"a block did not land: {result!r:.300}")


def measure(directory: Path, *, block_bytes: int, blocks: int, batch: int,
            repeat: int) -> tuple[dict[str, Pass], bool]:
    """Best pass of each path, and whether O_DIRECT was in effect."""
    with tempfile.TemporaryDirectory(dir=directory, prefix="worker-cpu-") as scratch:
        bench = _Bench(Path(scratch), block_bytes=block_bytes, blocks=blocks, batch=batch)
        try:
            bench.raw_write()
            bench.write(bench.write_jobs())  # every slot written once, then the same again
            passes: dict[str, list[Pass]] = {
                "raw_write": [], "spill_writer": [], "raw_read": [], "prefetch_reader": []}
            for _ in range(repeat):
                passes["raw_write"].append(_timed(blocks, bench.raw_write))
                passes["spill_writer"].append(
                    _timed(blocks, functools.partial(bench.write, bench.write_jobs())))
                passes["raw_read"].append(_timed(blocks, bench.raw_read))
                passes["prefetch_reader"].append(
                    _timed(blocks, functools.partial(bench.read, bench.read_jobs())))
            return {name: _best(p) for name, p in passes.items()}, bench.direct
        finally:
            bench.close()


def figures(best: dict[str, Pass], direct: bool) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for path, raw in (("spill_writer", "raw_write"), ("prefetch_reader", "raw_read")):
        own = best[path].cpu_us - best[raw].cpu_us
        out[f"{path}_own_cpu_us_per_block"] = {
            "value": round(own, 2), "unit": "us",
            "limit": round(best[raw].wall_us, 2),
            "limit_name": f"{raw.replace('_', ' ')} wall time a block, same run"
                          f"{'' if direct else ' (buffered: O_DIRECT refused)'}",
            "ratio": round(own / best[raw].wall_us, 3),
        }
        for name in (path, raw):
            out[f"{name}_cpu_us_per_block"] = {"value": round(best[name].cpu_us, 2), "unit": "us"}
            out[f"{name}_wall_us_per_block"] = {"value": round(best[name].wall_us, 2),
                                                "unit": "us"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.worker_cpu", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-kib", type=int_at_least(64), default=256,
                        help="payload bytes a block, KiB (a multiple of 64: one layer's)")
    parser.add_argument("--blocks", type=int_at_least(1), default=1024)
    parser.add_argument("--batch", type=int_at_least(1), default=16,
                        help="blocks a batch (the cache's max_batch_blocks)")
    parser.add_argument("--repeat", type=int_at_least(1), default=5, help="best of this many")
    parser.add_argument("--dir", type=existing_directory, default=tempfile.gettempdir(),
                        help="where the scratch slot store goes")
    parser.add_argument("--machine", default="cpu")
    parser.add_argument("--write", action="store_true", help="write bench/results/*.json")
    parser.add_argument("--tag", type=results_tag, default=None,
                        help="suffix of the results file name (several runs a day)")
    args = parser.parse_args(argv)
    if (args.block_kib << 10) % _LAYER_BYTES:
        parser.error(f"--block-kib must be a multiple of {_LAYER_BYTES >> 10}, "
                     f"got {args.block_kib}")
    best, direct = measure(Path(args.dir), block_bytes=args.block_kib << 10, blocks=args.blocks,
                           batch=args.batch, repeat=args.repeat)
    print(f"machine: {platform.node()} ({platform.processor() or platform.machine()}), "
          f"{os.cpu_count()} CPUs; {args.block_kib} KiB blocks, batches of {args.batch}, "
          f"{args.blocks} blocks, best of {args.repeat}; O_DIRECT: {direct}")
    for name, p in best.items():
        print(f"  {name:16} wall {p.wall_us:8.1f} us/block  cpu {p.cpu_us:7.1f} us/block")
    result_figures = figures(best, direct)
    for path in ("spill_writer", "prefetch_reader"):
        f = result_figures[f"{path}_own_cpu_us_per_block"]
        print(f"{path}: {f['value']} us of its own CPU a block = {f['ratio']:.3f} of the "
              f"{f['limit']} us the disk takes a block")
    if args.write:
        today = dt.date.today()
        result = {
            "bench": "worker_cpu", "machine": args.machine, "date": today.isoformat(),
            "commit": source_commit(),
            "command": f"python -m bench.worker_cpu --block-kib {args.block_kib} "
                       f"--blocks {args.blocks} --batch {args.batch} --repeat {args.repeat} "
                       f"--machine {args.machine} --write"
                       + (f" --tag {args.tag}" if args.tag else ""),
            "host": platform.node(), "cpus": os.cpu_count(), "direct": direct,
            "figures": result_figures,
        }
        print(f"wrote {write_new_results('worker_cpu', args.machine, today, result, tag=args.tag)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
