"""Deterministic fault injection for the shared tier, done to the real cluster.

:class:`FaultyRemoteStore` wraps a :class:`~io_actors.storage.redis_store.RedisClusterStore`
and, following a :class:`RemoteFaultPlan`, makes chosen calls meet the failures a Redis
Cluster really produces.  As in io_actors.storage.faults, calls are numbered per operation
and per block in the order they reach the store, a plan names the calls to strike, and a
counting run (no rules) says how many calls a scenario makes.

Every fault is produced on the cluster itself, through redis-py administration connections,
so the store's real client meets the real protocol:

- TIMEOUT: the block's master is paused (``CLIENT PAUSE ... ALL``) for longer than the
  store's timeout and its retry; the call times out.
- CONNECTION_RESET: every client connection to the block's master is killed
  (``CLIENT KILL TYPE normal``); the client's next command meets a closed socket.
- MOVED: the block's hash slot is resharded to another master (``SETSLOT IMPORTING /
  MIGRATING``, ``MIGRATE``, ``SETSLOT NODE``); the client's slot map is stale and the old
  master answers MOVED.
- ASK: the slot is left half-migrated with only this block moved; the old master answers
  ASK and the client must follow it with ASKING.  The migration is finished after the call.
- EVICTED: the block's key is deleted just before a fetch (what ``maxmemory`` eviction or
  expiry between match and fetch does).
- CORRUPT: one seeded bit of the stored value flips (``SETRANGE``) before a fetch.
- TRUNCATED: the stored value is cut short before a fetch.
- WRONG_KEY: the value stored under the block's key is replaced by another block's.

None may ever let a fetch return wrong bytes: a fault ends in a typed failure or, for
redirections and resets the client recovers from, in the right bytes.
"""

from __future__ import annotations

import enum
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import attrs
import torch

from io_actors.storage.redis_store import (
    RedisClusterStore,
    RemoteIO,
    RemoteOutcome,
    RemoteStatistics,
)
from io_actors.storage.slot_format import SlotMeta
from statekv.errors import TransferFailed, UsageError
from statekv.ids import BlockHash

MIGRATE_TIMEOUT_MS: Final = 5000


class RemoteOp(enum.Enum):
    PUBLISH = "publish"
    FETCH = "fetch"


class RemoteFault(enum.Enum):
    TIMEOUT = "timeout"
    CONNECTION_RESET = "connection_reset"
    MOVED = "moved"
    ASK = "ask"
    EVICTED = "evicted"
    CORRUPT = "corrupt"
    TRUNCATED = "truncated"
    WRONG_KEY = "wrong_key"


_FETCH_ONLY: Final = frozenset(
    {RemoteFault.EVICTED, RemoteFault.CORRUPT, RemoteFault.TRUNCATED, RemoteFault.WRONG_KEY}
)


_E = TypeVar("_E", bound=enum.Enum)


def _to_enum(kind: type[_E], field: str, value: object) -> _E:
    try:
        return kind(value)
    except ValueError:
        known = [m.value for m in kind]
        raise UsageError(field, f"unknown {field} {value!r} (known: {known})") from None


def _to_op(value: object) -> RemoteOp:
    return _to_enum(RemoteOp, "op", value)


def _to_fault(value: object) -> RemoteFault:
    return _to_enum(RemoteFault, "fault", value)


@attrs.frozen(kw_only=True)
class RemoteFaultRule:
    """Strike the `nth` call of `op` (counting blocks from 1), or every call from it on."""

    op: RemoteOp = attrs.field(converter=_to_op)
    fault: RemoteFault = attrs.field(converter=_to_fault)
    nth: int
    onward: bool = False

    def __attrs_post_init__(self) -> None:
        if self.fault in _FETCH_ONLY and self.op is not RemoteOp.FETCH:
            raise UsageError("op", f"{self.fault.value} applies to fetch calls only")
        if isinstance(self.nth, bool) or not isinstance(self.nth, int) or self.nth < 1:
            raise UsageError("nth", f"must be an integer >= 1, got {self.nth!r}")
        if not isinstance(self.onward, bool):
            raise UsageError("onward", f"must be True or False, got {self.onward!r}")

    def matches(self, call: int) -> bool:
        return call >= self.nth if self.onward else call == self.nth


