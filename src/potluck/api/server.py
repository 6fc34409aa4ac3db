"""The OpenAI-compatible HTTP server: FastAPI routes over the scheduler, SSE streaming, the
dashboard's JSON and the static web page.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both streaming or not), GET /v1/models,
GET /health, GET /metrics (Prometheus), GET /api/pool (the dashboard), and the files of
api/static/ at /. With an API key set, everything but /health and the static files needs
`Authorization: Bearer KEY`.

The asyncio loop only does I/O: generation runs on the scheduler's compute thread, and its events
come back through `loop.call_soon_threadsafe` into one asyncio.Queue per request.

GET /api/pool returns exactly:
  {"model": {"name", "arch", "quant", "n_layer", "n_ctx"},
   "nodes": [{"name", "address" ("local" or "host:port"), "device", "layers": [start, stop],
              "memory_used_bytes", "memory_total_bytes", "compute_ms" (or null), "hop_ms" (or null),
              "tokens_per_s" (or null), "status" ("ok" or "unreachable")}],
   "tokens_per_s", "requests_active", "requests_queued", "requests_total",
   "batches": [{"id", "status", "total", "completed", "failed"}] (running ones and the last done)}
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from potluck import __version__
from potluck.api import errors
from potluck.api.batch import Recruit
from potluck.api.batches import batch_progress
from potluck.api.errors import ApiError
from potluck.api.metrics import Metrics, RequestTiming
from potluck.api.pool import PoolInfo
from potluck.api.schemas import TOP_K_ALL, ChatCompletionRequest, ChatMessage, CompletionRequest
from potluck.api.text import StopText
from potluck.engine.generate import Model
from potluck.engine.sampling import SamplingParams, Token
from potluck.engine.scheduler import (
    BATCH,
    INTERACTIVE,
    Event,
    Failed,
    Finished,
    QueueFullError,
    Request,
    Scheduler,
    Stream,
    TokenEvent,
)
from potluck.errors import ContextError, PotluckError, UnsupportedError
from potluck.modelfile.chat import ChatTemplateError

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
MAX_CHOICES = 64  # prompts × n in one request
DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is still there


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    api_key: str | None = None
    event_timeout_s: float = 300.0  # longest silence from the scheduler before a request fails
    default_completion_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    batch_dir: Path | None = None  # the Files and Batches API's database and files (None: off)


def model_id_of(model: Model) -> str:
    """The id clients send as `model`: the GGUF file's name without .gguf."""
    return model.path.stem


# -- one request's choices, from scheduler events to text pieces -----------------------------------
@dataclass
class _Choice:
    index: int
    stream: Stream
    text: StopText
    n_prompt: int
    n_generated: int = 0
    finish: str | None = None
    done: bool = False
    offset: int = 0  # characters sent so far (completions' text_offset)


@dataclass(frozen=True)
class _Piece:
    index: int
    text: str
    ids: list[int]
    finish: str | None


class _Disconnected(Exception):
    pass


@dataclass
class _Job:
    """The choices of one HTTP request, running on the scheduler."""

    choices: list[_Choice] = field(default_factory=list)
    queue: asyncio.Queue[tuple[int, Event]] = field(default_factory=asyncio.Queue)
    prompt_tokens: int = 0

    def cancel(self) -> None:
        for c in self.choices:
            if not c.done:
                c.stream.cancel()

    def usage(self) -> dict[str, int]:
        done = sum(c.n_generated for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }


def _api_error(exc: BaseException) -> ApiError:
    """Potluck's typed errors → the HTTP answer (mapped once, here)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFullError):
        return errors.overloaded(str(exc))
    if isinstance(exc, ContextError):
        return errors.bad_request(str(exc), "messages", "context_length_exceeded")
    if isinstance(exc, UnsupportedError | ChatTemplateError):
        return errors.bad_request(str(exc))
    if isinstance(exc, PotluckError):
        return errors.server_error(str(exc))
    log.error("unexpected error: %r", exc)
    return errors.server_error(f"internal error: {type(exc).__name__}: {exc}")


class _StatusCounter:
    """Pure ASGI middleware counting answers by endpoint and status (streaming stays untouched)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path.startswith(("/v1/", "/api/", "/metrics", "/health")) else "static"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count(endpoint, int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)


