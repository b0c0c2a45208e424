"""Payload checksum cost: zlib's CRC-32 against CRC-32C (the ``crc32c`` package), and what
either costs a spill next to the disk write it precedes.

    python -m bench.checksum [--sizes-kib 256 2048 4096] [--seconds 1] [--dir /tmp] [--write]

Measured, for each buffer size (random bytes, one buffer per thread, so every thread reads
its own memory as a writer thread checksums its own host page):

* ``zlib.crc32`` and ``crc32c.crc32c``, one thread: bytes per second over `--seconds`, each
  thread cycling through `--pool-mib` of buffers, more than the CPU caches hold: a writer
  thread checksums a host page the copy engine has just filled, which is in no CPU cache
  (one buffer checksummed again and again would be, and at 256 KiB zlib reads twice as
  fast from cache as from memory);
* the same from two threads at once (aggregate): it scales only where the function releases
  the interpreter lock;
* the raw limit, in the same run: slot-sized blocks written with O_DIRECT from one thread
  (bench/disk_limits.py's raw write), the write a spill's checksum comes before.

The spill-path figure per size is the checksum's share of one block's work on a writer
thread, checksum then write: crc_time / (crc_time + write_time), where each time is the
block's bytes over the measured rate.  Rates are decimal GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import tempfile
import threading
import time
import zlib
from collections.abc import Callable

import crc32c

from bench.disk_limits import raw_write_rate
from bench.flags import OneLineParser, existing_directory, int_at_least, positive_number
from bench.results_files import source_commit, write_new_results
from io_actors.storage.slot_format import HEADER_SIZE, align_up

Checksum = Callable[[bytes], int]

FUNCTIONS: dict[str, Checksum] = {
    "zlib_crc32": zlib.crc32,
    "crc32c": crc32c.crc32c,
}


def rate(function: Checksum, size: int, threads: int, seconds: float, pool_bytes: int) -> float:
    """Aggregate GB/s of `threads` threads each checksumming its own `pool_bytes` of
    `size`-byte buffers, in turn, for about `seconds`."""
    count = max(1, pool_bytes // size)
    buffers = [[os.urandom(size) for _ in range(count)] for _ in range(threads)]
    for mine in buffers:
        function(mine[0])  # load the code
    done = [0] * threads
    start_line = threading.Barrier(threads + 1)
    stop = time.perf_counter() + seconds + 0.05

    def worker(n: int) -> None:
        mine = buffers[n]
        start_line.wait()
        count = 0
        while time.perf_counter() < stop:
            function(mine[count % len(mine)])
            count += 1
        done[n] = count

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for thread in pool:
        thread.start()
    start_line.wait()
    begin = time.perf_counter()
    for thread in pool:
        thread.join()
    elapsed = time.perf_counter() - begin
    return sum(done) * size / elapsed / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.checksum", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-kib", type=int_at_least(1), nargs="+", default=[256, 2048, 4096])
    parser.add_argument("--seconds", type=positive_number, default=1.0)
    parser.add_argument("--repeat", type=int_at_least(1), default=3, help="best of this many runs")
    parser.add_argument("--pool-mib", type=int_at_least(1), default=64,
                        help="buffer bytes each thread cycles through")
    parser.add_argument("--dir", type=existing_directory, default=tempfile.gettempdir(),
                        help="where the raw write's scratch file goes")
    parser.add_argument("--write-mib", type=int_at_least(1), default=1024,
                        help="bytes written per raw write run")
    parser.add_argument("--machine", default="cpu")
    parser.add_argument("--write", action="store_true", help="write bench/results/*.json")
    args = parser.parse_args(argv)
    print(f"machine: {platform.node()} ({platform.processor() or platform.machine()}), "
          f"{os.cpu_count()} CPUs; crc32c {crc32c.__version__} "
          f"(hardware: {crc32c.hardware_based}), zlib {zlib.ZLIB_RUNTIME_VERSION}")
    figures: dict[str, dict[str, object]] = {}
    pool = args.pool_mib << 20
    for kib in args.sizes_kib:
        size = kib << 10
        write = raw_write_rate(args.dir, block_bytes=HEADER_SIZE + align_up(size), threads=1,
                               total_bytes=args.write_mib << 20)
        print(f"{kib} KiB: raw write (O_DIRECT={write.direct}, 1 thread) "
              f"{write.gb_per_s:.2f} GB/s")
        single: dict[str, float] = {}
        for name, function in FUNCTIONS.items():
            one = max(rate(function, size, 1, args.seconds, pool) for _ in range(args.repeat))
            two = max(rate(function, size, 2, args.seconds, pool) for _ in range(args.repeat))
            single[name] = one
            share = (1 / one) / (1 / one + 1 / write.gb_per_s)
            print(f"  {name:10}: 1 thread {one:6.2f} GB/s, 2 threads {two:6.2f} GB/s "
                  f"({two / one:.2f}x); {share:.0%} of a block's checksum + write")
            figures[f"{name}_{kib}k_1thread"] = {"value": round(one, 2), "unit": "GB/s"}
            figures[f"{name}_{kib}k_2threads"] = {"value": round(two, 2), "unit": "GB/s",
                                                  "ratio": round(two / one, 2),
                                                  "limit_name": "2 x the 1-thread rate"}
            figures[f"{name}_{kib}k_share_of_spill_block"] = {
                "value": round(share, 3), "unit": "fraction",
                "limit": round(write.gb_per_s, 2),
                "limit_name": "raw O_DIRECT write GB/s, 1 thread, same run",
            }
        figures[f"raw_write_{kib}k_1thread"] = {"value": round(write.gb_per_s, 2),
                                               "unit": "GB/s", "direct": write.direct}
        figures[f"crc32c_over_zlib_{kib}k"] = {
            "value": round(single["crc32c"] / single["zlib_crc32"], 2), "unit": "x"}
    if args.write:
        commit = source_commit()
        today = dt.date.today()
        result = {
            "bench": "checksum", "machine": args.machine, "date": today.isoformat(),
            "commit": commit,
            "command": "python -m bench.checksum --sizes-kib "
                       + " ".join(map(str, args.sizes_kib))
                       + f" --seconds {args.seconds} --repeat {args.repeat} "
                       f"--pool-mib {args.pool_mib} --write-mib {args.write_mib} "
                       f"--machine {args.machine} --write",
            "host": platform.node(), "cpus": os.cpu_count(),
            "crc32c_version": crc32c.__version__, "crc32c_hardware": crc32c.hardware_based,
            "zlib_version": zlib.ZLIB_RUNTIME_VERSION,
            "figures": figures,
        }
        out = write_new_results("checksum", args.machine, today, result)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
