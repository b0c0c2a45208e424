"""One serving replica's side of the shared tier, run as its own process by the tests.

    python -m tests.remote_replica publish URL NAMESPACE OUT.json
    python -m tests.remote_replica onboard URL NAMESPACE IN.json OUT.json
    python -m tests.remote_replica cache-publish URL NAMESPACE OUT.json
    python -m tests.remote_replica cache-serve URL NAMESPACE IN.json OUT.json

``publish`` prefills a prompt with the tiny model (statekv_models, CPU), publishes every full
block of its KV pool through the RemotePublisher actor, and writes each block's SHA-256.
``onboard`` (another process, its own model and pool) onboards the same prompt's prefix from
the cluster through the RemoteFetcher actor, checks every served block against the
publisher's digests, then decodes the prompt's tail on top of the fetched prefix and on top
of its own prefill, and compares the logits.  Both write what they saw as JSON.

``cache-publish`` and ``cache-serve`` do the same through two whole caches (BlockingCache,
each with its own GPU and host tiers, ``remote_url`` set): A computes the prompt and serves
other work until the prompt's blocks are evicted to host, which publishes them; B's
``add_request`` finds them in the shared tier, fetches them (its request parked until they
land, ``wait_ready``), and serves them byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import trio

from io_actors.actors.remote_fetcher import RemoteFetcher
from io_actors.actors.remote_publisher import RemotePublisher
from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from io_actors.storage.redis_store import RedisClusterStore
from models.config import preset
from models.model import Chunk, PagedDecoder
from statekv.config import CacheConfig, KVLayout
from statekv.hashing import extend_chain, root_key, token_bytes
from statekv.ids import BlockHash, BlockId, PageId
from statekv.messages import PublishBlock
from tests.io_helpers import TEST_REMOTE_SECRET

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
                    block = PublishBlock(
                        block=BlockId(i), key=key, host_page=PageId(i), depth=i,
                        parent=keys[i - 1] if i else BlockHash(bytes(32)), reuse_count=0,
                        expiry=None)
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

    async def main() -> tuple[int, int]:
        with RedisClusterStore(url, config, namespace=namespace) as store:
            fetcher = RemoteFetcher(store, config)
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


GPU_BLOCKS = 10


def cache_config(url: str, namespace: str, config: CacheConfig) -> StateKVConfig:
    """One replica's cache: small GPU and host tiers, the shared tier on `url`."""
    return StateKVConfig(
        layout=config.layout, block_size=BLOCK_SIZE, gpu=GPU_BLOCKS, host=16, device="cpu",
        model_fingerprint=config.model_fingerprint, remote_url=url,
        remote_secret=TEST_REMOTE_SECRET,
        remote_namespace=namespace, remote_timeout_s=0.5,
    )


def digest(pool: torch.Tensor, page: int) -> str:
    return hashlib.sha256(page_bytes(pool, page).numpy().tobytes()).hexdigest()


def cache_publish(url: str, namespace: str, out: Path) -> None:
    """Replica A: compute the prompt, then other work that evicts it to host (published)."""
    model, config, _keys = setup()
    full = len(PROMPT) // BLOCK_SIZE
    with BlockingCache(cache_config(url, namespace, config)) as cache:
        cache.add_request("a", PROMPT, cache_salt="tenant-1")
        cache.allocate_nowait("a", len(PROMPT))
        table = list(cache.block_table("a"))
        model.forward(cache.kv_pool, [Chunk(token_ids=PROMPT, start=0, block_table=table)])
        cache.commit("a", len(PROMPT))
        digests = [digest(cache.kv_pool, table[i]) for i in range(full)]
        cache.release("a")
        filler = [200 + i % 50 for i in range(GPU_BLOCKS * BLOCK_SIZE)]
        cache.add_request("other", filler)
        cache.allocate_nowait("other", len(filler))  # every GPU page: A's go to host
        cache.release("other")
        offered = cache.statistics().cache.publishes_offered
    out.write_text(json.dumps({"digests": digests, "offered": offered}))


def cache_serve(url: str, namespace: str, published: Path, out: Path) -> None:
    """Replica B: the same prompt through add_request / wait_ready, served from the tier."""
    model, config, _keys = setup()
    digests = json.loads(published.read_text())["digests"]
    with BlockingCache(cache_config(url, namespace, config)) as cache:
        match = cache.add_request("b", PROMPT, cache_salt="tenant-1")
        ready = cache.wait_ready("b", timeout=60)
        status = cache.request_status("b")
        table = list(cache.block_table("b"))
        served = status.num_computed_tokens // BLOCK_SIZE
        same = [digest(cache.kv_pool, table[i]) == digests[i] for i in range(served)]
        # Decode the tail on the fetched prefix, and on this replica's own prefill.
        cache.allocate_nowait("b", len(PROMPT))
        table = list(cache.block_table("b"))
        start = served * BLOCK_SIZE
        tail = model.forward(cache.kv_pool, [Chunk(token_ids=PROMPT[start:], start=start,
                                                   block_table=table)]).last_logits
        pages = len(table)
        own = model.new_pool(pages, BLOCK_SIZE)
        own_table = list(range(pages))
        model.forward(own, [Chunk(token_ids=PROMPT[:start], start=0, block_table=own_table)])
        own_tail = model.forward(own, [Chunk(token_ids=PROMPT[start:], start=start,
                                             block_table=own_table)]).last_logits
        cache.release("b")
        other = cache.add_request("c", PROMPT, cache_salt="tenant-2")
        cache.release("c")
        stats = cache.statistics().cache
    out.write_text(json.dumps({
        "remote_tokens": match.remote_tokens, "ready": ready, "served": served,
        "same_bytes": same, "tail_equal": bool(torch.equal(tail, own_tail)),
        "fetches_completed": stats.fetches_completed, "fetch_failures": stats.fetch_failures,
        "other_tenant_remote_tokens": other.remote_tokens,
    }))


def main(argv: list[str]) -> int:
    if argv[:1] == ["publish"] and len(argv) == 4:
        publish(argv[1], argv[2], Path(argv[3]))
        return 0
    if argv[:1] == ["onboard"] and len(argv) == 5:
        onboard(argv[1], argv[2], Path(argv[3]), Path(argv[4]))
        return 0
    if argv[:1] == ["cache-publish"] and len(argv) == 4:
        cache_publish(argv[1], argv[2], Path(argv[3]))
        return 0
    if argv[:1] == ["cache-serve"] and len(argv) == 5:
        cache_serve(argv[1], argv[2], Path(argv[3]), Path(argv[4]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

