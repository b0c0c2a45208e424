"""Opening a POSIX slot store's directory: lock, vet, open or create the data file, rebuild
the index, replay the journals.

Everything here runs once, in the constructor of :class:`~io_actors.storage.posix.
PosixSlotStore`, before the first transfer: the directory is locked and vetted
(:mod:`io_actors.storage.ownership`), older data files are reclaimed, the data file is
opened and resized, or created under a temporary name (or wiped, without ``persist``), the
index is rebuilt from the index journal or by scanning every slot header, and the retention
journal's lengthened deadlines are applied.  What it found is a :class:`Recovery`.  Kept
apart from the store's transfer code (O_DIRECT, batches, headers on the hot path), which
never calls back into it.

Opening is all or nothing: a failure closes what it opened, removes the directories it
created and leaves an existing data file as it was (a file it was growing is cut back).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

import attrs

from io_actors.storage.buffers import host_view, page_aligned_buffer
from io_actors.storage.gc_pause import gc_paused
from io_actors.storage.index_journal import IndexFound, IndexJournal, IndexReplay, identity
from io_actors.storage.ownership import (
    check_path,
    check_private,
    create_private_directory,
    remove_created,
)
from io_actors.storage.retention_journal import (
    JournalReplay,
    RetentionJournal,
    RetentionRecord,
    replay,
)
from io_actors.storage.slot_format import (
    ALIGN,
    HEADER_SIZE,
    MAGIC,
    SlotHeader,
    SlotMeta,
)
from statekv.errors import ConfigError, DirectoryInUse, NewerFormat, TransferFailed
from statekv.ids import BlockHash, SlotId

_log = logging.getLogger(__name__)

DATA_FILE_VERSION: Final = 2
"""The version in the data file's name: the slot format version that last changed what a data
file holds beyond its checksums.  Version 3 of the slot format changed only the checksum
function, which every slot header names (its version), so a version 2 file is opened and
restored as it is, with old and new slots side by side.  Raising this to 3 would reclaim
(delete) every version 2 file at the upgrade.  The cost is in the other direction: a
version 2 build opens a file holding version 3 slots and counts those as corrupt (a scan),
or fails their reads (a journal restore), so they are recomputed: never served wrong."""
DATA_FILE: Final = f"slots.v{DATA_FILE_VERSION}"
"""Name of the data file inside a store's directory (the file's version is in the name, so
a directory written by an incompatible version is recognised before a byte of it is
read)."""
DATA_FILE_GRAIN: Final = ALIGN
"""Every data file of any configuration is a whole number of these (each slot is)."""
_NEW_FILE: Final = DATA_FILE + ".new"
"""A data file being created: renamed to DATA_FILE only once fully allocated."""
_VERSIONED = re.compile(r"^slots\.v([0-9]{1,9})(\.new)?$")
SCAN_THREADS: Final = 8
"""Threads reading headers in an index rebuild (one 4 KiB read per slot).  Measured on the
2-core CPU machine, 50k slots of 2 MiB: cold (headers from the device) 4.9 s with 1 thread,
3.0 with 2, 2.3 with 4, 2.2 with 8, 2.3 with 16 and 32 (the disk's random-read rate);
warm (page cache) 0.67 s with 1 thread, rising to 1.2 with 8 and 1.6 with 32, as parsing
the headers holds the GIL.  Cold is the case a restart after a reboot meets."""


def rank_dir(base: str | os.PathLike[str], rank: int, namespace: str = "target") -> Path:
    """The directory of one rank's slot store: ``base/<namespace>/rank_<rank>``.

    A draft model's cache uses another namespace (e.g. ``"draft"``), so it never shares slot
    files with the target model's.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError("rank", f"must be an integer >= 0, got {rank!r}")
    if (
        not isinstance(namespace, str) or not namespace or namespace in {".", ".."}
        or "/" in namespace or "\x00" in namespace or (os.altsep and os.altsep in namespace)
    ):
        raise ConfigError("namespace", f"must be a plain directory name, got {namespace!r}")
    if not isinstance(base, str | os.PathLike):
        raise ConfigError("directory", f"must be a path, got {base!r}")
    return Path(base) / namespace / f"rank_{rank}"


@attrs.frozen(kw_only=True)
class RecoveredSlot:
    """A slot an index rebuild found servable: its key and what its header says."""

    slot: SlotId
    key: BlockHash
    meta: SlotMeta


@attrs.frozen(kw_only=True)
class Recovery:
    """What opening a store found in its directory, slot by slot.

    Every slot with a header is either restorable or reclaimed for one counted reason.
    """

    slots: tuple[RecoveredSlot, ...]
    """Restorable slots, in slot order."""
    foreign: int = 0
    """Written under another config fingerprint (model, layout, block size) or without the
    fields a rebuild needs: never served."""
    corrupt: int = 0
    """A header that fails its checksum, names another slot, or is not a slot header (a
    write torn by a crash, media rot)."""
    unauthenticated: int = 0
    """Written without a MAC while this store requires one."""
    duplicates: int = 0
    """A second slot under a key found already (the older write is reclaimed)."""
    beyond_capacity: int = 0
    """Slots past the configured size (the data file shrank)."""
    old_files: int = 0
    """Data files of an older format version, removed."""
    journal: JournalReplay = attrs.field(factory=JournalReplay)
    """What replaying the retention journal found: deadlines lengthened after their slot
    was written (applied to `slots`), and the records ignored, by why."""
    index: IndexReplay = attrs.field(factory=IndexReplay)
    """How the index was rebuilt: from the index journal (no header scan), or by the scan
    (and why the journal was not used).  With the journal, the slots the scan would have
    reclaimed are not looked at: their counts above stay 0 (the open that wrote them
    counted them)."""

    @property
    def reclaimed(self) -> int:
        return (self.foreign + self.corrupt + self.unauthenticated + self.duplicates
                + self.beyond_capacity)


def _written(entry: RecoveredSlot) -> tuple[float, int]:
    return entry.meta.written_at, entry.meta.sequence


@attrs.frozen(kw_only=True)
class OpenedStore:
    """A store's directory, opened: the store owns these descriptors and journals from now
    on and closes them."""

    path: Path
    """The data file."""
    dir_fd: int
    """The directory, locked (closing it releases the lock)."""
    fd: int
    """The data file, read-write, without O_DIRECT yet."""
    recovery: Recovery
    journal: RetentionJournal
    index: IndexJournal


class StoreOpening:
    """One open of a store's directory, for a store of `slots` slots of `slot_bytes` bytes
    (`payload_len` of them payload) written under `config_fp`, signed with `mac_key`."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        slots: int,
        slot_bytes: int,
        payload_len: int,
        config_fp: bytes,
        mac_key: bytes | None,
        owned_from: str | os.PathLike[str] | None = None,
    ) -> None:
        self._requested = directory
        self._owned_from = owned_from
        self._slots: Final = slots
        self._slot_bytes: Final = slot_bytes
        self._payload_len: Final = payload_len
        self._config_fp: Final = config_fp
        self._mac_key: Final = mac_key
        self._directory = Path()
        self._path = Path()
        self._dir_fd = -1
        self._fd = -1

    def run(self, *, preallocate: bool, persist: bool, sync_writes: bool) -> OpenedStore:
        """Open the directory (created 0700 where missing), all or nothing.

        raises: ConfigError("directory") / ("disk_blocks"), DirectoryInUse, NewerFormat.
        """
        self._directory, created = create_private_directory(self._requested)
        self._path = self._directory / DATA_FILE
        journal: RetentionJournal | None = None
        index: IndexJournal | None = None
        try:
            check_path(self._directory, owned_from=None if self._owned_from is None
                       else Path(self._owned_from))
            self._dir_fd = self._lock_directory()
            journal = RetentionJournal(
                self._directory, self._dir_fd, slots=self._slots, config=self._config_fp,
                mac_key=self._mac_key, sync=sync_writes,
            )
            index = IndexJournal(
                self._directory, self._dir_fd, slots=self._slots, config=self._config_fp,
                mac_key=self._mac_key, sync=sync_writes,
            )
            # Vetted before anything changes on disk, like the data file.
            records = journal.vet()
            index_data = index.vet()
            with gc_paused():
                self._fd, recovery, found = self._open_data_file(
                    preallocate, persist, index, index_data if persist else None
                )
            self._recovery = self._replay(journal, recovery, records if persist else None)
            file_id = self._file_id(os.fstat(self._fd))
            if found is None or not index.resume(found, file_id):
                index.start(
                    [(e.slot, bytes(e.key), e.meta) for e in self._recovery.slots], file_id
                )
        except BaseException:
            if index is not None:
                index.abandon()
            if journal is not None:
                journal.close()
            if self._fd >= 0:
                os.close(self._fd)
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
            remove_created(created)
            raise
        return OpenedStore(path=self._path, dir_fd=self._dir_fd, fd=self._fd,
                           recovery=self._recovery, journal=journal, index=index)

    def _lock_directory(self) -> int:
        """Open, vet and lock the directory itself (a lock file would be one more thing to
        create, and to clean up after a failed open)."""
        try:
            fd = os.open(self._directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError("directory", f"cannot open {self._directory}: {exc}") from None
        try:
            check_private(self._directory, os.fstat(fd))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DirectoryInUse(
                    "directory", f"{self._directory} is in use by another slot store (locked "
                    "by another cache, in this process or another)"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _entries(self) -> tuple[list[Path], bool]:
        """Older data files (to reclaim) and whether a half-created one is left over.

        raises: NewerFormat for a data file of a newer format version.
        """
        older: list[Path] = []
        leftover = False
        try:
            names = os.listdir(self._dir_fd)
        except OSError as exc:
            raise ConfigError("directory", f"cannot list {self._directory}: {exc}") from None
        for name in sorted(names):
            match = _VERSIONED.match(name)
            if match is None:
                continue
            version = int(match.group(1))
            if version > DATA_FILE_VERSION:
                raise NewerFormat(
                    "directory", f"{self._directory / name} was written by a newer statekv "
                    f"(data file version {version}; this build writes {DATA_FILE_VERSION}): "
                    "upgrade, or give this cache another directory"
                )
            if version < DATA_FILE_VERSION:
                older.append(self._directory / name)
            elif match.group(2):
                leftover = True
        return older, leftover

    def _file_id(self, info: os.stat_result) -> bytes:
        return identity(inode=info.st_ino, size=info.st_size, slot_bytes=self._slot_bytes,
                        payload_len=self._payload_len)

    def _open_data_file(
        self, preallocate: bool, persist: bool, index: IndexJournal, index_data: bytes | None,
    ) -> tuple[int, Recovery, IndexFound | None]:
        """The data file, opened (and resized), what its index holds, and the index journal
        it was read from (None when the headers were scanned, or nothing was read)."""
        older, leftover = self._entries()
        try:
            info: os.stat_result | None = os.lstat(self._path)
        except FileNotFoundError:
            info = None
        except OSError as exc:
            raise ConfigError("directory", f"cannot inspect {self._path}: {exc}") from None
        if info is not None:
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(
                    "directory", f"{self._path} is not a regular file (a link or a device)"
                )
            check_private(self._path, info)
            if info.st_size % DATA_FILE_GRAIN:
                raise ConfigError(
                    "directory", f"{self._path} is not a statekv slot file: it is "
                    f"{info.st_size} bytes, a size no slot configuration makes (slots are "
                    f"whole {DATA_FILE_GRAIN}-byte pages); move it away"
                )
        fd = -1
        recovery = Recovery(slots=())
        found: IndexFound | None = None
        if info is not None and persist:
            fd = self._open_existing()
            try:
                recovery, found = self._rebuild(fd, info, index, index_data)
                self._resize(fd, info, preallocate)
            except BaseException:
                os.close(fd)
                raise
        else:
            if leftover:
                # A crash or failure during an earlier open: never renamed, so never used.
                _log.warning("%s: removing a half-created data file", self._directory)
                os.unlink(self._directory / _NEW_FILE)
            fd = self._create(preallocate)
            if info is not None:
                _log.warning("%s: persist is off, existing slots are wiped", self._path)
        # Only now, with the new file in place, is anything removed.
        for path in older:
            _log.warning("%s: slot format of an older version, reclaimed (removed)", path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if leftover and info is not None and persist:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._directory / _NEW_FILE)
        return fd, attrs.evolve(recovery, old_files=len(older)), found

    def _replay(
        self, journal: RetentionJournal, recovery: Recovery, records: bytes | None
    ) -> Recovery:
        """Apply the journal's lengthened deadlines to the restored slots (the later deadline
        wins), then rewrite the journal with the records that still say something."""
        if not records:
            journal.start(())
            return recovery
        restored: dict[int, bytes] = {entry.slot: bytes(entry.key) for entry in recovery.slots}
        latest, counts = replay(records, restored=restored, slots=self._slots,
                                config=self._config_fp, mac_key=self._mac_key)
        slots: list[RecoveredSlot] = []
        keep: list[RetentionRecord] = []
        for found in recovery.slots:
            deadline = latest.get(found.slot)
            if deadline is not None and (found.meta.expiry is None
                                         or deadline > found.meta.expiry):
                slots.append(attrs.evolve(found, meta=attrs.evolve(found.meta, expiry=deadline)))
                keep.append(RetentionRecord(slot=found.slot, key=found.key, expiry=deadline))
            else:
                slots.append(found)
        if counts.ignored:
            _log.warning(
                "%s: %d retention records ignored (%d torn, %d unauthenticated, %d foreign)",
                journal.path, counts.ignored, counts.torn, counts.unauthenticated,
                counts.foreign,
            )
        journal.start(keep)
        return attrs.evolve(recovery, slots=tuple(slots), journal=counts)

    def _open_existing(self) -> int:
        try:
            return os.open(self._path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise ConfigError("directory", f"cannot open {self._path}: {exc}") from None

    def _check_free_space(self, needed: int) -> None:
        try:
            fs = os.statvfs(self._directory)
        except OSError as exc:
            raise ConfigError("directory", f"cannot stat {self._directory}: {exc}") from None
        free = fs.f_bavail * fs.f_frsize
        if needed > free:
            raise ConfigError(
                "disk_blocks", f"{self._slots} slots of {self._slot_bytes} bytes need "
                f"{needed} more bytes; {self._directory} has {free} bytes free"
            )

    def _create(self, preallocate: bool) -> int:
        """A fresh data file, allocated under a temporary name and renamed into place only
        once complete: a failure (no space, an I/O error) leaves no partly allocated file."""
        needed = self._slots * self._slot_bytes
        new = self._directory / _NEW_FILE
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(new, flags, 0o600)
        except OSError as exc:
            raise ConfigError("directory", f"cannot create {new}: {exc}") from None
        try:
            os.fchmod(fd, 0o600)
            if preallocate:
                # Before a byte is allocated: posix_fallocate may fill the disk, then fail.
                self._check_free_space(needed)
            self._allocate(fd, 0, needed, preallocate)
            os.replace(new, self._path)
            os.fsync(self._dir_fd)  # the rename is durable before any slot is
        except BaseException as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(new)
            if isinstance(exc, OSError):
                raise ConfigError("directory", f"cannot prepare {self._path}: {exc}") from None
            raise
        return fd

    def _allocate(self, fd: int, start: int, end: int, preallocate: bool) -> None:
        """Reserve bytes [start, end) of the file (the size becomes at least `end`)."""
        if preallocate and end > start:
            try:
                os.posix_fallocate(fd, start, end - start)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise ConfigError(
                        "disk_blocks", f"{self._slots} slots of {self._slot_bytes} bytes need "
                        f"{end} bytes; {self._directory} has not that much free space"
                    ) from None
                if exc.errno not in {errno.EOPNOTSUPP, errno.EINVAL}:
                    raise
                _log.warning("%s: cannot preallocate (%s); using a sparse file", self._path, exc)
            else:
                return
        if os.fstat(fd).st_size < end:
            os.ftruncate(fd, end)

    def _resize(self, fd: int, info: os.stat_result, preallocate: bool) -> None:
        """Bring an existing data file to the configured size; restore it on failure."""
        needed = self._slots * self._slot_bytes
        current = info.st_size
        try:
            if current > needed:
                # The slots past the new end were counted as reclaimed by the scan.
                os.ftruncate(fd, needed)
                _log.warning("%s: shrunk from %d to %d bytes", self._path, current, needed)
            elif current < needed or preallocate:
                if preallocate:
                    self._check_free_space(max(0, needed - info.st_blocks * 512))
                try:
                    # From 0: an earlier open may have left the file sparse (holes are
                    # filled; allocated ranges cost nothing).
                    self._allocate(fd, 0, needed, preallocate)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, current)
                    raise
        except OSError as exc:
            raise ConfigError("directory", f"cannot resize {self._path}: {exc}") from None

    def _rebuild(
        self, fd: int, info: os.stat_result, index: IndexJournal, index_data: bytes | None,
    ) -> tuple[Recovery, IndexFound | None]:
        """The index of an existing data file: from the index journal when it is complete
        and names this file (one sequential read), else from the slot headers (a read per
        slot), with the reason logged."""
        self._check_first_block(fd, info.st_size)
        found, replay = index.read(index_data, self._file_id(info))
        if found is None:
            if info.st_size // self._slot_bytes:
                _log.warning("%s: index rebuilt from the slot headers: %s", self._path,
                             replay.reason)
            return attrs.evolve(self._scan(fd, info.st_size), index=replay), None
        if replay.torn:
            _log.warning("%s: %d torn index record(s) at the end ignored (an append torn "
                         "by a crash)", index.path, replay.torn)
        return Recovery(
            slots=tuple(RecoveredSlot(slot=SlotId(slot), key=BlockHash(key), meta=meta)
                        for slot, key, meta in found.entries),
            duplicates=replay.duplicates, beyond_capacity=replay.beyond_capacity,
            index=replay,
        ), found

    def _check_first_block(self, fd: int, size: int) -> None:
        """raises: ConfigError("directory") when the file is not a statekv data file (its
        first header block is neither empty nor a slot header), before anything changes."""
        if size < HEADER_SIZE:
            return
        first = os.pread(fd, HEADER_SIZE, 0)
        if any(first) and not first.startswith(MAGIC):
            raise ConfigError(
                "directory", f"{self._path} is not a statekv slot file (foreign or corrupt: "
                "its first header block is not a slot header); move it away"
            )

    def _scan(self, fd: int, size: int) -> Recovery:
        """Read every slot header of an existing data file: the index rebuild's input.

        Only headers are read (4 KiB a slot, in parallel): a payload is verified when it is
        read back, as always, so a slot torn by a crash is found then and never served.

        raises: ConfigError("directory") when the file is not a statekv data file (its first
        header block is neither empty nor a slot header), before anything changes.
        """
        nslots = size // self._slot_bytes
        if nslots == 0:
            return Recovery(slots=())
        with contextlib.suppress(OSError, AttributeError):
            # One header per slot, far apart: read-ahead would only read payloads.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        step = -(-nslots // SCAN_THREADS)
        ranges = [(lo, min(lo + step, nslots)) for lo in range(0, nslots, step)]
        with ThreadPoolExecutor(len(ranges), thread_name_prefix="statekv-scan") as pool:
            parts = list(pool.map(lambda r: self._scan_range(fd, *r), ranges))
        found: dict[bytes, RecoveredSlot] = {}
        counts = {"foreign": 0, "corrupt": 0, "unauthenticated": 0, "duplicates": 0,
                  "beyond_capacity": 0}
        for slots, part_counts in parts:
            for name, n in part_counts.items():
                counts[name] += n
            for entry in slots:
                if entry.slot >= self._slots:
                    counts["beyond_capacity"] += 1
                    continue
                other = found.get(entry.key)
                if other is not None:
                    counts["duplicates"] += 1
                    # Same key, same bytes by construction; keep the newer write.
                    if _written(other) >= _written(entry):
                        continue
                found[entry.key] = entry
        return Recovery(
            slots=tuple(sorted(found.values(), key=lambda e: e.slot)),
            foreign=counts["foreign"], corrupt=counts["corrupt"],
            unauthenticated=counts["unauthenticated"], duplicates=counts["duplicates"],
            beyond_capacity=counts["beyond_capacity"],
        )

    def _scan_range(self, fd: int, lo: int, hi: int) -> tuple[list[RecoveredSlot],
                                                              dict[str, int]]:
        slots: list[RecoveredSlot] = []
        counts = {"foreign": 0, "corrupt": 0, "unauthenticated": 0}
        buffer = page_aligned_buffer(HEADER_SIZE)
        view = host_view(buffer)
        zero = bytes(len(MAGIC))
        for slot in range(lo, hi):
            try:
                got = os.preadv(fd, [view], slot * self._slot_bytes)
            except OSError:
                counts["corrupt"] += 1
                continue
            if got != HEADER_SIZE:
                counts["corrupt"] += 1
                continue
            magic = bytes(view[: len(MAGIC)])
            if magic == zero and not any(view):
                continue  # never written
            if magic != MAGIC:
                counts["corrupt"] += 1
                continue
            try:
                header = SlotHeader.unpack(view, what=f"slot {slot}")
            except TransferFailed:
                counts["corrupt"] += 1
                continue
            if header.slot != slot:
                counts["corrupt"] += 1
            elif (header.config != self._config_fp or header.meta is None
                  or header.payload_len != self._payload_len):
                counts["foreign"] += 1
            elif self._mac_key is not None and header.mac is None:
                counts["unauthenticated"] += 1
            else:
                slots.append(RecoveredSlot(slot=SlotId(slot), key=BlockHash(header.key),
                                           meta=header.meta))
        return slots, counts
