"""The retention journal: deadlines lengthened after a block's slot was written.

A slot header holds the retention deadline its block was spilled with.  A later request with
a longer TTL that matched the same content lengthens the deadline in memory
(``statekv.disk_tier.DiskTier.stamp_retention``, which emits ``PersistRetention``); rewriting
the 4 KiB header for that would be a read-modify-write racing the slot's own transfers.
Instead the new deadline is appended here, next to the data file, and replayed at open: the
restored block carries the latest deadline of its header and of the records naming its slot
*and its key* (specs/disk_persistence.md says why no ordering against the slot's writes is needed).

File ``retention.v1`` in the slot directory: a sequence of fixed-size records (integers
little-endian)::

    offset 0    magic     8s   b"STKVRETN"
           8    version   u32  JOURNAL_VERSION
          12    flags     u32  bit 0: mac is set
          16    slot      u64
          24    key       32s  the block's BlockHash
          56    expiry    f64  the new deadline, wall-clock seconds
          64    config    16s  config fingerprint of the writer (slot_format.config_fingerprint)
          80    mac       32s  keyed BLAKE2b-256 of bytes [0, 80), or zeros
         112    zeros
         124    crc       u32  CRC-32 of bytes [0, 124) (zlib's, as the index journal's,
                                 which says why the journals did not move to CRC-32C)

Why fixed-size records: one batch is appended with one ``write(2)`` (O_APPEND), so only the
last record can be torn by a crash, and every other record stays at a multiple of
RECORD_SIZE: a record whose checksum fails (torn, or rotted) is skipped and counted without
losing the ones after it.  A record from another config fingerprint, or without a valid MAC
while a MAC key is set, is ignored and counted; a record whose slot holds other content by
now (the slot was reused) is inert.  Nothing in the journal can fail an open except its
ownership and mode (the same rule as the data file).

Bounded size: the journal is rewritten at every open with only the records that still apply
(write a temporary file, fsync, rename, fsync the directory), and at run time whenever it
holds more than ``COMPACT_FACTOR`` records per slot: then it is rewritten with one record per
(slot, key) whose slot was not written with another key since.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import struct
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

import attrs

from io_actors.storage.record_file import RecordFile, check_record_file
from io_actors.storage.slot_format import CONFIG_FINGERPRINT_SIZE, KEY_SIZE, MAC_SIZE
from statekv.errors import ConfigError, TransferFailed, UsageError

_log = logging.getLogger(__name__)

JOURNAL_VERSION: Final = 1
JOURNAL_FILE: Final = f"retention.v{JOURNAL_VERSION}"
"""Name of the journal inside a store's directory."""
RECORD_SIZE: Final = 128
MAGIC: Final = b"STKVRETN"
FLAG_MAC: Final = 1
COMPACT_FACTOR: Final = 4
"""Run-time rewrite when the file holds more than this many records per slot (plus 64)."""

_FIELDS = struct.Struct("<8sIIQ32sd16s")
_MAC_AT: Final = _FIELDS.size
_CRC_AT: Final = RECORD_SIZE - 4
_CRC = struct.Struct("<I")
_U64: Final = 2**64 - 1


@attrs.frozen(kw_only=True)
class RetentionRecord:
    """One lengthened deadline: the block under `key` in `slot` is kept until `expiry`."""

    slot: int
    key: bytes
    expiry: float

    def __attrs_post_init__(self) -> None:
        if isinstance(self.slot, bool) or not isinstance(self.slot, int) or not (
            0 <= self.slot <= _U64
        ):
            raise UsageError("slot", f"must be a slot number, got {self.slot!r}")
        if not isinstance(self.key, bytes) or len(self.key) != KEY_SIZE:
            raise UsageError("key", f"must be {KEY_SIZE} bytes, got {self.key!r:.80}")
        if isinstance(self.expiry, bool) or not isinstance(self.expiry, int | float) or not (
            math.isfinite(self.expiry)
        ):
            raise UsageError("expiry", f"must be finite seconds, got {self.expiry!r}")


def record_mac(mac_key: bytes, fields: bytes | memoryview) -> bytes:
    """Keyed BLAKE2b-256 of a record's fields (its bytes before the mac)."""
    return hashlib.blake2b(fields, key=mac_key, digest_size=MAC_SIZE,
                           person=b"statekv-retain").digest()


