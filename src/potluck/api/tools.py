"""Tool calls: OpenAI's `tools` rendered into the prompt, the grammar that makes a model call one
(`tool_choice` "required" or a named function), and the format its calls are written in.

A chat template that reads the `tools` variable renders them itself, as the model was trained; its
format (how a call is written) is read off the template: Hermes / Qwen `<tool_call>{json}</tool_call>`,
Mistral `[TOOL_CALLS][{json}, ...]`, Llama 3 a bare `{"name": ..., "parameters": ...}` object. A
template without tools (SmolLM2's, Gemma 3's, our built-ins) gets them as a system message in the
Hermes format (`FALLBACK_INSTRUCTIONS`), and earlier calls and their results become text in it.
Parsing the model's output is reply.py's.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from potluck.grammar import JSON_OPTIONS, GrammarError, lark_grammar, lark_literal
from potluck.modelfile.chat import ChatTemplate
from potluck.modelfile.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its tool calls: each call between `open` and `close` (a JSON object
    with the name under "name" and the arguments under `args_key`), or for a `list_open` format
    one JSON array of such objects after the marker; "" open: a bare object (Llama 3)."""

    name: str
    open: str
    close: str
    args_key: str = "arguments"
    is_list: bool = False


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", is_list=True)
LLAMA3 = ToolFormat("llama3", "", "", args_key="parameters")
# gpt-oss: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>`
# (read by reply.py's HarmonyParser; the other fields are unused)
HARMONY = ToolFormat("harmony", "<|channel|>", "")

FALLBACK_INSTRUCTIONS = (
    "You can call functions to answer the user. The functions, as JSON schemas:\n<tools>\n"
    "{tools}\n</tools>\n"
    "To call a function, answer with nothing but one block per call:\n"
    '<tool_call>\n{{"name": <the function\'s name>, "arguments": <an object of its '
    "arguments>}}\n</tool_call>\n"
    "A function's result comes back to you in a <tool_response> block."
)


def tool_format(template: ChatTemplate) -> tuple[ToolFormat, bool]:
    """The format of the template's tool calls, and whether the template renders `tools` itself
    (else: the built-in fallback, in the Hermes format)."""
    src = template.source
    native = not template.builtin and "tools" in src
    if "<|channel|>" in src:
        return HARMONY, native
    if not native:
        return HERMES, False
    if "[TOOL_CALLS]" in src:
        return MISTRAL, True
    if "<tool_call>" in src:
        return HERMES, True
    if "ipython" in src or "<|python_tag|>" in src:
        return LLAMA3, True
    return HERMES, True


def check_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's tool list, checked: function tools only, each with a name and an object schema.
    Raises ValueError with the field at fault."""
    out = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        kind = tool.get("type", "function")
        if kind != "function":
            raise ValueError(f"tools[{i}].type is {kind!r}: only function tools can be called")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name is missing: give each function a name")
        if fn["name"] in names:
            raise ValueError(f"tools[{i}]: a second function named {fn['name']!r}")
        names.add(fn["name"])
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"type": "function", "function": {**fn, "parameters": dict(params)}})
    return out


def arguments_object(call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call of an assistant message as templates expect it: arguments as an object (OpenAI
    clients send them as a JSON string)."""
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # (else the template prints it as given)
            fn["arguments"] = json.loads(args) if args.strip() else {}
    return {**call, "function": fn}


def render_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], native: bool
) -> list[dict[str, Any]]:
    """The messages for the template: with `native` tools, tool calls' arguments as objects;
    otherwise the tools as (the start of) the system prompt, calls and results as Hermes text."""
    msgs = [dict(m) for m in messages]
    for m in msgs:
        if m.get("tool_calls"):
            m["tool_calls"] = [arguments_object(c) for c in m["tool_calls"]]
    if native:
        return msgs
    out: list[dict[str, Any]] = []
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = FALLBACK_INSTRUCTIONS.format(tools=listing)
        if msgs and msgs[0]["role"] == "system":
            system = f"{msgs[0].get('content') or ''}\n\n{system}"
            msgs = msgs[1:]
        out.append({"role": "system", "content": system})
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                HERMES.open
                + json.dumps(
                    {
                        "name": c["function"].get("name"),
                        "arguments": c["function"].get("arguments"),
                    },
                    ensure_ascii=False,
                )
                + HERMES.close
                for c in m["tool_calls"]
            )
            text = f"{m.get('content') or ''}{calls}"
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if (
                out
                and out[-1]["role"] == "user"
                and out[-1]["content"].startswith("<tool_response>")
            ):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{result}"}
            else:
                out.append({"role": "user", "content": result})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    return out


def call_schema(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat) -> dict[str, Any]:
    """The JSON schema of one call of any of `tools`. Arguments the tool's schema does not name
    are not generated unless it says so (additionalProperties): a model that may invent one
    may also never end it."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                fmt.args_key: {"additionalProperties": False} | t["function"]["parameters"],
            },
            "required": ["name", fmt.args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def _marker(text: str, tokenizer: Tokenizer) -> str:
    """A marker as a Lark terminal: a special token by id (`<[id]>`: grammar text never matches
    a control token), else its text."""
    ids = tokenizer.encode(text, add_bos=False)
    if len(ids) == 1 and tokenizer.is_special(ids[0]):
        return f"<[{ids[0]}]>"
    return lark_literal(text)


def calls_grammar(
    tools: Sequence[Mapping[str, Any]], fmt: ToolFormat, parallel: bool, tokenizer: Tokenizer
) -> str:
    """A grammar whose every sentence is one call (or with `parallel`, one or more) of `tools`,
    written in the model's format. Raises GrammarError when a tool's schema cannot be compiled."""
    schema = json.dumps(call_schema(tools, fmt), ensure_ascii=False)
    if fmt is HARMONY:  # one message per call, its arguments the message's text
        alts = []
        for t in tools:
            args = {"additionalProperties": False} | t["function"]["parameters"]
            args["x-guidance"] = JSON_OPTIONS
            head = f"commentary to=functions.{t['function']['name']} "
            alts.append(
                f"{_marker('<|channel|>', tokenizer)} {lark_literal(head)} "
                f"{_marker('<|constrain|>', tokenizer)} {lark_literal('json')} "
                f"{_marker('<|message|>', tokenizer)} %json {json.dumps(args, ensure_ascii=False)}"
            )
        lark = "start: " + " | ".join(f"call{k}" for k in range(len(alts))) + "\n"
        lark += "".join(f"call{k}: {a}\n" for k, a in enumerate(alts))
    elif fmt.is_list:
        body = {
            "type": "array",
            "items": json.loads(schema),
            "minItems": 1,
            "x-guidance": JSON_OPTIONS,
        }
        if not parallel:
            body["maxItems"] = 1
        lark = f"start: {_marker(fmt.open, tokenizer)} %json {json.dumps(body)}\n"
    elif fmt.open:
        call = f"{_marker(fmt.open.strip(), tokenizer)} {lark_literal(chr(10))} %json {schema} "
        call += f"{lark_literal(chr(10))} {_marker(fmt.close.strip(), tokenizer)}"
        more = f" ({lark_literal(chr(10))} call)*" if parallel else ""
        lark = f"start: call{more}\ncall: {call}\n"
    else:
        lark = f"start: %json {schema}\n"
    try:
        return lark_grammar(lark)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
