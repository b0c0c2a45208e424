"""``statekv serve``: OpenAI-compatible completions and chat completions over the serving loop.

FastAPI on uvicorn, as the serving engines of the ecosystem do.  The routes:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming (server-sent events,
  ``stream: true``) or not;
* ``GET /v1/models``, ``GET /health`` (503 once the serving loop failed), ``GET /version``
  and ``GET /metrics`` (Prometheus: the cache's ``statistics()`` through
  :class:`io_actors.metrics.StateKVCollector`, and the serving loop's queue depths).

OpenAI's fields both endpoints take: ``model``, ``max_tokens`` (chat also
``max_completion_tokens``), ``stream``, ``stream_options.include_usage``, ``user``, and

* ``temperature`` in [0, 2]: 0 is greedy, and so is leaving it out (OpenAI's default is 1);
  above 0 a token is drawn from softmax(logits / temperature);
* ``top_p`` in (0, 1]: the draw is among the likeliest tokens holding that much probability
  (the likeliest is always kept, so a tiny ``top_p`` is greedy);
* ``seed``: the request's own generator, so a seeded request gives the same answer again
  (choice i of ``n`` uses seed + i); at temperature 0 seed and top_p change nothing;
* ``stop``: a string or a list of up to 4; the answer ends where one first appears, without
  it, and ``finish_reason`` is ``"stop"`` (streamed text that may begin a stop string is
  held back until it cannot);
* ``n`` up to 128: that many choices, each its own request in the loop, indexed 0 .. n-1 (in
  streamed chunks too); the first computes the prompt and the others take its blocks from
  the cache; usage counts the prompt once and every choice's completion tokens;
* log-probabilities, the model's own (before temperature and top_p): ``logprobs`` 0 .. 5 on
  completions (a byte above 0x7f is named ``bytes:\\xNN``), ``logprobs: true`` and
  ``top_logprobs`` 0 .. 20 on chat (each token with its ``bytes``);
* ``presence_penalty`` and ``frequency_penalty``: only 0; another value is refused.

A chat message's ``content`` is a string or a list of parts; ``{"type": "text", "text": ...}``
parts are joined, and any other part (``image_url``, ``input_audio``, ...) is refused naming
it (``messages.0.content.1.type``): the model reads text only.

Requests take three fields beyond OpenAI's, under the names the ecosystem uses:
``kv_cache_ttl_seconds`` (keep this request's KV reusable for that long, down to disk),
``cache_salt`` (vLLM's tenant isolation: requests share cached blocks only with the same salt)
and ``priority`` (the retention class, 0 .. priority_levels - 1).  The response's
``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens taken from the cache,
on any tier.  Any other field, and a bad value of any field, gets HTTP 400 with OpenAI's error
body, naming the field in ``param``.  A client that goes away cancels its request (every
choice): the loop releases it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import attrs
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from io_actors.config import StateKVConfig
from io_actors.embed import BlockingCache, resolve_device
from io_actors.metrics import COUNTER, GAUGE, MetricFamilies, StateKVCollector
from statekv.config import is_utf8_encodable

from . import tokenizer
from ._models import config as model_config
from ._models import model as model_module
from ._models import sampling, serving_loop
from .accept_errors import accept_errors_limited
from .engine import Engine, EngineStopped, GenerateRequest
from .gc_heap import startup_heap_frozen
from .shutdown import sigterm_raises

DEFAULT_MAX_TOKENS: Final = 16
"""Tokens generated when a request names no max_tokens (the model never stops on its own)."""


@attrs.frozen(kw_only=True)
class ServerOptions:
    """What ``statekv serve`` serves, on which budgets (its flags, read into this record)."""

    model: str = "tiny"
    layers: int | None = None
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    gpu_blocks: int = 160
    host_blocks: int = 32
    reserved_host_blocks: int = 8
    disk_blocks: int = 4096
    disk_dir: Path | None = None
    """Where slot files go; None: a temporary directory, removed when the server stops."""
    served_model_name: str = "statekv-tiny"
    max_model_len: int = 2048
    max_running: int = 64
    max_ttl_seconds: float = 30 * 24 * 3600.0
    priority_levels: int = 4
    remote_url: str | None = None
    """The shared tier's cluster (StateKVConfig.remote_url); None: no shared tier."""
    remote_namespace: str = "statekv"
    remote_secret: bytes | None = attrs.field(default=None, repr=False)
    """Signs every shared value (StateKVConfig.remote_secret); required with remote_url."""
    remote_password: str | None = attrs.field(default=None, repr=False)
    remote_tls_ca_file: Path | None = None
    publish_on: str = "release"
    """StateKVConfig.publish_on: when content is offered to the shared tier."""
    retention_write_through: bool = True
    """StateKVConfig.retention_write_through: retained content written at its release."""


