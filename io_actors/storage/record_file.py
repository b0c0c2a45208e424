"""An append-only file of fixed-size records next to a slot store's data file.

The retention journal (retention_journal.py) and the index journal (index_journal.py) keep
their records the same way, so the file handling lives here once:

* **Vetting** before anything changes on disk: the file must be a regular file of the
  effective user that no one else may write (``check_private``: another user who could
  write it could forge records), and it is read whole.
* **Appends** of one batch with one ``write(2)`` on an ``O_APPEND`` descriptor: after a crash
  only the file's last record can be torn, and every other record stays at a multiple of the
  record size.  A failed or short append is cut back off (``ftruncate`` to the last whole
  record) before the next one; under ``sync`` an append is ``fdatasync``ed before it counts.
* **Rewrites** are atomic: a temporary ``<name>.new``, written, ``fsync``ed, renamed over the
  file, the directory ``fsync``ed.  A ``.new`` left by a crash was never renamed, so it was
  never part of the file: it is removed at open.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from io_actors.storage.ownership import check_private
from statekv.errors import ConfigError

_log = logging.getLogger(__name__)


class ShortAppend(OSError):
    """The kernel took only part of an append (the part was cut off again)."""


def check_record_file(path: Path, info: os.stat_result) -> None:
    """raises: ConfigError("directory") unless `path` is a regular file of the effective user
    that no one else may write."""
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError("directory", f"{path} is not a regular file (a link or a device)")
    check_private(path, info)


class RecordFile:
    """One record file of a slot directory (not thread safe: its owner holds a lock)."""

    def __init__(self, directory: Path, dir_fd: int, name: str, record_size: int) -> None:
        self._directory = directory
        self._dir_fd = dir_fd
        self.path = directory / name
        self._new = directory / (name + ".new")
        self.record_size = record_size
        self.fd = -1
        """The append descriptor, or -1 while the file is not open for appends."""
        self.size = 0
        """Bytes in the file: always a multiple of record_size while it is open."""
        self.broken = False
        """A failed append could not be cut off again: only a rewrite (`replace`) repairs
        the file."""

    def vet(self) -> bytes | None:
        """The file's bytes (None when there is none); refuses a file of another user or
        writable by others.  Changes nothing."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigError("directory", f"cannot inspect {self.path}: {exc}") from None
        check_record_file(self.path, info)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise ConfigError("directory", f"cannot open {self.path}: {exc}") from None
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 22):
                chunks.append(chunk)
        except OSError as exc:
            raise ConfigError("directory", f"cannot read {self.path}: {exc}") from None
        finally:
            os.close(fd)
        return b"".join(chunks)

    def remove_leftover(self) -> None:
        """Remove a ``.new`` a crash left during a rewrite (it was never renamed in)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._new)

    def replace(self, data: bytes) -> None:
        """Make `data` the file's whole content atomically, and open it for appends.

        Always synced: a rename of an unsynced file can come back empty after a power loss.
        raises: OSError (the file in place is then the old one, or the new one whole).
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(self._new, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.replace(self._new, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self._new)
            raise
        os.close(fd)
        try:
            os.fsync(self._dir_fd)
        except OSError as exc:
            # The rename happened: only its survival of a power loss is in doubt.
            _log.warning("%s: directory sync after a rewrite failed (%s)", self.path, exc)
        appender = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        self.close()
        self.fd = appender
        self.size = len(data)
        self.broken = False

    def remove(self) -> None:
        """Remove the file (and make that durable).  raises: OSError."""
        self.close()
        if os.path.lexists(self.path):
            os.unlink(self.path)
            os.fsync(self._dir_fd)

    def create(self, *, sync: bool) -> None:
        """Open for appends, creating the file where missing; a partial record at its end
        is cut off.  Under `sync` the directory entry is made durable.  raises: OSError."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(self.path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            size = os.fstat(fd).st_size
            if size % self.record_size:
                os.ftruncate(fd, size - size % self.record_size)
                size -= size % self.record_size
            if sync:
                os.fsync(self._dir_fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = size

    def append(self, data: bytes, *, sync: bool) -> None:
        """Append whole records with one write (fdatasync'ed under `sync`).

        raises: OSError (ShortAppend for a partial write); the part that landed is cut off
        again (when even that fails, `broken` is set).
        """
        try:
            written = os.write(self.fd, data)
            if written == len(data) and sync:
                os.fdatasync(self.fd)
        except OSError:
            self.cut_back()
            raise
        if written != len(data):
            self.cut_back()
            raise ShortAppend(f"short append: {written} of {len(data)} bytes")
        self.size += written

    def cut_back(self) -> bool:
        """Cut the file back to its last whole append; False when that failed."""
        try:
            os.ftruncate(self.fd, self.size)
        except OSError:
            self.broken = True
            return False
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
