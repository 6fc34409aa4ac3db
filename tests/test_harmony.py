"""gpt-oss's harmony format end to end: a tiny random model whose vocabulary has harmony's
control tokens and whose template writes harmony (channels, `to=functions.NAME` calls), served
and asked through the `openai` client for a forced tool call: the answer is a harmony call
message (its markers matched as control tokens), parsed into `tool_calls` whose arguments
validate. (The weights are random: what is checked is the format's path, not the model.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import jsonschema
import pytest

from potluck.api.chat import ChatTurn, prepare
from potluck.api.tools import HARMONY, tool_format
from potluck.engine.scheduler import SchedulerConfig
from potluck.pool.build import load_model
from test_api import Server, start_server

from ggufgen import tiny_vocab, write_tiny_model

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]  # fmt: skip
# harmony as gpt-oss's template writes it, shortened: tools in a developer message, each turn
# `<|start|>ROLE<|message|>TEXT<|end|>`, an assistant's call in the commentary channel
TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n"
    "{%- for t in tools %}\n{{ t.function.name }}: {{ t.function.parameters | tojson }}{%- endfor %}"
    "<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}<|start|>assistant<|channel|>commentary "
    "to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- elif m.role == 'tool' %}<|start|>functions<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["x"],
}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in ("up", "down")
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    meta = tiny_vocab()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *MARKERS]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *[3] * len(MARKERS)]
    meta["tokenizer.chat_template"] = TEMPLATE
    path = tmp_path_factory.mktemp("harmony") / "harmony-tiny.gguf"
    write_tiny_model(path, "llama", tokenizer_from=SimpleNamespace(metadata=meta), tied=False)  # type: ignore[arg-type]
    yield from start_server(load_model(path, n_ctx=512), SchedulerConfig(), None)


def test_a_forced_call_in_harmony(server: Server) -> None:
    assert tool_format(server.model.chat) == (HARMONY, True)
    client = server.client(None)
    for choice in ("required", {"type": "function", "function": {"name": "down"}}):
        r = client.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": "go"}],
            tools=TOOLS,
            tool_choice=choice,
            temperature=0,
            max_tokens=60,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        (call,) = c.message.tool_calls
        assert call.function.name in ("up", "down")
        if isinstance(choice, dict):
            assert call.function.name == "down"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        assert not (c.message.content or "").strip()


def test_the_call_goes_back_as_harmony(server: Server) -> None:
    msgs = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "up", "arguments": '{"x": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    prep = prepare(ChatTurn(msgs, tools=TOOLS), server.model.chat, server.model.tokenizer)
    assert (
        '<|start|>assistant<|channel|>commentary to=functions.up <|constrain|>json<|message|>{"x": 3}<|call|>'
        in prep.text
    )
    assert prep.text.endswith("<|start|>functions<|message|>done<|end|><|start|>assistant")
    assert prep.harmony
