"""The forward pass beside a thread that runs Python in bursts: the interpreter lock's cost.

    python -m bench.gil_contention [--device cuda] [--cuda-graphs] [--write]

Every torch call lets the interpreter lock go while it dispatches and takes it back after.
When another thread is running Python at that moment, the caller waits until that thread
lets the lock go (at its next blocking call, or after the switch interval, 5 ms by
default).  The cache's own threads (its trio thread, writers, readers) run Python in bursts
between system calls, so a forward pass that makes a hundred torch calls can wait a hundred
times: ``bench.io``'s busy step, profiled on the H200, spent a third of its forward pass
waiting for the lock.  This bench isolates that mechanism from the disk: the same decode
pass, alone and beside one thread that runs Python for a given burst and then makes one
call that lets the lock go (``time.sleep(0)``, standing for a system call), at each switch
interval.  With ``--cuda-graphs`` the model's decode graphs run the same pass as one replay
(a handful of torch calls) beside the same bursts.

Each figure is a pass's median time over ``--repeat`` passes beside bursts of one length,
against the same pass alone in the same run (ratio: the slowdown).  The torch calls of one
eager pass are counted with torch's profiler (top-level operators).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from bench.flags import (
    OneLineParser,
    comma_list,
    device_name,
    int_at_least,
    non_negative_number,
    positive_number,
    results_tag,
    shape_preset,
)
from bench.results_files import source_commit, write_new_results
from io_actors.embed import resolve_device

if TYPE_CHECKING:
    import torch

BLOCK_SIZE = 16


@contextmanager
def python_bursts(burst_s: float) -> Iterator[None]:
    """A thread that runs Python for `burst_s`, lets the lock go once, and again, until the
    block ends (none for a burst of 0)."""
    if burst_s <= 0:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        clock = time.perf_counter
        while not stop.is_set():
            start = clock()
            while clock() - start < burst_s:
                pass
            time.sleep(0)

    thread = threading.Thread(target=run, name="python-bursts", daemon=True)
    thread.start()
    try:
        time.sleep(0.02)  # running before the first timed pass
        yield
    finally:
        stop.set()
        thread.join()


def measure(step: Callable[[], None], *, repeat: int, bursts_us: list[float],
            intervals_ms: list[float]) -> dict[tuple[float, float], float]:
    """Median seconds of `step` for each (switch interval ms, burst us)."""
    out: dict[tuple[float, float], float] = {}
    before = sys.getswitchinterval()
    try:
        for interval in intervals_ms:
            sys.setswitchinterval(interval / 1e3)
            for burst in bursts_us:
                with python_bursts(burst / 1e6):
                    step()  # one untimed pass with the thread running
                    times = []
                    for _ in range(repeat):
                        start = time.perf_counter()
                        step()
                        times.append(time.perf_counter() - start)
                out[(interval, burst)] = statistics.median(times)
    finally:
        sys.setswitchinterval(before)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.gil_contention",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=device_name, default="auto")
    parser.add_argument("--model", type=shape_preset, default="tiny")
    parser.add_argument("--model-layers", type=int_at_least(1), default=2)
    parser.add_argument("--decodes", type=int_at_least(1), default=16)
    parser.add_argument("--context", type=int_at_least(1), default=128,
                        help="tokens of each decode's context")
    parser.add_argument("--bursts-us",
                        type=comma_list(non_negative_number, what="comma-separated numbers"),
                        default=[0.0, 20.0, 50.0, 200.0, 1000.0],
                        help="the other thread's Python bursts, in microseconds (0: alone)")
    parser.add_argument("--switch-interval-ms",
                        type=comma_list(positive_number, what="comma-separated numbers"),
                        default=[5.0, 0.5],
                        help="sys.setswitchinterval values, in milliseconds (Python's: 5)")
    parser.add_argument("--repeat", type=int_at_least(3), default=30)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also the same pass replayed from the model's decode graphs")
    parser.add_argument("--machine", default="cpu", help="cpu, h200 or h200x2 (file name)")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--tag", type=results_tag, default=None)
    args = parser.parse_args(argv)
    if 0.0 not in args.bursts_us:
        parser.error("--bursts-us: must include 0 (the pass alone, what each figure is "
                     "measured against)")
    device = resolve_device(args.device)
    if args.cuda_graphs and device.type != "cuda":
        parser.error(f"--cuda-graphs: CUDA graphs need a CUDA device, not {args.device!r}")

    import torch

    threads = torch.get_num_threads()
    if device.type == "cpu":
        # One intra-op thread: the pass's compute then stays on its own thread, as a GPU
        # pass's does.  With torch's OpenMP pool, its workers spin between operators on the
        # cores the bursting thread needs (on the 2-core CPU machine the slowdown beside
        # 1 ms bursts measured 1.07x that way, 24x with one thread).
        torch.set_num_threads(1)
    try:
        results, calls = _run(args, device)
    finally:
        torch.set_num_threads(threads)
    _report(args, device, results, calls,
            command="python -m bench.gil_contention " + " ".join(
                sys.argv[1:] if argv is None else argv))
    return 0


def _run(args: argparse.Namespace, device: torch.device
         ) -> tuple[dict[str, dict[tuple[float, float], float]], int]:
    """Each mode's timings, and the eager pass's top-level torch calls."""
    from torch.profiler import ProfilerActivity, profile

    from models import Chunk, PagedDecoder, greedy, preset

    config = preset(args.model, num_layers=args.model_layers)
    modes = ["eager"] + (["graphs"] if args.cuda_graphs else [])
    need = -(-(args.context + 2) // BLOCK_SIZE)
    results: dict[str, dict[tuple[float, float], float]] = {}
    calls = 0
    for mode in modes:
        model = PagedDecoder(config, device=device, batch_decodes=True,
                             cuda_graphs=mode == "graphs")
        pool = model.new_pool(args.decodes * need, BLOCK_SIZE)
        tables = [list(range(i * need, (i + 1) * need)) for i in range(args.decodes)]
        prompt = [(7 * i) % config.vocab_size for i in range(args.context)]
        model.forward(pool, [Chunk(token_ids=prompt, start=0, block_table=t) for t in tables])
        chunks = [Chunk(token_ids=[1], start=args.context, block_table=t) for t in tables]

        def step(model: PagedDecoder = model, pool: torch.Tensor = pool,
                 chunks: list[Chunk] = chunks) -> None:
            # The readback is part of the step: on a GPU it waits for the pass.
            greedy(model.forward(pool, chunks).last_logits)

        step()  # warm-up (and the graph's capture)
        if mode == "eager":
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            calls = sum(1 for e in prof.events() if e.cpu_parent is None)
        results[mode] = measure(step, repeat=args.repeat, bursts_us=args.bursts_us,
                                intervals_ms=args.switch_interval_ms)
    return results, calls


def _report(args: argparse.Namespace, device: torch.device,
            results: dict[str, dict[tuple[float, float], float]], calls: int, *,
            command: str) -> None:
    print(f"machine: {args.machine} ({platform.node()}), device {device}; "
          f"{args.decodes} decodes of {args.context} tokens through {args.model_layers} "
          f"{args.model} layers; the eager pass makes {calls} top-level torch calls")
    figures: dict[str, dict[str, object]] = {}
    for mode, timings in results.items():
        for interval in args.switch_interval_ms:
            alone = timings[(interval, 0.0)]
            for burst in args.bursts_us:
                t = timings[(interval, burst)]
                what = "alone" if burst == 0 else f"beside {burst:g} us bursts"
                print(f"{mode:6s} switch {interval:g} ms, {what:24s} {t * 1e3:8.3f} ms"
                      + ("" if burst == 0 else f"  = {t / alone:6.2f}x"))
                if burst:
                    figures[f"pass_{mode}_switch{interval:g}ms_burst{burst:g}us"] = {
                        "value": round(t * 1e3, 4), "unit": "ms", "limit": round(alone * 1e3, 4),
                        "limit_name": "the same pass alone, same run",
                        "ratio": round(t / alone, 3)}
    if args.write:
        today = dt.date.today()
        out = write_new_results("gil_contention", args.machine, today, {
            "bench": "gil_contention", "machine": args.machine, "date": today.isoformat(),
            "commit": source_commit(),
            "command": command,
            "eager_torch_calls": calls, "figures": figures,
        }, tag=args.tag)
        print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