def pack_record(record: RetentionRecord, config: bytes, mac_key: bytes | None) -> bytes:
    """One record's RECORD_SIZE bytes."""
    out = bytearray(RECORD_SIZE)
    _FIELDS.pack_into(out, 0, MAGIC, JOURNAL_VERSION, FLAG_MAC if mac_key else 0, record.slot,
                      record.key, float(record.expiry), config)
    if mac_key is not None:
        out[_MAC_AT : _MAC_AT + MAC_SIZE] = record_mac(mac_key, bytes(out[:_MAC_AT]))
    _CRC.pack_into(out, _CRC_AT, zlib.crc32(bytes(out[:_CRC_AT])))
    return bytes(out)


@attrs.frozen(kw_only=True)
class JournalReplay:
    """What replaying the journal at open found, record by record.

    Every record is counted once: applied, stale, or ignored for one reason.
    """

    records: int = 0
    """Whole records in the file."""
    applied: int = 0
    """Records naming a restored slot under its key (the later deadline won)."""
    stale: int = 0
    """Records whose slot holds other content by now, or nothing restorable: inert."""
    torn: int = 0
    """A record that fails its checksum (torn by a crash, rotted), and a partial record at
    the end (an append torn by a crash; counted once, whatever its length)."""
    unauthenticated: int = 0
    """Records without a valid MAC while a MAC key is set (written without the key, or
    forged): never applied."""
    foreign: int = 0
    """Records of another config fingerprint, another journal version, or a slot past the
    configured size: never applied."""

    @property
    def ignored(self) -> int:
        return self.torn + self.unauthenticated + self.foreign


@attrs.frozen(kw_only=True)
class JournalStatistics:
    """Run-time counters of a journal."""

    appended: int
    """Records appended (their write returned; synced too under disk_sync="data")."""
    append_failures: int
    """Records whose append failed (the deadline lives on in memory only)."""
    compactions: int
    """Run-time rewrites (not counting the one at open)."""


def replay(
    data: bytes, *, restored: Mapping[int, bytes], slots: int, config: bytes,
    mac_key: bytes | None,
) -> tuple[dict[int, float], JournalReplay]:
    """The latest deadline of each restored slot that the records raise, and the counts.

    `restored`: slot -> key of every slot the header scan restored.
    """
    latest: dict[int, float] = {}
    counts = {"applied": 0, "stale": 0, "torn": 0, "unauthenticated": 0, "foreign": 0}
    whole = len(data) // RECORD_SIZE
    view = memoryview(data)
    for n in range(whole):
        rec = view[n * RECORD_SIZE : (n + 1) * RECORD_SIZE]
        (crc,) = _CRC.unpack_from(rec, _CRC_AT)
        if bytes(rec[:8]) != MAGIC or zlib.crc32(rec[:_CRC_AT]) != crc:
            counts["torn"] += 1
            continue
        _magic, version, flags, slot, key, expiry, fingerprint = _FIELDS.unpack_from(rec, 0)
        if (version != JOURNAL_VERSION or flags & ~FLAG_MAC or fingerprint != config
                or slot >= slots or not math.isfinite(expiry)):
            counts["foreign"] += 1
            continue
        if mac_key is not None:
            stored = bytes(rec[_MAC_AT : _MAC_AT + MAC_SIZE])
            if not flags & FLAG_MAC or not hmac.compare_digest(
                stored, record_mac(mac_key, bytes(rec[:_MAC_AT]))
            ):
                counts["unauthenticated"] += 1
                continue
        if restored.get(slot) != key:
            counts["stale"] += 1
            continue
        counts["applied"] += 1
        latest[slot] = max(latest.get(slot, -math.inf), expiry)
    if len(data) % RECORD_SIZE:
        counts["torn"] += 1
    return latest, JournalReplay(records=whole, **counts)


def check_journal_file(path: Path, info: os.stat_result) -> None:
    """raises: ConfigError("directory") unless `path` is a regular file of the effective user
    that no one else may write (another user could forge deadlines: keep content forever)."""
    check_record_file(path, info)


