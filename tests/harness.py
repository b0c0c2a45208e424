"""A test harness that plays the actors for a bare KVCacheManager.

:class:`Executor` takes the manager's commands, keeps every disk transfer in flight until a
test completes it (so a test decides *when* each read or write lands), and checks the
command-ordering contract of ``statekv.messages`` as it goes: at most one transfer per slot,
a read only of the content last written to its slot, no slot freed while a transfer on it
is in flight.  It also tracks which key each disk slot holds, so a test can tell which
content was written where.

The helpers below build small caches and serve whole requests, so that each test reads as
the story it tells.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import count
from typing import Any

import pytest

from statekv import CacheConfig, KVCacheManager
from statekv.hashing import chain_key, root_key, token_bytes
from statekv.ids import BlockHash, BlockId, SlotId, TransferId
from statekv.manager import CachedBlock, PrefetchStarted, PrefixMatch
from statekv.messages import (
    BlockCommand,
    CopyGpuToHost,
    CopyHostToGpu,
    FetchBlock,
    FetchBlocks,
    FreeSlot,
    PersistRetention,
    PrefetchSlot,
    PrefetchSlots,
    PublishBlock,
    ReadSlot,
    ReadSlots,
    SlotRead,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    WriteSlot,
    WriteSlots,
    per_block,
)
from statekv.stats import CacheStatistics

_fresh = count(1_000_000)


def config(**overrides: Any) -> CacheConfig:
    """A small cache: 2 tokens per block, 4 GPU pages, 2 host pages, 4 disk slots."""
    fields: dict[str, Any] = {
        "block_size": 2,
        "gpu_blocks": 4,
        "host_blocks": 2,
        "disk_blocks": 4,
    }
    fields.update(overrides)
    return CacheConfig(**fields)


def fresh_tokens(n: int) -> list[int]:
    """`n` token ids never used before in this process (content nothing else shares)."""
    return [next(_fresh) for _ in range(n)]


def block_keys(
    tokens: Sequence[int],
    block_size: int,
    *,
    fingerprint: str = "",
    salt: str | None = None,
    lora: int | None = None,
) -> list[BlockHash]:
    """The chained keys of the full blocks of `tokens` (what the prefix index holds)."""
    key = root_key(fingerprint, salt, lora)
    keys = []
    for i in range(len(tokens) // block_size):
        key = chain_key(key, token_bytes(tokens[i * block_size:(i + 1) * block_size]))
        keys.append(key)
    return keys


class Executor:
    """Executes a manager's commands the way the actors would, with test-chosen timing."""

    def __init__(self, cache: KVCacheManager, now: float = 0.0) -> None:
        self.cache = cache
        self.now = now
        self.writes: dict[TransferId, WriteSlot] = {}
        self.reads: dict[TransferId, ReadSlot] = {}
        self.prefetches: dict[TransferId, PrefetchSlot] = {}
        self.fetches: dict[TransferId, FetchBlock] = {}
        self.published: list[PublishBlock] = []
        """Every PublishBlock taken, in order."""
        self.log: list[BlockCommand] = []
        """Every command taken, batches opened into their per-block records."""
        self.batches: list[WriteSlots | ReadSlots | PrefetchSlots | FetchBlocks] = []
        """Every batch taken, in order."""
        self.slot_content: dict[SlotId, BlockHash] = {}
        """What each slot holds on the emulated disk (set when a write lands)."""
        self.freed: list[SlotId] = []
        self.retention: list[PersistRetention] = []
        """Every PersistRetention taken, in order."""
        self._ids = count()

    @property
    def bs(self) -> int:
        return self.cache.config.block_size

    # ------------------------------------------------------------------ commands

    def pump(self) -> list[BlockCommand]:
        """Take the manager's commands and start them, checking the ordering contract.

        Returns them with every batch opened into its per-block records.
        """
        taken = self.cache.take_commands()
        seen_batch = False
        for taken_cmd in taken:
            if isinstance(taken_cmd, WriteSlots | ReadSlots | PrefetchSlots | FetchBlocks):
                items = (taken_cmd.writes if isinstance(taken_cmd, WriteSlots)
                         else taken_cmd.reads)
                assert 1 <= len(items) <= self.cache.config.max_batch_blocks, taken_cmd
                self.batches.append(taken_cmd)
                seen_batch = True
            else:
                # Disk batches come after every copy and FreeSlot of the same take.
                assert not seen_batch, f"{taken_cmd} after a disk batch in {taken}"
        cmds = list(per_block(taken))
        busy = ({c.slot for c in self.writes.values()} | {c.slot for c in self.reads.values()}
                | {c.slot for c in self.prefetches.values()})
        cfg = self.cache.config
        bounds = {"slot": cfg.disk_blocks, "gpu_page": cfg.gpu_blocks,
                  "host_page": cfg.host_blocks + cfg.reserved_host_blocks}
        for cmd in cmds:
            # Every page and slot a command names exists: an actor would index with it.
            for field, bound in bounds.items():
                if hasattr(cmd, field):
                    value = getattr(cmd, field)
                    assert isinstance(value, int) and 0 <= value < bound, f"{cmd}: bad {field}"
            if isinstance(cmd, WriteSlot):
                assert cmd.slot not in busy, f"second transfer on slot {cmd.slot}: {cmd}"
                busy.add(cmd.slot)
                self.writes[cmd.transfer] = cmd
            elif isinstance(cmd, ReadSlot):
                assert cmd.slot not in busy, f"second transfer on slot {cmd.slot}: {cmd}"
                assert self.slot_content.get(cmd.slot) == cmd.key, (
                    f"read of slot {cmd.slot} expects other content than it holds"
                )
                busy.add(cmd.slot)
                self.reads[cmd.transfer] = cmd
            elif isinstance(cmd, PrefetchSlot):
                assert cmd.slot not in busy, f"second transfer on slot {cmd.slot}: {cmd}"
                assert self.slot_content.get(cmd.slot) == cmd.key, (
                    f"prefetch of slot {cmd.slot} expects other content than it holds"
                )
                busy.add(cmd.slot)
                self.prefetches[cmd.transfer] = cmd
            elif isinstance(cmd, FreeSlot):
                assert cmd.slot not in busy, f"slot {cmd.slot} freed with a transfer in flight"
                self.slot_content.pop(cmd.slot, None)
                self.freed.append(cmd.slot)
            elif isinstance(cmd, PersistRetention):
                self.retention.append(cmd)
            elif isinstance(cmd, FetchBlock):
                self.fetches[cmd.transfer] = cmd
            elif isinstance(cmd, PublishBlock):
                self.published.append(cmd)
            else:
                assert isinstance(cmd, CopyGpuToHost | CopyHostToGpu)
        self.log.extend(cmds)
        return cmds

    def land_write(self, tid: TransferId | None = None, *, ok: bool = True) -> WriteSlot:
        """Complete one write (the oldest when `tid` is None)."""
        if tid is None:
            tid = next(iter(self.writes))
        cmd = self.writes.pop(tid)
        if ok:
            self.slot_content[cmd.slot] = cmd.key
            self.cache.handle(SlotWritten(transfer=tid), now=self.now)
        else:
            self.slot_content.pop(cmd.slot, None)
            self.cache.handle(SlotWriteFailed(transfer=tid, cause="EIO"), now=self.now)
        self.pump()
        self.cache.check_invariants()
        return cmd

    def land_read(self, tid: TransferId | None = None, *, ok: bool = True) -> ReadSlot:
        """Complete one read (the oldest when `tid` is None)."""
        if tid is None:
            tid = next(iter(self.reads))
        cmd = self.reads.pop(tid)
        if ok:
            self.cache.handle(SlotRead(transfer=tid), now=self.now)
        else:
            self.cache.handle(SlotReadFailed(transfer=tid, cause="short read"), now=self.now)
        self.pump()
        self.cache.check_invariants()
        return cmd

    def land_prefetch(self, tid: TransferId | None = None, *, ok: bool = True) -> PrefetchSlot:
        """Complete one prefetch read (the oldest when `tid` is None)."""
        if tid is None:
            tid = next(iter(self.prefetches))
        cmd = self.prefetches.pop(tid)
        if ok:
            self.cache.handle(SlotRead(transfer=tid), now=self.now)
        else:
            self.cache.handle(SlotReadFailed(transfer=tid, cause="short read"), now=self.now)
        self.pump()
        self.cache.check_invariants()
        return cmd

    def land_fetch(self, tid: TransferId | None = None, *, ok: bool = True) -> FetchBlock:
        """Complete one shared-tier fetch (the oldest when `tid` is None)."""
        if tid is None:
            tid = next(iter(self.fetches))
        cmd = self.fetches.pop(tid)
        if ok:
            self.cache.handle(SlotRead(transfer=tid), now=self.now)
        else:
            self.cache.handle(SlotReadFailed(transfer=tid, cause="missing"), now=self.now)
        self.pump()
        self.cache.check_invariants()
        return cmd

    def drain(self) -> None:
        """Land every transfer in flight (writes first, oldest first)."""
        while self.writes or self.reads or self.prefetches or self.fetches:
            if self.writes:
                self.land_write()
            elif self.reads:
                self.land_read()
            elif self.prefetches:
                self.land_prefetch()
            else:
                self.land_fetch()

    def tick(self, dt: float) -> None:
        """Advance the clock by `dt` and tell the cache."""
        self.now += dt
        self.cache.advance(self.now)
        self.pump()
        self.cache.check_invariants()

    # ------------------------------------------------------------------ requests

    def add(
        self,
        rid: str,
        tokens: Sequence[int],
        *,
        ttl: float | None = None,
        priority: int = 0,
        salt: str | None = None,
        lora: int | None = None,
        remote: Collection[BlockHash] = (),
    ) -> PrefixMatch:
        match = self.cache.add_request(
            rid, tokens, now=self.now, ttl_seconds=ttl, priority=priority, cache_salt=salt,
            lora_id=lora, remote_keys=remote,
        )
        self.pump()
        self.cache.check_invariants()
        return match

    def prefetch(self, rid: str, tokens: Sequence[int]) -> PrefetchStarted:
        started = self.cache.prefetch(rid, tokens, now=self.now)
        self.pump()
        self.cache.check_invariants()
        return started

    def compute(self, rid: str, num_tokens: int | None = None) -> None:
        """Allocate pages for the request's tokens and commit them (a forward pass)."""
        n = self.cache.request_status(rid).num_tokens if num_tokens is None else num_tokens
        self.cache.allocate_nowait(rid, n, now=self.now)
        self.pump()
        self.cache.commit(rid, n, now=self.now)
        self.pump()
        self.cache.check_invariants()

    def release(self, rid: str) -> None:
        self.cache.release(rid, now=self.now)
        self.pump()
        self.cache.check_invariants()

    def serve(
        self,
        rid: str,
        tokens: Sequence[int],
        *,
        ttl: float | None = None,
        priority: int = 0,
        salt: str | None = None,
        lora: int | None = None,
    ) -> PrefixMatch:
        """One whole request: add it, wait for its reads, compute, commit, release."""
        match = self.add(rid, tokens, ttl=ttl, priority=priority, salt=salt, lora=lora)
        while not self.cache.is_ready(rid):
            if self.reads:
                self.land_read()
            elif self.fetches:
                self.land_fetch()
            else:
                self.land_prefetch()  # a prefetch the request took over as its onboard
        self.compute(rid)
        self.release(rid)
        return match

    def churn(self, rid: str, num_blocks: int | None = None) -> None:
        """A request of never-seen tokens that takes `num_blocks` GPU pages (every page that
        can be had, by default) and is released uncommitted: it evicts cached GPU content
        and caches nothing."""
        if num_blocks is None:
            stats = self.stats()
            num_blocks = stats.gpu_free_pages + stats.gpu_evictable_blocks
        n = num_blocks
        assert n >= 1
        self.add(rid, fresh_tokens(n * self.bs))
        self.cache.allocate_nowait(rid, n * self.bs, now=self.now)
        self.pump()
        self.cache.check_invariants()
        self.release(rid)

    def rid(self, prefix: str = "r") -> str:
        """A request id never used before by this executor."""
        return f"{prefix}{next(self._ids)}"

    def spill(
        self, prompts: Sequence[Sequence[int]], *, ttl: float | None = None, land: bool = True
    ) -> list[WriteSlot]:
        """Serve `prompts`, then push their full blocks through the host tier to disk together.

        Needs a cache without a host reserve whose host tier holds exactly the prompts' full
        blocks, and whose GPU holds them plus two more pages: a one-block filler request is
        served last, and evicting it from the full host tier spills every host block (the
        filler itself finds no host page and is dropped).  Returns the writes issued, landed
        in issue order when `land`.
        """
        cfg = self.cache.config
        assert cfg.reserved_host_blocks == 0, "spill() needs a cache without a host reserve"
        full = sum(len(p) // self.bs for p in prompts)
        assert full == cfg.host_blocks, "the host tier must hold exactly the spilled blocks"
        before = self.stats()
        assert before.host_cached_blocks == 0 and before.gpu_evictable_blocks == 0
        for tokens in prompts:
            self.serve(self.rid("spill"), tokens, ttl=ttl)
        self.serve(self.rid("filler"), fresh_tokens(self.bs + 1))
        start = len(self.log)
        self.churn(self.rid("churn"))
        writes = [c for c in self.log[start:] if isinstance(c, WriteSlot)]
        if land:
            for write in writes:
                self.land_write(write.transfer)
        return writes

    # ------------------------------------------------------------------ observation

    def cached(self) -> dict[BlockHash, CachedBlock]:
        return {b.key: b for b in self.cache.cached_blocks()}

    def tiers(self, tokens: Sequence[int], **key_args: Any) -> list[str | None]:
        """The state name of each full block of `tokens` in the index (None: not cached)."""
        cached = self.cached()
        out: list[str | None] = []
        for key in block_keys(tokens, self.bs, **key_args):
            block = cached.get(key)
            out.append(None if block is None else block.state.name)
        return out

    def stats(self) -> CacheStatistics:
        return self.cache.statistics()

    def written_block(self, key: BlockHash) -> BlockId:
        """The block id of the last WriteSlot issued for `key`."""
        for cmd in reversed(self.log):
            if isinstance(cmd, WriteSlot) and cmd.key == key:
                return cmd.block
        raise AssertionError("no write was issued for that key")


def make(**overrides: Any) -> Executor:
    """A manager built from :func:`config` with `overrides`, and its executor."""
    return Executor(KVCacheManager(config(**overrides)))


def count_encodings(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Every prompt the core encodes from now on (``statekv.requests.token_bytes``), in
    order: how a test sees that a prompt was checked, encoded and keyed once."""
    from statekv import requests

    encoded: list[tuple[int, ...]] = []

    def counting(tokens: Sequence[int]) -> bytes:
        encoded.append(tuple(tokens))
        return token_bytes(tokens)

    monkeypatch.setattr(requests, "token_bytes", counting)
    return encoded