class Api:
    """The routes' state: the model, its scheduler and the config."""

    def __init__(self, model: Model, scheduler: Scheduler, config: ServerConfig) -> None:
        self.model, self.scheduler, self.config = model, scheduler, config
        self.tokenizer = model.tokenizer
        self.pool = PoolInfo(model, scheduler, config.model_id)
        self.metrics = Metrics(scheduler, self.pool)
        self.created = int(time.time())
        name = model.file.metadata.get("general.name")
        self.aliases = {config.model_id, model.path.name, model.path.stem} | (
            {str(name)} if name else set()
        )

    # -- checks ------------------------------------------------------------------------------------
    async def auth(self, request: HttpRequest) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if not header:
            raise errors.unauthorized(
                "Missing API key: send the header 'Authorization: Bearer <key>' (the key the "
                "server was started with, --api-key)"
            )
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), key.encode()
        ):
            raise errors.unauthorized("Incorrect API key provided")

    async def json_body(self, request: HttpRequest) -> None:
        """A POST body is JSON, said so by its Content-Type, and every string in it is Unicode.

        Without the header FastAPI does not parse the body (a web page can make a browser post
        text/plain to a local server without asking first), so every field would be "missing".
        """
        kind = request.headers.get("content-type")
        mime = (kind or "").partition(";")[0].strip().lower()
        if mime != "application/json" and not (
            mime.startswith("application/") and mime.endswith("+json")
        ):
            got = f"Content-Type: {kind}" if kind else "no Content-Type"
            raise errors.ApiError(
                415,
                f"send the body as JSON with the header 'Content-Type: application/json' "
                f"(got {got})",
            )
        if await request.body():  # (FastAPI has parsed it; an empty one is "body: Field required")
            _check_unicode(await request.json())

    def check_model(self, name: str) -> int | None:
        """The adapter a model id asks for (Request.lora): the base model's ids take none of the
        server's adapters, `BASE+ADAPTER` that one; a server without adapters: None."""
        if name in self.aliases:
            return -1 if self.model.adapters else None
        if name in self.adapter_ids:
            return self.adapter_ids[name]
        raise errors.model_not_found(name, self.config.model_id)

    @property
    def adapter_ids(self) -> dict[str, int]:
        return {f"{self.config.model_id}+{a}": k for k, a in enumerate(self.model.adapters)}

    def budget(self, n_prompt: int, asked: int | None, default: int | None, what: str) -> int:
        """max_tokens for one prompt: as asked if prompt + asked fits the context, else 400."""
        n_ctx = self.model.n_ctx
        if n_prompt == 0:
            raise errors.bad_request("the prompt is empty after tokenization; give some text")
        if n_prompt >= n_ctx or (asked is not None and n_prompt + asked > n_ctx):
            raise errors.context_too_long(n_ctx, n_prompt, asked or 0, what)
        room = n_ctx - n_prompt
        return asked if asked is not None else min(default or room, room)

    # -- running -----------------------------------------------------------------------------------
    def start(
        self,
        prompts: list[list[int]],
        body: ChatCompletionRequest | CompletionRequest,
        default_tokens: int | None,
        priority: int = INTERACTIVE,
        lora: int | None = None,
    ) -> _Job:
        """Submit every choice (prompts × n); all or none (429 cancels the ones already in)."""
        if len(prompts) * body.n > MAX_CHOICES:
            raise errors.bad_request(
                f"{len(prompts)} prompts × n={body.n} is more than {MAX_CHOICES} choices", "n"
            )
        what = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        budgets = [self.budget(len(p), body.limit(), default_tokens, what) for p in prompts]
        loop = asyncio.get_running_loop()
        job = _Job(prompt_tokens=sum(len(p) for p in prompts))
        try:
            for p_i, (ids, budget) in enumerate(zip(prompts, budgets, strict=True)):
                for j in range(body.n):
                    params = SamplingParams(
                        temperature=body.temperature,  # below GREEDY_BELOW: greedy (Sampler)
                        top_k=min(body.top_k, TOP_K_ALL),
                        top_p=body.top_p,
                        min_p=body.min_p,
                        repeat_penalty=body.repeat_penalty,
                        presence_penalty=body.presence_penalty,
                        frequency_penalty=body.frequency_penalty,
                        seed=body.seed_of(j),
                        logprobs=body.logprob_k(),
                    )
                    index = p_i * body.n + j
                    timing = self.metrics.timing()

                    def sink(ev: Event, index: int = index, timing: RequestTiming = timing) -> None:
                        timing.see(ev)  # (on the scheduler's thread)
                        loop.call_soon_threadsafe(job.queue.put_nowait, (index, ev))

                    req = Request(
                        tuple(ids), params, budget, self.tokenizer.eot_ids, priority, lora
                    )
                    stream = self.scheduler.submit(req, sink)
                    job.choices.append(
                        _Choice(index, stream, StopText(self.tokenizer, body.stops()), len(ids))
                    )
        except BaseException as exc:
            job.cancel()
            raise _api_error(exc) from exc
        return job

    async def pieces(
        self, job: _Job, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[_Piece]:
        """Text pieces of every choice as they come; the last piece of a choice has `finish`."""
        remaining = len(job.choices)
        limit = self.config.event_timeout_s
        wait = DISCONNECT_POLL_S if disconnected is not None else limit
        last_event = last_check = time.monotonic()
        while remaining:
            try:
                index, ev = await asyncio.wait_for(job.queue.get(), wait)
            except TimeoutError:
                index, ev = -1, None
            now = time.monotonic()
            if disconnected is not None and now - last_check >= DISCONNECT_POLL_S:
                last_check = now
                if await disconnected():
                    raise _Disconnected()
            if ev is None:
                if now - last_event >= limit:
                    raise errors.ApiError(
                        503,
                        f"no token in {now - last_event:.0f} s: the pool is stuck or overloaded",
                        "server_error",
                    )
                continue
            last_event = now
            c = job.choices[index]
            if isinstance(ev, Failed):
                raise _api_error(ev.error)
            if c.done:
                continue
            if isinstance(ev, TokenEvent):
                c.n_generated = ev.index + 1
                if c.finish is not None or int(ev.token) in self.tokenizer.eot_ids:
                    continue
                text, ids = c.text.push(ev.token)
                if c.text.stopped:  # a stop sequence: nothing after it is generated or sent
                    c.finish = "stop"
                    c.stream.cancel("stop")
                if text or ids:
                    yield _Piece(index, text, [t for t in ids], None)
            elif isinstance(ev, Finished):
                if ev.reason == "cancelled" and c.finish is None:
                    raise errors.ApiError(503, "generation was cancelled: the server is stopping")
                text, ids = c.text.flush()
                c.done, remaining = True, remaining - 1
                if ev.reason != "cancelled":
                    c.n_generated = ev.n_generated
                yield _Piece(index, text, ids, c.finish or ev.reason)

    # -- logprobs ----------------------------------------------------------------------------------
    def _tok(self, t: int) -> tuple[str, list[int]]:
        b = self.tokenizer.token_bytes(int(t))
        return b.decode("utf-8", errors="replace"), list(b)

    def chat_logprobs(self, ids: list[int]) -> list[dict[str, Any]]:
        out = []
        for t in ids:
            text, b = self._tok(t)
            top = []
            for alt, lp in getattr(t, "top", ()):
                at, ab = self._tok(alt)
                top.append({"token": at, "logprob": lp, "bytes": ab})
            out.append(
                {
                    "token": text,
                    "logprob": getattr(t, "logprob", 0.0),
                    "bytes": b,
                    "top_logprobs": top,
                }
            )
        return out

    def completion_logprobs(self, ids: list[int], c: _Choice) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        for t in ids:
            text, _ = self._tok(t)
            tokens.append(text)
            lps.append(t.logprob if isinstance(t, Token) else 0.0)
            tops.append({self._tok(a)[0]: lp for a, lp in getattr(t, "top", ())})
            offsets.append(c.offset)
            c.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(
    model: Model,
    scheduler: Scheduler,
    config: ServerConfig,
    batch_replicas: Sequence[tuple[str, Any]] = (),
    batch_recruit: Recruit | None = None,
) -> FastAPI:
    """The app for one loaded model and its running scheduler (the CLI builds both: cli/serve.py).
    batch_replicas: more (label, app) for batch jobs (whole-model replicas on idle workers);
    batch_recruit: such replicas again once their worker is back, and on workers found later."""
    api = Api(model, scheduler, config)
    app = FastAPI(
        title="Potluck",
        version=__version__,
        description="OpenAI-compatible API over a pool of home computers.",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.api = api
    app.add_middleware(_StatusCounter, metrics=api.metrics)
    guarded = [Depends(api.auth)]
    posted = [Depends(api.auth), Depends(api.json_body)]

    @app.exception_handler(ApiError)
    async def _on_api_error(_: HttpRequest, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(_Disconnected)
    async def _on_gone(_: HttpRequest, exc: _Disconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: the client went away (nginx's code)

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(_: HttpRequest, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        ctx = first.get("ctx", {})
        if first.get("type") == "json_invalid":
            msg = f"the body is not valid JSON: {ctx.get('error', first.get('msg'))}"
            return errors.bad_request(msg).response()
        if not loc and first.get("type") == "missing":
            return errors.bad_request(
                "the body is empty: send a JSON object (Content-Type: application/json)"
            ).response()
        where = ".".join(loc) or "body"
        why = ctx.get("error") if first.get("type") == "value_error" else first.get("msg")
        return errors.bad_request(f"{where}: {why or 'invalid value'}", where).response()

    @app.exception_handler(HTTPException)
    async def _on_http(request: HttpRequest, exc: HTTPException) -> Response:
        """Starlette's and FastAPI's own errors (405, a body it cannot parse) in OpenAI's shape."""
        return _http_error(request, exc).response()

    @app.exception_handler(404)
    async def _on_404(request: HttpRequest, _: Exception) -> Response:
        return errors.ApiError(
            404, f"no route {request.method} {request.url.path}", "invalid_request_error"
        ).response()

    if config.batch_dir is not None:  # the Files and Batches API (api/batches.py)
        from potluck.api.batches import (
            LANES_BEHIND_CHATS,
            BatchRunner,
            BatchStore,
            add_batch_routes,
        )

        store = BatchStore(config.batch_dir)
        lanes = max(1, scheduler.config.max_active - LANES_BEHIND_CHATS)
        key = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        replicas = [("this server", app), *batch_replicas]
        runner = BatchRunner(store, replicas, lanes, key, batch_recruit)
        app.state.batches = store
        app.router.on_startup.append(runner.start)
        app.router.on_shutdown.append(runner.stop)
        add_batch_routes(app, store, runner, guarded)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": config.model_id,
            "requests_active": scheduler.active,
            "requests_queued": scheduler.queued,
        }

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        ids = [config.model_id, *api.adapter_ids]
        return {"object": "list", "data": [_model_card(api, i) for i in ids]}

    @app.get("/v1/models/{name}", dependencies=guarded)
    async def model_card(name: str) -> dict[str, Any]:
        api.check_model(name)
        return _model_card(api, name if name in api.adapter_ids else config.model_id)

    @app.get("/api/pool", dependencies=guarded)
    async def pool() -> dict[str, Any]:
        await run_in_threadpool(api.pool.refresh_hellos)
        snap = api.pool.snapshot()
        store = getattr(app.state, "batches", None)
        snap["batches"] = [] if store is None else batch_progress(store)
        return snap

    @app.get("/metrics", dependencies=guarded)
    async def metrics(request: HttpRequest) -> Response:
        await run_in_threadpool(api.pool.refresh_hellos)
        body, content_type = api.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.post("/v1/chat/completions", dependencies=posted)
    async def chat_completions(body: ChatCompletionRequest, request: HttpRequest) -> Response:
        lora = api.check_model(body.model)
        msgs = [_message(m, i) for i, m in enumerate(body.messages)]
        try:
            text = await run_in_threadpool(model.chat.render, msgs)
        except ChatTemplateError as exc:
            raise errors.bad_request(str(exc), "messages") from exc
        ids = await run_in_threadpool(model.tokenizer.encode, text)
        job = api.start([ids], body, None, _priority(request), lora)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        want_lp = body.logprobs
        if body.stream:
            usage_opt = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _chat_stream(api, job, rid, created, body.model, want_lp, usage_opt),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        texts = {c.index: "" for c in job.choices}
        lps: dict[int, list[dict[str, Any]]] = {c.index: [] for c in job.choices}
        finish: dict[int, str] = {}
        try:
            async for p in api.pieces(job, request.is_disconnected):
                texts[p.index] += p.text
                if want_lp:
                    lps[p.index] += api.chat_logprobs(p.ids)
                if p.finish:
                    finish[p.index] = p.finish
        finally:
            job.cancel()
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "system_fingerprint": f"potluck-{__version__}",
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": texts[i]},
                        "logprobs": {"content": lps[i]} if want_lp else None,
                        "finish_reason": finish[i],
                    }
                    for i in sorted(texts)
                ],
                "usage": job.usage(),
            }
        )

    @app.post("/v1/completions", dependencies=posted)
    async def completions(body: CompletionRequest, request: HttpRequest) -> Response:
        lora = api.check_model(body.model)
        prompts, texts0 = await run_in_threadpool(_completion_prompts, api, body.prompt)
        if body.echo and body.logprobs is not None:
            raise errors.bad_request("echo with logprobs is not supported", "echo")
        job = api.start(prompts, body, config.default_completion_tokens, _priority(request), lora)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        echo = {c.index: (texts0[c.index // body.n] if body.echo else "") for c in job.choices}
        if body.stream:
            usage_opt = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _completion_stream(api, job, rid, created, body, echo, usage_opt),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        texts = dict(echo)
        lps: dict[int, list[int]] = {c.index: [] for c in job.choices}
        finish: dict[int, str] = {}
        try:
            async for p in api.pieces(job, request.is_disconnected):
                texts[p.index] += p.text
                lps[p.index] += p.ids
                if p.finish:
                    finish[p.index] = p.finish
        finally:
            job.cancel()
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "system_fingerprint": f"potluck-{__version__}",
                "choices": [
                    {
                        "index": c.index,
                        "text": texts[c.index],
                        "logprobs": api.completion_logprobs(lps[c.index], c)
                        if body.logprobs is not None
                        else None,
                        "finish_reason": finish[c.index],
                    }
                    for c in job.choices
                ],
                "usage": job.usage(),
            }
        )

    if STATIC_DIR.is_dir():
        app.mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="static")
    return app


PRIORITY_HEADER = "X-Potluck-Priority"  # "batch": after interactive requests (a batch job's)


def _priority(request: HttpRequest) -> int:
    """A request that says it belongs to a batch job waits behind interactive ones (a client can
    only lower its own priority this way)."""
    return BATCH if request.headers.get(PRIORITY_HEADER, "").lower() == "batch" else INTERACTIVE


def _model_card(api: Api, model_id: str) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": api.created,
        "owned_by": "potluck",
        "context_length": api.model.n_ctx,
    }


