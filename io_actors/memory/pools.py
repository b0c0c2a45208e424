"""The KV memory pools and the engine that copies pages between them.

:class:`KVPools` owns two preallocated tensors of pages, one on the compute device (L1) and
one in host memory (L2), each page holding one block's KV contiguously.  The core hands out
page numbers; nothing here allocates after construction.

:class:`TorchCopyEngine` executes the core's ``CopyGpuToHost`` / ``CopyHostToGpu`` commands
in batches on a few dedicated CUDA copy streams, each batch ordered after every earlier
copy that touched one of its pages (see its docstring for that, and for how it is ordered
against the forward pass).  On a CPU device the same code path performs real, synchronous
copies, so tests exercise the byte movement everywhere.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import Final

import attrs
import torch

from io_actors.memory import page_copy_kernel
from io_actors.memory.copy_order import PageCopyLedger
from io_actors.storage.buffers import page_aligned_buffer
from io_actors.storage.gpu_checksum import checksums_into, have_kernel, warm_up
from io_actors.storage.interfaces import Fence
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
        self.gpu: Final = self._allocate_gpu()
        self.host_pinned: bool = False
        self.host: Final = self._allocate_host()
        self.host_crcs: torch.Tensor | None = self._allocate_host_crcs()
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
                pinned = torch.zeros(shape, dtype=self.dtype, pin_memory=True)
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

    def _allocate_host_crcs(self) -> torch.Tensor | None:
        if self.device.type != "cuda" or not self.host_pinned or self.host_pages == 0:
            return None
        if not have_kernel():
            return None
        warm_up(self.block_nbytes, self.device)
        return torch.zeros(self.host_pages, dtype=torch.int32, pin_memory=True)

    def gpu_page(self, page: PageId) -> torch.Tensor:
        """One GPU page as a 1-D uint8 view of its block_nbytes bytes."""
        return _page_bytes(self.gpu, "gpu_page", page)

    def host_page(self, page: PageId) -> torch.Tensor:
        """One host page as a 1-D uint8 view of its block_nbytes bytes."""
        return _page_bytes(self.host, "host_page", page)

    def new_staging_buffer(self, blocks: int = 1) -> torch.Tensor:
        """A uint8 host buffer of `blocks` blocks, page aligned and pinned like the host pool.

        For reader workers: each stages a batch of disk reads through its own buffer.
        """
        nbytes = blocks * self.block_nbytes
        if self.host_pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return page_aligned_buffer(nbytes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _page_bytes(pool: torch.Tensor, field: str, page: int) -> torch.Tensor:
    if isinstance(page, bool) or not isinstance(page, int):
        raise UsageError(field, f"must be an integer page number, got {page!r}")
    if not 0 <= page < pool.shape[0]:
        raise UsageError(field, f"page {page} out of range [0, {pool.shape[0]})")
    return pool[page].view(-1).view(torch.uint8)


# --- the copy engine --------------------------------------------------------------------------


class _DoneFence:
    """The fence of a synchronous engine: every copy before it has already happened."""

    def wait(self) -> None:
        return None


def _event_done(event: torch.cuda.Event | None) -> bool:
    return event is None or bool(event.query())  # type: ignore[no-untyped-call]


class _EventFence:
    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self._events = events

    def wait(self) -> None:
        # Event.synchronize releases the GIL while it blocks.
        for event in self._events:
            event.synchronize()


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
    copy_path: str
    """How a batch of scattered pages is copied: "scattered-page kernel" (one launch per
    batch), "one copy per run" (one cudaMemcpyAsync per run of consecutive pages) or
    "synchronous" (CPU device)."""
    kernel_refused: str | None
    """Why a CUDA engine does not use the scattered-page kernel (None: it does, or CPU)."""
    kernel_batches: int
    """Batches copied by the scattered-page kernel."""
    batches: int
    """Copy batches enqueued (on CUDA each records one event on the copy stream)."""
    compute_waits: int
    """Compute-stream waits for a copy batch that a step's pages needed."""
    compute_waits_skipped: int
    """Steps whose pages had no copy batch in flight (no wait issued)."""
    lanes: int
    """Copy streams the batches are spread over (1 on a CPU device)."""
    lane_waits: int
    """Waits of a lane for a batch on another lane that touched one of its batch's pages."""


