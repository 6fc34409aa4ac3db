"""Tool calls and structured outputs through the official `openai` client against a real server
(uvicorn on 127.0.0.1), on the two packaged models (SmolLM2-135M, Gemma-3-270M), over a pool of
two worker processes, and across a worker killed in the middle of a constrained answer.

The checks are what a user relies on: every forced tool call parses and its arguments validate
against the tool's schema (jsonschema, an independent validator), every constrained answer
validates, and an answer format that cannot be compiled is a 400 with the reason.
(The workers are separate OS processes on 127.0.0.1 standing in for separate machines.)
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from potluck.api.chat import ChatTurn, prepare
from potluck.api.reply import _calls_of
from potluck.api.tools import HERMES
from potluck.engine.contract import Assignment
from potluck.engine.scheduler import SchedulerConfig
from potluck.pool.build import load_model
from potluck.pool.failover import FailoverPipeline
from test_api import Server, start_server
from workers import Spawn
from workers import spawn_module_worker as spawn_module_worker
from workers import spawn_worker as spawn_worker

N_CTX = 1024

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -10000, "maximum": 10000},
                "b": {"type": "integer", "minimum": 0, "maximum": 10000},
            },
            "required": ["a", "b"],
        },
    },
}
# (bounded strings and numbers: a sampled 135M model left free may write digits or letters
# until max_tokens, a valid prefix that never closes; finish_reason "length" says so)
TOOLS = [WEATHER, ADD]
PROMPTS = [
    "What is the weather in Paris?",
    "Add 2 and 40.",
    "Is it raining in Tokyo right now?",
    "How much is 17 plus 25?",
    "Tell me the temperature in Lima in fahrenheit.",
    "Sum 3.5 and 9.",
    "Weather for Oslo please.",
    "What do I get if I add 100 to 23?",
    "Should I take an umbrella in London today?",
    "Compute 8 + 8.",
]
PEOPLE = {
    "type": "array",
    "minItems": 6,
    "maxItems": 6,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}


class Person(pydantic.BaseModel):
    # (bounded: a sampled 135M model left free writes a list or a string to max_tokens)
    name: str = pydantic.Field(max_length=30)
    age: int
    hobbies: list[Annotated[str, pydantic.Field(max_length=30)]] = pydantic.Field(max_length=3)


def _serve(model: Any) -> Iterator[Server]:
    # with the prefix cache, as `potluck serve` runs: the tools' system prompt that opens every
    # prompt here is computed once (and a constrained answer's sequence can start from a cached
    # one: its grammar starts at the new prompt's end)
    yield from start_server(model, SchedulerConfig(cache_bytes=64 << 20), None)


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Iterator[Server]:
    yield from _serve(load_model(smollm2_path, n_ctx=N_CTX))


@pytest.fixture(scope="module")
def gemma(gemma3_path: Path) -> Iterator[Server]:
    yield from _serve(load_model(gemma3_path, n_ctx=N_CTX))


def _client(server: Server) -> openai.OpenAI:
    return server.client(None)


def _check_calls(calls: Any, tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every call names one of the tools and its arguments validate against its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = []
    for call in calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schemas[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_required_tool_calls_validate(which: str, request: pytest.FixtureRequest) -> None:
    """tool_choice "required": ten prompts, sampled, on both packaged models: every answer is
    one call of a given tool with valid arguments, finish_reason tool_calls."""
    server = request.getfixturevalue(which)
    client = _client(server)
    for i, prompt in enumerate(PROMPTS):
        r = client.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice="required",
            temperature=0.8,
            seed=i,
            max_tokens=120,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (prompt, choice.message)
        assert len(_check_calls(choice.message.tool_calls, TOOLS)) == 1
        assert choice.message.content is None


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_auto_calls_are_parsed_whenever_the_model_makes_them(
    which: str, request: pytest.FixtureRequest
) -> None:
    """tool_choice "auto" (the default with tools): the model decides. Whatever it writes, a call
    block that parses comes back as tool_calls (finish_reason tool_calls), never as text; the
    rest is content. (How often a 135M/270M model calls by itself is not asserted: its choice.)"""
    server = request.getfixturevalue(which)
    client = _client(server)
    for i, prompt in enumerate(PROMPTS):
        r = client.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            temperature=0.7,
            seed=i,
            max_tokens=48,
        )
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason in ("tool_calls", "length")
            for call in c.message.tool_calls:
                json.loads(call.function.arguments)  # (a JSON object: what the parser took)
        # a block left in the text is one that is no call (not JSON with a name): the parser
        # took every one that is
        for block in re.findall(r"<tool_call>(.*?)</tool_call>", c.message.content or "", re.S):
            assert _calls_of(block, HERMES) is None, block


def test_named_tool_choice_and_parallel_calls(smol: Server) -> None:
    client = _client(smol)
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(
        model=smol.model_id,
        messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        tools=TOOLS,
        tool_choice=named,
        temperature=0,
        max_tokens=80,
    )
    assert [n for n, _ in _check_calls(r.choices[0].message.tool_calls, TOOLS)] == ["add"]
    r = client.chat.completions.create(
        model=smol.model_id,
        messages=[{"role": "user", "content": "Weather in Rome and in Nice?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=True,
        temperature=0,
        max_tokens=200,
    )
    calls = _check_calls(r.choices[0].message.tool_calls or [], TOOLS)
    assert len(calls) >= 1  # one or more: each complete call is parsed and valid


def test_streamed_tool_calls_assemble_to_the_same_call(smol: Server) -> None:
    client = _client(smol)
    kw: dict[str, Any] = dict(
        model=smol.model_id,
        messages=[{"role": "user", "content": "Add 2 and 3."}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"name": "", "arguments": ""})
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]


def test_tool_results_are_rendered_back(smol: Server) -> None:
    """The call and its result go back into the prompt (the fallback's Hermes text, as the
    template has no tools of its own): the prompt holds them, and the model answers in text."""
    client = _client(smol)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=smol.model_id, messages=msgs, tools=TOOLS, tool_choice="required", temperature=0
    )
    call = r.choices[0].message.tool_calls[0]
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees celsius"},
    ]
    r2 = client.chat.completions.create(
        model=smol.model_id, messages=msgs, tools=TOOLS, temperature=0, max_tokens=40
    )
    assert r2.choices[0].finish_reason in ("stop", "length")
    assert r2.choices[0].message.content
    prep = prepare(ChatTurn(msgs, tools=TOOLS), smol.model.chat, smol.model.tokenizer)
    assert "Sunny, 24 degrees celsius" in prep.text and '"name": "get_weather"' in prep.text
    assert r2.usage.prompt_tokens == len(prep.ids)


def test_parse_with_a_pydantic_model_ten_of_ten(smol: Server) -> None:
    """LangChain's with_structured_output and the client's parse() send a strict json_schema."""
    client = _client(smol)
    for i in range(10):
        r = client.chat.completions.parse(
            model=smol.model_id,
            messages=[{"role": "user", "content": "Invent a person with some hobbies."}],
            response_format=Person,
            temperature=0.9,
            seed=100 + i,
            max_tokens=200,
        )
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, Person), msg.content


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"json_schema": PEOPLE}, lambda t: jsonschema.validate(json.loads(t), PEOPLE) is None),
        ({"grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, lambda t: len(t) == 8 and t[3] == "-"),
    ],
)
def test_answer_formats(smol: Server, fields: dict[str, Any], check: Any) -> None:
    r = _client(smol).chat.completions.create(
        model=smol.model_id,
        messages=[
            {"role": "user", "content": 'Reply with a JSON object with keys "name" and "color".'}
        ],
        temperature=0,
        max_tokens=300,
        extra_body=fields,
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert check(text), text


def test_completions_take_a_schema_too(smol: Server) -> None:
    client = _client(smol)
    r = client.completions.create(
        model=smol.model_id,
        prompt="A person as JSON:",
        max_tokens=100,
        temperature=0,
        extra_body={"json_schema": Person.model_json_schema()},
    )
    Person.model_validate_json(r.choices[0].text)


def test_reasoning_content_is_split_off_or_kept_inline(smol: Server) -> None:
    """A <think> block (forced here by a grammar, since the packaged models do not think) comes
    back as reasoning_content, or inline with reasoning_format "none"; streamed the same."""
    client = _client(smol)
    grammar = 'root ::= "<think>" [a-z ]{1,20} "</think>" [A-Za-z ]{1,20}'
    kw: dict[str, Any] = dict(
        model=smol.model_id,
        messages=[{"role": "user", "content": "Think, then answer."}],
        temperature=0,
        max_tokens=60,
    )
    r = client.chat.completions.create(**kw, extra_body={"grammar": grammar})
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] and "<think>" not in msg["content"], msg
    inline = client.chat.completions.create(
        **kw, extra_body={"grammar": grammar, "reasoning_format": "none"}
    )
    text = inline.choices[0].message.content
    assert text == f"<think>{msg['reasoning_content']}</think>{msg['content']}"
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kw, stream=True, extra_body={"grammar": grammar}):
        for c in chunk.choices:
            d = c.delta.model_dump()
            parts["reasoning_content"] += d.get("reasoning_content") or ""
            parts["content"] += d.get("content") or ""
    assert parts == {"reasoning_content": msg["reasoning_content"], "content": msg["content"]}


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _bad(server: Server, **fields: Any) -> str:
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "hi"}], **fields}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "\n" not in err["message"]
    return str(err["message"])


def test_errors_are_400_with_the_reason(smol: Server) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    assert "foo" in _bad(smol, response_format=bad_schema)
    assert "json_object" in _bad(smol, response_format={"type": "xml"})
    assert "grammar" in _bad(smol, grammar="root ::= (")
    assert "only one" in _bad(smol, grammar='root ::= "a"', json_schema={"type": "object"})
    assert "nope" in _bad(
        smol, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
    )
    assert "no tools" in _bad(smol, tool_choice="required")
    assert "sometimes" in _bad(smol, tools=TOOLS, tool_choice="sometimes")
    assert "only function tools" in _bad(smol, tools=[{"type": "web_search"}])
    assert "logit_bias" in _bad(smol, logit_bias={"50": 5})
    assert "tools" in _bad(smol, functions=[{"name": "f"}])
    assert "text only" in _bad(smol, modalities=["text", "audio"])
    assert "prediction" in _bad(smol, prediction={"type": "content", "content": "x"})
    assert "response_format" in _bad(
        smol, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}
    )


def test_unknown_v1_paths_are_404_in_openais_shape(smol: Server) -> None:
    for method in ("GET", "POST"):
        r = httpx.request(method, smol.url + "/v1/nothing/here", json={}, timeout=10)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "unknown_url" and "/v1/chat/completions" in err["message"]
    with pytest.raises(openai.NotFoundError):
        _client(smol).post("/nothing", cast_to=httpx.Response, body={})


# -- over a pool ---------------------------------------------------------------------------------
def _pool_server(spawn: Spawn, path: Path, failover_s: float | None) -> tuple[Any, list[Any]]:
    workers = [spawn(), spawn()]
    plan = [Assignment(workers[0].address, 0, 14), Assignment(workers[1].address, 14, 30)]
    m = load_model(path, n_ctx=N_CTX, assignments=plan, failover_s=failover_s)
    return m, workers


@pytest.fixture(scope="module")
def pooled(spawn_module_worker: Spawn, smollm2_path: Path) -> Iterator[Server]:
    m, _ = _pool_server(spawn_module_worker, smollm2_path, 5.0)
    yield from _serve(m)


def test_constrained_answers_over_a_pool_equal_one_process(pooled: Server, smol: Server) -> None:
    """The grammar travels with the sampling settings to the last stage, which masks there: the
    same greedy answers as one process, and they validate."""
    for kw in (
        dict(tools=TOOLS, tool_choice="required"),
        dict(extra_body={"json_schema": PEOPLE}),
    ):
        answers = []
        for server in (pooled, smol):
            r = _client(server).chat.completions.create(
                model=server.model_id,
                messages=[{"role": "user", "content": "Who lives where? Or: weather in Bern?"}],
                temperature=0,
                max_tokens=300,
                **kw,
            )
            answers.append(r.choices[0].message)
        assert answers[0].content == answers[1].content
        if "tools" in kw:
            assert _check_calls(answers[0].tool_calls, TOOLS) == _check_calls(
                answers[1].tool_calls, TOOLS
            )
        else:
            jsonschema.validate(json.loads(answers[0].content), PEOPLE)


def test_responses_and_messages_over_a_pool(pooled: Server) -> None:
    """The Responses API's and Anthropic's forced calls over the pool: valid arguments."""
    import anthropic

    schema = WEATHER["function"]["parameters"]
    r = _client(pooled).responses.create(
        model=pooled.model_id,
        input="Weather in Bern?",
        tools=[{"type": "function", "name": "get_weather", "parameters": schema}],
        tool_choice="required",
        temperature=0,
        max_output_tokens=80,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), schema)
    a = anthropic.Anthropic(base_url=pooled.url, api_key="none", max_retries=0, timeout=120)
    m = a.messages.create(
        model=pooled.model_id,
        max_tokens=80,
        messages=[{"role": "user", "content": "Weather in Bern?"}],
        tools=[{"name": "get_weather", "input_schema": schema}],
        tool_choice={"type": "any"},
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    jsonschema.validate(uses[0].input, schema)


def test_a_worker_killed_mid_answer_still_gives_a_valid_answer(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """The last stage (it samples, with the grammar's matcher) is killed a few tokens into a
    sampled, schema-constrained answer: the new last stage's matcher catches up on the tokens so
    far (SeqChunk.constrained) and the answer still validates."""
    m, workers = _pool_server(spawn_worker, smollm2_path, 2.0)
    gen = _serve(m)
    server = next(gen)
    try:
        stream = _client(server).chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": "List six people."}],
            temperature=0.8,
            seed=5,
            max_tokens=400,
            stream=True,
            extra_body={"json_schema": PEOPLE},
        )
        text, killed = "", threading.Event()
        for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                if len(text) > 40 and not killed.is_set():
                    workers[1].kill()
                    killed.set()
        assert killed.is_set()
        jsonschema.validate(json.loads(text), PEOPLE)
        assert isinstance(m.pipeline, FailoverPipeline) and len(m.pipeline.events) == 1
    finally:
        gen.close()
        m.close()


def test_an_agent_frameworks_tool_loop_runs_to_its_end(smol: Server) -> None:
    """The OpenAI Agents SDK over /v1/chat/completions, with its default loop: the model must call
    the tool (tool_choice required, reset to auto once called), the SDK runs the tool and sends
    its result back as a `tool` message, and the model's next answer (text) ends the run."""
    import asyncio

    import agents
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel

    agents.set_tracing_disabled(True)
    seen: list[tuple[int, int]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0)
        agent = agents.Agent(
            name="calculator",
            instructions="You add numbers with the add tool, then say the result.",
            tools=[add],
            model=OpenAIChatCompletionsModel(model=smol.model_id, openai_client=client),
            model_settings=agents.ModelSettings(
                tool_choice="required", temperature=0, max_tokens=60
            ),
        )
        try:
            return await agents.Runner.run(agent, "What is 2 + 3?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(seen) == 1 and all(isinstance(x, int) for x in seen[0])
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(calls) == 1 and len(outputs) == 1 and outputs[0].output == sum(seen[0])
    assert isinstance(result.final_output, str) and result.final_output.strip()
