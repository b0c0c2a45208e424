"""Fetch throughput from the shared tier against redis-benchmark's GET rate, same cluster.

    python -m bench.remote [--block-kib 256] [--blocks 256] [--batch 16] [--threads 2]
                           [--seconds 5] [--write]

One run starts a three-master Redis Cluster on loopback (bench/redis_cluster.py, Debian's
redis-server), publishes `--blocks` blocks through RedisClusterStore, then measures:

* fetch rate: RedisClusterStore.fetch_many by `--threads` threads, `--batch` blocks per call
  (one pipeline per master holding some of them), every value verified (length, header CRC,
  key, config fingerprint, payload CRC) and copied into a host page, for `--seconds`;
* limit: ``redis-benchmark --cluster -t get -d <value bytes>`` against the same cluster in
  the same run, with ``-c <threads x masters>`` connections and ``-P <batch / masters>``
  pipelining, i.e. the same number of requests in flight per master: the rate at which
  Redis serves GETs of this value size to a C client that verifies and copies nothing.

The figure is fetch bytes/s over redis-benchmark's GETs/s times the same value size.  Rates
are decimal GB/s of whole values (header block included), so the two sides count the same
bytes.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.flags import OneLineParser, int_at_least, positive_number
from bench.redis_cluster import running_cluster
from bench.results_files import source_commit, write_new_results
from io_actors.storage.redis_store import RedisClusterStore, RemoteIO
from io_actors.storage.slot_format import HEADER_SIZE
from statekv.config import CacheConfig, KVLayout
from statekv.hashing import chain_key, root_key, token_bytes
from statekv.ids import BlockHash

MASTERS = 3
BLOCK_SIZE = 16


def config_for(block_kib: int) -> CacheConfig:
    # float32 KV of one layer, one head: head_dim sets the block's bytes exactly.
    head_dim = block_kib * 1024 // (2 * BLOCK_SIZE * 4)
    return CacheConfig(block_size=BLOCK_SIZE, gpu_blocks=8, model_fingerprint="bench-remote",
                       layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=head_dim,
                                       dtype="float32"))


def fetch_rate(store: RedisClusterStore, keys: list[BlockHash], *, batch: int, threads: int,
               seconds: float) -> tuple[float, int]:
    """(values per second, fetches) over `seconds`, every fetch verified."""
    stop = threading.Event()
    counts = [0] * threads
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        dsts = [torch.empty(store.payload_len, dtype=torch.uint8) for _ in range(batch)]
        at = n * batch
        try:
            while not stop.is_set():
                chunk = [keys[(at + i) % len(keys)] for i in range(batch)]
                at += batch * threads
                out = store.fetch_many([RemoteIO(k, d) for k, d in zip(chunk, dsts, strict=True)])
                if any(o is not None for o in out):
                    raise RuntimeError(f"fetch failed: {next(o for o in out if o)}")
                counts[n] += batch
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    started = time.perf_counter()
    for t in pool:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return sum(counts) / elapsed, sum(counts)


def _redis_benchmark(cli_dir: str, port: int, test: str, *, value_bytes: int,
                     connections: int, pipeline: int, requests: int) -> float:
    """Requests per second of one redis-benchmark test; tried three times (on this machine
    redis-benchmark's cluster mode now and then aborts with "All clients disconnected")."""
    failures: list[str] = []
    for _attempt in range(3):
        done = subprocess.run(
            [f"{cli_dir}/redis-benchmark", "--cluster", "-h", "127.0.0.1", "-p", str(port),
             "-t", test, "-d", str(value_bytes), "-n", str(requests), "-c", str(connections),
             "-P", str(pipeline), "--csv"],
            capture_output=True, text=True, timeout=600, check=False,
        )
        for row in csv.reader(io.StringIO(done.stdout)):
            if done.returncode == 0 and row and row[0] == test.upper():
                return float(row[1])
        failures.append(f"rc {done.returncode}: {done.stdout[-300:]} {done.stderr[-300:]}")
    raise RuntimeError("redis-benchmark failed three times:\n" + "\n".join(failures))


def benchmark_get_rate(cli_dir: str, port: int, *, value_bytes: int, connections: int,
                       pipeline: int, requests: int) -> float:
    """redis-benchmark's GETs per second of `value_bytes` values on the cluster.

    A SET run first stores the value under the keys the GET run reads (without it every
    GET would answer nil, a few bytes).
    """
    _redis_benchmark(cli_dir, port, "set", value_bytes=value_bytes, connections=connections,
                     pipeline=pipeline, requests=max(300, 30 * connections * pipeline))
    return _redis_benchmark(cli_dir, port, "get", value_bytes=value_bytes,
                            connections=connections, pipeline=pipeline, requests=requests)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.remote", description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-kib", type=int_at_least(1), default=256)
    parser.add_argument("--blocks", type=int_at_least(1), default=256)
    parser.add_argument("--batch", type=int_at_least(1), default=16)
    parser.add_argument("--threads", type=int_at_least(1), default=2)
    parser.add_argument("--seconds", type=positive_number, default=5.0)
    parser.add_argument("--write", action="store_true",
                        help="write bench/results/remote-cpu-<date>.json")
    args = parser.parse_args(argv)

    config = config_for(args.block_kib)
    value_bytes = HEADER_SIZE + config.block_bytes
    tool = shutil.which("redis-benchmark")
    if tool is None:
        parser.error("redis-benchmark not found: apt-get install -y redis-server")
    cli_dir = str(Path(tool).parent)
    with tempfile.TemporaryDirectory() as tmp, running_cluster(Path(tmp),
                                                               maxmemory="1gb") as cluster:
        with RedisClusterStore(cluster.url, config, timeout_s=5.0) as store:
            root = root_key(config.model_fingerprint, None, None)
            keys: list[BlockHash] = []
            parent = root
            for i in range(args.blocks):
                parent = chain_key(parent, token_bytes(range(i * BLOCK_SIZE,
                                                             (i + 1) * BLOCK_SIZE)))
                keys.append(parent)
            g = torch.Generator().manual_seed(0)
            for first in range(0, len(keys), 32):
                items = [RemoteIO(k, torch.randint(0, 256, (config.block_bytes,),
                                                   dtype=torch.uint8, generator=g))
                         for k in keys[first:first + 32]]
                if any(o is not None for o in store.publish_many(items)):
                    raise RuntimeError("publish failed")
            fetch_rate(store, keys, batch=args.batch, threads=args.threads, seconds=0.5)
            values_per_s, fetched = fetch_rate(store, keys, batch=args.batch,
                                               threads=args.threads, seconds=args.seconds)
        pipeline = max(1, args.batch // MASTERS)
        # At least a few seconds of GETs: a short run is mostly its own ramp-up.
        requests = max(10_000, int(3 * values_per_s * args.seconds))
        # Each fetching thread holds one connection per master, with a pipeline of about
        # batch / masters GETs on each: the same requests in flight as -c threads*masters.
        connections = args.threads * MASTERS
        get_per_s = benchmark_get_rate(cli_dir, cluster.nodes[0].port, value_bytes=value_bytes,
                                       connections=connections, pipeline=pipeline,
                                       requests=requests)

    fetch_gb = values_per_s * value_bytes / 1e9
    limit_gb = get_per_s * value_bytes / 1e9
    ratio = fetch_gb / limit_gb
    print(f"machine: {platform.node()} ({platform.processor() or platform.machine()}), "
          f"python {platform.python_version()}")
    print(f"value {value_bytes} bytes ({args.block_kib} KiB block + header), "
          f"{args.threads} threads x batch {args.batch}, {fetched} fetches")
    print(f"fetch (verified):      {values_per_s:10.0f} values/s  {fetch_gb:6.3f} GB/s")
    print(f"redis-benchmark GET:   {get_per_s:10.0f} values/s  {limit_gb:6.3f} GB/s "
          f"(-c {connections} -P {pipeline})")
    print(f"ratio: {ratio:.2f}")

    if args.write:
        commit = source_commit()
        today = dt.date.today()
        command = (f"python -m bench.remote --block-kib {args.block_kib} --blocks {args.blocks} "
                   f"--batch {args.batch} --threads {args.threads} --seconds {args.seconds} "
                   "--write")
        result = {
            "bench": "remote", "machine": "cpu", "date": today.isoformat(), "commit": commit,
            "command": command,
            "figures": {
                "fetch_from_cluster": {
                    "value": round(fetch_gb, 4), "unit": "GB/s", "limit": round(limit_gb, 4),
                    "limit_name": f"redis-benchmark --cluster GET, -d {value_bytes} "
                                  f"-c {connections} -P {pipeline}, same run",
                    "ratio": round(ratio, 3),
                },
                "fetch_values_per_s": {"value": round(values_per_s, 1), "unit": "1/s"},
                "redis_benchmark_get_per_s": {"value": round(get_per_s, 1), "unit": "1/s"},
            },
        }
        out = write_new_results("remote", "cpu", today, result)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
