"""FaultyStore: every injected fault ends in TransferFailed, now or at read-back; never in
wrong bytes.  Scenarios are enumerated SQLite-style: count the calls, then fail each one."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from io_actors.storage.faults import (
    POISON,
    Fault,
    FaultPlan,
    FaultRule,
    FaultyStore,
    Op,
    single_fault_plans,
)
from io_actors.storage.interfaces import BatchOutcome, SlotIO, SlotStore, read_each, write_each
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import DATA_FILE
from io_actors.storage.slot_format import SlotMeta
from statekv.config import CacheConfig, KVLayout
from statekv.errors import TransferFailed, UsageError
from statekv.ids import BlockHash, SlotId

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
CONFIG = CacheConfig(block_size=16, gpu_blocks=2, host_blocks=2, disk_blocks=8, layout=LAYOUT)
"""16 KiB blocks: four payload pages, so torn writes have room to tear."""
SLOTS = 4

MakeStore = Callable[[], PosixSlotStore]

WRITE_FAULTS = [
    Fault.EIO_OPEN, Fault.EIO, Fault.ENOSPC, Fault.SHORT_WRITE, Fault.TORN_WRITE,
    Fault.TORN_WRITE_SILENT, Fault.BIT_FLIP,
]
READ_FAULTS = [Fault.EIO_OPEN, Fault.EIO, Fault.SHORT_READ]


def key(generation: int, slot: int) -> BlockHash:
    return BlockHash(bytes([generation, slot]) * 16)


def payload(generation: int, slot: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(generation * 1000 + slot)
    return torch.randint(0, 256, (CONFIG.block_bytes,), dtype=torch.uint8, generator=gen)


@attrs.define
class Outcome:
    failed_writes: list[tuple[int, int]] = attrs.Factory(list)
    """(generation, slot) of writes that raised."""
    failed_reads: list[tuple[int, int]] = attrs.Factory(list)
    """(generation, slot) of reads that raised."""
    bad_bytes: list[tuple[int, int]] = attrs.Factory(list)
    """(generation, slot) of reads that returned bytes other than that generation's."""


def scenario(store: SlotStore) -> Outcome:
    """Fill every slot (generation 0), overwrite it (generation 1), read both back.

    A read of generation g may fail or return generation g's bytes exactly; anything else
    is a wrong-bytes bug.
    """
    outcome = Outcome()
    for generation, slot in itertools.product((0, 1), range(SLOTS)):
        try:
            store.write(SlotId(slot), key(generation, slot), payload(generation, slot))
        except TransferFailed:
            outcome.failed_writes.append((generation, slot))
    for slot, generation in itertools.product(range(SLOTS), (1, 0)):
        dst = torch.zeros(CONFIG.block_bytes, dtype=torch.uint8)
        try:
            store.read(SlotId(slot), key(generation, slot), dst)
        except TransferFailed:
            outcome.failed_reads.append((generation, slot))
            continue
        if not torch.equal(dst, payload(generation, slot)):
            outcome.bad_bytes.append((generation, slot))
    return outcome


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[MakeStore]:
    """A factory of fresh POSIX stores in distinct directories, closed after the test."""
    counter = itertools.count()
    opened: list[PosixSlotStore] = []

    def make() -> PosixSlotStore:
        store = PosixSlotStore(tmp_path / f"s{next(counter)}", CONFIG)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def counted_calls(make: MakeStore) -> tuple[int, int]:
    counting = FaultyStore(make(), FaultPlan())
    outcome = scenario(counting)
    assert outcome == Outcome(failed_reads=[(0, s) for s in range(SLOTS)])
    return counting.calls(Op.WRITE), counting.calls(Op.READ)


def test_counting_mode_counts_every_call_and_injects_nothing(fresh: MakeStore) -> None:
    writes, reads = counted_calls(fresh)
    assert (writes, reads) == (2 * SLOTS, 2 * SLOTS)


@pytest.mark.parametrize("fault", WRITE_FAULTS, ids=lambda f: f.value)
def test_each_write_fault_fails_loudly_and_never_serves_wrong_bytes(
    fresh: MakeStore, fault: Fault
) -> None:
    writes, _ = counted_calls(fresh)
    for plan in single_fault_plans(Op.WRITE, fault, writes, seed=7):
        store = FaultyStore(fresh(), plan)
        outcome = scenario(store)
        assert outcome.bad_bytes == [], plan
        (injected,) = store.statistics().injected
        call = int(injected.split("#")[1].split(":")[0])
        generation, slot = divmod(call - 1, SLOTS)
        faulted = (generation, slot)
        assert faulted in outcome.failed_writes or faulted in outcome.failed_reads, plan
        if fault in {Fault.BIT_FLIP, Fault.TORN_WRITE_SILENT}:
            assert faulted not in outcome.failed_writes
            assert faulted in outcome.failed_reads


