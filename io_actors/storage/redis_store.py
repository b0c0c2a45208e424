"""The shared tier: blocks published to a Redis Cluster that every serving replica reads.

A block lives under one Redis key per block::

    <namespace>:<config fingerprint, hex>:<chained block key, hex>

The chained key (statekv.hashing) is rooted in the model fingerprint, the tenant's cache salt
and the LoRA id, so two tenants or two models never read each other's blocks; the config
fingerprint (slot_format.config_fingerprint: layout, block size, format version) keeps caches
that would read the same bytes as different KV apart as well.  Keys spread over the
cluster's hash slots (no hash tag): a prefix's blocks land on every master, and losing one
master loses only the blocks it held.

The value is the disk tier's slot format without the padding: the 4 KiB header block (key,
config fingerprint, payload length, payload CRC, header CRC, restore metadata and, when a
MAC key is configured, the keyed BLAKE2b MAC), then the payload.  The format code is
io_actors.storage.slot_format's; nothing here re-implements a field.  The header's slot number is
always :data:`REMOTE_SLOT`: a Redis key names the value, there is no slot geometry.  Values
are written in the current slot format version (CRC-32C checksums); a value of version 2
(zlib CRC-32), published by a replica of an older build under the same Redis key (the
config fingerprint did not change), is read and verified with its own checksums.  The other
way round, an older replica refuses a version 3 value as CORRUPT, a miss: during a rolling
upgrade the old replicas recompute what the new ones publish.

Retention deadlines become Redis key expiry (``SET ... PX``): a block retained for 60 s
disappears from the cluster when its deadline passes.  Best-effort blocks get no expiry and
leave when the cluster's ``maxmemory-policy`` (allkeys-lru is what a deployment should run)
evicts them.

A fetch verifies everything before a byte reaches the destination: exact length, header
checksum, key, config fingerprint, payload checksum, MAC.  A value that fails any check, a
key that is missing (never published, expired, evicted, or on a dead master), and a cluster
that does not answer in time are each a :class:`RemoteFetchFailed` with a typed
:class:`FetchStatus`, counted in :meth:`RedisClusterStore.statistics`; the destination is
left untouched.  Nothing here ever returns bytes it did not verify.

All methods block and are meant for worker threads, like a SlotStore's.  One client (its
connection pools are thread-safe) serves every thread.
"""

from __future__ import annotations

import enum
import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import attrs
import torch
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError
from redis.retry import Retry

from io_actors.storage.buffers import check_block_tensor, host_view
from io_actors.storage.cluster_url import (
    MAX_TIMEOUT_S,
    ClusterAddress,
    parse_cluster,
)
from io_actors.storage.slot_format import (
    HEADER_SIZE,
    MacMismatch,
    SlotHeader,
    SlotMeta,
    check_key,
    check_mac_key,
    config_fingerprint,
    payload_checksum,
    verify_checksum,
    verify_header,
    verify_mac,
)
from statekv.config import CacheConfig
from statekv.errors import ConfigError, TransferFailed, UsageError
from statekv.ids import BlockHash, SlotId

REMOTE_SLOT: Final = SlotId(0)
"""The slot number every remote value's header carries (a Redis key names the value)."""
DEFAULT_NAMESPACE: Final = "statekv"


class FetchStatus(enum.Enum):
    """Why a fetch returned no data (HIT: it did)."""

    HIT = "hit"
    MISSING = "missing"
    """No such key: never published, expired, evicted, or on a master that is gone."""
    UNAVAILABLE = "unavailable"
    """The cluster did not answer: timeout, connection reset, cluster down."""
    CORRUPT = "corrupt"
    """A value of the wrong length, or a header or payload checksum that does not match."""
    WRONG_KEY = "wrong_key"
    """A sound value that belongs to another block."""
    FOREIGN = "foreign"
    """A sound value written under another config fingerprint (layout, block size)."""
    MAC_MISMATCH = "mac_mismatch"
    """The keyed MAC is missing or wrong: written without this cache's key, or forged."""


class RemoteFetchFailed(TransferFailed):
    """A fetch from the shared tier that returned no data; `status` says why."""

    def __init__(self, what: str, cause: str, status: FetchStatus) -> None:
        super().__init__(what, cause)
        self.status = status


class RemotePublishFailed(TransferFailed):
    """A publish that did not land (the cluster refused it or did not answer)."""


