"""The KV memory pools and the engine that copies pages between them.

:class:`KVPools` owns two preallocated tensors of pages, one on the compute device (L1) and
one in host memory (L2), each page holding one block's KV contiguously.  The core hands out
page numbers; nothing here allocates after construction.

:class:`TorchCopyEngine` executes the core's ``CopyGpuToHost`` / ``CopyHostToGpu`` commands
in command order on one dedicated CUDA stream (see its docstring for how it is ordered
against the forward pass).  On a CPU device the same code path performs real, synchronous
copies, so tests exercise the byte movement everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Final

import attrs
import torch

from io_actors.memory import batched_dma, page_gather
from io_actors.memory.copy_passes import GPU, HOST, SCRATCH, Page, plan_passes
from io_actors.memory.host_checksums import HostChecksums
from io_actors.memory.page_copies import COMPUTE_WAITS, HostPageFills, PendingPageCopies
from io_actors.storage.buffers import page_aligned_buffer, pinned_page_aligned_buffer
from io_actors.storage.gpu_checksum import checksums_into, have_kernel, warm_up
from io_actors.storage.interfaces import CopyRun, Fence
from statekv.config import CacheConfig
from statekv.errors import ConfigError, UsageError
from statekv.ids import PageId

_log = logging.getLogger(__name__)

TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}
"""The torch dtype of each KVLayout dtype name."""

_PAGE_SIZE: Final = mmap.PAGESIZE

GATHER_RUN_BYTES: Final = 1 << 20
"""Mean bytes per run below which a batch of copies goes as one kernel, not one DMA a run
(when the engine chooses): a DMA of 1 MiB takes about 20 us at pinned H2D speed, several
times the cost of enqueueing it, while a 256 KiB one takes about as long as its enqueue."""

PASSES_RUN_BYTES: Final = 384 << 10
"""Mean bytes per run below which a call of copies in both directions goes as the stash and
moves kernels (:mod:`io_actors.memory.copy_passes`), not run by run (when the engine
chooses).  Lower than GATHER_RUN_BYTES: an admission's chain stashes every page it moves,
so the kernels carry its bytes twice.  Measured on an H100 (bench.copy_calls, 2026-12-07):
the passes against run by run 0.49-0.50x / 0.37-0.39x of pinned H2D at 256 KiB pages,
0.42x / 0.46x at 384 KiB, 0.43-0.44x / 0.51-0.54x at 512 KiB."""

COPY_KERNEL: Final = ("auto", "on", "off")
"""StateKVConfig.copy_kernel: whether page copies run as kernels (TorchCopyEngine's
gather_kernel None, True, False)."""

SCRATCH_BYTES: Final = 16 << 20
"""Device memory a copy engine keeps, once a call needs it, for the pages a call's copies
both read and overwrite (:mod:`io_actors.memory.copy_passes`): a call whose stash is larger
runs as several segments of two kernels each."""

SCRATCH_PAGES: Final = 1024
"""At most this many scratch pages (small pages: the scratch's bytes stay below
SCRATCH_BYTES, and its views few)."""


def torch_dtype(name: str) -> torch.dtype:
    """raises: ConfigError("dtype") for a name KVLayout does not know."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        known = sorted(TORCH_DTYPES)
        raise ConfigError("dtype", f"unknown dtype {name!r} (known: {known})") from None