def _http_error(request: HttpRequest, exc: HTTPException) -> ApiError:
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
        return errors.bad_request(f"the body is not valid UTF-8 ({cause}): send JSON in UTF-8")
    if exc.status_code == 400 and isinstance(cause, RecursionError):
        return errors.bad_request(f"the body's JSON is nested too deeply to parse ({cause})")
    if exc.status_code == 400 and cause is not None:
        return errors.bad_request(f"the body is not valid JSON: {cause}")
    if exc.status_code == 405:  # (from the static files too, which take every other path)
        path = request.url.path
        routes = [r for r in request.app.routes if isinstance(r, APIRoute)]
        takes = sorted({m for r in routes if r.path_regex.match(path) for m in r.methods or ()})
        return errors.ApiError(
            405,
            f"{request.method} {path} is not supported; it takes {', '.join(takes) or 'GET'}",
            headers={"Allow": ", ".join(takes or ["GET", "HEAD"])},
        )
    kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return errors.ApiError(
        exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}) or None
    )


_JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return _JSON_TYPES.get(type(value), "an array" if isinstance(value, list) else "an object")


def _check_unicode(body: Any) -> None:
    """400 at the first string (or key) in a parsed JSON body that holds a lone surrogate: valid
    JSON ("\\ud800") that is no Unicode text, so it cannot be tokenized or written as UTF-8."""
    todo: list[tuple[str, Any]] = [("", body)]  # (path, value), depth-first in document order
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = path or "body"
                raise errors.bad_request(
                    f"{where} is not valid Unicode text: character {exc.start} is a lone "
                    f"surrogate U+{ord(value[exc.start]):04X} (half of a UTF-16 pair); send the "
                    f"text as UTF-8, or escape such a character as its full pair",
                    where,
                ) from None
        elif isinstance(value, dict):
            items = list(value.items())
            for k, v in reversed(items):
                todo.append((f"{path}.{k}" if path else k, v))
            todo.extend((f"a key in {path or 'the body'}", k) for k, _ in reversed(items))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))


