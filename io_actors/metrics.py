"""Prometheus metrics of a cache, read from ``statistics()`` at scrape time.

A :class:`StateKVCollector` is a prometheus-client custom collector: it keeps no counters of
its own and adds nothing to the cache's hot path; each scrape takes one ``statistics()``
snapshot and turns every field into a metric.  Register it on any registry::

    from prometheus_client import CollectorRegistry, generate_latest
    from io_actors.metrics import StateKVCollector

    registry = CollectorRegistry()
    registry.register(StateKVCollector(cache.statistics))
    print(generate_latest(registry).decode())

Names follow Prometheus' conventions: a ``statekv_`` prefix, ``_total`` on counters, base
units (``_bytes``), one family with a label where fields differ only by tier, pool or state
(``statekv_prompt_tokens_total{tier="disk"}``).  ``constant_labels`` (e.g. ``{"rank": "0"}``)
go on every sample.

Transfer latency histograms are not here: the pools do not time their transfers, and timing
them would add a clock read and a lock to every transfer (the trace recorder has per-transfer
times when they are needed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Final

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ModuleNotFoundError as exc:
    # prometheus-client is an extra (the cache itself exports nothing): name the one that
    # brings it, not only the module that is missing.
    raise ModuleNotFoundError(
        f"io_actors.metrics needs prometheus-client ({exc.name} is not installed): "
        "pip install 'statekv[metrics]'", name=exc.name) from None

from io_actors.actors.scheduler import SystemStatistics
from io_actors.actors.worker_threads import PoolStatistics
from statekv.stats import CacheStatistics

PREFIX: Final = "statekv"

# Every field of CacheStatistics, once: (metric name without prefix or _total, kind, labels,
# help).  A test checks that every field is listed, so a new counter cannot go unexported.
COUNTER: Final = "counter"
GAUGE: Final = "gauge"
CACHE_FIELDS: Final[dict[str, tuple[str, str, dict[str, str], str]]] = {
    "requests_added": ("requests_added", COUNTER, {}, "Requests registered with add_request."),
    "prefix_cache_queries": ("prefix_cache_queries", COUNTER, {},
                             "Prompt tokens looked up in the cache (vLLM's "
                             "prefix_cache_queries)."),
    "prefix_cache_hits": ("prefix_cache_hits", COUNTER, {},
                          "Of those, tokens taken from the cache on any tier (vLLM's "
                          "prefix_cache_hits)."),
    "requests_released": ("requests_released", COUNTER, {},
                          "Requests released (finished or cancelled)."),
    "requests_parked": ("requests_parked", COUNTER, {},
                        "Requests that waited for at least one disk read when added."),
    "parked_requests": ("parked_requests", GAUGE, {},
                        "Requests waiting for disk reads right now."),
    "requests_fallen_back": ("requests_fallen_back", COUNTER, {},
                             "Times a request lost matched blocks to a failed read and "
                             "recomputed them."),
    "hit_blocks_gpu": ("prompt_blocks", COUNTER, {"tier": "gpu"},
                       "Full prompt blocks taken from the cache, by the tier they were on."),
    "hit_blocks_host": ("prompt_blocks", COUNTER, {"tier": "host"}, ""),
    "hit_blocks_disk": ("prompt_blocks", COUNTER, {"tier": "disk"}, ""),
    "hit_blocks_disk_retained": ("retained_disk_hit_blocks", COUNTER, {},
                                 "Disk hits on blocks whose retention TTL was still running."),
    "hit_tokens_gpu": ("prompt_tokens", COUNTER, {"tier": "gpu"},
                       "Prompt tokens served from the cache, by the tier they were on."),
    "hit_tokens_host": ("prompt_tokens", COUNTER, {"tier": "host"}, ""),
    "hit_tokens_disk": ("prompt_tokens", COUNTER, {"tier": "disk"}, ""),
    "hit_tokens_remote": ("prompt_tokens", COUNTER, {"tier": "remote"}, ""),
    "gpu_evictions": ("gpu_evictions", COUNTER, {}, "Cached GPU blocks evicted to make room."),
    "host_offloads": ("host_offloads", COUNTER, {}, "GPU victims copied into host pages."),
    "host_recalls": ("host_recalls", COUNTER, {}, "Host prefix hits copied back to GPU."),
    "host_copies_kept": ("host_copies_kept", COUNTER, {},
                         "Host recalls whose host page stayed as the block's host copy."),
    "offloads_saved_by_host_copy": ("offloads_saved_by_host_copy", COUNTER, {},
                                    "GPU victims moved onto their host copy: no copy made."),
    "offloads_skipped": ("offloads_skipped", COUNTER, {},
                         "GPU victims dropped because no host page could be had."),
    "host_drops": ("host_drops", COUNTER, {}, "Host victims dropped instead of spilled."),
    "spills": ("spills", COUNTER, {}, "Spill writes (host to disk) issued."),
    "spills_completed": ("spills_completed", COUNTER, {}, "Spill writes that completed."),
    "spill_failures": ("spill_failures", COUNTER, {}, "Spill writes that failed."),
    "spills_saved_by_disk_copy": ("spills_saved_by_disk_copy", COUNTER, {},
                                  "Evictions that wrote nothing: the disk copy was valid."),
    "write_throughs": ("write_throughs", COUNTER, {},
                       "Retained content written to disk at its release, kept where it is."),
    "write_throughs_skipped": ("write_throughs_skipped", COUNTER, {},
                               "Retained blocks a release could not write through then."),
    "write_throughs_retried": ("write_throughs_retried", COUNTER, {},
                               "Held-back write-throughs issued as earlier writes completed."),
    "bytes_written": ("disk_written_bytes", COUNTER, {}, "Bytes written to disk slots."),
    "writes_in_flight": ("disk_writes_in_flight", GAUGE, {}, "Spill writes in flight."),
    "onboards": ("onboards", COUNTER, {}, "Onboard reads (disk to GPU) issued."),
    "onboards_completed": ("onboards_completed", COUNTER, {}, "Onboard reads that completed."),
    "onboard_failures": ("onboard_failures", COUNTER, {}, "Onboard reads that failed."),
    "bytes_read": ("disk_read_bytes", COUNTER, {}, "Bytes read from disk slots."),
    "reads_in_flight": ("disk_reads_in_flight", GAUGE, {}, "Onboard reads in flight."),
    "gate_drops": ("spill_refusals", COUNTER, {"reason": "spill_mode"},
                   "Host victims not spilled, by why."),
    "pressure_drops": ("spill_refusals", COUNTER, {"reason": "write_queue_full"}, ""),
    "admission_refusals": ("spill_refusals", COUNTER, {"reason": "disk_retained_full"}, ""),
    "disk_busy_refusals": ("spill_refusals", COUNTER, {"reason": "disk_busy"}, ""),
    "displacements": ("disk_displacements", COUNTER, {},
                      "Disk blocks displaced by a new spill."),
    "expirations": ("retention_expirations", COUNTER, {},
                    "Retained disk blocks whose TTL ran out."),
    "restored_blocks": ("restored_blocks", COUNTER, {},
                        "Disk blocks an earlier process left, adopted at open."),
    "io_errors": ("io_errors", COUNTER, {}, "Failed reads plus failed writes."),
    "prefetches": ("prefetches", COUNTER, {},
                   "Prefetch reads (disk to host, for queued requests) issued, in blocks."),
    "prefetches_completed": ("prefetches_completed", COUNTER, {},
                             "Prefetch reads that landed in their host page."),
    "prefetch_failures": ("prefetch_failures", COUNTER, {}, "Prefetch reads that failed."),
    "prefetch_hits": ("prefetch_hit_blocks", COUNTER, {},
                      "Prefetched blocks an admitted request took as host hits."),
    "prefetches_taken_over": ("prefetches_taken_over", COUNTER, {},
                              "Prefetch reads in flight at admission, continued as onboards."),
    "prefetches_cancelled": ("prefetches_given_back", COUNTER, {"reason": "request_left"},
                             "Prefetched blocks whose host page was given back, by why."),
    "prefetches_reclaimed": ("prefetches_given_back", COUNTER, {"reason": "host_pressure"},
                             ""),
    "prefetch_reads_in_flight": ("prefetch_reads_in_flight", GAUGE, {},
                                 "Prefetch reads in flight."),
    "prefetched_blocks": ("prefetched_blocks", GAUGE, {},
                          "Blocks held in a host page for a queued request."),
    "prefetching_requests": ("prefetching_requests", GAUGE, {},
                             "Queued requests with a prefetch registered."),
    "onboards_skipped_as_too_slow": ("onboards_skipped_as_too_slow", COUNTER, {},
                                     "Disk hit blocks recomputed because reading them back "
                                     "was estimated slower."),
    "onboard_tokens_skipped_as_too_slow": ("onboard_tokens_skipped_as_too_slow", COUNTER, {},
                                           "Disk hit tokens recomputed because reading them "
                                           "back was estimated slower."),
    "cost_probes": ("cost_gate_probes", COUNTER, {},
                    "Requests read anyway to measure a tier the cost gate had stopped "
                    "reading."),
    "cached_blocks": ("cached_blocks", GAUGE, {}, "Blocks in the prefix index, on any tier."),
    "gpu_free_pages": ("free_pages", GAUGE, {"tier": "gpu"}, "Free pages, by tier."),
    "host_free_pages": ("free_pages", GAUGE, {"tier": "host"}, ""),
    "disk_empty_slots": ("free_pages", GAUGE, {"tier": "disk"}, ""),
    "gpu_evictable_blocks": ("gpu_evictable_blocks", GAUGE, {},
                             "Cached GPU blocks no request holds."),
    "host_copy_pages": ("host_copy_pages", GAUGE, {},
                        "Free host pages that still hold a host copy of a block on GPU."),
    "host_reserved_pages": ("host_reserved_pages", GAUGE, {},
                            "Host pages reserved for spills whose victims drain."),
    "host_cached_blocks": ("tier_cached_blocks", GAUGE, {"tier": "host"},
                           "Cached blocks below the GPU, by tier."),
    "disk_cached_blocks": ("tier_cached_blocks", GAUGE, {"tier": "disk"}, ""),
    "disk_retained_blocks": ("disk_retained_blocks", GAUGE, {},
                             "Disk blocks whose retention TTL is running."),
    "disk_copy_blocks": ("disk_copy_blocks", GAUGE, {},
                         "Blocks on GPU or host that also keep a valid disk copy."),
    "blocks_by_state": ("blocks", GAUGE, {}, "Blocks in each lifecycle state."),
    "hit_blocks_remote": ("prompt_blocks", COUNTER, {"tier": "remote"}, ""),
    "fetches": ("remote_fetches", COUNTER, {}, "Block fetches from the shared tier issued."),
    "fetches_completed": ("remote_fetches_completed", COUNTER, {},
                          "Shared-tier fetches that landed, verified."),
    "fetch_failures": ("remote_fetch_failures", COUNTER, {},
                       "Shared-tier fetches that failed (never served)."),
    "bytes_fetched": ("remote_fetched_bytes", COUNTER, {}, "Bytes fetched from the shared tier."),
    "fetches_in_flight": ("remote_fetches_in_flight", GAUGE, {},
                          "Shared-tier fetches in flight."),
    "fetches_skipped_as_too_slow": ("remote_fetches_skipped_as_too_slow", COUNTER, {},
                                    "Shared-tier hit blocks recomputed because fetching them "
                                    "was estimated slower."),
    "publishes_offered": ("remote_publishes_offered", COUNTER, {},
                          "Host offloads offered to the shared tier's publisher."),
    "publishes_not_admitted": ("remote_publishes_not_admitted", COUNTER, {},
                               "Host offloads the spill mode kept from the shared tier."),
}


class MetricFamilies:
    """Metric families by name, created on first use, in a stable order."""

    def __init__(self, prefix: str, labels: Mapping[str, str]) -> None:
        self._prefix = prefix
        self._labels = dict(labels)
        self._families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def add(self, name: str, kind: str, labels: Mapping[str, str], value: float,
            documentation: str = "") -> None:
        full = f"{self._prefix}_{name}"
        family = self._families.get(full)
        names = [*self._labels, *labels]
        if family is None:
            doc = documentation or full
            family = (CounterMetricFamily(full, doc, labels=names) if kind == COUNTER
                      else GaugeMetricFamily(full, doc, labels=names))
            self._families[full] = family
        family.add_metric([*self._labels.values(), *labels.values()], value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


class StateKVCollector(Collector):
    """Every field of a cache's ``statistics()`` as Prometheus metrics, read per scrape."""

    def __init__(self, statistics: Callable[[], SystemStatistics], *,
                 prefix: str = PREFIX, constant_labels: Mapping[str, str] | None = None) -> None:
        self._statistics = statistics
        self._prefix = prefix
        self._labels = dict(constant_labels or {})

    def collect(self) -> Iterator[Metric]:
        stats = self._statistics()
        families = MetricFamilies(self._prefix, self._labels)
        add_cache_statistics(families, stats.cache)
        for pool, pool_stats in (("writer", stats.writer), ("reader", stats.reader)):
            if pool_stats is not None:
                add_pool_statistics(families, pool, pool_stats)
        families.add("spill_backlog", GAUGE, {}, stats.spill_backlog,
                     "Spills decided but not yet handed to the writer pool.")
        families.add("slots_discarded", COUNTER, {}, stats.slots_discarded,
                     "Disk slots whose content was discarded.")
        if stats.recovery is not None:
            recovery = stats.recovery
            for reason in ("foreign", "corrupt", "unauthenticated", "duplicates",
                           "beyond_capacity"):
                families.add("restore_reclaimed_slots", GAUGE, {"reason": reason},
                             getattr(recovery, reason),
                             "Slots found at open and reclaimed instead of served, by why.")
            for outcome in ("applied", "stale", "torn", "unauthenticated", "foreign"):
                families.add("restore_retention_records", GAUGE, {"outcome": outcome},
                             getattr(recovery.journal, outcome),
                             "Retention journal records replayed at open, by outcome: applied "
                             "(a lengthened deadline restored), stale (the slot was reused), "
                             "or ignored (torn, unauthenticated, foreign).")
            families.add("restore_from_index_journal", GAUGE, {},
                         int(recovery.index.source == "journal"),
                         "1 when the open rebuilt the disk index from the index journal, 0 "
                         "when it scanned the slot headers (or had nothing to rebuild).")
            families.add("restore_index_records_torn", GAUGE, {}, recovery.index.torn,
                         "Index journal records torn by a crash at its end, ignored at open.")
        families.add("retention_backlog", GAUGE, {}, stats.retention_backlog,
                     "Lengthened deadlines waiting for their journal append.")
        if stats.store is not None:
            families.add("slot_mac_failures", COUNTER, {}, stats.store.mac_failures,
                         "Slots whose keyed MAC failed on read: never served.")
            families.add("retention_records_journaled", COUNTER, {},
                         stats.store.retention_records,
                         "Lengthened retention deadlines appended to the journal.")
            families.add("retention_journal_failures", COUNTER, {},
                         stats.store.retention_failures,
                         "Lengthened deadlines whose journal append failed (kept in memory).")
            families.add("retention_journal_compactions", COUNTER, {},
                         stats.store.journal_compactions,
                         "Run-time rewrites of the retention journal.")
            families.add("index_records_journaled", COUNTER, {}, stats.store.index_records,
                         "Records appended to the index journal (landed spills, freed slots, "
                         "seals).")
            families.add("index_journal_failures", COUNTER, {}, stats.store.index_failures,
                         "Index journal appends that failed (the journal is then off until "
                         "the next open, which scans the slot headers).")
        yield from families


def add_cache_statistics(families: MetricFamilies, cache: CacheStatistics) -> None:
    for field, (name, kind, labels, doc) in CACHE_FIELDS.items():
        value = getattr(cache, field)
        if field == "blocks_by_state":
            for state, count in value:
                families.add(name, kind, {"state": state}, count, doc)
        else:
            families.add(name, kind, labels, value, doc)


def add_pool_statistics(families: MetricFamilies, pool: str, stats: PoolStatistics) -> None:
    labels = {"pool": pool}
    families.add("io_workers", GAUGE, labels, stats.workers, "Threads of each I/O pool.")
    families.add("io_queue_depth", GAUGE, labels, stats.queued,
                 "Batches of transfers queued for a thread, by pool.")
    families.add("io_in_flight", GAUGE, labels, stats.in_flight,
                 "Batches of transfers a thread is executing, by pool.")
    families.add("io_jobs_completed", COUNTER, labels, stats.completed,
                 "Block transfers completed, by pool.")
    families.add("io_jobs_failed", COUNTER, labels, stats.failed,
                 "Block transfers that reported a failure, by pool.")
    families.add("io_jobs_dropped_at_close", COUNTER, labels, stats.dropped_at_close,
                 "Batches dropped when the pool closed without draining, by pool.")
