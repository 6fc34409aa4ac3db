"""One chat turn, whichever API it came in by (chat completions, Responses, Anthropic's Messages):
its messages, tools and output format → the prompt ids, the grammar that constrains the answer,
and the parser that splits the answer into reasoning, content and tool calls.

`ChatTurn` is the common shape (OpenAI chat messages, OpenAI function tools); each route converts
its body into one and reads the answer back through `ReplyParser` (reply.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from potluck.api import errors
from potluck.api.reply import HarmonyParser, ReplyParser
from potluck.api.tools import (
    HARMONY,
    ToolFormat,
    calls_grammar,
    check_tools,
    render_messages,
    tool_format,
)
from potluck.grammar import (
    GrammarError,
    Vocabulary,
    gbnf_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
)
from potluck.modelfile.chat import ChatTemplate, ChatTemplateError
from potluck.modelfile.tokenizer import Tokenizer

TOOL_CHOICES = ("auto", "none", "required")


@dataclass
class ChatTurn:
    """What a chat request asks, in OpenAI's chat terms."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = None  # "auto" / "none" / "required" / {"type": "function", ...}; None: auto
    parallel_tool_calls: bool = False  # a forced call may be several (auto: always may)
    # the answer's format: ("json_schema", schema) / ("json_object", None) / ("gbnf", text) /
    # ("regex", text) / ("choice", [str]); None: free text
    output: tuple[str, Any] | None = None
    reasoning: bool = True  # <think> blocks → reasoning_content (False: inline in content)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables


@dataclass(frozen=True)
class Prepared:
    """A turn ready to run: its prompt, its grammar, how to read its answer."""

    ids: list[int]
    text: str
    grammar: str | None
    tools: ToolFormat | None  # the format to find calls in (None: calls are not read)
    thinking: bool  # the prompt opened a <think> block
    reasoning: bool

    harmony: bool = False  # gpt-oss's channels (its analysis is reasoning)

    def parser(self) -> ReplyParser:
        if self.harmony:
            return HarmonyParser(self.reasoning)
        return ReplyParser(self.tools, self.reasoning, self.thinking)


def prepare(turn: ChatTurn, template: ChatTemplate, tokenizer: Tokenizer) -> Prepared:
    """Render and tokenize the turn, and compile what constrains it. Raises ApiError (400) with
    the field at fault. (Runs in a worker thread: rendering and compiling can take a while.)"""
    try:
        tools = check_tools(turn.tools)
    except ValueError as exc:
        raise errors.bad_request(str(exc), "tools") from None
    choice = _tool_choice(turn.tool_choice, tools)
    fmt, native = tool_format(template)
    messages = render_messages(turn.messages, tools, native)
    variables: dict[str, Any] = dict(turn.template_kwargs)
    if native and tools:
        variables["tools"] = tools
    constrained = turn.output is not None or (tools and choice not in ("auto", "none"))
    if constrained and "enable_thinking" in template.source:
        variables.setdefault("enable_thinking", False)  # a grammar starts with the answer
    try:
        text = template.render(messages, **variables)
    except ChatTemplateError as exc:
        raise errors.bad_request(str(exc), "messages") from exc
    ids = tokenizer.encode(text)
    grammar = checked_grammar(turn.output, tokenizer)
    if tools and choice not in ("auto", "none"):
        if turn.output is not None:
            raise errors.bad_request(
                "tool_choice forces a tool call, so the answer cannot also follow "
                "response_format: send one of them",
                "response_format",
            )
        chosen = tools if choice == "required" else [t for t in tools if _name(t) == choice]
        try:
            grammar = calls_grammar(chosen, fmt, turn.parallel_tool_calls, tokenizer)
            Vocabulary.of(tokenizer).check(grammar)
        except GrammarError as exc:
            raise errors.bad_request(
                f"the tools cannot be compiled into a grammar: {exc}", "tools"
            ) from None
    thinking = text.rstrip().endswith("<think>")
    return Prepared(
        ids=ids,
        text=text,
        grammar=grammar,
        tools=fmt if tools and choice != "none" else None,
        thinking=thinking,
        reasoning=turn.reasoning,
        harmony=fmt is HARMONY,
    )


def checked_grammar(output: tuple[str, Any] | None, tokenizer: Tokenizer) -> str | None:
    """The grammar of an answer format (ChatTurn.output), compiled over the model's vocabulary;
    400 with llguidance's reason when it cannot be. (Blocking: run it in a worker thread.)"""
    if output is None:
        return None
    try:
        grammar = output_grammar(*output)
        Vocabulary.of(tokenizer).check(grammar)
    except GrammarError as exc:
        raise errors.bad_request(
            f"the response format cannot be compiled into a grammar: {exc}", "response_format"
        ) from None
    return grammar


def output_grammar(kind: str, value: Any) -> str:
    """The grammar of an answer format (ChatTurn.output). Raises GrammarError."""
    if kind == "json_schema":
        return json_schema_grammar(value)
    if kind == "json_object":
        return json_object_grammar()
    if kind == "gbnf":
        return gbnf_grammar(value)
    if kind == "regex":
        return lark_grammar(f"start: /{_regex_body(value)}/\n")
    if kind == "choice":
        alts = " | ".join(json.dumps(str(v), ensure_ascii=False) for v in value)
        return lark_grammar(f"start: {alts}\n")
    raise GrammarError(f"unknown output format {kind!r}")


def _regex_body(regex: str) -> str:
    return regex.replace("/", "\\/")


def _name(tool: Mapping[str, Any]) -> str:
    return str(tool["function"]["name"])


def _tool_choice(choice: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """ "auto", "none", "required", or the name of the function a named choice forces."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise errors.bad_request(
                f"tool_choice {choice!r} is not one of {', '.join(TOOL_CHOICES)}, or "
                f'{{"type": "function", "function": {{"name": ...}}}}',
                "tool_choice",
            )
        if choice == "required" and not tools:
            raise errors.bad_request("tool_choice is 'required' but no tools were given", "tools")
        return choice
    name = None
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
    if not isinstance(name, str):
        raise errors.bad_request(
            'tool_choice must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in {_name(t) for t in tools}:
        known = ", ".join(_name(t) for t in tools) or "none"
        raise errors.bad_request(
            f"tool_choice names function {name!r}, which is not among the tools ({known})",
            "tool_choice",
        )
    return name


def response_format_output(fmt: Mapping[str, Any] | None) -> tuple[str, Any] | None:
    """OpenAI's response_format → ChatTurn.output."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", None)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping):
            raise errors.bad_request(
                'response_format.json_schema is missing: give {"name": ..., "schema": {...}}',
                "response_format.json_schema",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, Mapping):
            raise errors.bad_request(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format.json_schema.schema",
            )
        return ("json_schema", dict(schema))
    raise errors.bad_request(
        f"response_format.type {kind!r} is not one of text, json_object, json_schema",
        "response_format.type",
    )
