"""Index rebuild time: how long a cache takes to reopen a slot directory full of blocks.

What is timed, per run: opening the slot store on an existing data file (lock, checks, the
index rebuild, the index journal's rewrite) and restoring every slot found into a fresh core
(KVCacheManager.restore).  Two ways of rebuilding, each measured cold and warm:

* "journal": the index journal (io_actors/storage/index_journal.py), one sequential read of a
  192-byte record per slot -- what every open does when the journal is complete;
* "scan": the header scan, one 4 KiB read per slot (SCAN_THREADS threads) -- what an open
  does when the journal is missing or unusable (here: removed before each such run).

Reported as seconds per 100k slots (target: under 1 s on the H200 machine's disk).

The data file is sparse: every slot's header is written (real headers, chained keys, some
with deadlines), payloads are holes -- the rebuild never reads a payload, and a sparse file
lets 100k slots of a realistic block size (default 2 MiB) fit on any disk.  "Cold" runs first
evict the file from the page cache (fsync, then POSIX_FADV_DONTNEED, plus drop_caches where
permitted), so every header or journal record comes from the device; "warm" runs reopen at
once.  The journal is first written by an open that scans the populated file, as a cache's
first open after an upgrade would.

    python -m bench.rebuild --slots 100000 [--dir /tmp] --write
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import math
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from bench.flags import OneLineParser, existing_directory, int_at_least, positive_number
from bench.results_files import source_commit, write_new_results
from io_actors.embed import restore_from_disk
from io_actors.storage.index_journal import INDEX_FILE, RECORD_SIZE, IndexJournal
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import SCAN_THREADS
from io_actors.storage.record_file import RecordFile
from io_actors.storage.slot_format import HEADER_SIZE, SlotHeader, SlotMeta
from statekv.config import CacheConfig, KVLayout
from statekv.manager import KVCacheManager

PER: int = 100_000


def make_config(slots: int, block_mib: float) -> CacheConfig:
    # 16 tokens x 8 KV heads x 128 dims x bf16 x K and V = 64 KiB per layer.
    layers = max(1, round(block_mib * 1024 / 64))
    layout = KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    return CacheConfig(block_size=16, gpu_blocks=64, host_blocks=8, disk_blocks=slots,
                       layout=layout)


def populate(directory: Path, config: CacheConfig) -> int:
    """A sparse data file whose every slot holds a valid, restorable header, in the empty
    `directory`."""
    store = PosixSlotStore(directory, config, preallocate=False, persist=False)
    path, slot_bytes, fingerprint = store.path, store.slot_bytes, store.config_fingerprint
    payload_len = store.payload_len
    store.close()
    now = time.time()
    fd = os.open(path, os.O_WRONLY)
    try:
        parent = bytes(32)
        for slot in range(config.disk_blocks):
            depth = slot % 8  # chains of 8 blocks
            if depth == 0:
                parent = hashlib.blake2b(b"root%d" % slot, digest_size=32).digest()
            key = hashlib.blake2b(b"key%d" % slot, digest_size=32).digest()
            meta = SlotMeta(parent=parent, depth=depth, reuse_count=slot % 3,
                            expiry=now + 3600 if slot % 4 == 0 else None,
                            written_at=now - config.disk_blocks + slot, sequence=slot)
            header = SlotHeader(slot=slot, key=key, payload_len=payload_len, payload_crc=0,
                                config=fingerprint, meta=meta)
            os.pwrite(fd, header.pack(), slot * slot_bytes)
            parent = key
        os.fsync(fd)
    finally:
        os.close(fd)
    # Headers written behind the store's back: the journal the store created names none of
    # them.  Without it, the first open scans the headers and writes the index journal.
    (directory / INDEX_FILE).unlink()
    store = PosixSlotStore(directory, config, preallocate=False)
    assert store.recovery.index.source == "scan", store.recovery.index
    store.close()
    return slot_bytes


def evict(*paths: Path) -> bool:
    """Drop the files from the page cache; True when the system-wide drop also worked."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def rebuild(directory: Path, config: CacheConfig, source: str) -> tuple[float, float, int]:
    """(seconds to open and rebuild the index, seconds to restore, blocks restored), the
    index rebuilt from `source` ("journal" or "scan").

    Building the core (one record per slot) is not timed: every cache with this many slots
    pays it, whether or not it restores anything."""
    start = time.perf_counter()
    store = PosixSlotStore(directory, config, preallocate=False)
    scanned = time.perf_counter()
    assert store.recovery.index.source == source, store.recovery.index
    core = KVCacheManager(config)
    built = time.perf_counter()
    recovery = restore_from_disk(core, store, time.time())
    done = time.perf_counter()
    store.close()
    assert recovery is not None
    restored = core.statistics().restored_blocks
    # Outside the timing: the result is a real, consistent cache.
    if config.disk_blocks <= 20_000:
        core.check_invariants()
    return scanned - start, done - built, restored


