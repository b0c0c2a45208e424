"""Disk slots read straight into GPU memory with kvikio (GPUDirect Storage when present).

Same data file, layout and slot format as :class:`~io_actors.storage.posix.PosixSlotStore`,
which this store wraps: writes (whose source is a host page, by the protocol) and reads into
host memory go through it unchanged; only reads into a CUDA tensor take the kvikio path.
kvikio runs GDS when the driver and filesystem support it and its POSIX "compatibility mode"
(host bounce buffers, then a copy to the device) otherwise; the mode in use is logged and
reported in :meth:`KvikioSlotStore.gds`.

Verifying a device read.  The header is small and read on the host first (one 4 KiB
O_DIRECT read), then checked against the expected slot, key and length before any payload
byte moves.  The payload goes straight into the GPU page, and its checksum is computed *on
the GPU* by :func:`~io_actors.storage.slot_format.payload_checksum_torch`, which is
bit-for-bit the host's (CRC-32C, or zlib's CRC-32 for a version 2 slot: what the writer
stored, as the header's version says), built from gathers and XORs on int32 tensors on a
stream of this store's own.  The alternative, staging the payload through a host buffer to
check it there, would put the bytes through host memory twice and defeat GDS; reading the
payload back from the GPU to check it would add a copy per block.  The page holds unverified
bytes while the check runs, which is harmless: a read that raises is never published, and the
caller does not let any kernel read the page before ``read`` returns.

Batches: ``read_many`` submits every slot of a batch to kvikio's C++ thread pool at once
(header into a host buffer, payload into its GPU page: two futures per slot, no Python
between the bytes), waits for all of them, checks the headers on the host, and verifies
every payload with one checksum kernel launch for the whole batch
(:func:`io_actors.storage.gpu_checksum.payload_checksums_cuda`; one per slot format version
in the batch, so a batch holding version 2 slots too takes two).  ``write_many`` goes to the wrapped
POSIX store's vector writes.

Ordering obligations of the caller (the reader actor): before a device read, wait on a
copy-engine fence taken after the ``ReadSlot`` command arrived, so that the page's previous
copies and forward passes have finished; kvikio writes the page from outside the torch
streams.  When ``read`` returns the bytes are complete and verified on the device.

kvikio is imported lazily: this module imports on machines without CUDA (kvikio needs
``libcuda.so.1`` even to import), and the store refuses to open there.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from io_actors.storage.buffers import check_block_tensor
from io_actors.storage.gpu_checksum import payload_checksums_cuda, warm_up
from io_actors.storage.index_journal import Observer
from io_actors.storage.interfaces import BatchOutcome, SlotIO
from io_actors.storage.posix import PosixSlotStore, SlotStoreStatistics
from io_actors.storage.posix_open import Recovery
from io_actors.storage.retention_journal import RetentionRecord
from io_actors.storage.slot_format import (
    HEADER_SIZE,
    SlotExtent,
    SlotHeader,
    SlotMeta,
    check_key,
    payload_checksum_torch,
    verify_checksum,
    verify_header,
)
from statekv.config import CacheConfig
from statekv.errors import ConfigError, TransferFailed, UsageError
from statekv.ids import BlockHash, SlotId

_log = logging.getLogger(__name__)


def _import_kvikio() -> Any:
    if not torch.cuda.is_available():
        raise ConfigError("kind", "the kvikio backend needs CUDA, and CUDA is not available")
    try:
        import kvikio
        import kvikio.defaults
    except (ImportError, OSError) as exc:
        raise ConfigError(
            "kind", f"the kvikio backend needs kvikio ({exc}); install statekv[cu12] or "
            "statekv[cu13]"
        ) from None
    return kvikio


def _compat_mode(kvikio: Any) -> bool:
    defaults = kvikio.defaults
    if hasattr(defaults, "is_compat_mode_preferred"):
        return bool(defaults.is_compat_mode_preferred())
    mode = defaults.compat_mode()
    return bool(mode) if isinstance(mode, bool) else str(mode).endswith("ON")


class KvikioSlotStore:
    """:class:`~io_actors.storage.interfaces.SlotStore` whose reads can fill GPU memory directly.

    ``device`` is the CUDA device whose pages reads fill (default: the current device).
    The other arguments are those of :class:`PosixSlotStore`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: CacheConfig,
        *,
        device: torch.device | None = None,
        direct_io: bool = True,
        preallocate: bool = True,
        sync_writes: bool = False,
        persist: bool = True,
        mac_key: bytes | None = None,
        owned_from: str | os.PathLike[str] | None = None,
    ) -> None:
        kvikio = _import_kvikio()
        if mac_key is not None:
            # A keyed MAC is computed on the host; a device read would have to bring every
            # payload back to the host to check it, which is what this store exists to avoid.
            raise ConfigError(
                "mac_key", "the kvikio backend reads into GPU memory and cannot check a keyed "
                "MAC there; use the posix backend with a MAC key"
            )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not isinstance(device, torch.device) or device.type != "cuda":
            raise ConfigError("device", f"must be a CUDA torch.device, got {device!r}")
        self._device = device
        self._host = PosixSlotStore(
            directory, config, direct_io=direct_io, preallocate=preallocate,
            sync_writes=sync_writes, persist=persist, owned_from=owned_from,
        )
        try:
            self._file = kvikio.CuFile(str(self._host.path), "r")
        except Exception as exc:
            self._host.close()
            raise ConfigError("directory", f"kvikio cannot open {self._host.path}: {exc}") from None
        self._gds = not _compat_mode(kvikio)
        _log.info(
            "kvikio slot store %s: %s", self._host.path,
            "GPUDirect Storage" if self._gds else "compatibility mode (POSIX, host bounce)",
        )
        with torch.cuda.device(device):
            self._verify_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # The batch checksum's first call compiles its kernel: not inside the first reads.
        warm_up(self._host.payload_len, device)
        self._cond = threading.Condition()
        self._closed = False
        self._in_flight = 0
        self._device_reads = 0
        self._device_read_failures = 0

    @property
    def device_reads(self) -> bool:
        return True

    @property
    def gds(self) -> bool:
        """Whether kvikio moves bytes with GPUDirect Storage (False: compatibility mode)."""
        return self._gds

    def slot_extent(self, slot: SlotId) -> SlotExtent:
        return self._host.slot_extent(slot)

    @property
    def recovery(self) -> Recovery:
        return self._host.recovery

    @property
    def journal_path(self) -> Path:
        return self._host.journal_path

    def persist_retention(self, records: Sequence[RetentionRecord]) -> None:
        """The wrapped store's retention journal (the same directory)."""
        self._host.persist_retention(records)

    def write(
        self, slot: SlotId, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None
    ) -> None:
        self._host.write(slot, key, src, meta)

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        if isinstance(dst, torch.Tensor) and dst.device.type == "cpu":
            self._host.read(slot, key, dst)
            return
        payload_len = self._host.payload_len
        check_key(key)
        check_block_tensor("dst", dst, payload_len, device_type="cuda")
        with self._cond:
            if self._closed:
                raise UsageError("store", f"slot store {self._host.path} is closed")
            self._in_flight += 1
        try:
            self._read_to_device(slot, key, dst, payload_len)
        except TransferFailed:
            with self._cond:
                self._device_read_failures += 1
            raise
        else:
            with self._cond:
                self._device_reads += 1
        finally:
            with self._cond:
                self._in_flight -= 1
                if not self._in_flight:
                    self._cond.notify_all()

    def _read_to_device(
        self, slot: SlotId, key: BlockHash, dst: torch.Tensor, payload_len: int
    ) -> None:
        what = f"slot {slot}"
        header = self._host.read_header(slot)
        verify_header(header, what=what, slot=slot, key=key, payload_len=payload_len)
        if header.config != self._host.config_fingerprint:
            raise TransferFailed(what, "written under another configuration fingerprint")
        offset = self._host.slot_extent(slot).offset + HEADER_SIZE
        try:
            got = self._file.pread(dst, payload_len, offset).get()
        except Exception as exc:
            raise TransferFailed(what, f"kvikio read failed: {exc}") from exc
        if got != payload_len:
            raise TransferFailed(what, f"short read: {got} of {payload_len} payload bytes")
        try:
            with torch.cuda.device(dst.device), torch.cuda.stream(self._verify_stream):
                actual = payload_checksum_torch(dst, version=header.version)
        except RuntimeError as exc:
            raise TransferFailed(what, f"device checksum failed: {exc}") from exc
        verify_checksum(header, actual, what=what)

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        return self._host.write_many(writes)

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        items = list(reads)
        if all(isinstance(i, SlotIO) and i.buffer.device.type == "cpu" for i in items):
            return self._host.read_many(items)
        payload_len = self._host.payload_len
        for item in items:
            if not isinstance(item, SlotIO):
                raise UsageError("reads", f"must hold SlotIO items, got {item!r:.80}")
            self._host.slot_extent(item.slot)  # raises UsageError for a bad slot
            check_key(item.key)
            check_block_tensor("dst", item.buffer, payload_len, device_type="cuda")
        if len({item.slot for item in items}) != len(items):
            raise UsageError("reads", "a batch names one slot twice")
        with self._cond:
            if self._closed:
                raise UsageError("store", f"slot store {self._host.path} is closed")
            self._in_flight += 1
        try:
            out = self._read_batch_to_device(items, payload_len)
        finally:
            with self._cond:
                self._in_flight -= 1
                if not self._in_flight:
                    self._cond.notify_all()
        failed = sum(1 for o in out if o is not None)
        with self._cond:
            self._device_reads += len(out) - failed
            self._device_read_failures += failed
        return out

    def _read_batch_to_device(self, items: list[SlotIO], payload_len: int) -> BatchOutcome:
        out: BatchOutcome = [None] * len(items)
        pending: list[tuple[int, Any]] = []
        for n, item in enumerate(items):
            offset = self._host.slot_extent(item.slot).offset + HEADER_SIZE
            try:
                pending.append((n, self._file.pread(item.buffer, payload_len, offset)))
            except Exception as exc:
                out[n] = TransferFailed(f"slot {item.slot}", f"kvikio read failed: {exc}")
        # Wait for the payloads first, then read the headers through the POSIX store's
        # O_DIRECT descriptor (4 KiB each, about 1 ms for a batch of 16 on the H200 machine):
        # never through kvikio's buffered host path, which would pull payload bytes into the
        # page cache in front of the direct payload reads of the same ranges.
        moved: list[int] = []
        for n, future in pending:
            what = f"slot {items[n].slot}"
            try:
                got = future.get()
            except Exception as exc:
                out[n] = TransferFailed(what, f"kvikio read failed: {exc}")
                continue
            if got != payload_len:
                out[n] = TransferFailed(what, f"short read: {got} of {payload_len} payload bytes")
                continue
            moved.append(n)
        landed: list[tuple[int, SlotHeader]] = []
        for n in moved:
            item = items[n]
            what = f"slot {item.slot}"
            try:
                header = self._host.read_header(item.slot)
                verify_header(header, what=what, slot=item.slot, key=item.key,
                              payload_len=payload_len)
                if header.config != self._host.config_fingerprint:
                    raise TransferFailed(what, "written under another configuration fingerprint")
            except TransferFailed as exc:
                out[n] = exc
            else:
                landed.append((n, header))
        # Each slot is verified with the checksum of its header's version: one launch per
        # version present (slots written before version 3 hold zlib CRC-32s).
        for version in sorted({header.version for _n, header in landed}):
            group = [(n, header) for n, header in landed if header.version == version]
            try:
                with torch.cuda.device(self._device), torch.cuda.stream(self._verify_stream):
                    crcs = payload_checksums_cuda([items[n].buffer for n, _h in group],
                                                  version=version)
            except RuntimeError as exc:
                for n, _header in group:
                    out[n] = TransferFailed(f"slot {items[n].slot}",
                                            f"device checksum failed: {exc}")
                continue
            for (n, header), crc in zip(group, crcs, strict=True):
                try:
                    verify_checksum(header, crc, what=f"slot {items[n].slot}")
                except TransferFailed as exc:
                    out[n] = exc
        return out

    def discard(self, slot: SlotId) -> None:
        """The wrapped store's (:meth:`PosixSlotStore.discard`: no I/O)."""
        self._host.discard(slot)

    def close(self) -> None:
        """Wait for device reads in flight, then close the kvikio handle and the file."""
        if self._stop_reads():
            self._host.close()

    def abandon(self) -> None:
        """As :meth:`close`, writing nothing more (:meth:`PosixSlotStore.abandon`)."""
        if self._stop_reads():
            self._host.abandon()

    def _stop_reads(self) -> bool:
        """Refuse new device reads, wait for those in flight, close the kvikio handle; False
        if the store was already closed (nothing to do)."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            while self._in_flight:
                self._cond.wait()
        self._file.close()
        return True

    def observe_index(self, observer: Observer | None) -> None:
        self._host.observe_index(observer)

    def statistics(self) -> SlotStoreStatistics:
        """The wrapped store's counters, device reads included."""
        host = self._host.statistics()
        with self._cond:
            reads = host.reads + self._device_reads
            failures = host.read_failures + self._device_read_failures
        return SlotStoreStatistics(
            writes=host.writes,
            reads=reads,
            write_failures=host.write_failures,
            read_failures=failures,
            bytes_written=host.bytes_written,
            bytes_read=reads * self._host.payload_len,
            bounced=host.bounced,
            direct_io=host.direct_io,
            mac_failures=host.mac_failures,
            retention_records=host.retention_records,
            retention_failures=host.retention_failures,
            journal_compactions=host.journal_compactions,
            index_records=host.index_records,
            index_failures=host.index_failures,
        )