@pytest.mark.parametrize("fault", READ_FAULTS, ids=lambda f: f.value)
def test_each_read_fault_raises_and_poisons_rather_than_returning_bytes(
    fresh: MakeStore, fault: Fault
) -> None:
    _, reads = counted_calls(fresh)
    for plan in single_fault_plans(Op.READ, fault, reads, seed=3):
        store = FaultyStore(fresh(), plan)
        outcome = scenario(store)
        assert outcome.bad_bytes == []
        assert len(outcome.failed_reads) == SLOTS + (1 if plan.rules[0].nth % 2 else 0)


def test_failed_reads_leave_poison_not_stale_bytes(fresh: MakeStore) -> None:
    for fault in (Fault.EIO, Fault.SHORT_READ):
        plan = FaultPlan(rules=(FaultRule(op=Op.READ, fault=fault, nth=1),), seed=1)
        store = FaultyStore(fresh(), plan)
        store.write(SlotId(0), key(0, 0), payload(0, 0))
        dst = torch.zeros(CONFIG.block_bytes, dtype=torch.uint8)
        with pytest.raises(TransferFailed, match="injected"):
            store.read(SlotId(0), key(0, 0), dst)
        assert bool((dst[-1:] == POISON).all())
        assert not torch.equal(dst, payload(0, 0))


def test_onward_rules_fail_every_later_call(fresh: MakeStore) -> None:
    plan = FaultPlan(rules=(FaultRule(op="write", fault="enospc", nth=3, onward=True),))
    store = FaultyStore(fresh(), plan)
    outcome = scenario(store)
    assert outcome.bad_bytes == []
    expected = [(g, s) for g, s in itertools.product((0, 1), range(SLOTS))][2:]
    assert outcome.failed_writes == expected


def test_slow_calls_sleep_then_succeed(fresh: MakeStore) -> None:
    slept: list[float] = []
    plan = FaultPlan(rules=(
        FaultRule(op=Op.WRITE, fault=Fault.SLOW, nth=2, delay_s=0.25),
        FaultRule(op=Op.READ, fault=Fault.SLOW, nth=1, onward=True, delay_s=0.5),
    ))
    store = FaultyStore(fresh(), plan, sleep=slept.append)
    outcome = scenario(store)
    assert outcome.bad_bytes == [] and outcome.failed_writes == []
    assert slept == [0.25] + [0.5] * (2 * SLOTS)


def test_the_first_matching_rule_wins(fresh: MakeStore) -> None:
    plan = FaultPlan(rules=(
        FaultRule(op=Op.WRITE, fault=Fault.ENOSPC, nth=1),
        FaultRule(op=Op.WRITE, fault=Fault.EIO_OPEN, nth=1, onward=True),
    ))
    store = FaultyStore(fresh(), plan)
    scenario(store)
    injected = store.statistics().injected
    assert injected[0] == "write#1:enospc"
    assert all(entry.endswith("eio_open") for entry in injected[1:])


@pytest.mark.parametrize("fault", [Fault.TORN_WRITE, Fault.TORN_WRITE_SILENT, Fault.SHORT_WRITE,
                                   Fault.BIT_FLIP])
def test_a_plan_replays_to_identical_disk_bytes(fresh: MakeStore, fault: Fault) -> None:
    images = []
    for _ in range(2):
        inner = fresh()
        plan = FaultPlan(rules=(FaultRule(op=Op.WRITE, fault=fault, nth=6),), seed=11)
        scenario(FaultyStore(inner, plan))
        images.append((inner.path.parent / DATA_FILE).read_bytes())
    assert images[0] == images[1]


def test_different_seeds_tear_differently(fresh: MakeStore) -> None:
    images = set()
    for seed in range(6):
        inner = fresh()
        plan = FaultPlan(rules=(FaultRule(op=Op.WRITE, fault=Fault.TORN_WRITE, nth=5),), seed=seed)
        scenario(FaultyStore(inner, plan))
        images.add((inner.path.parent / DATA_FILE).read_bytes())
    assert len(images) > 1


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), fault=st.sampled_from([Fault.BIT_FLIP, Fault.TORN_WRITE_SILENT]))
def test_silent_corruption_is_always_caught_at_read(
    tmp_path_factory: pytest.TempPathFactory, seed: int, fault: Fault
) -> None:
    inner = PosixSlotStore(tmp_path_factory.mktemp("silent"), CONFIG)
    try:
        inner.write(SlotId(1), key(0, 1), payload(0, 1))
        store = FaultyStore(inner, FaultPlan(rules=(FaultRule(op=Op.WRITE, fault=fault, nth=1),),
                                             seed=seed))
        store.write(SlotId(1), key(1, 1), payload(1, 1))
        dst = torch.zeros(CONFIG.block_bytes, dtype=torch.uint8)
        with pytest.raises(TransferFailed):
            store.read(SlotId(1), key(1, 1), dst)
    finally:
        inner.close()