def _message(m: ChatMessage, i: int) -> dict[str, Any]:
    """One message for the chat template: OpenAI's "developer" role is the system prompt; a list
    of content parts becomes its text (images and audio cannot be read by these models). Content
    may be null only in an assistant message that makes tool calls (as OpenAI); it is "" then."""
    out = m.model_dump(exclude_none=True)
    if out["role"] == "developer":
        out["role"] = "system"
    content = out.get("content")
    if content is None:
        if m.role == "assistant" and ("tool_calls" in out or "function_call" in out):
            out["content"] = ""
            return out
        state = "null" if "content" in m.model_fields_set else "missing"
        raise errors.bad_request(
            f"messages[{i}].content is {state}: give the {m.role} message's text, a string or a "
            f"list of text parts (only an assistant message with tool_calls may leave it null)",
            f"messages[{i}].content",
        )
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind != "text":
                raise errors.bad_request(
                    f"messages[{i}].content[{j}]: content part of type {kind!r} is not "
                    f"supported: send text parts only",
                    f"messages[{i}].content[{j}]",
                )
            if not isinstance(part.get("text"), str):
                raise errors.bad_request(
                    f"messages[{i}].content[{j}].text must be a string, got "
                    f"{_json_type(part.get('text'))}",
                    f"messages[{i}].content[{j}].text",
                )
            texts.append(part["text"])
        out["content"] = "".join(texts)
    return out