# ---------------------------------------------------------------------- request bodies

def _encodable(value: str) -> str:
    if not is_utf8_encodable(value):
        raise ValueError("must be encodable as UTF-8 (it holds a lone surrogate)")
    return value


Text = Annotated[str, Field(strict=True), AfterValidator(_encodable)]
"""Every text field follows one rule: a string that UTF-8 can encode (a lone surrogate,
which JSON's \\ud800 escapes can carry, is refused naming the field)."""
Ttl = Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)]
Priority = Annotated[int, Field(ge=0, strict=True)]
MaxTokens = Annotated[int, Field(ge=1, strict=True)]
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False, strict=True)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, strict=True)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False, strict=True)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64, strict=True)]
"""What torch.Generator.manual_seed takes."""
StopText = Annotated[Text, Field(min_length=1)]

MAX_N: Final = 128
"""Choices one request may ask for (OpenAI's bound)."""
MAX_STOP: Final = 4
"""Stop strings one request may give (OpenAI's bound)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Annotated[bool, Field(strict=True)] = False


class _Common(BaseModel):
    """Fields both endpoints take.  Unknown fields are refused, not ignored."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    max_tokens: MaxTokens | None = None
    stream: Annotated[bool, Field(strict=True)] = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    """Absent or 0: greedy (this server's default, where OpenAI's is 1)."""
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N, strict=True)] | None = None
    presence_penalty: Penalty | None = None
    """Only 0 (or absent): penalties are not implemented, and a non-zero one is refused."""
    frequency_penalty: Penalty | None = None
    user: Text | None = None
    kv_cache_ttl_seconds: Ttl | None = None
    cache_salt: Annotated[Text, Field(min_length=1)] | None = None
    priority: Priority = 0


class CompletionRequest(_Common):
    prompt: Text | list[Annotated[int, Field(strict=True)]]
    logprobs: Annotated[int, Field(ge=0, le=5, strict=True)] | None = None
    """The sampled token's log-probability and this many most likely alternatives."""


class ContentPart(BaseModel):
    """One part of a message's content.  Any type is read, so that a part the text-only
    model cannot take (image_url, input_audio, ...) is refused naming its `type`, and a text
    part's fields are checked in :func:`_message_text`."""

    model_config = ConfigDict(extra="allow")
    type: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: Text | list[ContentPart]


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: Annotated[bool, Field(strict=True)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20, strict=True)] | None = None


class BadRequest(Exception):
    """A request the server refuses: HTTP `status`, OpenAI's error body naming `param`."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def _error_body(message: str, param: str | None, code: str | None,
                kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------------- one request


@attrs.frozen
class _Event:
    """What happened to choice `index`: a token, its end (`result`) or its failure."""

    index: int
    token: int | None = None
    logprob: sampling.TokenLogprob | None = None
    result: serving_loop.RequestResult | None = None
    error: BaseException | None = None


class _ChoiceSink:
    """One choice's events, carried from the engine thread into the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue[_Event],
                 index: int) -> None:
        self._loop = loop
        self._events = events
        self._index = index

    def _put(self, event: _Event) -> None:
        # The event loop may be gone already (the server stopped with requests in flight).
        with suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def token(self, token: int, logprob: sampling.TokenLogprob | None) -> None:
        self._put(_Event(self._index, token=token, logprob=logprob))

    def finished(self, result: serving_loop.RequestResult) -> None:
        self._put(_Event(self._index, result=result))

    def failed(self, error: BaseException) -> None:
        self._put(_Event(self._index, error=error))