def physical_memory() -> int | None:
    """Bytes of RAM on this machine (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _parse_device(device: object) -> torch.device:
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ConfigError("device", f"not a torch device: {device!r} ({exc})") from None
    else:
        raise ConfigError("device", f"must be a torch.device or a string, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{dev} requested but CUDA is not available")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if not 0 <= index < torch.cuda.device_count():
            raise ConfigError("device", f"{dev}: only {torch.cuda.device_count()} CUDA devices")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ConfigError("device", f"must be cpu or cuda, got {dev}")
    return dev


class KVPools:
    """The GPU page pool and the host page pool of one cache (one rank's shard).

    ``gpu`` is ``[gpu_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` on the
    device; ``host`` has the same page shape with ``host_blocks + reserved_host_blocks``
    pages.  A page's bytes are contiguous, so a block moves with one copy and is written to
    disk as one buffer.

    The host pool is pinned when CUDA is available (a pageable copy runs at about a sixth of
    pinned speed and cannot overlap compute); if pinning fails the pool falls back to
    ordinary memory and the reason is logged.  Without pinning the pool lives in anonymous
    mmap memory, which is page aligned, so disk I/O can use O_DIRECT on pages directly.
    Pinned memory comes from torch's host allocator, which is page aligned too but rounds
    each allocation up to a power of two: a 40 GiB pool pins 64 GiB.
    """

    def __init__(self, config: CacheConfig, device: torch.device | str) -> None:
        if not isinstance(config, CacheConfig):
            raise ConfigError("config", f"must be a CacheConfig, got {config!r}")
        self.config: Final = config
        self.device: Final = _parse_device(device)
        layout = config.layout
        self.dtype: Final = torch_dtype(layout.dtype)
        self.page_shape: Final = (
            layout.num_layers, 2, config.block_size, layout.num_kv_heads, layout.head_dim
        )
        self.block_nbytes: Final = config.block_bytes
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        if self.block_nbytes != element_bytes * _numel(self.page_shape):
            raise ConfigError("layout", "block bytes disagree with the layout's shape and dtype")
        self.gpu_pages: Final = config.gpu_blocks
        self.host_pages: Final = config.host_blocks + config.reserved_host_blocks
        self._check_fits("gpu_blocks", self.gpu_pages, on_host=self.device.type == "cpu")
        self._check_fits("host_blocks", self.host_pages, on_host=True)
        self.gpu = self._allocate_gpu()
        self.host_pinned: bool = False
        self.host = self._allocate_host()
        self.released = False
        """Set by release(): the pools' memory was given back when the cache closed."""
        self._gpu_views: list[torch.Tensor | None] = [None] * self.gpu_pages
        self._host_views: list[torch.Tensor | None] = [None] * self.host_pages
        self.host_checksums: HostChecksums | None = self._allocate_host_checksums()
        """The payload checksum of each host page's content, computed on the GPU by the copy
        that filled it (one kernel per batch of copies), so that a spill writes it into the
        slot header without a CPU pass over the bytes.  None where that cannot run (no CUDA,
        unpinned host pool, or no cupy): writers then checksum on the CPU."""

    def _check_fits(self, field: str, pages: int, *, on_host: bool) -> None:
        # Host allocations are lazily committed (overcommit): without this check an absurd
        # size "succeeds" here and the process is killed when the pages are first touched.
        if not on_host:
            return
        nbytes = pages * self.block_nbytes
        physical = physical_memory()
        if physical is not None and nbytes > physical:
            raise ConfigError(
                field, f"{pages} pages x {self.block_nbytes} bytes = {nbytes} bytes exceeds "
                f"this machine's {physical} bytes of memory"
            )

    def _allocate_gpu(self) -> torch.Tensor:
        shape = (self.gpu_pages, *self.page_shape)
        try:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        except RuntimeError as exc:
            raise ConfigError(
                "gpu_blocks", f"cannot allocate {self.gpu_pages} pages of {self.block_nbytes} "
                f"bytes on {self.device}: {exc}"
            ) from None

    def _allocate_host(self) -> torch.Tensor:
        shape = (self.host_pages, *self.page_shape)
        if torch.cuda.is_available() and self.host_pages > 0:
            try:
                pinned = pinned_page_aligned_buffer(
                    self.host_pages * self.block_nbytes).zero_().view(self.dtype).view(shape)
            except RuntimeError as exc:
                _log.warning(
                    "host pool: pinning %d bytes failed (%s); using pageable memory, host "
                    "<-> GPU copies will be slower and synchronous",
                    self.host_pages * self.block_nbytes, exc,
                )
            else:
                self.host_pinned = True
                return pinned
        try:
            flat = page_aligned_buffer(self.host_pages * self.block_nbytes)
        except (OSError, RuntimeError) as exc:
            raise ConfigError(
                "host_blocks", f"cannot allocate {self.host_pages} pages of "
                f"{self.block_nbytes} bytes: {exc}"
            ) from None
        return flat.view(self.dtype).view(shape)

    def _allocate_host_checksums(self) -> HostChecksums | None:
        if self.device.type != "cuda" or not self.host_pinned or self.host_pages == 0:
            return None
        if not have_kernel():
            return None
        warm_up(self.block_nbytes, self.device)
        return HostChecksums(torch.zeros(self.host_pages, dtype=torch.int32, pin_memory=True))

    def gpu_page(self, page: PageId) -> torch.Tensor:
        """One GPU page as a 1-D uint8 view of its block_nbytes bytes."""
        return _page_bytes(self.gpu, self._gpu_views, "gpu_page", page, self.released)

    def host_page(self, page: PageId) -> torch.Tensor:
        """One host page as a 1-D uint8 view of its block_nbytes bytes."""
        return _page_bytes(self.host, self._host_views, "host_page", page, self.released)

    def release(self) -> None:
        """Give the pools' memory back now; for the cache's close, once every thread that
        used a page is done.  The actors around the pools refer to each other (the pools'
        callbacks in the workers, the scheduler's report in the pools), so without this the
        GPU pool and the pinned host pool would stay allocated after close until the
        garbage collector's next full pass -- a cache opened next in the same process could
        find no room -- and would then be freed in whichever thread set off that pass.  A
        caller that kept a reference to a pool tensor keeps that tensor."""
        self.released = True
        self.gpu = torch.empty((0, *self.page_shape), dtype=self.dtype, device=self.device)
        self.host = torch.empty((0, *self.page_shape), dtype=self.dtype)
        self._gpu_views = []
        self._host_views = []
        self.host_checksums = None

    def new_staging_buffer(self, blocks: int = 1) -> torch.Tensor:
        """A uint8 host buffer of `blocks` blocks, page aligned and pinned like the host pool.

        For reader workers: each stages a batch of disk reads through its own buffer.
        """
        nbytes = blocks * self.block_nbytes
        if self.host_pinned:
            return pinned_page_aligned_buffer(nbytes)
        return page_aligned_buffer(nbytes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


_VIEW_RUN: Final = 256
"""Pages whose byte views are made together (one tensor object each, ~0.5 KiB: a pool's
views are made only for the runs of pages it uses)."""


def _page_bytes(pool: torch.Tensor, views: list[torch.Tensor | None], field: str,
                page: int, released: bool) -> torch.Tensor:
    if isinstance(page, bool) or not isinstance(page, int):
        raise UsageError(field, f"must be an integer page number, got {page!r}")
    if not 0 <= page < pool.shape[0]:
        given_back = " (the pool was given back when the cache closed)" if released else ""
        raise UsageError(field, f"page {page} out of range [0, {pool.shape[0]}){given_back}")
    # Each page's view is made once, and for a run of _VIEW_RUN pages at a time: making
    # views takes torch calls, each of which gives up the interpreter lock and waits to take
    # it back.  One view a call, under a 256 KiB spill on the H200 machine 264 of 1,219
    # samples of the writer threads' batches were making them (py-spy), against 821 in the
    # disk writes themselves; made once per page, still 42-50 of each writer's 320 samples
    # on an H100 (a spill touches each page about once).  Two threads racing here make
    # equal views, either of which is kept.
    view = views[page]
    if view is None:
        start = page - page % _VIEW_RUN
        stop = min(start + _VIEW_RUN, pool.shape[0])
        run = pool[start:stop].reshape(stop - start, -1).view(torch.uint8).unbind(0)
        views[start:stop] = run
        view = run[page - start]
    return view


# --- the copy engine --------------------------------------------------------------------------


class _DoneFence:
    """The fence of a synchronous engine: every copy before it has already happened."""

    def wait(self) -> None:
        return None


class _EventFence:
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self) -> None:
        # Event.synchronize releases the GIL while it blocks.
        self._event.synchronize()


@attrs.frozen(kw_only=True)
class _RunPlan:
    """One run of a copy_runs call, checked: its pairs, merged into (source, destination,
    pages) runs of pages consecutive on both sides, and whether it runs as one kernel."""

    to_gpu: bool
    pairs: list[tuple[PageId, PageId]]
    runs: list[tuple[int, int, int]]
    use_kernel: bool

    def pools(self, pools: KVPools) -> tuple[torch.Tensor, torch.Tensor]:
        """(source pool, destination pool)."""
        return (pools.host, pools.gpu) if self.to_gpu else (pools.gpu, pools.host)


def _copies(planned: Sequence[_RunPlan]) -> list[tuple[Page, Page]]:
    """A call's checked runs as one list of (source, destination) pages, in order."""
    copies: list[tuple[Page, Page]] = []
    for plan in planned:
        src_pool, dst_pool = (HOST, GPU) if plan.to_gpu else (GPU, HOST)
        copies += [((src_pool, src), (dst_pool, dst)) for src, dst in plan.pairs]
    return copies


def _checksum_order(
    planned: Sequence[_RunPlan],
) -> tuple[list[tuple[int, int]], dict[int, list[tuple[int, int]]]]:
    """Where each host page's checksum of one copy_runs call is computed: (GPU page, host
    page) fills for one kernel ahead of every copy of the call, and per run index those
    that must follow that run.

    A host page filled more than once in the call gets the checksum of its last fill only
    (an earlier fill's would describe bytes the page no longer holds).  That fill's GPU page
    is read ahead of the copies -- as it is at the call's start -- unless an earlier run of
    the call copies into it: then right after the fill's own run, before any later run can
    copy into it again.
    """
    written: set[int] = set()  # GPU pages an earlier run copies into
    last: dict[int, tuple[int, int, bool]] = {}  # host page -> (run, GPU page, after a write)
    for k, plan in enumerate(planned):
        if plan.to_gpu:
            written.update(d for _s, d in plan.pairs)
            continue
        for gpu_page, host_page in plan.pairs:
            last.pop(host_page, None)  # re-inserted: the dict keeps fill order
            last[host_page] = (k, gpu_page, gpu_page in written)
    early: list[tuple[int, int]] = []
    late: dict[int, list[tuple[int, int]]] = {}
    for host, (k, gpu, after_write) in last.items():
        if after_write:
            late.setdefault(k, []).append((gpu, host))
        else:
            early.append((gpu, host))
    return early, late


@attrs.frozen(kw_only=True)
class CopyEngineStatistics:
    """Counters of one copy engine."""

    copies_to_host: int
    """GPU -> host page copies enqueued."""
    copies_to_gpu: int
    """Host -> GPU page copies enqueued (pool pages and staging buffers)."""
    bytes_to_host: int
    bytes_to_gpu: int
    fences: int
    """Fences handed out."""
    asynchronous: bool
    """Whether copies run on a CUDA copy stream (False: synchronous CPU copies)."""
    kernel_batches: int
    """Batches of page copies that ran as one gather/scatter kernel, or as one call of the
    driver's batched memcpy with ``batch_dma=True`` (the rest: a DMA per run of consecutive
    pages)."""
    compute_waits: str
    """"all" or "pages": what a forward pass waits for (TorchCopyEngine)."""
    page_waits: int
    """Forward passes that waited for a copy of their own pages (compute_waits="pages")."""


class TorchCopyEngine:
    """GPU <-> host page copies in command order on one dedicated CUDA copy stream.

    Ordering, on CUDA:

    - *Against the forward pass.*  Before each copy the copy stream waits for every kernel
      already enqueued on the compute stream (``wait_stream`` records an event there and
      makes the copy stream wait on it).  A copy out of a GPU page therefore sees the bytes
      of the forward pass that wrote them, and a copy into a GPU page cannot overwrite bytes
      that an earlier forward pass is still reading.  The compute stream is the one the
      forward pass runs on: by default the stream current on the constructing thread
      (torch's default stream unless the serving loop chose another); pass it explicitly
      otherwise.  Capturing it once matters because torch's "current stream" is per thread,
      and the engine is driven from actor and worker threads, not the serving thread.
    - *Among copies.*  One stream executes them in enqueue order.
    - *Forward pass after copies.*  With ``compute_waits="all"`` (the default),
      :meth:`order_before_compute` makes the compute stream wait for every copy enqueued so
      far (the scheduler calls it after each batch of copies it enqueues).  With
      ``compute_waits="pages"`` it does nothing: instead each forward pass is ordered after
      the copies of its own pages only (:meth:`wait_for_pages`, which the serving loop calls
      before each pass with the pages its batch reads or writes), so a pass never waits for
      a spill or onboard of pages it does not use.  Every piece of compute-stream work that
      touches a GPU page must then be announced that way.
    - *Host threads after copies.*  :meth:`fence` records an event after every copy enqueued
      so far, and after the compute work the copy stream has been made to wait for; a
      worker thread blocks on ``Fence.wait()`` before it writes a page (a disk read into a
      host page or staging buffer, or a GPU page from outside the streams: kvikio, GDS).
      A spill write only reads its host pages: :meth:`fence_for_host_pages` covers the last
      copy into each of them and no later copy, so a write never queues behind another
      request's eviction enqueued ahead of it.

    On a CPU device every copy completes before its call returns and fences are no-ops.
    Methods may be called from several threads: a lock keeps enqueue order equal to call
    order.
    """

    def __init__(
        self, pools: KVPools, *, compute_stream: torch.cuda.Stream | None = None,
        gather_kernel: bool | None = None, compute_waits: str = "all",
        batch_dma: bool = False,
    ) -> None:
        if not isinstance(pools, KVPools):
            raise ConfigError("pools", f"must be KVPools, got {pools!r}")
        if compute_waits not in COMPUTE_WAITS:
            raise ConfigError("compute_waits", f"must be one of {COMPUTE_WAITS}, got "
                              f"{compute_waits!r}")
        if gather_kernel is not None and not isinstance(gather_kernel, bool):
            raise ConfigError("gather_kernel", f"must be True, False or None, got "
                              f"{gather_kernel!r}")
        if not isinstance(batch_dma, bool):
            raise ConfigError("batch_dma", f"must be True or False, got {batch_dma!r}")
        self._pools = pools
        self._lock = threading.Lock()
        self._copies_to_host = 0
        self._copies_to_gpu = 0
        self._fences = 0
        self._pending_for_compute = False
        self._async = pools.device.type == "cuda"
        if self._async:
            self._compute: torch.cuda.Stream | None = (
                compute_stream
                if compute_stream is not None
                else torch.cuda.current_stream(pools.device)
            )
            self._stream: torch.cuda.Stream | None = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                device=pools.device
            )
        else:
            if compute_stream is not None:
                raise ConfigError("compute_stream", "only meaningful for a CUDA device")
            self._compute = None
            self._stream = None
        self._non_blocking = self._async and pools.host_pinned
        can_gather = (self._async and pools.host_pinned and page_gather.have_kernel()
                      and pools.block_nbytes % page_gather.WORD == 0)
        if gather_kernel and not can_gather:
            raise ConfigError(
                "gather_kernel", "needs a CUDA device, a pinned host pool, cupy, and block "
                f"bytes a multiple of {page_gather.WORD} (got {pools.block_nbytes})")
        self.gather_kernel_available: Final = can_gather
        """Whether batches of page copies can run as one gather/scatter kernel here."""
        self._gather: bool | None = (gather_kernel if can_gather or not self._async
                                     else False)
        """True: every batch of page copies is one kernel; False: one DMA per run; None:
        the kernel when a batch's runs average under GATHER_RUN_BYTES (a call of both
        directions: PASSES_RUN_BYTES).  A CPU device (no kernel) runs every call run by run
        (_passes_suit)."""
        self._gatherer: page_gather.PageGather | batched_dma.BatchedDMA | None = (
            page_gather.PageGather(pools.device, self._stream)
            if can_gather and self._stream is not None else None)
        if batch_dma:
            # A batch of copies as one call of the driver's batched memcpy (copy engines)
            # instead of the gather kernel (SMs): the same batches, the same contract.
            if self._gatherer is None or self._stream is None:
                raise ConfigError("batch_dma", "needs what gather_kernel needs: a CUDA "
                                  "device, a pinned host pool and cupy")
            try:
                self._gatherer = batched_dma.BatchedDMA(pools.device, self._stream)
            except batched_dma.BatchedDMAUnavailable as exc:
                raise ConfigError("batch_dma", f"the driver's batched memcpy cannot run "
                                  f"here: {exc}") from None
        self._kernel_batches = 0
        self._scratch: torch.Tensor | None = None
        """Pages of a call's stash (copy_passes); allocated by the first call that needs it."""
        self._scratch_views: tuple[torch.Tensor, ...] = ()
        self._scratch_pages = max(1, min(SCRATCH_PAGES, SCRATCH_BYTES // pools.block_nbytes))
        self.compute_waits: Final = compute_waits
        # Only where copies are asynchronous: on a CPU device every copy is done when its
        # call returns, and there is nothing to wait for.
        self._page_copies: PendingPageCopies[torch.cuda.Event] | None = (
            PendingPageCopies() if compute_waits == "pages" and self._async else None)
        # The last copy into each host page, for the spill writes' fences (a CPU device's
        # copies are done when their call returns: nothing to record there).
        self._host_fills: HostPageFills[torch.cuda.Event] = HostPageFills(
            done=lambda event: bool(event.query()))  # type: ignore[no-untyped-call]
        self._page_waits = 0

    def copy_gpu_to_host(self, gpu_page: PageId, host_page: PageId) -> None:
        if self._pools.host_checksums is not None:
            # The page's checksum must be recorded with it: the batched path does that.
            self.copy_pages([(gpu_page, host_page)], to_gpu=False)
            return
        src = self._pools.gpu_page(gpu_page)
        dst = self._pools.host_page(host_page)
        with self._lock:
            self._enqueue(dst, src, gpu_page, filled_host_page=host_page)
            self._copies_to_host += 1

    def copy_host_to_gpu(self, host_page: PageId, gpu_page: PageId) -> None:
        src = self._pools.host_page(host_page)
        dst = self._pools.gpu_page(gpu_page)
        with self._lock:
            self._enqueue(dst, src, gpu_page)
            self._copies_to_gpu += 1

    def copy_buffer_to_gpu(self, src: torch.Tensor, gpu_page: PageId) -> None:
        """Enqueue a copy of a one-block host buffer (a reader's staging buffer) into a GPU
        page, behind every earlier copy.  The buffer must not be reused before a fence taken
        after this call has been waited on."""
        if (
            not isinstance(src, torch.Tensor) or src.device.type != "cpu"
            or src.dtype != torch.uint8 or src.dim() != 1 or not src.is_contiguous()
            or src.numel() != self._pools.block_nbytes
        ):
            raise UsageError(
                "src", f"must be a contiguous 1-D uint8 host tensor of "
                f"{self._pools.block_nbytes} bytes"
            )
        dst = self._pools.gpu_page(gpu_page)
        with self._lock:
            self._enqueue(dst, src, gpu_page)
            self._copies_to_gpu += 1

    def copy_pages(
        self, pairs: Sequence[tuple[PageId, PageId]], *, to_gpu: bool
    ) -> None:
        """Enqueue many page copies, in order, as one call: (source page, destination page)
        pairs, host -> GPU when `to_gpu`, else GPU -> host (:meth:`copy_runs` with one run).
        """
        self.copy_runs([(to_gpu, pairs)])

    def copy_runs(self, runs: Sequence[CopyRun]) -> None:
        """Enqueue runs of page copies, each of one direction, all in order, as one call:
        each run a (to_gpu, pairs) with (source page, destination page) pairs, host -> GPU
        when `to_gpu`, else GPU -> host.

        One lock, one wait on the compute stream, one stream switch and one event for the
        whole call.  Where the call's runs are small (below PASSES_RUN_BYTES a run on
        average, or always with ``gather_kernel=True``), the
        whole call runs as two kernels whatever its directions
        (:mod:`io_actors.memory.copy_passes`: the pages it both reads and overwrites
        stashed in scratch, then every destination's final bytes moved in), with the host
        pages' checksums (with cupy) between them.  So an admission that recalls host
        blocks into pages it evicts -- a copy out of each page, then one into it,
        alternating -- costs the serving thread three launches, not a DMA a page.
        Otherwise each run is one DMA per run of pages consecutive on both sides, and the
        checksums one kernel ahead of the copies, from the GPU pages as they are at the
        call's start (except those an earlier run of the call copies into).  A CPU device
        copies run by run, synchronously.

        Every pair is checked before anything is enqueued: a bad one raises UsageError and
        no copy of the call is made.
        """
        pools = self._pools
        planned = [self._plan(to_gpu, pairs) for to_gpu, pairs in runs]
        planned = [plan for plan in planned if plan.pairs]
        if not planned:
            return
        with self._lock:
            stream, compute = self._stream, self._compute
            on_gpu = stream is not None and compute is not None
            checksums = pools.host_checksums if on_gpu else None
            if stream is not None and compute is not None:
                stream.wait_stream(compute)
            with (torch.cuda.stream(stream) if stream is not None
                  else contextlib.nullcontext()):
                if self._passes_suit(planned):
                    self._run_passes(_copies(planned), checksums)
                else:
                    self._run_by_run(planned, checksums)
            if on_gpu:
                self._pending_for_compute = True
                gpu_pages: list[int] = []
                filled: list[int] = []
                for plan in planned:
                    if plan.to_gpu:
                        gpu_pages += [d for _s, d in plan.pairs]
                    else:
                        gpu_pages += [s for s, _d in plan.pairs]
                        filled += [d for _s, d in plan.pairs]
                self._copied(gpu_pages, filled)
            for plan in planned:
                if plan.to_gpu:
                    self._copies_to_gpu += len(plan.pairs)
                else:
                    self._copies_to_host += len(plan.pairs)

    def _run_by_run(self, planned: Sequence[_RunPlan], checksums: HostChecksums | None
                    ) -> None:
        """Under the lock (on the copy stream, on a GPU): each run in order, its DMAs or its
        gather kernel, with the filled host pages' checksums where _checksum_order puts
        them."""
        early, late = _checksum_order(planned) if checksums is not None else ([], {})
        if early:
            assert checksums is not None
            self._checksum(early, checksums)
        for k, plan in enumerate(planned):
            self._enqueue_run(plan)
            if k in late:
                assert checksums is not None
                self._checksum(late[k], checksums)

    def _plan(self, to_gpu: bool, pairs: Sequence[tuple[PageId, PageId]]) -> _RunPlan:
        """One run's pairs checked, and merged into runs of pages consecutive on both sides."""
        pools = self._pools
        src_pages, dst_pages = (pools.host_pages, pools.gpu_pages) if to_gpu else (
            pools.gpu_pages, pools.host_pages)
        runs: list[tuple[int, int, int]] = []
        for src, dst in pairs:
            if not (0 <= src < src_pages and 0 <= dst < dst_pages):
                raise UsageError("pairs", f"page pair {(src, dst)} out of range")
            if runs:
                s0, d0, n = runs[-1]
                if src == s0 + n and dst == d0 + n:
                    runs[-1] = (s0, d0, n + 1)
                    continue
            runs.append((src, dst, 1))
        return _RunPlan(to_gpu=to_gpu, pairs=list(pairs), runs=runs,
                        use_kernel=(bool(runs) and self._gatherer is not None
                                    and self._use_kernel(len(pairs), len(runs))))

    def _passes_suit(self, planned: Sequence[_RunPlan]) -> bool:
        """Whether a call runs as passes (two kernels on a GPU) rather than run by run.
        A CPU device has no gatherer: its synchronous copies in command order are already
        right, and the passes would copy every stashed page twice (on the CPU machine,
        bench.io at 256 KiB: a spill 0.22-0.23x of the raw write with them, 0.29-0.31x
        without).  A gatherer there is a test's stand-in, running the passes by address."""
        if self._gather is False or self._gatherer is None:
            return False
        if self._gather or not self._async:
            return True
        return self._small_runs(sum(len(plan.pairs) for plan in planned),
                                sum(len(plan.runs) for plan in planned), PASSES_RUN_BYTES)

    def _run_passes(self, copies: list[tuple[Page, Page]],
                    checksums: HostChecksums | None) -> None:
        """Under the lock (on the copy stream, on a GPU): `copies` as stash and moves passes,
        each one kernel on a GPU, with the filled host pages' checksums between them."""
        for segment in plan_passes(copies, self._scratch_pages):
            if segment.stash:
                self._copy_batch([(page, (SCRATCH, slot)) for page, slot in segment.stash],
                                 scratch=True)
            if checksums is not None and segment.checksums:
                hosts = [PageId(host) for _holder, host in segment.checksums]
                checksums_into([self._page(holder) for holder, _host in segment.checksums],
                               checksums.table, hosts)
                checksums.computed(hosts)
            if segment.moves:
                self._copy_batch(segment.moves, scratch=bool(segment.stash))

    def _copy_batch(self, pairs: Sequence[tuple[Page, Page]], *, scratch: bool) -> None:
        """One pass's copies as one batch of the gatherer (in no defined order: a pass
        neither repeats a destination nor reads one)."""
        nbytes = self._pools.block_nbytes
        assert self._gatherer is not None  # _passes_suit
        # Indexed by pool number (copy_passes: GPU 0, HOST 1, SCRATCH 2); the scratch pool
        # is only made by a call whose copies stash.
        base = [self._pools.gpu.data_ptr(), self._pools.host.data_ptr(),
                self._scratch_pool().data_ptr() if scratch else 0]
        self._gatherer.copy_addressed(
            [(base[src[0]] + src[1] * nbytes, base[dst[0]] + dst[1] * nbytes)
             for src, dst in pairs], nbytes)
        self._kernel_batches += 1

    def release(self) -> None:
        """Give the scratch back now (the cache's close, after pools.release()): up to
        SCRATCH_BYTES of device memory that the engine, held by the closed cache object,
        would otherwise keep for as long as that object lives."""
        with self._lock:
            self._scratch = None
            self._scratch_views = ()
            if isinstance(self._gatherer, batched_dma.BatchedDMA):
                self._gatherer.release()
                self._gatherer = None

    def _scratch_pool(self) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty((self._scratch_pages, self._pools.block_nbytes),
                                        dtype=torch.uint8, device=self._pools.device)
            self._scratch_views = self._scratch.unbind(0)
        return self._scratch

    def _page(self, page: Page) -> torch.Tensor:
        """A page of the GPU, host or scratch pool as a 1-D uint8 view."""
        pool, number = page
        if pool == GPU:
            return self._pools.gpu_page(PageId(number))
        if pool == HOST:
            return self._pools.host_page(PageId(number))
        self._scratch_pool()
        return self._scratch_views[number]

    def _enqueue_run(self, plan: _RunPlan) -> None:
        """On the copy stream (current): one run's copies."""
        src_pool, dst_pool = plan.pools(self._pools)
        if plan.use_kernel:
            assert self._gatherer is not None
            # Where a run fills a page twice (the page freed again within the same decision
            # and handed to the next copy: 61 such batches in one 16k-history run on the
            # H200) only its last copy counts: the DMAs in stream order leave it there,
            # while the kernel's thread blocks run in no defined order.
            last = dict((dst, src) for src, dst in plan.pairs)
            self._gatherer.copy(src_pool, dst_pool, [(s, d) for d, s in last.items()],
                                self._pools.block_nbytes)
            self._kernel_batches += 1
        else:
            src_page, dst_page = ((self._pools.host_page, self._pools.gpu_page) if plan.to_gpu
                                  else (self._pools.gpu_page, self._pools.host_page))
            for s0, d0, n in plan.runs:
                if n == 1:
                    # The pools' cached page views: one torch call, where slicing both
                    # pools took three (each a release of the interpreter lock).
                    dst_page(PageId(d0)).copy_(src_page(PageId(s0)),
                                               non_blocking=self._non_blocking)
                else:
                    dst_pool[d0 : d0 + n].copy_(src_pool[s0 : s0 + n],
                                                non_blocking=self._non_blocking)

    def _checksum(self, fills: Sequence[tuple[int, int]], checksums: HostChecksums) -> None:
        """On the copy stream (current): the checksums of (GPU page, host page) fills, each
        host page's entry from its GPU page (one entry per host page)."""
        pools = self._pools
        hosts = [PageId(h) for _g, h in fills]
        checksums_into([pools.gpu_page(PageId(g)) for g, _h in fills], checksums.table, hosts)
        checksums.computed(hosts)

    def _use_kernel(self, pages: int, runs: int) -> bool:
        if self._gather is not None:
            return self._gather
        return self._small_runs(pages, runs, GATHER_RUN_BYTES)

    def _small_runs(self, pages: int, runs: int, run_bytes: int) -> bool:
        """Whether `pages` pages in `runs` runs (two or more) average under `run_bytes` a
        run: where one batch beats a DMA a run (GATHER_RUN_BYTES, PASSES_RUN_BYTES)."""
        return runs >= 2 and pages * self._pools.block_nbytes < runs * run_bytes

    def _enqueue(self, dst: torch.Tensor, src: torch.Tensor, gpu_page: PageId, *,
                 filled_host_page: PageId | None = None) -> None:
        if self._stream is None or self._compute is None:
            dst.copy_(src)
            return
        self._stream.wait_stream(self._compute)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=self._non_blocking)
        self._pending_for_compute = True
        self._copied((gpu_page,), () if filled_host_page is None else (filled_host_page,))

    def _copied(self, gpu_pages: Iterable[int], filled_host_pages: Sequence[int]) -> None:
        """Under the lock, right after the copies of `gpu_pages` were enqueued, which filled
        `filled_host_pages` (GPU -> host copies, the host pages' checksums with them): one
        event after them stands for both (copy_stream order)."""
        assert self._stream is not None
        if self._page_copies is None and not filled_host_pages:
            return
        # Blocking sync: a worker thread waiting on it for a host page sleeps, not spins.
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        event.record(self._stream)
        if self._page_copies is not None:
            self._page_copies.copied(gpu_pages, event)
        if filled_host_pages:
            self._host_fills.filled(filled_host_pages, event)

    def fence(self) -> Fence:
        with self._lock:
            self._fences += 1
            if self._stream is None or self._compute is None:
                return _DoneFence()
            self._stream.wait_stream(self._compute)
            # A blocking-sync event puts a waiting worker thread to sleep instead of spinning
            # a core for the whole wait.
            event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            event.record(self._stream)
            return _EventFence(event)

    def fence_for_host_pages(self, host_pages: Iterable[int]) -> Fence:
        """A fence after every copy enqueued so far into one of `host_pages`, and after no
        later one: what a spill write that reads those pages waits for.  Copies into other
        pages queued before it (another request's eviction, often a whole batch of them)
        do not hold the write back.  A page no copy ever filled needs no wait."""
        with self._lock:
            self._fences += 1
            if self._stream is None:
                return _DoneFence()
            event = self._host_fills.newest(host_pages)
            return _DoneFence() if event is None else _EventFence(event)

    def order_before_compute(self) -> None:
        """After the scheduler enqueued copies: with ``compute_waits="all"``, later work on
        the compute stream waits for every copy enqueued so far; with "pages", nothing
        (:meth:`wait_for_pages` orders each forward pass instead)."""
        with self._lock:
            if (self._stream is None or self._compute is None or not self._pending_for_compute
                    or self._page_copies is not None):
                return
            self._compute.wait_stream(self._stream)
            self._pending_for_compute = False

    @property
    def orders_by_page(self) -> bool:
        """Whether :meth:`wait_for_pages` orders passes (compute_waits="pages" on a GPU): a
        caller with nothing else to do with its pages can skip naming them otherwise."""
        return self._page_copies is not None

    def wait_for_pages(self, gpu_pages: Iterable[int]) -> None:
        """Before a forward pass that reads or writes `gpu_pages`: with
        ``compute_waits="pages"``, the compute stream waits for the latest copy of any of
        them not waited for yet (one event: the copy stream runs in order), and for no
        other.  A no-op otherwise (every copy is waited for already) and on a CPU device.

        The pages a request has used in an earlier pass need not be named again: the cache
        never copies into a page of a running request, nor out of the part of one a pass
        writes (only whole, committed blocks are copied out, and a pass writes only its new
        tokens' slots)."""
        pending = self._page_copies
        if pending is None:
            return
        assert self._compute is not None
        with self._lock:
            event = pending.take(gpu_pages)
            if event is not None:
                self._compute.wait_event(event)
                self._page_waits += 1

    def statistics(self) -> CopyEngineStatistics:
        with self._lock:
            nbytes = self._pools.block_nbytes
            return CopyEngineStatistics(
                copies_to_host=self._copies_to_host,
                copies_to_gpu=self._copies_to_gpu,
                bytes_to_host=self._copies_to_host * nbytes,
                bytes_to_gpu=self._copies_to_gpu * nbytes,
                fences=self._fences,
                asynchronous=self._async,
                kernel_batches=self._kernel_batches,
                compute_waits=self.compute_waits,
                page_waits=self._page_waits,
            )
