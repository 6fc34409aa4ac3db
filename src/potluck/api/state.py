"""What every route shares (`Api`): the model, its scheduler and the server's config; the checks
before a request runs (API key, JSON body, model id, token budget); submitting its choices to the
scheduler as a `Job` and turning their events into text pieces; logprobs in OpenAI's two forms.

The asyncio loop only does I/O: generation runs on the scheduler's compute thread, and its events
come back through `loop.call_soon_threadsafe` into one asyncio.Queue per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HttpRequest

from potluck.api import errors
from potluck.api.errors import Disconnected, api_error
from potluck.api.job import Choice, Job, Piece
from potluck.api.metrics import Metrics, RequestTiming
from potluck.api.pool import PoolInfo
from potluck.api.text import StopText
from potluck.engine.generate import Model
from potluck.engine.scheduler import (
    INTERACTIVE,
    Event,
    Failed,
    Finished,
    Request,
    Scheduler,
    TokenEvent,
)
from potluck.sampling import Token

if TYPE_CHECKING:  # the bodies are the routes' (completions.py imports this module)
    from potluck.api.completions import ChatCompletionRequest, CompletionRequest

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
            check_unicode(await request.json())

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
        grammar: str | None = None,
    ) -> Job:
        """Submit every choice (prompts × n); all or none (429 cancels the ones already in).
        grammar: what constrains every choice's answer (grammar.py; compiled and checked)."""
        if len(prompts) * body.n > MAX_CHOICES:
            raise errors.bad_request(
                f"{len(prompts)} prompts × n={body.n} is more than {MAX_CHOICES} choices", "n"
            )
        what = body.prompt_field
        budgets = [self.budget(len(p), body.limit(), default_tokens, what) for p in prompts]
        loop = asyncio.get_running_loop()
        job = Job(prompt_tokens=sum(len(p) for p in prompts))
        try:
            for p_i, (ids, budget) in enumerate(zip(prompts, budgets, strict=True)):
                for j in range(body.n):
                    params = dataclasses.replace(body.sampling(j), grammar=grammar)
                    index = p_i * body.n + j
                    timing = self.metrics.timing()

                    def sink(ev: Event, index: int = index, timing: RequestTiming = timing) -> None:
                        timing.see(ev)  # (on the scheduler's thread)
                        loop.call_soon_threadsafe(job.queue.put_nowait, (index, ev))

                    req = Request(
                        tuple(ids), params, budget, self.tokenizer.eot_ids, priority, lora
                    )
                    stream = self.scheduler.submit(req, sink)
                    stop_text = StopText(self.tokenizer, body.stops())
                    job.choices.append(Choice(index, stream, stop_text, len(ids), p_i))
        except BaseException as exc:
            job.cancel()
            raise api_error(exc) from exc
        return job

    async def pieces(
        self, job: Job, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[Piece]:
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
                    raise Disconnected()
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
                raise api_error(ev.error)
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
                    yield Piece(index, text, [t for t in ids], None)
            elif isinstance(ev, Finished):
                if ev.reason == "cancelled" and c.finish is None:
                    raise errors.ApiError(
                        503, "generation was cancelled: the server is stopping", "server_error"
                    )
                text, ids = c.text.flush()
                c.done, remaining = True, remaining - 1
                c.n_cached = ev.n_cached
                if ev.reason != "cancelled":
                    c.n_generated = ev.n_generated
                yield Piece(index, text, ids, c.finish or ev.reason)

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

    def completion_logprobs(self, ids: list[int], c: Choice) -> dict[str, Any]:
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


def check_unicode(body: Any) -> None:
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
