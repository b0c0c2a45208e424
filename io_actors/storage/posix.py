"""Disk slots in one preallocated file, read and written with O_DIRECT where possible.

Layout: one data file per store, slot ``s`` at offset ``s * slot_bytes``, each slot in the
format of :mod:`io_actors.storage.slot_format`.  Measured on this project's CPU machine (ext4 on a
virtio disk, O_DIRECT, 1 MiB and 4 MiB payloads, 1 and 4 threads, 2 GiB per run, three
runs; the disk is noisy, +-30% between runs): reads ran at the disk's ceiling either way
(0.5-1.1 GB/s for both layouts); overwriting slots from one thread ran at 1.9-2.5 GB/s in
the shared file against 1.5-1.9 GB/s with a file per slot, whose every write also pays an
open and a close; with four threads both ran at 1.4-2.7 GB/s; first writes into fresh space
ran at 0.5-1.4 GB/s in both.  Throughput does not separate them much; the rest decides for
the shared file: one descriptor for any number of slots (a file per slot needs an open per
transfer or a descriptor per slot), the whole capacity reserved up front with
``posix_fallocate`` (running out of disk is a ConfigError at startup, not an ENOSPC in the
middle of serving), and one lock that keeps two caches (a draft and a target model, two ranks
misconfigured onto one directory) from sharing slots.

Buffers: O_DIRECT needs the buffer address, file offset and length aligned to the logical
block size.  A page-aligned tensor whose payload length is a multiple of 4096 (pinned host
pages, reader staging buffers) goes to the kernel directly, together with a separate aligned
header block in one ``preadv`` / ``pwritev``; anything else is copied through an aligned
bounce buffer.  Filesystems that refuse O_DIRECT fall back to buffered I/O, with the reason
logged.

Batches: ``write_many`` / ``read_many`` move a batch of slots with one ``pwritev`` /
``preadv`` per run of consecutive slot numbers (the core hands out empty slots in order, so a
round of spills usually is one run): header, payload and padding of every slot of the run are
iovecs of a single call, so the kernel sees one large sequential transfer instead of one
call per block, and the worker thread holds the interpreter lock only to build the iovec list
and to check the headers.  A run that the kernel moves only in part is resumed at the first
slot that did not land in full; a failed call fails the slots it had not moved.

Failure: every I/O error, short transfer, or header / checksum mismatch raises
:class:`~statekv.errors.TransferFailed` naming the slot.  A failed read may have written
garbage into ``dst``: the caller never publishes a page whose read raised.

Opening the directory (locking and vetting it, creating, resizing or wiping the data file,
rebuilding the index from the index journal or the slot headers, replaying the retention
journal) is :mod:`io_actors.storage.posix_open`'s; this module starts where it ends, with an
open data file, and holds the transfer code and the store's counters.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Final

import attrs
import torch

from io_actors.storage.buffers import check_block_tensor, host_view, page_aligned_buffer
from io_actors.storage.index_journal import IndexJournalStatistics, Observer
from io_actors.storage.interfaces import BatchOutcome, SlotIO
from io_actors.storage.posix_open import Recovery, StoreOpening
from io_actors.storage.retention_journal import JournalStatistics, RetentionRecord
from io_actors.storage.slot_format import (
    ALIGN,
    HEADER_SIZE,
    MacMismatch,
    SlotExtent,
    SlotHeader,
    SlotMeta,
    check_key,
    check_mac_key,
    check_payload_crc,
    config_fingerprint,
    payload_checksum,
    slot_nbytes,
    verify_checksum,
    verify_header,
    verify_mac,
)
from statekv.config import CacheConfig
from statekv.errors import ConfigError, TransferFailed, UsageError
from statekv.ids import BlockHash, SlotId

_log = logging.getLogger(__name__)

_O_DIRECT: Final = getattr(os, "O_DIRECT", 0)
_MAX_RUN: Final = 256
"""Slots per vector call: three iovecs each stays under Linux's IOV_MAX of 1024."""


_VectorCall = Callable[[int, Sequence[memoryview], int], int]
"""os.preadv or os.pwritev."""


