"""Opening a BlockingCache: Ctrl-C while it opens reaches the caller, and the cache's trio
thread is not left running (a daemon thread still inside the store's open when the
interpreter exits aborted the process); "cuda" resolves to the caller's current GPU; a
refusal of the shared tier's store names the StateKVConfig field."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from io_actors.embed import BlockingCache, open_shared_store, resolve_device
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import Recovery
from statekv.errors import ConfigError
from tests.io_helpers import small_config


class SlowOpen(PosixSlotStore):
    """A store whose recovery (read while the cache opens) waits until released."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.entered = threading.Event()
        self.release = threading.Event()

    @property
    def recovery(self) -> Recovery:
        self.entered.set()
        assert self.release.wait(30)
        return super().recovery


def _statekv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("statekv-")]


def _until_no_statekv_threads(seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while _statekv_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _statekv_threads()


def test_ctrl_c_while_the_cache_opens_closes_it_once_it_has_opened(tmp_path: Path) -> None:
    # Python's own SIGINT handler, whatever the runner installed: a shell's background job
    # ignores SIGINT, and a mutation runner catches it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_while_opening(tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_while_opening(tmp_path: Path) -> None:
    assert not _statekv_threads()
    config = small_config(tmp_path)
    rank = config.rank_directory()
    assert rank is not None
    store = SlowOpen(rank, config.core_config())
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main

    def interrupt() -> None:
        assert store.entered.wait(10)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.2)  # the caller is now waiting for the open to finish
        store.release.set()

    threading.Thread(target=interrupt, name="test-interrupter").start()
    with pytest.raises(KeyboardInterrupt):
        BlockingCache(config, store=store)
    # The open finished, then the cache was closed: its threads are gone.
    assert _until_no_statekv_threads(5) == []


def test_ctrl_c_before_the_trio_thread_started_gives_up_waiting_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt inside Thread.start() before the thread runs: nothing will ever open,
    so the caller stops waiting about a second later and the interrupt goes on."""
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "statekv-trio":
            raise KeyboardInterrupt
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        BlockingCache(small_config(tmp_path))
    waited = time.monotonic() - began
    assert waited < 5, f"waited {waited:.1f}s for a thread that never started"
    assert not _statekv_threads()


@pytest.mark.parametrize(("name", "expected"), [
    ("cuda", torch.device("cuda", 3)), ("auto", torch.device("cuda", 3)),
    ("cuda:1", torch.device("cuda", 1)), ("cpu", torch.device("cpu")),
])
def test_cuda_resolves_to_the_callers_current_device(
    name: str, expected: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """"cuda" and "auto" bind to the calling thread's current GPU (a tensor-parallel rank's
    own), never to an index-less device: checked without a GPU, by telling torch it has one
    whose current device is 3 (a torch.device is only a name until something is allocated)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device(name) == expected


@pytest.mark.parametrize(("store_field", "config_field"), [
    ("url", "remote_url"), ("namespace", "remote_namespace"), ("mac_key", "remote_secret"),
    ("timeout_s", "remote_timeout_s"), ("password", "remote_password"),
    ("tls_ca_file", "remote_tls_ca_file"), ("other", "other"),
])
def test_a_shared_store_refusal_names_the_statekv_config_field(
    store_field: str, config_field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Redis store names its own arguments; the user set StateKVConfig's fields."""
    from io_actors.storage import redis_store

    def refuse(*args: object, **kwargs: object) -> None:
        raise ConfigError(store_field, "is not acceptable here")

    monkeypatch.setattr(redis_store, "RedisClusterStore", refuse)
    config = small_config(tmp_path, remote_url="redis://127.0.0.1:7000")
    with pytest.raises(ConfigError) as caught:
        open_shared_store(config, config.core_config())
    assert caught.value.field == config_field
    assert str(caught.value) == str(ConfigError(config_field, "is not acceptable here"))


def test_the_shared_tier_without_redis_py_is_a_config_error_naming_remote_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "io_actors.storage.redis_store", None)
    config = small_config(tmp_path, remote_url="redis://127.0.0.1:7000")
    with pytest.raises(ConfigError, match="redis-py") as caught:
        open_shared_store(config, config.core_config())
    assert caught.value.field == "remote_url"
