"""Machine 3: the real-thread soak -- no completion gate, real timing, random faults.

The gated machine decides the order of completions, so it cannot create the interleavings
that real threads do: a completion applied while a serving-loop call waits for the
scheduler's lock, two workers in the store at once, a read landing between a request's
``is_ready`` and its ``release``, the spill feeder blocked on a full queue while the next
step runs.  This soak runs the same system with the ordinary open gate, several worker
threads, random delays in every store call (and now and then in the serving loop), and
faults drawn at random, while a seeded random serving loop adds, computes, decodes, releases
and cancels requests and moves the clock.

Every few operations it freezes the scheduler (takes its lock, so no completion is applied
meanwhile) and runs every check of :meth:`fuzz.driver.Driver.check` -- the model follows
the exact calls the core executed, in the order it executed them, so even with real timing
the comparison is exact.  At the end, half the rounds wait for the disk to go quiet, release
everything and run :meth:`~fuzz.driver.Driver.check_nothing_leaks`; the other half close the
cache mid-traffic without draining, and check that the close finishes, stops every thread and
accounts for every transfer.

A failure writes a report (the seed, the cache's shape, the last operations) and the state
trace of the run.  The seed makes the serving loop and the faults repeat; thread timing does
not repeat, which is why this is a soak and not a Hypothesis machine.
"""

from __future__ import annotations

import collections
import random
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import attrs

from fuzz.core_machine import CLOCK_STEPS, REQUESTS
from fuzz.driver import CLOSE_TIMEOUT, Driver, SystemSpec
from fuzz.store import RandomFaults
from fuzz.tracefile import write_trace
from statekv.config import SpillMode
from statekv.stats import CacheStatistics

CHECK_EVERY = 16
"""Operations between two full checks."""
QUIET_TIMEOUT = 60.0


@attrs.frozen(kw_only=True)
class SoakResult:
    seed: int
    seconds: float
    operations: int
    checks: int
    spills: int
    onboards: int
    io_errors: int
    fallbacks: int

    def line(self) -> str:
        return (f"threads (seed {self.seed}): {self.operations} operations, {self.checks} "
                f"checks in {self.seconds:.1f} s = {self.operations / self.seconds:,.0f} ops/s; "
                f"{self.spills} spills, {self.onboards} onboards, {self.io_errors} I/O errors, "
                f"{self.fallbacks} fallbacks")


def random_spec(rng: random.Random) -> SystemSpec:
    """A cache shape for one soak round: bigger queues and more threads than the gated
    machine uses, so that threads really overlap."""
    return SystemSpec(
        block_size=rng.choice([2, 4]),
        gpu=rng.randint(4, 12),
        host=rng.randint(1, 4),
        reserved_host=rng.randint(0, 2),
        disk=rng.randint(2, 16),
        spill_mode=rng.choice(list(SpillMode)),
        spill_min_reuse=rng.randint(1, 2),
        protect_unexpired=rng.random() < 0.5,
        drop_on_pressure=rng.random() < 0.5,
        write_queue_depth=rng.randint(1, 8),
        priority_levels=rng.randint(1, 3),
        writers=rng.randint(1, 4),
        readers=rng.randint(1, 4),
        direct_io=rng.random() < 0.5,
    )