@attrs.frozen(kw_only=True)
class SlotStoreStatistics:
    """Counters of one slot store."""

    writes: int
    """Slots written successfully."""
    reads: int
    """Slots read and verified successfully."""
    write_failures: int
    read_failures: int
    """Reads that raised TransferFailed (I/O error, short read, header or checksum)."""
    bytes_written: int
    """Payload bytes of successful writes."""
    bytes_read: int
    """Payload bytes of successful reads."""
    bounced: int
    """Transfers copied through an aligned bounce buffer (unaligned tensor or length)."""
    direct_io: bool
    """Whether the data file is read and written with O_DIRECT."""
    mac_failures: int = 0
    """Reads refused because the slot's keyed MAC was missing or wrong (counted in
    read_failures too)."""
    retention_records: int = 0
    """Lengthened deadlines appended to the retention journal."""
    retention_failures: int = 0
    """Lengthened deadlines whose append failed (kept in memory only)."""
    journal_compactions: int = 0
    """Run-time rewrites of the retention journal (it holds a bounded number of records)."""
    index_records: int = 0
    """Records appended to the index journal (landed spills, freed slots, the seal)."""
    index_failures: int = 0
    """Index journal appends that failed (the journal is then off until the next open,
    which scans the headers)."""


class _Buffer:
    """One aligned slot-sized buffer: header block, payload, padding."""

    __slots__ = ("header", "pad", "payload", "payload_tensor", "tensor", "whole")

    def __init__(self, payload_len: int) -> None:
        total = slot_nbytes(payload_len)
        self.tensor = page_aligned_buffer(total)
        self.whole = host_view(self.tensor)
        self.header = self.whole[:HEADER_SIZE]
        self.payload = self.whole[HEADER_SIZE : HEADER_SIZE + payload_len]
        self.pad = self.whole[HEADER_SIZE + payload_len :]
        self.payload_tensor = self.tensor[HEADER_SIZE : HEADER_SIZE + payload_len]


class _Headers:
    """Aligned header blocks for one vector call (O_DIRECT wants every iovec aligned)."""

    __slots__ = ("tensor", "views")

    def __init__(self, count: int) -> None:
        self.tensor = page_aligned_buffer(count * HEADER_SIZE)
        whole = host_view(self.tensor)
        self.views = [whole[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] for i in range(count)]


_SlotCall = Callable[[SlotIO, _Buffer, str], None]
"""One slot through a bounce buffer (PosixSlotStore._write or ._read)."""