def _usage(result: serving_loop.RequestResult,
           others: Sequence[serving_loop.RequestResult] = ()) -> dict[str, Any]:
    """OpenAI's usage of a completion whose first choice is `result`: the prompt counted
    once, the completion tokens of every choice (stop sequences included: generated)."""
    completion = len(result.output) + sum(len(other.output) for other in others)
    # Every prompt token the model did not compute came from the cache, whichever tier
    # (the shared tier's included), and a failed read that made it recompute counts as
    # computed: what the request was really spared.
    cached = result.prompt_tokens - result.recomputed_tokens
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _labelled(metric: Metric, labels: dict[str, str]) -> Metric:
    """`metric` with `labels` added to every sample (the engine's histograms are made
    before the server knows its model's name)."""
    out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
    out.samples = [sample._replace(labels={**sample.labels, **labels})
                   for sample in metric.samples]
    return out


def package_version() -> str:
    """The installed statekv's version ("unknown" run from a source tree, not installed)."""
    from importlib import metadata

    try:
        return metadata.version("statekv")
    except metadata.PackageNotFoundError:
        return "unknown"


class EngineCollector(Collector):
    """The serving loop's own figures (queue depths, parked requests, steps), per scrape."""

    def __init__(self, engine: Engine, labels: dict[str, str]) -> None:
        self._engine = engine
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()
        loop = stats.loop
        families = MetricFamilies("statekv_serving", self._labels)
        families.add("build_info", GAUGE, {"version": package_version()}, 1,
                     "1, labelled with the statekv version serving.")
        families.add("requests", GAUGE, {"state": "waiting"}, loop.waiting_now,
                     "Requests in the serving loop, by state.")
        families.add("requests", GAUGE, {"state": "parked"}, loop.parked_now)
        families.add("requests", GAUGE, {"state": "running"},
                     loop.running_now - loop.parked_now)
        families.add("requests_cancelled", COUNTER, {}, stats.cancelled,
                     "Requests cancelled before they finished (the client went away).")
        families.add("steps", COUNTER, {}, loop.steps, "Steps of the serving loop.")
        families.add("forward_tokens", COUNTER, {}, loop.forward_tokens,
                     "Tokens run through the model.")
        families.add("prompt_tokens_computed", COUNTER, {}, loop.prompt_tokens_computed,
                     "Prompt tokens the model computed (not taken from the cache).")
        families.add("generated_tokens", COUNTER, {}, loop.decode_tokens,
                     "Tokens generated by decode steps.")
        yield from families
        for histogram in (self._engine.ttft, self._engine.step_seconds):
            for metric in histogram.collect():
                yield _labelled(metric, self._labels)


