"""Ownership of the whole path to the slot files (the way ssh vets a home directory).

Every directory from `disk_dir` down to the rank directory belongs to this user and no one
else may write it, and is reached without following a symbolic link; the directories above
`disk_dir` belong to this user or root and are writable by no one else unless sticky; a data
file with a second name, or of a size no configuration makes, is refused rather than
adopted.  Each refusal is a ConfigError naming disk_dir, before anything changes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from io_actors.storage.posix_open import DATA_FILE
from statekv import ConfigError
from tests.io_helpers import serve, small_config


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (files with their bytes, links by target)."""
    out: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = os.readlink(path).encode()
        elif path.is_file():
            out[rel] = path.read_bytes()
        else:
            out[rel] = None
    return out


def refused(config: StateKVConfig, root: Path, match: str) -> None:
    before = tree(root)
    with pytest.raises(ConfigError, match=match) as info:
        BlockingCache(config)
    assert info.value.field == "disk_dir"
    assert tree(root) == before  # nothing created, resized or removed


def used(tmp_path: Path) -> StateKVConfig:
    config = small_config(tmp_path / "cache")
    with BlockingCache(config) as cache:
        serve(cache, "p", list(range(9)))
    return config


def test_a_rank_directory_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    config = used(tmp_path)
    rank = config.rank_directory()
    assert rank is not None
    elsewhere = tmp_path / "elsewhere"
    rank.rename(elsewhere)
    rank.symlink_to(elsewhere)
    refused(config, tmp_path, "symbolic link")


def test_a_directory_between_disk_dir_and_the_files_others_may_write_is_refused(
    tmp_path: Path,
) -> None:
    config = used(tmp_path)
    rank = config.rank_directory()
    assert rank is not None
    rank.parent.chmod(0o777)  # <disk_dir>/<namespace>
    refused(config, tmp_path, "group or others may write")


def test_a_directory_above_disk_dir_others_may_write_is_refused_unless_sticky(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    config = small_config(parent / "cache")
    parent.chmod(0o777)
    refused(config, tmp_path, "above the slot directory")
    parent.chmod(0o1777)  # like /tmp: others cannot move our directory aside
    with BlockingCache(config) as cache:
        serve(cache, "p", list(range(9)))


def test_a_data_file_with_a_second_name_is_refused(tmp_path: Path) -> None:
    config = used(tmp_path)
    rank = config.rank_directory()
    assert rank is not None
    os.link(rank / DATA_FILE, tmp_path / "another-name")
    refused(config, tmp_path, "hard links")


def test_a_data_file_of_a_size_no_configuration_makes_is_refused_not_grown(
    tmp_path: Path,
) -> None:
    config = small_config(tmp_path / "cache")
    rank = config.rank_directory()
    assert rank is not None
    rank.mkdir(parents=True, mode=0o700)
    for d in (tmp_path / "cache", rank.parent, rank):
        d.chmod(0o700)
    decoy = rank / DATA_FILE
    decoy.write_bytes(b"not a slot file " * 86 + b"1234567")  # 1,383 bytes
    decoy.chmod(0o600)
    refused(config, tmp_path, "a size no slot configuration makes")
