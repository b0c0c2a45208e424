"""Who may own a slot store's files: the private directory, and the ownership check.

Another local user who owns a slot directory or any file in it, or who may write to one,
can replace spilled KV or forge journal records.  Every file of a store (the data file, the
journals' record files) is vetted by :func:`check_private`, and missing directories are
created 0700.  Separate from the stores and the record file so that both import the one rule
from below, not from each other.
"""

from __future__ import annotations

import contextlib
import errno
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


def check_path(directory: Path, *, owned_from: Path | None) -> None:
    """Vet every directory on the way to `directory`, the way ssh vets a home directory.

    From `owned_from` (the ``disk_dir`` the user gave; `directory` itself when None) down
    to `directory`: each belongs to the effective user and no one else may write it
    (:func:`check_private`), and the components below `owned_from` are opened without
    following symbolic links, each from the one checked before it (``openat``), so that no
    one can swap a component between the check and the use.  Above `owned_from`: each
    belongs to the effective user or to root, and is writable by no one else unless it is
    sticky (``/tmp``: others cannot rename or remove what is ours there).  Someone who may
    write any of these directories can move ours aside and put theirs in its place.

    raises: ConfigError("directory") naming the component at fault.
    """
    target = Path(os.path.abspath(directory))
    base = target if owned_from is None else Path(os.path.abspath(owned_from))
    if base != target and base not in target.parents:
        base = target
    real_base = Path(os.path.realpath(base))  # the user's own links up to disk_dir: theirs
    euid = os.geteuid()
    for above in reversed(real_base.parents):
        try:
            info = os.stat(above)
        except OSError as exc:
            raise ConfigError("directory", f"cannot inspect {above}: {exc}") from None
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid not in (euid, 0):
            raise ConfigError(
                "directory", f"{above} (above the slot directory) belongs to uid "
                f"{info.st_uid}, neither this process's effective uid {euid} nor root: its "
                "owner could move the slot directory aside and put another in its place"
            )
        if mode & 0o022 and not mode & stat.S_ISVTX:
            raise ConfigError(
                "directory", f"{above} (above the slot directory) has mode {mode:o}: group "
                "or others may write it and so replace the slot directory (chmod go-w)"
            )
    below = target.relative_to(base).parts
    try:
        fd = os.open(real_base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError("directory", f"cannot open {base}: {exc}") from None
    try:
        here = base
        check_private(here, os.fstat(fd))
        for name in below:
            here = here / name
            try:
                next_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                  | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                kind = ("a symbolic link or not a directory"
                        if exc.errno in (errno.ELOOP, errno.ENOTDIR) else str(exc))
                raise ConfigError("directory", f"cannot use {here}: {kind}") from None
            os.close(fd)
            fd = next_fd
            check_private(here, os.fstat(fd))
    finally:
        os.close(fd)


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
    if stat.S_ISREG(info.st_mode) and info.st_nlink != 1:
        # Another name for the file may live in a directory someone else controls (or be a
        # file of theirs that this open would then resize or wipe).
        raise ConfigError(
            "directory", f"{what} has {info.st_nlink} hard links: a file of a slot "
            "directory must have exactly one name"
        )
    if mode & 0o044:
        _log.warning("%s has mode %o: other users can read cached KV", what, mode)