# --- plan validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"op": Op.READ, "fault": Fault.BIT_FLIP}, "op"),
        ({"op": Op.WRITE, "fault": Fault.SHORT_READ}, "op"),
        ({"op": "append", "fault": Fault.EIO}, "op"),
        ({"op": Op.READ, "fault": "melted"}, "fault"),
        ({"nth": 0}, "nth"),
        ({"nth": True}, "nth"),
        ({"onward": 1}, "onward"),
        ({"fault": Fault.SLOW, "delay_s": -1.0}, "delay_s"),
        ({"fault": Fault.SLOW, "delay_s": float("nan")}, "delay_s"),
        ({"delay_s": 1.0}, "delay_s"),
    ],
)
def test_bad_rules_raise_usage_error_naming_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    fields: dict[str, object] = {"op": Op.READ, "fault": Fault.EIO, "nth": 1}
    fields.update(kwargs)
    with pytest.raises(UsageError) as info:
        FaultRule(**fields)  # type: ignore[arg-type]
    assert info.value.field == field


def test_bad_plans_raise_usage_error_naming_the_field() -> None:
    with pytest.raises(UsageError) as info:
        FaultPlan(rules=("eio",))
    assert info.value.field == "rules"
    with pytest.raises(UsageError) as info:
        FaultPlan(seed="x")  # type: ignore[arg-type]
    assert info.value.field == "seed"
    with pytest.raises(UsageError) as info:
        single_fault_plans(Op.WRITE, Fault.EIO, -1)
    assert info.value.field == "calls"


class _MemoryStore:
    """A store with no on-disk extent: only seam-level faults can apply to it."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[bytes, torch.Tensor]] = {}

    @property
    def device_reads(self) -> bool:
        return False

    def write(
        self, slot: SlotId, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None
    ) -> None:
        self.slots[slot] = (key, src.clone())

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        stored_key, data = self.slots[slot]
        if stored_key != key:
            raise TransferFailed(f"slot {slot}", "key mismatch")
        dst.copy_(data)

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        return write_each(self, writes)

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        return read_each(self, reads)

    def discard(self, slot: SlotId) -> None:
        self.slots.pop(slot, None)

    def close(self) -> None:
        self.slots.clear()


def test_disk_faults_need_a_store_that_exposes_slot_extents() -> None:
    for fault in (Fault.BIT_FLIP, Fault.TORN_WRITE):
        with pytest.raises(UsageError) as info:
            plan = FaultPlan(rules=(FaultRule(op=Op.WRITE, fault=fault, nth=1),))
            FaultyStore(_MemoryStore(), plan)
        assert info.value.field == "plan"


def test_seam_faults_work_on_any_store() -> None:
    plan = FaultPlan(rules=(FaultRule(op=Op.WRITE, fault=Fault.ENOSPC, nth=2),))
    store = FaultyStore(_MemoryStore(), plan)
    outcome = scenario(store)
    assert outcome.bad_bytes == []
    assert outcome.failed_writes == [(0, 1)]
    store.discard(SlotId(0))
    assert store.statistics().discards == 1
    store.close()


def test_after_a_crash_nothing_reaches_the_disk(fresh: MakeStore) -> None:
    inner = fresh()
    store = FaultyStore(inner, FaultPlan(rules=(FaultRule(op=Op.WRITE, fault=Fault.CRASH,
                                                          nth=3),), seed=4))
    image_before = None
    for slot in range(SLOTS):
        if slot == 3:
            image_before = (inner.path.parent / DATA_FILE).read_bytes()
        try:
            store.write(SlotId(slot), key(0, slot), payload(0, slot))
        except TransferFailed as exc:
            assert "crashed" in str(exc)
            assert slot >= 2
    assert store.crashed_at == 3
    # The fourth write raised without touching the disk; so does every read.
    assert (inner.path.parent / DATA_FILE).read_bytes() == image_before
    dst = torch.zeros(CONFIG.block_bytes, dtype=torch.uint8)
    with pytest.raises(TransferFailed, match="crashed"):
        store.read(SlotId(0), key(0, 0), dst)
    # What did land reads back intact; the crashed write is all, some or none of its pages.
    assert bytes(dst) == bytes([POISON]) * CONFIG.block_bytes
    for slot in (0, 1):
        inner.read(SlotId(slot), key(0, slot), dst)
        assert torch.equal(dst, payload(0, slot))
