"""Tools rendered by a chat template that reads `tools`, token for token as `transformers`'
`apply_chat_template` renders them (the reference for how a template sees tools, tool calls and
tool results), in the three call formats whose markers tools.py reads off a template.

The templates are written here in the style of the families' own (Hermes / Qwen, Llama 3.1,
Mistral); the packaged models' templates have no tools. Both sides tokenize with SmolLM2's
vocabulary: ours from the GGUF, transformers' own GGUF tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from potluck.api.chat import ChatTurn, prepare
from potluck.api.tools import HERMES, LLAMA3, MISTRAL, tool_format
from potluck.modelfile.chat import ChatTemplate
from potluck.modelfile.tokenizer import Tokenizer

HERMES_STYLE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "Tools you may call:\n<tools>\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
    'Answer a call as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
LLAMA3_STYLE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'user' and loop.last and tools %}<|start_header_id|>user<|end_header_id|>\n\n"
    'Call a function with a JSON object {"name": ..., "parameters": ...}. Functions:\n'
    "{%- for t in tools %}\n{{ t | tojson(indent=4) }}{%- endfor %}\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.role == 'ipython' or m.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{%- endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
MISTRAL_STYLE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "[INST]{{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}[TOOL_CALLS][{%- for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "{%- if not loop.last %}, {% endif %}{%- endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ m.content }}{{ eos_token }}{%- endif %}{%- endfor %}"
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ARGS = {"city": "Zürich"}
# OpenAI's form (what a client sends): arguments as a JSON string
OPENAI_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 °C"},
    {"role": "user", "content": "And tomorrow?"},
]


def _hf_messages() -> list[dict[str, Any]]:
    """The same conversation as transformers' documentation writes it: arguments as an object."""
    out = json.loads(json.dumps(OPENAI_MESSAGES))
    out[2]["tool_calls"][0]["function"]["arguments"] = ARGS
    out[2]["content"] = ""
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name
    )


@pytest.mark.parametrize(
    ("source", "fmt"), [(HERMES_STYLE, HERMES), (LLAMA3_STYLE, LLAMA3), (MISTRAL_STYLE, MISTRAL)]
)
def test_tools_render_token_for_token_as_transformers(
    source: str, fmt: Any, hf_tokenizer: Any, smollm2_path: Path
) -> None:
    ours = Tokenizer.from_gguf(smollm2_path)
    template = ChatTemplate(source, bos_token="", eos_token="</s>")
    assert tool_format(template) == (fmt, True)
    prep = prepare(ChatTurn([dict(m) for m in OPENAI_MESSAGES], tools=TOOLS), template, ours)
    want_text = hf_tokenizer.apply_chat_template(
        _hf_messages(),
        tools=TOOLS,
        chat_template=source,
        add_generation_prompt=True,
        tokenize=False,
        bos_token="",
        eos_token="</s>",
    )
    assert prep.text == want_text
    want_ids = hf_tokenizer(want_text, add_special_tokens=False)["input_ids"]
    assert prep.ids[len(prep.ids) - len(want_ids) :] == want_ids
    assert "Sunny, 21 °C" in prep.text and "Zürich" in prep.text


def test_a_template_without_tools_gets_them_in_the_system_prompt(smollm2_path: Path) -> None:
    """SmolLM2's own template has no tools: they go into the system prompt (Hermes format), the
    call and its result become text, and the system message given stays first."""
    ours = Tokenizer.from_gguf(smollm2_path)
    template = ChatTemplate.from_metadata(_metadata(smollm2_path))
    assert tool_format(template) == (HERMES, False)
    prep = prepare(ChatTurn([dict(m) for m in OPENAI_MESSAGES], tools=TOOLS), template, ours)
    assert prep.text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert '"name": "get_weather"' in prep.text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' in prep.text
    assert "<tool_response>\nSunny, 21 °C\n</tool_response>" in prep.text
    plain = prepare(ChatTurn([{"role": "user", "content": "hi"}]), template, ours)
    assert "You can call functions" not in plain.text


def _metadata(path: Path) -> dict[str, Any]:
    from potluck.modelfile.gguf_file import GGUFFile

    return dict(GGUFFile(path).metadata)
