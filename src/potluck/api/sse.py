"""Server-sent events: the chunks of a streaming chat or text completion, as OpenAI sends them
(`data: {json}` per event, `data: [DONE]` at the end). An error after the stream has started goes
in it as one event in OpenAI's error shape (`ApiError.sse`), since the status line has gone."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from potluck import __version__
from potluck.api.chat import Prepared
from potluck.api.errors import ApiError
from potluck.api.job import Job
from potluck.api.reply import chat_finish
from potluck.api.state import Api

if TYPE_CHECKING:  # (completions.py imports this module)
    from potluck.api.completions import CompletionRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def chat_stream(
    api: Api,
    job: Job,
    prep: Prepared,
    rid: str,
    created: int,
    model: str,
    want_lp: bool,
    usage_opt: bool,
) -> AsyncIterator[str]:
    """A chat answer's chunks: reasoning_content, content and tool_calls deltas as each choice's
    parser tells them apart (reply.py), then its finish_reason."""

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

    parsers = {c.index: prep.parser() for c in job.choices}
    n_calls = {c.index: 0 for c in job.choices}
    try:
        for c in job.choices:
            yield sse(chunk(c.index, {"role": "assistant", "content": ""}, None, None))
        async for p in api.pieces(job):
            parser = parsers[p.index]
            parts = parser.push(p.text)
            if p.finish:
                parts.add(parser.finish())
            lp = {"content": api.chat_logprobs(p.ids)} if want_lp and p.ids else None
            if parts or lp:
                yield sse(chunk(p.index, parts.delta(n_calls[p.index]), lp, None))
                n_calls[p.index] += len(parts.calls)
            if p.finish:
                yield sse(chunk(p.index, {}, None, chat_finish(p.finish, parser)))
        if usage_opt:
            last = chunk(0, {}, None, None) | {"choices": [], "usage": job.usage()}
            yield sse(last)
        yield "data: [DONE]\n\n"
    except ApiError as exc:  # the stream has started: the error goes in it, as OpenAI does
        yield exc.sse()
    finally:  # also when the client went away (the task is cancelled): free the sequences
        job.cancel()


async def completion_stream(
    api: Api,
    job: Job,
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
                yield sse(chunk(i, text, None, None))
        async for p in api.pieces(job):
            lp = (
                api.completion_logprobs(p.ids, by_index[p.index])
                if body.logprobs is not None and p.ids
                else None
            )
            if p.text or lp:
                yield sse(chunk(p.index, p.text, lp, None))
            if p.finish:
                yield sse(chunk(p.index, "", None, p.finish))
        if usage_opt:
            yield sse(chunk(0, "", None, None) | {"choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield exc.sse()
    finally:
        job.cancel()