class Server:
    """The app's state: the model, the cache, the engine; built by the app's lifespan."""

    def __init__(self, options: ServerOptions, disk_dir: Path) -> None:
        self.options = options
        device = resolve_device(options.device)
        self.model_config = model_config.preset(
            options.model, num_layers=options.layers, seed=options.seed,
            vocab_size=tokenizer.VOCAB_SIZE)
        self.model = model_module.PagedDecoder(self.model_config, device=device)
        self.cache_config = StateKVConfig(
            layout=self.model_config.kv_layout(), block_size=options.block_size,
            gpu=options.gpu_blocks, host=options.host_blocks,
            reserved_host=options.reserved_host_blocks if options.disk_blocks else 0,
            disk=options.disk_blocks, disk_dir=disk_dir, device=str(device),
            model_fingerprint=self.model_config.fingerprint(),
            max_ttl_seconds=options.max_ttl_seconds, priority_levels=options.priority_levels,
            remote_url=options.remote_url, remote_namespace=options.remote_namespace,
            remote_secret=options.remote_secret, remote_password=options.remote_password,
            remote_tls_ca_file=options.remote_tls_ca_file, publish_on=options.publish_on,
            retention_write_through=options.retention_write_through,
        )
        self.context_length = min(options.max_model_len,
                                  options.gpu_blocks * options.block_size)
        """Prompt plus generated tokens of one request: the flag, and what the GPU holds."""
        self.cache = BlockingCache(self.cache_config)
        try:
            self.engine = Engine(self.model, self.cache, max_running=options.max_running)
        except BaseException:
            self.cache.close(drain=False)
            raise
        self.registry = CollectorRegistry()
        # model_name on every series, as vLLM's dashboards select by it.
        labels = {"model_name": options.served_model_name}
        self.registry.register(StateKVCollector(self.cache.statistics, constant_labels=labels))
        self.registry.register(EngineCollector(self.engine, labels))
        self._ids = itertools.count()

    def close(self) -> None:
        self.engine.stop()
        self.cache.close()

    def next_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}-{time.time_ns():x}"

    # ------------------------------------------------------------------ checks

    def check(self, body: _Common, prompt: tuple[int, ...], max_tokens: int) -> None:
        """What pydantic cannot know: the served model, the context, the cache's bounds."""
        if body.model != self.options.served_model_name:
            raise BadRequest(f"The model `{body.model}` does not exist.", "model", status=404,
                             code="model_not_found")
        if body.stream_options is not None and not body.stream:
            raise BadRequest("stream_options is only allowed when stream is true",
                             "stream_options")
        if not prompt:
            raise BadRequest("the prompt is empty; a request needs at least one token",
                             "prompt" if isinstance(body, CompletionRequest) else "messages")
        if len(prompt) + max_tokens > self.context_length:
            raise BadRequest(
                f"This model's maximum context length is {self.context_length} tokens. "
                f"However, you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in "
                f"the prompt, {max_tokens} for the completion).",
                "prompt" if isinstance(body, CompletionRequest) else "messages")
        ttl = body.kv_cache_ttl_seconds
        if ttl is not None and ttl > self.options.max_ttl_seconds:
            raise BadRequest(f"kv_cache_ttl_seconds must be <= "
                             f"{self.options.max_ttl_seconds:g}, got {ttl!r}",
                             "kv_cache_ttl_seconds")
        if body.priority >= self.options.priority_levels:
            raise BadRequest(f"priority must be an integer in [0, "
                             f"{self.options.priority_levels}), got {body.priority}",
                             "priority")
        for field in ("presence_penalty", "frequency_penalty"):
            if getattr(body, field):
                raise BadRequest(f"{field} is not supported: only 0 (or leaving it out)",
                                 field)
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None \
                and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs to be true", "top_logprobs")


def _completion_prompt(body: CompletionRequest) -> tuple[int, ...]:
    if isinstance(body.prompt, str):
        try:
            return tokenizer.encode(body.prompt)
        except UnicodeEncodeError:
            raise BadRequest("prompt must be encodable as UTF-8", "prompt") from None
    for token in body.prompt:
        if not 0 <= token < tokenizer.VOCAB_SIZE:
            raise BadRequest(f"token ids must be in [0, {tokenizer.VOCAB_SIZE}) (one per "
                             f"byte), got {token}", "prompt")
    return tuple(body.prompt)


def _message_text(message: ChatMessage, index: int) -> str:
    """A message's text: its string, or its text parts joined (the model reads only text)."""
    if isinstance(message.content, str):
        return message.content
    texts: list[str] = []
    for number, part in enumerate(message.content):
        where = f"messages.{index}.content.{number}"
        if part.type != "text":
            raise BadRequest(f"content parts of type {part.type!r} are not supported: the "
                             f"model reads text only (type \"text\")", f"{where}.type")
        extra = dict(part.model_extra or {})
        text = extra.pop("text", None)
        if not isinstance(text, str):
            raise BadRequest("a text part needs a string `text`", f"{where}.text")
        if not is_utf8_encodable(text):
            raise BadRequest("must be encodable as UTF-8 (it holds a lone surrogate)",
                             f"{where}.text")
        if extra:  # refused, not ignored, as everywhere else
            field = next(iter(extra))
            raise BadRequest(f"Extra inputs are not permitted: {field!r}", f"{where}.{field}")
        texts.append(text)
    return "".join(texts)