@attrs.frozen
class RemoteIO:
    """One block of a batched publish (source) or fetch (destination)."""

    key: BlockHash
    buffer: torch.Tensor
    """uint8 CPU tensor of one block: a host page to publish, or one to fetch into."""
    meta: SlotMeta | None = None
    """A publish's restore metadata (parent, depth, reuse...), stored in the header."""
    ttl_s: float | None = None
    """A publish's time to live in seconds (the block's retention left); None: no expiry."""


RemoteOutcome = list[TransferFailed | None]
"""One entry per item of a batch, in order: None when it landed (verified, for a fetch)."""


class SharedStore(Protocol):
    """What the remote actors use of a shared store (the store, or a fault-injecting one)."""

    def publish_many(self, items: Sequence[RemoteIO]) -> RemoteOutcome: ...

    def fetch_many(self, items: Sequence[RemoteIO]) -> RemoteOutcome: ...

    def match_prefix(self, keys: Sequence[BlockHash]) -> int: ...


@attrs.frozen(kw_only=True)
class RemoteStatistics:
    published: int
    publish_failures: int
    fetches: int
    """Fetch attempts, whatever their outcome."""
    fetch_outcomes: dict[str, int]
    """FetchStatus value -> count (hits included)."""
    lookups: int
    """Keys asked about by :meth:`RedisClusterStore.present`."""


def _check_namespace(namespace: object) -> str:
    if (not isinstance(namespace, str) or not namespace or len(namespace) > 64
            or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in namespace)):
        raise ConfigError(
            "namespace", f"must be 1-64 ASCII letters, digits, '-', '_' or '.', got {namespace!r}"
        )
    return namespace