@attrs.frozen(kw_only=True)
class RemoteFaultPlan:
    """Which calls are struck, and how; the first matching rule wins.  No rules: counting."""

    rules: tuple[RemoteFaultRule, ...] = ()
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.rules, tuple) or not all(
            isinstance(r, RemoteFaultRule) for r in self.rules
        ):
            raise UsageError("rules", f"must be a tuple of RemoteFaultRule, got {self.rules!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError("seed", f"must be an integer, got {self.seed!r}")

    def rule_for(self, op: RemoteOp, call: int) -> RemoteFaultRule | None:
        for rule in self.rules:
            if rule.op is op and rule.matches(call):
                return rule
        return None


class _Admin:
    """Administration connections to every master, apart from the store's own client."""

    def __init__(self, store: RedisClusterStore) -> None:
        import redis

        self._store = store
        self._conns: dict[str, Any] = {}
        self._ids: dict[str, str] = {}
        for node in store.client.get_primaries():
            conn = redis.Redis(host=node.host, port=node.port, socket_timeout=10)
            self._conns[node.name] = conn
            self._ids[node.name] = conn.execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER", "MYID").decode()
        self._redis = redis

    def conn(self, name: str) -> Any:
        return self._conns[name]

    def owner(self, rkey: bytes) -> str:
        """The name (host:port) of the master the cluster says owns `rkey` now."""
        slot = self.keyslot(rkey)
        for name, conn in self._conns.items():
            try:
                lines = conn.execute_command("CLUSTER", "NODES").decode().splitlines()
            except self._redis.RedisError:
                continue
            for line in lines:
                fields = line.split()
                if "myself" in fields[2].split(",") and owns_slot(fields[8:], slot):
                    return name
        raise UsageError("key", f"no reachable master owns slot {slot}")

    def keyslot(self, rkey: bytes) -> int:
        conn = next(iter(self._conns.values()))
        return int(conn.execute_command("CLUSTER", "KEYSLOT", rkey))

    def other(self, name: str) -> str:
        return next(n for n in sorted(self._conns) if n != name)

    def begin_migration(self, slot: int, source: str, target: str) -> None:
        self._conns[target].execute_command(
            "CLUSTER", "SETSLOT", slot, "IMPORTING", self._ids[source])
        self._conns[source].execute_command(
            "CLUSTER", "SETSLOT", slot, "MIGRATING", self._ids[target])

    def migrate_keys(self, source: str, target: str, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        host, _, port = target.rpartition(":")
        self._conns[source].execute_command(
            "MIGRATE", host, int(port), "", 0, MIGRATE_TIMEOUT_MS, "KEYS", *keys)

    def finish_migration(self, slot: int, source: str, target: str) -> None:
        while True:
            keys = self._conns[source].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            if not keys:
                break
            self.migrate_keys(source, target, keys)
        # The target first, then the source, then everyone (Redis's resharding order).
        for name in (target, source, *(n for n in self._conns if n not in (source, target))):
            self._conns[name].execute_command(
                "CLUSTER", "SETSLOT", slot, "NODE", self._ids[target])

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()


def owns_slot(ranges: list[str], slot: int) -> bool:
    """Whether the slot ranges of a CLUSTER NODES line ("0-5460", "7", "[...]" while
    migrating) include `slot`."""
    for item in ranges:
        if item.startswith("["):
            continue
        lo, _, hi = item.partition("-")
        if int(lo) <= slot <= int(hi or lo):
            return True
    return False


class FaultyRemoteStore:
    """A remote store that strikes the calls `plan` names with real cluster faults."""

    def __init__(self, inner: RedisClusterStore, plan: RemoteFaultPlan) -> None:
        if not isinstance(inner, RedisClusterStore):
            raise UsageError("inner", f"must be a RedisClusterStore, got {inner!r:.80}")
        if not isinstance(plan, RemoteFaultPlan):
            raise UsageError("plan", f"must be a RemoteFaultPlan, got {plan!r:.80}")
        self._inner = inner
        self._plan = plan
        self._admin = _Admin(inner)
        self._lock = threading.Lock()
        self._counts = {RemoteOp.PUBLISH: 0, RemoteOp.FETCH: 0}
        self._injected: list[str] = []

    @property
    def inner(self) -> RedisClusterStore:
        return self._inner

    def calls(self, op: RemoteOp | str) -> int:
        with self._lock:
            return self._counts[_to_enum(RemoteOp, "op", op)]

    @property
    def injected(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._injected)

    def statistics(self) -> RemoteStatistics:
        return self._inner.statistics()

    def _next(self, op: RemoteOp) -> tuple[int, RemoteFaultRule | None]:
        with self._lock:
            self._counts[op] += 1
            call = self._counts[op]
            rule = self._plan.rule_for(op, call)
            if rule is not None:
                self._injected.append(f"{op.value}#{call}:{rule.fault.value}")
            return call, rule

    # --- the store's interface --------------------------------------------------------------

    def publish(self, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None,
                ttl_s: float | None = None) -> None:
        failure = self.publish_many([RemoteIO(key, src, meta, ttl_s)])[0]
        if failure is not None:
            raise failure

    def fetch(self, key: BlockHash, dst: torch.Tensor) -> None:
        failure = self.fetch_many([RemoteIO(key, dst)])[0]
        if failure is not None:
            raise failure

    def publish_many(self, items: Sequence[RemoteIO]) -> RemoteOutcome:
        return self._many(RemoteOp.PUBLISH, items, self._inner.publish_many)

    def fetch_many(self, items: Sequence[RemoteIO]) -> RemoteOutcome:
        return self._many(RemoteOp.FETCH, items, self._inner.fetch_many)

    def present(self, keys: Sequence[BlockHash]) -> list[bool]:
        return self._inner.present(keys)

    def match_prefix(self, keys: Sequence[BlockHash]) -> int:
        return self._inner.match_prefix(keys)

    def forget(self, keys: Sequence[BlockHash]) -> None:
        self._inner.forget(keys)

    def close(self) -> None:
        self._admin.close()
        self._inner.close()

    def _many(
        self, op: RemoteOp, items: Sequence[RemoteIO],
        call_inner: Callable[[Sequence[RemoteIO]], RemoteOutcome],
    ) -> RemoteOutcome:
        """Runs of unstruck blocks go to the inner store as one batch; a struck block alone,
        its fault set up on the cluster just before its call and undone just after."""
        batch = list(items)
        out: RemoteOutcome = [None] * len(batch)
        run: list[int] = []

        def flush() -> None:
            if run:
                for n, outcome in zip(run, call_inner([batch[n] for n in run]), strict=True):
                    out[n] = outcome
                run.clear()

        for n, item in enumerate(batch):
            call, rule = self._next(op)
            if rule is None:
                run.append(n)
                continue
            flush()
            out[n] = self._struck(op, item, rule, call, call_inner)
        flush()
        return out

    def _struck(
        self, op: RemoteOp, item: RemoteIO, rule: RemoteFaultRule, call: int,
        call_inner: Callable[[Sequence[RemoteIO]], RemoteOutcome],
    ) -> TransferFailed | None:
        rng = random.Random(f"{self._plan.seed}:{op.value}:{call}")
        rkey = self._inner.redis_key(item.key)
        owner = self._admin.owner(rkey)
        conn = self._admin.conn(owner)
        fault = rule.fault
        if fault is RemoteFault.TIMEOUT:
            # Longer than the store's wait and its one retry, so the call must give up.
            pause_s = 3 * self._inner.timeout_s + 0.2
            conn.execute_command("CLIENT", "PAUSE", int(pause_s * 1000), "ALL")
            try:
                return call_inner([item])[0]
            finally:
                conn.execute_command("CLIENT", "UNPAUSE")
        if fault is RemoteFault.CONNECTION_RESET:
            conn.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            return call_inner([item])[0]
        if fault in (RemoteFault.MOVED, RemoteFault.ASK):
            slot = self._admin.keyslot(rkey)
            target = self._admin.other(owner)
            # Asked before the migration starts: a migrating source answers ASK for a key
            # it does not hold, admin connections included.
            held = bool(conn.exists(rkey))
            self._admin.begin_migration(slot, owner, target)
            try:
                if fault is RemoteFault.MOVED:
                    self._admin.finish_migration(slot, owner, target)
                else:
                    # Only this block moves: the source answers ASK for it.
                    self._admin.migrate_keys(owner, target, [rkey] if held else [])
                return call_inner([item])[0]
            finally:
                if fault is RemoteFault.ASK:
                    self._admin.finish_migration(slot, owner, target)
        if fault is RemoteFault.EVICTED:
            conn.delete(rkey)
        elif fault is RemoteFault.CORRUPT:
            value = conn.get(rkey)
            if value:
                where = rng.randrange(len(value))
                flipped = value[where] ^ (1 << rng.randrange(8))
                conn.setrange(rkey, where, bytes([flipped]))
        elif fault is RemoteFault.TRUNCATED:
            value = conn.get(rkey)
            if value:
                keep = rng.randrange(len(value))
                ttl = conn.pttl(rkey)
                conn.set(rkey, value[:keep], px=ttl if ttl > 0 else None)
        else:
            # WRONG_KEY: a sound value of another block under this block's key.
            other = BlockHash(bytes(b ^ 0xFF for b in bytes(item.key)))
            image = self._inner.encode(other, item.buffer.clone())
            conn.set(rkey, image)
            del image
        return call_inner([item])[0]


__all__ = [
    "FaultyRemoteStore",
    "RemoteFault",
    "RemoteFaultPlan",
    "RemoteFaultRule",
    "RemoteOp",
    "owns_slot",
]
