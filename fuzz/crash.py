"""Crash consistency of the persistent disk tier (specs/disk_persistence.md), two ways.

* :func:`enumerate_crashes` -- SQLite style: a scripted spill-heavy workload runs once through
  a counting :class:`~io_actors.storage.faults.FaultyStore` to learn its number of write
  calls N; then, for every k in 1..N, it runs again and "crashes" at the k-th write (a seeded
  subset of that write's pages reaches the disk, nothing after it does).  Each time the
  directory is reopened and checked.
* :func:`kill_loop` -- real kill -9: a child process serves a spill-heavy workload on one
  directory, reopening what the previous child left, and is killed at random moments (also
  while it opens and rebuilds its index); after each kill the directory is reopened and
  checked.  The child logs every slot write it starts and every one that returned, so the
  check knows which blocks had landed.

The check (:func:`check_directory`): every slot the index rebuild restores is read back
through the store, and every read that succeeds must return exactly the bytes computed for
its key (the KV of a block is a function of its tokens: :func:`block_bytes`); a read that
fails is a torn slot found, never served.  Then a cache opened on the directory serves every
prompt and compares every page it is handed.  Wrong bytes anywhere is a failure; so is a
block whose write returned before the crash and that the rebuild did not find (kill -9
leaves the page cache intact, so the durability policy explains no loss here; only a power
loss could, which these tests do not simulate).
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import attrs
import torch

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache, CacheAPI
from io_actors.storage.buffers import page_aligned_buffer
from io_actors.storage.faults import Fault, FaultPlan, FaultRule, FaultyStore, Op
from io_actors.storage.index_journal import INDEX_FILE
from io_actors.storage.interfaces import BatchOutcome, RetentionStore, SlotIO, SlotStore
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.posix_open import Recovery
from io_actors.storage.retention_journal import RetentionRecord
from io_actors.storage.slot_format import SlotMeta
from statekv.config import KVLayout
from statekv.errors import OutOfBlocks, TransferFailed
from statekv.hashing import chain_key, root_key, token_bytes
from statekv.ids import BlockHash, SlotId

LAYOUT: Final = KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, dtype="float32")
BLOCK_SIZE: Final = 4
"""A block is 1 x 2 x 4 x 1 x 32 x 4 = 1024 bytes; a slot is 8 KiB (two 4 KiB pages)."""
DOCUMENTS: Final = 6
"""Prompts share prefixes of this many documents (so restored blocks are found again)."""


def workload_config(directory: Path, **overrides: object) -> StateKVConfig:
    """Small pools, so that nearly every step spills and the disk displaces often."""
    args: dict[str, object] = {
        "layout": LAYOUT, "block_size": BLOCK_SIZE, "gpu": 6, "host": 2, "reserved_host": 1,
        "disk": 10, "disk_dir": directory, "writers": 2, "readers": 2, "device": "cpu",
        "model_fingerprint": "crash-workload",
    }
    args.update(overrides)
    return StateKVConfig(**args)  # type: ignore[arg-type]


def prompts(seed: int, count: int) -> list[list[int]]:
    """`count` prompts over DOCUMENTS documents: shared prefixes of random lengths."""
    rng = random.Random(seed)
    docs = [[1000 * d + t for t in range(5 * BLOCK_SIZE)] for d in range(DOCUMENTS)]
    out = []
    for _ in range(count):
        doc = docs[rng.randrange(DOCUMENTS)]
        cut = rng.randrange(BLOCK_SIZE + 1, len(doc) + 1)
        out.append([*doc[:cut], rng.randrange(1_000_000, 2_000_000)])
    return out


def block_bytes(prefix: Sequence[int], nbytes: int) -> torch.Tensor:
    """The KV of the block ending a prompt prefix: a fixed function of the prefix's tokens."""
    seed = hashlib.blake2b(repr(list(prefix)).encode(), digest_size=16).digest()
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += hashlib.blake2b(seed + counter.to_bytes(8, "little"), digest_size=64).digest()
        counter += 1
    return torch.frombuffer(out[:nbytes], dtype=torch.uint8)


