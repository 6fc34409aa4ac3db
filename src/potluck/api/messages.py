"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API, on the same
machinery as chat completions (chat.py's `ChatTurn` → `prepare`, `Api.start`, reply.py's parser).

What differs from chat completions, and where it is handled here:
  - the key comes as `x-api-key` (or `Authorization: Bearer`): `_auth`;
  - errors are Anthropic's `{"type": "error", "error": {"type", "message"}}` with the same status
    codes: `_AnthropicRoute` re-shapes what the app's handlers answer (errors.py stays the one
    mapping), and a stream that has started ends with an `error` event;
  - the body: content blocks (text, tool_use, tool_result) → OpenAI chat messages, `tools` with
    `input_schema`, `tool_choice` {auto, any, tool, none}, `thinking` → the template's
    `enable_thinking`; any field not listed is a 400 that names it; a last assistant message is a
    prefill (the answer continues it);
  - the answer: content blocks (thinking, text, tool_use) built by `Blocks`, the same for the JSON
    answer and the stream (`message_start`, `content_block_*`, `message_delta`, `message_stop`);
    `stop_reason` end_turn / max_tokens / stop_sequence (with which one) / tool_use, and
    model_context_window_exceeded when `max_tokens` was cut to the room left in the context
    (as Anthropic's newer models do, instead of a 400);
  - usage: `input_tokens` are the prompt tokens computed, `cache_read_input_tokens` those reused
    from the prefix cache (their sum is the prompt, what count_tokens says).
"""

from __future__ import annotations

import dataclasses
import hmac
import inspect
import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Literal

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from potluck.api import errors
from potluck.api.chat import ChatTurn, Prepared, prepare
from potluck.api.completions import ChatCompletionRequest, _priority
from potluck.api.errors import ApiError
from potluck.api.job import Job
from potluck.api.reply import THINK_OPEN, Parts, ToolCall
from potluck.api.sse import SSE_HEADERS
from potluck.api.state import Api
from potluck.api.text import StopText

# Anthropic's error types by status (errors.py gives the status; 503: a pool without a node)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
NOT_READ = "not supported: these models read text"
# keys a content block may carry besides its own (cache_control: the prefix cache is automatic;
# the others come back on blocks of earlier answers and say nothing about the text)
BLOCK_EXTRAS = {"cache_control", "citations", "caller", "toolset_name"}
BLOCK_KEYS = {
    "text": {"type", "text"},
    "tool_use": {"type", "id", "name", "input"},
    "tool_result": {"type", "tool_use_id", "content", "is_error"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict"}
TOOL_KEYS |= {"eager_input_streaming"}  # (a call's input is always sent whole, in one delta)


# -- errors ---------------------------------------------------------------------------------------
def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class _AnthropicRoute(APIRoute):
    """A route whose errors are answered in Anthropic's shape: the ApiErrors of the route and its
    dependencies, and what the app's own handlers make of a body that does not validate."""

    def get_route_handler(self) -> Callable[[HttpRequest], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handler(request: HttpRequest) -> Response:
            try:
                return await handle(request)
            except ApiError as exc:
                return _error_response(exc.status, exc.message, exc.headers)
            except (RequestValidationError, HTTPException) as exc:
                return await _reshaped(request, exc)

        return handler


def _error_response(status: int, message: str, headers: dict[str, str]) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


async def _reshaped(request: HttpRequest, exc: Exception) -> Response:
    """The app's answer to `exc` (errors.py's handlers: OpenAI's shape) in Anthropic's."""
    handlers = request.app.exception_handlers
    keys: list[Any] = [exc.status_code] if isinstance(exc, HTTPException) else []
    handler = next((handlers[k] for k in [*keys, *type(exc).__mro__] if k in handlers), None)
    if handler is None:
        raise exc
    answer = handler(request, exc)
    if inspect.isawaitable(answer):
        answer = await answer
    if not isinstance(answer, Response):
        raise exc
    try:
        message = json.loads(bytes(answer.body))["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return answer
    keep = {k: v for k, v in answer.headers.items() if k not in ("content-length", "content-type")}
    return _error_response(answer.status_code, str(message), keep)


def _auth(api: Api) -> Callable[[HttpRequest], Coroutine[Any, Any, None]]:
    """The key check of these routes: Anthropic's clients send `x-api-key: KEY`; `Authorization:
    Bearer KEY` (their auth_token, and OpenAI's clients) is taken too."""

    async def check(request: HttpRequest) -> None:
        key = api.config.api_key
        if key is None:
            return
        given = request.headers.get("x-api-key")
        if given is None:
            scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
            given = bearer.strip() if scheme.lower() == "bearer" else None
        if given is None:
            raise errors.ApiError(
                401,
                "Missing API key: send the header 'x-api-key: <key>' (or 'Authorization: Bearer "
                "<key>'), the key the server was started with (--api-key)",
            )
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise errors.ApiError(401, "invalid x-api-key")

    return check


# -- the bodies -------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # (a field not here: 400)


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)  # (max_tokens bounds the whole answer)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None


class CacheControl(_Strict):  # (accepted: the prefix cache keeps every prompt by itself)
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class CountTokensRequest(_Strict):
    """The turn: what both routes take (count_tokens takes nothing else)."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    def sampling_body(self, max_tokens: int) -> ChatCompletionRequest:
        """What Api.start reads (n, limits, sampling, stops) as chat completions' body; its
        defaults (top_k, min_p) are the server's. (Built from fields checked here: not again.)"""
        given: dict[str, Any] = {"top_p": self.top_p, "top_k": self.top_k}
        return ChatCompletionRequest.model_construct(
            model=self.model,
            messages=[],
            max_tokens=max_tokens,
            temperature=self.temperature,
            stop=list(self.stop_sequences or []),
            **{k: v for k, v in given.items() if v is not None},
        )


# -- the turn -------------------------------------------------------------------------------------
def _bad(message: str) -> ApiError:
    return errors.bad_request(message)


def _text_of(blocks: list[dict[str, Any]], where: str) -> str:
    """Text blocks (a system prompt, a tool result) → their text."""
    texts = []
    for j, block in enumerate(blocks):
        _check_block(block, f"{where}.{j}", ("text",))
        texts.append(block["text"])
    return "\n".join(texts)


def _check_block(block: dict[str, Any], where: str, kinds: tuple[str, ...]) -> str:
    """A content block's type, checked: one of `kinds`, its keys known, its fields' types."""
    kind = block.get("type")
    if kind in ("image", "document", "search_result"):
        raise _bad(f"{where}: {kind} blocks are {NOT_READ}; send text blocks")
    if kind not in kinds:
        raise _bad(f"{where}.type: {kind!r} is not one of {', '.join(kinds)} here")
    unknown = sorted(set(block) - BLOCK_KEYS[kind] - BLOCK_EXTRAS)
    if unknown:
        raise _bad(f"{where}.{unknown[0]}: Extra inputs are not permitted")
    wanted = {"text": str, "id": str, "name": str, "tool_use_id": str, "input": dict}
    for name, typ in wanted.items():
        if name in BLOCK_KEYS[kind] and not isinstance(block.get(name), typ):
            shown = "an object" if typ is dict else "a string"
            raise _bad(f"{where}.{name}: give {shown}")
    return str(kind)


def _turn_messages(body: CountTokensRequest) -> tuple[list[dict[str, Any]], str]:
    """The body's system prompt and messages as OpenAI chat messages, and the prefill (the text
    of a last assistant message, which the answer continues; "" when the last is the user's)."""
    out: list[dict[str, Any]] = []
    system = body.system or ""
    if isinstance(system, list):
        system = _text_of(system, "system")
    if system:
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}  # tool_use id → the tool's name
    prefill = ""
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            texts, calls = [], []
            for j, block in enumerate(blocks):
                kind = _check_block(block, f"{where}.{j}", _ASSISTANT_BLOCKS)
                if kind == "text":
                    texts.append(block["text"])
                elif kind == "tool_use":
                    names[block["id"]] = block["name"]
                    args = json.dumps(block["input"], ensure_ascii=False)
                    fn = {"name": block["name"], "arguments": args}
                    calls.append({"id": block["id"], "type": "function", "function": fn})
                # (thinking blocks of earlier answers are dropped, as the templates drop them)
            if i == len(body.messages) - 1 and not calls:
                prefill = "".join(texts)
                break
            msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        texts = []
        for j, block in enumerate(blocks):
            kind = _check_block(block, f"{where}.{j}", ("text", "tool_result"))
            if kind == "text":
                texts.append(block["text"])
                continue
            if texts:  # (text before a result: its own user message, in order)
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_message(block, names, f"{where}.{j}"))
        if texts or not blocks:
            out.append({"role": "user", "content": "\n".join(texts)})
    if body.messages[-1].role == "assistant" and out and out[-1].get("tool_calls"):
        raise _bad(
            "messages: the last message is an assistant tool_use; send its tool_result in a "
            "user message after it"
        )
    return out, prefill


