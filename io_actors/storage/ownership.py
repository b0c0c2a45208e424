"""Who may own a slot store's files: the private directory, and the ownership check.

Another local user who owns a slot directory or any file in it, or who may write to one,
can replace spilled KV or forge journal records.  Every file of a store (the data file, the
journals' record files) is vetted by :func:`check_private`, and missing directories are
created 0700.  Separate from the stores and the record file so that both import the one rule
from below, not from each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from statekv.errors import ConfigError

_log = logging.getLogger(__name__)


def prepare_directory(directory: str | os.PathLike[str]) -> Path:
    """Make sure `directory` exists as a directory; missing components are created 0700.

    raises: ConfigError("directory") when it is not a path, exists as something other than a
    directory, or cannot be created.
    """
    return create_private_directory(directory)[0]


def create_private_directory(directory: str | os.PathLike[str]) -> tuple[Path, list[Path]]:
    """`directory`, and the components this call created (deepest last)."""
    if not isinstance(directory, str | os.PathLike):
        raise ConfigError("directory", f"must be a path, got {directory!r}")
    text = os.fspath(directory)
    if not isinstance(text, str) or not text or "\x00" in text:
        raise ConfigError("directory", f"must be a non-empty text path, got {directory!r}")
    path = Path(text)
    created: list[Path] = []
    try:
        _make_private_directory(path, created)
    except OSError as exc:
        remove_created(created)
        raise ConfigError("directory", f"cannot use {path}: {exc}") from None
    except BaseException:
        remove_created(created)
        raise
    return path, created


def remove_created(created: list[Path]) -> None:
    """Undo create_private_directory: remove the directories it created, deepest first."""
    for component in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(component)


def _make_private_directory(path: Path, created: list[Path]) -> None:
    missing: list[Path] = []
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            raise ConfigError("directory", f"{probe} is a dangling symbolic link")
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for component in reversed(missing):
        try:
            os.mkdir(component, 0o700)
        except FileExistsError:
            pass  # another rank created it between our check and our mkdir
        except OSError as exc:
            raise ConfigError("directory", f"cannot create {component}: {exc}") from None
        else:
            created.append(component)
            # mkdir's mode is filtered by the umask; chmod is not.
            os.chmod(component, 0o700)
    if not path.is_dir():
        raise ConfigError("directory", f"{path} exists but is not a directory")


def check_private(what: Path, info: os.stat_result) -> None:
    """raises: ConfigError("directory") unless `info` (of `what`) belongs to the effective
    user and no one else can write it.

    Another local user who owns the slot directory or data file, or may write to it, can
    replace spilled KV with bytes of their choosing (a CRC is no defence): the cache would
    serve them to this user's requests.
    """
    euid = os.geteuid()
    if info.st_uid != euid:
        raise ConfigError(
            "directory", f"{what} belongs to uid {info.st_uid}, not to this process's "
            f"effective uid {euid}: another user could rewrite the cached KV"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise ConfigError(
            "directory", f"{what} has mode {mode:o}: group or others may write it "
            "(chmod go-w, or use a private directory)"
        )
    if mode & 0o044:
        _log.warning("%s has mode %o: other users can read cached KV", what, mode)