def _chat_prompt(body: ChatCompletionRequest) -> tuple[int, ...]:
    conversation = [(m.role, _message_text(m, i)) for i, m in enumerate(body.messages)]
    try:
        return tokenizer.encode(tokenizer.chat_prompt(conversation))
    except UnicodeEncodeError:
        raise BadRequest("message content must be encodable as UTF-8", "messages") from None


def _stops(body: _Common) -> tuple[tuple[int, ...], ...]:
    """The stop strings as token sequences.  One token per byte: the decoded text contains
    a stop string exactly when the tokens contain its bytes -- but for U+FFFD, which a stop
    string matches only as its own three bytes, not where invalid bytes decode to it."""
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    return tuple(tokenizer.encode(text) for text in stop)


def _sampling(body: _Common, index: int) -> sampling.Sampling | None:
    """Choice `index`'s sampling; None for the batched greedy path (greedy, no logprobs)."""
    if isinstance(body, CompletionRequest):
        top = body.logprobs
    else:
        assert isinstance(body, ChatCompletionRequest)
        top = (body.top_logprobs or 0) if body.logprobs else None
    temperature = body.temperature or 0.0
    if temperature == 0 and top is None:
        return None
    # Choices of one seeded request differ from each other, and each is reproducible.
    seed = None if body.seed is None else (body.seed + index) % sampling.SEED_MODULUS
    return sampling.Sampling(temperature=temperature,
                             top_p=1.0 if body.top_p is None else body.top_p,
                             seed=seed, logprobs=top)


class _Choices:
    """The n requests of one completion in the engine, their events on one queue.

    Choice 0 goes first; the others are submitted once it has a token (its prompt is then
    computed and committed), so that they take the prompt's full blocks from the cache
    instead of all computing it side by side."""

    def __init__(self, server: Server, body: _Common, request_id: str,
                 prompt: tuple[int, ...], max_tokens: int) -> None:
        self._server = server
        self._body = body
        self._prompt = prompt
        self._max_tokens = max_tokens
        self._stop = _stops(body)
        self.n = body.n or 1
        self.ids = [request_id] if self.n == 1 else [f"{request_id}-{i}"
                                                      for i in range(self.n)]
        self.events: asyncio.Queue[_Event] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._unfinished: set[int] = set()
        self._submitted = 0
        self._submit(0)

    def _submit(self, index: int) -> None:
        body = self._body
        try:
            self._server.engine.submit(GenerateRequest(
                request_id=self.ids[index], prompt=self._prompt,
                max_new_tokens=self._max_tokens, ttl_seconds=body.kv_cache_ttl_seconds,
                priority=body.priority, cache_salt=body.cache_salt,
                sampling=_sampling(body, index), stop=self._stop,
            ), _ChoiceSink(self._loop, self.events, index))
        except EngineStopped as exc:
            self.cancel()
            raise BadRequest(str(exc), None, status=503, code="engine_stopped") from None
        self._unfinished.add(index)
        self._submitted += 1

    async def next(self) -> _Event:
        """The next event of any choice; a failed choice raises BadRequest (500)."""
        event = await self.events.get()
        if event.index == 0 and event.error is None:
            while self._submitted < self.n:
                self._submit(self._submitted)
        if event.result is not None or event.error is not None:
            self._unfinished.discard(event.index)
        if event.error is not None:
            raise BadRequest(f"generation failed: {event.error}", None, status=500,
                             code="engine_error")
        return event

    @property
    def done(self) -> bool:
        return self._submitted == self.n and not self._unfinished

    def cancel(self) -> None:
        """Release every choice still in the engine (the client went away, or one failed)."""
        for index in self._unfinished:
            self._server.engine.cancel(self.ids[index])
        self._unfinished.clear()


def _completion_token(token: int) -> str:
    """A byte token's name in a completion's logprobs (distinct per byte: the keys of
    top_logprobs), as OpenAI names a token that is not a whole character."""
    return chr(token) if token < 0x80 else f"bytes:\\x{token:02x}"


def _chat_token(token: int) -> dict[str, Any]:
    return {"token": bytes([token]).decode("utf-8", errors="replace"), "bytes": [token]}