class PosixSlotStore:
    """:class:`~io_actors.storage.interfaces.SlotStore` over one preallocated file.

    ``directory`` is created 0700 if missing; the data file is created 0600.  Both must
    belong to the effective user and be writable by no one else.  ``direct_io`` asks for
    O_DIRECT (the store falls back to buffered I/O, logged, where the filesystem refuses
    it).  ``preallocate`` reserves the whole capacity at construction; without it the file is
    sparse and blocks are allocated by the first write of each slot.  ``sync_writes`` makes
    every write ``fdatasync`` before it reports success, so that a spill that landed survives
    power loss (specs/disk_persistence.md); without it a slot lost in a crash reads back as a
    header or checksum failure, never as wrong KV.  ``persist`` keeps what an earlier process
    left in the directory (:attr:`recovery` lists it); without it the data file is recreated
    empty.  ``mac_key`` (16-64 bytes, never stored) signs every slot written with keyed
    BLAKE2b and refuses to serve a slot whose MAC is missing or wrong.

    Opening is all or nothing: a failure removes the directories and files the open created
    and leaves an existing data file as it was (a file it was growing is cut back).  A
    second store on the same directory, in this process or another, is refused
    (:class:`~statekv.errors.DirectoryInUse`) while the first is open.

    Thread safety: any number of threads may read and write different slots concurrently
    (positional I/O on one descriptor, a pool of per-transfer buffers).  :meth:`close` waits
    for transfers in flight, then closes the file.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: CacheConfig,
        *,
        direct_io: bool = True,
        preallocate: bool = True,
        sync_writes: bool = False,
        persist: bool = True,
        mac_key: bytes | None = None,
        owned_from: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise ConfigError("config", f"must be a CacheConfig, got {config!r}")
        for field, value in (
            ("direct_io", direct_io), ("preallocate", preallocate), ("sync_writes", sync_writes),
            ("persist", persist),
        ):
            if not isinstance(value, bool):
                raise ConfigError(field, f"must be True or False, got {value!r}")
        try:
            self._mac_key = check_mac_key("mac_key", mac_key)
        except UsageError as exc:
            raise ConfigError("mac_key", exc.args[0].split(": ", 1)[1]) from None
        if config.disk_blocks < 1:
            raise ConfigError("disk_blocks", "a slot store needs disk_blocks >= 1")
        self._payload_len: Final = config.block_bytes
        self._slot_bytes: Final = slot_nbytes(config.block_bytes)
        self._slots: Final = config.disk_blocks
        self._sync_writes = sync_writes
        layout = config.layout
        self._config_fp: Final = config_fingerprint(
            model_fingerprint=config.model_fingerprint,
            layout=(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype),
            block_size=config.block_size,
        )
        opened = StoreOpening(
            directory, slots=self._slots, slot_bytes=self._slot_bytes,
            payload_len=self._payload_len, config_fp=self._config_fp, mac_key=self._mac_key,
            owned_from=owned_from,
        ).run(preallocate=preallocate, persist=persist, sync_writes=sync_writes)
        self._path = opened.path
        self._dir_fd = opened.dir_fd
        self._fd = opened.fd
        self._recovery = opened.recovery
        self._journal = opened.journal
        self._index = opened.index
        self._direct = direct_io and self._enable_direct_io()
        self._cond = threading.Condition()
        self._closed = False
        self._in_flight = 0
        self._free_buffers: list[_Buffer] = []
        self._free_headers: list[_Headers] = []
        # Padding after each payload: zeros to write, scratch to read into (the bytes read
        # there are never looked at, so concurrent reads may share it).
        pad = self._slot_bytes - HEADER_SIZE - self._payload_len
        self._zero_pad = page_aligned_buffer(pad)
        self._scratch_pad = page_aligned_buffer(pad)
        self._zero_pad_view = host_view(self._zero_pad) if pad else None
        self._scratch_pad_view = host_view(self._scratch_pad) if pad else None
        self._writes = 0
        self._reads = 0
        self._write_failures = 0
        self._read_failures = 0
        self._mac_failures = 0
        self._bounced = 0

    def _enable_direct_io(self) -> bool:
        """Turn on O_DIRECT and prove it with one aligned read; fall back, logged."""
        if not _O_DIRECT:
            _log.warning("%s: O_DIRECT is not available on this platform", self._path)
            return False
        try:
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | _O_DIRECT)
            probe = _Buffer(ALIGN)
            os.preadv(self._fd, [probe.header], 0)
        except OSError as exc:
            _log.warning(
                "%s: the filesystem refuses O_DIRECT (%s); using buffered I/O", self._path, exc
            )
            with contextlib.suppress(OSError):
                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
            return False
        return True

    # --- properties -------------------------------------------------------------------------

    @property
    def device_reads(self) -> bool:
        return False

    @property
    def path(self) -> Path:
        """The data file."""
        return self._path

    @property
    def recovery(self) -> Recovery:
        """What the open found in the directory (empty when persist is off)."""
        return self._recovery

    @property
    def config_fingerprint(self) -> bytes:
        """The fingerprint written into every slot header (slot_format.config_fingerprint)."""
        return self._config_fp

    @property
    def direct_io(self) -> bool:
        return self._direct

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot on disk (header, payload, padding)."""
        return self._slot_bytes

    @property
    def payload_len(self) -> int:
        return self._payload_len

    def slot_extent(self, slot: SlotId) -> SlotExtent:
        """Where `slot` lives in the data file."""
        self._check_slot(slot)
        return SlotExtent(
            path=str(self._path), offset=slot * self._slot_bytes, nbytes=self._slot_bytes
        )

    # --- transfers --------------------------------------------------------------------------

    def write(
        self, slot: SlotId, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None
    ) -> None:
        """Write `src` to `slot` under `key`; `meta` makes the slot restorable after a
        restart (without it, a later open reclaims the slot instead of serving it)."""
        self._check_slot(slot)
        check_key(key)
        check_block_tensor("src", src, self._payload_len, device_type="cpu")
        if meta is not None and not isinstance(meta, SlotMeta):
            raise UsageError("meta", f"must be a SlotMeta or None, got {meta!r:.80}")
        what = f"slot {slot}"
        with self._transfer() as buffer:
            self._index.before_write([slot])
            try:
                self._write(slot, key, src, meta, buffer, what)
            except TransferFailed:
                with self._cond:
                    self._write_failures += 1
                raise
            if meta is not None:
                self._index.landed([(slot, bytes(key), meta)])
            with self._cond:
                self._writes += 1
        self._journal.slot_written(slot, key)

    def _write(
        self, slot: SlotId, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None,
        buffer: _Buffer, what: str,
    ) -> None:
        payload = host_view(src)
        header = SlotHeader(
            slot=slot, key=key, payload_len=self._payload_len,
            payload_crc=payload_checksum(payload), config=self._config_fp, meta=meta,
        )
        # Header and payload go down in one pwritev: a crash can tear them apart, and the
        # payload checksum (and MAC) in the header is what finds that on the read back.
        header.pack_into(buffer.header, mac_key=self._mac_key, payload=payload)
        if self._zero_copy(src):
            if buffer.pad.nbytes:
                buffer.pad[:] = bytes(buffer.pad.nbytes)
                iov = [buffer.header, payload, buffer.pad]
            else:
                iov = [buffer.header, payload]
        else:
            buffer.payload_tensor.copy_(src)
            buffer.pad[:] = bytes(buffer.pad.nbytes)
            iov = [buffer.whole]
            with self._cond:
                self._bounced += 1
        offset = slot * self._slot_bytes
        try:
            written = os.pwritev(self._fd, iov, offset)
            if written == self._slot_bytes and self._sync_writes:
                os.fdatasync(self._fd)
        except OSError as exc:
            raise TransferFailed(what, f"write failed: {exc}") from exc
        if written != self._slot_bytes:
            raise TransferFailed(what, f"short write: {written} of {self._slot_bytes} bytes")

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        self._check_slot(slot)
        check_key(key)
        check_block_tensor("dst", dst, self._payload_len, device_type="cpu")
        what = f"slot {slot}"
        with self._transfer() as buffer:
            try:
                self._read(slot, key, dst, buffer, what)
            except TransferFailed:
                with self._cond:
                    self._read_failures += 1
                raise
            with self._cond:
                self._reads += 1

    def _read(
        self, slot: SlotId, key: BlockHash, dst: torch.Tensor, buffer: _Buffer, what: str
    ) -> None:
        zero_copy = self._zero_copy(dst)
        if zero_copy:
            payload = host_view(dst)
            iov = [buffer.header, payload, buffer.pad] if buffer.pad.nbytes else [
                buffer.header, payload
            ]
        else:
            payload = buffer.payload
            iov = [buffer.whole]
        try:
            got = os.preadv(self._fd, iov, slot * self._slot_bytes)
        except OSError as exc:
            raise TransferFailed(what, f"read failed: {exc}") from exc
        if got != self._slot_bytes:
            raise TransferFailed(what, f"short read: {got} of {self._slot_bytes} bytes")
        header = SlotHeader.unpack(buffer.header, what=what)
        verify_header(header, what=what, slot=slot, key=key, payload_len=self._payload_len)
        if header.config != self._config_fp:
            raise TransferFailed(what, "written under another configuration fingerprint")
        verify_checksum(header, payload_checksum(payload, version=header.version), what=what)
        try:
            verify_mac(self._mac_key, buffer.header, header, payload, what=what)
        except MacMismatch:
            with self._cond:
                self._mac_failures += 1
            raise
        if not zero_copy:
            dst.copy_(buffer.payload_tensor)
            with self._cond:
                self._bounced += 1

    # --- batches ----------------------------------------------------------------------------

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        items = self._check_batch("writes", writes, "src")
        out: BatchOutcome = [None] * len(items)
        with self._batch() as headers:
            self._index.before_write([item.slot for item in items])
            for run, direct in self._runs(items):
                if direct:
                    self._write_run(items, run, headers, out)
                else:
                    self._each(items, run, out, lambda item, buffer, what: self._write(
                        item.slot, item.key, item.buffer, item.meta, buffer, what))
            # After the writes returned (and were synced, under sync_writes): a record never
            # names bytes that were not written.
            self._index.landed([(item.slot, bytes(item.key), item.meta)
                                for item, outcome in zip(items, out, strict=True)
                                if outcome is None and item.meta is not None])
        self._count(out, write=True)
        for item, outcome in zip(items, out, strict=True):
            if outcome is None:
                self._journal.slot_written(item.slot, item.key)
        return out

    def persist_retention(self, records: Sequence[RetentionRecord]) -> None:
        """Append lengthened deadlines to the retention journal (retention_journal.py).

        raises: TransferFailed when the append failed (the journal stays whole).
        """
        for record in records:
            if not isinstance(record, RetentionRecord):
                raise UsageError("records", f"must hold RetentionRecord, got {record!r:.80}")
            self._check_slot(record.slot)
        with self._cond:
            if self._closed:
                raise UsageError("store", f"slot store {self._path} is closed")
            self._in_flight += 1
        try:
            self._journal.append(records)
        finally:
            with self._cond:
                self._in_flight -= 1
                if not self._in_flight:
                    self._cond.notify_all()

    @property
    def journal_path(self) -> Path:
        """The retention journal (fault injection tears appends to it)."""
        return self._journal.path

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        items = self._check_batch("reads", reads, "dst")
        out: BatchOutcome = [None] * len(items)
        with self._batch() as headers:
            for run, direct in self._runs(items):
                if direct:
                    self._read_run(items, run, headers, out)
                else:
                    self._each(items, run, out, lambda item, buffer, what: self._read(
                        item.slot, item.key, item.buffer, buffer, what))
        self._count(out, write=False)
        return out

    def _check_batch(self, field: str, batch: Sequence[SlotIO], role: str) -> list[SlotIO]:
        """Every item valid and every slot named once, before any byte moves."""
        items = list(batch)
        write = role == "src"
        for item in items:
            if not isinstance(item, SlotIO):
                raise UsageError(field, f"must hold SlotIO items, got {item!r:.80}")
            self._check_slot(item.slot)
            check_key(item.key)
            check_block_tensor(role, item.buffer, self._payload_len, device_type="cpu")
            if write:
                # What the header holds beyond the store's own fields, checked here, before
                # any byte (or index record) moves, not when its header is packed.
                if item.crc is not None:
                    check_payload_crc("crc", item.crc)
                if item.meta is not None and not isinstance(item.meta, SlotMeta):
                    raise UsageError("meta", f"must be a SlotMeta or None, got {item.meta!r:.80}")
        if len({item.slot for item in items}) != len(items):
            raise UsageError(field, "a batch names one slot twice")
        return items

    def _runs(self, items: list[SlotIO]) -> Iterator[tuple[list[int], bool]]:
        """Indices of `items` grouped into runs of consecutive slots, in slot order, each
        with whether it can go to the kernel as it is (else: one bounced call per slot)."""
        order = sorted(range(len(items)), key=lambda i: items[i].slot)
        run: list[int] = []
        for i in order:
            if not self._zero_copy(items[i].buffer):
                yield [i], False
                continue
            if run and (items[i].slot != items[run[-1]].slot + 1 or len(run) == _MAX_RUN):
                yield run, True
                run = []
            run.append(i)
        if run:
            yield run, True

    @staticmethod
    def _iov(header: memoryview, payload: memoryview, pad: memoryview | None
             ) -> list[memoryview]:
        """One slot's part of a run's vector: header block, payload, padding."""
        return [header, payload] if pad is None else [header, payload, pad]

    def _write_run(
        self, items: list[SlotIO], run: list[int], headers: _Headers, out: BatchOutcome
    ) -> None:
        iov: list[memoryview] = []
        pad = self._zero_pad_view
        for n, i in enumerate(run):
            item = items[i]
            payload = host_view(item.buffer)
            crc = payload_checksum(payload) if item.crc is None else item.crc
            header = headers.views[n]
            # One pwritev for the run: a crash can tear header from payload, and the payload
            # checksum (and MAC) in the header is what finds that on the read back.  The
            # fields are the store's own or were checked with the batch (_check_batch).
            SlotHeader.unchecked(
                slot=item.slot, key=item.key, payload_len=self._payload_len, payload_crc=crc,
                config=self._config_fp, meta=item.meta,
            ).pack_into(header, mac_key=self._mac_key, payload=payload)
            iov += self._iov(header, payload, pad)
        self._vector_io(os.pwritev, "write", items, run, iov, out)
        if self._sync_writes and any(out[i] is None for i in run):
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                for i in run:
                    if out[i] is None:
                        out[i] = TransferFailed(f"slot {items[i].slot}", f"sync failed: {exc}")

    def _read_run(
        self, items: list[SlotIO], run: list[int], headers: _Headers, out: BatchOutcome
    ) -> None:
        iov: list[memoryview] = []
        for n, i in enumerate(run):
            iov += self._iov(headers.views[n], host_view(items[i].buffer),
                             self._scratch_pad_view)
        self._vector_io(os.preadv, "read", items, run, iov, out)
        for n, i in enumerate(run):
            if out[i] is not None:
                continue
            item = items[i]
            what = f"slot {item.slot}"
            payload = host_view(item.buffer)
            try:
                header = SlotHeader.unpack(headers.views[n], what=what)
                verify_header(header, what=what, slot=item.slot, key=item.key,
                              payload_len=self._payload_len)
                if header.config != self._config_fp:
                    raise TransferFailed(what, "written under another configuration fingerprint")
                verify_checksum(header, payload_checksum(payload, version=header.version),
                                what=what)
                verify_mac(self._mac_key, headers.views[n], header, payload, what=what)
            except MacMismatch as exc:
                with self._cond:
                    self._mac_failures += 1
                out[i] = exc
            except TransferFailed as exc:
                out[i] = exc

    def _vector_io(
        self, call: _VectorCall, verb: str, items: list[SlotIO], run: list[int],
        iov: list[memoryview], out: BatchOutcome,
    ) -> None:
        """Move the run's iovecs with as few calls as the kernel allows; fail what did not
        move.  A partial transfer resumes at the first slot that did not move in full."""
        per_slot = len(iov) // len(run)
        done = 0
        while done < len(run):
            first = items[run[done]].slot
            try:
                moved = call(self._fd, iov[done * per_slot :], first * self._slot_bytes)
            except OSError as exc:
                for i in run[done:]:
                    out[i] = TransferFailed(f"slot {items[i].slot}", f"{verb} failed: {exc}")
                return
            full = moved // self._slot_bytes
            if full == 0:
                short = "short write" if verb == "write" else "short read"
                for i in run[done:]:
                    out[i] = TransferFailed(
                        f"slot {items[i].slot}", f"{short}: {moved} of {self._slot_bytes} bytes"
                    )
                return
            done += full

    def _each(
        self, items: list[SlotIO], run: list[int], out: BatchOutcome,
        op: _SlotCall,
    ) -> None:
        """Slots whose buffer the kernel cannot take as it is: one bounced call each."""
        with self._transfer() as buffer:
            for i in run:
                item = items[i]
                try:
                    op(item, buffer, f"slot {item.slot}")
                except TransferFailed as exc:
                    out[i] = exc

    def _count(self, out: BatchOutcome, *, write: bool) -> None:
        failed = sum(1 for o in out if o is not None)
        with self._cond:
            if write:
                self._writes += len(out) - failed
                self._write_failures += failed
            else:
                self._reads += len(out) - failed
                self._read_failures += failed

    @contextlib.contextmanager
    def _batch(self) -> Iterator[_Headers]:
        with self._cond:
            if self._closed:
                raise UsageError("store", f"slot store {self._path} is closed")
            self._in_flight += 1
            headers = self._free_headers.pop() if self._free_headers else None
        try:
            if headers is None:
                headers = _Headers(_MAX_RUN)
            yield headers
        finally:
            with self._cond:
                self._in_flight -= 1
                if headers is not None and not self._closed:
                    self._free_headers.append(headers)
                if not self._in_flight:
                    self._cond.notify_all()

    def read_header(self, slot: SlotId) -> SlotHeader:
        """The self-checked header of `slot` (magic, version, header checksum).

        The caller still checks it against what it expects (:func:`verify_header`).
        """
        self._check_slot(slot)
        what = f"slot {slot}"
        with self._transfer() as buffer:
            try:
                got = os.preadv(self._fd, [buffer.header], slot * self._slot_bytes)
            except OSError as exc:
                raise TransferFailed(what, f"header read failed: {exc}") from exc
            if got != HEADER_SIZE:
                raise TransferFailed(what, f"short header read: {got} of {HEADER_SIZE} bytes")
            return SlotHeader.unpack(buffer.header, what=what)

    def discard(self, slot: SlotId) -> None:
        """Forget the slot's content in the index journal; no I/O, and the bytes stay.

        The bytes left behind cannot be served wrongly: a later read must name the key they
        were written under, and a key is a content hash, so bytes found under the right key
        with a valid checksum are the right KV.  Invalidating them here would cost a write
        per eviction and, run from a worker thread, could land after the slot's next write
        and destroy it; punching a hole would turn the next write into an allocating one
        (half the overwrite rate measured above).  The index journal's FREE record is held
        in memory and appended by the next append (a writer thread) or the close.
        """
        self._check_slot(slot)
        # The index journal forgets the slot (its FREE record goes with the next append):
        # a reopened cache does not resurrect content the cache had let go, whose later
        # deadlines (lengthened while it was elsewhere) the slot's header would not have.
        self._index.discard(slot)

    def close(self) -> None:
        """Wait for transfers in flight, seal the index journal (a clean close), then
        release the lock and the descriptors."""
        self._close(seal=True)

    def abandon(self) -> None:
        """Close as a process that died would leave the directory: nothing more is written
        (no index journal seal, no discards appended).  For fault injection."""
        self._close(seal=False)

    def _close(self, *, seal: bool) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            while self._in_flight:
                self._cond.wait()
            self._free_buffers.clear()
            self._free_headers.clear()
        try:
            if seal:
                self._index.close()
            else:
                self._index.abandon()
        finally:
            self._journal.close()
            os.close(self._fd)
            os.close(self._dir_fd)  # releases the directory lock

    def observe_index(self, observer: Observer | None) -> None:
        """Call `observer` after each index journal append (fault injection tears them)."""
        self._index.observer = observer

    @property
    def index_path(self) -> Path:
        """The index journal."""
        return self._index.path

    def statistics(self) -> SlotStoreStatistics:
        journal: JournalStatistics = self._journal.statistics()
        index: IndexJournalStatistics = self._index.statistics()
        with self._cond:
            return SlotStoreStatistics(
                writes=self._writes,
                reads=self._reads,
                write_failures=self._write_failures,
                read_failures=self._read_failures,
                bytes_written=self._writes * self._payload_len,
                bytes_read=self._reads * self._payload_len,
                bounced=self._bounced,
                direct_io=self._direct,
                mac_failures=self._mac_failures,
                retention_records=journal.appended,
                retention_failures=journal.append_failures,
                journal_compactions=journal.compactions,
                index_records=index.appended,
                index_failures=index.failures,
            )

    # --- helpers ----------------------------------------------------------------------------

    def _check_slot(self, slot: object) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise UsageError("slot", f"must be an integer slot number, got {slot!r}")
        if not 0 <= slot < self._slots:
            raise UsageError("slot", f"slot {slot} out of range [0, {self._slots})")

    def _zero_copy(self, tensor: torch.Tensor) -> bool:
        if not self._direct:
            return True
        return tensor.data_ptr() % ALIGN == 0 and self._payload_len % ALIGN == 0

    @contextlib.contextmanager
    def _transfer(self) -> Iterator[_Buffer]:
        with self._cond:
            if self._closed:
                raise UsageError("store", f"slot store {self._path} is closed")
            self._in_flight += 1
            buffer = self._free_buffers.pop() if self._free_buffers else None
        try:
            if buffer is None:
                buffer = _Buffer(self._payload_len)
            yield buffer
        finally:
            with self._cond:
                self._in_flight -= 1
                if buffer is not None and not self._closed:
                    self._free_buffers.append(buffer)
                if not self._in_flight:
                    self._cond.notify_all()
