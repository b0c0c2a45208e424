"""The remote reader actor: onboards a prefix from the shared tier into host pages.

One :meth:`RemoteFetcher.onboard` call, for the blocks of a request that the local tiers
missed:

1. match: how many leading blocks the cluster holds now (one pipelined EXISTS per block);
2. cost: fetch only when :class:`statekv.policies.FetchCost` says moving their bytes beats
   recomputing their tokens;
3. fetch: one ``fetch_many`` (a pipeline per master) on a worker thread, every value
   verified before a byte reaches its page.

What is served is the leading run of blocks that landed: a prefix is only useful whole, so
the blocks after the first failure are not served either, and the request recomputes from
there.  A block that was matched but is gone at fetch time (evicted by Redis, expired, its
master dead) is such a failure: a clean miss.  The destination pages are the caller's for
the whole call, and a failed block's page is never written (the store verifies first).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs
import torch
import trio

from io_actors.backends.redis_store import (
    FetchStatus,
    RemoteFetchFailed,
    RemoteIO,
    SharedStore,
)
from statekv.config import CacheConfig
from statekv.errors import ConfigError, UsageError
from statekv.ids import BlockHash
from statekv.policies import FetchCost


@attrs.frozen(kw_only=True)
class Onboarded:
    """The result of one onboard."""

    matched: int
    """Leading blocks the cluster held at match time."""
    served: int
    """Leading blocks fetched and verified into their pages (<= matched)."""
    fetched: bool
    """Whether a fetch was issued (False: nothing matched, or recompute was cheaper)."""
    failure: FetchStatus | None = None
    """Why the block after the served ones failed, when one did."""


class RemoteFetcher:
    """Prefix onboarding from a shared store, with the fetch-or-recompute decision."""

    def __init__(self, store: SharedStore, config: CacheConfig, cost: FetchCost) -> None:
        if not isinstance(config, CacheConfig):
            raise ConfigError("config", f"must be a CacheConfig, got {config!r}")
        if not isinstance(cost, FetchCost):
            raise ConfigError("cost", f"must be a FetchCost, got {cost!r}")
        self._store = store
        self._config = config
        self._cost = cost
        self._counts: Counter[str] = Counter()

    async def onboard(self, keys: Sequence[BlockHash], pages: Sequence[torch.Tensor],
                      ) -> Onboarded:
        """Fill ``pages[i]`` with block ``keys[i]`` for the leading blocks the tier serves."""
        if len(keys) != len(pages):
            raise UsageError("pages", f"one page per key: {len(keys)} keys, {len(pages)} pages")
        self._counts["onboards"] += 1
        if not keys:
            return Onboarded(matched=0, served=0, fetched=False)
        matched = await trio.to_thread.run_sync(self._store.match_prefix, list(keys))
        if matched == 0:
            self._counts["misses"] += 1
            return Onboarded(matched=0, served=0, fetched=False)
        if not self._cost.fetch_beats_recompute(matched, self._config.block_bytes,
                                                self._config.block_size):
            self._counts["recompute_cheaper"] += 1
            return Onboarded(matched=matched, served=0, fetched=False)
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
        self._counts["blocks_served"] += served
        if failure is not None:
            self._counts[f"cut_by_{failure.value}"] += 1
        return Onboarded(matched=matched, served=served, fetched=True, failure=failure)

    def statistics(self) -> dict[str, int]:
        return dict(self._counts)
