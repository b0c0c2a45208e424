"""The index journal: what every slot holds, so that an open needs no header scan.

An index rebuild from the slot headers reads one 4 KiB block per slot, far apart: 100k random
reads, seconds on any disk (BENCHMARKS.md "Index rebuild at open").  This journal holds the
same facts as one sequential file: a record per landed spill (the slot, its key and the
restore metadata of its header: SlotMeta), a record per slot whose content left the index,
and a seal at a clean close.  specs/disk_persistence.md has the write order and the crash
argument; the short form:

* A SLOT record is appended only after the slot's write returned (and after its
  ``fdatasync`` under disk_sync="data"; the record is then synced too, before the write
  counts as landed), so a record never names bytes that were not written.
* A FREE record is appended *before* a write to a slot that the journal maps to content (a
  displacement reusing the slot), and for every slot whose content left the cache
  (``discard``: held in memory -- no I/O on the serving thread -- and appended ahead of the
  next append, or at close).  So after a kill -9 no record names a slot whose bytes were
  overwritten since.
* A later record for a slot wins; a key in two slots keeps the later record.
* Reads verify every header and payload anyway (key, CRC, MAC): a stale record can only
  cause a failed read (the request recomputes), never wrong bytes.

File ``index.v1`` in the slot directory: a HEAD record, then SLOT / FREE records, and a SEAL
at each clean close (an open that keeps the file as it is appends after the seal).
Fixed-size records (integers little-endian)::

    offset 0    magic        8s   b"STKVINDX"
           8    version      u32  INDEX_VERSION
          12    kind         u32  1 HEAD, 2 SLOT, 3 FREE, 4 SEAL
          16    flags        u32  bit 0: mac is set; bit 1: expiry is set
          20    depth        u32  SLOT: position in the chain
          24    slot         u64  SLOT, FREE: the slot; HEAD: slots configured; SEAL: the
                                  number of records before it
          32    key          32s  SLOT: the block's key; HEAD: the data file's identity
                                  (inode, size, slot bytes, payload bytes: 4 x u64)
          64    parent       32s  SLOT: the key of the previous block of the chain
          96    expiry       f64  SLOT: retention deadline, wall-clock seconds (flags bit 1)
         104    written_at   f64  SLOT: wall-clock seconds when the spill was issued
         112    sequence     u64  SLOT: the writer's transfer number
         120    reuse_count  u32  SLOT
         124    zeros        4
         128    config       16s  config fingerprint of the writer (slot_format)
         144    mac          32s  keyed BLAKE2b-256 of bytes [0, 144), or zeros
         176    zeros        12
         188    crc          u32  CRC-32 of bytes [0, 188) (zlib's: see below)

The journal is used at open only when it is *complete*: a valid HEAD naming this config
fingerprint and this very data file (inode, size, slot geometry), every whole record valid
and of this config (with a MAC key: every record signed), every SEAL counting the records
before it.
Only the last append can be torn by a crash: records failing their checksum at the end of
the file are ignored and counted.  Anything else -- missing, torn in the middle, another
fingerprint, another data file, unsigned under a MAC key -- falls back to the header scan,
with the reason logged, and the open rewrites the journal from what it restored.

Why a file apart from the retention journal: the two are trusted differently.  This one is
all or nothing (a hole in the middle means the map may be incomplete: the scan is used
instead), while each retention record stands alone and is replayed against whichever index
the open built, the scan's included; and retention records are appended unordered against
the slot's writes, while SLOT records must follow them.  One file would make a retention
record torn in the middle discard the whole index.

Why zlib's CRC-32 here while slots moved to CRC-32C (slot format version 3): a record is 188
bytes, where the call's overhead is most of the cost (on the CPU machine 0.24 us a record
with zlib, 0.16 us with crc32c: 8 ms per 100k records at a rebuild), and changing it would
need an index.v2, which the journal of no existing directory is: the first open after the
upgrade would rescan every slot header instead of reading the journal.
"""

from __future__ import annotations

