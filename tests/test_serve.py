"""`statekv serve`, driven by the real OpenAI client against a server on a loopback port."""

from __future__ import annotations

import gc
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


def test_a_client_that_disconnects_releases_every_choice(tmp_path: Path) -> None:
    roomy = attrs.evolve(SMALL, gpu_blocks=1200, max_model_len=4096)
    with serving(roomy, tmp_path) as running, httpx.Client(timeout=60) as http:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "stream": True, "n": 2,
                "temperature": 1.0}
        with http.stream("POST", f"{running.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
        engine = running.server.engine
        wait_until(lambda: engine.statistics().requests == 0, "the choices left the loop")
        stats = engine.statistics()
        assert stats.cancelled == 2 and stats.loop.decode_tokens < 4000
        cache = running.server.cache.statistics().cache
        assert cache.requests_added == cache.requests_released
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


# ---------------------------------------------------------------------- sampling

ROOMY = attrs.evolve(SMALL, gpu_blocks=400, max_model_len=400)
"""Room for many choices of one request at once."""


@pytest.fixture
def roomy(tmp_path: Path) -> Iterator[Running]:
    with serving(ROOMY, tmp_path) as running:
        yield running


def completion_text(client: openai.OpenAI, salt: str, **fields: Any) -> str:
    """One completion's text; each `salt` computes afresh (no cached prefix), so that two
    requests meant to agree run the same arithmetic."""
    reply = client.completions.create(model=MODEL, prompt=PROMPT,
                                      extra_body={"cache_salt": salt}, **fields)
    text = reply.choices[0].text
    assert isinstance(text, str)
    return text


def test_a_seeded_sample_is_reproducible_and_unlike_other_seeds_and_greedy(
    roomy: Running,
) -> None:
    client = roomy.client()
    greedy = completion_text(client, "g", max_tokens=24)
    assert completion_text(client, "g0", max_tokens=24, temperature=0) == greedy
    # At temperature 0 the seed and top_p change nothing: greedy.
    assert completion_text(client, "g1", max_tokens=24, temperature=0, seed=5,
                           top_p=0.5) == greedy
    seeded = completion_text(client, "a", max_tokens=24, temperature=1.0, seed=7)
    assert completion_text(client, "b", max_tokens=24, temperature=1.0, seed=7) == seeded
    assert completion_text(client, "c", max_tokens=24, temperature=1.0, seed=8) != seeded
    assert seeded != greedy
    # Unseeded draws are fresh each time (24 near-uniform bytes never repeat by chance).
    assert (completion_text(client, "d", max_tokens=24, temperature=1.0)
            != completion_text(client, "e", max_tokens=24, temperature=1.0))


def test_a_tiny_top_p_is_greedy(roomy: Running) -> None:
    client = roomy.client()
    greedy = completion_text(client, "g", max_tokens=24)
    assert completion_text(client, "p", max_tokens=24, temperature=1.5, top_p=1e-6,
                           seed=3) == greedy
    assert completion_text(client, "q", max_tokens=24, temperature=1.5, top_p=0.9,
                           seed=3) != greedy


def test_samples_follow_the_models_distribution_sharpened_by_temperature(
    roomy: Running,
) -> None:
    client = roomy.client()
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=5)
    assert greedy.choices[0].logprobs is not None
    (top,) = greedy.choices[0].logprobs.top_logprobs or [{}]
    assert len(top) == 5
    p_top = sum(math.exp(logprob) for logprob in top.values())

    def in_top(temperature: float) -> int:
        """Of 128 first tokens drawn at `temperature`, how many are the model's top 5."""
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, n=128,
                                          temperature=temperature, seed=1, logprobs=0)
        assert [choice.index for choice in reply.choices] == list(range(128))
        names = [(choice.logprobs.tokens or [""])[0] for choice in reply.choices
                 if choice.logprobs is not None]
        assert len(names) == 128
        return sum(name in top for name in names)

    # Temperature 1 draws from the model's own distribution: within five standard
    # deviations of the binomial's mean (seeded, so the same count every run).
    at_1 = in_top(1.0)
    assert abs(at_1 - 128 * p_top) <= 5 * math.sqrt(128 * p_top * (1 - p_top)), (at_1, p_top)
    # A lower temperature concentrates the draws on the likeliest tokens, a higher spreads.
    assert in_top(0.25) > 3 * at_1 and in_top(2.0) < at_1


