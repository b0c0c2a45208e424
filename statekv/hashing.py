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
from typing import Final

from statekv.errors import UsageError
from statekv.ids import BlockHash

DIGEST_SIZE: Final = 32
_ROOT_PERSON: Final = b"statekv-root-v1"
_BLOCK_PERSON: Final = b"statekv-blk-v1"
_NEEDS_BYTESWAP: Final = sys.byteorder != "little"
MAX_TOKEN_ID: Final = 2**32 - 1


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
    if _NEEDS_BYTESWAP:
        arr.byteswap()
    return arr.tobytes()


def chain_key(parent: BlockHash, block_tokens: bytes) -> BlockHash:
    """Key of a block from its parent's key and its canonical token bytes."""
    return BlockHash(
        hashlib.blake2b(parent + block_tokens, digest_size=DIGEST_SIZE, person=_BLOCK_PERSON)
        .digest()
    )