def _completion_prompts(api: Api, prompt: Any) -> tuple[list[list[int]], list[str]]:
    """OpenAI's prompt forms → token id lists (and their texts, for echo)."""
    tok = api.tokenizer
    if isinstance(prompt, str):
        return [tok.encode(prompt)], [prompt]
    if not prompt:
        raise errors.bad_request("prompt is empty", "prompt")
    if all(isinstance(x, str) for x in prompt):
        return [tok.encode(p) for p in prompt], list(prompt)
    lists = [prompt] if all(isinstance(x, int) for x in prompt) else prompt
    n_vocab = tok.vocab_size
    for ids in lists:
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:
            raise errors.bad_request(
                f"token id {bad[0]} is outside the vocabulary [0, {n_vocab})", "prompt"
            )
    return [list(ids) for ids in lists], [tok.decode(ids) for ids in lists]


async def _chat_stream(
    api: Api, job: _Job, rid: str, created: int, model: str, want_lp: bool, usage_opt: bool
) -> AsyncIterator[str]:
    def chunk(index: int, delta: dict[str, Any], lp: Any, finish: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": f"potluck-{__version__}",
            "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
        }
        if usage_opt:
            out["usage"] = None
        return out

    try:
        for c in job.choices:
            yield _sse(chunk(c.index, {"role": "assistant", "content": ""}, None, None))
        async for p in api.pieces(job):
            lp = {"content": api.chat_logprobs(p.ids)} if want_lp and p.ids else None
            if p.text or lp:
                yield _sse(chunk(p.index, {"content": p.text}, lp, None))
            if p.finish:
                yield _sse(chunk(p.index, {}, None, p.finish))
        if usage_opt:
            last = chunk(0, {}, None, None) | {"choices": [], "usage": job.usage()}
            yield _sse(last)
        yield "data: [DONE]\n\n"
    except ApiError as exc:  # the stream has started: the error goes in it, as OpenAI does
        yield exc.sse()
    finally:  # also when the client went away (the task is cancelled): free the sequences
        job.cancel()


