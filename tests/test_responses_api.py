"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) on a real server,
driven by the official `openai` client and the OpenAI Agents SDK: the same prompt and greedy
text as chat completions, streaming events the client assembles, function calls continued by
previous_response_id, structured output, stored responses, and a 400 / 404 for what cannot be
honoured."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import agents
import httpx
import jsonschema
import openai
import pytest
from agents.models.openai_responses import OpenAIResponsesModel
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from potluck.api.reply import Parts, ToolCall
from potluck.api.responses import Output
from potluck.engine.scheduler import SchedulerConfig
from potluck.pool.build import load_model
from test_api import KEY, N_CTX, Server, start_server

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ADD_TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": ADD,
    "strict": True,
}
ADD_CHAT_TOOL = {"type": "function", "function": {k: v for k, v in ADD_TOOL.items() if k != "type"}}
QUESTION = "What is 2 + 3? Use the add tool."
YES_NO = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[Server]:
    m = load_model(smollm2_path, n_ctx=N_CTX)
    yield from start_server(m, SchedulerConfig(max_active=8, max_queue=16), KEY)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


EVENT = TypeAdapter(ResponseStreamEvent)


def _raw_stream(server: Server, body: dict[str, Any]) -> list[Any]:
    """The events of a streamed response, each checked strictly against the client's types (the
    client itself builds them without checking) and its `event:` line against its type."""
    headers = {"Authorization": f"Bearer {KEY}"}
    events, name = [], None
    with httpx.stream(
        "POST", server.url + "/v1/responses", json=body | {"stream": True}, headers=headers,
        timeout=120,
    ) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                events.append(EVENT.validate_python(data))
    return events


def _chat(client: openai.OpenAI, server: Server, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(
        model=server.model_id, messages=messages, temperature=0, **kw
    )


def test_text_equals_chat_completions(server: Server, client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=server.model_id, input="Name a planet.", max_output_tokens=16, temperature=0
    )
    c = _chat(client, server, [{"role": "user", "content": "Name a planet."}], max_tokens=16)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == c.choices[0].message.content
    assert r.usage is not None and r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    finish = c.choices[0].finish_reason
    assert r.status == ("incomplete" if finish == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.max_output_tokens == 16 and r.temperature == 0 and r.tools == []
    raw = httpx.post(
        server.url + "/v1/responses",
        json={"model": server.model_id, "input": "Name a planet.", "max_output_tokens": 16,
              "temperature": 0},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    ).json()  # fmt: skip
    assert Response.model_validate(raw).output_text == r.output_text  # (strictly as typed)


def test_instructions_and_stream(server: Server, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": server.model_id,
        "instructions": "You are terse.",
        "input": [
            {"role": "user", "content": "Name three planets."},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Mars, Venus."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Two more?"}]},
        ],
        "max_output_tokens": 24,
        "temperature": 0,
    }
    plain = client.responses.create(**kw)
    chat = _chat(
        client,
        server,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three planets."},
            {"role": "assistant", "content": "Mars, Venus."},
            {"role": "user", "content": "Two more?"},
        ],
        max_tokens=24,
    )
    assert plain.output_text == chat.choices[0].message.content
    assert plain.instructions == "You are terse."

    events = list(client.responses.create(**kw, stream=True))
    raw = _raw_stream(server, kw)
    assert [e.type for e in raw] == [e.type for e in events]
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text
    last = events[-1]
    assert last.type == f"response.{plain.status}"
    assert last.response.output_text == plain.output_text
    assert last.response.usage == plain.usage
    for t in ("response.output_item.added", "response.content_part.added"):
        assert t in types
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


def test_stream_helper_final_response(server: Server, client: openai.OpenAI) -> None:
    """The client's stream helper assembles the events; a grammar ends the answer by itself."""
    fmt = {"type": "json_schema", "name": "yes_no", "schema": YES_NO, "strict": True}
    with client.responses.stream(
        model=server.model_id,
        input="Is the sky blue? Answer in JSON.",
        text={"format": fmt},
        max_output_tokens=32,
        temperature=0,
    ) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(texts)
    jsonschema.validate(json.loads(final.output_text), YES_NO)


