"""Counters, readable through one ``statistics()`` call.

A counter that is not a field of :class:`CacheStatistics` does not exist.  Counters are
per manager instance (never module globals), so tests and ranks never share them.
"""

from __future__ import annotations

import attrs


@attrs.define(slots=True)
class Counters:
    """The manager's live counters (mutable; snapshot them with CacheStatistics)."""

    requests_added: int = 0
    prefix_cache_queries: int = 0
    requests_released: int = 0
    requests_parked: int = 0
    requests_fallen_back: int = 0
    hit_blocks_gpu: int = 0
    hit_blocks_host: int = 0
    hit_blocks_disk: int = 0
    hit_blocks_disk_retained: int = 0
    gpu_evictions: int = 0
    host_offloads: int = 0
    host_recalls: int = 0
    offloads_skipped: int = 0
    host_copies_kept: int = 0
    offloads_saved_by_host_copy: int = 0
    host_drops: int = 0
    spills: int = 0
    spills_completed: int = 0
    spill_failures: int = 0
    spills_saved_by_disk_copy: int = 0
    write_throughs: int = 0
    write_throughs_skipped: int = 0
    write_throughs_retried: int = 0
    bytes_written: int = 0
    onboards: int = 0
    onboards_completed: int = 0
    onboard_failures: int = 0
    bytes_read: int = 0
    gate_drops: int = 0
    pressure_drops: int = 0
    admission_refusals: int = 0
    disk_busy_refusals: int = 0
    displacements: int = 0
    expirations: int = 0
    restored_blocks: int = 0
    prefetches: int = 0
    prefetches_completed: int = 0
    prefetch_failures: int = 0
    prefetch_hits: int = 0
    prefetches_taken_over: int = 0
    prefetches_cancelled: int = 0
    prefetches_reclaimed: int = 0
    onboards_skipped_as_too_slow: int = 0
    cost_probes: int = 0
    hit_blocks_remote: int = 0
    fetches: int = 0
    fetches_completed: int = 0
    fetch_failures: int = 0
    bytes_fetched: int = 0
    fetches_skipped_as_too_slow: int = 0
    publishes_offered: int = 0
    publishes_not_admitted: int = 0


