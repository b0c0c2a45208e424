"""Typed identifiers.

Every id that crosses a module boundary has its own type, so that a slot number can never be
passed where a GPU page is expected without mypy noticing.
"""

from typing import NewType

BlockId = NewType("BlockId", int)
"""A content record (a node of the prefix tree, or a private block of one request)."""

PageId = NewType("PageId", int)
"""A page of KV memory in the GPU pool or in the pinned host pool."""

SlotId = NewType("SlotId", int)
"""A fixed disk slot: disk blocks are poolless, a slot number names where the bytes live."""

RequestId = NewType("RequestId", str)
"""The caller's name for one request."""

BlockHash = NewType("BlockHash", bytes)
"""Chained content hash of one full block (see statekv.hashing)."""

TransferId = NewType("TransferId", int)
"""One disk read or write in flight; completions name it."""
