"""A Hypothesis state machine over statekv.engine_tiers with the bytes followed
(tests/engine_harness.py): saves, loads, disk writes and reads landing or failing in any
order, time passing, restarts on the same disk image -- and after every step, the core's
invariants, and the one property a user of an engine cares about: **a load that lands fills
its engine page with exactly the content of the block the engine asked for**, and a block
whose read failed is never offered again until it is saved anew.

The budget follows STATEKV_FUZZ_PROFILE as the other machines do (tests/test_fuzz_machines.py).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from statekv.messages import LoadSlot
from tests.engine_harness import Content, EngineHarness, engine_config

_EXAMPLES = {"ci": 150, "soak": 2000, "mutation": 60, "gpu": 150}
_PROFILE = os.environ.get("STATEKV_FUZZ_PROFILE", "ci")

# Three shared prefixes, each extended in a few ways: lookups hit, miss and hit partly.
_STEMS = [[1000 * s + i for i in range(12)] for s in range(3)]


def _prompt(stem: int, tail: int, length: int) -> list[int]:
    base = _STEMS[stem][:length]
    return [*base, 50_000 + 100 * tail + stem, 9]


class EngineTiersMachine(RuleBasedStateMachine):
    harness: EngineHarness

    @initialize(host=st.integers(1, 4), reserved=st.integers(1, 2), disk=st.integers(2, 6),
                write_through=st.sampled_from(["all", "retained", "none"]),
                protect=st.booleans())
    def open(self, host: int, reserved: int, disk: int, write_through: str,
             protect: bool) -> None:
        config = engine_config(host_blocks=host, reserved_host_blocks=reserved,
                               disk_blocks=disk, protect_unexpired=protect,
                               cost_aware_onboarding=False)
        self.harness = EngineHarness(config, write_through=write_through)
        self.next_page = 0
        self.expected: dict[int, Content] = {}   # engine page -> what a landed load must hold
        self.loading: dict[int, str] = {}        # transfer -> request
        self.failed: set[Content] = set()        # content whose read failed, not saved since
        self.rid = 0

    def _pages(self, n: int) -> list[int]:
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return pages

    @rule(stem=st.integers(0, 2), tail=st.integers(0, 2), length=st.integers(4, 12),
          ttl=st.sampled_from([None, None, 5.0, 600.0]))
    def save(self, stem: int, tail: int, length: int, ttl: float | None) -> None:
        h = self.harness
        prompt = _prompt(stem, tail, length)
        full = len(prompt) // h.bs
        pages = self._pages(full)
        h.compute(prompt, pages)
        h.save(prompt[: full * h.bs], pages, ttl=ttl)
        for i in range(full):
            self.failed.discard(h.content(prompt, i))

    @rule(stem=st.integers(0, 2), tail=st.integers(0, 2), length=st.integers(4, 12),
          start=st.integers(0, 2))
    def load(self, stem: int, tail: int, length: int, start: int) -> None:
        h = self.harness
        prompt = _prompt(stem, tail, length)
        match = h.tiers.lookup(prompt, start_block=start)
        assert h.tiers.lookup(prompt, start_block=start) == match   # asking changed nothing
        if not match.num_blocks:
            return
        pages = self._pages(match.num_blocks)
        self.rid += 1
        rid = f"r{self.rid}"
        for i, page in enumerate(pages):
            content = h.content(prompt, start + i)
            assert content not in self.failed, f"a block whose read failed is offered: {i}"
            self.expected[page] = content
        plan = h.tiers.start_load(rid, prompt, start_block=start, engine_pages=pages,
                                  now=h.now)
        assert plan.unavailable_pages == ()
        assert plan.host_blocks + plan.disk_blocks == match.num_blocks
        h.run()
        for tid in plan.transfers:
            self.loading[tid] = rid
        # Host hits are copied at once (stream ordered): their pages hold the content now.
        for page in pages:
            if page in h.engine:
                assert h.engine[page] == self.expected[page], f"page {page} wrong at once"

    @precondition(lambda self: bool(self.harness.writes))
    @rule(data=st.data(), ok=st.booleans())
    def land_a_write(self, data: st.DataObject, ok: bool) -> None:
        h = self.harness
        h.land_write(data.draw(st.integers(0, len(h.writes) - 1)), ok=ok or len(h.writes) > 3)

    @precondition(lambda self: bool(self.harness.loads))
    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]))
    def land_a_load(self, data: st.DataObject, ok: bool) -> None:
        h = self.harness
        index = data.draw(st.integers(0, len(h.loads) - 1))
        load: LoadSlot = h.loads[index]
        content = self.expected[load.engine_page]
        # A read in flight owns its slot: nothing was written over it meanwhile.
        image = h.disk.get(load.slot)
        assert image is not None and image.key == load.key and image.content == content, (
            f"load {load.transfer}: slot {load.slot} does not hold the block under the read")
        h.land_load(index, ok=ok)
        self.loading.pop(load.transfer)
        if ok:
            assert h.engine[load.engine_page] == content, (
                f"engine page {load.engine_page} holds other content")
        else:
            assert load.engine_page not in h.engine    # a failed read is never served
            self.failed.add(content)

    @rule(seconds=st.sampled_from([1.0, 10.0, 1000.0]))
    def time_passes(self, seconds: float) -> None:
        h = self.harness
        h.now += seconds
        h.tiers.advance(h.now)

    @rule(later=st.sampled_from([0.0, 3.0, 5000.0]))
    def restart(self, later: float) -> None:
        h = self.harness
        h.restart(later=later)
        self.loading.clear()
        self.failed = {c for c in self.failed}   # failed content stays failed on disk too

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "harness"):
            self.harness.tiers.check_invariants()
            assert {load.transfer for load in self.harness.loads} == set(self.loading)


EngineTiersMachine.TestCase.settings = settings(
    max_examples=_EXAMPLES.get(_PROFILE, 150), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=_PROFILE == "mutation",
)
test_engine_tiers_against_the_bytes = EngineTiersMachine.TestCase
