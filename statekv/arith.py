"""Small pure functions whose arithmetic must be exactly right.

Each carries CrossHair contracts (``pre:`` / ``post:``) that ``make test`` checks over all
paths within a bounded time; the manager uses these functions rather than inlining the
arithmetic, so the checked code is the code that runs.
"""

from __future__ import annotations

import math


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (the last one may be partly filled).

    pre: num_tokens >= 0 and block_size >= 1
    post: __return__ * block_size >= num_tokens
    post: __return__ == 0 or (__return__ - 1) * block_size < num_tokens
    """
    return -(-num_tokens // block_size)


def full_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks completely filled by `num_tokens` tokens (only these can be shared).

    pre: num_tokens >= 0 and block_size >= 1
    post: __return__ * block_size <= num_tokens < (__return__ + 1) * block_size
    """
    return num_tokens // block_size


def matchable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks a prompt may take from the cache.

    The last prompt token is always computed (its logits start generation), so a prompt
    whose every block is cached still leaves its last block's last token to compute.

    pre: num_prompt_tokens >= 1 and block_size >= 1
    post: __return__ * block_size <= num_prompt_tokens - 1
    post: (__return__ + 1) * block_size > num_prompt_tokens - 1
    """
    return (num_prompt_tokens - 1) // block_size


def expiry_after(now: float, ttl_seconds: float) -> float:
    """The retention deadline of content stamped at `now` with a TTL.

    pre: math.isfinite(now) and math.isfinite(ttl_seconds) and ttl_seconds > 0
    pre: abs(now) < 1e15 and ttl_seconds < 1e12
    post: __return__ > now
    """
    deadline = now + ttl_seconds
    # Far from zero, adding a TTL much smaller than the ulp of `now` would round back to
    # `now` and stamp content that is already expired; never let that happen.
    return deadline if deadline > now else math.nextafter(now, math.inf)


def is_live(expiry: float | None, now: float) -> bool:
    """Whether a retention stamp still protects its content at `now`.

    The deadline itself is the first instant at which the content is no longer retained.

    post: __return__ == (expiry is not None and now < expiry)
    """
    return expiry is not None and now < expiry


def retention_order(expiry: float, depth: int, seq: int) -> tuple[float, int, int]:
    """Sort key of a retained disk block: displaced earliest-first on this key.

    Exact expiry order; among equal expiries a suffix (deeper block) goes before its prefix;
    among equals again, first in first out.

    pre: depth >= 0 and seq >= 0
    post: __return__ < retention_order(expiry, depth - 1, seq) if depth >= 1 else True
    post: __return__ < retention_order(expiry, depth, seq + 1)
    """
    return (expiry, -depth, seq)