class RetentionJournal:
    """The journal of one slot store: opened (replayed, compacted) by the store's open.

    Thread safety: appends from any number of threads are serialized by a lock (one
    ``write(2)`` per batch, under it).
    """

    def __init__(
        self, directory: Path, dir_fd: int, *, slots: int, config: bytes,
        mac_key: bytes | None, sync: bool,
    ) -> None:
        if len(config) != CONFIG_FINGERPRINT_SIZE:
            raise UsageError("config", f"must be {CONFIG_FINGERPRINT_SIZE} bytes")
        self._dir_fd = dir_fd
        self._file = RecordFile(directory, dir_fd, JOURNAL_FILE, RECORD_SIZE)
        self._slots = slots
        self._config = config
        self._mac_key = mac_key
        self._sync = sync
        self._lock = threading.Lock()
        self._live: dict[int, dict[bytes, float]] = {}
        """slot -> key -> latest deadline: what a rewrite keeps."""
        self._appended = 0
        self._append_failures = 0
        self._compactions = 0
        self._open = False

    @property
    def path(self) -> Path:
        return self._file.path

    # --- open -----------------------------------------------------------------------------

    def vet(self) -> bytes | None:
        """The journal's bytes (None when there is none); refuses a file of another user or
        writable by others.  Reads nothing else and changes nothing."""
        return self._file.vet()

    def start(self, keep: Iterable[RetentionRecord]) -> None:
        """Rewrite the journal with `keep` only (atomically); without records to keep, remove
        it (it is created by the first append).

        raises: ConfigError("directory") when the rewrite fails (nothing else changed).
        """
        records = list(keep)
        for record in records:
            self._live.setdefault(record.slot, {})[record.key] = record.expiry
        try:
            self._file.remove_leftover()
            if records:
                self._rewrite(records)
            else:
                self._file.remove()
        except OSError as exc:
            raise ConfigError("directory", f"cannot rewrite {self.path}: {exc}") from None
        self._open = True

    def _rewrite(self, records: Sequence[RetentionRecord]) -> None:
        self._file.replace(
            b"".join(pack_record(r, self._config, self._mac_key) for r in records)
        )

    # --- run time -------------------------------------------------------------------------

    def append(self, records: Sequence[RetentionRecord]) -> None:
        """Append `records` with one write (and fdatasync under disk_sync="data").

        raises: TransferFailed when the append failed; the file is left whole (a partial
        append is cut off again), so later appends and the replay are unaffected.
        """
        if not records:
            return
        data = b"".join(pack_record(r, self._config, self._mac_key) for r in records)
        with self._lock:
            if not self._open:
                raise UsageError("journal", f"{self.path} is closed")
            file = self._file
            if file.fd < 0:
                try:
                    file.create(sync=self._sync)
                except OSError as exc:
                    self._append_failures += len(records)
                    raise TransferFailed("retention journal", f"cannot create: {exc}") from exc
            if file.broken:
                self._compact_locked()
                if file.broken:
                    self._append_failures += len(records)
                    raise TransferFailed("retention journal", "a torn append could not be "
                                         "cut off, nor the journal rewritten")
            try:
                file.append(data, sync=self._sync)
            except OSError as exc:
                self._append_failures += len(records)
                raise TransferFailed("retention journal", f"append failed: {exc}") from exc
            self._appended += len(records)
            for record in records:
                keys = self._live.setdefault(record.slot, {})
                keys[record.key] = max(keys.get(record.key, -math.inf), record.expiry)
            if file.size // RECORD_SIZE > COMPACT_FACTOR * self._slots + 64:
                self._compact_locked()

    def slot_written(self, slot: int, key: bytes) -> None:
        """A write of `key` to `slot` returned: records of other keys there are inert now."""
        with self._lock:
            keys = self._live.get(slot)
            if keys and (len(keys) > 1 or key not in keys):
                self._live[slot] = {key: keys[key]} if key in keys else {}

    def _compact_locked(self) -> None:
        keep = [RetentionRecord(slot=slot, key=key, expiry=expiry)
                for slot, keys in sorted(self._live.items()) for key, expiry in keys.items()]
        try:
            self._rewrite(keep)
        except OSError as exc:
            # Still correct, only longer: the next append tries again.
            _log.warning("%s: cannot compact (%s)", self.path, exc)
            return
        self._compactions += 1

    def statistics(self) -> JournalStatistics:
        """The counters as they are now, each read once: never waits for an append, which
        holds the lock across its write (and fdatasync): the cache's statistics() runs on
        the serving thread."""
        return JournalStatistics(appended=self._appended,
                                 append_failures=self._append_failures,
                                 compactions=self._compactions)

    def close(self) -> None:
        """Nothing is written at close: what was appended is already where it belongs."""
        with self._lock:
            self._open = False
            self._file.close()
