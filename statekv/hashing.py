"""Chained block keys: stable across processes, collision-resistant, tenant-separated.

A full block's key is ``blake2b-256(parent key || its token ids as little-endian uint32)``.
The first block's parent is a *root* key that encodes everything besides tokens that makes KV
reusable or not: the model fingerprint (KV computed with other weights is never reused), the
per-tenant cache salt and the LoRA adapter id.  Because every key chains from its root, two
tenants with different salts never share a block, even for identical tokens.

Python's ``hash()`` is never used: it is salted per process (a restart would find no keys) and
is not collision-resistant (a crafted collision would serve one tenant another's KV).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Final, cast

from statekv.errors import UsageError
from statekv.ids import BlockHash

DIGEST_SIZE: Final = 32
_ROOT_PERSON: Final = b"statekv-root-v1"
_NEEDS_BYTESWAP: Final = sys.byteorder != "little"
MAX_TOKEN_ID: Final = 2**32 - 1
_blake2b = hashlib.blake2b


def _length_prefixed(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def root_key(model_fingerprint: str, cache_salt: str | None, lora_id: int | None) -> BlockHash:
    """The key every chain of one (model, tenant, adapter) starts from."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_ROOT_PERSON)
    h.update(_length_prefixed(model_fingerprint.encode()))
    # None and "" are different tenants: a presence byte keeps them apart.
    h.update(b"\x00" if cache_salt is None else b"\x01" + _length_prefixed(cache_salt.encode()))
    h.update(b"\x00" if lora_id is None else b"\x01" + lora_id.to_bytes(8, "little", signed=True))
    return BlockHash(h.digest())


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Canonical encoding of token ids: little-endian uint32.

    raises: UsageError
    """
    try:
        arr = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise UsageError("token_ids", f"token ids must be integers in [0, 2**32): {exc}") from None
    raw = arr.tobytes()
    at = _first_bool(tokens, raw)
    if at is not None:
        raise UsageError("token_ids", f"token ids must be integers, not bool "
                                      f"(token_ids[{at}] is {tokens[at]!r})")
    if _NEEDS_BYTESWAP:
        arr.byteswap()
        return arr.tobytes()
    return raw


_ZERO: Final = array("I", [0]).tobytes()
_ONE: Final = array("I", [1]).tobytes()
_FEW_CANDIDATES: Final = 32


def _first_bool(tokens: Sequence[int], raw: bytes) -> int | None:
    """The index of the first bool among `tokens`, whose native uint32 encoding is `raw`.

    array() takes True and False as 1 and 0: a bool among token ids is a caller's bug (a
    mask passed for ids), never a token.  Only an entry encoded as 0 or 1 can be one, so
    bytes.find (memchr speed) finds the candidates and only those are typed; a match not on
    an entry's boundary is skipped.  Past a few matches (a padded prompt) one typing pass
    in C over every entry is quicker: ``type`` through ``map``, about 30 ns a token on the
    CPU machine, three quarters of the whole encoding's time when done for every prompt."""
    candidates: list[int] = []
    matches = 0
    for pattern in (_ZERO, _ONE):
        at = raw.find(pattern)
        while at != -1:
            matches += 1
            if matches > _FEW_CANDIDATES:  # many (on a boundary or across two entries)
                if bool not in map(type, tokens):
                    return None
                return next(i for i, t in enumerate(tokens) if type(t) is bool)
            if not at & 3:
                candidates.append(at >> 2)
            at = raw.find(pattern, at + 1)
    bools = [i for i in candidates if type(tokens[i]) is bool]
    return min(bools) if bools else None


def chain_key(parent: BlockHash, block_tokens: bytes | bytearray) -> BlockHash:
    """Key of a block from its parent's key and its canonical token bytes.

    Unlike the root, block keys carry no personalization string: every chain starts from a
    personalized root, which already separates statekv's key space, and passing `person`
    costs a third of the whole call (measured by bench.core).
    """
    return BlockHash(_blake2b(parent + block_tokens, digest_size=DIGEST_SIZE).digest())


def extend_chain(
    keys: list[BlockHash], root: BlockHash, encoded_tokens: bytes | bytearray, block_size: int,
    upto: int,
) -> None:
    """Append to `keys` the keys of full blocks ``len(keys) .. upto-1`` of a sequence.

    `keys` holds the keys of the sequence's first blocks (it may be empty); the loop is the
    hot path of every prefix lookup and commit, so it calls blake2b directly.
    """
    step = 4 * block_size
    key: bytes = keys[-1] if keys else root
    digest = _blake2b
    raw = cast(list[bytes], keys)
    size = DIGEST_SIZE
    for i in range(len(keys), upto):
        key = digest(key + encoded_tokens[i * step:(i + 1) * step], digest_size=size).digest()
        raw.append(key)
