"""POST /v1/chat/completions and POST /v1/completions: a body's prompts → token ids, its choices
submitted to the scheduler, and the answer as one JSON object or as server-sent events (sse.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, params
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from potluck import __version__
from potluck.api import errors
from potluck.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from potluck.api.sse import SSE_HEADERS, chat_stream, completion_stream
from potluck.api.state import Api
from potluck.engine.scheduler import BATCH, INTERACTIVE
from potluck.modelfile.chat import ChatTemplateError

PRIORITY_HEADER = "X-Potluck-Priority"  # "batch": after interactive requests (a batch job's)


def add_completion_routes(app: FastAPI, api: Api, posted: list[params.Depends]) -> None:
    """The two generating endpoints on `app` (posted: the API key and JSON body checks)."""

    @app.post("/v1/chat/completions", dependencies=posted)
    async def chat_completions(body: ChatCompletionRequest, request: HttpRequest) -> Response:
        lora = api.check_model(body.model)
        msgs = [_message(m, i) for i, m in enumerate(body.messages)]
        try:
            text = await run_in_threadpool(api.model.chat.render, msgs)
        except ChatTemplateError as exc:
            raise errors.bad_request(str(exc), "messages") from exc
        ids = await run_in_threadpool(api.model.tokenizer.encode, text)
        job = api.start([ids], body, None, _priority(request), lora)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        want_lp = body.logprobs
        if body.stream:
            usage_opt = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                chat_stream(api, job, rid, created, body.model, want_lp, usage_opt),
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
        job = api.start(
            prompts, body, api.config.default_completion_tokens, _priority(request), lora
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