import array
import errno
import hashlib
import hmac
import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import attrs
import numpy as np

from io_actors.storage.record_file import RecordFile
from io_actors.storage.slot_format import CONFIG_FINGERPRINT_SIZE, KEY_SIZE, MAC_SIZE, SlotMeta
from statekv.errors import ConfigError, UsageError

_log = logging.getLogger(__name__)

INDEX_VERSION: Final = 1
INDEX_FILE: Final = f"index.v{INDEX_VERSION}"
"""Name of the journal inside a store's directory."""
RECORD_SIZE: Final = 192
MAGIC: Final = b"STKVINDX"
HEAD: Final = 1
SLOT: Final = 2
FREE: Final = 3
SEAL: Final = 4
FLAG_MAC: Final = 1
FLAG_EXPIRY: Final = 2
COMPACT_FACTOR: Final = 4
"""Run-time rewrite when the file holds more than this many records per slot (plus 64)."""

_FIELDS = struct.Struct("<8sIIIIQ32s32sddQII16s")
_MAC_AT: Final = _FIELDS.size
_CRC_AT: Final = RECORD_SIZE - 4
_CRC = struct.Struct("<I")
_IDENTITY = struct.Struct("<QQQQ")
_ZERO_KEY: Final = bytes(KEY_SIZE)

Observer = Callable[[str, Path, int, int], None]
"""Called after each append reached the file: (what: "free", "landed" or "seal", the
journal's path, its size before, its size after).  Fault injection tears appends with it."""


def record_mac(mac_key: bytes, fields: bytes | memoryview) -> bytes:
    """Keyed BLAKE2b-256 of a record's fields (its bytes before the mac)."""
    return hashlib.blake2b(fields, key=mac_key, digest_size=MAC_SIZE,
                           person=b"statekv-index").digest()


def _pack(kind: int, slot: int, key: bytes, config: bytes, mac_key: bytes | None,
          meta: SlotMeta | None = None) -> bytes:
    out = bytearray(RECORD_SIZE)
    flags = FLAG_MAC if mac_key else 0
    if meta is None:
        _FIELDS.pack_into(out, 0, MAGIC, INDEX_VERSION, kind, flags, 0, slot, key, _ZERO_KEY,
                          0.0, 0.0, 0, 0, 0, config)
    else:
        if meta.expiry is not None:
            flags |= FLAG_EXPIRY
        _FIELDS.pack_into(out, 0, MAGIC, INDEX_VERSION, kind, flags, meta.depth, slot, key,
                          meta.parent, meta.expiry if meta.expiry is not None else 0.0,
                          meta.written_at, meta.sequence, meta.reuse_count, 0, config)
    view = memoryview(out)
    if mac_key is not None:
        out[_MAC_AT : _MAC_AT + MAC_SIZE] = record_mac(mac_key, view[:_MAC_AT])
    _CRC.pack_into(out, _CRC_AT, zlib.crc32(view[:_CRC_AT]))
    return bytes(out)


def identity(*, inode: int, size: int, slot_bytes: int, payload_len: int) -> bytes:
    """The HEAD's name for one data file: a journal of another file is never used."""
    return _IDENTITY.pack(inode, size, slot_bytes, payload_len)


@attrs.frozen(kw_only=True)
class IndexReplay:
    """How an open rebuilt its index, and what the journal held."""

    source: str = "none"
    """"journal" (no header scan), "scan" (the journal was not usable: `reason`), or "none"
    (nothing to rebuild: no data file, or persistence off)."""
    reason: str = ""
    """Why the journal was not used (empty when it was)."""
    records: int = 0
    """Whole records in the journal."""
    sealed: bool = False
    """The journal ended with a seal: the last process closed cleanly."""
    torn: int = 0
    """Records at the end failing their checksum, and a partial record (a torn append)."""
    freed: int = 0
    """FREE records (content that left the index)."""
    duplicates: int = 0
    """A key named by two slots' records (the later record is kept)."""
    beyond_capacity: int = 0
    """Slots past the configured size (the data file shrank)."""