class _Answer:
    """One choice's text, released as its tokens arrive, with their logprobs.

    Text that may still turn out to be the start of a stop string is held back until the
    next token says otherwise (OpenAI never returns the stop string, streamed or not)."""

    def __init__(self, stops: tuple[tuple[int, ...], ...], *, chat: bool,
                 logprobs: bool) -> None:
        self._stops = stops
        self._chat = chat
        self._logprobs = logprobs
        self._decoder = tokenizer.StreamDecoder()
        self._window = max((len(stop) for stop in stops), default=0)
        self._tail: tuple[int, ...] = ()
        """The last `_window` tokens generated."""
        self._pending: list[tuple[int, sampling.TokenLogprob | None]] = []
        self._chars = 0

    def feed(self, token: int, logprob: sampling.TokenLogprob | None
             ) -> tuple[str, dict[str, Any] | None]:
        self._pending.append((token, logprob))
        if not self._stops:
            release, self._pending = self._pending, []
            return self._render(release)
        # Only the last tokens can end or begin a stop sequence: a bounded window, not the
        # whole output, is compared on each token.
        self._tail = (*self._tail, token)[-self._window:]
        tail = self._tail
        if any(tail[len(tail) - len(stop):] == stop for stop in self._stops
               if len(stop) <= len(tail)):
            return "", None  # the loop ends the request on this token: none of it is text
        held = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), held, -1):
                if tail[len(tail) - k:] == stop[:k]:
                    held = k
                    break
        release = self._pending[:len(self._pending) - held]
        self._pending = self._pending[len(self._pending) - held:]
        return self._render(release)

    def finish(self, result: serving_loop.RequestResult) -> tuple[str, dict[str, Any] | None]:
        keep = len(self._pending) - result.stop_tokens
        if keep < 0:
            raise RuntimeError(f"the stop sequence ({result.stop_tokens} tokens) was not "
                               f"held back ({len(self._pending)} tokens were)")
        text, logprobs = self._render(self._pending[:keep])
        self._pending = []
        tail = self._decoder.flush()
        self._chars += len(tail)
        return text + tail, logprobs

    def whole(self, result: serving_loop.RequestResult) -> tuple[str, dict[str, Any] | None]:
        """A finished request's answer at once (the loop cut its stop sequence already)."""
        kept = result.answer
        logprobs = result.logprobs
        text, body = self._render([(token, None if logprobs is None else logprobs[i])
                                   for i, token in enumerate(kept)])
        tail = self._decoder.flush()
        self._chars += len(tail)
        return text + tail, body

    def _render(self, tokens: list[tuple[int, sampling.TokenLogprob | None]]
                ) -> tuple[str, dict[str, Any] | None]:
        text: list[str] = []
        offsets: list[int] = []
        for token, _logprob in tokens:
            offsets.append(self._chars)
            piece = self._decoder.feed([token])
            self._chars += len(piece)
            text.append(piece)
        if not self._logprobs:
            return "".join(text), None
        entries = [logprob for _token, logprob in tokens if logprob is not None]
        if len(entries) != len(tokens):
            raise RuntimeError("the serving loop gave a token without its logprobs")
        if self._chat:
            return "".join(text), {"content": [
                {**_chat_token(e.token), "logprob": e.logprob,
                 "top_logprobs": [{**_chat_token(t), "logprob": lp} for t, lp in e.top]}
                for e in entries], "refusal": None}
        return "".join(text), {
            "tokens": [_completion_token(e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_completion_token(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }


def _wants_logprobs(body: _Common) -> bool:
    if isinstance(body, CompletionRequest):
        return body.logprobs is not None
    assert isinstance(body, ChatCompletionRequest)
    return bool(body.logprobs)


async def _collect(choices: _Choices) -> list[serving_loop.RequestResult]:
    """Wait for every choice's result (their tokens arrive one by one before)."""
    results: dict[int, serving_loop.RequestResult] = {}
    while len(results) < choices.n:
        event = await choices.next()
        if event.result is not None:
            results[event.index] = event.result
    return [results[index] for index in range(choices.n)]


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body was read: only that can come next)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, allow_nan=False)
    return f"data: {data}\n\n".encode()


async def _respond(server: Server, request: Request, body: _Common, *, chat: bool
                   ) -> JSONResponse | StreamingResponse:
    if chat:
        assert isinstance(body, ChatCompletionRequest)
        prompt = _chat_prompt(body)
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
    else:
        assert isinstance(body, CompletionRequest)
        prompt = _completion_prompt(body)
        max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
    server.check(body, prompt, max_tokens)
    request_id = server.next_id("chatcmpl" if chat else "cmpl")
    created = int(time.time())
    model = server.options.served_model_name
    obj = "chat.completion" if chat else "text_completion"
    choices = _Choices(server, body, request_id, prompt, max_tokens)
    stops = _stops(body)
    wants_logprobs = _wants_logprobs(body)

    if not body.stream:
        collector = asyncio.ensure_future(_collect(choices))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():  # the client went away (or the server stops)
                collector.cancel()
            choices.cancel()  # a no-op once every choice finished
        if not collector.done() or collector.cancelled():
            return JSONResponse(_error_body("the client closed the connection", None,
                                            "client_closed"), status_code=499)
        results = collector.result()  # raises BadRequest when generation failed
        out: list[dict[str, Any]] = []
        for index, result in enumerate(results):
            text, logprob_body = _Answer((), chat=chat, logprobs=wants_logprobs).whole(result)
            choice: dict[str, Any] = {"index": index, "finish_reason": result.finish_reason,
                                      "logprobs": logprob_body}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out.append(choice)
        return JSONResponse({"id": request_id, "object": obj, "created": created,
                             "model": model, "choices": out,
                             "usage": _usage(results[0], results[1:])})

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, delta_text: str | None, finish: str | None,
              logprobs: dict[str, Any] | None = None, *, role: bool = False
              ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish,
                                  "logprobs": logprobs}
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice["delta"] = delta
        else:
            choice["text"] = delta_text or ""
        payload: dict[str, Any] = {"id": request_id, "object": chunk_obj, "created": created,
                                   "model": model, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return payload

    async def events() -> AsyncIterator[bytes]:
        answers = [_Answer(stops, chat=chat, logprobs=wants_logprobs)
                   for _ in range(choices.n)]
        results: dict[int, serving_loop.RequestResult] = {}
        try:
            if chat:
                for index in range(choices.n):
                    yield _sse(chunk(index, "", None, role=True))
            while len(results) < choices.n:
                try:
                    event = await choices.next()
                except BadRequest as exc:
                    yield _sse(_error_body(exc.message, None, exc.code, "server_error"))
                    return
                answer = answers[event.index]
                if event.token is not None:
                    text, logprobs = answer.feed(event.token, event.logprob)
                    if text or logprobs is not None:
                        yield _sse(chunk(event.index, text, None, logprobs))
                    continue
                assert event.result is not None
                results[event.index] = event.result
                tail, logprobs = answer.finish(event.result)
                yield _sse(chunk(event.index, tail or ("" if not chat else None),
                                 event.result.finish_reason, logprobs))
            if include_usage:
                ordered = [results[index] for index in range(choices.n)]
                usage_chunk: dict[str, Any] = {
                    "id": request_id, "object": chunk_obj, "created": created,
                    "model": model, "choices": [], "usage": _usage(ordered[0], ordered[1:])}
                yield _sse(usage_chunk)
            yield _sse("[DONE]")
        finally:
            choices.cancel()  # the client went away (or the server stops): free its pages

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# ---------------------------------------------------------------------- the app


_UNION_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\]|function-\w+\[.*\])")
"""How pydantic names the member of a union that an error is about (``prompt.str``)."""


