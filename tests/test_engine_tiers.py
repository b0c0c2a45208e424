"""statekv beneath an engine's prefix cache (statekv.engine_tiers), through its public calls,
with the bytes followed by tests/engine_harness.py: what a lookup offers is exactly what a
load delivers, a failed read is never offered again, and the tiers keep copies."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from statekv.errors import ConfigError, UsageError
from statekv.lifecycle import BlockState
from statekv.messages import LoadSlots
from tests.engine_harness import EngineHarness, engine_config

S = BlockState


def tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def _one_block_on_disk() -> tuple[EngineHarness, list[int]]:
    """A one-page host tier, a prompt `a` of one full block saved, then pushed to disk by
    another prompt's save."""
    h = EngineHarness(engine_config(host_blocks=1, reserved_host_blocks=1))
    a = tokens(h.bs + 1)
    h.compute(a, [0])
    h.save(a[: h.bs], [0])
    h.compute(tokens(h.bs + 1, 500), [1])
    h.save(tokens(h.bs, 500), [1])
    h.drain()
    return h, a


def test_a_saved_prompt_is_offered_past_the_engines_blocks_and_loaded_byte_for_byte() -> None:
    h = EngineHarness()
    prompt = tokens(4 * h.bs + 1)
    h.compute(prompt, [10, 11, 12, 13])
    h.save(prompt[: 4 * h.bs], [10, 11, 12, 13])
    # The engine still has block 0 (its own prefix cache); the tiers supply 1..3.
    match = h.tiers.lookup(prompt, start_block=1)
    assert (match.num_blocks, match.host_blocks, match.disk_blocks) == (3, 3, 0)
    assert h.tiers.lookup(prompt, start_block=1) == match  # asking changes nothing
    h.load("r", prompt, 1, [20, 21, 22])
    for i, page in enumerate([20, 21, 22], start=1):
        assert h.engine[page] == h.content(prompt, i)
    h.tiers.check_invariants()


def test_the_last_prompt_token_is_always_left_to_compute() -> None:
    h = EngineHarness()
    prompt = tokens(2 * h.bs)
    h.compute(prompt, [0, 1])
    h.save(prompt, [0, 1])
    assert h.tiers.lookup(prompt, start_block=0).num_blocks == 1
    assert h.tiers.lookup([*prompt, 99], start_block=0).num_blocks == 2
    with pytest.raises(UsageError) as info:
        h.tiers.start_load("r", prompt, start_block=0, engine_pages=[5, 6], now=h.now)
    assert info.value.field == "engine_pages"


def test_host_pressure_spills_and_a_disk_hit_is_read_back_and_stays_on_disk() -> None:
    h = EngineHarness(engine_config(host_blocks=2, reserved_host_blocks=1, disk_blocks=8))
    a, b = tokens(2 * h.bs + 1), tokens(2 * h.bs + 1, base=1000)
    h.compute(a, [0, 1])
    h.save(a[: 2 * h.bs], [0, 1])
    h.compute(b, [2, 3])
    h.save(b[: 2 * h.bs], [2, 3])      # a's blocks spill to make room
    h.drain()
    match = h.tiers.lookup(a, start_block=0)
    assert (match.num_blocks, match.disk_blocks) == (2, 2)
    transfers = h.load("r", a, 0, [40, 41])
    assert len(transfers) == 2 and h.tiers.loading("r")
    assert set(h.tiers.cached_keys().values()) >= {S.LOADING}
    h.land_load()
    h.land_load()
    assert not h.tiers.loading("r")
    assert h.engine[40] == h.content(a, 0) and h.engine[41] == h.content(a, 1)
    # Inclusive: still on disk, offered again.
    assert h.tiers.lookup(a, start_block=0).disk_blocks == 2
    h.tiers.check_invariants()


def test_two_requests_may_read_one_disk_block_at_once() -> None:
    h, a = _one_block_on_disk()
    assert h.tiers.lookup(a, start_block=0).disk_blocks == 1
    h.load("r1", a, 0, [10])
    h.load("r2", a, 0, [11])
    h.tiers.check_invariants()
    h.land_load(1)
    assert h.tiers.loading("r1") and not h.tiers.loading("r2")
    h.land_load()
    assert h.engine[10] == h.engine[11] == h.content(a, 0)
    h.tiers.check_invariants()