@attrs.frozen(kw_only=True)
class IndexJournalStatistics:
    """Run-time counters of the index journal."""

    appended: int
    """Records appended (SLOT, FREE and SEAL)."""
    failures: int
    """Appends that failed: the journal was then given up for this run (removed, so the
    next open scans)."""
    compactions: int
    """Run-time rewrites (not counting the one at open)."""
    active: bool
    """Whether the journal is kept up to date (False after a failure)."""


Entry = tuple[int, bytes, SlotMeta]
"""(slot, key, restore metadata) of one indexed slot."""

_DTYPE = np.dtype([
    ("magic", "S8"), ("version", "<u4"), ("kind", "<u4"), ("flags", "<u4"), ("depth", "<u4"),
    ("slot", "<u8"), ("key", "V32"), ("parent", "V32"), ("expiry", "<f8"),
    ("written_at", "<f8"), ("sequence", "<u8"), ("reuse_count", "<u4"), ("pad", "<u4"),
    ("config", "V16"), ("mac", "V32"), ("zeros", "V12"), ("crc", "<u4"),
])
"""A whole record, as numpy reads the file."""
assert _DTYPE.itemsize == RECORD_SIZE
_CONFIG_AT: Final = 128
assert _DTYPE.fields is not None and _DTYPE.fields["config"][1] == _CONFIG_AT


@attrs.frozen(kw_only=True)
class IndexFound:
    """A usable journal: its entries, and where each indexed slot's record is (so that the
    open may keep appending to it instead of rewriting it)."""

    entries: list[Entry]
    """By slot."""
    offsets: array.array[int]
    """slot -> byte offset of the record naming its content, -1 for none."""
    length: int
    """Bytes of the valid records (the torn tail after them is cut off on reuse)."""
    head: bytes
    """The head record as it is in the file."""


