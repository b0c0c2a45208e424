"""The prefix index: which cached block holds the content of each chained key.

Owns the map from a block's chained key to its record and the count of indexed children of
each parent key, and answers the one question matching asks: how long is the cached prefix
of a request's prompt.  It is separate because it is the only structure keyed by content:
every tier holds indexed blocks, and a block stays indexed while it moves between tiers.
A key maps to at most one record: content is cached once, wherever it is.
"""

from __future__ import annotations

from collections.abc import Iterator

from statekv.arith import matchable_blocks
from statekv.block import Block
from statekv.hashing import extend_chain
from statekv.ids import BlockHash
from statekv.requests import Request


class PrefixIndex:
    """Chained key -> the block caching that content, with child counts per parent key."""

    __slots__ = ("block_size", "blocks", "children")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[BlockHash, Block] = {}
        self.children: dict[BlockHash, int] = {}

    def extend_keys(self, req: Request, upto: int) -> None:
        if len(req.keys) < upto:
            extend_chain(req.keys, req.root, req.encoded, self.block_size, upto)

    def lookup(self, req: Request) -> list[Block]:
        """The cached blocks of the longest matching prefix (no state is changed).

        Keys of every matchable block are computed at once: commit needs them anyway.
        """
        limit = matchable_blocks(req.num_tokens, self.block_size)
        self.extend_keys(req, limit)
        get = self.blocks.get
        matched: list[Block] = []
        for key in req.keys:
            block = get(key)
            if block is None:
                break
            matched.append(block)
        return matched

    def remote_run(self, req: Request, start: int, remote: frozenset[bytes]) -> int:
        """How many blocks from `start` on the shared tier holds (per `remote`).  A key that
        is cached locally ends the run: one key, one record."""
        if not remote:
            return 0
        index = self.blocks
        n = 0
        for key in req.keys[start:]:
            if key not in remote or key in index:
                break
            n += 1
        return n

    def committed_content(self, req: Request) -> Iterator[Block]:
        """The cached block of each of `req`'s committed blocks, in prefix order: the block
        itself, or, for a private duplicate, its cached twin (when there is one)."""
        blocks, keys, index = req.blocks, req.keys, self.blocks
        for i in range(req.committed):
            block = blocks[i]
            target = block if block.key is not None else index.get(keys[i])
            if target is not None:
                yield target

    def add(self, block: Block, key: BlockHash, parent: BlockHash) -> None:
        """Index `block` as the content of `key` (the block after `parent`)."""
        block.key = key
        block.parent_key = parent
        self.blocks[key] = block
        self.children[parent] = self.children.get(parent, 0) + 1

    def remove(self, block: Block) -> None:
        """Remove a block from the prefix index (its content is leaving or failing)."""
        key = block.key
        if key is None:
            return
        del self.blocks[key]
        parent = block.parent_key
        assert parent is not None
        left = self.children[parent] - 1
        if left:
            self.children[parent] = left
        else:
            del self.children[parent]
        block.key = block.parent_key = None

    def remove_all(self, blocks: list[Block]) -> None:
        """remove for a run of blocks (GPU victims evicted by one allocation), in one pass."""
        index, children = self.blocks, self.children
        for block in blocks:
            key = block.key
            if key is None:
                continue
            del index[key]
            parent = block.parent_key
            assert parent is not None
            left = children[parent] - 1
            if left:
                children[parent] = left
            else:
                del children[parent]
            block.key = block.parent_key = None