def test_a_failed_read_is_never_offered_again_and_its_slot_waits_for_every_read() -> None:
    h, a = _one_block_on_disk()
    h.load("r1", a, 0, [10])
    h.load("r2", a, 0, [11])
    empty_before = h.tiers.statistics().disk_empty_slots
    h.land_load(0, ok=False)
    assert h.tiers.lookup(a, start_block=0).num_blocks == 0      # out of the index at once
    assert h.tiers.statistics().disk_empty_slots == empty_before  # r2's read keeps the slot
    h.tiers.check_invariants()
    h.land_load()
    assert h.tiers.statistics().disk_empty_slots == empty_before + 1
    assert h.tiers.statistics().onboard_failures == 1
    h.tiers.check_invariants()


def test_a_request_given_up_while_loading_keeps_its_reads_until_they_report() -> None:
    h, a = _one_block_on_disk()
    h.load("r1", a, 0, [10])
    # The engine aborts r1: nothing to call, but the pages must stay the engine's until
    # loading() says the read reported; a spill storm meanwhile never takes the slot.
    for n in range(6):
        t = tokens(h.bs + 1, 2000 + 100 * n)
        h.compute(t, [30 + n])
        h.save(t[: h.bs], [30 + n])
        while h.writes:
            h.land_write()
    assert h.tiers.loading("r1")
    h.land_load()
    assert h.engine[10] == h.content(a, 0)
    assert not h.tiers.loading("r1")
    h.tiers.check_invariants()


def test_an_engine_page_reused_after_the_save_ran_does_not_change_the_saved_copy() -> None:
    h = EngineHarness()
    a = tokens(h.bs + 1)
    h.compute(a, [7])
    h.save(a[: h.bs], [7])          # the copy runs (stream ordered) before the page is reused
    h.engine[7] = ("other content",)
    h.load("r", a, 0, [8])
    assert h.engine[8] == h.content(a, 0)


def test_a_saved_block_is_stamped_and_an_earlier_copy_is_only_stamped() -> None:
    h = EngineHarness()
    a = tokens(2 * h.bs + 1)
    h.compute(a, [0, 1])
    h.save(a[: 2 * h.bs], [0, 1])
    out = h.tiers.save(a[: 2 * h.bs], engine_pages=[5, 6], now=h.now, ttl_seconds=60)
    assert (out.saved_blocks, out.cached_blocks, out.unsaved_blocks) == (0, 2, 0)
    assert not [c for c in h.tiers.take_commands() if c.__class__.__name__ != "WriteSlots"]


def test_cache_salt_separates_tenants() -> None:
    h = EngineHarness()
    a = tokens(h.bs + 1)
    h.compute(a, [0], salt="alice")
    h.save(a[: h.bs], [0], salt="alice")
    assert h.tiers.lookup(a, start_block=0, cache_salt="alice").num_blocks == 1
    assert h.tiers.lookup(a, start_block=0, cache_salt="bob").num_blocks == 0
    assert h.tiers.lookup(a, start_block=0).num_blocks == 0


def test_retained_content_survives_a_restart_and_best_effort_is_displaced_first() -> None:
    h = EngineHarness(engine_config(host_blocks=1, reserved_host_blocks=1, disk_blocks=3))
    kept = tokens(h.bs + 1, 0)
    h.compute(kept, [0])
    h.save(kept[: h.bs], [0], ttl=3600)
    for n in range(6):   # best-effort churn through a 3-slot disk
        t = tokens(h.bs + 1, 100 * (n + 1))
        h.compute(t, [1 + n])
        h.save(t[: h.bs], [1 + n])
        h.drain()
    h.restart(later=10)
    assert h.tiers.lookup(kept, start_block=0).disk_blocks == 1
    h.load("r", kept, 0, [50])
    h.drain()
    assert h.engine[50] == h.content(kept, 0)
    # After its deadline it is best-effort, and displaced like any other.
    h.restart(later=3600)
    for n in range(4):
        t = tokens(h.bs + 1, 10_000 + 100 * n)
        h.compute(t, [20 + n])
        h.save(t[: h.bs], [20 + n])
        h.drain()
    assert h.tiers.lookup(kept, start_block=0).num_blocks == 0
    h.tiers.check_invariants()


def test_the_cost_gate_recomputes_a_slow_disk_run_and_probes_it_again() -> None:
    h, a = _one_block_on_disk()
    h.tiers.report_disk_read(1, 10.0)                       # 0.1 B/s: hopeless
    h.tiers.report_prefill(1000, 0.001, context_tokens=8)   # and a fast model
    match = h.tiers.lookup(a, start_block=0)
    assert (match.num_blocks, match.skipped_disk_blocks) == (0, 1)
    cuts = 0
    while h.tiers.lookup(a, start_block=0).num_blocks == 0:
        h.tiers.start_load(f"r{cuts}", a, start_block=0, engine_pages=[], now=h.now)
        cuts += 1
        assert cuts <= 16
    assert cuts == 16                                       # statekv.cost.PROBE_EVERY
    assert h.tiers.lookup(a, start_block=0).num_blocks == 1  # the probe reads anyway


