"""A byte-level executor for statekv.engine_tiers: engine pages, host pages and disk slots as
Python dicts of content, with disk reads and writes held until a test lands them.

Content of a block is the tuple of its tokens with the salt: what a page "holds" is exactly
what was copied into it, so a test can check that a loaded engine page holds the content of
the block the engine asked for -- the property a user cares about (never wrong KV).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from statekv import CacheConfig, KVLayout
from statekv.disk_tier import RestoredBlock
from statekv.engine_tiers import EngineTiers
from statekv.ids import BlockHash, SlotId, TransferId
from statekv.messages import (
    BatchFinished,
    Command,
    CopyEngineToHost,
    CopyHostToEngine,
    FreeSlot,
    LoadSlot,
    LoadSlots,
    PersistRetention,
    SlotRead,
    SlotReadFailed,
    SlotWriteFailed,
    SlotWritten,
    WriteSlot,
    WriteSlots,
)
from statekv.trace import TraceSink

Content = tuple[object, ...]


def engine_config(**overrides: object) -> CacheConfig:
    fields: dict[str, object] = {
        "block_size": 4, "gpu_blocks": 64, "host_blocks": 4, "reserved_host_blocks": 1,
        "disk_blocks": 6, "model_fingerprint": "engine-test",
        "layout": KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32"),
    }
    fields.update(overrides)
    return CacheConfig(**fields)  # type: ignore[arg-type]


@attrs.define
class SlotImage:
    """What a slot holds on the simulated disk (what a restart's index rebuild finds)."""

    key: BlockHash
    parent: BlockHash
    depth: int
    expiry: float | None
    written_at: float
    sequence: int
    content: Content
    forgotten: bool = False
    """A FreeSlot named it: the bytes stay (reads in flight still get them), but a restart
    does not restore it."""


class EngineHarness:
    """EngineTiers plus the memory its commands move bytes between."""

    def __init__(self, config: CacheConfig | None = None, *, now: float = 1000.0,
                 trace: TraceSink | None = None, write_through: str = "none") -> None:
        self.config = config or engine_config()
        self.write_through = write_through
        self.tiers = EngineTiers(self.config, trace=trace, write_through=write_through)
        self.bs = self.config.block_size
        self.now = now
        self.engine: dict[int, Content] = {}
        self.host: dict[int, Content] = {}
        self.disk: dict[int, SlotImage] = {}
        self.writes: list[tuple[WriteSlot, Content]] = []
        self.loads: list[LoadSlot] = []
        self.seq = 0

    # ------------------------------------------------------------------ the engine's side

    def compute(self, tokens: Sequence[int], pages: Sequence[int], salt: str | None = None,
                upto: int | None = None) -> None:
        """The engine computes the blocks of `tokens` into `pages` (content = tokens)."""
        full = len(tokens) // self.bs if upto is None else upto
        for i in range(full):
            self.engine[pages[i]] = self.content(tokens, i, salt)

    def content(self, tokens: Sequence[int], i: int, salt: str | None = None) -> Content:
        return (salt, *tokens[: (i + 1) * self.bs])

    def save(self, tokens: Sequence[int], pages: Sequence[int], *, ttl: float | None = None,
             salt: str | None = None) -> None:
        self.tiers.save(tokens, engine_pages=pages, now=self.now, ttl_seconds=ttl,
                        cache_salt=salt)
        self.run()

    def load(self, rid: str, tokens: Sequence[int], start: int, pages: Sequence[int],
             salt: str | None = None) -> tuple[int, ...]:
        """Load what lookup offers from block `start` into `pages`; returns the transfers."""
        plan = self.tiers.start_load(rid, tokens, start_block=start, engine_pages=pages,
                                     now=self.now, cache_salt=salt)
        self.run()
        return plan.transfers

    # ------------------------------------------------------------------ executing commands

    def run(self) -> None:
        for cmd in self.tiers.take_commands():
            self.execute(cmd)

    def execute(self, cmd: Command) -> None:
        if isinstance(cmd, CopyEngineToHost):
            self.host[cmd.host_page] = self.engine[cmd.engine_page]
        elif isinstance(cmd, CopyHostToEngine):
            self.engine[cmd.engine_page] = self.host[cmd.host_page]
        elif isinstance(cmd, WriteSlots):
            # The writer reads the page when it runs; it is the spill's until it lands.
            self.writes.extend((w, self.host[w.host_page]) for w in cmd.writes)
        elif isinstance(cmd, LoadSlots):
            self.loads.extend(cmd.reads)
        elif isinstance(cmd, FreeSlot):
            image = self.disk.get(cmd.slot)
            if image is not None:
                image.forgotten = True
        elif isinstance(cmd, PersistRetention):
            image = self.disk.get(cmd.slot)
            if image is not None and image.key == cmd.key:
                image.expiry = cmd.expiry
        else:  # pragma: no cover - the engine tiers emit nothing else
            raise AssertionError(f"unexpected command {cmd!r}")

    def land_write(self, index: int = 0, *, ok: bool = True) -> None:
        write, content = self.writes.pop(index)
        if ok:
            self.seq += 1
            assert write.parent is not None
            self.disk[write.slot] = SlotImage(
                key=write.key, parent=write.parent, depth=write.depth, expiry=write.expiry,
                written_at=write.issued_at, sequence=self.seq, content=content)
            event: SlotWritten | SlotWriteFailed = SlotWritten(transfer=write.transfer)
        else:
            event = SlotWriteFailed(transfer=write.transfer, cause="injected")
        self.tiers.handle(BatchFinished(outcomes=(event,)), now=self.now)
        self.run()

    def land_load(self, index: int = 0, *, ok: bool = True) -> LoadSlot:
        load = self.loads.pop(index)
        image = self.disk.get(load.slot)
        if ok and image is not None and image.key == load.key:
            self.engine[load.engine_page] = image.content
            event: SlotRead | SlotReadFailed = SlotRead(transfer=load.transfer)
        else:
            event = SlotReadFailed(transfer=load.transfer, cause="injected")
        self.tiers.handle(event, now=self.now)
        self.run()
        return load

    def drain(self) -> None:
        while self.writes or self.loads:
            if self.writes:
                self.land_write()
            if self.loads:
                self.land_load()

    def transfers_in_flight(self) -> set[TransferId]:
        return {w.transfer for w, _ in self.writes} | {r.transfer for r in self.loads}

    # ------------------------------------------------------------------ a restart

    def restart(self, *, later: float = 0.0) -> None:
        """A new process on the same disk: writes in flight are lost, the rest restored."""
        self.writes.clear()
        self.loads.clear()
        self.host.clear()
        self.now += later
        self.tiers = EngineTiers(self.config, write_through=self.write_through)
        # As the store's index rebuild does (io_actors.storage.posix_open): one slot per key,
        # the newer write.  Two can hold one key: a slot whose content was displaced by a
        # write that the restart lost still holds its old header, and that content may have
        # been written again elsewhere meanwhile.
        newest: dict[BlockHash, tuple[int, SlotImage]] = {}
        for slot, img in sorted(self.disk.items()):
            if img.forgotten:
                continue
            kept = newest.get(img.key)
            if kept is None or (kept[1].written_at, kept[1].sequence) < (img.written_at,
                                                                          img.sequence):
                newest[img.key] = (slot, img)
        self.tiers.restore(
            [RestoredBlock(key=img.key, parent_key=img.parent, slot=SlotId(slot),
                           depth=img.depth, reuse_count=0, expiry=img.expiry,
                           written_at=img.written_at, sequence=img.sequence)
             for slot, img in sorted(newest.values(), key=lambda kept: kept[0])],
            now=self.now,
        )
        self.run()
