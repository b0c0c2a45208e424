"""`statekv serve`, driven by the real OpenAI client against a server on a loopback port."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from io_actors.metrics import CACHE_FIELDS
from serve.server import DEFAULT_MAX_TOKENS, Server, ServerOptions, create_app, server_of
from statekv.stats import CacheStatistics

MODEL = "statekv-tiny"
# Blocks of 4 tokens (bytes), a GPU pool of 24 blocks and a host pool of 2 (+2 reserved):
# a few requests push earlier blocks through host to disk.
SMALL = ServerOptions(device="cpu", block_size=4, gpu_blocks=24, host_blocks=2,
                      reserved_host_blocks=2, disk_blocks=256, max_model_len=96)
PROMPT = "The tiered cache keeps this prefix: 40b."  # 40 bytes: 10 full blocks of 4
assert len(PROMPT.encode()) == 40


@attrs.frozen
class Running:
    url: str
    server: Server

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


def wait_until(condition: Callable[[], bool], what: str, deadline: float = 120.0) -> None:
    """Poll for a state the server reaches asynchronously (a deadline for hangs only)."""
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"never happened: {what}")
        time.sleep(0.01)


@contextmanager
def serving(options: ServerOptions, tmp_path: Path) -> Iterator[Running]:
    app = create_app(attrs.evolve(options, disk_dir=tmp_path / "slots"))
    listener = socket.create_server(("127.0.0.1", 0))  # a free loopback port
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), "the server started")
        assert thread.is_alive(), "the server did not start"
        yield Running(f"http://127.0.0.1:{port}", server_of(app))
    finally:
        server.should_exit = True
        thread.join(60)
        listener.close()


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Running]:
    with serving(SMALL, tmp_path) as running:
        yield running


def cached(usage: Any) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None
    value = usage.prompt_tokens_details.cached_tokens
    assert isinstance(value, int)
    return value


# ---------------------------------------------------------------------- completions


def test_completion_reports_usage_and_a_shared_prefix_reports_cached_tokens(
    small: Running,
) -> None:
    client = small.client()
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert first.object == "text_completion" and first.model == MODEL
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (40, 5)
    assert cached(first.usage) == 0
    second = client.completions.create(model=MODEL, prompt=PROMPT + " And more.",
                                       max_tokens=5)
    assert cached(second.usage) == 40  # the ten full blocks of the shared prefix
    # Another tenant (cache salt) shares nothing.
    salted = client.completions.create(model=MODEL, prompt=PROMPT + " And more.",
                                       max_tokens=5, extra_body={"cache_salt": "tenant-b"})
    assert cached(salted.usage) == 0


def test_chat_turns_share_their_conversation_prefix(small: Running) -> None:
    client = small.client()
    messages: list[Any] = [{"role": "system", "content": "Brief."},
                           {"role": "user", "content": "A tier?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert first.object == "chat.completion"
    answer = first.choices[0].message
    assert answer.role == "assistant" and isinstance(answer.content, str)
    assert cached(first.usage) == 0
    messages += [{"role": "assistant", "content": answer.content},
                 {"role": "user", "content": "More?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_completion_tokens=4)
    assert second.usage is not None and second.usage.completion_tokens == 4
    assert cached(second.usage) >= 40  # the system and first user message, at least


def test_after_its_blocks_were_spilled_a_ttl_request_still_hits_from_disk(
    tmp_path: Path,
) -> None:
    # A host pool that takes a request's GPU victims at once (none dropped for want of a
    # page), yet is small next to what flows through it.
    with serving(attrs.evolve(SMALL, host_blocks=16, reserved_host_blocks=8),
                 tmp_path) as running:
        check_ttl_request_hits_from_disk(running)


def check_ttl_request_hits_from_disk(running: Running) -> None:
    client = running.client()
    stats = running.server.cache.statistics
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                              extra_body={"kv_cache_ttl_seconds": 600})
    # Other requests take the GPU pool (24 blocks) and the host pool (2 + 2) many times over;
    # their higher priority keeps them on the GPU longer, so the TTL request goes first.
    for n in range(8):
        client.completions.create(model=MODEL, prompt=f"{n} filler prompt, unrelated {n}.  "
                                  f"{n * 1111:08d}", max_tokens=4, extra_body={"priority": 2})
    wait_until(lambda: stats().cache.writes_in_flight == 0, "spills finished")
    before = stats().cache
    assert before.spills_completed > 0
    again = client.completions.create(model=MODEL, prompt=PROMPT + " Back again.",
                                      max_tokens=4,
                                      extra_body={"kv_cache_ttl_seconds": 600})
    after = stats().cache
    assert cached(again.usage) == 40, (before, after)
    assert after.hit_tokens_disk - before.hit_tokens_disk == 40
    assert after.hit_blocks_disk_retained > before.hit_blocks_disk_retained
    assert after.io_errors == 0


# ---------------------------------------------------------------------- streaming


def test_streaming_gives_the_same_text_as_a_whole_response(small: Running) -> None:
    client = small.client()
    # Different salts: neither reuses the other's cache, so both compute the same way.
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                      extra_body={"cache_salt": "a"})
    pieces: list[str] = []
    usage = None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"cache_salt": "b"}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].text
    assert usage is not None and usage.completion_tokens == 12 and cached(usage) == 0

    chat_pieces: list[str] = []
    finish = None
    for event in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Stream, please."}],
            max_tokens=6, stream=True):
        delta = event.choices[0].delta
        chat_pieces.append(delta.content or "")
        finish = event.choices[0].finish_reason or finish
    assert finish == "length"
    whole_chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream, please."}], max_tokens=6,
        extra_body={"cache_salt": "c"})
    assert "".join(chat_pieces) == whole_chat.choices[0].message.content


def test_a_client_that_disconnects_mid_stream_releases_its_request(tmp_path: Path) -> None:
    roomy = attrs.evolve(SMALL, gpu_blocks=1200, max_model_len=4096)
    with serving(roomy, tmp_path) as running, httpx.Client(timeout=60) as http:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "stream": True}
        with http.stream("POST", f"{running.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
        # The connection is closed with thousands of tokens still to go.
        engine = running.server.engine
        wait_until(lambda: engine.statistics().requests == 0, "the request left the loop")
        stats = engine.statistics()
        assert stats.cancelled == 1
        assert stats.loop.running_now == stats.loop.waiting_now == 0
        assert stats.loop.decode_tokens < 4000
        cache = running.server.cache.statistics().cache
        assert cache.requests_added == cache.requests_released == 1
        assert cache.gpu_free_pages + cache.gpu_evictable_blocks == 1200  # nothing held


def test_a_client_that_gives_up_on_a_whole_response_releases_its_request(
    tmp_path: Path,
) -> None:
    roomy = attrs.evolve(SMALL, gpu_blocks=1200, max_model_len=4096)
    with serving(roomy, tmp_path) as running:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000}
        engine = running.server.engine
        with httpx.Client(timeout=httpx.Timeout(60, read=0.5)) as http, \
                pytest.raises(httpx.ReadTimeout):  # thousands of tokens: it gives up
            http.post(f"{running.url}/v1/completions", json=body)
        wait_until(lambda: engine.statistics().requests == 0, "the request left the loop")
        stats = engine.statistics()
        assert stats.cancelled == 1 and stats.loop.decode_tokens < 4000
        cache = running.server.cache.statistics().cache
        assert cache.requests_added == cache.requests_released == 1


# ---------------------------------------------------------------------- bad requests


def _post(running: Running, path: str, content: str) -> httpx.Response:
    return httpx.post(f"{running.url}{path}", content=content,
                      headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize(("fields", "param"), [
    ('"kv_cache_ttl_seconds": -1', "kv_cache_ttl_seconds"),
    ('"kv_cache_ttl_seconds": NaN', "kv_cache_ttl_seconds"),
    ('"kv_cache_ttl_seconds": Infinity', "kv_cache_ttl_seconds"),
    ('"kv_cache_ttl_seconds": "60"', "kv_cache_ttl_seconds"),
    ('"kv_cache_ttl_seconds": 1e12', "kv_cache_ttl_seconds"),
    ('"priority": 9', "priority"),
    ('"priority": "high"', "priority"),
    ('"priority": -1', "priority"),
    ('"cache_salt": ""', "cache_salt"),
    ('"cache_salt": 7', "cache_salt"),
    ('"max_tokens": 0', "max_tokens"),
    ('"max_tokens": 90', "prompt"),
    ('"temperature": 0.7', "temperature"),
    ('"n": 2', "n"),
    ('"stream": "yes"', "stream"),
    ('"stream_options": {"include_usage": true}', "stream_options"),
    ('"best_of": 3', "best_of"),
])
def test_a_bad_completion_field_is_a_400_in_openai_shape(
    small: Running, fields: str, param: str
) -> None:
    response = _post(small, "/v1/completions",
                     f'{{"model": "{MODEL}", "prompt": "{PROMPT}", {fields}}}')
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ('{"model": "statekv-tiny", "prompt": ""}', "prompt"),
    ('{"model": "statekv-tiny", "prompt": []}', "prompt"),
    ('{"model": "statekv-tiny", "prompt": [1, 256]}', "prompt"),
    ('{"model": "statekv-tiny", "prompt": "' + "x" * 200 + '"}', "prompt"),
    ('{"model": "statekv-tiny"}', "prompt"),
    ('{"model": "statekv-tiny", "prompt": "\\ud800"}', "prompt"),
    ('{"model": "statekv-tiny", "prompt": 7}', "prompt"),
    ('{"model": "statekv-tiny", "prompt": [1, "a"]}', "prompt"),
    ('{"model": "\\ud800", "prompt": "hi"}', "model"),
    ('{"model": "statekv-tiny", "prompt": "hi", "user": "\\udfff"}', "user"),
    ('{"model": "statekv-tiny", "prompt": "hi", "cache_salt": "\\ud800"}', "cache_salt"),
    ('{"model": "statekv-tiny", "prompt": "the body ends he', None),
    ('not json', None),
])
def test_a_bad_prompt_is_a_400(small: Running, body: str, param: str | None) -> None:
    response = _post(small, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize(("messages", "param"), [
    ("[]", "messages"),
    ('[{"role": "wizard", "content": "hi"}]', "messages.0.role"),
    ('[{"role": "user"}]', "messages.0.content"),
    ('[{"role": "user", "content": "' + "y" * 200 + '"}]', "messages"),
])
def test_a_bad_chat_request_is_a_400(small: Running, messages: str, param: str) -> None:
    response = _post(small, "/v1/chat/completions",
                     f'{{"model": "{MODEL}", "messages": {messages}}}')
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_openai_client_sees_bad_request_errors(small: Running) -> None:
    client = small.client()
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=PROMPT,
                                  extra_body={"kv_cache_ttl_seconds": -5})
    assert raised.value.status_code == 400
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["param"] == "kv_cache_ttl_seconds"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    # Nothing was admitted by the refused requests.
    assert small.server.cache.statistics().cache.requests_added == 0


def test_defaults_and_models_listing(small: Running) -> None:
    client = small.client()
    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    default = client.completions.create(model=MODEL, prompt="hi")
    assert default.usage is not None and default.usage.completion_tokens == DEFAULT_MAX_TOKENS


# ---------------------------------------------------------------------- metrics


def scrape(running: Running) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    response = httpx.get(f"{running.url}/metrics", timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if sample.name.startswith("statekv"):
                # Every series names the served model (vLLM's dashboards select by it).
                assert labels.pop("model_name", None) == MODEL, sample
            samples.setdefault(sample.name, {})[tuple(sorted(labels.items()))] = (
                sample.value)
    return samples


def test_metrics_are_scraped_and_follow_statistics(small: Running) -> None:
    client = small.client()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    client.completions.create(model=MODEL, prompt=PROMPT + " again", max_tokens=4)
    samples = scrape(small)
    stats = small.server.cache.statistics().cache
    assert samples["statekv_requests_added_total"][()] == stats.requests_added == 2
    assert samples["statekv_prompt_tokens_total"][(("tier", "gpu"),)] == stats.hit_tokens_gpu
    assert stats.hit_tokens_gpu == 40
    assert samples["statekv_prompt_tokens_total"][(("tier", "disk"),)] == 0
    assert samples["statekv_prompt_tokens_total"][(("tier", "remote"),)] == 0
    (version,) = samples["statekv_serving_build_info"]
    assert dict(version)["version"] and samples["statekv_serving_build_info"][version] == 1
    assert samples["statekv_spills_total"][()] == stats.spills
    assert samples["statekv_parked_requests"][()] == 0
    by_state = samples["statekv_blocks"]
    assert sum(by_state.values()) == sum(count for _state, count in stats.blocks_by_state)
    assert samples["statekv_io_queue_depth"][(("pool", "writer"),)] == 0
    assert samples["statekv_serving_requests"][(("state", "running"),)] == 0
    assert samples["statekv_serving_generated_tokens_total"][()] > 0
    assert samples["statekv_serving_time_to_first_token_seconds_count"][()] == 2
    assert samples["statekv_serving_step_seconds_count"][()] >= 8  # 2 prefills, 6 decodes
    for name in samples:
        assert name.startswith("statekv_")
        assert math.isfinite(next(iter(samples[name].values())))


def test_every_statistics_field_is_exported() -> None:
    assert set(CACHE_FIELDS) == set(attrs.fields_dict(CacheStatistics))


def test_health_answers_503_once_the_serving_loop_failed(
    small: Running, monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert httpx.get(f"{small.url}/health").json() == {"status": "ok"}

    def broken_step() -> list[Any]:
        raise RuntimeError("a planted failure of the serving loop")

    monkeypatch.setattr(small.server.engine._loop, "step", broken_step)
    monkeypatch.setattr(threading, "excepthook", lambda _args: None)  # expected: quiet
    reply = httpx.post(f"{small.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert reply.status_code >= 500
    wait_until(lambda: not small.server.engine.healthy, "the engine saw its loop fail")
    health = httpx.get(f"{small.url}/health")
    assert health.status_code == 503
    assert health.json()["status"] == "unhealthy"


def test_cached_tokens_count_every_tier_the_prompt_was_spared_from() -> None:
    """usage.prompt_tokens_details.cached_tokens: tokens from the shared tier count too, and
    tokens recomputed after a failed read do not."""
    from serve._models import serving_loop
    from serve.server import _usage

    fetched = serving_loop.RequestResult(request_id="r", prompt_tokens=200, gpu_tokens=8,
                                         remote_tokens=192, recomputed_tokens=0)
    assert _usage(fetched)["prompt_tokens_details"]["cached_tokens"] == 200
    fell_back = serving_loop.RequestResult(request_id="s", prompt_tokens=100, disk_tokens=96,
                                           recomputed_tokens=36, fell_back=True)
    assert _usage(fell_back)["prompt_tokens_details"]["cached_tokens"] == 64


def test_version_names_the_installed_package(small: Running) -> None:
    from importlib import metadata

    reply = httpx.get(f"{small.url}/version")
    assert reply.status_code == 200
    assert reply.json() == {"version": metadata.version("statekv")}
