"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat
machinery. A request's input items (messages, earlier function calls and their outputs) become
chat messages, its flat function tools chat tools, its `text.format` the answer's format: the
body becomes a chat completion's (`_as_chat`) and runs as one does (chat.py's `prepare`,
`Api.start`). The answer's parts (reply.py) become output items (reasoning, message,
function_call) built once by `Output`, for the JSON answer and for its server-sent events alike
(`event: <type>` and `data: {json}` with a `sequence_number`).

With `store` (the default) a finished response is kept in memory, the last STORED per server, so
that `previous_response_id` continues its conversation: the stored response's input and output
items go before the new input (its `instructions` do not, as OpenAI's). Input items' ids and
statuses are read past; reasoning items are skipped (the model's own earlier thoughts, which
chat templates drop from earlier turns too).
"""

from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, params
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from potluck.api import errors
from potluck.api.chat import Prepared, prepare
from potluck.api.completions import ChatCompletionRequest, ChatMessage, _priority
from potluck.api.errors import ApiError
from potluck.api.job import Job
from potluck.api.reply import Parts, ToolCall
from potluck.api.sse import SSE_HEADERS
from potluck.api.state import Api
from potluck.sampling import MAX_LOGPROBS

STORED = 256  # responses kept for previous_response_id and GET, per server (the oldest go first)
MAX_METADATA = 16  # OpenAI's limits on metadata: pairs, key and value lengths
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
LOGPROBS = "message.output_text.logprobs"  # the one `include` this server can fill
ROLES = ("user", "system", "developer", "assistant")
TOOL_FIELDS = {"type", "name", "description", "parameters", "strict"}
# OpenAI's fields that this server cannot honour: 400 when set (null is fine), with what to do
UNSUPPORTED = {
    "conversation": "conversations are not stored here: continue with previous_response_id",
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "max_tool_calls": "limit calls with parallel_tool_calls and tool_choice instead",
    "context_management": "no context management: the input must fit the model's context",
    "prompt_cache_retention": "the prefix cache keeps what it can: drop prompt_cache_retention",
    "prompt_cache_options": "the prefix cache is automatic: drop prompt_cache_options",
    "background_options": "background responses are not supported",
    "moderation": "no moderation runs here",
    "image": "these models read text only",
    "access_programs": "no access programs here",
}


class ResponseRequest(BaseModel):
    """The body of POST /v1/responses (OpenAI's fields; any other is a 400, `_check_fields`)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    # {"include_obfuscation": bool}: accepted; no obfuscation padding is added (the events'
    # types have no field for it, and the client drops it)
    stream_options: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # (the prefix cache finds shared prefixes by itself)
    service_tier: Literal["auto", "default"] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None


class _AsChat(ChatCompletionRequest):
    """A Responses body as a chat completion's (what `Api.start` and `prepare` read)."""

    prompt_field: ClassVar[str] = "input"  # what a too-long prompt's error points at


# -- the request → a chat turn ---------------------------------------------------------------------
def _check_fields(body: ResponseRequest) -> None:
    """400 for a field this server does not know or cannot honour (never silently ignored)."""
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED:
            if value is not None:
                raise errors.bad_request(f"{name} is not supported: {UNSUPPORTED[name]}", name)
            continue
        raise errors.bad_request(
            f"unknown field {name!r}: not a field of a Responses request (see OpenAI's API "
            f"reference for POST /v1/responses)",
            name,
        )
    if body.background:
        raise errors.bad_request(
            "background responses are not supported: send the request without background "
            "(stream it to see the answer as it comes)",
            "background",
        )
    if body.truncation not in (None, "disabled"):
        raise errors.bad_request(
            f"truncation {body.truncation!r} is not supported: only 'disabled' (an input past "
            f"the context is a 400; shorten it)",
            "truncation",
        )
    for name in body.include or []:
        if name != LOGPROBS:
            raise errors.bad_request(
                f"include {name!r} cannot be filled here: only {LOGPROBS!r} can", "include"
            )
    if body.top_logprobs is not None and LOGPROBS not in (body.include or []):
        raise errors.bad_request(
            f"top_logprobs needs include [{LOGPROBS!r}] to return them", "top_logprobs"
        )
    if body.stream_options is not None:
        if not body.stream:
            raise errors.bad_request("stream_options is only for stream: true", "stream_options")
        for name in body.stream_options:
            if name != "include_obfuscation":
                raise errors.bad_request(
                    f"stream_options.{name} is not supported: only include_obfuscation",
                    f"stream_options.{name}",
                )
    for name in body.reasoning or {}:
        if name not in ("effort", "summary", "generate_summary"):
            raise errors.bad_request(
                f"reasoning.{name} is not supported: only effort and summary",
                f"reasoning.{name}",
            )
    _check_metadata(body.metadata or {})


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA:
        raise errors.bad_request(
            f"metadata has {len(metadata)} pairs: at most {MAX_METADATA}", "metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise errors.bad_request(
                f"metadata[{key[:20]!r}]: keys are at most {MAX_METADATA_KEY} characters and "
                f"values at most {MAX_METADATA_VALUE}",
                "metadata",
            )


def _items(value: str | list[Any] | None) -> list[dict[str, Any]]:
    """The request's input as a list of items (a string is one user message)."""
    if value is None:
        raise errors.bad_request(
            "input is missing: give the user's message as a string, or a list of input items",
            "input",
        )
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise errors.bad_request(
                f"input[{i}] must be an object (a message or an item with a type)", f"input[{i}]"
            )
    return list(value)


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or a list of text parts) as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise errors.bad_request(
            f"{where}.content must be a string or a list of input_text parts", f"{where}.content"
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind in ("input_text", "output_text", "refusal"):
            if not isinstance(part.get(key), str):
                raise errors.bad_request(f"{at}.{key} must be a string", f"{at}.{key}")
            texts.append(part[key])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise errors.bad_request(
                f"{at} is of type {kind!r}, which is not supported: these models read text "
                f"only; send input_text parts",
                at,
            )
        else:
            raise errors.bad_request(
                f"{at}: content part of type {kind!r} is not one of input_text, output_text", at
            )
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise errors.bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _messages(items: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Input items (each with its place in the request, for errors) → chat messages: a
    function_call joins the assistant message before it as one of its tool_calls (or starts
    one), a function_call_output is a tool message."""
    out: list[dict[str, Any]] = []
    for where, item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise errors.bad_request(
                    f"{where}.role {role!r} is not one of {', '.join(ROLES)}", f"{where}.role"
                )
            role = "system" if role == "developer" else role
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            call_id = _string(item, "call_id", where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise errors.bad_request(
                f"{where}.type {kind!r} is not supported: send messages, function_call and "
                f"function_call_output items",
                f"{where}.type",
            )
    return out


def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Responses' flat function tools → chat tools ({"type": "function", "function": {...}})."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise errors.bad_request(
                f"tools[{i}] is of type {kind!r}, which is not supported: this server calls "
                f'function tools only (your own code: {{"type": "function", "name", '
                f'"parameters"}})',
                f"tools[{i}].type",
            )
        for name in tool:
            if name not in TOOL_FIELDS:
                raise errors.bad_request(
                    f"tools[{i}].{name} is not supported: a function tool takes "
                    f"{', '.join(sorted(TOOL_FIELDS))}",
                    f"tools[{i}].{name}",
                )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise errors.bad_request(
                f"tools[{i}].name is missing: give each function a name", f"tools[{i}].name"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' tool_choice → chat's ({"type": "function", "name"} → a named function)."""
    if choice is None or isinstance(choice, str):
        return choice  # (prepare checks the word)
    kind = choice.get("type")
    if kind != "function" or not isinstance(choice.get("name"), str):
        raise errors.bad_request(
            f'tool_choice of type {kind!r} is not supported: send "auto", "none", "required" or '
            f'{{"type": "function", "name": ...}}',
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` → chat's response_format."""
    for name, value in (text or {}).items():
        if name != "format" and not (name == "verbosity" and value is None):
            raise errors.bad_request(
                f"text.{name} is not supported: only text.format", f"text.{name}"
            )
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise errors.bad_request(
            f"text.format.type {kind!r} is not one of text, json_object, json_schema",
            "text.format.type",
        )
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise errors.bad_request(
            'text.format.schema is missing: give the answer\'s JSON schema ({"type": '
            '"json_schema", "name": ..., "schema": {...}})',
            "text.format.schema",
        )
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _as_chat(
    body: ResponseRequest, messages: list[dict[str, Any]], parallel: bool, logprobs: bool
) -> _AsChat:
    effort = (body.reasoning or {}).get("effort")
    # "none": a thinking template (Qwen3's enable_thinking) answers at once; other efforts are
    # accepted but not graded: the model reasons as it does
    kwargs = {"enable_thinking": False} if effort == "none" else {}
    try:
        return _AsChat(
            model=body.model,
            messages=[ChatMessage.model_validate(m) for m in messages],
            max_completion_tokens=body.max_output_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            logprobs=logprobs,
            top_logprobs=body.top_logprobs,
            tools=_tools(body.tools or []),
            tool_choice=_tool_choice(body.tool_choice),
            parallel_tool_calls=parallel,
            response_format=_response_format(body.text),
            chat_template_kwargs=kwargs,
            user=body.user,
        )
    except ValidationError as exc:  # (the fields were checked above: a message's shape)
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise errors.bad_request(f"input: {where}: {first['msg']}", "input") from None


async def _prepared(api: Api, chat: _AsChat) -> Prepared:
    """prepare() with its errors naming the Responses fields."""
    turn = chat.turn([m.model_dump(exclude_none=True) for m in chat.messages])
    try:
        return await run_in_threadpool(prepare, turn, api.model.chat, api.model.tokenizer)
    except ApiError as exc:
        names = {"response_format": "text.format", "messages": "input"}
        if exc.param in names:
            message = exc.message.replace("response format", "text.format")
            raise errors.bad_request(
                message.replace("response_format", "text.format"), names[exc.param]
            ) from None
        raise


# -- the answer → output items ---------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Output:
    """A response's output items as its parts arrive, and the stream events that build them.

    Items follow each other and never interleave: reasoning, then a message, a function_call per
    call (a message after a call is a new item). Blank text before a call is dropped (the space
    a model writes before its call block); an answer with neither text nor calls is one empty
    message. Logprobs (when asked) are the message's tokens'."""

    def __init__(self, logprobs: bool) -> None:
        self.items: list[dict[str, Any]] = []
        self.logprobs = logprobs
        self.incomplete = False  # the answer ran out of max_output_tokens
        self.reasoning_tokens = 0
        self._open: dict[str, Any] | None = None  # the reasoning or message item being written
        self._held = ""  # blank text, perhaps before a call
        self._lps: list[dict[str, Any]] = []  # logprobs not yet given to a text delta

    def push(self, parts: Parts, lps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        self._lps += lps
        if parts.reasoning:
            events += self._write("reasoning", parts.reasoning)
        if parts.content:
            text, self._held = self._held + parts.content, ""
            if self._open is not None and self._open["type"] == "message" or text.strip():
                events += self._write("message", text)
            else:
                self._held = text
        for call in parts.calls:
            self._held = ""
            events += self._close("completed") + self._call(call)
        return events

    def finish(self, reason: str) -> list[dict[str, Any]]:
        """The last events, once the answer ended ("length": it ran out of tokens)."""
        self.incomplete = reason == "length"
        status = "incomplete" if self.incomplete else "completed"
        events = self._close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._write("message", self._held) + self._close(status)
        return events

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed") + self._add(kind)
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        at = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            self._lps = []
            events.append({"type": "response.reasoning_text.delta", **at, "delta": text})
        elif text:
            lps, self._lps = self._lps, []
            part["logprobs"] += lps
            events.append(
                {"type": "response.output_text.delta", **at, "delta": text, "logprobs": lps}
            )
        return events

    def _add(self, kind: str) -> list[dict[str, Any]]:
        item: dict[str, Any]
        if kind == "message":
            item = {"id": _new_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _new_id("rs"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}  # fmt: skip
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": index,
                   "item": copy.deepcopy(item)}]  # fmt: skip
        item["content"].append(part)
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        events.append({"type": "response.content_part.added", **at, "part": copy.deepcopy(part)})
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        index = len(self.items) - 1  # (the open item is always the last)
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            done = {"type": "response.output_text.done", **at, "text": part["text"],
                    "logprobs": part["logprobs"]}  # fmt: skip
        else:
            done = {"type": "response.reasoning_text.done", **at, "text": part["text"]}
        return [
            done,
            {"type": "response.content_part.done", **at, "part": copy.deepcopy(part)},
            {"type": "response.output_item.done", "output_index": index,
             "item": copy.deepcopy(item)},
        ]  # fmt: skip

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        item: dict[str, Any] = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call.id, "name": call.name, "arguments": ""}  # fmt: skip
        self.items.append(item)
        index = len(self.items) - 1
        at = {"item_id": item["id"], "output_index": index}
        added = {"type": "response.output_item.added", "output_index": index,
                 "item": copy.deepcopy(item)}  # fmt: skip
        item["arguments"], item["status"] = call.arguments, "completed"
        return [
            added,
            {"type": "response.function_call_arguments.delta", **at, "delta": call.arguments},
            {"type": "response.function_call_arguments.done", **at, "arguments": call.arguments},
            {"type": "response.output_item.done", "output_index": index,
             "item": copy.deepcopy(item)},
        ]  # fmt: skip


async def _run(
    api: Api,
    job: Job,
    prep: Prepared,
    out: Output,
    disconnected: Callable[[], Awaitable[bool]] | None,
) -> AsyncIterator[list[dict[str, Any]]]:
    """The answer's events, a list per text piece (the last piece's ends the output)."""
    parser = prep.parser()
    async for p in api.pieces(job, disconnected):
        parts = parser.push(p.text)
        if parser.mode == "think" or (parts.reasoning and not parts.content and not parts.calls):
            out.reasoning_tokens += len(p.ids)
        if p.finish:
            parts.add(parser.finish())
        lps = api.chat_logprobs(p.ids) if out.logprobs else []
        events = out.push(parts, lps)
        if p.finish:
            events += out.finish(p.finish)
        yield events


# -- the response ----------------------------------------------------------------------------------
@dataclass
class _Turn:
    """One response: its id, the request's settings as the response echoes them, and the whole
    conversation it continues (stored for the next previous_response_id)."""

    id: str
    created_at: int
    model: str
    echo: dict[str, Any]
    items: list[dict[str, Any]]  # earlier responses' items, then this request's input items
    store: bool

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        done = status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if done else None,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
        }

    def finished(self, out: Output, job: Job) -> dict[str, Any]:
        u = job.usage()
        usage = {
            "input_tokens": u["prompt_tokens"],
            # (cache_write_tokens: nothing is billed here; the prefix cache keeps what it can)
            "input_tokens_details": {
                "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": out.reasoning_tokens},
            "total_tokens": u["total_tokens"],
        }
        return self.response("incomplete" if out.incomplete else "completed", out.items, usage)


def _echo(body: ResponseRequest, chat: _AsChat) -> dict[str, Any]:
    """The request's settings as the response shows them (OpenAI's defaults where not given)."""
    reasoning = body.reasoning or {}
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": chat.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": body.store,
        "temperature": chat.temperature,
        "top_p": chat.top_p,
        "top_logprobs": body.top_logprobs or 0,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "truncation": "disabled",
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "service_tier": "default",
        "background": False,
        "max_tool_calls": None,
    }


@dataclass
class _Stored:
    response: dict[str, Any]
    items: list[dict[str, Any]]  # its input (earlier turns' items included), then its output


class ResponseStore:
    """The last `limit` stored responses of one server, the least recently used first out."""

    def __init__(self, limit: int = STORED) -> None:
        self.limit = limit
        self._by_id: OrderedDict[str, _Stored] = OrderedDict()

    def get(self, rid: str, param: str | None = None) -> _Stored:
        stored = self._by_id.get(rid)
        if stored is None:
            raise ApiError(
                404,
                f"No response found with id {rid!r} (responses are kept in this server's "
                f"memory, the last {self.limit}, and only with store: true)",
                "invalid_request_error",
                param,
                "response_not_found",
            )
        self._by_id.move_to_end(rid)
        return stored

    def put(self, turn: _Turn, response: dict[str, Any]) -> None:
        if not turn.store:
            return
        self._by_id[turn.id] = _Stored(response, turn.items + response["output"])
        while len(self._by_id) > self.limit:
            self._by_id.popitem(last=False)

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._by_id[rid]


def _event(event: dict[str, Any], seq: int) -> str:
    data = json.dumps({**event, "sequence_number": seq}, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n"


async def _stream(
    api: Api, job: Job, prep: Prepared, turn: _Turn, out: Output, store: ResponseStore
) -> AsyncIterator[str]:
    seq = itertools.count()
    try:
        started = turn.response("in_progress", [], None)
        yield _event({"type": "response.created", "response": started}, next(seq))
        yield _event({"type": "response.in_progress", "response": started}, next(seq))
        async for events in _run(api, job, prep, out, None):
            for ev in events:
                yield _event(ev, next(seq))
        response = turn.finished(out, job)
        store.put(turn, response)
        yield _event({"type": f"response.{response['status']}", "response": response}, next(seq))
    except ApiError as exc:  # the stream has started: the error goes in it, as OpenAI does
        error = {"type": "error", "code": exc.code or exc.type, "message": exc.message,
                 "param": exc.param}  # fmt: skip
        yield _event(error, next(seq))
    finally:  # also when the client went away (the task is cancelled): free the sequence
        job.cancel()


def add_response_routes(
    app: FastAPI, api: Api, posted: list[params.Depends], guarded: list[params.Depends]
) -> None:
    """POST /v1/responses (posted: the API key and JSON body checks), GET and DELETE
    /v1/responses/{id} (guarded: the API key)."""
    store = ResponseStore()

    @app.post("/v1/responses", dependencies=posted)
    async def create_response(body: ResponseRequest, request: HttpRequest) -> Response:
        _check_fields(body)
        lora = api.check_model(body.model)
        earlier = []
        if body.previous_response_id is not None:
            earlier = store.get(body.previous_response_id, "previous_response_id").items
        new = _items(body.input)
        places = [("previous_response_id", item) for item in earlier]
        places += [(f"input[{i}]", item) for i, item in enumerate(new)]
        messages = _messages(places)
        if body.instructions:
            messages.insert(0, {"role": "system", "content": body.instructions})
        if not messages:
            raise errors.bad_request("input is empty: give at least one message", "input")
        logprobs = LOGPROBS in (body.include or [])
        forced = body.tool_choice not in (None, "auto", "none")
        # a forced call is one call unless parallel_tool_calls is true (as chat completions');
        # "auto" reads every call the model makes
        parallel = body.parallel_tool_calls if body.parallel_tool_calls is not None else not forced
        chat = _as_chat(body, messages, parallel, logprobs)
        prep = await _prepared(api, chat)
        job = api.start([prep.ids], chat, None, _priority(request), lora, prep.grammar)
        turn = _Turn(
            _new_id("resp"), int(time.time()), body.model, _echo(body, chat), earlier + new,
            body.store,
        )  # fmt: skip
        out = Output(logprobs)
        if body.stream:
            return StreamingResponse(
                _stream(api, job, prep, turn, out, store),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        try:
            async for _ in _run(api, job, prep, out, request.is_disconnected):
                pass
        finally:
            job.cancel()
        response = turn.finished(out, job)
        store.put(turn, response)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}", dependencies=guarded)
    async def get_response(response_id: str) -> Response:
        return JSONResponse(store.get(response_id).response)

    @app.delete("/v1/responses/{response_id}", dependencies=guarded)
    async def delete_response(response_id: str) -> Response:
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
