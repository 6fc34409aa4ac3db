"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) driven by the official
`anthropic` client over real HTTP, against the packaged SmolLM2: greedy answers equal chat
completions' for the same conversation (the same prompt), the stream helper assembles the same
message, tool_use (forced by tool_choice "any") validates against its schema and its result goes
back, stop sequences, a prefill, count_tokens, and the errors in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from potluck.api.messages import Blocks
from potluck.api.reply import Parts, ToolCall
from potluck.engine.scheduler import SchedulerConfig
from potluck.pool.build import load_model
from test_api import KEY, N_CTX, Server, start_server

anthropic = pytest.importorskip("anthropic")

GREEDY = {"temperature": 0}  # (the client has no temperature argument: it goes in extra_body)
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[Server]:
    m = load_model(smollm2_path, n_ctx=N_CTX)
    yield from start_server(m, SchedulerConfig(max_active=4, max_queue=16), KEY)


def _client(server: Server, **kw: Any) -> Any:
    kw.setdefault("api_key", KEY)
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=120, **kw)


def _chat(server: Server, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    """Chat completions' greedy answer (the reference)."""
    return server.client().chat.completions.create(
        model=server.model_id, messages=messages, max_tokens=max_tokens, temperature=0
    )


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _prompt_tokens(usage: Any) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


def test_plain_message_equals_chat_completions(server: Server) -> None:
    msgs = [{"role": "user", "content": "Name three planets."}]
    ref = _chat(server, msgs, 24)
    m = _client(server).messages.create(
        model=server.model_id, max_tokens=24, messages=msgs, extra_body=GREEDY
    )
    assert m.type == "message" and m.role == "assistant" and m.model == server.model_id
    assert m.id.startswith("msg_") and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == ref.choices[0].message.content
    finish = ref.choices[0].finish_reason
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert m.stop_sequence is None
    assert _prompt_tokens(m.usage) == ref.usage.prompt_tokens
    assert m.usage.output_tokens == ref.usage.completion_tokens
    assert m.usage.cache_creation_input_tokens == 0
    assert server.idle()


def test_system_multi_turn_and_stream(server: Server) -> None:
    system = "You are terse."
    msgs = [
        {"role": "user", "content": "Name three planets."},
        {"role": "assistant", "content": "Mars, Venus, Earth."},
        {"role": "user", "content": [{"type": "text", "text": "Two more?"}]},
    ]
    openai_msgs = [{"role": "system", "content": system}] + [
        {
            "role": m["role"],
            "content": m["content"] if isinstance(m["content"], str) else "Two more?",
        }
        for m in msgs
    ]
    ref = _chat(server, openai_msgs, 8)
    assert ref.choices[0].finish_reason == "length"  # (cut: max_tokens)
    c = _client(server)
    blocks_system = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    args = {"model": server.model_id, "max_tokens": 8, "messages": msgs, "extra_body": GREEDY}
    m = c.messages.create(system=system, **args)
    assert _text(m) == ref.choices[0].message.content and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 8
    with c.messages.stream(system=blocks_system, **args) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == _text(m) == _text(final)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert _prompt_tokens(final.usage) == ref.usage.prompt_tokens
    # the wire: Anthropic's events in order
    r = httpx.post(
        server.url + "/v1/messages",
        json={"model": server.model_id, "max_tokens": 8, "messages": msgs, "stream": True} | GREEDY,
        headers={"x-api-key": KEY},
        timeout=60,
    )
    names = [line[len("event: ") :] for line in r.text.splitlines() if line.startswith("event:")]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert server.idle()


def test_tool_use_result_and_count_tokens(server: Server) -> None:
    c = _client(server)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = {
        "model": server.model_id,
        "max_tokens": 64,
        "tools": [WEATHER],
        "tool_choice": {"type": "any"},
        "extra_body": GREEDY,
    }
    m = c.messages.create(messages=msgs, **args)
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with c.messages.stream(messages=msgs, **args) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [(uses[0].name, uses[0].input)]
    assert final.stop_reason == "tool_use"
    count = c.messages.count_tokens(
        model=server.model_id, messages=msgs, tools=[WEATHER], tool_choice={"type": "any"}
    )
    assert count.input_tokens == _prompt_tokens(m.usage) == _prompt_tokens(final.usage)
    # the result goes back: an answer in text
    msgs += [
        m.to_param(),
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 °C"}
            ],
        },
    ]
    answer = c.messages.create(
        model=server.model_id, max_tokens=32, messages=msgs, tools=[WEATHER], extra_body=GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.content and answer.usage.output_tokens > 0
    count = c.messages.count_tokens(model=server.model_id, messages=msgs, tools=[WEATHER])
    assert count.input_tokens == _prompt_tokens(answer.usage)
    assert server.idle()


def test_stop_sequences(server: Server) -> None:
    c = _client(server)
    msgs = [{"role": "user", "content": "Name three planets."}]
    args = {"model": server.model_id, "max_tokens": 40, "messages": msgs, "extra_body": GREEDY}
    text = _text(c.messages.create(**args))
    words = text.split()
    word = words[len(words) // 2]  # a word from the middle of the greedy answer
    assert len(words) >= 4 and text.index(word) >= 3, text
    m = c.messages.create(stop_sequences=["zzz", word], **args)
    assert _text(m) == text[: text.index(word)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    with c.messages.stream(stop_sequences=[word], **args) as stream:
        final = stream.get_final_message()
    assert _text(final) == _text(m) and final.stop_sequence == word
    assert final.stop_reason == "stop_sequence"
    assert server.idle()


def test_prefill_and_thinking_blocks(server: Server) -> None:
    """A last assistant message is continued; "<think>" opens the reasoning, read back as a
    thinking block (what /v1/completions gives after the same prompt text)."""
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    prompt = server.model.chat.render(msgs) + "<think>"
    raw = (
        server.client()
        .completions.create(model=server.model_id, prompt=prompt, max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    thought, _, rest = raw.partition("</think>")
    c = _client(server)
    with c.messages.stream(
        model=server.model_id,
        max_tokens=24,
        messages=[*msgs, {"role": "assistant", "content": "<think>"}],
        thinking={"type": "enabled", "budget_tokens": 16},
        extra_body=GREEDY,
    ) as stream:
        m = stream.get_final_message()
    thinking = "".join(b.thinking for b in m.content if b.type == "thinking")
    assert thinking == thought and _text(m) == rest.lstrip()
    assert m.content[0].type == ("thinking" if thought.strip() else "text")


def test_blocks_events_build_the_blocks() -> None:
    """The events Blocks gives, applied as a client does, give its blocks; whitespace alone opens
    no block; with max_calls=1 the second call is dropped."""
    b = Blocks(max_calls=1)
    call = ToolCall("call_abc", "get_weather", '{"city": "Paris"}')
    events = b.add(Parts(reasoning="\n"))
    events += b.add(Parts(reasoning="hm, weather"))
    events += b.add(Parts(content="\n\n"))
    events += b.add(Parts(content="Let me look.", calls=[call, call]))
    events += b.add(Parts(content="  ")) + b.close()
    built: list[dict[str, Any]] = []
    inputs: dict[int, str] = {}
    for ev in events:
        if ev["type"] == "content_block_start":
            assert ev["index"] == len(built)
            built.append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            d, block = ev["delta"], built[ev["index"]]
            if d["type"] == "input_json_delta":
                inputs[ev["index"]] = inputs.get(ev["index"], "") + d["partial_json"]
            else:
                key = d["type"].removesuffix("_delta")
                block[key] += d[key]
    for i, text in inputs.items():
        built[i]["input"] = json.loads(text)
    assert built == b.blocks
    assert [x["type"] for x in b.blocks] == ["thinking", "text", "tool_use"]
    assert b.blocks[0] == {"type": "thinking", "thinking": "\nhm, weather", "signature": ""}
    assert b.blocks[1]["text"] == "\n\nLet me look."
    assert b.blocks[2] == {
        "type": "tool_use",
        "id": "toolu_abc",
        "name": "get_weather",
        "input": {"city": "Paris"},
    }
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2] and b.called
    hidden = Blocks(show_thinking=False)  # thinking.display "omitted": the block, no text
    events = hidden.add(Parts(reasoning="secret", content="Hi"))
    assert hidden.blocks[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert "secret" not in json.dumps(events) and hidden.blocks[1]["text"] == "Hi"


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return dict(body["error"])


def test_errors_in_anthropic_shape(server: Server) -> None:
    c = _client(server)
    hi = [{"role": "user", "content": "hi"}]
    url = server.url + "/v1/messages"
    r = httpx.post(url, json={"model": server.model_id, "messages": hi}, headers={"x-api-key": KEY})
    err = _error(r)
    assert r.status_code == 400 and err["type"] == "invalid_request_error"
    assert "max_tokens" in err["message"]
    with pytest.raises(anthropic.BadRequestError, match="frobnicate") as e:
        c.messages.create(
            model=server.model_id, max_tokens=4, messages=hi, extra_body={"frobnicate": 1}
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    with pytest.raises(anthropic.BadRequestError, match="not supported: these models read text"):
        c.messages.create(
            model=server.model_id, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        c.messages.count_tokens(
            model=server.model_id,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}],
                }
            ],
        )
    with pytest.raises(anthropic.BadRequestError, match="tool_choice forces tool use"):
        c.messages.create(
            model=server.model_id,
            max_tokens=4,
            messages=hi,
            tools=[WEATHER],
            tool_choice={"type": "any"},
            thinking={"type": "enabled", "budget_tokens": 2},
        )
    with pytest.raises(anthropic.BadRequestError, match=f"maximum context length is {N_CTX}"):
        c.messages.create(
            model=server.model_id,
            max_tokens=4,
            messages=[{"role": "user", "content": "word " * 600}],
        )
    with pytest.raises(anthropic.AuthenticationError) as e:
        _client(server, api_key="wrong").messages.create(
            model=server.model_id, max_tokens=4, messages=hi
        )
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/count_tokens", json={"model": server.model_id, "messages": hi})
    assert r.status_code == 401 and "x-api-key" in _error(r)["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=hi)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert server.model_id in e.value.body["error"]["message"]
    # Authorization: Bearer (the client's auth_token) is taken too
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, api_key=None, max_retries=0)
    assert bearer.messages.count_tokens(model=server.model_id, messages=hi).input_tokens > 0
    r = httpx.post(url, content=b"{", headers={"x-api-key": KEY, "content-type": "text/plain"})
    assert r.status_code == 415 and _error(r)["type"] == "invalid_request_error"
    assert server.idle()


def test_max_tokens_past_the_context_is_cut_to_it(server: Server) -> None:
    """max_tokens past the room left is answered (Anthropic's newer models: stop_reason
    model_context_window_exceeded when the context fills), not refused."""
    m = _client(server).messages.create(
        model=server.model_id,
        max_tokens=100_000,
        messages=[{"role": "user", "content": "Say hi."}],
        extra_body=GREEDY,
    )
    n_prompt = _prompt_tokens(m.usage)
    assert m.stop_reason in ("end_turn", "model_context_window_exceeded")
    assert m.usage.output_tokens <= N_CTX - n_prompt
    if m.stop_reason == "model_context_window_exceeded":
        assert m.usage.output_tokens == N_CTX - n_prompt
    assert server.idle()


@pytest.fixture(scope="module")
def cached_server(smollm2_path: Path) -> Iterator[Server]:
    m = load_model(smollm2_path, n_ctx=N_CTX)
    yield from start_server(m, SchedulerConfig(max_active=2, cache_bytes=64 << 20), None)


def test_usage_splits_the_prompt_into_computed_and_cached(cached_server: Server) -> None:
    """usage.input_tokens are the prompt tokens computed, cache_read_input_tokens those reused
    from the (real) prefix cache; their sum is the prompt (count_tokens). The first request reuses
    nothing, the same prompt again reuses part of it. Streamed: message_start has the prompt,
    message_delta the split. (No key on this server: none asked for.)"""
    s = cached_server
    c = _client(s, api_key="anything")
    args = {"model": s.model_id, "messages": [{"role": "user", "content": "Name a planet."}]}
    n_prompt = c.messages.count_tokens(**args).input_tokens
    first = c.messages.create(max_tokens=4, extra_body=GREEDY, **args)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens == n_prompt
    m = c.messages.create(max_tokens=4, extra_body=GREEDY, **args)
    cached = m.usage.cache_read_input_tokens
    assert 0 < cached < n_prompt
    assert m.usage.input_tokens == n_prompt - cached
    with c.messages.stream(max_tokens=4, extra_body=GREEDY, **args) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens == n_prompt
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens == n_prompt - final.usage.cache_read_input_tokens
    assert final.usage.output_tokens == m.usage.output_tokens == 4
