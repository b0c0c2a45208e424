"""The connector in each vLLM worker: host pool, slot store, reader and writer threads.

It executes the scheduler side's commands (statekv.messages, via :class:`~io_actors.vllm.
plans.StepPlan`) in the core's order, and reports what happened.  It decides nothing: which
page, which slot and which block are the core's decisions, made in the engine-core process.

* Copies between vLLM's paged caches and the pinned host pages (``CopyEngineToHost`` for a
  save, ``CopyHostToEngine`` for a host hit) run in vLLM's worker thread, in command order,
  one batched gather or scatter per layer (:class:`~io_actors.vllm.layouts.EnginePages`).
* Disk writes (spills from host pages) and reads (disk hits) run on thread pools; a read
  lands in a staging buffer and is scattered into the engine's pages by vLLM's worker
  thread in :meth:`WorkerSide.finished`, only once its header, key and checksum were
  verified by the store.  A read that fails writes nothing into the engine's pages: its
  page goes to ``invalid_block_ids`` and vLLM recomputes it.
* A request is reported done loading (``finished_recving``) when every read of it reported
  on this rank; a save is reported done (``finished_sending``) once its copies ran, so the
  engine keeps those pages until then.

At open, the store rebuilds its index (persistence): what it found is written to a
manifest in the rank's directory for the scheduler side, which vLLM constructs after the
workers have registered their caches (``io_actors.vllm.connector``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

import attrs
import torch

from io_actors.actors.scheduler import append_retention, retention_store
from io_actors.config import StateKVConfig
from io_actors.storage.interfaces import BatchOutcome, SlotIO, SlotStore
from io_actors.storage.open_store import open_slot_store, public_config_error
from io_actors.storage.posix_open import Recovery
from io_actors.storage.retention_journal import RetentionRecord
from io_actors.storage.slot_format import SlotMeta
from io_actors.vllm.layouts import EnginePages
from io_actors.vllm.plans import RequestLoad, StepPlan, TransferReport, WorkerReport
from io_actors.vllm.settings import named
from statekv.errors import ConfigError, TransferFailed
from statekv.ids import TransferId
from statekv.messages import (
    CopyEngineToHost,
    CopyHostToEngine,
    FreeSlot,
    LoadSlot,
    LoadSlots,
    PersistRetention,
    WriteSlot,
    WriteSlots,
)

log = logging.getLogger(__name__)

MANIFEST: Final = "engine-restore.json"
"""The rank directory's file naming what this engine's open restored (for the scheduler)."""
_U32 = 2**32 - 1


def manifest_path(config: StateKVConfig) -> Path | None:
    directory = config.rank_directory()
    return None if directory is None else directory / MANIFEST


@attrs.define(eq=False)
class _ReadJob:
    batch: tuple[LoadSlot, ...]
    staging: torch.Tensor
    future: cf.Future[tuple[BatchOutcome, float]]


@attrs.define(eq=False)
class _WriteJob:
    transfers: tuple[TransferId, ...]
    future: cf.Future[BatchOutcome]


class WorkerSide:
    """One rank's half of the connector (vLLM's worker process)."""

    def __init__(self, config: StateKVConfig, *, instance: str) -> None:
        self.config = config
        self.core_config = core = config.core_config()
        self.instance = instance
        self.pages: EnginePages | None = None
        self.host: torch.Tensor | None = None
        self.store: SlotStore | None = None
        self._writers: cf.ThreadPoolExecutor | None = None
        self._readers: cf.ThreadPoolExecutor | None = None
        self._staging: list[torch.Tensor] = []
        self._reads: list[_ReadJob] = []
        self._writes: list[_WriteJob] = []
        self._retention: list[cf.Future[None]] = []
        self._page_of: dict[TransferId, int] = {}
        self._request_of: dict[TransferId, str] = {}
        self._loading: dict[str, set[TransferId]] = {}
        self._recving: set[str] = set()
        self._saved: set[str] = set()
        self._finished_seen: set[str] = set()
        self._errors: set[int] = set()
        self._outcomes: dict[TransferId, TransferReport] = {}
        self._disk_reads: list[tuple[int, float]] = []
        self._payload = core.block_bytes

    # ------------------------------------------------------------------ setup

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Adopt vLLM's caches; allocate the host pool; open the store (restoring it)."""
        # vLLM registers under inference mode; tensors made there could not be written by
        # the reader threads, which run outside it.
        with torch.inference_mode(False):
            self._register(kv_caches)

    def _register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        core = self.core_config
        try:
            pages = EnginePages(kv_caches, expect=core.layout, block_size=core.block_size)
        except ConfigError as exc:
            raise ConfigError(f"vllm kv cache: {exc.field}", exc.message) from None
        if pages.page_nbytes != self._payload:
            raise ConfigError("vllm kv cache", f"a block is {pages.page_nbytes} bytes in vLLM's "
                              f"caches, {self._payload} in statekv's layout")
        self.pages = pages
        on_cuda = pages.device.type == "cuda"
        host_pages = core.host_blocks + core.reserved_host_blocks
        self.host = torch.empty((host_pages, *pages.page_shape), dtype=pages.dtype,
                                pin_memory=on_cuda)
        if core.disk_blocks:
            directory = self.config.rank_directory()
            assert directory is not None
            try:
                self.store = open_slot_store(
                    self.config.backend, directory, core, persist=self.config.persist,
                    sync_writes=self.config.disk_sync == "data",
                    mac_key=self.config.disk_mac_key, owned_from=self.config.disk_dir)
            except ConfigError as exc:
                public = public_config_error(exc)
                raise public.renamed(named(public.field)) from None
            self._write_manifest(directory)
            self._writers = cf.ThreadPoolExecutor(self.config.writers, "statekv-writer")
            self._readers = cf.ThreadPoolExecutor(self.config.readers, "statekv-reader")
            batch = core.max_batch_blocks
            self._staging = [
                torch.empty((batch, *pages.page_shape), dtype=pages.dtype, pin_memory=on_cuda)
                for _ in range(2 * self.config.readers)
            ]

    def _write_manifest(self, directory: Path) -> None:
        recovery = getattr(self.store, "recovery", None)
        slots = recovery.slots if isinstance(recovery, Recovery) else ()
        entries = [
            [found.slot, found.key.hex(), found.meta.parent.hex(), found.meta.depth,
             found.meta.reuse_count, found.meta.expiry, found.meta.written_at,
             found.meta.sequence]
            for found in slots
        ]
        body = json.dumps({"instance": self.instance, "blocks": entries})
        tmp = directory / f".{MANIFEST}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, directory / MANIFEST)
        if slots:
            log.info("statekv: %d blocks restored from %s", len(slots), directory)

    # ------------------------------------------------------------------ one step

    def start(self, plan: StepPlan) -> None:
        """Execute a step's commands in order and take note of its loads and saves."""
        pages, host = self.pages, self.host
        assert pages is not None and host is not None, "register_kv_caches comes first"
        saves: tuple[list[int], list[int]] = ([], [])   # engine pages, host pages
        loads: tuple[list[int], list[int]] = ([], [])   # host pages, engine pages
        on_cuda = pages.device.type == "cuda"

        def flush() -> None:
            if saves[0]:
                pages.save(saves[0], host, saves[1])
                saves[0].clear()
                saves[1].clear()
            if loads[0]:
                pages.load(loads[0], host, loads[1])
                loads[0].clear()
                loads[1].clear()

        copied = False
        for cmd in plan.commands:
            # One copy call takes each page at most once: two requests of a step may copy
            # the same host page (a shared prefix), so a repeated page starts a new call.
            if isinstance(cmd, CopyEngineToHost):
                if loads[0] or cmd.engine_page in saves[0] or cmd.host_page in saves[1]:
                    flush()
                saves[0].append(cmd.engine_page)
                saves[1].append(cmd.host_page)
                copied = True
            elif isinstance(cmd, CopyHostToEngine):
                if saves[0] or cmd.host_page in loads[0] or cmd.engine_page in loads[1]:
                    flush()
                loads[0].append(cmd.host_page)
                loads[1].append(cmd.engine_page)
                copied = True
            else:
                flush()
                if on_cuda and copied:
                    # A write reads a page a copy above may still be filling.
                    torch.cuda.current_stream(pages.device).synchronize()
                    copied = False
                self._io_command(cmd)
        flush()
        if on_cuda and copied:
            torch.cuda.current_stream(pages.device).synchronize()
        for load in plan.loads:
            self._track(load)
        self._saved.update(plan.saves)

    def _io_command(self, cmd: object) -> None:
        store = self.store
        if isinstance(cmd, WriteSlots):
            assert store is not None and self._writers is not None
            items = [self._write_item(w) for w in cmd.writes]
            self._writes.append(_WriteJob(
                transfers=tuple(w.transfer for w in cmd.writes),
                future=self._writers.submit(store.write_many, items)))
        elif isinstance(cmd, LoadSlots):
            assert store is not None and self._readers is not None
            staging = self._staging.pop() if self._staging else self._new_staging()
            self._page_of.update((r.transfer, r.engine_page) for r in cmd.reads)
            self._reads.append(_ReadJob(
                batch=cmd.reads, staging=staging,
                future=self._readers.submit(_timed_read, store, cmd.reads, staging)))
        elif isinstance(cmd, FreeSlot):
            assert store is not None
            store.discard(cmd.slot)
        elif isinstance(cmd, PersistRetention):
            journal = retention_store(store)
            if journal is not None and self._writers is not None:
                record = RetentionRecord(slot=cmd.slot, key=cmd.key, expiry=cmd.expiry)
                self._retention.append(self._writers.submit(append_retention, journal,
                                                            [record]))
        else:
            raise TypeError(f"the connector's worker cannot execute {cmd!r}")

    def _write_item(self, w: WriteSlot) -> SlotIO:
        host = self.host
        assert host is not None
        meta = None if w.parent is None else SlotMeta(
            parent=w.parent, depth=w.depth, reuse_count=min(w.reuse_count, _U32),
            expiry=w.expiry, written_at=w.issued_at, sequence=w.transfer)
        return SlotIO(w.slot, w.key, host[w.host_page].view(torch.uint8).reshape(-1),
                      meta=meta)

    def _new_staging(self) -> torch.Tensor:
        pages = self.pages
        assert pages is not None
        with torch.inference_mode(False):
            return torch.empty((self.core_config.max_batch_blocks, *pages.page_shape),
                               dtype=pages.dtype, pin_memory=pages.device.type == "cuda")

    def _track(self, load: RequestLoad) -> None:
        for tid in load.transfers:
            self._request_of[tid] = load.request_id
        self._errors.update(load.unavailable_pages)
        if load.transfers:
            self._loading[load.request_id] = set(load.transfers)
        else:
            self._recving.add(load.request_id)

    # ------------------------------------------------------------------ reporting

    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """(saves done, loads done) since the last call; applies landed reads first."""
        self._finished_seen.update(finished_req_ids)
        self._collect(block=False)
        sending = {rid for rid in self._saved if rid in self._finished_seen}
        self._saved -= sending
        self._finished_seen -= sending
        recving, self._recving = self._recving, set()
        return sending, recving

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def report(self) -> WorkerReport | None:
        if not self._outcomes and not self._disk_reads:
            return None
        out = WorkerReport(outcomes=self._outcomes, disk_reads=tuple(self._disk_reads))
        self._outcomes, self._disk_reads = {}, []
        return out

    def _collect(self, *, block: bool) -> None:
        pages = self.pages
        waiting_reads: list[_ReadJob] = []
        for job in self._reads:
            if not (block or job.future.done()):
                waiting_reads.append(job)
                continue
            try:
                results, seconds = job.future.result()
            except Exception as exc:  # a store bug: every item failed, none served
                log.exception("statekv: a read batch raised")
                results, seconds = [TransferFailed("batch", str(exc))] * len(job.batch), 0.0
            good = [i for i, r in enumerate(results) if r is None]
            if good and pages is not None:
                pages.load(good, job.staging, [job.batch[i].engine_page for i in good])
                if pages.device.type == "cuda":
                    torch.cuda.current_stream(pages.device).synchronize()
                if seconds > 0:
                    self._disk_reads.append((len(good) * self._payload, seconds))
            for load, result in zip(job.batch, results, strict=True):
                self._outcome(load.transfer, None if result is None else str(result))
                page = self._page_of.pop(load.transfer)
                rid = self._request_of.pop(load.transfer)
                if result is not None:
                    self._errors.add(page)
                waiting = self._loading.get(rid)
                if waiting is not None:
                    waiting.discard(load.transfer)
                    if not waiting:
                        del self._loading[rid]
                        self._recving.add(rid)
            self._staging.append(job.staging)
        self._reads = waiting_reads
        waiting_writes: list[_WriteJob] = []
        for wjob in self._writes:
            if not (block or wjob.future.done()):
                waiting_writes.append(wjob)
                continue
            try:
                wresults = wjob.future.result()
            except Exception as exc:
                log.exception("statekv: a write batch raised")
                wresults = [TransferFailed("batch", str(exc))] * len(wjob.transfers)
            for tid, wresult in zip(wjob.transfers, wresults, strict=True):
                self._outcome(tid, None if wresult is None else str(wresult))
        self._writes = waiting_writes
        self._retention = [f for f in self._retention if not f.done() or _log_failure(f)]

    def _outcome(self, tid: TransferId, failure: str | None) -> None:
        if failure is not None:
            log.warning("statekv: transfer %d failed: %s", tid, failure)
        self._outcomes[tid] = TransferReport(ranks=1, failure=failure)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Finish what is in flight (its outcomes are dropped: the engine is going away) and
        close the store."""
        self._collect(block=True)
        for pool in (self._readers, self._writers):
            if pool is not None:
                pool.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
            self.store = None


def _timed_read(store: SlotStore, reads: tuple[LoadSlot, ...],
                staging: torch.Tensor) -> tuple[BatchOutcome, float]:
    # The views are made here, outside the inference mode vLLM's worker thread runs in: a
    # view made there could not be written.
    items = [SlotIO(r.slot, r.key, staging[i].view(torch.uint8).reshape(-1))
             for i, r in enumerate(reads)]
    start = time.perf_counter()
    results = store.read_many(items)
    return results, time.perf_counter() - start


def _log_failure(future: cf.Future[None]) -> bool:
    exc = future.exception()
    if exc is not None:
        log.warning("statekv: a retention deadline was not persisted: %s", exc)
    return False