def compaction(directory: Path, slots: int, repeat: int) -> tuple[float, float, float]:
    """(seconds, seconds of the calling thread's CPU) of the index journal's run-time
    compaction with every one of `slots` slots indexed, best of `repeat`; and the seconds
    of writing the compacted file's bytes alone, the same way (atomic replace, synced):
    the floor a compaction cannot go below.  In `directory` (made empty, left so)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        journal = IndexJournal(directory, fd, slots=slots, config=bytes(16), mac_key=None,
                               sync=False)
        journal.start([], bytes(32))
        meta = SlotMeta(parent=bytes(32), depth=1, reuse_count=0, expiry=None,
                        written_at=0.0, sequence=0)
        for first in range(0, slots, 1024):
            journal.landed([(s, hashlib.blake2b(s.to_bytes(8, "little"), digest_size=32)
                             .digest(), meta) for s in range(first, min(slots, first + 1024))])
        best = cpu = math.inf
        for _ in range(repeat):
            start, start_cpu = time.perf_counter(), time.thread_time()
            journal.compact()
            best = min(best, time.perf_counter() - start)
            cpu = min(cpu, time.thread_time() - start_cpu)
        assert journal.statistics().compactions == repeat and journal.statistics().active
        size = (directory / INDEX_FILE).stat().st_size
        journal.close()
        floor_file = RecordFile(directory, fd, "floor", RECORD_SIZE)
        payload = os.urandom(size)
        floor = math.inf
        for _ in range(repeat):
            start = time.perf_counter()
            floor_file.replace(payload)
            floor = min(floor, time.perf_counter() - start)
        floor_file.close()
        for name in os.listdir(directory):
            os.unlink(directory / name)
    finally:
        os.close(fd)
    return best, cpu, floor


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.rebuild", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int_at_least(1), default=PER)
    parser.add_argument("--block-mib", type=positive_number, default=2.0)
    parser.add_argument("--dir", type=existing_directory, default=Path(tempfile.gettempdir()),
                        help="where the scratch directory goes (made and removed inside it)")
    parser.add_argument("--repeat", type=int_at_least(1), default=3)
    parser.add_argument("--machine", default="cpu")
    parser.add_argument("--write", action="store_true", help="write bench/results/*.json")
    args = parser.parse_args(argv)
    config = make_config(args.slots, args.block_mib)
    # A directory of its own inside --dir: only that one is removed afterwards.
    scratch = Path(tempfile.mkdtemp(prefix="statekv-bench-rebuild-", dir=args.dir))
    try:
        print(f"populating {args.slots:,} slots of {config.block_bytes / 2**20:.2f} MiB in "
              f"{scratch} (sparse)")
        slot_bytes = populate(scratch, config)
        data = scratch / next(p for p in os.listdir(scratch) if p.startswith("slots."))
        journal = scratch / INDEX_FILE
        runs: dict[tuple[str, str], list[tuple[float, float]]] = {
            (source, kind): [] for source in ("journal", "scan") for kind in ("cold", "warm")
        }
        dropped = False
        for _ in range(args.repeat):
            for source in ("journal", "scan"):
                for kind in ("cold", "warm"):
                    if source == "scan":
                        journal.unlink()  # the open's rewrite puts it back
                    if kind == "cold":
                        dropped = evict(data, *([journal] if journal.exists() else []))
                    opened, restore, restored = rebuild(scratch, config, source)
                    assert restored == args.slots, (restored, args.slots)
                    runs[source, kind].append((opened, restore))
        scale = PER / args.slots
        figures: dict[str, dict[str, object]] = {}
        for (source, kind), samples in runs.items():
            best = min(samples, key=sum)
            per = sum(best) * scale
            print(f"{source} {kind}: open {best[0]:.3f} s + restore {best[1]:.3f} s for "
                  f"{args.slots:,} slots = {per:.3f} s per 100k slots (best of {len(samples)}; "
                  "all: " + ", ".join(f"{sum(s) * scale:.3f}" for s in samples) + ")")
            # The journal is what an open uses: its figures keep the plain names.
            name = kind if source == "journal" else f"scan_{kind}"
            figures[f"rebuild_{name}_per_100k_slots"] = {
                "value": round(per, 3), "unit": "s", "limit": 1.0,
                "limit_name": "target: 1 s per 100k slots", "ratio": round(per, 3),
            }
            figures[f"open_{name}_per_100k_slots"] = {"value": round(best[0] * scale, 3),
                                                      "unit": "s"}
            figures[f"restore_{name}_per_100k_slots"] = {"value": round(best[1] * scale, 3),
                                                         "unit": "s"}
        print(f"page cache dropped system-wide before cold runs: {dropped} "
              "(else only this file was evicted)")
        compact_dir = scratch / "compaction"
        compact_dir.mkdir()
        compact_s, compact_cpu, floor_s = compaction(compact_dir, args.slots, args.repeat)
        print(f"index journal compaction, {args.slots:,} slots indexed: {compact_s * 1e3:.1f} ms"
              f" ({compact_cpu * 1e3:.1f} ms of the thread's CPU) vs writing its bytes alone "
              f"{floor_s * 1e3:.1f} ms = {compact_s / floor_s:.2f}x (best of {args.repeat})")
        figures["index_compaction"] = {
            "value": round(compact_s * 1e3, 3), "unit": "ms", "limit": round(floor_s * 1e3, 3),
            "limit_name": "writing the compacted bytes alone (atomic replace, synced), same run",
            "ratio": round(compact_s / floor_s, 3),
            "thread_cpu_ms": round(compact_cpu * 1e3, 3), "slots": args.slots,
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.write:
        commit = source_commit()
        today = dt.date.today()
        result = {
            "bench": "rebuild", "machine": args.machine, "date": today.isoformat(),
            "commit": commit,
            "command": f"python -m bench.rebuild --slots {args.slots} --block-mib "
                       f"{args.block_mib} --repeat {args.repeat} --machine {args.machine} "
                       "--write",
            "host": platform.node(), "slot_bytes": slot_bytes, "header_bytes": HEADER_SIZE,
            "scan_threads": SCAN_THREADS, "index_record_bytes": RECORD_SIZE,
            "page_cache_dropped": dropped,
            "figures": figures,
        }
        out = write_new_results("rebuild", args.machine, today, result)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