_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


def _tool_message(block: dict[str, Any], names: dict[str, str], where: str) -> dict[str, Any]:
    """A tool_result block → OpenAI's tool message (an error result says so in its text)."""
    call_id = block["tool_use_id"]
    if call_id not in names:
        raise _bad(
            f"{where}.tool_use_id: {call_id!r} answers no tool_use block of an earlier "
            f"assistant message"
        )
    content = block.get("content", "")
    if isinstance(content, list):
        content = _text_of(content, f"{where}.content")
    elif not isinstance(content, str):
        raise _bad(f"{where}.content: give a string or a list of text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "name": names[call_id], "content": content}


def _tools(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's tools ({name, description, input_schema}) → OpenAI's function tools."""
    out = []
    forced = body.tool_choice is not None and body.tool_choice.type in ("any", "tool")
    for i, tool in enumerate(body.tools or []):
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise _bad(
                f"tools.{i}.type: {kind!r} is a server tool, which this server does not run: "
                f"give custom tools (name, description, input_schema)"
            )
        unknown = sorted(set(tool) - TOOL_KEYS)
        if unknown:
            raise _bad(f"tools.{i}.{unknown[0]}: Extra inputs are not permitted")
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"tools.{i}.input_schema: give the tool's input as a JSON schema object")
        if tool.get("strict") and not forced:
            raise _bad(
                f"tools.{i}.strict: a call follows input_schema exactly only when tool_choice "
                f"forces it (any or tool); with auto the model may write any arguments"
            )
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _turn(body: CountTokensRequest, messages: list[dict[str, Any]]) -> ChatTurn:
    tools = _tools(body)
    choice, parallel = body.tool_choice, False
    tool_choice: Any = None
    if choice is not None:
        if choice.type in ("any", "tool") and not tools:
            raise _bad(f"tool_choice.type is {choice.type!r} but no tools were given")
        if choice.type == "tool" and not choice.name:
            raise _bad("tool_choice.name: give the name of the tool to call")
        tool_choice = {
            "auto": "auto",
            "none": "none",
            "any": "required",
            "tool": {"type": "function", "function": {"name": choice.name}},
        }[choice.type]
        # a forced call is one call unless the client asks for several (as chat completions'
        # parallel_tool_calls: a small model asked for "one or more" repeats its call)
        parallel = choice.disable_parallel_tool_use is False
    kwargs: dict[str, Any] = {}
    if body.thinking is not None and body.thinking.type != "adaptive":
        thinking = body.thinking.type == "enabled"
        if thinking and body.thinking.budget_tokens is None:
            raise _bad("thinking.budget_tokens: Field required")
        if thinking and choice is not None and choice.type in ("any", "tool"):
            raise _bad("Thinking may not be enabled when tool_choice forces tool use.")
        kwargs["enable_thinking"] = thinking
    fmt = body.output_config.format if body.output_config is not None else None
    return ChatTurn(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        output=("json_schema", fmt.schema_) if fmt is not None else None,
        template_kwargs=kwargs,
    )


async def _prepared(api: Api, body: CountTokensRequest) -> Prepared:
    """The body's prompt, its grammar and its parser (as chat completions'); a prefill is
    appended to the prompt's text."""
    messages, prefill = _turn_messages(body)
    turn = _turn(body, messages)
    prep = await run_in_threadpool(prepare, turn, api.model.chat, api.model.tokenizer)
    if not prefill:
        return prep
    if prep.grammar is not None:
        raise _bad(
            "messages: a last assistant message (a prefill) cannot be continued under a forced "
            "tool_choice or output_config.format: end with a user message"
        )
    text = prep.text + prefill
    ids = await run_in_threadpool(api.model.tokenizer.encode, text)
    return dataclasses.replace(
        prep, ids=ids, text=text, thinking=text.rstrip().endswith(THINK_OPEN)
    )


# -- the answer -----------------------------------------------------------------------------------
class Blocks:
    """An answer's content blocks, built from the parser's parts as they come; `add` and `close`
    give the stream events that build the same blocks on the client. Whitespace alone opens no
    block (it joins the next block of its kind, or is dropped)."""

    def __init__(self, show_thinking: bool = True, max_calls: int | None = None) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.show_thinking, self.max_calls = show_thinking, max_calls
        self.kind: str | None = None  # the open block's type: "thinking" / "text"; None: none
        self.space: tuple[str, str] = ("", "")  # (kind, whitespace) waiting for more text

    @property
    def called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def add(self, parts: Parts) -> list[dict[str, Any]]:
        events = self._extend("thinking", parts.reasoning) if parts.reasoning else []
        if parts.content:
            events += self._extend("text", parts.content)
        for call in parts.calls:
            events += self._call(call)
        return events

    def close(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _extend(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.kind != kind:
            waiting = self.space[1] if self.space[0] == kind else ""
            if not (waiting + text).strip():
                self.space = (kind, waiting + text)
                return []
            events = self.close()
            text, self.space = waiting + text, ("", "")
            self.blocks.append(
                {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            )
            self.kind = kind
            events.append(
                {
                    "type": "content_block_start",
                    "index": len(self.blocks) - 1,
                    "content_block": dict(self.blocks[-1]),
                }
            )
        if kind == "thinking" and not self.show_thinking:
            return events
        self.blocks[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(
            {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}
        )
        return events

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        n_calls = sum(b["type"] == "tool_use" for b in self.blocks)
        if self.max_calls is not None and n_calls >= self.max_calls:
            return []  # (disable_parallel_tool_use with auto: the first call only)
        events = self.close()
        self.space = ("", "")
        block_id = "toolu_" + call.id.removeprefix("call_")
        self.blocks.append(
            {
                "type": "tool_use",
                "id": block_id,
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        )
        index = len(self.blocks) - 1
        start = {"type": "tool_use", "id": block_id, "name": call.name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        return events + [
            {"type": "content_block_start", "index": index, "content_block": start},
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]


def _stop_sequence(text: StopText) -> str | None:
    """The stop sequence that ended the text (StopText stops just before it), or None."""
    if not text.stopped:
        return None
    return next((s for s in text.stops if text.text.startswith(s, text.sent)), None)


def _ending(job: Job, finish: str, blocks: Blocks, capped: bool) -> dict[str, Any]:
    """stop_reason and stop_sequence (message_delta's delta, the answer's fields)."""
    stop = _stop_sequence(job.choices[0].text)
    if finish == "length":
        reason = "model_context_window_exceeded" if capped else "max_tokens"
    elif blocks.called:
        reason = "tool_use"
    elif stop is not None:
        reason = "stop_sequence"
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": stop if reason == "stop_sequence" else None}


def _usage(job: Job) -> dict[str, int]:
    u = job.usage()
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"] - cached,
        "output_tokens": u["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _event(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(
    api: Api, job: Job, prep: Prepared, blocks: Blocks, message: dict[str, Any], capped: bool
) -> AsyncIterator[str]:
    parser = prep.parser()
    try:
        yield _event({"type": "message_start", "message": message})
        yield _event({"type": "ping"})
        async for p in api.pieces(job):
            parts = parser.push(p.text)
            if p.finish:
                parts.add(parser.finish())
            for ev in blocks.add(parts):
                yield _event(ev)
            if p.finish:
                for ev in blocks.close():
                    yield _event(ev)
                delta = _ending(job, p.finish, blocks, capped)
                yield _event({"type": "message_delta", "delta": delta, "usage": _usage(job)})
                yield _event({"type": "message_stop"})
    except ApiError as exc:  # the stream has started: the error is its last event
        yield _event(error_body(exc.status, exc.message))
    finally:  # also when the client went away (the task is cancelled): free the sequence
        job.cancel()


def add_message_routes(app: FastAPI, api: Api) -> None:
    """The two routes of Anthropic's Messages API on `app`, with their own key check."""
    posted = [Depends(_auth(api)), Depends(api.json_body)]

    async def messages(body: MessagesRequest, request: HttpRequest) -> Response:
        lora = api.check_model(body.model)
        if any(not s for s in body.stop_sequences or []):
            raise _bad("stop_sequences: a stop sequence must not be empty")
        prep = await _prepared(api, body)
        n_prompt = len(prep.ids)
        api.budget(n_prompt, None, None, "messages")  # (400 when the prompt fills the context)
        limit = min(body.max_tokens, api.model.n_ctx - n_prompt)
        capped = limit < body.max_tokens
        sampling = body.sampling_body(limit)
        job = api.start([prep.ids], sampling, None, _priority(request), lora, prep.grammar)
        choice = body.tool_choice
        auto_one = choice is not None and choice.type == "auto" and choice.disable_parallel_tool_use
        shown = body.thinking is None or body.thinking.display != "omitted"
        blocks = Blocks(shown, 1 if auto_one else None)
        message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(job),
        }
        if body.stream:
            return StreamingResponse(
                _stream(api, job, prep, blocks, message, capped),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        parser = prep.parser()
        finish = "stop"
        try:
            async for p in api.pieces(job, request.is_disconnected):
                parts = parser.push(p.text)
                if p.finish:
                    parts.add(parser.finish())
                    finish = p.finish
                blocks.add(parts)
        finally:
            job.cancel()
        message |= {"content": blocks.blocks, "usage": _usage(job)}
        return JSONResponse(message | _ending(job, finish, blocks, capped))

    async def count_tokens(body: CountTokensRequest) -> Response:
        api.check_model(body.model)
        prep = await _prepared(api, body)
        return JSONResponse({"input_tokens": len(prep.ids)})

    # (on the app's own router: an included router's routes are not listed in 404s, errors.py)
    for path, endpoint in (("/v1/messages", messages), ("/v1/messages/count_tokens", count_tokens)):
        app.router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            dependencies=posted,
            route_class_override=_AnthropicRoute,
        )