@attrs.frozen(kw_only=True)
class CacheStatistics:
    """A snapshot of every counter and gauge of one cache."""

    # Requests.
    requests_added: int
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the cache (every add_request's tokens), as vLLM's
    prefix_cache_queries counts them."""
    prefix_cache_hits: int = 0
    """Of those, tokens taken from the cache on any tier (hit_tokens_gpu + host + disk +
    remote), as vLLM's prefix_cache_hits: hits / queries is the token hit rate."""
    """Requests registered with add_request."""
    requests_released: int
    """Requests released (finished or cancelled)."""
    requests_parked: int
    """Requests that had to wait for at least one onboard read when added."""
    parked_requests: int
    """Requests waiting for onboard reads right now."""
    requests_fallen_back: int
    """Times a request lost matched blocks to a failed read and fell back to recompute."""

    # Prefix hits by tier (full blocks taken from the cache at add_request).
    hit_blocks_gpu: int
    hit_blocks_host: int
    hit_blocks_disk: int
    hit_blocks_disk_retained: int
    """Disk hits on content whose TTL was still running: the retention promise paying off."""
    hit_tokens_gpu: int
    hit_tokens_host: int
    hit_tokens_disk: int
    hit_tokens_remote: int = 0
    """Prompt tokens fetched from the shared tier."""

    # GPU <-> host.
    gpu_evictions: int
    """Cached GPU blocks evicted to make room."""
    host_offloads: int
    """GPU victims copied into host pages."""
    host_recalls: int
    """Host-resident prefix hits copied back to GPU."""
    offloads_skipped: int
    """GPU victims dropped because no host page could be had (all busy spilling)."""
    host_copies_kept: int = 0
    """Host recalls whose host page stayed as the block's host copy (the inclusive host
    tier: not when the page refilled the spill reserve)."""
    offloads_saved_by_host_copy: int = 0
    """Of host_offloads, GPU victims that moved to host onto their host copy: no
    GPU -> host copy was made."""
    host_drops: int
    """Host victims dropped instead of spilled (no disk tier, gate, pressure, admission)."""

    # Host -> disk.
    spills: int
    """Spill writes issued."""
    spills_completed: int
    spill_failures: int
    bytes_written: int
    writes_in_flight: int
    spills_saved_by_disk_copy: int = 0
    """Evictions (from host, or from GPU with no host page) of blocks whose disk copy was
    still valid, in blocks: each became ON_DISK in the slot it kept since its onboard, with
    no write (a spill, and its bytes, saved).  Not in spills."""
    write_throughs: int = 0
    """Of the spills, writes of retained content issued when its request was released
    (retention_write_through): the content stays on GPU or host, with a disk copy once the
    write lands."""
    write_throughs_skipped: int = 0
    """Retained blocks a release could not write through then (no slot the disk admits, no
    host page to stage a GPU block through, or write_queue_depth writes in flight); they join
    the write-through backlog, retried as writes complete (write_throughs_retried), and are
    otherwise spilled on eviction as before, or at a clean close."""
    write_throughs_retried: int = 0
    """Of write_throughs, writes of backlog content issued when an earlier write completed."""

    # Disk -> GPU.
    onboards: int
    """Onboard reads issued."""
    onboards_completed: int
    onboard_failures: int
    bytes_read: int
    reads_in_flight: int

    # Spill admission.
    gate_drops: int
    """Victims the spill mode refused (retained-only / reuse gate)."""
    pressure_drops: int
    """Best-effort spills shed because the write queue was full (drop-on-pressure)."""
    admission_refusals: int
    """Spills refused because the disk was full of unexpired retained content."""
    disk_busy_refusals: int
    """Spills refused because every slot had a read or write in flight."""
    displacements: int
    """Disk content displaced by a new spill."""
    expirations: int
    """Retained disk content whose TTL ran out (it became best-effort)."""
    restored_blocks: int
    """Blocks adopted from disk at open (left by an earlier process: restore)."""
    io_errors: int
    """Failed reads (onboards and prefetches) plus failed writes."""

    # Prefetch for queued requests (disk -> host ahead of admission).
    prefetches: int
    """Prefetch reads (disk -> host) issued, in blocks."""
    prefetches_completed: int
    """Prefetch reads that landed in their host page."""
    prefetch_failures: int
    """Prefetch reads that failed (the content left the cache, never served)."""
    prefetch_hits: int
    """Prefetched blocks an admitted request took as host hits (also in hit_blocks_host)."""
    prefetches_taken_over: int
    """Prefetch reads still in flight when their request was admitted: they continued as
    onboards (also in onboards and hit_blocks_disk)."""
    prefetches_cancelled: int
    """Prefetched blocks given back because every queued request that wanted them left."""
    prefetches_reclaimed: int
    """Prefetched blocks whose host page the host tier took back under pressure."""
    prefetch_reads_in_flight: int
    prefetched_blocks: int
    """Blocks in a host page for a queued request now (PREFETCHED)."""
    prefetching_requests: int
    """Queued requests with a prefetch registered now."""

    # Cost-aware onboarding.
    onboards_skipped_as_too_slow: int
    """Disk hits not read back because recomputing their tokens was estimated faster."""
    onboard_tokens_skipped_as_too_slow: int
    cost_probes: int = 0
    """Requests whose hits the cost gate would have dropped that read them anyway, to measure
    a tier again that had not been read for PROBE_EVERY drops in a row (statekv.cost)."""

    # Occupancy now.
    cached_blocks: int
    """Blocks in the prefix index, on any tier."""
    gpu_free_pages: int
    gpu_evictable_blocks: int
    host_free_pages: int
    """Host pages that can be had without evicting anything: empty ones and host copies."""
    host_reserved_pages: int
    host_cached_blocks: int
    disk_empty_slots: int
    disk_cached_blocks: int
    disk_retained_blocks: int
    """Disk slots whose content's TTL is running (the deadline set), disk copies of blocks on
    GPU or host included."""
    disk_copy_blocks: int = 0
    """Blocks on GPU or host that keep a valid disk copy (their slot is not empty, and not
    in disk_cached_blocks)."""
    host_copy_pages: int = 0
    """Of host_free_pages, those holding the host copy of a block on GPU (forgotten when
    the page is taken)."""
    blocks_by_state: tuple[tuple[str, int], ...]
    """(state name, count) for every lifecycle state."""

    # The shared tier (zero without one).
    hit_blocks_remote: int = 0
    """Matched blocks served from the shared tier (fetched, or waiting on another request's
    fetch)."""
    fetches: int = 0
    """Block fetches from the shared tier issued."""
    fetches_completed: int = 0
    fetch_failures: int = 0
    """Fetches that failed (missing, evicted, corrupt, unavailable): never served."""
    bytes_fetched: int = 0
    fetches_in_flight: int = 0
    fetches_skipped_as_too_slow: int = 0
    """Blocks the shared tier held that were recomputed because that was estimated faster."""
    publishes_offered: int = 0
    """Host offloads offered to the publisher (PublishBlock)."""
    publishes_not_admitted: int = 0
    """Host offloads the spill mode kept from the shared tier."""


def snapshot(
    c: Counters, *, block_size: int, parked_requests: int, writes_in_flight: int,
    reads_in_flight: int, prefetch_reads_in_flight: int, prefetched_blocks: int,
    prefetching_requests: int, fetches_in_flight: int, cached_blocks: int,
    gpu_free_pages: int, gpu_evictable_blocks: int, host_free_pages: int,
    host_reserved_pages: int, host_cached_blocks: int, disk_empty_slots: int,
    disk_cached_blocks: int, disk_retained_blocks: int, disk_copy_blocks: int,
    host_copy_pages: int, blocks_by_state: tuple[tuple[str, int], ...],
) -> CacheStatistics:
    """The statistics of one cache: its counters, with the gauges each concern reads off its
    own data (the manager collects them)."""
    bs = block_size
    return CacheStatistics(
        requests_added=c.requests_added,
        prefix_cache_queries=c.prefix_cache_queries,
        prefix_cache_hits=(c.hit_blocks_gpu + c.hit_blocks_host + c.hit_blocks_disk
                           + c.hit_blocks_remote) * bs,
        requests_released=c.requests_released,
        requests_parked=c.requests_parked,
        parked_requests=parked_requests,
        requests_fallen_back=c.requests_fallen_back,
        hit_blocks_gpu=c.hit_blocks_gpu,
        hit_blocks_host=c.hit_blocks_host,
        hit_blocks_disk=c.hit_blocks_disk,
        hit_blocks_disk_retained=c.hit_blocks_disk_retained,
        hit_tokens_gpu=c.hit_blocks_gpu * bs,
        hit_tokens_host=c.hit_blocks_host * bs,
        hit_tokens_disk=c.hit_blocks_disk * bs,
        hit_tokens_remote=c.hit_blocks_remote * bs,
        gpu_evictions=c.gpu_evictions,
        host_offloads=c.host_offloads,
        host_recalls=c.host_recalls,
        offloads_skipped=c.offloads_skipped,
        host_copies_kept=c.host_copies_kept,
        offloads_saved_by_host_copy=c.offloads_saved_by_host_copy,
        host_drops=c.host_drops,
        spills=c.spills,
        spills_completed=c.spills_completed,
        spill_failures=c.spill_failures,
        spills_saved_by_disk_copy=c.spills_saved_by_disk_copy,
        write_throughs=c.write_throughs,
        write_throughs_skipped=c.write_throughs_skipped,
        write_throughs_retried=c.write_throughs_retried,
        bytes_written=c.bytes_written,
        writes_in_flight=writes_in_flight,
        onboards=c.onboards,
        onboards_completed=c.onboards_completed,
        onboard_failures=c.onboard_failures,
        bytes_read=c.bytes_read,
        reads_in_flight=reads_in_flight,
        gate_drops=c.gate_drops,
        pressure_drops=c.pressure_drops,
        admission_refusals=c.admission_refusals,
        disk_busy_refusals=c.disk_busy_refusals,
        displacements=c.displacements,
        expirations=c.expirations,
        restored_blocks=c.restored_blocks,
        io_errors=c.spill_failures + c.onboard_failures + c.prefetch_failures,
        prefetches=c.prefetches,
        prefetches_completed=c.prefetches_completed,
        prefetch_failures=c.prefetch_failures,
        prefetch_hits=c.prefetch_hits,
        prefetches_taken_over=c.prefetches_taken_over,
        prefetches_cancelled=c.prefetches_cancelled,
        prefetches_reclaimed=c.prefetches_reclaimed,
        prefetch_reads_in_flight=prefetch_reads_in_flight,
        prefetched_blocks=prefetched_blocks,
        prefetching_requests=prefetching_requests,
        onboards_skipped_as_too_slow=c.onboards_skipped_as_too_slow,
        onboard_tokens_skipped_as_too_slow=c.onboards_skipped_as_too_slow * bs,
        cost_probes=c.cost_probes,
        hit_blocks_remote=c.hit_blocks_remote,
        fetches=c.fetches,
        fetches_completed=c.fetches_completed,
        fetch_failures=c.fetch_failures,
        bytes_fetched=c.bytes_fetched,
        fetches_in_flight=fetches_in_flight,
        fetches_skipped_as_too_slow=c.fetches_skipped_as_too_slow,
        publishes_offered=c.publishes_offered,
        publishes_not_admitted=c.publishes_not_admitted,
        cached_blocks=cached_blocks,
        gpu_free_pages=gpu_free_pages,
        gpu_evictable_blocks=gpu_evictable_blocks,
        host_free_pages=host_free_pages,
        host_reserved_pages=host_reserved_pages,
        host_cached_blocks=host_cached_blocks,
        disk_empty_slots=disk_empty_slots,
        disk_cached_blocks=disk_cached_blocks,
        disk_retained_blocks=disk_retained_blocks,
        disk_copy_blocks=disk_copy_blocks,
        host_copy_pages=host_copy_pages,
        blocks_by_state=blocks_by_state,
    )
