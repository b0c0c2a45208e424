"""The vLLM connector's two halves, driven exactly through vLLM 0.32's call sequence.

SchedulerSide and WorkerSide run together in one process over a small fake engine: a KV
cache of real CPU tensors in the CPU_ATTN layout, a page allocator, and deterministic
content -- "computing" a block fills its page with values derived from the hash of its token
prefix (and salt), so any wrong, stale or half-written page is seen.  The disk reads and
writes the worker submits are held and run when a rule says so, in any order, some of them
failing.  What is checked (tests/vllm/FACTS.md says how vLLM calls a connector):

* no engine page ever holds bytes other than the content of the block vLLM asked for: a
  loaded page holds the block's content unless the worker reported it in
  ``get_block_ids_with_load_errors``; pages the engine holds keep their content; pages the
  engine freed are never written;
* vLLM's bookkeeping: ``finished_recving`` names each loading request once, after its
  loads (an aborted one too: vLLM keeps its pages until then); ``finished_sending`` names
  each request whose ``request_finished`` returned True, once; the engine reuses a page
  the moment it may (so a save copy issued after the free would copy garbage, served later);
* the core's invariants after every step, across restarts on the same directory.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import attrs
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fuzz.profiles import machine_settings
from io_actors.config import StateKVConfig
from io_actors.storage.interfaces import BatchOutcome, SlotIO, SlotStore
from io_actors.vllm.plans import StepPlan
from io_actors.vllm.scheduler_side import TTL_PARAM, SchedulerSide
from io_actors.vllm.settings import connector_config
from io_actors.vllm.worker_side import WorkerSide
from statekv.config import KVLayout
from statekv.errors import TransferFailed
from statekv.ids import BlockHash, BlockId, PageId, SlotId
from statekv.messages import CopyEngineToHost, CopyHostToEngine

P = ParamSpec("P")
T = TypeVar("T")

BS = 4
DEVICE = os.environ.get("STATEKV_TEST_DEVICE", "cpu")
LAYERS = 2
HEADS = 1
HEAD_DIM = 8
ENGINE_PAGES = 24
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float32")
INSTANCE = "fuzz-engine"
PREFIXES = (
    tuple(range(1, 21)),
    tuple(range(100, 120)),
    (7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9, 9, 7, 7, 7, 7, 8, 8, 8, 8),
)

# The profile is the CI one unless the environment names another (fuzz/profiles.py).
SETTINGS = {
    "ci": machine_settings(300, 50),
    "soak": machine_settings(500, 80),
    "mutation": machine_settings(10, 30, shrink=False, derandomize=True),
    "gpu": machine_settings(300, 50),
}[os.environ.get("STATEKV_FUZZ_PROFILE", "ci")]

COVERAGE: collections.Counter[str] = collections.Counter()
"""What the runs did (rules taken, loads landed from host and disk, faults): the test checks
that the interesting paths were taken at all."""


class HeldPool(cf.ThreadPoolExecutor):
    """The worker's reader or writer pool, running nothing until the test says which job."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.jobs: list[tuple[Callable[[], Any], cf.Future[Any]]] = []

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs,
               ) -> cf.Future[T]:
        future: cf.Future[T] = cf.Future()
        self.jobs.append((lambda: fn(*args, **kwargs), future))
        return future

    def run(self, index: int) -> None:
        job, future = self.jobs.pop(index % len(self.jobs))
        try:
            future.set_result(job())
        except Exception as exc:  # a store bug, or a fault: the worker's to report
            future.set_exception(exc)

    def run_all(self) -> None:
        while self.jobs:
            self.run(0)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        assert not self.jobs, "the test drains every job before closing the worker"
        super().shutdown(wait=wait, cancel_futures=cancel_futures)


class FaultyStore:
    """The worker's slot store, failing the reads the test names (their buffers garbled, as
    a checksum mismatch would leave them)."""

    def __init__(self, inner: SlotStore) -> None:
        self.inner = inner
        self.fail_mask = 0
        """Bit i set: the i-th read of the next read_many fails."""

    @property
    def device_reads(self) -> bool:
        return self.inner.device_reads

    def write(self, slot: SlotId, key: BlockHash, src: torch.Tensor,
              meta: Any = None) -> None:
        self.inner.write(slot, key, src, meta)

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        self.inner.read(slot, key, dst)

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        return self.inner.write_many(writes)

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        results = list(self.inner.read_many(reads))
        for i, item in enumerate(reads):
            if self.fail_mask >> i & 1:
                item.buffer.fill_(0xA5)
                results[i] = TransferFailed("read", "injected by the test")
        self.fail_mask = 0
        return results

    def discard(self, slot: SlotId) -> None:
        self.inner.discard(slot)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # the retention journal, where it has one
        return getattr(self.inner, name)


