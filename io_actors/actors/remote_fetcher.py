"""The remote reader actor: looks prefixes up in the shared tier and fetches blocks from it.

Inside a cache (io_actors.actors.scheduler), for each request the local tiers did not fully serve:

1. lookup (:meth:`RemoteFetcher.lookup`): how many leading blocks of the keys the core named
   (``KVCacheManager.remote_candidates``) the cluster holds now (one pipelined EXISTS per
   block).  Those keys go to ``add_request(remote_keys=...)``; the core decides whether to
   fetch them (its cost estimates, which this actor feeds with each batch's rate).
2. fetch (:meth:`RemoteFetcher.fetch`): a ``FetchBlocks`` batch on a worker thread, one
   ``fetch_many`` (a pipeline per master) into staging buffers, every value verified before
   a byte reaches its page; then, after the copy-stream fence taken at dispatch, the
   verified blocks are copied into their GPU pages.  One ``SlotRead`` or ``SlotReadFailed``
   per block: a block that was looked up but is gone at fetch time (evicted by Redis,
   expired, its master dead) fails cleanly, and the core never serves it.

:meth:`RemoteFetcher.onboard` does both for a caller that owns its pages outright (no core,
no cost decision): it serves the leading run of blocks that landed, since a prefix is only
useful whole.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import attrs
import torch
import trio

from io_actors.storage.interfaces import Fence
from io_actors.storage.redis_store import (
    FetchStatus,
    RemoteFetchFailed,
    RemoteIO,
    SharedStore,
)
from statekv.config import CacheConfig
from statekv.errors import ConfigError, UsageError
from statekv.ids import BlockHash, PageId
from statekv.messages import BatchFinished, FetchBlock, SlotRead, SlotReadFailed, TransferOutcome


@attrs.frozen(kw_only=True)
class Onboarded:
    """The result of one onboard."""

    matched: int
    """Leading blocks the cluster held at match time."""
    served: int
    """Leading blocks fetched and verified into their pages (<= matched)."""
    fetched: bool
    """Whether a fetch was issued (False: nothing matched)."""
    failure: FetchStatus | None = None
    """Why the block after the served ones failed, when one did."""


@attrs.frozen(kw_only=True)
class Fetched:
    """One FetchBlocks batch done: the completion for the core, and what it measured."""

    completion: BatchFinished
    landed_bytes: int
    seconds: float


class RemoteFetcher:
    """Lookups and verified fetches from a shared store."""

    def __init__(self, store: SharedStore, config: CacheConfig, *,
                 lookup_timeout_s: float | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise ConfigError("config", f"must be a CacheConfig, got {config!r}")
        if lookup_timeout_s is not None and not (
                isinstance(lookup_timeout_s, int | float) and not isinstance(lookup_timeout_s, bool)
                and 0 < lookup_timeout_s < float("inf")):
            raise ConfigError("lookup_timeout_s", f"must be a number > 0 or None, got "
                              f"{lookup_timeout_s!r}")
        self._store = store
        self._config = config
        self._counts: Counter[str] = Counter()
        # Lookups run on the serving thread, fetches on worker threads.
        self._lock = threading.Lock()
        self._lookup_timeout_s = lookup_timeout_s
        # With a bound, the lookup runs on this thread and the caller waits at most the bound:
        # a master that is stopped (not dead) answers nothing, and each of the client's
        # attempts waits out its own socket timeout, well past the bound the caller was given.
        self._lookup_thread: ThreadPoolExecutor | None = None

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def lookup(self, keys: Sequence[BlockHash]) -> tuple[BlockHash, ...]:
        """The leading keys the cluster holds now (blocking: one pipelined round trip, at
        most the store's timeout per master).  A hint: a key may be gone by fetch time."""
        self._count("lookups")
        if not keys:
            return ()
        if self._lookup_timeout_s is None:
            found = self._store.match_prefix(list(keys))
        else:
            if self._lookup_thread is None:
                self._lookup_thread = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="statekv-remote-lookup")
            future = self._lookup_thread.submit(self._store.match_prefix, list(keys))
            try:
                found = future.result(timeout=self._lookup_timeout_s)
            except TimeoutError:
                # A hint not worth waiting for: the request computes what it would have
                # fetched.  A lookup stuck on the thread delays the next ones, which time
                # out in turn (each caller waits the bound, never more).
                future.cancel()
                self._count("lookup_timeouts")
                return ()
        self._count("lookup_blocks_found", found)
        return tuple(keys[:found])

    def close(self) -> None:
        """Let go of the lookup thread (a lookup still running ends with its socket
        timeout)."""
        if self._lookup_thread is not None:
            self._lookup_thread.shutdown(wait=False, cancel_futures=True)

    def fetch(
        self,
        reads: Sequence[FetchBlock],
        page: Callable[[PageId], torch.Tensor],
        fence: Fence | None,
    ) -> Fetched:
        """Fetch a batch into its pages (blocking; a worker thread).  Every value is verified
        into a staging buffer first; the verified ones are copied into their pages after
        `fence` (the pages may have just been emptied by an eviction's copy)."""
        if not reads:
            raise UsageError("reads", "a fetch batch needs at least one block")
        pages = [page(cmd.gpu_page) for cmd in reads]
        staging = [torch.empty(p.shape, dtype=p.dtype, device="cpu") for p in pages]
        started = time.perf_counter()
        results = self._store.fetch_many(
            [RemoteIO(cmd.key, buf) for cmd, buf in zip(reads, staging, strict=True)]
        )
        seconds = time.perf_counter() - started
        if fence is not None:
            fence.wait()
        outcomes: list[TransferOutcome] = []
        landed = 0
        for cmd, dst, buf, failure in zip(reads, pages, staging, results, strict=True):
            if failure is None:
                dst.copy_(buf)
                landed += buf.numel() * buf.element_size()
                outcomes.append(SlotRead(transfer=cmd.transfer))
                self._count("blocks_fetched")
            else:
                status = (failure.status if isinstance(failure, RemoteFetchFailed)
                          else FetchStatus.UNAVAILABLE)
                self._count(f"failed_{status.value}")
                outcomes.append(SlotReadFailed(transfer=cmd.transfer, cause=str(failure)))
        if pages and pages[0].device.type == "cuda":
            # Reported landed only once the bytes are on the device.
            torch.cuda.current_stream(pages[0].device).synchronize()
        return Fetched(completion=BatchFinished(outcomes=tuple(outcomes)), landed_bytes=landed,
                       seconds=seconds)

    async def onboard(self, keys: Sequence[BlockHash], pages: Sequence[torch.Tensor],
                      ) -> Onboarded:
        """Fill ``pages[i]`` with block ``keys[i]`` for the leading blocks the tier serves."""
        if len(keys) != len(pages):
            raise UsageError("pages", f"one page per key: {len(keys)} keys, {len(pages)} pages")
        self._count("onboards")
        if not keys:
            return Onboarded(matched=0, served=0, fetched=False)
        matched = len(await trio.to_thread.run_sync(self.lookup, list(keys)))
        if matched == 0:
            self._count("misses")
            return Onboarded(matched=0, served=0, fetched=False)
        items = [RemoteIO(k, p) for k, p in zip(keys[:matched], pages[:matched], strict=True)]
        outcomes = await trio.to_thread.run_sync(self._store.fetch_many, items)
        served = 0
        failure: FetchStatus | None = None
        for outcome in outcomes:
            if outcome is not None:
                failure = (outcome.status if isinstance(outcome, RemoteFetchFailed)
                           else FetchStatus.UNAVAILABLE)
                break
            served += 1
        self._count("blocks_served", served)
        if failure is not None:
            self._count(f"cut_by_{failure.value}")
        return Onboarded(matched=matched, served=served, fetched=True, failure=failure)

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