def read_index(
    data: bytes | None, *, slots: int, config: bytes, mac_key: bytes | None, file_id: bytes,
) -> tuple[IndexFound | None, IndexReplay]:
    """The index a journal holds, or None and the reason it cannot be used.

    `slots`: the configured size (records past it are counted, not restored); `file_id`:
    :func:`identity` of the data file as it is now.
    """
    if data is None:
        return None, IndexReplay(source="scan", reason="no index journal")
    whole = len(data) // RECORD_SIZE
    partial = len(data) % RECORD_SIZE
    view = memoryview(data)

    def scan(reason: str) -> tuple[None, IndexReplay]:
        return None, IndexReplay(source="scan", reason=reason, records=whole)

    def intact(n: int) -> bool:
        at = n * RECORD_SIZE
        (crc,) = _CRC.unpack_from(view, at + _CRC_AT)
        return bytes(view[at : at + 8]) == MAGIC and zlib.crc32(view[at : at + _CRC_AT]) == crc

    if whole == 0:
        return scan("the index journal holds no whole record")
    # The end: records failing their checksum after the last intact one are a torn append
    # (only the last append can be torn; a checksum failure before an intact record is a
    # hole in the middle, found below).
    last = whole
    while last > 1 and not intact(last - 1):
        last -= 1
    torn = whole - last + (1 if partial else 0)
    # Vectorized over the records (numpy): 100k records parse in tens of milliseconds, where
    # a Python loop over them took half a second.  Only the CRC (and a MAC) is one call per
    # record.
    rec = np.frombuffer(data, dtype=_DTYPE, count=last)
    raw = np.frombuffer(data, dtype=np.uint8, count=last * RECORD_SIZE).reshape(last, -1)
    crc32 = zlib.crc32
    crcs = np.fromiter((crc32(view[at : at + _CRC_AT])
                        for at in range(0, last * RECORD_SIZE, RECORD_SIZE)),
                       dtype=np.uint32, count=last)
    bad = np.flatnonzero((crcs != rec["crc"]) | (rec["magic"] != MAGIC))
    if bad.size:
        return scan(f"record {bad[0]} is torn, in the middle of the file")
    bad = np.flatnonzero((rec["version"] != INDEX_VERSION)
                         | (rec["flags"] & ~np.uint32(FLAG_MAC | FLAG_EXPIRY) != 0))
    if bad.size:
        return scan(f"record {bad[0]} is of another index journal version")
    bad = np.flatnonzero(
        (raw[:, _CONFIG_AT : _CONFIG_AT + CONFIG_FINGERPRINT_SIZE]
         != np.frombuffer(config, dtype=np.uint8)).any(axis=1))
    if bad.size:
        return scan(f"record {bad[0]} is of another config fingerprint")
    if mac_key is not None:
        for n in range(last):
            at = n * RECORD_SIZE
            if not rec["flags"][n] & FLAG_MAC or not hmac.compare_digest(
                bytes(view[at + _MAC_AT : at + _MAC_AT + MAC_SIZE]),
                record_mac(mac_key, view[at : at + _MAC_AT]),
            ):
                return scan(f"record {n} is unauthenticated (no valid MAC under this key)")
    kinds = rec["kind"]
    if kinds[0] != HEAD:
        return scan("it does not start with a head record")
    if bytes(view[32:64]) != file_id:
        return scan("it was written for another data file (or another size)")
    bad = np.flatnonzero((kinds[1:] != SLOT) & (kinds[1:] != FREE) & (kinds[1:] != SEAL))
    if bad.size:
        return scan(f"record {bad[0] + 1} is of kind {kinds[bad[0] + 1]}")
    numbers = np.arange(last, dtype=np.uint64)
    seals = np.flatnonzero(kinds == SEAL)
    if seals.size and (rec["slot"][seals] != numbers[seals]).any():
        return scan("a seal does not count the records before it")
    slot_of = rec["slot"]
    is_slot = kinds == SLOT
    beyond = int((is_slot & (slot_of >= slots)).sum())
    freed = int((kinds == FREE).sum())
    moves = np.flatnonzero(((kinds == SLOT) | (kinds == FREE)) & (slot_of < slots))
    # A later record for a slot wins.
    latest = np.full(slots, -1, dtype=np.int64)
    np.maximum.at(latest, slot_of[moves].astype(np.int64), moves)
    live = latest[latest >= 0]
    live = np.sort(live[is_slot[live]])
    times = rec["expiry"][live], rec["written_at"][live]
    if not (np.isfinite(times[0]).all() and np.isfinite(times[1]).all()):
        return scan("a record holds a non-finite time")
    keys = raw[live, 32:64].tobytes()
    # A key in two slots: the later record is kept (its slot's content is the newer write).
    by_key: dict[bytes, int] = {}
    for i in range(live.size):
        by_key[keys[32 * i : 32 * i + 32]] = i
    duplicates = int(live.size) - len(by_key)
    kept = np.fromiter(sorted(by_key.values()), dtype=np.int64, count=len(by_key))
    idx = live[kept]
    parents = raw[idx, 64:96].tobytes()
    columns = zip(
        rec["slot"][idx].tolist(), kept.tolist(), rec["flags"][idx].tolist(),
        rec["depth"][idx].tolist(), rec["reuse_count"][idx].tolist(),
        rec["expiry"][idx].tolist(), rec["written_at"][idx].tolist(),
        rec["sequence"][idx].tolist(), range(len(by_key)), strict=True,
    )
    unpacked = SlotMeta.unpacked
    entries: list[Entry] = [
        (slot, keys[32 * k : 32 * k + 32], unpacked(
            parent=parents[32 * j : 32 * j + 32], depth=depth, reuse_count=reuse,
            expiry=expiry if flags & FLAG_EXPIRY else None, written_at=written_at,
            sequence=sequence))
        for slot, k, flags, depth, reuse, expiry, written_at, sequence, j in columns
    ]
    offsets = np.full(slots, -1, dtype=np.int64)
    offsets[rec["slot"][idx].astype(np.int64)] = idx * RECORD_SIZE
    entries.sort(key=lambda e: e[0])
    return (IndexFound(entries=entries, offsets=array.array("q", offsets.tobytes()),
                       length=last * RECORD_SIZE, head=bytes(view[:RECORD_SIZE])),
            IndexReplay(source="journal", records=whole, sealed=bool(kinds[-1] == SEAL),
                        torn=torn, freed=freed, duplicates=duplicates,
                        beyond_capacity=beyond))


