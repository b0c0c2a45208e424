"""The remote writer actor: publishes blocks to the shared tier without blocking serving.

* :meth:`RemotePublisher.offer` is synchronous and never waits: it decides, copies the host
  page and queues, or refuses with a typed :class:`Offer` (counted).  The scheduler calls it
  for each ``PublishBlock`` the core emits, at its place in the command order.
* What to publish is decided by the core, with the cache's spill-mode policy (every block,
  retained content only, or content reused at least ``spill_min_reuse`` times): a
  ``PublishBlock`` is an admitted block.  Here the config's pressure policy sheds
  best-effort content while ``write_queue_depth`` publishes wait (``drop_on_pressure``);
  anything past twice that depth is refused, retained content too: a publish never blocks
  the loop.
* A retained block's time to live (its deadline minus now) becomes the Redis key's expiry;
  a block whose deadline has passed is not published.
* :meth:`RemotePublisher.run` drains the queue in batches of ``max_batch_blocks`` through
  ``publish_many`` on a worker thread (one cluster pipeline per batch) and counts what
  landed.  A publish that fails is dropped (counted): the shared tier is a cache, and the
  block stays wherever it is locally.

The page is copied at offer time.  The host page belongs to the local tiers, which may reuse
it as soon as the loop goes on; the copy is one block of memcpy on the serving thread.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
from collections import Counter
from collections.abc import Callable

import attrs
import torch
import trio

from io_actors.storage.redis_store import RemoteIO, SharedStore
from io_actors.storage.slot_format import SlotMeta
from statekv.config import CacheConfig
from statekv.errors import ConfigError, UsageError
from statekv.ids import BlockHash
from statekv.messages import PublishBlock
from statekv.policies import PressurePolicy, QueueOnPressure, ShedBestEffortOnPressure

log = logging.getLogger(__name__)
_U32 = 2**32 - 1

class Offer(enum.Enum):
    """What :meth:`RemotePublisher.offer` did with a block."""

    QUEUED = "queued"
    SHED = "shed"
    """Best-effort content shed because the queue is under pressure (drop_on_pressure)."""
    FULL = "full"
    """The queue is at its hard bound: refused rather than block the serving loop."""


@attrs.frozen
class _Job:
    key: bytes
    payload: torch.Tensor
    meta: SlotMeta
    ttl_s: float | None


@attrs.frozen(kw_only=True)
class PublisherStatistics:
    offers: dict[str, int]
    """Offer value -> count."""
    published: int
    failed: int
    queued: int
    """Publishes waiting now."""


class RemotePublisher:
    """Bounded, never-blocking publishing of blocks to a shared remote store."""

    def __init__(self, store: SharedStore, config: CacheConfig, *,
                 queue_depth: int | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise ConfigError("config", f"must be a CacheConfig, got {config!r}")
        depth = config.write_queue_depth if queue_depth is None else queue_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError("queue_depth", f"must be an integer >= 1, got {depth!r}")
        self._store = store
        self._config = config
        # The publisher's own depth is what sheds: with the pool's write_queue_depth instead
        # (the spill path's), a remote_queue_depth below it let the queue reach its hard
        # bound -- refusing retained content -- before any best-effort offer was shed.
        self._pressure: PressurePolicy = (ShedBestEffortOnPressure(depth)
                                          if config.drop_on_pressure else QueueOnPressure())
        self._depth = depth
        self._bound = 2 * depth
        self._batch = config.max_batch_blocks
        # Offers come from the serving thread (inside a cache call), the drain runs on the
        # trio thread: a deque and a lock between them, and a wake-up through the trio token.
        self._queue: collections.deque[_Job] = collections.deque()
        self._lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._wakeup = trio.Event()
        self._closed = False
        self._waiting = 0
        self._offers: Counter[Offer] = Counter()
        self._published = 0
        self._failed = 0
        self._sequence = 0

    def offer(self, block: PublishBlock, page: torch.Tensor | Callable[[], torch.Tensor],
              now: float, wall_now: float) -> Offer:
        """Queue `block` (its bytes are `page`, one host page, or what calling `page`
        returns: called only when the block is queued) for publishing, or say why not.

        Any thread.  `now` is the cache's clock (the one `block.expiry` is on); `wall_now` is
        wall-clock seconds for the header's `written_at`.  Never blocks on the network.
        """
        if not isinstance(block, PublishBlock):
            raise UsageError("block", f"must be a PublishBlock, got {block!r:.80}")
        # A deadline that passed by now leaves best-effort content: no expiry.
        ttl = block.expiry - now if block.expiry is not None and block.expiry > now else None
        with self._lock:
            if self._closed:
                raise UsageError("publisher", "the publisher is closed")
            outcome = self._decide(ttl is not None)
            self._offers[outcome] += 1
            if outcome is not Offer.QUEUED:
                return outcome
            self._sequence += 1
            meta = SlotMeta(
                parent=block.parent, depth=block.depth,
                reuse_count=min(block.reuse_count, _U32),
                expiry=None, written_at=wall_now, sequence=self._sequence,
            )
            data = page() if callable(page) else page
            # The shared tier's deadline is Redis's key expiry; the header's expiry (the
            # local clock of one process) would mean nothing to another replica.
            self._queue.append(_Job(bytes(block.key), data.clone(), meta, ttl))
            self._waiting += 1
        self._wake()
        return outcome

    def _wake(self) -> None:
        token = self._token
        if token is not None:
            token.run_sync_soon(self._wakeup.set)

    def _decide(self, retained: bool) -> Offer:
        if self._pressure.sheds(retained, self._waiting):
            return Offer.SHED
        if self._waiting >= self._bound:
            return Offer.FULL
        return Offer.QUEUED

    async def run(self) -> None:
        """Drain the queue until :meth:`close`; run it in the actor's nursery."""
        self._token = trio.lowlevel.current_trio_token()
        while True:
            with self._lock:
                jobs = [self._queue.popleft()
                        for _ in range(min(self._batch, len(self._queue)))]
                closed = self._closed
                if not jobs and not closed:
                    self._wakeup = trio.Event()
                    wakeup = self._wakeup
            if jobs:
                await self._publish(jobs)
                continue
            if closed:
                return
            await wakeup.wait()

    async def _publish(self, jobs: list[_Job]) -> None:
        items = [RemoteIO(BlockHash(j.key), j.payload, j.meta, j.ttl_s) for j in jobs]
        outcomes = await trio.to_thread.run_sync(self._store.publish_many, items)
        with self._lock:
            self._waiting -= len(jobs)
            for job, failure in zip(jobs, outcomes, strict=True):
                if failure is None:
                    self._published += 1
                else:
                    self._failed += 1
                    log.warning("publish of block %s failed: %s", job.key.hex()[:16], failure)

    def close(self) -> None:
        """No more offers; :meth:`run` returns once the queue is drained."""
        with self._lock:
            self._closed = True
        self._wake()

    def discard_queued(self) -> int:
        """Drop the publishes not started (closing without draining); returns how many."""
        with self._lock:
            dropped = len(self._queue)
            self._queue.clear()
            self._waiting -= dropped
        return dropped

    def statistics(self) -> PublisherStatistics:
        with self._lock:
            return self._statistics_locked()

    def _statistics_locked(self) -> PublisherStatistics:
        return PublisherStatistics(
            offers={o.value: self._offers[o] for o in Offer}, published=self._published,
            failed=self._failed, queued=self._waiting,
        )
