"""The remote writer actor: publishes blocks to the shared tier without blocking serving.

* :meth:`RemotePublisher.offer` is synchronous and never waits: it decides, copies the host
  page and queues, or refuses with a typed :class:`Offer` (counted).  The serving loop calls
  it with the block record a host eviction or a commit hands it.
* What to publish is the cache's spill-mode policy (statekv.policies.SpillPolicy built from
  the same CacheConfig): every block, retained content only, or content reused at least
  ``spill_min_reuse`` times.  The same config's pressure policy sheds best-effort content
  while ``write_queue_depth`` publishes wait (``drop_on_pressure``); anything past twice
  that depth is refused, retained content too: a publish never blocks the loop.
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

import enum
import logging
import math
from collections import Counter

import attrs
import torch
import trio

from io_actors.backends.redis_store import RemoteIO, SharedStore
from io_actors.slot_format import SlotMeta
from statekv.block import Block
from statekv.config import CacheConfig
from statekv.errors import ConfigError, UsageError
from statekv.ids import BlockHash
from statekv.policies import Policies

log = logging.getLogger(__name__)
_U32 = 2**32 - 1

class Offer(enum.Enum):
    """What :meth:`RemotePublisher.offer` did with a block."""

    QUEUED = "queued"
    NOT_ADMITTED = "not_admitted"
    """The spill-mode policy does not publish this content (or its deadline passed)."""
    SHED = "shed"
    """Best-effort content shed because the queue is under pressure (drop_on_pressure)."""
    FULL = "full"
    """The queue is at its hard bound: refused rather than block the serving loop."""
    UNKEYED = "unkeyed"
    """A private block (no chained key) is never shared."""


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
        self._policies = Policies.from_config(config)
        self._depth = depth
        self._bound = 2 * depth
        self._batch = config.max_batch_blocks
        self._send, self._receive = trio.open_memory_channel[_Job](math.inf)
        self._waiting = 0
        self._offers: Counter[Offer] = Counter()
        self._published = 0
        self._failed = 0
        self._sequence = 0

    def offer(self, block: Block, page: torch.Tensor, now: float, wall_now: float) -> Offer:
        """Queue `block` (its bytes are `page`, one host page) for publishing, or say why not.

        `now` is the cache's clock (the one `block.expiry` is on); `wall_now` is wall-clock
        seconds for the header's `written_at`.  Never blocks.
        """
        if not isinstance(block, Block):
            raise UsageError("block", f"must be a Block record, got {block!r:.80}")
        outcome = self._decide(block, now)
        self._offers[outcome] += 1
        if outcome is not Offer.QUEUED:
            return outcome
        assert block.key is not None  # _decide refused unkeyed blocks
        ttl = None if block.expiry is None else block.expiry - now
        self._sequence += 1
        meta = SlotMeta(
            parent=block.parent_key if block.parent_key is not None else bytes(32),
            depth=block.depth, reuse_count=min(block.reuse_count, _U32),
            expiry=None, written_at=wall_now, sequence=self._sequence,
        )
        # The shared tier's deadline is Redis's key expiry; the header's expiry (the local
        # clock of one process) would mean nothing to another replica.
        self._send.send_nowait(_Job(bytes(block.key), page.clone(), meta, ttl))
        self._waiting += 1
        return outcome

    def _decide(self, block: Block, now: float) -> Offer:
        if block.key is None:
            return Offer.UNKEYED
        retained = block.expiry is not None
        if retained and block.expiry is not None and block.expiry <= now:
            return Offer.NOT_ADMITTED
        if not self._policies.spill.admits(block, now):
            return Offer.NOT_ADMITTED
        if self._policies.pressure.sheds(retained, self._waiting):
            return Offer.SHED
        if self._waiting >= self._bound:
            return Offer.FULL
        return Offer.QUEUED

    async def run(self) -> None:
        """Drain the queue until :meth:`close`; run it in the actor's nursery."""
        async with self._receive:
            async for first in self._receive:
                jobs = [first]
                while len(jobs) < self._batch:
                    try:
                        jobs.append(self._receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await self._publish(jobs)

    async def _publish(self, jobs: list[_Job]) -> None:
        items = [RemoteIO(BlockHash(j.key), j.payload, j.meta, j.ttl_s) for j in jobs]
        outcomes = await trio.to_thread.run_sync(self._store.publish_many, items)
        self._waiting -= len(jobs)
        for job, failure in zip(jobs, outcomes, strict=True):
            if failure is None:
                self._published += 1
            else:
                self._failed += 1
                log.warning("publish of block %s failed: %s", job.key.hex()[:16], failure)

    def close(self) -> None:
        """No more offers; :meth:`run` returns once the queue is drained."""
        self._send.close()

    def statistics(self) -> PublisherStatistics:
        return PublisherStatistics(
            offers={o.value: self._offers[o] for o in Offer}, published=self._published,
            failed=self._failed, queued=self._waiting,
        )