def _check_seconds(field: str, value: object, *, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(field, f"must be a finite number of seconds, got {value!r}")
    if not 0 < value <= high:
        raise ConfigError(field, f"must be in (0, {high}] seconds, got {value!r}")
    return float(value)


def _check_ttl(ttl_s: object) -> int | None:
    """`ttl_s` as Redis milliseconds (at least 1), or None for no expiry."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not math.isfinite(ttl_s):
        raise UsageError("ttl_s", f"must be None or a finite number of seconds, got {ttl_s!r}")
    if ttl_s <= 0:
        raise UsageError("ttl_s", f"must be > 0 (an expired block is not published), got {ttl_s}")
    return max(1, math.ceil(ttl_s * 1000))


class RedisClusterStore:
    """Blocks in a Redis Cluster, shared by every cache that opens the same cluster.

    ``url`` lists startup nodes (:func:`parse_cluster`: ``rediss://`` for TLS, ``user@`` for
    an ACL user; ``password`` and ``tls_ca_file`` separately); ``namespace`` prefixes every key
    (deployments sharing one cluster for other things keep theirs apart); ``mac_key`` (16-64
    bytes, held by every replica, never stored) signs every published block and refuses
    blocks without a valid MAC; ``timeout_s`` bounds every network wait, connect included,
    so a dead master costs a fetch at most that long, never a hang.

    Opening is all or nothing: it validates every argument, connects, and reads the
    cluster's slot map; any failure raises ConfigError naming the argument and leaves no
    connection open.
    """

    def __init__(
        self,
        url: str,
        config: CacheConfig,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        mac_key: bytes | None = None,
        timeout_s: float = 1.0,
        password: str | None = None,
        tls_ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise ConfigError("config", f"must be a CacheConfig, got {config!r}")
        target = parse_cluster(url)
        nodes = target.nodes
        if password is not None and (not isinstance(password, str) or not password):
            raise ConfigError("password", "must be a non-empty string or None")
        if tls_ca_file is not None and not target.tls:
            raise ConfigError("tls_ca_file", "a CA file is for TLS: use rediss:// URLs")
        self._target = target
        self._password = password
        self._tls_ca_file = None if tls_ca_file is None else os.fspath(tls_ca_file)
        self._namespace = _check_namespace(namespace)
        try:
            self._mac_key = check_mac_key("mac_key", mac_key)
        except UsageError as exc:
            raise ConfigError("mac_key", exc.args[0].split(": ", 1)[1]) from None
        self._timeout_s = _check_seconds("timeout_s", timeout_s, high=MAX_TIMEOUT_S)
        self._payload_len: Final = config.block_bytes
        layout = config.layout
        self._config_fp: Final = config_fingerprint(
            model_fingerprint=config.model_fingerprint,
            layout=(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype),
            block_size=config.block_size,
        )
        self._prefix: Final = f"{self._namespace}:{self._config_fp.hex()}:".encode()
        self._client = self._connect(nodes)
        self._lock = threading.Lock()
        self._published = 0
        self._publish_failures = 0
        self._fetches = 0
        self._lookups = 0
        self._outcomes: Counter[FetchStatus] = Counter()
        self._closed = False

    def _connect(self, nodes: Sequence[ClusterAddress]) -> Any:
        # redis-py's cluster client sends its first command (COMMAND) to a random node, so
        # with a master down a construction fails by chance; each attempt picks again.  A
        # refused connection costs nothing, a silent host one timeout per attempt.
        attempts = 4 * len(nodes)
        for attempt in range(attempts):
            try:
                # One retry per command: a connection reset by a restarted or failed-over
                # master is tried once more on a fresh connection; more would only stretch
                # a dead master's cost.
                client = RedisCluster(
                    startup_nodes=[
                        ClusterNode(n.host, n.port)  # type: ignore[no-untyped-call]
                        for n in nodes
                    ],
                    socket_timeout=self._timeout_s,
                    socket_connect_timeout=self._timeout_s,
                    username=self._target.username,
                    password=self._password,
                    ssl=self._target.tls,
                    ssl_ca_certs=self._tls_ca_file,
                    require_full_coverage=False,
                    socket_read_size=1 << 20,
                    retry=Retry(NoBackoff(), retries=1),
                )
                break
            except (RedisError, RedisClusterException, OSError) as exc:
                if _refused_credentials(exc):
                    raise ConfigError(
                        "password", f"the cluster refused the credentials (user "
                        f"{self._target.username or 'default'}): {type(exc).__name__}"
                    ) from None
                if attempt + 1 < attempts:
                    continue
                where = ", ".join(f"{n.host}:{n.port}" for n in nodes)
                raise ConfigError(
                    "url",
                    f"cannot reach a Redis Cluster at {where}: {type(exc).__name__}: {exc}",
                ) from None
        # One live master is enough to open: a dead one loses only the blocks it held (and
        # a ping of a random node failed the open one time in three with a master down).
        error: BaseException | None = None
        for node in client.get_primaries():  # type: ignore[no-untyped-call]
            try:
                client.ping(target_nodes=node)
                break
            except (RedisError, RedisClusterException, OSError) as exc:
                error = exc
        else:
            client.close()
            if error is not None and _refused_credentials(error):
                raise ConfigError("password", "the cluster refused the credentials (user "
                                  f"{self._target.username or 'default'})") from None
            raise ConfigError("url", f"the cluster does not answer: {error}") from None
        return client

    # --- properties -------------------------------------------------------------------------

    @property
    def config_fingerprint(self) -> bytes:
        return self._config_fp

    @property
    def timeout_s(self) -> float:
        """The bound on every network wait of one attempt (a call makes at most two)."""
        return self._timeout_s

    @property
    def payload_len(self) -> int:
        return self._payload_len

    def redis_key(self, key: BlockHash) -> bytes:
        """The Redis key a block lives under (fault injection and tools)."""
        check_key(key)
        return self._prefix + bytes(key).hex().encode()

    @property
    def client(self) -> Any:
        """The redis-py RedisCluster client (fault injection and tools, not the data path)."""
        return self._client

    def statistics(self) -> RemoteStatistics:
        with self._lock:
            return RemoteStatistics(
                published=self._published, publish_failures=self._publish_failures,
                fetches=self._fetches,
                fetch_outcomes={s.value: self._outcomes[s] for s in FetchStatus},
                lookups=self._lookups,
            )

    # --- publish ----------------------------------------------------------------------------

    def encode(self, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None) -> bytes:
        """The value of one block: header block then payload (no padding)."""
        check_key(key)
        check_block_tensor("src", src, self._payload_len, device_type="cpu")
        if meta is not None and not isinstance(meta, SlotMeta):
            raise UsageError("meta", f"must be a SlotMeta or None, got {meta!r:.80}")
        payload = host_view(src)
        header = SlotHeader(
            slot=REMOTE_SLOT, key=key, payload_len=self._payload_len,
            payload_crc=payload_checksum(payload), config=self._config_fp, meta=meta,
        )
        value = bytearray(HEADER_SIZE + self._payload_len)
        view = memoryview(value)
        header.pack_into(view[:HEADER_SIZE], mac_key=self._mac_key, payload=payload)
        view[HEADER_SIZE:] = payload
        return bytes(value)

    def publish(
        self, key: BlockHash, src: torch.Tensor, meta: SlotMeta | None = None,
        ttl_s: float | None = None,
    ) -> None:
        """Publish one block.  raises: RemotePublishFailed; UsageError for a caller's bug."""
        failure = self.publish_many([RemoteIO(key, src, meta, ttl_s)])[0]
        if failure is not None:
            raise failure

    def publish_many(self, items: Sequence[RemoteIO]) -> RemoteOutcome:
        """Publish a batch in one cluster pipeline (one round trip per master).

        Never raises TransferFailed: each item's failure is its entry.  UsageError for a
        caller's bug (bad key, buffer, TTL), before anything is sent.
        """

        self._check_open()
        encoded = [
            (self.redis_key(item.key), self.encode(item.key, item.buffer, item.meta),
             _check_ttl(item.ttl_s))
            for item in items
        ]
        out: RemoteOutcome = []
        results = self._pipelined(
            [rkey for rkey, _, _ in encoded],
            lambda pipe, n: pipe.set(encoded[n][0], encoded[n][1], px=encoded[n][2]),
        )
        for item, result in zip(items, results, strict=True):
            if isinstance(result, BaseException) or result is not True:
                out.append(RemotePublishFailed(
                    f"remote block {bytes(item.key).hex()[:16]}",
                    f"publish failed: {type(result).__name__}: {result}",
                ))
            else:
                out.append(None)
        with self._lock:
            failed = sum(1 for o in out if o is not None)
            self._published += len(out) - failed
            self._publish_failures += failed
        return out

    # --- lookup -----------------------------------------------------------------------------

    def present(self, keys: Sequence[BlockHash]) -> list[bool]:
        """Which of `keys` the cluster holds now (a hint: a key may leave before its fetch).

        A master that does not answer reads as holding nothing.
        """

        self._check_open()
        rkeys = [self.redis_key(k) for k in keys]
        with self._lock:
            self._lookups += len(rkeys)
        results = self._pipelined(rkeys, lambda pipe, n: pipe.exists(rkeys[n]))
        return [r == 1 for r in results]

    def match_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many leading blocks of a chain the cluster holds now (a hint, as `present`)."""
        found = 0
        for here in self.present(keys):
            if not here:
                break
            found += 1
        return found

    # --- fetch ------------------------------------------------------------------------------

    def decode_into(self, key: BlockHash, value: object, dst: torch.Tensor) -> None:
        """Verify one value fully, then copy its payload into `dst`.

        raises: RemoteFetchFailed (dst untouched) unless the value is this block's, whole and
        sound.
        """
        what = f"remote block {bytes(key).hex()[:16]}"
        if value is None:
            raise RemoteFetchFailed(what, "no such key (never published, expired, evicted, "
                                    "or its master is gone)", FetchStatus.MISSING)
        if not isinstance(value, bytes):
            raise RemoteFetchFailed(what, f"the cluster answered {type(value).__name__}",
                                    FetchStatus.CORRUPT)
        expected = HEADER_SIZE + self._payload_len
        if len(value) != expected:
            kind = "short" if len(value) < expected else "long"
            raise RemoteFetchFailed(what, f"{kind} value: {len(value)} bytes, expected "
                                    f"{expected}", FetchStatus.CORRUPT)
        view = memoryview(value)
        try:
            header = SlotHeader.unpack(view[:HEADER_SIZE], what=what)
        except TransferFailed as exc:
            raise RemoteFetchFailed(what, exc.cause, FetchStatus.CORRUPT) from None
        if header.key != key:
            raise RemoteFetchFailed(
                what, f"value holds block {header.key.hex()[:16]}...", FetchStatus.WRONG_KEY
            )
        if header.config != self._config_fp:
            raise RemoteFetchFailed(
                what, "value written under another config fingerprint", FetchStatus.FOREIGN
            )
        payload = view[HEADER_SIZE:]
        try:
            verify_header(header, what=what, slot=REMOTE_SLOT, key=key,
                          payload_len=self._payload_len)
            verify_checksum(header, payload_checksum(payload, version=header.version),
                            what=what)
        except TransferFailed as exc:
            raise RemoteFetchFailed(what, exc.cause, FetchStatus.CORRUPT) from None
        try:
            verify_mac(self._mac_key, view[:HEADER_SIZE], header, payload, what=what)
        except MacMismatch as exc:
            raise RemoteFetchFailed(what, exc.cause, FetchStatus.MAC_MISMATCH) from None
        host_view(dst)[:] = payload

    def fetch(self, key: BlockHash, dst: torch.Tensor) -> None:
        """Fill `dst` with one block, verified.  raises: RemoteFetchFailed (dst untouched)."""
        failure = self.fetch_many([RemoteIO(key, dst)])[0]
        if failure is not None:
            raise failure

    def fetch_many(self, items: Sequence[RemoteIO]) -> RemoteOutcome:
        """Fetch a batch in one cluster pipeline; outcomes as for :meth:`publish_many`.

        A failed item's destination is untouched, and never holds unverified bytes.
        """

        self._check_open()
        for item in items:
            check_key(item.key)
            check_block_tensor("dst", item.buffer, self._payload_len, device_type="cpu")
        rkeys = [self.redis_key(item.key) for item in items]
        results = self._pipelined(rkeys, lambda pipe, n: pipe.get(rkeys[n]))
        out: RemoteOutcome = []
        statuses: list[FetchStatus] = []
        for item, result in zip(items, results, strict=True):
            try:
                if isinstance(result, BaseException):
                    raise RemoteFetchFailed(
                        f"remote block {bytes(item.key).hex()[:16]}",
                        f"the cluster did not answer: {type(result).__name__}: {result}",
                        FetchStatus.UNAVAILABLE,
                    )
                self.decode_into(item.key, result, item.buffer)
            except RemoteFetchFailed as exc:
                out.append(exc)
                statuses.append(exc.status)
            else:
                out.append(None)
                statuses.append(FetchStatus.HIT)
        with self._lock:
            self._fetches += len(items)
            self._outcomes.update(statuses)
        return out

    def forget(self, keys: Sequence[BlockHash]) -> None:
        """Delete blocks from the cluster (an invalidation; missing keys are fine).

        raises: TransferFailed when the cluster does not answer.
        """

        self._check_open()
        rkeys = [self.redis_key(k) for k in keys]
        try:
            pipe = self._client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.delete(rkey)
            pipe.execute()
        except (RedisError, RedisClusterException, OSError) as exc:
            raise TransferFailed("remote blocks", f"delete failed: {exc}") from None

    def _pipelined(self, rkeys: Sequence[bytes], queue: Callable[[Any, int], object],
                   ) -> list[object]:
        """One command per key, pipelined: the result or the exception of each, in order.

        redis-py's cluster pipeline fails every command of a pipeline when one master's
        connection fails: after such a failure the keys are tried again with one pipeline
        per master, which keeps a dead master's failure to its own blocks.  (A command that
        landed on a live master is sent twice then: a GET, EXISTS or SET of the same value,
        all idempotent.)  MOVED and ASK answers inside a pipeline are followed by redis-py.
        """

        results: list[object] = [None] * len(rkeys)
        # All masters at once first: the pipeline sends to every master before it reads.
        try:
            pipe = self._client.pipeline(transaction=False)
            for n in range(len(rkeys)):
                queue(pipe, n)
            return list(pipe.execute(raise_on_error=False))
        except (RedisError, RedisClusterException, OSError):
            pass
        groups: dict[str, list[int]] = {}
        for n, rkey in enumerate(rkeys):
            try:
                name = self._client.get_node_from_key(rkey).name
            except (RedisError, RedisClusterException) as exc:
                results[n] = exc  # no master is known for the slot
                continue
            groups.setdefault(name, []).append(n)
        for members in groups.values():
            try:
                pipe = self._client.pipeline(transaction=False)
                for n in members:
                    queue(pipe, n)
                got = pipe.execute(raise_on_error=False)
            except (RedisError, RedisClusterException, OSError) as exc:
                got = [exc] * len(members)
            for n, result in zip(members, got, strict=True):
                results[n] = result
        return results

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("store", "the remote store is closed")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> RedisClusterStore:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _refused_credentials(exc: BaseException) -> bool:
    """Whether the cluster said no to the credentials (not a network failure: retrying
    another node would only repeat it)."""
    text = str(exc)
    return (isinstance(exc, AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text
            or "invalid username-password" in text or "Authentication required" in text
            # Redis 7 refuses the client's first command (HELLO) this way without AUTH.
            or "HELLO must be called with the client already authenticated" in text)