COPY_LANES: Final = 4
"""Copy streams of a CUDA copy engine: batches that share no page run side by side, so a
step waits for the copies of its own pages, never behind an unrelated spill."""


class TorchCopyEngine:
    """GPU <-> host page copies in batches on a few dedicated CUDA copy streams ("lanes").

    Ordering, on CUDA:

    - *Against the forward pass.*  Before each batch its lane waits for every kernel
      already enqueued on the compute stream (``wait_stream`` records an event there and
      makes the lane wait on it).  A copy out of a GPU page therefore sees the bytes of the
      forward pass that wrote them, and a copy into a GPU page cannot overwrite bytes that
      an earlier forward pass is still reading.  The compute stream is the one the forward
      pass runs on: by default the stream current on the constructing thread (torch's
      default stream unless the serving loop chose another); pass it explicitly otherwise.
      Capturing it once matters because torch's "current stream" is per thread, and the
      engine is driven from actor and worker threads, not the serving thread.
    - *Among copies.*  Each batch records an event; a
      :class:`~io_actors.memory.copy_order.PageCopyLedger` remembers, per GPU page and per
      host page, the last batch that touched it.  A batch goes to the lane with the least
      work in flight, after waiting for the last batch on another lane that touched any of
      its pages (the module lists the hazards); batches on one lane run in enqueue order.
      So a batch is ordered after every earlier copy it could conflict with, as one stream
      in command order would, and after nothing else.
    - *Forward pass after copies.*  :meth:`order_pages_before_compute` makes the compute
      stream wait only for the last batches that touched the pages a step touches (into or
      out of them: the module says why both; the scheduler calls it when it hands out a
      request's block table), so that spills and other requests' copies never delay a
      step.  :meth:`order_before_compute` makes it wait for every copy enqueued so far.
    - *Host threads after copies.*  :meth:`fence` records an event on every lane and on the
      compute stream: a worker thread blocks on ``Fence.wait()`` until every copy enqueued
      so far and the compute work queued before it completed, before it reads a host page
      just filled by a copy, or writes a page from outside the streams (a disk read, kvikio).

    A batch of several runs of pages is copied by one kernel launch where CUDA, cupy and a
    pinned host pool allow it and the kernel passed its self-check at construction
    (:mod:`io_actors.memory.page_copy_kernel`); otherwise, or with ``use_kernel=False``, by
    one ``cudaMemcpyAsync`` per run.  ``statistics().copy_path`` says which.

    On a CPU device every copy completes before its call returns and fences are no-ops.
    Methods may be called from several threads: a lock keeps enqueue order equal to call
    order.
    """

    def __init__(
        self, pools: KVPools, *, compute_stream: torch.cuda.Stream | None = None,
        use_kernel: bool = True, lanes: int = COPY_LANES,
    ) -> None:
        if not isinstance(pools, KVPools):
            raise ConfigError("pools", f"must be KVPools, got {pools!r}")
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= 16:
            raise ConfigError("lanes", f"must be an integer in [1, 16], got {lanes!r}")
        self._pools = pools
        self._lock = threading.Lock()
        self._copies_to_host = 0
        self._copies_to_gpu = 0
        self._fences = 0
        self._pending_for_compute = False
        self._async = pools.device.type == "cuda"
        self._streams: list[torch.cuda.Stream] = []
        if self._async:
            self._compute: torch.cuda.Stream | None = (
                compute_stream
                if compute_stream is not None
                else torch.cuda.current_stream(pools.device)
            )
            self._streams = [
                torch.cuda.Stream(device=pools.device)  # type: ignore[no-untyped-call]
                for _ in range(lanes)
            ]
        else:
            if compute_stream is not None:
                raise ConfigError("compute_stream", "only meaningful for a CUDA device")
            self._compute = None
        self._non_blocking = self._async and pools.host_pinned
        self._kernel_batches = 0
        # On a CPU device every batch is complete when recorded (its event is None): the
        # ledger still counts batches and steps, and checks the pages a step names.
        self._ledger: PageCopyLedger[torch.cuda.Event | None] = PageCopyLedger(
            pools.gpu_pages, _event_done, host_pages=pools.host_pages,
            lanes=max(1, len(self._streams)))
        self._kernel = False
        self.kernel_refused: str | None = None
        if self._async:
            self.kernel_refused = self._kernel_refusal(use_kernel)
            self._kernel = self.kernel_refused is None
            if self.kernel_refused is not None and use_kernel:
                _log.warning("copy engine: scattered pages are copied with one copy per run, "
                             "not the batch kernel: %s", self.kernel_refused)

    def _kernel_refusal(self, use_kernel: bool) -> str | None:
        """Why this engine must not use the scattered-page kernel (None: it may)."""
        pools = self._pools
        if not use_kernel:
            return "turned off (use_kernel=False)"
        if pools.host_pages == 0 or pools.gpu_pages == 0:
            return "an empty pool"
        why = page_copy_kernel.usable(pools.host, pools.gpu, pools.block_nbytes)
        if why is None:
            why = page_copy_kernel.self_check(pools.device, pools.block_nbytes)
        return why

    def copy_gpu_to_host(self, gpu_page: PageId, host_page: PageId) -> None:
        if self._pools.host_crcs is not None:
            # The page's checksum must be recorded with it: the batched path does that.
            self.copy_pages([(gpu_page, host_page)], to_gpu=False)
            return
        src = self._pools.gpu_page(gpu_page)
        dst = self._pools.host_page(host_page)
        with self._lock:
            self._batch([gpu_page], [host_page], lambda: self._copy(dst, src))
            self._copies_to_host += 1

    def copy_host_to_gpu(self, host_page: PageId, gpu_page: PageId) -> None:
        src = self._pools.host_page(host_page)
        dst = self._pools.gpu_page(gpu_page)
        with self._lock:
            self._batch([gpu_page], [host_page], lambda: self._copy(dst, src))
            self._copies_to_gpu += 1

    def copy_buffer_to_gpu(self, src: torch.Tensor, gpu_page: PageId) -> None:
        """Enqueue a copy of a one-block host buffer (a reader's staging buffer) into a GPU
        page, ordered after every earlier copy that touched the page.  The buffer must not
        be reused before a fence taken after this call has been waited on."""
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
            self._batch([gpu_page], [], lambda: self._copy(dst, src))
            self._copies_to_gpu += 1

    def copy_pages(
        self, pairs: Sequence[tuple[PageId, PageId]], *, to_gpu: bool
    ) -> None:
        """Enqueue many page copies as one batch: (source page, destination page) pairs,
        host -> GPU when `to_gpu`, else GPU -> host.

        One lock, one lane, one wait on the compute stream and one event for the whole
        list; one copy per run of pages consecutive on both sides (a run of blocks is one
        DMA), or, for a batch of several runs, one launch of the scattered-page kernel: the
        serving thread pays per batch what it paid per block.
        """
        if not pairs:
            return
        pools = self._pools
        src_pool, dst_pool = (pools.host, pools.gpu) if to_gpu else (pools.gpu, pools.host)
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
        sources = [src for src, _dst in pairs]
        destinations = [dst for _src, dst in pairs]
        gpu_pages, host_pages = (destinations, sources) if to_gpu else (sources, destinations)

        def work() -> None:
            # The kernel copies a batch's pages in no order: a destination named twice
            # (never by the core) keeps the per-run copies' last-wins order.
            if not (self._kernel and len(runs) > 1
                    and len(set(destinations)) == len(pairs)
                    and self._launch(src_pool, dst_pool, pairs)):
                for s0, d0, n in runs:
                    dst_pool[d0 : d0 + n].copy_(src_pool[s0 : s0 + n],
                                                non_blocking=self._non_blocking)
            if not to_gpu and pools.host_crcs is not None:
                # The host pages' checksums, from the GPU pages they were copied from,
                # behind the copies on the same lane (its event and fences cover it).
                checksums_into([pools.gpu_page(src) for src in sources], pools.host_crcs,
                               destinations)

        with self._lock:
            self._batch(gpu_pages, host_pages, work)
            if to_gpu:
                self._copies_to_gpu += len(pairs)
            else:
                self._copies_to_host += len(pairs)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self._non_blocking)

    def _batch(self, gpu_pages: Sequence[int], host_pages: Sequence[int],
               work: Callable[[], None]) -> None:
        """Run `work` (the batch's copies) on a lane, ordered after the compute stream and
        after the last batch on another lane that touched any of these pages; then record
        the batch's event under its pages.  Under the lock.  On a CPU device `work` runs
        here and now."""
        ledger = self._ledger
        if self._compute is None:
            work()
            ledger.record(0, gpu_pages, host_pages, None)
            return
        lane = ledger.idlest_lane()
        stream = self._streams[lane]
        for event in ledger.lane_waits_for(lane, gpu_pages, host_pages):
            if event is not None:
                stream.wait_event(event)
        stream.wait_stream(self._compute)
        with torch.cuda.stream(stream):
            work()
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        ledger.record(lane, gpu_pages, host_pages, event)
        self._pending_for_compute = True

    def _launch(self, src_pool: torch.Tensor, dst_pool: torch.Tensor,
                pairs: Sequence[tuple[PageId, PageId]]) -> bool:
        """One kernel launch for the batch, on the current stream (its lane); False (and
        the kernel off from now on, with the reason logged and in statistics) where the
        launch raised: the caller copies the batch per run instead, so that a kernel that
        passed its self-check but fails later costs speed, never a cache call."""
        try:
            page_copy_kernel.launch(src_pool, dst_pool, self._pools.block_nbytes, pairs,
                                    torch.cuda.current_stream(self._pools.device))
        except Exception as exc:  # cupy's errors have no common base we could name
            self._kernel = False
            self.kernel_refused = f"a launch failed: {type(exc).__name__}: {exc}"
            _log.error("copy engine: the scattered-page kernel failed, falling back to one "
                       "copy per run: %s", self.kernel_refused)
            return False
        self._kernel_batches += 1
        return True

    def fence(self) -> Fence:
        with self._lock:
            self._fences += 1
            if self._compute is None:
                return _DoneFence()
            # A blocking-sync event puts a waiting worker thread to sleep instead of spinning
            # a core for the whole wait.  The compute stream's own event: a page just freed
            # by the core may still be read or written by a forward pass in flight.
            events = []
            for stream in (*self._streams, self._compute):
                event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                event.record(stream)
                events.append(event)
            return _EventFence(events)

    def order_pages_before_compute(self, gpu_pages: Sequence[PageId]) -> None:
        """Make later work on the compute stream wait for the copies that touched
        `gpu_pages` (into or out of them) -- the pages a step reads and writes -- and for
        nothing else: at most one stream wait per lane, none when no such copy is in flight.

        Must be called after the copies that fill the pages were enqueued and before the
        step that touches them is; the scheduler calls it when it hands out a block table.

        raises: UsageError("pages") for a page outside the GPU pool.
        """
        with self._lock:
            events = self._ledger.wait_for(gpu_pages)
            if self._compute is not None:
                for event in events:
                    if event is not None:
                        self._compute.wait_event(event)

    def order_before_compute(self) -> None:
        with self._lock:
            if self._compute is None or not self._pending_for_compute:
                return
            for stream in self._streams:
                self._compute.wait_stream(stream)
            self._pending_for_compute = False
            self._ledger.settle_all()

    @property
    def copy_path(self) -> str:
        if not self._async:
            return "synchronous"
        return "scattered-page kernel" if self._kernel else "one copy per run"

    def check_invariants(self) -> None:
        with self._lock:
            self._ledger.check_invariants()

    def statistics(self) -> CopyEngineStatistics:
        with self._lock:
            nbytes = self._pools.block_nbytes
            ledger = self._ledger.statistics()
            return CopyEngineStatistics(
                copies_to_host=self._copies_to_host,
                copies_to_gpu=self._copies_to_gpu,
                bytes_to_host=self._copies_to_host * nbytes,
                bytes_to_gpu=self._copies_to_gpu * nbytes,
                fences=self._fences,
                asynchronous=self._async,
                copy_path=self.copy_path,
                kernel_refused=self.kernel_refused,
                kernel_batches=self._kernel_batches,
                batches=ledger.batches,
                compute_waits=ledger.waits,
                compute_waits_skipped=ledger.waits_skipped,
                lanes=self._ledger.lanes,
                lane_waits=ledger.lane_waits,
            )