def test_function_call_and_its_output(server: Server, client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=server.model_id,
        input=QUESTION,
        tools=[ADD_TOOL],
        tool_choice="required",
        max_output_tokens=48,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "add" and call.id and call.id.startswith("fc_") and call.call_id
    args = json.loads(call.arguments)
    jsonschema.validate(args, ADD)
    assert first.parallel_tool_calls is False and first.tool_choice == "required"
    assert first.tools[0].type == "function" and first.tools[0].name == "add"

    # the same as chat completions: the same prompt
    chat_first = _chat(
        client,
        server,
        [{"role": "user", "content": QUESTION}],
        tools=[ADD_CHAT_TOOL],
        tool_choice="required",
        max_tokens=48,
    )
    assert first.usage is not None and first.usage.input_tokens == chat_first.usage.prompt_tokens

    result = str(args["a"] + args["b"])
    second = client.responses.create(
        model=server.model_id,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
        tools=[ADD_TOOL],
        tool_choice="none",
        max_output_tokens=24,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    assert [item.type for item in second.output] == ["message"]
    # the prompt held the question, the call and its result: the chat equivalent's
    chat_second = _chat(
        client,
        server,
        [
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "add", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": result},
        ],
        tools=[ADD_CHAT_TOOL],
        tool_choice="none",
        max_tokens=24,
    )
    assert second.usage is not None
    assert second.usage.input_tokens == chat_second.usage.prompt_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + len(call.arguments) // 4
    assert second.output_text == chat_second.choices[0].message.content

    # the same conversation sent whole (no previous_response_id) is the same prompt
    whole = client.responses.create(
        model=server.model_id,
        input=[
            {"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": call.call_id, "name": "add",
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": result},
        ],
        tools=[ADD_TOOL],
        tool_choice="none",
        max_output_tokens=24,
        temperature=0,
        store=False,
    )  # fmt: skip
    assert whole.usage is not None and whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text


def test_function_call_streamed(server: Server, client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=server.model_id,
        input=QUESTION,
        tools=[ADD_TOOL],
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=48,
        temperature=0,
    ) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    body = {"model": server.model_id, "input": QUESTION, "tools": [ADD_TOOL],
            "tool_choice": {"type": "function", "name": "add"}, "max_output_tokens": 48,
            "temperature": 0}  # fmt: skip
    assert [e.type for e in _raw_stream(server, body)] == types
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    [call] = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), ADD)
    assert call.parsed_arguments == json.loads(call.arguments)  # (strict: the client parses)


class Person(BaseModel):
    name: str
    age: int


def test_json_schema_output(server: Server, client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=server.model_id,
        input="Invent a person. Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}},
        max_output_tokens=64,
        temperature=0,
    )  # fmt: skip
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_schema"

    parsed = client.responses.parse(
        model=server.model_id,
        input="Invent a person. Answer in JSON.",
        text_format=Person,
        max_output_tokens=64,
        temperature=0,
    )
    assert isinstance(parsed.output_parsed, Person)

    obj = client.responses.create(
        model=server.model_id,
        input="Describe a cat in JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=48,
        temperature=0,
    )
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_logprobs(server: Server, client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=server.model_id,
        input="Name a planet.",
        max_output_tokens=8,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    [item] = r.output
    assert item.type == "message"
    lps = item.content[0].logprobs
    assert lps is not None and len(lps) == r.usage.output_tokens  # type: ignore[union-attr]
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)


def test_stored_responses(server: Server, client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=server.model_id,
        input="Hello!",
        max_output_tokens=4,
        temperature=0,
        metadata={"topic": "greeting"},
    )
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"topic": "greeting"}
    deleted = httpx.delete(
        f"{server.url}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    assert deleted == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)

    unstored = client.responses.create(
        model=server.model_id, input="Hello!", max_output_tokens=4, store=False
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=server.model_id, input="Hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.parametrize(
    ("kw", "param", "words"),
    [
        ({"extra_body": {"frobnicate": 1}}, "frobnicate", "unknown field"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
        ({"truncation": "auto"}, "truncation", "disabled"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "reasoning.encrypted_content"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"background": True}, "background", "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]", "text only"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
        ({"tool_choice": "required"}, "tools", "no tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"type": "nonsense"}}}}, "text.format", "text.format"),
        ({"temperature": 3}, "temperature", "temperature"),
    ],
)  # fmt: skip
def test_errors(
    server: Server, client: openai.OpenAI, kw: dict[str, Any], param: str, words: str
) -> None:
    args: dict[str, Any] = {"model": server.model_id, "input": "Hi", "max_output_tokens": 4}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**(args | kw))
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert words in body["message"], body["message"]


def test_unknown_previous_response(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=server.model_id, input="Hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert e.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_agents_sdk_tool_loop(server: Server) -> None:
    """The OpenAI Agents SDK's tool loop on this server: the model must call the tool (tool_choice
    required), the SDK runs it, and the run ends with its result (stop_on_first_tool)."""
    agents.set_tracing_disabled(True)
    seen: list[tuple[int, int]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        agent = agents.Agent(
            name="calculator",
            instructions="You add numbers with the add tool.",
            tools=[add],
            model=OpenAIResponsesModel(model=server.model_id, openai_client=client),
            model_settings=agents.ModelSettings(
                tool_choice="required", temperature=0, max_tokens=48
            ),
            tool_use_behavior="stop_on_first_tool",
        )
        try:
            return await agents.Runner.run(agent, "What is 2 + 3?", max_turns=3)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(seen) == 1 and all(isinstance(x, int) for x in seen[0])
    assert str(result.final_output) == str(sum(seen[0]))


def test_output_items_and_events() -> None:
    """Output (no model): reasoning, blank text dropped before a call, a message after the call
    is a new item; every event as the client's types say, the items complete at the end."""
    out = Output(logprobs=False)
    events = out.push(Parts(reasoning="Adding."), [])
    events += out.push(Parts(reasoning=" Easy.", content="\n"), [])
    events += out.push(Parts(calls=[ToolCall("call_1", "add", '{"a": 1, "b": 2}')]), [])
    events += out.push(Parts(content="Done."), [])
    events += out.finish("stop")
    for i, ev in enumerate(events):
        EVENT.validate_python({**ev, "sequence_number": i})
    assert [(item["type"], item["status"]) for item in out.items] == [
        ("reasoning", "completed"),
        ("function_call", "completed"),
        ("message", "completed"),
    ]
    assert out.items[0]["content"] == [{"type": "reasoning_text", "text": "Adding. Easy."}]
    assert out.items[2]["content"][0]["text"] == "Done."
    added = [ev["output_index"] for ev in events if ev["type"] == "response.output_item.added"]
    done = [ev["output_index"] for ev in events if ev["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]

    empty = Output(logprobs=False)  # no text, no call: one empty message, cut short
    empty.push(Parts(content=" "), [])
    empty.finish("length")
    assert empty.incomplete
    assert [(i["type"], i["status"], i["content"][0]["text"]) for i in empty.items] == [
        ("message", "incomplete", " ")
    ]