class ThreadSoak:
    """One round: one cache, one seed, `seconds` of random serving."""

    def __init__(self, seed: int, *, device: str = "cpu", backend: str = "posix",
                 fault_rate: float = 0.03) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.spec = random_spec(self.rng)
        self.faults = RandomFaults(seed, fault_rate=fault_rate, delay_rate=0.5,
                                   max_delay_s=0.002)
        self.driver = Driver(self.spec, device=device, backend=backend,
                             random_faults=self.faults)
        self.recent: collections.deque[str] = collections.deque(maxlen=200)
        self.operations = 0
        self.checks = 0

    def step(self) -> None:
        """One random serving-loop operation."""
        d, rng = self.driver, self.rng
        live = list(d.live.values())
        roll = rng.random()
        if len(live) > 3 and roll < 0.5:
            # Keep a few requests live, not the whole GPU: held pages would leave nothing to
            # evict, and nothing would move down the tiers.
            req = rng.choice(live)
            self.recent.append(f"release {req.rid} (ready={d.api.is_ready(req.rid)})")
            d.release(req.rid)
        elif roll < 0.22:
            spec = rng.choice(REQUESTS)
            self.recent.append(f"add {spec}")
            d.add(list(spec.prompt), spec.ttl, spec.priority, spec.salt)
        elif roll < 0.40:
            spec = rng.choice(REQUESTS)
            self.recent.append(f"serve {spec}")
            d.serve(list(spec.prompt), spec.ttl, spec.priority, spec.salt)
        elif roll < 0.52 and d.served:
            prompt, salt = rng.choice(d.served)
            self.recent.append(f"revisit {prompt} salt={salt}")
            d.serve(prompt, rng.choice([None, 5.0]), 0, salt)
        elif roll < 0.64:
            blocks = rng.choice([1, 2, 4, None])
            ttl = rng.choice([None, 2.0, 10.0])
            self.recent.append(f"churn blocks={blocks} ttl={ttl}")
            d.serve(d.fresh_prompt(blocks), ttl, 0)
        elif roll < 0.76 and live:
            req = rng.choice(live)
            self.recent.append(f"compute {req.rid}")
            d.compute(req, rng.randint(0, 8))
        elif roll < 0.80 and live:
            req = rng.choice(live)
            self.recent.append(f"decode {req.rid}")
            d.decode(req, rng.randint(0, 3))
        elif roll < 0.90 and live:
            req = rng.choice(live)
            self.recent.append(f"release {req.rid} (ready={d.api.is_ready(req.rid)})")
            d.release(req.rid)
        elif roll < 0.95:
            dt = rng.choice(CLOCK_STEPS)
            self.recent.append(f"clock +{dt}")
            d.now += dt
        else:
            pause = rng.uniform(0, 0.003)
            self.recent.append(f"pause {pause * 1000:.1f} ms")
            time.sleep(pause)
        self.operations += 1

    def run(self, seconds: float) -> SoakResult:
        start = time.monotonic()
        d = self.driver
        while time.monotonic() - start < seconds:
            self.step()
            if self.operations % CHECK_EVERY == 0:
                d.raise_if_crashed()
                d.check()
                self.checks += 1
        if self.rng.random() < 0.5:
            stats = self.close_with_work_in_flight()
        else:
            self.wait_quiet()
            for rid in list(d.live):
                d.release(rid)
            self.wait_quiet()
            stats = d.core.statistics()
            d.check_nothing_leaks()
        self.checks += 1
        return SoakResult(
            seed=self.seed, seconds=time.monotonic() - start, operations=self.operations,
            checks=self.checks, spills=stats.spills, onboards=stats.onboards,
            io_errors=stats.io_errors, fallbacks=stats.requests_fallen_back,
        )

    def close_with_work_in_flight(self) -> CacheStatistics:
        """Shut down mid-traffic without draining: the close must finish, stop every thread
        and account for every transfer (applied to the core, or reported dropped)."""
        d = self.driver
        report = d.close_within(d.api, CLOSE_TIMEOUT, drain=False)
        assert report is not None
        d.check()
        stats = d.core.statistics()
        assert (stats.writes_in_flight, stats.reads_in_flight) == (
            report.writes_dropped, report.reads_dropped), (stats, report)
        threads = d.new_threads()
        assert not threads, f"threads left running after close: {threads}"
        return stats

    def wait_quiet(self) -> None:
        """Until every write and read the core issued has been applied."""
        d = self.driver
        deadline = time.monotonic() + QUIET_TIMEOUT
        while True:
            d.raise_if_crashed()
            stats = d.api.statistics()
            if stats.cache.writes_in_flight == stats.cache.reads_in_flight == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"transfers still in flight after {QUIET_TIMEOUT}s: "
                                     f"{stats}")
            time.sleep(0.001)


def soak_round(
    seed: int, seconds: float, *, failure_dir: Path, device: str = "cpu",
    backend: str = "posix", echo: Callable[[str], None] = print,
) -> SoakResult:
    """Run one round; on failure write the report and the trace, then re-raise."""
    soak = ThreadSoak(seed, device=device, backend=backend)
    try:
        return soak.run(seconds)
    except BaseException as exc:
        failure_dir.mkdir(parents=True, exist_ok=True)
        stem = f"ThreadSoak-seed{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        report = failure_dir / f"{stem}.txt"
        report.write_text("\n".join([
            f"# thread soak failed: seed {seed}, device {device}, backend {backend}",
            f"# {soak.spec}", "", "## Last operations", "", *soak.recent, "",
            f"## Faults injected: {soak.driver.fuzz_store.injected[-50:]}", "",
            "## Error", "", *traceback.format_exception(exc),
        ]))
        trace = write_trace(soak.driver.trace, failure_dir / f"{stem}.trace.jsonl",
                            f"{type(exc).__name__}: {exc}")
        echo(f"failure report: {report}\nstate trace: {trace}")
        raise
    finally:
        soak.driver.clean_up()
