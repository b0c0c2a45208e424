"""Shared helpers for the integration tests of the actors: a small serving-loop driver that
writes recognisable KV into the pages it is given and checks what comes back.

The KV of a full block is derived from the block's tokens and position alone, so the bytes
a request finds in its pages after an onboard can be checked against what any request that
computed that prefix wrote.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from io_actors.config import StateKVConfig
from io_actors.embed import CacheAPI
from io_actors.storage.record_file import RecordFile
from statekv.config import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
BLOCK_SIZE = 4
TEST_REMOTE_SECRET = b"statekv-tests-remote-secret"
"""Signs the shared tier's values in the tests (every replica of a test shares it)."""


def small_config(tmp_path: object, **overrides: object) -> StateKVConfig:
    args: dict[str, object] = {
        "layout": LAYOUT, "block_size": BLOCK_SIZE, "gpu": 8, "host": 2, "reserved_host": 1,
        "disk": 32, "disk_dir": tmp_path, "writers": 2, "readers": 2,
        "model_fingerprint": "io-test-model",
        # The GPU machine runs the same tests on CUDA: STATEKV_TEST_DEVICE=cuda.
        "device": os.environ.get("STATEKV_TEST_DEVICE", "cpu"),
    }
    args.update(overrides)
    if args.get("remote_url") is not None:
        args.setdefault("remote_secret", TEST_REMOTE_SECRET)
    return StateKVConfig(**args)  # type: ignore[arg-type]


def block_payload(tokens: Sequence[int], nbytes: int) -> torch.Tensor:
    """Deterministic bytes for the KV of one block whose prefix is `tokens`."""
    seed = hashlib.blake2b(repr(list(tokens)).encode(), digest_size=8).digest()
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += hashlib.blake2b(seed + counter.to_bytes(8, "little"), digest_size=64).digest()
        counter += 1
    return torch.frombuffer(bytearray(out[:nbytes]), dtype=torch.uint8)


def page_bytes(cache: CacheAPI, page: int) -> torch.Tensor:
    return cache.kv_pool[page].reshape(-1).view(torch.uint8)


def compute(cache: CacheAPI, rid: str, tokens: Sequence[int]) -> None:
    """Act as a forward pass: allocate, write each new block's payload, commit."""
    status = cache.request_status(rid)
    cache.allocate_nowait(rid, len(tokens))
    table = cache.block_table(rid)
    bs = cache.config.block_size
    nbytes = cache.kv_pool[0].numel() * cache.kv_pool.element_size()
    for i in range(status.num_computed_tokens // bs, len(table)):
        prefix = tokens[: min((i + 1) * bs, len(tokens))]
        page_bytes(cache, table[i]).copy_(block_payload(prefix, nbytes).to(cache.device))
    cache.commit(rid, len(tokens))


def check_pages(cache: CacheAPI, rid: str, tokens: Sequence[int], blocks: int) -> None:
    """The first `blocks` pages of `rid` hold exactly what was computed for that prefix."""
    table = cache.block_table(rid)
    bs = cache.config.block_size
    nbytes = cache.kv_pool[0].numel() * cache.kv_pool.element_size()
    for i in range(blocks):
        expected = block_payload(tokens[: (i + 1) * bs], nbytes)
        got = page_bytes(cache, table[i]).cpu()
        assert torch.equal(got, expected), f"request {rid}: block {i} differs"


def serve(cache: CacheAPI, rid: str, tokens: Sequence[int], **kwargs: object) -> None:
    """Add, compute and release one request (blocking facade: waits for onboards)."""
    match = cache.add_request(rid, tokens, **kwargs)  # type: ignore[arg-type]
    wait_ready(cache, rid)
    check_pages(cache, rid, tokens, match.matched_tokens // cache.config.block_size)
    compute(cache, rid, tokens)
    cache.release(rid)


def doc_evicted_to_host(cache: CacheAPI, bs: int) -> list[int]:
    """Serve a document of four full blocks and a token, then another request whose six
    blocks fill a six-page GPU and evict the document's to host; returns the document's
    tokens.  Asking for them again recalls each block into the page of a block it evicts:
    a copy out of each page, then one into it."""
    doc = [(7 * i + 1) % 50 for i in range(4 * bs + 1)]
    other = [(3 * i + 2) % 50 + 50 for i in range(6 * bs)]
    for rid, tokens in (("doc", doc), ("other", other)):
        cache.add_request(rid, tokens)
        compute(cache, rid, tokens)
        cache.release(rid)
    return doc


def wait_ready(cache: CacheAPI, rid: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cache.is_ready(rid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"request {rid} still parked after {timeout}s")
        time.sleep(0.001)


def wait_quiet(cache: CacheAPI, timeout: float = 10.0) -> None:
    """Until no disk transfer is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        stats = cache.statistics()
        if (stats.cache.writes_in_flight == 0 and stats.cache.reads_in_flight == 0
                and stats.spill_backlog == 0):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"transfers still in flight: {stats}")
        time.sleep(0.001)


@contextlib.contextmanager
def append_stuck_in_the_disk(monkeypatch: pytest.MonkeyPatch, file_name: str,
                             start: Callable[[], object]) -> Iterator[None]:
    """`start` runs on a thread of its own, and its first append to the record file
    `file_name` blocks in the disk until the block exits: inside, that append is under way
    (its journal's lock held, as across a slow write or fdatasync)."""
    real_append = RecordFile.append
    in_append, go_on = threading.Event(), threading.Event()

    def stuck(self: RecordFile, data: bytes, *, sync: bool) -> None:
        if self.path.name == file_name and not go_on.is_set():
            in_append.set()
            assert go_on.wait(10)
        real_append(self, data, sync=sync)

    monkeypatch.setattr(RecordFile, "append", stuck)
    thread = threading.Thread(target=start)
    thread.start()
    try:
        assert in_append.wait(10)
        yield
    finally:
        go_on.set()
        thread.join(10)


class MemmoveGather:
    """The gather kernel's addressed copies, checking the batch's contract first: no
    destination repeats and no copy reads bytes another one writes.  Then the engine's own
    kernel runs them where it has one (`inner`: device addresses cannot be memmoved), or
    memmoves run them in reverse order (a kernel's thread blocks keep none)."""

    def __init__(self, inner: Any = None) -> None:
        self.batches = 0
        self._inner = inner

    def copy_addressed(self, pairs: list[tuple[int, int]], page_nbytes: int) -> None:
        destinations = [dst for _src, dst in pairs]
        assert len(set(destinations)) == len(destinations)
        for src, _dst in pairs:
            assert all(not (dst < src + page_nbytes and src < dst + page_nbytes)
                       for dst in destinations), "a copy reads a page the batch writes"
        if self._inner is not None:
            self._inner.copy_addressed(pairs, page_nbytes)
        else:
            for src, dst in reversed(pairs):
                ctypes.memmove(dst, src, page_nbytes)
        self.batches += 1
