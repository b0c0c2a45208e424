"""One serving replica's side of the shared tier, run as its own process by the tests.

    python -m tests.remote_replica publish URL NAMESPACE OUT.json
    python -m tests.remote_replica onboard URL NAMESPACE IN.json OUT.json

``publish`` prefills a prompt with the tiny model (statekv_models, CPU), publishes every full
block of its KV pool through the RemotePublisher actor, and writes each block's SHA-256.
``onboard`` (another process, its own model and pool) onboards the same prompt's prefix from
the cluster through the RemoteFetcher actor, checks every served block against the
publisher's digests, then decodes the prompt's tail on top of the fetched prefix and on top
of its own prefill, and compares the logits.  Both write what they saw as JSON.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import trio

from io_actors.backends.redis_store import RedisClusterStore
from io_actors.remote_fetcher import RemoteFetcher
from io_actors.remote_publisher import RemotePublisher
from models.config import preset
from models.model import Chunk, PagedDecoder
from statekv.block import Block
from statekv.config import CacheConfig, KVLayout
from statekv.hashing import extend_chain, root_key, token_bytes
from statekv.ids import BlockHash, BlockId
from statekv.policies import FetchCost

BLOCK_SIZE = 16
PROMPT = [(7 * i + 3) % 97 for i in range(6 * BLOCK_SIZE + 5)]
"""Six full blocks and five tokens of a seventh (never shared: not a full block)."""


def setup() -> tuple[PagedDecoder, CacheConfig, list[BlockHash]]:
    model = PagedDecoder(preset("tiny"))
    c = model.config
    config = CacheConfig(
        block_size=BLOCK_SIZE, gpu_blocks=16, model_fingerprint=c.fingerprint(),
        layout=KVLayout(num_layers=c.num_layers, num_kv_heads=model.num_kv_heads,
                        head_dim=c.head_dim, dtype="float32"),
    )
    keys: list[BlockHash] = []
    extend_chain(keys, root_key(config.model_fingerprint, "tenant-1", None),
                 token_bytes(PROMPT), BLOCK_SIZE, len(PROMPT) // BLOCK_SIZE)
    return model, config, keys


def page_bytes(pool: torch.Tensor, page: int) -> torch.Tensor:
    return pool[page].contiguous().view(torch.uint8).reshape(-1)


def publish(url: str, namespace: str, out: Path) -> None:
    model, config, keys = setup()
    pages = len(PROMPT) // BLOCK_SIZE + 1
    pool = model.new_pool(pages, BLOCK_SIZE)
    model.forward(pool, [Chunk(token_ids=PROMPT, start=0, block_table=list(range(pages)))])
    digests = [hashlib.sha256(page_bytes(pool, i).numpy().tobytes()).hexdigest()
               for i in range(len(keys))]

    async def main() -> list[str]:
        with RedisClusterStore(url, config, namespace=namespace) as store:
            publisher = RemotePublisher(store, config)
            offers = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publisher.run)
                for i, key in enumerate(keys):
                    block = Block(id=BlockId(i), key=key, depth=i,
                                  parent_key=keys[i - 1] if i else None)
                    offers.append(publisher.offer(block, page_bytes(pool, i), now=0.0,
                                                  wall_now=time.time()).value)
                publisher.close()
            assert publisher.statistics().published == len(keys), publisher.statistics()
            return offers

    offers = trio.run(main)
    out.write_text(json.dumps({"digests": digests, "offers": offers}))


def onboard(url: str, namespace: str, published: Path, out: Path) -> None:
    model, config, keys = setup()
    digests = json.loads(published.read_text())["digests"]
    pages = len(PROMPT) // BLOCK_SIZE + 1
    pool = model.new_pool(pages, BLOCK_SIZE, fill=float("nan"))
    # A fast network against a slow prefill: fetching wins.
    cost = FetchCost(network_bytes_per_s=1e9, prefill_tokens_per_s=1e3)

    async def main() -> tuple[int, int]:
        with RedisClusterStore(url, config, namespace=namespace) as store:
            fetcher = RemoteFetcher(store, config, cost)
            staging = [torch.empty(config.block_bytes, dtype=torch.uint8) for _ in keys]
            result = await fetcher.onboard(keys, staging)
            for i in range(result.served):
                page_bytes_view = pool[i].view(torch.uint8).reshape(-1)
                page_bytes_view.copy_(staging[i])
            return result.matched, result.served

    matched, served = trio.run(main)
    same = [hashlib.sha256(page_bytes(pool, i).numpy().tobytes()).hexdigest() == digests[i]
            for i in range(served)]
    # Decode the tail on top of the fetched prefix; then on this process's own prefill of
    # the prompt (what it would have computed without the shared tier), the same way.
    start = served * BLOCK_SIZE
    table = list(range(pages))
    tail = model.forward(pool, [Chunk(token_ids=PROMPT[start:], start=start,
                                      block_table=table)]).last_logits
    own = model.new_pool(pages, BLOCK_SIZE)
    full = model.forward(own, [Chunk(token_ids=PROMPT, start=0, block_table=table)]).last_logits
    own_tail = model.forward(own, [Chunk(token_ids=PROMPT[start:], start=start,
                                         block_table=table)]).last_logits
    out.write_text(json.dumps({
        "matched": matched, "served": served, "same_bytes": same,
        "tail_equal": bool(torch.equal(tail, own_tail)),
        "tail_vs_full_prefill": float((tail - full).abs().max()),
    }))


def main(argv: list[str]) -> int:
    if argv[:1] == ["publish"] and len(argv) == 4:
        publish(argv[1], argv[2], Path(argv[3]))
        return 0
    if argv[:1] == ["onboard"] and len(argv) == 5:
        onboard(argv[1], argv[2], Path(argv[3]), Path(argv[4]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