def generated_bytes(tokens: list[str]) -> bytes:
    """The bytes a completion's logprobs name (a byte above 0x7f is "bytes:\\xNN")."""
    return bytes(int(name[len("bytes:\\x"):], 16) if name.startswith("bytes:") else ord(name)
                 for name in tokens)


def test_stop_strings_cut_the_text_and_finish_with_stop(roomy: Running) -> None:
    client = roomy.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, logprobs=0,
                                      extra_body={"cache_salt": "full"})
    full = whole.choices[0].text
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.tokens
    output = generated_bytes(whole.choices[0].logprobs.tokens)
    assert len(output) == 48 and output.decode(errors="replace") == full
    # A stop string of two ASCII bytes, where the output has them (its first place).
    at = next(i for i in range(4, 47) if output[i] < 0x80 and output[i + 1] < 0x80)
    pair = output[at:at + 2].decode()
    cut = output.index(pair.encode())
    expected = output[:cut].decode(errors="replace")
    absent = "\u20ac\u20ac\u20ac"
    assert absent not in full
    for salt, stop in (("one", pair), ("list", [absent, pair])):
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, stop=stop,
                                          extra_body={"cache_salt": salt})
        assert reply.choices[0].text == expected
        assert reply.choices[0].finish_reason == "stop"
        # The stop string's tokens were generated: they count as completion tokens.
        assert reply.usage is not None and reply.usage.completion_tokens == cut + 2
    unmatched = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48,
                                          stop=absent, extra_body={"cache_salt": "none"})
    assert unmatched.choices[0].text == full
    assert unmatched.choices[0].finish_reason == "length"

    streamed: list[str] = []
    finishes: list[Any] = []  # the client's type says str; streamed chunks carry None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48,
                                           stop=[pair], stream=True,
                                           extra_body={"cache_salt": "stream"}):
        streamed.append(chunk.choices[0].text)
        finishes.append(chunk.choices[0].finish_reason)
    assert "".join(streamed) == expected
    assert finishes[-1] == "stop" and not any(finishes[:-1])