async def _completion_stream(
    api: Api,
    job: _Job,
    rid: str,
    created: int,
    body: CompletionRequest,
    echo: dict[int, str],
    usage_opt: bool,
) -> AsyncIterator[str]:
    def chunk(index: int, text: str, lp: Any, finish: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "system_fingerprint": f"potluck-{__version__}",
            "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}],
        }
        if usage_opt:
            out["usage"] = None
        return out

    by_index = {c.index: c for c in job.choices}
    try:
        for i, text in echo.items():
            if text:
                yield _sse(chunk(i, text, None, None))
        async for p in api.pieces(job):
            lp = (
                api.completion_logprobs(p.ids, by_index[p.index])
                if body.logprobs is not None and p.ids
                else None
            )
            if p.text or lp:
                yield _sse(chunk(p.index, p.text, lp, None))
            if p.finish:
                yield _sse(chunk(p.index, "", None, p.finish))
        if usage_opt:
            yield _sse(chunk(0, "", None, None) | {"choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield exc.sse()
    finally:
        job.cancel()


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def bind(host: str, port: int) -> tuple[socket.socket, str]:
    """A listening socket on host:port (0: any free port) and its URL."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PotluckError(
            f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port"
        ) from None
    sock.listen(2048)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return sock, f"http://{shown}:{sock.getsockname()[1]}"


def uvicorn_server(app: FastAPI) -> Any:
    """A uvicorn.Server for the app; run it with `.run(sockets=[sock])`, stop it with
    `.should_exit = True` (or Ctrl-C when it runs on the main thread)."""
    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=3, lifespan="on"
    )
    return uvicorn.Server(config)


def serve(app: FastAPI, host: str, port: int, on_listen: Callable[[str], None]) -> None:
    """Run the app with uvicorn until Ctrl-C. `on_listen` gets the URL (with the real port when
    port is 0) once the socket accepts connections."""
    sock, url = bind(host, port)
    server = uvicorn_server(app)
    # uvicorn shuts down gracefully on SIGINT and SIGTERM, then raises the signal again under the
    # handler it found: the default ones would kill the process (SIGTERM) or interrupt whatever
    # runs next (SIGINT) before the caller lets its pool go, and workers would hold its stages
    # until their idle timeout. Under ours the run returns. (Ours also stops a server that has
    # not installed its own handlers yet: a signal right after `on_listen`, which is therefore
    # called only once ours are in place: a supervisor that stops the server as soon as it said
    # it listens would otherwise meet the default handler, and the workers keep its stages.)

    def stop(signum: int, frame: object) -> None:
        server.should_exit = True

    stops = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, stop) for sig in stops} if main_thread else {}
    try:
        on_listen(url)
        server.run(sockets=[sock])
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