def _param_of(error: Any) -> str | None:
    """The request field a validation error is about, as OpenAI names it (``prompt``,
    ``messages.0.content``): None for a body that is not JSON at all (pydantic puts the
    byte offset of the syntax error where the field would be)."""
    if error.get("type") == "json_invalid":
        return None
    parts = [part for part in error.get("loc", ()) if part != "body"]
    kept = [str(part) for part in parts
            if isinstance(part, int) or not _UNION_TAG.fullmatch(str(part))]
    return ".".join(kept) or None


def create_app(options: ServerOptions, server: Server | None = None) -> FastAPI:
    """The ASGI app.  Its lifespan builds the model, opens the cache and starts the engine,
    unless `server` was built already (the command builds it first, so that a bad option is
    reported before anything listens); either way it closes them at shutdown."""
    state: dict[str, Server] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        with tempfile.TemporaryDirectory(prefix="statekv-serve-") as tmp:
            nonlocal server
            if server is None:
                disk_dir = options.disk_dir if options.disk_dir is not None else Path(tmp)
                server = await asyncio.to_thread(Server, options, disk_dir)
            state["server"] = server
            try:
                with startup_heap_frozen():
                    yield
            finally:
                await asyncio.to_thread(server.close)

    app = FastAPI(title="statekv", lifespan=lifespan)

    def current() -> Server:
        return state["server"]

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return JSONResponse(_error_body(exc.message, exc.param, exc.code, kind),
                            status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _param_of(first)
        message = "; ".join(f"{_param_of(e) or 'body'}: {e.get('msg', 'invalid')}"
                            for e in errors)
        return JSONResponse(_error_body(message, param, None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(_error_body(str(exc.detail), None, None), status_code=exc.status_code)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request
                          ) -> JSONResponse | StreamingResponse:
        return await _respond(current(), request, body, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request
                               ) -> JSONResponse | StreamingResponse:
        return await _respond(current(), request, body, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        server = current()
        return {"object": "list", "data": [{
            "id": options.served_model_name, "object": "model", "created": 0,
            "owned_by": "statekv", "max_model_len": server.context_length}]}

    @app.get("/health", response_model=None)
    async def health() -> dict[str, str] | JSONResponse:
        # A load balancer must stop sending requests once the serving loop failed: every
        # request would be refused.
        if not current().engine.healthy:
            return JSONResponse({"status": "unhealthy", "reason": "the serving loop is not "
                                 "running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        # Off the event loop: the engine's figures are read between two of its steps.
        data = await asyncio.to_thread(generate_latest, current().registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    app.state.statekv = state
    return app


def server_of(app: FastAPI) -> Server:
    """The running app's Server (for tests and embedding): its engine and cache."""
    state: dict[str, Server] = app.state.statekv
    return state["server"]


def run_server(options: ServerOptions, listener: socket.socket, *,
               log_level: str = "info", on_ready: Callable[[], None] | None = None) -> None:
    """Serve on `listener` until interrupted (uvicorn handles SIGINT and SIGTERM).

    The model, cache and engine are built first, here: a typed error (an impossible budget)
    reaches the caller before the app starts."""
    # serve/shutdown.py: every `finally` below runs on SIGTERM; serve/accept_errors.py: a
    # process short of file descriptors logs that once per interval, not once per retry.
    with sigterm_raises(), accept_errors_limited():
        _serve_until_stopped(options, listener, log_level=log_level, on_ready=on_ready)


def _serve_until_stopped(options: ServerOptions, listener: socket.socket, *, log_level: str,
                         on_ready: Callable[[], None] | None) -> None:
    with tempfile.TemporaryDirectory(prefix="statekv-serve-") as tmp:
        server = Server(options, options.disk_dir if options.disk_dir is not None else Path(tmp))
        try:
            if on_ready is not None:
                on_ready()
            app = create_app(options, server)
            config = uvicorn.Config(app, log_level=log_level, lifespan="on")
            http = _InterruptibleServer(config)
            http.run(sockets=[listener])
            # uvicorn shuts down gracefully on SIGINT and then re-raises the signal, but that
            # re-raise reaches asyncio.run's own handler, which only cancels a main task that
            # may already be done: the process then ended with status 0, as if nobody had
            # pressed Ctrl-C (seen on a loaded machine).  Say it was interrupted ourselves.
            if http.interrupted:
                raise KeyboardInterrupt
        finally:
            server.close()


class _InterruptibleServer(uvicorn.Server):
    """uvicorn's server, remembering whether Ctrl-C (SIGINT) ended it."""

    interrupted = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGINT:
            self.interrupted = True
        super().handle_exit(sig, frame)
