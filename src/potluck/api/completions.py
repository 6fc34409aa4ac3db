"""POST /v1/chat/completions and POST /v1/completions: the bodies they take (pydantic models), a
body's prompts → token ids, its choices submitted to the scheduler, and the answer as one JSON
object or as server-sent events (sse.py).

The bodies' fields follow OpenAI's API reference; a few llama.cpp / vLLM extensions (`top_k`,
`min_p`, `repeat_penalty`, `json_schema`, `grammar`, `guided_*`, `reasoning_format`,
`chat_template_kwargs`) are accepted too. OpenAI's fields for what this server cannot do
(`logit_bias`, `functions`, audio, predicted outputs, web search) are a 400 when set; fields
unknown to OpenAI's reference are ignored, as OpenAI's own server does.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, params
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from potluck import __version__
from potluck.api import errors
from potluck.api.chat import ChatTurn, checked_grammar, prepare, response_format_output
from potluck.api.reply import Parts, chat_finish
from potluck.api.sse import SSE_HEADERS, chat_stream, completion_stream
from potluck.api.state import Api
from potluck.engine.scheduler import BATCH, INTERACTIVE
from potluck.sampling import (
    MAX_LOGPROBS,
    REPEAT_PENALTY_MAX,
    REPEAT_PENALTY_MIN,
    SamplingParams,
)

PRIORITY_HEADER = "X-Potluck-Priority"  # "batch": after interactive requests (a batch job's)
MAX_STOPS = 4  # stop sequences per request (OpenAI's limit)
MAX_N = 16  # choices per request
# Seeds: OpenAI's are int64, the sampler's generator (numpy PCG64) and the wire's SamplingConfig.seed are uint64; a
# negative seed is its uint64 twin (seed mod 2**64), as the sampler reads it (seed % 2**64).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
TOP_K_ALL = 2**31 - 1  # a top_k past the vocabulary keeps every token; the wire's top_k is int32


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    prompt_field: ClassVar[str]  # the body's field that holds the prompt

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # JSON's NaN / Infinity: 400

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # extensions (llama.cpp server / vLLM names)
    top_k: int = Field(default=40, ge=0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, ge=REPEAT_PENALTY_MIN, le=REPEAT_PENALTY_MAX)
    # the answer's format (constrained decoding): OpenAI's, llama.cpp's, vLLM's
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # fields this server cannot honour: an error when set, never ignored
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        if self.logit_bias:
            raise ValueError(
                "logit_bias is not supported: constrain the answer with response_format, "
                "json_schema or grammar instead"
            )
        return self

    def output(self) -> tuple[str, Any] | None:
        """The answer's format (chat.py's ChatTurn.output) from whichever field gives it; 400
        when more than one does."""
        given = {
            name: value
            for name, value in (
                ("response_format", response_format_output(self.response_format)),
                ("json_schema", ("json_schema", self.json_schema) if self.json_schema else None),
                ("grammar", ("gbnf", self.grammar) if self.grammar else None),
                ("guided_json", ("json_schema", _schema(self.guided_json))
                 if self.guided_json is not None else None),
                ("guided_regex", ("regex", self.guided_regex) if self.guided_regex else None),
                ("guided_choice", ("choice", self.guided_choice) if self.guided_choice else None),
                ("guided_grammar", ("gbnf", self.guided_grammar) if self.guided_grammar else None),
            )
            if value is not None
        }  # fmt: skip
        if len(given) > 1:
            raise errors.bad_request(
                f"the answer's format is given by {' and '.join(given)}: send only one",
                next(iter(given)),
            )
        return next(iter(given.values()), None)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(
                f"{v} is out of range: give an integer from {SEED_MIN} to {SEED_MAX} "
                f"(64 bits, signed or unsigned)"
            )
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def seed_of(self, j: int) -> int | None:
        """Choice j's seed: seed + j, as a uint64 (wrapping past 2**64 - 1)."""
        return None if self.seed is None else (self.seed + j) % 2**64

    def sampling(self, j: int) -> SamplingParams:
        """Choice j's sampling (a temperature below GREEDY_BELOW is greedy: Sampler)."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=min(self.top_k, TOP_K_ALL),
            top_p=self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed_of(j),
            logprobs=self.logprob_k(),
        )

    def logprob_k(self) -> int | None:
        """None: no logprobs; k: logprobs with k alternatives."""
        raise NotImplementedError


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... go to the template as given
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # a forced call (tool_choice "required" or named) is one call unless this is true (as
    # llama.cpp's server; a small model asked for "one or more" repeats its call to max_tokens);
    # with "auto" every call the model makes is read
    parallel_tool_calls: bool | None = None
    # llama.cpp's: "none" keeps <think> blocks in the content; else they are reasoning_content
    reasoning_format: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (vLLM, llama.cpp)
    functions: list[dict[str, Any]] | None = None  # (OpenAI's old names for tools: refused)
    function_call: str | dict[str, Any] | None = None
    # OpenAI's fields for what these models cannot do: refused when they ask for it
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refused(self) -> ChatCompletionRequest:
        if self.functions is not None or self.function_call is not None:
            raise ValueError(
                "functions and function_call are OpenAI's deprecated fields: send tools and "
                "tool_choice instead"
            )
        if self.audio is not None or any(m != "text" for m in self.modalities or ()):
            raise ValueError("this server answers in text only: leave out audio and modalities")
        if self.prediction is not None:
            raise ValueError("prediction (predicted outputs) is not supported: leave it out")
        if self.web_search_options is not None:
            raise ValueError("web search is not available on a local model: leave it out")
        return self

    def turn(self, messages: list[dict[str, Any]]) -> ChatTurn:
        return ChatTurn(
            messages=messages,
            tools=list(self.tools or []),
            tool_choice=self.tool_choice,
            parallel_tool_calls=bool(self.parallel_tool_calls),
            output=self.output(),
            reasoning=(self.reasoning_format or "auto") != "none",
            template_kwargs=dict(self.chat_template_kwargs or {}),
        )

    prompt_field: ClassVar[str] = "messages"  # what a too-long prompt's error points at

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_k(self) -> int | None:
        """None: no logprobs; k: logprobs with k alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    """(Without max_tokens: 16, OpenAI's default here, or what is left of the context.)"""

    # a text, several texts, token ids, or several lists of token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    prompt_field: ClassVar[str] = "prompt"

    def limit(self) -> int | None:
        return self.max_tokens

    def logprob_k(self) -> int | None:
        return self.logprobs