def key_prefixes(all_prompts: Sequence[Sequence[int]], fingerprint: str = "") -> dict[
    BlockHash, tuple[int, ...]
]:
    """The chained key of every full block of every prompt -> that block's prompt prefix."""
    out: dict[BlockHash, tuple[int, ...]] = {}
    for prompt in all_prompts:
        key = root_key(fingerprint, None, None)
        for end in range(BLOCK_SIZE, len(prompt) + 1, BLOCK_SIZE):
            key = chain_key(key, token_bytes(prompt[end - BLOCK_SIZE:end]))
            out[key] = tuple(prompt[:end])
    return out


def _page(cache: CacheAPI, page: int) -> torch.Tensor:
    return cache.kv_pool[page].reshape(-1).view(torch.uint8)


def _wait_ready(cache: CacheAPI, rid: str) -> None:
    deadline = time.monotonic() + 30
    while not cache.is_ready(rid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"request {rid} parked for 30 s")
        time.sleep(0.0005)


def _wait_quiet(cache: CacheAPI) -> None:
    deadline = time.monotonic() + 30
    while cache.transfers_in_flight():
        if time.monotonic() > deadline:
            raise TimeoutError("disk transfers still in flight after 30 s")
        time.sleep(0.0005)


def serve_checked(cache: CacheAPI, rid: str, prompt: Sequence[int], ttl: float | None) -> int:
    """Serve one request as a serving loop would; returns wrong bytes among the pages the
    cache handed over as matched (computed pages are written here, then committed)."""
    try:
        match = cache.add_request(rid, prompt, ttl_seconds=ttl)
    except OutOfBlocks:
        _wait_quiet(cache)  # as below: pages held by reads still in flight
        match = cache.add_request(rid, prompt, ttl_seconds=ttl)
    _wait_ready(cache, rid)
    status = cache.request_status(rid)
    nbytes = cache.kv_pool[0].numel() * cache.kv_pool.element_size()
    table = cache.block_table(rid)
    wrong = 0
    for i in range(status.num_computed_tokens // BLOCK_SIZE):
        expected = block_bytes(prompt[:(i + 1) * BLOCK_SIZE], nbytes)
        wrong += int((_page(cache, table[i]).cpu() != expected).sum())
    del match
    compute_checked(cache, rid, prompt)
    cache.release(rid)
    return wrong


def compute_checked(cache: CacheAPI, rid: str, prompt: Sequence[int]) -> None:
    """Act as the forward pass: write the KV of every block the cache did not match, commit."""
    status = cache.request_status(rid)
    nbytes = cache.kv_pool[0].numel() * cache.kv_pool.element_size()
    try:
        cache.allocate_nowait(rid, len(prompt))
    except OutOfBlocks:
        # A read whose request fell back keeps its GPU page until it lands (the lifecycle's
        # rule): as a serving loop's admission control would, wait for the disk to go quiet.
        _wait_quiet(cache)
        cache.allocate_nowait(rid, len(prompt))
    table = cache.block_table(rid)
    for i in range(status.num_computed_tokens // BLOCK_SIZE, len(table)):
        end = min((i + 1) * BLOCK_SIZE, len(prompt))
        _page(cache, table[i]).copy_(block_bytes(prompt[:end], nbytes))
    cache.commit(rid, len(prompt))


def twin_prompts(n: int) -> tuple[list[int], list[list[int]]]:
    """The n-th retention extension of a workload: a prompt of two full blocks, and three
    fillers of as many blocks that push its blocks out to disk."""
    base = 5_000_000 + 10_000 * n
    return ([base + t for t in range(2 * BLOCK_SIZE + 1)],
            [[base + 1000 * (j + 1) + t for t in range(2 * BLOCK_SIZE + 1)] for j in range(3)])


def extend_retention(cache: CacheAPI, rid: str, n: int, short: float, long: float) -> int:
    """Lengthen a deadline while its block is on disk: two requests compute the same new
    prompt (the second one's blocks stay private duplicates); the first is released with the
    `short` TTL, fillers push its blocks out to disk, then the second is released with the
    `long` TTL and stamps the cached twins where they are (PersistRetention).  Returns the
    wrong bytes the fillers were served."""
    prompt, fillers = twin_prompts(n)
    for side, ttl in (("a", short), ("b", long)):
        try:
            cache.add_request(f"{rid}{side}", prompt, ttl_seconds=ttl)
        except OutOfBlocks:
            _wait_quiet(cache)
            cache.add_request(f"{rid}{side}", prompt, ttl_seconds=ttl)
        _wait_ready(cache, f"{rid}{side}")
    compute_checked(cache, f"{rid}a", prompt)
    compute_checked(cache, f"{rid}b", prompt)
    cache.release(f"{rid}a")
    wrong = sum(serve_checked(cache, f"{rid}f{j}", filler, None)
                for j, filler in enumerate(fillers))
    cache.release(f"{rid}b")
    return wrong


@attrs.frozen(kw_only=True)
class Check:
    """What reopening one directory after a crash found."""

    restored: int
    """Slots the index rebuild restored."""
    verified: int
    """Restored slots read back intact (byte-identical to their key's KV)."""
    torn: int
    """Restored slots whose read failed its checks (found, never served)."""
    wrong_bytes: int
    """Bytes served that differ from the KV computed for their key: must be 0."""
    unknown_keys: int
    """Restored keys the workload never computed: must be 0."""
    landed: int
    """Blocks whose write had returned before the crash (and whose slot was not written
    again): each must be found again."""
    lost: int
    """Of those, blocks not found again: must be 0."""
    served_blocks: int
    """Matched blocks a cache opened on the directory handed to requests (all checked)."""
    recovery: Recovery
    stale: int = 0
    """Slots the reopen restored (from the index journal) that a header scan of the same
    directory does not restore under the same key: must be 0 after a crash (the journal
    never names bytes that were not written, nor a slot written again since)."""
    scan: Recovery | None = None
    """What a header scan of the same directory found, right after the reopen."""
    scan_torn: int = 0
    """Slots that scan restored whose read fails its checks (torn by the crash): the
    journal must not have restored them (they are never served either way)."""
    deadlines_checked: int = 0
    """Restored slots whose deadline was checked against the ledger (DeadlineLedger)."""
    deadline_errors: tuple[str, ...] = ()
    """Restored deadlines never issued for that content, or earlier than one durably
    committed for that slot and key: must be none."""
    landed_retained: int = 0
    """Of `landed`, content written with a retention deadline (kill loop): most of it was
    written through at its release and was still on GPU or host when the process died."""
    lost_retained: int = 0
    """Of those, not found again: must be 0 (it is part of `lost` too)."""

    @property
    def ok(self) -> bool:
        return not (self.wrong_bytes or self.unknown_keys or self.lost or self.deadline_errors
                    or self.stale)


def check_directory(
    config: StateKVConfig, all_prompts: Sequence[Sequence[int]],
    landed: dict[SlotId, BlockHash] | None = None,
    serve: Sequence[Sequence[int]] | None = None,
    ledger: DeadlineLedger | None = None,
    retained: set[BlockHash] | None = None,
    lying: set[SlotId] | None = None,
) -> Check:
    """Reopen the directory of `config` and check everything it serves (module docstring).

    `all_prompts`: every prompt any process may have cached there (for the expected bytes);
    `serve`: the prompts to serve through a reopened cache (default: all of them);
    `landed`: slot -> key of every write that returned and was not followed by another
    write to the same slot before the crash (these must be found again); `ledger`: the
    deadlines issued and committed (every restored deadline is checked against it);
    `retained`: of the landed keys, those written with a retention deadline (content
    released with a TTL: written through at its release while it stayed on GPU or host, or
    spilled), each counted in ``landed_retained`` and, if not found, in ``lost_retained``;
    `lying`: slots whose last write an injected fault tore (reporting success: a lying
    disk; or reporting failure after the injector let its index record land): the journal
    names what the write claimed and the slot holds something else, so they cannot count as
    stale -- their reads fail their checks, and are counted as torn.
    """
    directory = config.rank_directory()
    assert directory is not None
    by_key = key_prefixes(all_prompts, config.model_fingerprint)
    core = config.core_config()
    store = PosixSlotStore(directory, core)
    try:
        recovery = store.recovery
        dst = page_aligned_buffer(store.payload_len)
        verified = torn = wrong = unknown = 0
        intact: set[tuple[int, bytes]] = set()
        found = {s.key for s in recovery.slots}
        for entry in recovery.slots:
            prefix = by_key.get(entry.key)
            if prefix is None:
                unknown += 1
                continue
            try:
                store.read(entry.slot, entry.key, dst)
            except TransferFailed:
                torn += 1
                continue
            wrong += int((dst != block_bytes(prefix, store.payload_len)).sum())
            verified += 1
            intact.add((entry.slot, bytes(entry.key)))
        lost = sum(1 for key in (landed or {}).values() if key not in found)
        lost_retained = sum(1 for key in (retained or set()) if key not in found)
        deadline_errors = ledger.check(recovery) if ledger is not None else []
    finally:
        store.close()
    # The same directory through the header scan (the reopen above rewrote the journal:
    # remove it, and the scan rewrites it again for the cache below).
    (directory / INDEX_FILE).unlink(missing_ok=True)
    store = PosixSlotStore(directory, core)
    scan_torn = 0
    try:
        scan = store.recovery
        assert scan.index.source == "scan", scan.index
        for entry in scan.slots:
            try:
                store.read(entry.slot, entry.key, dst)
            except TransferFailed:
                scan_torn += 1
    finally:
        store.close()
    scanned = {(s.slot, s.key) for s in scan.slots}
    scanned_keys = {bytes(s.key) for s in scan.slots}
    # Two slots holding one key (a crash between a second write of the content and the
    # freeing of one slot) are one restore each way, possibly not the same one: the
    # journal's is not stale when its slot read back intact and the scan kept the other.
    stale = sum(1 for s in recovery.slots if (s.slot, s.key) not in scanned
                and s.slot not in (lying or set())
                and not ((s.slot, bytes(s.key)) in intact and bytes(s.key) in scanned_keys))
    served = 0
    with BlockingCache(config) as cache:
        for i, prompt in enumerate(all_prompts if serve is None else serve):
            before = cache.statistics().cache.hit_blocks_disk
            wrong += serve_checked(cache, f"check{i}", prompt, None)
            served += cache.statistics().cache.hit_blocks_disk - before
        cache.check_invariants()
    return Check(restored=len(recovery.slots), verified=verified, torn=torn, wrong_bytes=wrong,
                 unknown_keys=unknown, landed=len(landed or {}), lost=lost,
                 served_blocks=served, recovery=recovery, stale=stale, scan=scan,
                 scan_torn=scan_torn,
                 deadlines_checked=len(recovery.slots) if ledger is not None else 0,
                 deadline_errors=tuple(deadline_errors),
                 landed_retained=len(retained or ()), lost_retained=lost_retained)


# --- SQLite style: a crash after the k-th write call ---------------------------------------------

SCRIPT_PROMPTS: Final = 30
SCRIPT_SEED: Final = 13


SCRIPT_EXTENSIONS: Final = 5
"""Retention extensions of blocks on disk in the scripted workload (one after every
SCRIPT_PROMPTS // SCRIPT_EXTENSIONS prompts)."""


def script_prompts() -> list[list[int]]:
    """Every prompt the scripted workload serves."""
    out = prompts(SCRIPT_SEED, SCRIPT_PROMPTS)
    for n in range(SCRIPT_EXTENSIONS):
        prompt, fillers = twin_prompts(n)
        out += [prompt, *fillers]
    return out


def scripted_workload(directory: Path, plan: FaultPlan) -> tuple[FaultyStore, int, Path]:
    """The scripted workload through a FaultyStore (inline I/O: one call order every run).

    Returns the store (its call counts), the wrong bytes served while it ran, and the
    write log (WriteLog) of what reached the store.
    """
    config = workload_config(directory)
    core = config.core_config()
    rank = config.rank_directory()
    assert rank is not None
    store = FaultyStore(PosixSlotStore(rank, core), plan)
    log = directory.parent / f"{directory.name}-writes.log"
    logged = WriteLog(store, log)
    wrong = 0
    every = SCRIPT_PROMPTS // SCRIPT_EXTENSIONS
    try:
        with BlockingCache(config, store=logged, synchronous_io=True) as cache:
            for i, prompt in enumerate(prompts(SCRIPT_SEED, SCRIPT_PROMPTS)):
                ttl = (None, 3600.0, 60.0)[i % 3]
                wrong += serve_checked(cache, f"s{i}", prompt, ttl)
                if i % every == every - 1:
                    wrong += extend_retention(cache, f"x{i}", i // every, 60.0, 3600.0)
    finally:
        logged.close()
    return store, wrong, log


@attrs.frozen(kw_only=True)
class Enumeration:
    writes: int
    """Slot write calls of the scripted workload (one crash point each)."""
    journal_appends: int
    """Retention journal appends of the scripted workload (one crash point each, torn at a
    seeded byte: often inside a record)."""
    index_appends: int = 0
    """Index journal appends of the scripted workload (before and after slot writes, the
    seal at close; one crash point each, torn at a seeded byte)."""
    checks: tuple[Check, ...]
    wrong_bytes_while_running: int


def enumerate_crashes(base: Path, *, seed: int = 0, every: int = 1) -> Enumeration:
    """Crash the scripted workload during its k-th slot write, and during its k-th journal
    append, for every k (every `every`-th k, for a quicker pass), and check each directory,
    deadlines included."""
    counting, wrong, _log = scripted_workload(base / "count", FaultPlan())
    writes = counting.calls(Op.WRITE)
    appends = counting.calls(Op.JOURNAL)
    index_appends = counting.calls(Op.INDEX)
    checks = []
    all_prompts = script_prompts()
    points = [(Op.WRITE, k) for k in range(1, writes + 1, every)]
    points += [(Op.JOURNAL, k) for k in range(1, appends + 1, every)]
    points += [(Op.INDEX, k) for k in range(1, index_appends + 1, every)]
    for op, k in points:
        directory = base / f"crash-{op.value}{k}"
        plan = FaultPlan(rules=(FaultRule(op=op, fault=Fault.CRASH, nth=k),), seed=seed)
        store, running_wrong, log = scripted_workload(directory, plan)
        assert store.crashed_at == k
        wrong += running_wrong
        ledger = DeadlineLedger()
        ledger.read(log)
        checks.append(check_directory(workload_config(directory), all_prompts,
                                      landed_slots(log), ledger=ledger))
    return Enumeration(writes=writes, journal_appends=appends, index_appends=index_appends,
                       checks=tuple(checks),
                       wrong_bytes_while_running=wrong)


# --- real kill -9 -----------------------------------------------------------------------------

_CHILD_PROMPTS: Final = 40


class WriteLog:
    """A SlotStore wrapper that logs each write it starts and each that returned.

    Lines go to the file with one write(2) each (O_APPEND): the kernel has them the moment
    the call returns, so a kill -9 loses none that were made.
    """

    def __init__(self, inner: SlotStore, path: Path) -> None:
        self._inner = inner
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @property
    def device_reads(self) -> bool:
        return self._inner.device_reads

    @property
    def recovery(self) -> Recovery | None:
        found = getattr(self._inner, "recovery", None)
        return found if isinstance(found, Recovery) else None

    def write(
        self, slot: SlotId, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None
    ) -> None:
        line = _line(slot, key, meta.expiry if meta is not None else None)
        os.write(self._fd, f"W {line}".encode())
        try:
            self._inner.write(slot, key, src, meta)
        except TransferFailed:
            os.write(self._fd, f"F {slot}\n".encode())
            raise
        os.write(self._fd, f"L {line}{self._torn([slot])}".encode())

    def _torn(self, slots: Sequence[SlotId]) -> str:
        """T lines for those of `slots` an injected fault tore while the write reported
        success (a lying disk): what they hold is not what their records say."""
        torn = getattr(self._inner, "silently_torn", None)
        if torn is None:
            return ""
        found = torn()
        return "".join(f"T {slot}\n" for slot in slots if slot in found)

    def write_many(self, writes: Sequence[SlotIO]) -> BatchOutcome:
        """A batch: every slot logged as started, then each one that landed as returned."""
        items = list(writes)
        lines = [_line(item.slot, item.key, item.meta.expiry if item.meta else None)
                 for item in items]
        os.write(self._fd, "".join(f"W {line}" for line in lines).encode())
        out = self._inner.write_many(items)
        landed = "".join(f"L {line}"
                         for line, error in zip(lines, out, strict=True) if error is None)
        landed += self._torn([item.slot for item, error in zip(items, out, strict=True)
                              if error is None])
        landed += "".join(f"F {item.slot}\n" for item, error in zip(items, out, strict=True)
                          if error is not None)
        if landed:
            os.write(self._fd, landed.encode())
        return out

    def persist_retention(self, records: Sequence[RetentionRecord]) -> None:
        """One journal append: its records logged as started (j), then as returned (J)."""
        lines = "".join(_line(r.slot, r.key, r.expiry) for r in records)
        os.write(self._fd, "".join(f"j {line}" for line in lines.splitlines(True)).encode())
        inner = self._inner
        if not isinstance(inner, RetentionStore):
            return  # a store without a journal: the deadlines stay in memory
        inner.persist_retention(records)
        os.write(self._fd, "".join(f"J {line}" for line in lines.splitlines(True)).encode())

    def read(self, slot: SlotId, key: BlockHash, dst: torch.Tensor) -> None:
        self._inner.read(slot, key, dst)

    def read_many(self, reads: Sequence[SlotIO]) -> BatchOutcome:
        return self._inner.read_many(reads)

    def discard(self, slot: SlotId) -> None:
        """Logged (D): the slot's content left the cache, so it need not be found again."""
        os.write(self._fd, f"D {slot}\n".encode())
        self._inner.discard(slot)

    def close(self) -> None:
        self._inner.close()
        os.close(self._fd)


def _line(slot: int, key: bytes, expiry: float | None) -> str:
    return f"{slot} {bytes(key).hex()} {'-' if expiry is None else repr(float(expiry))}\n"


def landed_slots(log: Path) -> dict[SlotId, BlockHash]:
    """Slot -> key of each slot whose last logged event is a returned write."""
    return {slot: key for slot, (key, _retained) in landed_writes(log).items()}


def faulted_slots(log: Path) -> set[SlotId]:
    """Slots whose last logged write an injected fault tore while it reported success (T),
    or failed (F: the fault injector lets some failed writes land in part after their index
    record, which no real store's failed write has).

    A discard (D) after it changes nothing here: it is a hint that does no I/O, and the
    index journal's FREE record for the slot goes out with its next append -- a child
    killed before that append leaves the journal naming what the faulted write claimed,
    exactly as without the discard.  Counting the discard as the slot's last event would
    count such a slot as a stale index entry.
    """
    last: dict[SlotId, bool] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            parts = line.split()
            if (len(parts) >= 2 and parts[0] in {"W", "L", "T", "F"}
                    and parts[1].isdigit()):
                last[SlotId(int(parts[1]))] = parts[0] in {"T", "F"}
    return {slot for slot, faulted in last.items() if faulted}


def landed_writes(log: Path) -> dict[SlotId, tuple[BlockHash, bool]]:
    """Slot -> (key, whether the write carried a retention deadline) of each slot whose
    last logged event is a returned write."""
    last: dict[SlotId, tuple[BlockHash, bool] | None] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            parts = line.split()
            if parts[:1] in (["j"], ["J"]):
                continue  # journal appends: DeadlineLedger reads them
            if len(parts) in (2, 4) and parts[0] in {"W", "D"}:
                last[SlotId(int(parts[1]))] = None
            elif len(parts) in (3, 4) and parts[0] == "L" and len(parts[2]) == 64:
                last[SlotId(int(parts[1]))] = (BlockHash(bytes.fromhex(parts[2])),
                                               parts[3:4] not in ([], ["-"]))
            elif len(parts) >= 2 and parts[1].isdigit():
                # A line torn by the kill: what that slot holds is unknown.
                last[SlotId(int(parts[1]))] = None
    return {slot: entry for slot, entry in last.items() if entry is not None}


class DeadlineLedger:
    """Which retention deadlines each content was given, and which are durably committed.

    Read from WriteLog logs, in order (one per process, the kill loop's across processes):
    a deadline is *issued* for a key when a slot write carrying it, or a journal append
    naming it, starts; it is *committed* for (slot, key) when that write or append returned
    (kill -9 loses nothing the kernel has: disk_sync "none" suffices), and stays committed
    until a write of another key to the slot returns.  After a crash every restored
    deadline must be one issued for its key (None only where none is committed), and never
    earlier than one committed for its slot and key.
    """

    def __init__(self) -> None:
        self.issued: dict[bytes, set[float]] = {}
        self.committed: dict[int, dict[bytes, float]] = {}

    def read(self, log: Path) -> None:
        if not log.exists():
            return
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) != 4 or parts[0] not in {"W", "L", "j", "J"} or len(parts[2]) != 64:
                if len(parts) >= 2 and parts[1].isdigit():
                    # A line torn by the kill: nothing is known of that slot any more.
                    self.committed.pop(int(parts[1]), None)
                continue
            kind, slot, key = parts[0], int(parts[1]), bytes.fromhex(parts[2])
            expiry = None if parts[3] == "-" else float(parts[3])
            here = self.committed.setdefault(slot, {})
            if kind in {"W", "L"}:
                # A write of another key puts what the slot held at risk from its start (a
                # torn write), and replaces it once returned.
                for other in [k for k in here if k != key]:
                    del here[other]
            if kind in {"W", "j"}:
                if expiry is not None:
                    self.issued.setdefault(key, set()).add(expiry)
            elif expiry is not None:
                here[key] = max(here.get(key, expiry), expiry)

    def forget_commitments(self) -> None:
        """Start a new process's log: checking a directory serves requests through a cache,
        whose writes no log records, so only what was issued is carried over."""
        self.committed.clear()

    def check(self, recovery: Recovery) -> list[str]:
        """What is wrong with the restored deadlines (nothing, when the list is empty)."""
        errors = []
        for entry in recovery.slots:
            key, expiry = bytes(entry.key), entry.meta.expiry
            floor = self.committed.get(entry.slot, {}).get(key)
            where = f"slot {entry.slot} ({key.hex()[:12]})"
            if expiry is not None and expiry not in self.issued.get(key, ()):
                errors.append(f"{where}: deadline {expiry!r} was never issued for it")
            if floor is not None and (expiry is None or expiry < floor):
                errors.append(f"{where}: deadline {expiry!r}, but {floor!r} was committed")
        return errors


WRITE_FAULTS: Final = (Fault.EIO, Fault.ENOSPC, Fault.SHORT_WRITE, Fault.TORN_WRITE,
                       Fault.TORN_WRITE_SILENT, Fault.BIT_FLIP)
"""What a kill-loop child with write faults injects: failed, short and torn writes that say
so, and torn or rotted ones that report success (only a read-back can tell)."""


def child_fault_plan(seed: int) -> FaultPlan:
    """A few write faults among a child's first writes (its seed decides which and where)."""
    rng = random.Random(seed ^ 0x5EED)
    rules = tuple(FaultRule(op=Op.WRITE, fault=rng.choice(WRITE_FAULTS), nth=n)
                  for n in sorted(rng.sample(range(1, 60), 6)))
    return FaultPlan(rules=rules, seed=seed)


def child_main(directory: str, seed: int, log: str, faults: bool = False) -> int:
    """The child of the kill loop: reopen the directory, then serve until killed (with
    `faults`, through a store that fails some of its writes)."""
    config = workload_config(Path(directory))
    rank = config.rank_directory()
    assert rank is not None
    print("opening", flush=True)
    posix = PosixSlotStore(rank, config.core_config())
    inner: SlotStore = FaultyStore(posix, child_fault_plan(seed)) if faults else posix
    store = WriteLog(inner, Path(log))
    rng = random.Random(seed)
    all_prompts = prompts(seed, _CHILD_PROMPTS)
    extensions = child_extensions(seed)
    with BlockingCache(config, store=store) as cache:
        print("ready", flush=True)
        i = 0
        while True:
            prompt = all_prompts[rng.randrange(len(all_prompts))]
            wrong = serve_checked(cache, f"c{i}", prompt, rng.choice([None, 3600.0, 30.0]))
            if i % 5 == 4 and i // 5 < len(extensions):
                wrong += extend_retention(cache, f"x{i}", extensions[i // 5], 30.0, 3600.0)
            if wrong:
                print(f"served {wrong} wrong bytes", flush=True)
                return 3
            i += 1


_CHILD_EXTENSIONS: Final = 16


def child_extensions(seed: int) -> list[int]:
    """The twin_prompts numbers of a child's retention extensions (token ids stay < 2**32)."""
    return [(seed % 4000) * _CHILD_EXTENSIONS + j for j in range(_CHILD_EXTENSIONS)]


def child_prompts(seed: int) -> list[list[int]]:
    """Every prompt a child of the kill loop may serve."""
    out = prompts(seed, _CHILD_PROMPTS)
    for n in child_extensions(seed):
        prompt, fillers = twin_prompts(n)
        out += [prompt, *fillers]
    return out


@attrs.frozen(kw_only=True)
class KillReport:
    kills: int
    checks: tuple[Check, ...]

    def totals(self) -> dict[str, int]:
        return {
            "kills": self.kills,
            "blocks_restored": sum(c.restored for c in self.checks),
            "blocks_verified": sum(c.verified for c in self.checks),
            "torn_found": sum(c.torn for c in self.checks),
            "landed_before_kill": sum(c.landed for c in self.checks),
            "blocks_served_after_reopen": sum(c.served_blocks for c in self.checks),
            "wrong_bytes": sum(c.wrong_bytes for c in self.checks),
            "unknown_keys": sum(c.unknown_keys for c in self.checks),
            "lost": sum(c.lost for c in self.checks),
            "retained_landed_before_kill": sum(c.landed_retained for c in self.checks),
            "retained_lost": sum(c.lost_retained for c in self.checks),
            "deadlines_checked": sum(c.deadlines_checked for c in self.checks),
            "journal_records_applied": sum(c.recovery.journal.applied for c in self.checks),
            "journal_records_torn": sum(c.recovery.journal.torn for c in self.checks),
            "deadline_errors": sum(len(c.deadline_errors) for c in self.checks),
            "reopened_from_index_journal": sum(c.recovery.index.source == "journal"
                                               for c in self.checks),
            "index_records_torn": sum(c.recovery.index.torn for c in self.checks),
            "stale_index_entries": sum(c.stale for c in self.checks),
        }


@contextmanager
def _child(directory: Path, seed: int, log: Path,
           faults: bool) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fuzz.crash", "child", str(directory), str(seed), str(log),
         *(["faults"] if faults else [])],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def kill_loop(directory: Path, *, kills: int, seed: int = 0, max_delay_s: float = 1.0,
              on_check: object = None, write_faults: bool = False) -> KillReport:
    """Run `kills` children on one directory, killing each at a random moment; with
    `write_faults`, every other child's store fails some of its writes (WRITE_FAULTS)."""
    rng = random.Random(seed)
    checks: list[Check] = []
    ledger = DeadlineLedger()
    config = workload_config(directory)
    all_prompts: list[list[int]] = []
    for n in range(kills):
        child_seed = rng.randrange(2**31)
        served = child_prompts(child_seed)
        all_prompts += served
        log = directory.parent / f"{directory.name}-writes-{n}.log"
        with _child(directory, child_seed, log, write_faults and n % 2 == 1) as proc:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line != "opening\n":
                raise RuntimeError(f"child {n} did not start: {line!r}, rc={proc.wait()}")
            if rng.random() < 0.1:
                # Kill while it opens: creating or resizing the data file, the header scan,
                # the restore.
                time.sleep(rng.uniform(0.0, 0.05))
            else:
                line = proc.stdout.readline()
                if line != "ready\n":
                    raise RuntimeError(f"child {n} did not open: {line!r}, rc={proc.wait()}")
                time.sleep(rng.uniform(0.0, max_delay_s))
            if proc.poll() is not None:
                raise RuntimeError(f"child {n} exited by itself: rc={proc.returncode}")
            os.kill(proc.pid, signal.SIGKILL)
        writes = landed_writes(log)
        lying = faulted_slots(log)
        landed = {slot: key for slot, (key, _retained) in writes.items()}
        retained = {key for key, is_retained in writes.values() if is_retained}
        ledger.read(log)
        log.unlink(missing_ok=True)
        check = check_directory(config, all_prompts, landed, serve=served, ledger=ledger,
                                retained=retained, lying=lying)
        ledger.forget_commitments()
        checks.append(check)
        if callable(on_check):
            on_check(n, check)
        if not check.ok:
            break
    return KillReport(kills=len(checks), checks=tuple(checks))


def summary(check: Check) -> dict[str, object]:
    fields = attrs.asdict(check, recurse=False)
    fields["reclaimed"] = check.recovery.reclaimed
    fields["index"] = check.recovery.index.source
    del fields["recovery"], fields["scan"]
    return fields


def main(argv: list[str]) -> int:
    if argv[:1] == ["child"]:
        return child_main(argv[1], int(argv[2]), argv[3], faults=argv[4:5] == ["faults"])
    kills = int(argv[0]) if argv else 5
    with tempfile.TemporaryDirectory() as tmp:
        report = kill_loop(Path(tmp) / "cache", kills=kills,
                           on_check=lambda n, c: print(n, summary(c), flush=True))
    print(report.totals())
    totals = report.totals()
    bad = (totals["wrong_bytes"] or totals["unknown_keys"] or totals["lost"]
           or totals["stale_index_entries"])
    return 0 if not (bad or totals["deadline_errors"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