def test_n_choices_have_their_indices_and_share_the_prompts_cache(roomy: Running) -> None:
    client = roomy.client()
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3,
                                      temperature=1.0, seed=11)
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    texts = [choice.text for choice in reply.choices]
    assert len(set(texts)) == 3  # each choice draws with a seed of its own
    assert all(choice.finish_reason == "length" for choice in reply.choices)
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (40, 24)
    # Choices 1 and 2 started once choice 0 had computed the prompt: they took its nine
    # full blocks before the last token (36 tokens) from the GPU cache.
    assert roomy.server.cache.statistics().cache.hit_tokens_gpu == 2 * 36
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3,
                                      temperature=1.0, seed=11, extra_body={"cache_salt": "x"})
    assert [choice.text for choice in again.choices] == texts
    # Choice i of seed s draws as a request of seed s + i.
    assert completion_text(client, "y", max_tokens=8, temperature=1.0, seed=12) == texts[1]
    greedy = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Twice."}], max_tokens=6, n=2)
    assert [choice.index for choice in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_streaming_n_choices_carries_each_choices_index(roomy: Running) -> None:
    client = roomy.client()
    messages: list[Any] = [{"role": "user", "content": "Two streams."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, n=2,
                                           temperature=0.8, seed=4,
                                           extra_body={"cache_salt": "whole"})
    pieces: dict[int, list[str]] = {0: [], 1: []}
    roles: list[int] = []
    finishes: dict[int, str] = {}
    usage = None
    for event in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, n=2, temperature=0.8, seed=4,
            stream=True, stream_options={"include_usage": True},
            extra_body={"cache_salt": "stream"}):
        if event.usage is not None:
            usage = event.usage
        for choice in event.choices:
            if choice.delta.role is not None:
                roles.append(choice.index)
            pieces[choice.index].append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert sorted(roles) == [0, 1] and finishes == {0: "length", 1: "length"}
    assert ["".join(pieces[i]) for i in (0, 1)] == [
        choice.message.content for choice in whole.choices]
    assert usage is not None and usage.completion_tokens == 20


def test_logprobs_of_completions_and_chat(roomy: Running) -> None:
    client = roomy.client()
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and logprob < 0
        assert top[token] == logprob == max(top.values())  # greedy: the likeliest
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    # The model's own log-probabilities, whatever the temperature draws with.
    hot = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=3,
                                    temperature=0.3, seed=3)
    assert hot.choices[0].logprobs is not None and hot.choices[0].logprobs.top_logprobs
    first = hot.choices[0].logprobs.top_logprobs[0]
    assert list(first) == list(logprobs.top_logprobs[0])
    assert list(first.values()) == pytest.approx(list(logprobs.top_logprobs[0].values()),
                                                 abs=1e-4)

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Scores?"}], max_tokens=5,
        logprobs=True, top_logprobs=2, temperature=1.0, seed=2)
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) == 5
    answer = b"".join(bytes(entry.bytes or []) for entry in content.content)
    assert answer.decode(errors="replace") == chat.choices[0].message.content
    for entry in content.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Scores?"}], max_tokens=5,
        logprobs=False)
    assert plain.choices[0].logprobs is None

    streamed: list[float] = []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                           logprobs=1, stream=True,
                                           extra_body={"cache_salt": "s"}):
        if chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert streamed == pytest.approx(logprobs.token_logprobs, abs=1e-4)


def test_content_parts_are_joined_text(roomy: Running) -> None:
    client = roomy.client()
    as_string = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream, please."}], max_tokens=8,
        extra_body={"cache_salt": "s"})
    as_parts = client.chat.completions.create(
        model=MODEL, max_tokens=8, extra_body={"cache_salt": "p"},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Stream, "},
                                               {"type": "text", "text": "please."}]}])
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage is not None and as_string.usage is not None
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["param"] == "messages.0.content.1.type"


def test_zero_penalties_are_accepted(small: Running) -> None:
    reply = small.client().completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                              presence_penalty=0, frequency_penalty=0.0)
    assert reply.usage is not None and reply.usage.completion_tokens == 2