def add_completion_routes(app: FastAPI, api: Api, posted: list[params.Depends]) -> None:
    """The two generating endpoints on `app` (posted: the API key and JSON body checks)."""

    @app.post("/v1/chat/completions", dependencies=posted)
    async def chat_completions(body: ChatCompletionRequest, request: HttpRequest) -> Response:
        lora = api.check_model(body.model)
        msgs = [_message(m, i) for i, m in enumerate(body.messages)]
        turn = body.turn(msgs)
        prep = await run_in_threadpool(prepare, turn, api.model.chat, api.model.tokenizer)
        job = api.start([prep.ids], body, None, _priority(request), lora, prep.grammar)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        want_lp = body.logprobs
        if body.stream:
            usage_opt = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                chat_stream(api, job, prep, rid, created, body.model, want_lp, usage_opt),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        parsers = {c.index: prep.parser() for c in job.choices}
        parts = {c.index: Parts() for c in job.choices}
        lps: dict[int, list[dict[str, Any]]] = {c.index: [] for c in job.choices}
        finish: dict[int, str] = {}
        try:
            async for p in api.pieces(job, request.is_disconnected):
                parts[p.index].add(parsers[p.index].push(p.text))
                if want_lp:
                    lps[p.index] += api.chat_logprobs(p.ids)
                if p.finish:
                    parts[p.index].add(parsers[p.index].finish())
                    finish[p.index] = chat_finish(p.finish, parsers[p.index])
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
                        "message": parts[i].message(),
                        "logprobs": {"content": lps[i]} if want_lp else None,
                        "finish_reason": finish[i],
                    }
                    for i in sorted(parts)
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
        grammar = await run_in_threadpool(checked_grammar, body.output(), api.tokenizer)
        job = api.start(
            prompts, body, api.config.default_completion_tokens, _priority(request), lora, grammar
        )
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        echo = {c.index: (texts0[c.index // body.n] if body.echo else "") for c in job.choices}
        if body.stream:
            usage_opt = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                completion_stream(api, job, rid, created, body, echo, usage_opt),
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


def _schema(value: dict[str, Any] | str) -> dict[str, Any]:
    """vLLM's guided_json: a schema, or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise errors.bad_request(f"guided_json is not JSON: {exc}", "guided_json") from None
    if not isinstance(value, dict):
        raise errors.bad_request("guided_json must be a JSON schema object", "guided_json")
    return value


def _priority(request: HttpRequest) -> int:
    """A request that says it belongs to a batch job waits behind interactive ones (a client can
    only lower its own priority this way)."""
    return BATCH if request.headers.get(PRIORITY_HEADER, "").lower() == "batch" else INTERACTIVE


_JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return _JSON_TYPES.get(type(value), "an array" if isinstance(value, list) else "an object")


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
