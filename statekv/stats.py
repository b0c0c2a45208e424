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
    host_drops: int = 0
    spills: int = 0
    spills_completed: int = 0
    spill_failures: int = 0
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


@attrs.frozen(kw_only=True)
class CacheStatistics:
    """A snapshot of every counter and gauge of one cache."""

    # Requests.
    requests_added: int
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

    # GPU <-> host.
    gpu_evictions: int
    """Cached GPU blocks evicted to make room."""
    host_offloads: int
    """GPU victims copied into host pages."""
    host_recalls: int
    """Host-resident prefix hits copied back to GPU."""
    offloads_skipped: int
    """GPU victims dropped because no host page could be had (all busy spilling)."""
    host_drops: int
    """Host victims dropped instead of spilled (no disk tier, gate, pressure, admission)."""

    # Host -> disk.
    spills: int
    """Spill writes issued."""
    spills_completed: int
    spill_failures: int
    bytes_written: int
    writes_in_flight: int

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

    # Occupancy now.
    cached_blocks: int
    """Blocks in the prefix index, on any tier."""
    gpu_free_pages: int
    gpu_evictable_blocks: int
    host_free_pages: int
    host_reserved_pages: int
    host_cached_blocks: int
    disk_empty_slots: int
    disk_cached_blocks: int
    disk_retained_blocks: int
    """Disk blocks whose TTL is running (the deadline set)."""
    blocks_by_state: tuple[tuple[str, int], ...]
    """(state name, count) for every lifecycle state."""
