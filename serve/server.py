"""``statekv serve``: OpenAI-compatible completions and chat completions over the serving loop.

FastAPI on uvicorn, as the serving engines of the ecosystem do.  The routes:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming (server-sent events,
  ``stream: true``) or not, greedy decoding;
* ``GET /v1/models``, ``GET /health``, and ``GET /metrics`` (Prometheus: the cache's
  ``statistics()`` through :class:`io_actors.metrics.StateKVCollector`, and the serving
  loop's queue depths).

Requests take three fields beyond OpenAI's, under the names the ecosystem uses:
``kv_cache_ttl_seconds`` (keep this request's KV reusable for that long, down to disk),
``cache_salt`` (vLLM's tenant isolation: requests share cached blocks only with the same salt)
and ``priority`` (the retention class, 0 .. priority_levels - 1).  The response's
``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens taken from the cache,
on any tier.  A bad request gets HTTP 400 with OpenAI's error body, naming the field in
``param``.  A streaming client that goes away cancels its request: the loop releases it.
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
from collections.abc import AsyncIterator, Callable, Iterator
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
from ._models import serving_loop
from .accept_errors import accept_errors_limited
from .engine import Engine, EngineStopped, GenerateRequest
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
    temperature: Annotated[float, Field(ge=0, le=0, strict=True)] | None = None
    """Only greedy decoding: 0 or absent."""
    n: Annotated[int, Field(ge=1, le=1, strict=True)] | None = None
    user: Text | None = None
    kv_cache_ttl_seconds: Ttl | None = None
    cache_salt: Annotated[Text, Field(min_length=1)] | None = None
    priority: Priority = 0


class CompletionRequest(_Common):
    prompt: Text | list[Annotated[int, Field(strict=True)]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None


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


class _Stream:
    """One request's events, carried from the engine thread into the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.events: asyncio.Queue[int | serving_loop.RequestResult | BaseException] = (
            asyncio.Queue())

    def _put(self, item: int | serving_loop.RequestResult | BaseException) -> None:
        # The event loop may be gone already (the server stopped with requests in flight).
        with suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.events.put_nowait, item)

    def token(self, token: int) -> None:
        self._put(token)

    def finished(self, result: serving_loop.RequestResult) -> None:
        self._put(result)

    def failed(self, error: BaseException) -> None:
        self._put(error)


def _usage(result: serving_loop.RequestResult) -> dict[str, Any]:
    completion = len(result.output)
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
            remote_tls_ca_file=options.remote_tls_ca_file,
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

    def generate(self, body: _Common, request_id: str, prompt: tuple[int, ...],
                 max_tokens: int) -> _Stream:
        stream = _Stream(asyncio.get_running_loop())
        try:
            self.engine.submit(GenerateRequest(
                request_id=request_id, prompt=prompt, max_new_tokens=max_tokens,
                ttl_seconds=body.kv_cache_ttl_seconds, priority=body.priority,
                cache_salt=body.cache_salt,
            ), stream)
        except EngineStopped as exc:
            raise BadRequest(str(exc), None, status=503, code="engine_stopped") from None
        return stream


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


def _chat_prompt(body: ChatCompletionRequest) -> tuple[int, ...]:
    try:
        return tokenizer.encode(tokenizer.chat_prompt(
            [(m.role, m.content) for m in body.messages]))
    except UnicodeEncodeError:
        raise BadRequest("message content must be encodable as UTF-8", "messages") from None


async def _collect(stream: _Stream) -> serving_loop.RequestResult:
    """Wait for a request's result (its tokens arrive one by one before it)."""
    while True:
        item = await stream.events.get()
        if isinstance(item, BaseException):
            raise BadRequest(f"generation failed: {item}", None, status=500,
                             code="engine_error")
        if isinstance(item, serving_loop.RequestResult):
            return item


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
    stream = server.generate(body, request_id, prompt, max_tokens)

    if not body.stream:
        collector = asyncio.ensure_future(_collect(stream))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():  # the client went away (or the server stops)
                collector.cancel()
                server.engine.cancel(request_id)
        if not collector.done() or collector.cancelled():
            return JSONResponse(_error_body("the client closed the connection", None,
                                            "client_closed"), status_code=499)
        result = collector.result()  # raises BadRequest when generation failed
        text = tokenizer.decode(result.output)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse({"id": request_id, "object": obj, "created": created,
                             "model": model, "choices": [choice], "usage": _usage(result)})

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_text: str | None, finish: str | None, *, role: bool = False
              ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
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
        decoder = tokenizer.StreamDecoder()
        done = False
        try:
            if chat:
                yield _sse(chunk("", None, role=True))
            while True:
                item = await stream.events.get()
                if isinstance(item, BaseException):
                    yield _sse(_error_body(f"generation failed: {item}", None,
                                           "engine_error", "server_error"))
                    done = True
                    break
                if isinstance(item, int):
                    text = decoder.feed([item])
                    if text:
                        yield _sse(chunk(text, None))
                    continue
                done = True
                tail = decoder.flush()
                yield _sse(chunk(tail or ("" if not chat else None), "length"))
                if include_usage:
                    usage_chunk: dict[str, Any] = {
                        "id": request_id, "object": chunk_obj, "created": created,
                        "model": model, "choices": [], "usage": _usage(item)}
                    yield _sse(usage_chunk)
                break
            yield _sse("[DONE]")
        finally:
            if not done:  # the client went away (or the server stops): free its pages
                server.engine.cancel(request_id)

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
