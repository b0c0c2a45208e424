"""The admitted requests: each one's token sequence, block table and onboarding progress.

Owns the request records (:class:`Request`), the table of admitted ones and the gauge of
parked ones (admitted, with reads or fetches not landed).  It is separate because requests
and blocks divide cleanly: a request holds blocks (its table) and counts the ones it still
waits for; what happens to a block's storage is the other concerns' business.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from statekv.block import Block
from statekv.config import CacheConfig, is_utf8_encodable
from statekv.errors import UsageError
from statekv.hashing import root_key, token_bytes
from statekv.ids import BlockHash, PageId, RequestId

_MAX_LORA_ID = 2**63 - 1


@attrs.define(eq=False, slots=True)
class Request:
    id: RequestId
    encoded: bytearray
    num_tokens: int
    root: BlockHash
    ttl: float | None
    priority: int
    keys: list[BlockHash] = attrs.field(factory=list)
    blocks: list[Block] = attrs.field(factory=list)
    pages: list[PageId] = attrs.field(factory=list)
    num_computed: int = 0
    committed: int = 0
    """Blocks [0, committed) are full and were offered to the prefix index."""
    pending: int = 0
    """Blocks of this request whose onboard read or fetch has not landed."""


@attrs.frozen(slots=True)
class QueuedRecord:
    """What a queued request's first ``prefetch`` was given, and the record it made.

    A serving loop asks again every step for the reads that could not start (host pages come
    back as spills land); for a 17,664-token prompt the token checks, encoding and keys were
    0.5 ms a call on the CPU machine, 4.2 ms a step for 8 queued requests.  A repeat call
    with the *same tuple object* (immutable, checked at the first call) and the same salt
    and adapter objects takes this record instead; any other argument is checked anew."""

    token_ids: object
    cache_salt: str | None
    lora_id: int | None
    request: Request

    def same_call(self, token_ids: object, cache_salt: object, lora_id: object) -> bool:
        return (type(token_ids) is tuple and token_ids is self.token_ids
                and cache_salt is self.cache_salt and lora_id is self.lora_id)


class RequestTable:
    """The admitted requests by id, and how many of them are parked."""

    __slots__ = ("config", "live", "parked")

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.live: dict[RequestId, Request] = {}
        self.parked = 0

    def get(self, request_id: str) -> Request:
        if type(request_id) is str:  # the common case first: every step looks a request up
            # (a str is a RequestId here; RequestId() would cost a call)
            req: Request | None = self.live.get(request_id)  # type: ignore[call-overload]
            if req is not None:
                return req
        if not isinstance(request_id, str):
            raise UsageError("request_id", f"must be a string, got {request_id!r}")
        req = self.live.get(RequestId(request_id))
        if req is None:
            raise UsageError("request_id", f"unknown request {request_id!r}")
        return req

    def check_new_id(self, request_id: object) -> RequestId:
        if not isinstance(request_id, str) or not request_id:
            raise UsageError("request_id", f"must be a non-empty string, got {request_id!r}")
        if not is_utf8_encodable(request_id):  # the rule for every text field (cache_salt)
            raise UsageError("request_id", f"must be encodable as UTF-8, got {request_id!r}")
        if request_id in self.live:
            raise UsageError("request_id", f"request {request_id!r} already exists")
        return RequestId(request_id)

    def new_record(
        self, rid: RequestId, token_ids: Sequence[int], cache_salt: str | None,
        lora_id: int | None, ttl: float | None, priority: int,
    ) -> Request:
        """A request record for `token_ids`, every argument checked (nothing changed)."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise UsageError("cache_salt", f"must be a string or None, got {cache_salt!r}")
        if cache_salt is not None and not is_utf8_encodable(cache_salt):
            raise UsageError("cache_salt", f"must be encodable as UTF-8, got {cache_salt!r}")
        if lora_id is not None and (
            isinstance(lora_id, bool) or not isinstance(lora_id, int)
            or not 0 <= lora_id <= _MAX_LORA_ID
        ):
            raise UsageError("lora_id", f"must be a non-negative integer or None, got {lora_id!r}")
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
            raise UsageError("token_ids", "must be a sequence of integer token ids")
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise UsageError("token_ids", "a request needs at least one token")
        config = self.config
        capacity_tokens = config.gpu_blocks * config.block_size
        if num_tokens > capacity_tokens:
            raise UsageError(
                "token_ids",
                f"{num_tokens} tokens do not fit in {config.gpu_blocks} GPU blocks "
                f"of {config.block_size} tokens",
            )
        encoded = bytearray(token_bytes(token_ids))
        return Request(
            id=rid, encoded=encoded, num_tokens=num_tokens,
            root=root_key(config.model_fingerprint, cache_salt, lora_id),
            ttl=ttl, priority=priority,
        )

    @staticmethod
    def from_queued(queued: Request, ttl: float | None, priority: int) -> Request:
        """A request record for the prompt a queued request's prefetch already checked,
        encoded and keyed (QueuedRecord): the same bytes and keys, copied, so the queued
        record stays as it was (an add_request that raises OutOfBlocks changes nothing).
        Keys are a function of the root and the tokens alone: reusing them is exact."""
        return Request(
            id=queued.id, encoded=bytearray(queued.encoded), num_tokens=queued.num_tokens,
            root=queued.root, ttl=ttl, priority=priority, keys=list(queued.keys),
        )

    def wake_waiters(self, block: Block) -> None:
        """`block`'s transfer landed: each request waiting for it waits for one block less."""
        live = self.live
        for rid in block.waiters:
            req = live[rid]
            req.pending -= 1
            if req.pending == 0:
                self.parked -= 1
        block.waiters.clear()
