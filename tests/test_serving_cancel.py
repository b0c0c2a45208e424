"""ServingLoop.cancel and on_token: what a server needs of the loop."""

from __future__ import annotations

from pathlib import Path

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache
from models.config import preset
from models.model import PagedDecoder
from models.serving_loop import ServeRequest, ServingLoop


def test_cancel_drops_waiting_and_running_requests_and_releases_their_pages(
    tmp_path: Path,
) -> None:
    model = PagedDecoder(preset("tiny"), device="cpu")
    config = StateKVConfig(layout=model.config.kv_layout(), block_size=4, gpu=16, host=2,
                           reserved_host=2, disk=32, disk_dir=tmp_path, device="cpu",
                           model_fingerprint=model.config.fingerprint())
    streamed: list[tuple[str, int]] = []
    with BlockingCache(config) as cache:
        loop = ServingLoop(model, cache, max_running=1,
                           on_token=lambda rid, token, _logprob: streamed.append((rid, token)))
        for rid in ("a", "b"):
            loop.submit(ServeRequest(request_id=rid, prompt=tuple(range(10)),
                                     max_new_tokens=5))
        loop.step()  # admits "a" (one at a time), prefills it: its first token
        assert streamed == [("a", streamed[0][1])]
        stats = loop.statistics()
        assert (stats.running_now, stats.waiting_now) == (1, 1)

        assert loop.cancel("b")  # still waiting: never reached the cache
        assert loop.cancel("a")  # running: released, pages back
        assert not loop.cancel("a") and not loop.cancel("never-seen")
        assert loop.idle
        cache_stats = cache.statistics().cache
        assert cache_stats.requests_added == cache_stats.requests_released == 1
        assert cache.obtainable_gpu_blocks() == 16
        # Its two full blocks stay cached for the next request with the same prefix.
        match = cache.add_request("c", tuple(range(10)))
        assert match.gpu_tokens == 8
        cache.release("c")