class IndexJournal:
    """The index journal of one slot store: rewritten by the store's open, kept up to date
    by its writes, sealed by its close.

    Thread safety: the writers' methods take one lock, and each append is one ``write(2)``
    under it (``fdatasync``ed there under disk_sync="data"; a compaction rewrites the file
    under it).  The serving thread's ``discard`` and ``statistics`` never take that lock: a
    discard runs under the scheduler's lock, and waiting there for a writer's append would
    stall every caller of the cache on the disk.
    """

    def __init__(
        self, directory: Path, dir_fd: int, *, slots: int, config: bytes,
        mac_key: bytes | None, sync: bool,
    ) -> None:
        if len(config) != CONFIG_FINGERPRINT_SIZE:
            raise UsageError("config", f"must be {CONFIG_FINGERPRINT_SIZE} bytes")
        self._file = RecordFile(directory, dir_fd, INDEX_FILE, RECORD_SIZE)
        self._slots = slots
        self._config = config
        self._mac_key = mac_key
        self._sync = sync
        self._lock = threading.Lock()
        """Held by the writers' methods, across their appends (I/O)."""
        self._pending_lock = threading.Lock()
        """Guards `_pending` alone; never held across I/O."""
        self._where = array.array("q", [-1]) * slots
        """slot -> offset of the record naming its content, -1 for none."""
        self._pending: set[int] = set()
        """Slots discarded since the last append (FREE records still to append): changed
        under `_pending_lock`, and replaced (not changed) by whoever takes it."""
        self._file_id = b""
        self._active = False
        self._appended = 0
        self._failures = 0
        self._compactions = 0
        self.observer: Observer | None = None

    @property
    def path(self) -> Path:
        return self._file.path

    def vet(self) -> bytes | None:
        """The journal's bytes (None when there is none); refuses a file of another user or
        writable by others.  Changes nothing."""
        return self._file.vet()

    def read(self, data: bytes | None, file_id: bytes) -> tuple[IndexFound | None,
                                                                   IndexReplay]:
        return read_index(data, slots=self._slots, config=self._config,
                          mac_key=self._mac_key, file_id=file_id)

    def resume(self, found: IndexFound, file_id: bytes) -> bool:
        """Keep appending to the journal `found` was read from, instead of rewriting it: when
        it still names the data file (not resized) and is within its size bound.  Its torn
        tail is cut off first.  False (nothing changed) when it cannot be kept.

        raises: ConfigError("directory") when the journal cannot be opened or cut.
        """
        if found.length // RECORD_SIZE > COMPACT_FACTOR * self._slots + 64:
            return False
        if found.head != _pack(HEAD, self._slots, file_id, self._config, self._mac_key):
            return False  # resized, or written under another MAC setting: rewrite
        try:
            self._file.remove_leftover()
            self._file.create(sync=self._sync)
            if self._file.size != found.length:
                os.ftruncate(self._file.fd, found.length)  # the torn tail
                self._file.size = found.length
        except OSError as exc:
            self._file.close()
            raise ConfigError("directory", f"cannot open {self.path}: {exc}") from None
        self._file_id = file_id
        self._where = found.offsets
        self._active = True
        return True

    def start(self, entries: Sequence[Entry], file_id: bytes) -> None:
        """Rewrite the journal atomically: a head naming the data file, one record per entry.

        raises: ConfigError("directory") when the rewrite fails (nothing else changed).
        """
        self._file_id = file_id
        try:
            self._file.remove_leftover()
            self._rewrite(entries)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise ConfigError("directory", f"cannot rewrite {self.path}: {exc}") from None
            # A full disk is no reason to refuse the cache: it runs without the journal
            # (the next open scans the slot headers), once no older journal is left to
            # describe slots this run will change.
            try:
                self._file.remove()
            except OSError as gone:
                raise ConfigError("directory", f"cannot rewrite {self.path} ({exc}) nor "
                                  f"remove it ({gone})") from None
            _log.warning("%s: cannot write the index journal (%s): this run keeps none, and "
                         "the next open rebuilds the index from the slot headers", self.path,
                         exc)
            return
        self._active = True

    def _rewrite(self, entries: Sequence[Entry]) -> None:
        records = [_pack(HEAD, self._slots, self._file_id, self._config, self._mac_key)]
        records += [_pack(SLOT, slot, key, self._config, self._mac_key, meta)
                    for slot, key, meta in entries]
        self._file.replace(b"".join(records))
        where = array.array("q", [-1]) * self._slots
        for n, (slot, _key, _meta) in enumerate(entries, start=1):
            where[slot] = n * RECORD_SIZE
        self._where = where

    # --- run time -------------------------------------------------------------------------

    def before_write(self, slots: Sequence[int]) -> None:
        """Slots about to be written: those the journal maps to content lose it first (a FREE
        record lands before the write starts), so a crash that tears the write leaves no
        record naming the torn slot.  Discarded slots' records go with them."""
        with self._lock:
            if not self._active:
                return
            where = self._where
            free = {s for s in slots if where[s] >= 0} | self._take_pending()
            if free:
                self._append_locked("free", [self._free_record(s) for s in sorted(free)])
                for s in free:
                    where[s] = -1

    def landed(self, entries: Sequence[Entry]) -> None:
        """Writes that returned (synced, under disk_sync="data"): one SLOT record each,
        synced too under "data" before the writes count as landed."""
        if not entries:
            return
        # Packed before the lock is taken (a record is a function of its entry alone, about
        # 2 us each with its MAC): the writers share this lock, and hold it for the append.
        records = [_pack(SLOT, slot, key, self._config, self._mac_key, meta)
                   for slot, key, meta in entries]
        with self._lock:
            if not self._active:
                return
            start = self._file.size
            if self._append_locked("landed", records, sync=self._sync):
                for n, (slot, _key, _meta) in enumerate(entries):
                    self._where[slot] = start + n * RECORD_SIZE
                with self._pending_lock:
                    self._pending.difference_update(slot for slot, _key, _meta in entries)
                if self._file.size // RECORD_SIZE > COMPACT_FACTOR * self._slots + 64:
                    self._compact_locked()

    def discard(self, slot: int) -> None:
        """`slot`'s content left the cache: its FREE record goes with the next append (no
        I/O here, and no wait for a writer's append: this runs on the serving thread).

        Read without the writers' lock, `_where[slot]` is exact for this slot: the core
        issues no write to a slot between freeing it and this call (the scheduler calls it
        while dispatching that FreeSlot), and a compaction keeps which slots are indexed."""
        if self._active and self._where[slot] >= 0:
            with self._pending_lock:
                self._pending.add(slot)

    def _take_pending(self) -> set[int]:
        with self._pending_lock:
            pending, self._pending = self._pending, set()
        return pending

    def _free_record(self, slot: int) -> bytes:
        return _pack(FREE, slot, _ZERO_KEY, self._config, self._mac_key)

    def _append_locked(self, what: str, records: list[bytes], *, sync: bool = False) -> bool:
        """One append; on failure the journal is given up for this run (removed, so that
        the next open scans the headers instead of trusting a journal with a hole)."""
        file = self._file
        before = file.size
        try:
            file.append(b"".join(records), sync=sync)
        except OSError as exc:
            self._give_up_locked(f"append failed ({exc})")
            return False
        self._appended += len(records)
        if self.observer is not None:
            self.observer(what, file.path, before, file.size)
        return True

    def _give_up_locked(self, why: str) -> None:
        self._failures += 1
        self._active = False
        self._take_pending()
        try:
            self._file.remove()
        except OSError as exc:
            # Still no wrong bytes: every read verifies its slot; a stale record costs a
            # failed read (recompute), a missing one a block not found again.
            _log.error("%s: %s, and it cannot be removed (%s): the next open may restore "
                       "stale entries (their reads fail and recompute)", self.path, why, exc)
            return
        _log.warning("%s: %s; the index journal is off until the next open (which scans "
                     "the slot headers)", self.path, why)

    def compact(self) -> None:
        """Rewrite now with one record per indexed slot (appends do it themselves once the
        file passes its size bound).  A no-op while the journal is off."""
        with self._lock:
            if self._active:
                self._compact_locked()

    def _compact_locked(self) -> None:
        """Rewrite with one record per indexed slot (bounds the file's size).

        Each record is copied from the file as it was appended, never packed again: a
        record changed behind the journal's back keeps the checksum (and MAC) it no longer
        matches, so the next open still refuses it, where packing it anew would have given
        it a fresh one.  A record at an indexed offset that is not that slot's SLOT record
        means the file is not the one this journal wrote: it is given up (the next open
        scans the slot headers).  Vectorized: the loop over every slot, unpacking and
        packing each record in Python, held the interpreter lock for 14 ms a compaction at
        4,096 slots and 0.55 s at 100,000 (CPU machine) -- on a writer thread, so the
        serving thread waited that long for its next torch call.
        """
        try:
            with open(self._file.path, "rb") as f:
                data = f.read()
        except OSError as exc:
            _log.warning("%s: cannot compact (%s)", self.path, exc)
            return
        where = np.frombuffer(self._where, dtype=np.int64)
        slots = np.flatnonzero(where >= 0)
        offsets = where[slots]
        whole = len(data) // RECORD_SIZE
        if ((offsets % RECORD_SIZE) != 0).any() or (offsets // RECORD_SIZE >= whole).any():
            self._give_up_locked("an indexed record lies outside the file")
            return
        raw = np.frombuffer(data, dtype=np.uint8, count=whole * RECORD_SIZE)
        rows = raw.reshape(whole, RECORD_SIZE)[offsets // RECORD_SIZE]
        rec = rows.view(_DTYPE).reshape(-1)
        wrong = np.flatnonzero((rec["magic"] != MAGIC) | (rec["kind"] != SLOT)
                               | (rec["slot"] != slots.astype(np.uint64)))
        if wrong.size:
            self._give_up_locked(f"the record of slot {slots[wrong[0]]} is not the one "
                                 f"appended for it")
            return
        head = _pack(HEAD, self._slots, self._file_id, self._config, self._mac_key)
        try:
            self._file.replace(head + rows.tobytes())
        except OSError as exc:
            # Still correct, only longer: the next append that crosses the bound tries again.
            _log.warning("%s: cannot compact (%s)", self.path, exc)
            return
        compacted = array.array("q", [-1]) * self._slots
        np.frombuffer(compacted, dtype=np.int64)[slots] = (
            np.arange(1, slots.size + 1, dtype=np.int64) * RECORD_SIZE)
        self._where = compacted
        self._compactions += 1

    def statistics(self) -> IndexJournalStatistics:
        """The counters as they are now, each read once: never waits for an append (the
        cache's statistics() runs on the serving thread)."""
        return IndexJournalStatistics(appended=self._appended, failures=self._failures,
                                      compactions=self._compactions, active=self._active)

    def close(self) -> None:
        """Append the discards still held and the seal (a clean close), then close."""
        with self._lock:
            try:
                if self._active:
                    records = [self._free_record(s) for s in sorted(self._take_pending())]
                    records.append(_pack(SEAL, self._file.size // RECORD_SIZE + len(records),
                                         _ZERO_KEY, self._config, self._mac_key))
                    self._append_locked("seal", records, sync=self._sync)
            finally:
                self._active = False
                self._take_pending()
                self._file.close()

    def abandon(self) -> None:
        """Close without writing anything (a process that died: fault injection)."""
        with self._lock:
            self._active = False
            self._take_pending()
            self._file.close()