@pytest.mark.parametrize(
    ("pages", "field"),
    [([1, 1], "engine_pages"), ([-1], "engine_pages"), ([True], "engine_pages"),
     ("ab", "engine_pages")],
)
def test_bad_engine_pages_are_refused_before_anything_changes(pages: object, field: str) -> None:
    h = EngineHarness()
    a = tokens(3 * h.bs + 1)
    h.compute(a, [0, 1, 2])
    before = h.tiers.statistics()
    with pytest.raises(UsageError) as info:
        h.tiers.save(a[: 3 * h.bs], engine_pages=pages, now=h.now)  # type: ignore[arg-type]
    assert info.value.field == field
    assert h.tiers.statistics() == before
    assert h.tiers.take_commands() == []


def test_bad_arguments_name_their_field() -> None:
    h = EngineHarness()
    a = tokens(h.bs + 1)
    h.compute(a, [0])
    h.save(a[: h.bs], [0])
    calls: list[tuple[Callable[[], object], str]] = [
        (lambda: h.tiers.lookup(a, start_block=-1), "start_block"),
        (lambda: h.tiers.lookup([], start_block=0), "token_ids"),
        (lambda: h.tiers.save(a, engine_pages=[0], now=h.now, ttl_seconds=-1), "ttl_seconds"),
        (lambda: h.tiers.save(a, engine_pages=[], now=h.now), "engine_pages"),
        (lambda: h.tiers.save(a, engine_pages=[0], now=h.now - 1e9), "now"),
        (lambda: h.tiers.start_load("", a, start_block=0, engine_pages=[], now=h.now),
         "request_id"),
    ]
    for call, field in calls:
        with pytest.raises(UsageError) as info:
            call()
        assert info.value.field == field


def test_engine_tiers_need_a_host_tier_and_no_shared_tier() -> None:
    with pytest.raises(ConfigError) as info:
        EngineHarness(engine_config(host_blocks=0, reserved_host_blocks=0, disk_blocks=0))
    assert info.value.field == "host_blocks"
    with pytest.raises(ConfigError) as info:
        EngineHarness(engine_config(shared_tier=True))
    assert info.value.field == "shared_tier"


def test_write_through_puts_a_saved_block_on_disk_and_keeps_it_a_host_hit() -> None:
    h = EngineHarness(write_through="all")
    a = tokens(2 * h.bs + 1)
    h.compute(a, [0, 1])
    h.save(a[: 2 * h.bs], [0, 1])
    assert len(h.writes) == 2                      # written at once
    h.drain()
    match = h.tiers.lookup(a, start_block=0)
    assert (match.host_blocks, match.disk_blocks) == (2, 0)   # still host hits
    h.tiers.check_invariants()
    h.restart(later=1)                             # host memory is gone, the disk is not
    assert h.tiers.lookup(a, start_block=0).disk_blocks == 2
    h.load("r", a, 0, [30, 31])
    h.drain()
    assert [h.engine[30], h.engine[31]] == [h.content(a, 0), h.content(a, 1)]


def test_write_through_of_retained_content_only() -> None:
    h = EngineHarness(write_through="retained")
    kept, other = tokens(h.bs + 1), tokens(h.bs + 1, 700)
    h.compute(kept, [0])
    h.save(kept[: h.bs], [0], ttl=600)
    h.compute(other, [1])
    h.save(other[: h.bs], [1])
    assert len(h.writes) == 1                       # only the TTL block is written
    h.drain()
    h.restart()
    assert h.tiers.lookup(kept, start_block=0).disk_blocks == 1
    assert h.tiers.lookup(other, start_block=0).num_blocks == 0


def test_an_unknown_write_through_policy_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        EngineHarness(write_through="sometimes")
    assert info.value.field == "write_through"


def test_two_loads_of_one_block_in_one_step_travel_in_different_batches() -> None:
    """A vectored read names each slot once (the store refuses a batch that does not)."""
    h, a = _one_block_on_disk()
    h.tiers.start_load("r1", a, start_block=0, engine_pages=[10], now=h.now)
    h.tiers.start_load("r2", a, start_block=0, engine_pages=[11], now=h.now)
    batches = [c for c in h.tiers.take_commands() if isinstance(c, LoadSlots)]
    assert [len(b.reads) for b in batches] == [1, 1]
    assert batches[0].reads[0].slot == batches[1].reads[0].slot
