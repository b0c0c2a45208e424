"""io_actors.metrics: a cache's statistics() as Prometheus metrics on a user's own registry."""

from __future__ import annotations

from pathlib import Path

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from io_actors.embed import BlockingCache
from io_actors.metrics import CACHE_FIELDS, COUNTER, StateKVCollector
from statekv.stats import CacheStatistics
from tests.io_helpers import BLOCK_SIZE, serve, small_config, wait_quiet


def test_every_field_of_statistics_is_a_metric_with_its_value(tmp_path: Path) -> None:
    with BlockingCache(small_config(tmp_path)) as cache:
        # Enough distinct prompts to push blocks through host to disk, then one back.
        prompts = [[1000 * n + i for i in range(3 * BLOCK_SIZE + 1)] for n in range(6)]
        for n, prompt in enumerate(prompts):
            serve(cache, f"r{n}", prompt, ttl_seconds=60)
        wait_quiet(cache)
        serve(cache, "again", prompts[0])
        wait_quiet(cache)

        registry = CollectorRegistry()  # the user's own, not the process-wide default
        registry.register(StateKVCollector(cache.statistics, constant_labels={"rank": "0"}))
        text = generate_latest(registry).decode()
        stats = cache.statistics()

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value

    values = attrs.asdict(stats.cache)
    assert set(CACHE_FIELDS) == set(attrs.fields_dict(CacheStatistics))
    for field, (name, kind, labels, _doc) in CACHE_FIELDS.items():
        full = f"statekv_{name}"
        assert types[full] == kind
        if field == "blocks_by_state":
            for state, count in stats.cache.blocks_by_state:
                assert samples[full, (("rank", "0"), ("state", state))] == count
            continue
        sample_name = f"{full}_total" if kind == COUNTER else full
        key = tuple(sorted({"rank": "0", **labels}.items()))
        assert samples[sample_name, key] == values[field], field
    # The run did reach the disk, so the values compared are not all zero.
    assert stats.cache.spills_completed > 0 and stats.cache.hit_tokens_disk > 0
    assert samples["statekv_prompt_tokens_total", (("rank", "0"), ("tier", "disk"))] == (
        stats.cache.hit_tokens_disk)
    assert stats.writer is not None
    assert samples["statekv_io_jobs_completed_total", (("pool", "writer"), ("rank", "0"))] == (
        stats.writer.completed)
    assert samples["statekv_spill_backlog", (("rank", "0"),)] == stats.spill_backlog