def block_content(salt: str | None, tokens: Sequence[int], block: int) -> torch.Tensor:
    """What computing block `block` of `tokens` writes into its page: one [heads, bs, 2*hd]
    tensor per layer, stacked, derived from the token prefix up to the block's end."""
    prefix = tuple(tokens[: (block + 1) * BS])
    return _content(salt, prefix)


_CONTENT: dict[tuple[str | None, tuple[int, ...]], torch.Tensor] = {}


def _content(salt: str | None, prefix: tuple[int, ...]) -> torch.Tensor:
    key = (salt, prefix)
    got = _CONTENT.get(key)
    if got is None:
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        got = torch.rand((LAYERS, HEADS, BS, 2 * HEAD_DIM), generator=gen)
        _CONTENT[key] = got
    return got


@attrs.define(eq=False)
class Req:
    rid: str
    tokens: list[int]
    salt: str | None
    ttl: float | None
    pages: list[int] = attrs.field(factory=list)
    state: str = "new"
    """new | loading | running | saving | aborted (pages held until its load reports)."""
    start: int = 0
    """Blocks vLLM had itself (its prefix-cache hit) when it asked the connector."""
    loaded: int = 0
    """Blocks the connector is filling from `start` on."""
    invalid: set[int] = attrs.field(factory=set)
    """Pages of this request the worker reported it could not fill."""

    def blocks(self) -> int:
        return -(-len(self.tokens) // BS)


class ConnectorMachine(RuleBasedStateMachine):
    """vLLM's scheduler, engine and worker around the connector's two halves."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="statekv-connector-")
        self.now = 1000.0
        self.kv: dict[str, torch.Tensor] = {}
        self.free: list[int] = []
        self.poison: dict[int, float] = {}
        self.poison_next = -1.0
        self.reqs: dict[str, Req] = {}
        self.finished_ids: set[str] = set()
        self.next_id = 0
        self.steps_since_open = 0
        self.config = connector_config(
            {"host": 3, "reserved_host": 1, "disk": 8, "disk_dir": self.dir,
             "model_fingerprint": "fuzz-model", "readers": 1, "writers": 1,
             "max_batch_blocks": 2, "cost_aware_onboarding": False},
            layout=LAYOUT, block_size=BS, gpu_blocks=16, rank=0,
            default_fingerprint="fuzz")
        self.worker, self.sched = self._open(self.config)

    # ------------------------------------------------------------------ the engine

    def _open(self, config: StateKVConfig) -> tuple[WorkerSide, SchedulerSide]:
        """A fresh engine: new caches, workers registered first, then the scheduler side
        (vLLM's construction order)."""
        # The GPU machine runs this machine on CUDA caches (STATEKV_TEST_DEVICE=cuda): the
        # worker's pinned host pages, staged copies and stream synchronization then run.
        self.kv = {f"layer.{i}": torch.empty(ENGINE_PAGES, HEADS, BS, 2 * HEAD_DIM,
                                             device=DEVICE)
                   for i in range(LAYERS)}
        self.free = []
        for page in range(ENGINE_PAGES):
            self._release(page)
        worker = WorkerSide(config, instance=INSTANCE)
        worker.register(self.kv)
        assert worker.store is not None
        worker.store = FaultyStore(worker.store)
        worker._readers = HeldPool()
        worker._writers = HeldPool()
        sched = SchedulerSide(config, world_size=1, instance=INSTANCE, clock=self.clock)
        self.steps_since_open = 0
        return worker, sched

    def clock(self) -> float:
        return self.now

    def _release(self, page: int) -> None:
        """The engine frees `page` and reuses it at once: it is scribbled over (a value no
        computed block holds), and must keep that value while free."""
        self.poison_next -= 1.0
        for layer in self.kv.values():
            layer[page].fill_(self.poison_next)
        self.poison[page] = self.poison_next
        self.free.append(page)

    def _alloc(self, count: int) -> list[int] | None:
        if count > len(self.free):
            return None
        pages, self.free = self.free[:count], self.free[count:]
        for page in pages:
            del self.poison[page]
        return pages

    def _page(self, page: int) -> torch.Tensor:
        return torch.stack([self.kv[f"layer.{i}"][page] for i in range(LAYERS)]).cpu()

    def _compute(self, req: Req, first: int) -> None:
        """The engine computes blocks `first`.. of `req` into its pages."""
        for b in range(first, req.blocks()):
            content = _content(req.salt, tuple(req.tokens[: (b + 1) * BS]))
            for i in range(LAYERS):
                self.kv[f"layer.{i}"][req.pages[b]].copy_(content[i])

    def _free_req(self, req: Req) -> None:
        for page in req.pages:
            self._release(page)
        req.pages = []

    # ------------------------------------------------------------------ requests

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 5).map(lambda n: BS * n),
          tail=st.lists(st.integers(0, 1), max_size=3),
          salt=st.sampled_from([None, None, None, "s"]),
          ttl=st.sampled_from([None, None, 0.0, 50.0]), local=st.integers(0, 2))
    def new_request(self, prefix: tuple[int, ...], cut: int, tail: list[int],
                    salt: str | None, ttl: float | None, local: int) -> None:
        tokens = [*prefix[:cut], *tail]
        COVERAGE["new_request"] += 1
        if len(tokens) < 2:
            return
        self.add(tokens, salt=salt, ttl=ttl, local=local)

    def add(self, tokens: list[int], *, salt: str | None = None, ttl: float | None = None,
            local: int = 0) -> Req:
        req = Req(rid=f"r{self.next_id}", tokens=tokens, salt=salt, ttl=ttl)
        self.next_id += 1
        self.reqs[req.rid] = req
        self._schedule(req, local)
        return req

    def _schedule(self, req: Req, local: int) -> None:
        """vLLM's scheduler takes a waiting request: its own prefix-cache hit (`local`
        blocks, computed here), the connector's claim, the pages, update_state_after_alloc."""
        COVERAGE["scheduled"] += 1
        full = len(req.tokens) // BS
        local = min(local, max(0, (len(req.tokens) - 1) // BS))
        n = self.sched.matched(req.tokens, local * BS, cache_salt=req.salt, lora_id=None)
        again = self.sched.matched(req.tokens, local * BS, cache_salt=req.salt, lora_id=None)
        assert n == again, "get_num_new_matched_tokens must not change anything"
        assert n % BS == 0 and local * BS + n < len(req.tokens) and local + n // BS <= full
        if n == 0:
            pages = self._alloc(req.blocks())
            if pages is None:
                del self.reqs[req.rid]
                return
            req.pages, req.start, req.state = pages, local, "running"
            self._compute(req, 0)
            return
        pages = self._alloc(local + n // BS)
        if pages is None:
            del self.reqs[req.rid]  # no room: vLLM would keep it waiting; dropped here
            return
        req.pages, req.start, req.loaded, req.state = pages, local, n // BS, "loading"
        req.invalid = set()
        for b in range(local):  # vLLM's own hit: the pages it shares hold the blocks
            content = block_content(req.salt, req.tokens, b)
            for i in range(LAYERS):
                self.kv[f"layer.{i}"][pages[b]].copy_(content[i])
        self.sched.allocated(req.rid, req.tokens, pages, n, local * BS, cache_salt=req.salt,
                             lora_id=None)

    def _ids(self, state: str) -> list[str]:
        return sorted(rid for rid, r in self.reqs.items() if r.state == state)

    @precondition(lambda self: any(r.state == "running" for r in self.reqs.values()))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def decode(self, data: st.DataObject, extra: list[int]) -> None:
        """A running request generates tokens: pages as its blocks need them."""
        COVERAGE["decode"] += 1
        running = self._ids("running")
        if not running:
            return
        req = self.reqs[data.draw(st.sampled_from(running))]
        before = req.blocks()
        req.tokens += extra
        more = self._alloc(req.blocks() - before)
        if more is None or req.blocks() > 16:
            del req.tokens[-len(extra):]
            return
        req.pages += more
        self._compute(req, max(0, before - 1))

    @precondition(lambda self: any(r.state == "running" for r in self.reqs.values()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A running request finishes: request_finished with its computed tokens (all but
        the last one sampled); its pages stay while a save is pending."""
        COVERAGE["finish"] += 1
        running = self._ids("running")
        if not running:
            return
        self.end(self.reqs[data.draw(st.sampled_from(running))])

    def end(self, req: Req) -> None:
        params = None if req.ttl is None else {TTL_PARAM: req.ttl}
        computed = req.tokens[:-1]
        delay, out = self.sched.finished(req.rid, computed, req.pages, params,
                                         cache_salt=req.salt, lora_id=None)
        assert out is None
        self.finished_ids.add(req.rid)
        if delay:
            COVERAGE["saves_delayed"] += 1
            req.state = "saving"
        else:
            self._free_req(req)
            del self.reqs[req.rid]

    @precondition(lambda self: any(r.state == "loading" for r in self.reqs.values()))
    @rule(data=st.data())
    def abort_loading(self, data: st.DataObject) -> None:
        """A request given up while WAITING_FOR_REMOTE_KVS: request_finished is called with
        the tokens vLLM counts as computed (its own hit); vLLM keeps its pages until the
        worker reports it in finished_recving."""
        COVERAGE["abort_loading"] += 1
        loading = self._ids("loading")
        if not loading:
            return
        req = self.reqs[data.draw(st.sampled_from(loading))]
        computed = req.tokens[: req.start * BS]
        delay, _ = self.sched.finished(req.rid, computed, req.pages, None,
                                       cache_salt=req.salt, lora_id=None)
        # vLLM frees its pages when its load reports: a pending save would free them twice.
        assert not delay, f"{req.rid} was given up while loading, yet a save is pending"
        self.finished_ids.add(req.rid)
        req.state = "aborted"

    @precondition(lambda self: any(r.state == "running" for r in self.reqs.values()))
    @rule(data=st.data(), local=st.integers(0, 2))
    def preempt(self, data: st.DataObject, local: int) -> None:
        """vLLM preempts a running request: its pages are freed at once, no connector call;
        it is scheduled again from scratch."""
        COVERAGE["preempt"] += 1
        running = self._ids("running")
        if not running:
            return
        req = self.reqs[data.draw(st.sampled_from(running))]
        self._free_req(req)
        req.state = "new"
        self._schedule(req, local)

    # ------------------------------------------------------------------ the step

    @rule()
    def step(self) -> None:
        """One engine step: build_connector_meta, start_load_kv, get_finished,
        get_block_ids_with_load_errors, build_connector_worker_meta, update_connector_output."""
        COVERAGE["step"] += 1
        plan = self.sched.plan(num_new_tokens=1, longest_context=1)
        self.worker.start(plan)
        finished_ids, self.finished_ids = self.finished_ids, set()
        sending, recving = self.worker.finished(finished_ids)
        errors = self.worker.load_errors()
        self.sched.reported(self.worker.report(), recving)
        self.now += 1.0
        self.steps_since_open += 1
        owner = {p: r for r in self.reqs.values() for p in r.pages}
        for page in errors:
            req = owner.get(page)
            assert req is not None and req.state in ("loading", "aborted"), (
                f"load error for page {page}, which no loading request holds")
            assert req.start <= req.pages.index(page) < req.start + req.loaded
            req.invalid.add(page)
        for rid in recving:
            req = self.reqs.get(rid)
            assert req is not None and req.state in ("loading", "aborted"), (
                f"finished_recving names {rid}, which is not loading")
            self._landed(req)
        for rid in sending:
            req = self.reqs.get(rid)
            assert req is not None and req.state in ("saving",), (
                f"finished_sending names {rid}, whose request_finished did not delay")
            self._free_req(req)
            del self.reqs[rid]
        self.sched.core.check_invariants()

    def _landed(self, req: Req) -> None:
        COVERAGE["loads_landed"] += 1
        COVERAGE["blocks_loaded"] += req.loaded - len(req.invalid)
        COVERAGE["blocks_failed"] += len(req.invalid)
        COVERAGE[f"landed_{req.state}"] += 1
        for b in range(req.start, req.start + req.loaded):
            page = req.pages[b]
            if page in req.invalid:
                continue
            assert torch.equal(self._page(page), block_content(req.salt, req.tokens, b)), (
                f"{req.rid}: page {page} (block {b}) was loaded with the wrong content")
        if req.state != "loading":  # aborted: vLLM frees its pages now
            self._free_req(req)
            del self.reqs[req.rid]
            return
        # Recompute policy: computed tokens are cut at the first invalid block.
        bad = [req.pages.index(p) for p in req.invalid]
        first = min(bad) if bad else req.start + req.loaded
        more = self._alloc(req.blocks() - len(req.pages))
        if more is None:  # no room to run it: vLLM would preempt it
            self._free_req(req)
            req.state = "new"
            del self.reqs[req.rid]
            return
        req.pages += more
        self.sched.allocated(req.rid, req.tokens, req.pages, 0, first * BS,
                             cache_salt=req.salt, lora_id=None)
        req.state = "running"
        self._compute(req, first)

    @rule(readers=st.booleans(), index=st.integers(0, 7), fail=st.integers(0, 3))
    def run_io(self, readers: bool, index: int, fail: int) -> None:
        """One disk batch the worker submitted runs (any of them, in any order); a read batch
        may have items fail."""
        COVERAGE["run_io"] += 1
        reader, writer = self.worker._readers, self.worker._writers
        assert isinstance(reader, HeldPool) and isinstance(writer, HeldPool)
        readers = bool(reader.jobs) and (readers or not writer.jobs)
        pool = reader if readers else writer
        if not pool.jobs:
            return
        store = self.worker.store
        assert isinstance(store, FaultyStore)
        store.fail_mask = fail if readers else 0
        COVERAGE["reads_run" if readers else "writes_run"] += 1
        COVERAGE["reads_failing"] += bool(store.fail_mask)
        pool.run(index)
        store.fail_mask = 0

    def _drain(self) -> None:
        """Steps and I/O until nothing is in flight; every load and save has reported."""
        for _ in range(8):
            self.step()
            readers, writers = self.worker._readers, self.worker._writers
            assert isinstance(readers, HeldPool) and isinstance(writers, HeldPool)
            if not (readers.jobs or writers.jobs or self.finished_ids) and all(
                    r.state in ("running", "new") for r in self.reqs.values()):
                break
            readers.run_all()
            writers.run_all()
        stuck = {r.rid: r.state for r in self.reqs.values() if r.state not in ("running",)}
        assert not stuck, f"loads or saves never reported: {stuck}"

    @precondition(lambda self: self.steps_since_open >= 12)
    @rule()
    def restart(self) -> None:
        """The engine shuts down (in-flight work finishes) and a new one opens the same
        directory: what reached disk is served again, with the right content."""
        COVERAGE["restart"] += 1
        self._drain()
        self.worker.close()
        self.reqs.clear()
        self.worker, self.sched = self._open(self.config)
        self.sched.core.check_invariants()

    # ------------------------------------------------------------------ checks

    @invariant()
    def pages_hold_what_the_engine_put_there(self) -> None:
        for page, value in self.poison.items():
            for layer in self.kv.values():
                assert bool((layer[page] == value).all()), f"free page {page} was written"
        for req in self.reqs.values():
            held = range(len(req.pages))
            if req.state in ("loading", "aborted"):
                held = range(req.start)  # the rest is the connector's until it reports
            for b in held:
                assert torch.equal(self._page(req.pages[b]),
                                   block_content(req.salt, req.tokens, b)), (
                    f"{req.rid}: page {req.pages[b]} (block {b}) changed under the engine")

    def teardown(self) -> None:
        try:
            self._drain()
            self.worker.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def test_connector_serves_only_the_asked_content_through_vllms_calls() -> None:
    COVERAGE.clear()
    run_state_machine_as_test(ConnectorMachine, settings=SETTINGS)
    assert COVERAGE["loads_landed"] > 0 and COVERAGE["saves_delayed"] > 0, COVERAGE


# ---------------------------------------------------------------------- what the machine found


def test_two_requests_hitting_one_host_block_in_a_step_both_get_it() -> None:
    # Two copies from one host page in one step were one batch, which EnginePages refuses
    # ("pages: 0 is repeated"): the worker raised in start_load_kv.
    m = ConnectorMachine()
    try:
        tokens = [*PREFIXES[0][:8], 0]
        m.end(m.add(tokens))
        m.step()
        a, b = m.add(tokens), m.add(tokens)
        assert a.state == b.state == "loading" and a.loaded == b.loaded == 2
        m.step()  # checks both requests' pages as their loads land
        assert a.state == b.state == "running"
    finally:
        m.teardown()


def test_a_step_saving_into_one_host_page_twice_keeps_the_later_copy() -> None:
    # The core may hand a host page to a second save in one step (the first block was
    # evicted at once): in one batch the two scatters had no order, and EnginePages
    # refused it.
    m = ConnectorMachine()
    try:
        w = m.worker
        pages = [m._alloc(1) for _ in range(2)]
        for got, fill in zip(pages, (1.0, 2.0), strict=True):
            assert got is not None
            for layer in m.kv.values():
                layer[got[0]].fill_(fill)
        (p1,), (p2,) = pages  # type: ignore[misc]
        w.start(StepPlan(commands=(
            CopyEngineToHost(block=BlockId(0), engine_page=p1, host_page=PageId(0)),
            CopyEngineToHost(block=BlockId(1), engine_page=p2, host_page=PageId(0)),
            CopyHostToEngine(block=BlockId(1), host_page=PageId(0), engine_page=p1),
        )))
        assert w.host is not None and bool((w.host[0] == 2.0).all())
        assert torch.equal(m._page(p1), m._page(p2))
    finally:
        m.worker.close()
        shutil.rmtree(m.dir, ignore_errors=True)


def test_a_request_given_up_before_its_host_copies_ran_claims_no_save() -> None:
    # Its host copies were not yet sent to the workers, so the core did not count it
    # loading: request_finished saved its own blocks and returned True, and vLLM -- which
    # frees such a request's pages when its load reports -- got the pages reported twice.
    config = connector_config({"host": 3, "model_fingerprint": "fuzz-model"}, layout=LAYOUT,
                              block_size=BS, gpu_blocks=16, rank=0, default_fingerprint="x")
    sched = SchedulerSide(config, world_size=1, instance=INSTANCE, clock=lambda: 1000.0)
    first = list(range(1, 9))
    assert sched.finished("x", first, [0, 1], None, cache_salt=None, lora_id=None)[0]
    # Another request's two blocks take the last page and evict the oldest: block 0 of
    # `first` is gone from the tiers, block 1 is still on the host.
    assert sched.finished("y", list(range(50, 58)), [2, 3], None, cache_salt=None,
                          lora_id=None)[0]
    tokens = [*first, 0]
    assert sched.matched(tokens, BS, cache_salt=None, lora_id=None) == BS
    sched.allocated("z", tokens, [4, 5], BS, BS, cache_salt=None, lora_id=None)
    delay, _ = sched.finished("z", tokens[:BS], [4, 5], None, cache_salt=None, lora_id=None)
    assert not delay
    sched.core.check_invariants()


def test_a_request_given_up_after_its_copies_ran_but_before_vllm_saw_them_claims_no_save(
) -> None:
    # With vLLM's asynchronous scheduling an abort can land between the step that carried a
    # request's host copies and the step whose output reports them (finished_recving): vLLM
    # frees its pages at that report, so a save would report them a second time.
    config = connector_config({"host": 3, "model_fingerprint": "fuzz-model"}, layout=LAYOUT,
                              block_size=BS, gpu_blocks=16, rank=0, default_fingerprint="x")
    sched = SchedulerSide(config, world_size=1, instance=INSTANCE, clock=lambda: 1000.0)
    first = list(range(1, 9))
    assert sched.finished("x", first, [0, 1], None, cache_salt=None, lora_id=None)[0]
    tokens = [*first, 0]
    assert sched.matched(tokens, 0, cache_salt=None, lora_id=None) == 2 * BS
    sched.allocated("z", tokens, [4, 5], 2 * BS, 0, cache_salt=None, lora_id=None)
    sched.plan(num_new_tokens=1, longest_context=1)          # the copies went out
    assert sched.finished("z", tokens[:BS], [4, 5], None, cache_salt=None,
                          lora_id=None) == (False, None)
    sched.reported(None, {"z"})                              # vLLM saw the load finish
    assert sched.finished("z", tokens[: 2 * BS], [4, 5], None, cache_salt=None,
                          lora_id=None)[1] is None