def test_stop_strings_are_held_back_until_they_cannot_match() -> None:
    """A streamed answer never shows a stop string, nor text taken back later."""
    from serve._models import serving_loop
    from serve.server import _Answer

    answer = _Answer((tuple(b"AB"), tuple(b"XYZ")), chat=False, logprobs=False)
    fed = [answer.feed(token, None)[0] for token in b"AXAC"]
    # "A" may begin "AB", then "X" "XYZ", then "A" again; "C" begins nothing.
    assert fed == ["", "A", "X", "AC"]
    fed = [answer.feed(token, None)[0] for token in b"XYAB"]
    assert fed == ["", "", "XY", ""]  # "XYA" is no stop's start; "AB" is one
    result = serving_loop.RequestResult(request_id="r", prompt_tokens=1,
                                        output=list(b"AXACXYAB"), stop_tokens=2)
    assert answer.finish(result) == ("", None)


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
    ('"temperature": -0.1', "temperature"),
    ('"temperature": 2.5', "temperature"),
    ('"temperature": "hot"', "temperature"),
    ('"temperature": NaN', "temperature"),
    ('"top_p": 0', "top_p"),
    ('"top_p": 1.5', "top_p"),
    ('"top_p": "all"', "top_p"),
    ('"n": 0', "n"),
    ('"n": 129', "n"),
    ('"n": 2.5', "n"),
    ('"n": "3"', "n"),
    ('"stop": ["a", "b", "c", "d", "e"]', "stop"),
    ('"stop": ""', "stop"),
    ('"stop": [""]', "stop"),
    ('"stop": 7', "stop"),
    ('"stop": ["a", 7]', "stop"),
    ('"stop": "\\ud800"', "stop"),
    ('"seed": 1.5', "seed"),
    ('"seed": "7"', "seed"),
    ('"seed": 18446744073709551616', "seed"),
    ('"logprobs": 6', "logprobs"),
    ('"logprobs": -1', "logprobs"),
    ('"logprobs": true', "logprobs"),
    ('"presence_penalty": 0.5', "presence_penalty"),
    ('"frequency_penalty": -1', "frequency_penalty"),
    ('"frequency_penalty": 3', "frequency_penalty"),
    ('"top_logprobs": 2', "top_logprobs"),
    ('"logit_bias": {"65": 5}', "logit_bias"),
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
    ('[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
     "messages.0.content.0.type"),
    ('[{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", '
     '"text": "hi"}, {"type": "input_audio", "input_audio": {}}]}]',
     "messages.1.content.1.type"),
    ('[{"role": "user", "content": [{"type": "text"}]}]', "messages.0.content.0.text"),
    ('[{"role": "user", "content": [{"type": "text", "text": 7}]}]',
     "messages.0.content.0.text"),
    ('[{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]',
     "messages.0.content.0.text"),
    ('[{"role": "user", "content": [{"type": "text", "text": "a", "colour": 1}]}]',
     "messages.0.content.0.colour"),
    ('[{"role": "user", "content": [{"text": "a"}]}]', "messages.0.content"),
    ('[{"role": "user", "content": 7}]', "messages.0.content"),
])
def test_a_bad_chat_request_is_a_400(small: Running, messages: str, param: str) -> None:
    response = _post(small, "/v1/chat/completions",
                     f'{{"model": "{MODEL}", "messages": {messages}}}')
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(("fields", "param"), [
    ('"logprobs": 1', "logprobs"),
    ('"top_logprobs": 21', "top_logprobs"),
    ('"top_logprobs": 2', "top_logprobs"),
    ('"logprobs": false, "top_logprobs": 2', "top_logprobs"),
    ('"max_completion_tokens": 0', "max_completion_tokens"),
    ('"temperature": 2.01', "temperature"),
    ('"n": -1', "n"),
    ('"stop": ["a", "b", "c", "d", "e"]', "stop"),
    ('"presence_penalty": 1', "presence_penalty"),
    ('"tools": []', "tools"),
])
def test_a_bad_chat_field_is_a_400(small: Running, fields: str, param: str) -> None:
    response = _post(small, "/v1/chat/completions",
                     f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": '
                     f'"hi"}}], {fields}}}')
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


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


# ---------------------------------------------------------------------- the collector


def test_the_startup_heap_is_frozen_while_serving_and_given_back_at_shutdown(
    tmp_path: Path,
) -> None:
    """A full collection stops every thread for as long as it walks the heap: while the
    server serves, what it made at start-up (the model, the cache) is out of the collector's
    generations; after shutdown it is back, so that it can be freed."""
    with serving(SMALL, tmp_path) as running:
        assert gc.get_freeze_count() > 0
        walked = {id(obj) for obj in gc.get_objects()}
        assert id(running.server.cache) not in walked
        assert id(running.server.model) not in walked
        # Serving goes on as before.
        completion = running.client().completions.create(model=MODEL, prompt=PROMPT,
                                                         max_tokens=3)
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        server = running.server
    assert gc.get_freeze_count() == 0
    walked = {id(obj) for obj in gc.get_objects()}
    assert id(server.cache) in walked and id(server.model) in walked
