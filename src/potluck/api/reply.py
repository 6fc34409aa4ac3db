"""A chat answer's text, split as it streams into what it is: reasoning (`<think>...</think>`,
returned as `reasoning_content`), the answer's content, and tool calls (tools.py's formats).

`ReplyParser.push(text)` takes each decoded piece and gives the parts it can already tell apart;
`finish()` gives the rest. Text that might be the start of a marker (`<tool_ca`) is held back
until the next piece tells; a tool call goes out whole once its block is closed (OpenAI clients
assemble `tool_calls` deltas, so a call in one delta is a valid stream).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from potluck.api.tools import ToolFormat, new_call_id

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


@dataclass
class Parts:
    """What one piece of text turned out to be."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def add(self, more: Parts) -> None:
        self.reasoning += more.reasoning
        self.content += more.content
        self.calls += more.calls

    def message(self) -> dict[str, Any]:
        """The whole answer as OpenAI's assistant message (content null beside tool calls)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.calls:
            out["content"] = self.content.strip() or None
            out["tool_calls"] = [c.openai() for c in self.calls]
        return out

    def delta(self, first_call: int) -> dict[str, Any]:
        """This part as a streamed chunk's delta (its calls numbered from `first_call`)."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.calls:
            out["tool_calls"] = [c.openai(first_call + k) for k, c in enumerate(self.calls)]
        return out


def chat_finish(reason: str, parser: ReplyParser) -> str:
    """OpenAI's finish_reason: "tool_calls" when an answer that ended by itself made calls."""
    return "tool_calls" if parser.called and reason == "stop" else reason


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReplyParser:
    """Splits one choice's streamed text. tools: the format to find calls in (None: no tools in
    the request); reasoning: split `<think>` blocks off (False: keep them inline in content);
    thinking: the prompt already opened the block (a template that ends its generation prompt
    with `<think>`)."""

    def __init__(
        self, tools: ToolFormat | None, reasoning: bool = True, thinking: bool = False
    ) -> None:
        self.fmt, self.reasoning = tools, reasoning
        self.mode = "think" if reasoning and thinking else "start"
        self.buf = ""  # text not given out yet
        self.calls: list[ToolCall] = []
        self.content = ""  # all content given out (the whole answer's, for finish_reason)
        self._lead = ""  # characters dropped where the text goes on (after </think>, a call)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def push(self, text: str) -> Parts:
        self.buf += text
        out = Parts()
        self._run(out, final=False)
        return out

    def finish(self) -> Parts:
        out = Parts()
        self._run(out, final=True)
        if self.buf:  # an unclosed call, or a bare object that is no call: the text as it is
            out.content += self.buf
            self.buf = ""
        self.content += out.content
        return out

    # -- the states ---------------------------------------------------------------------------------
    def _run(self, out: Parts, final: bool) -> None:
        while True:
            before = (self.mode, len(self.buf))
            getattr(self, f"_{self.mode}")(out, final)
            if (self.mode, len(self.buf)) == before:
                break
        if not final:
            self.content += out.content

    def _start(self, out: Parts, final: bool) -> None:
        """Before anything: a `<think>` block may open the answer (after blank space)."""
        head = self.buf.lstrip()
        if self.reasoning and head.startswith(THINK_OPEN):
            self.buf, self.mode = head[len(THINK_OPEN) :], "think"
        elif self.reasoning and THINK_OPEN.startswith(head) and not final:
            return  # (wait: it may still become "<think>")
        else:
            self.mode = "text"

    def _think(self, out: Parts, final: bool) -> None:
        end = self.buf.find(THINK_CLOSE)
        if end >= 0:
            out.reasoning += self.buf[:end]
            self.buf, self.mode = self.buf[end + len(THINK_CLOSE) :], "text"
            self._lead = " \n\t"
            return
        keep = 0 if final else _held(self.buf, THINK_CLOSE)
        out.reasoning += self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]

    def _text(self, out: Parts, final: bool) -> None:
        fmt = self.fmt
        if fmt is None:
            out.content += self.buf
            self.buf = ""
            return
        if not fmt.open:  # Llama 3: a bare JSON object is a call, whatever comes before it
            if not (self.content + out.content).strip() and self.buf.lstrip().startswith("{"):
                self.mode = "bare"
                return
            if not final and not (self.content + out.content + self.buf).strip():
                return
            out.content += self.buf
            self.buf = ""
            return
        if self._lead:  # (blank space after a reasoning block, line breaks after a call)
            self.buf = self.buf.lstrip(self._lead)
            if not self.buf:
                return
            self._lead = ""
        at = self.buf.find(fmt.open.strip())
        if at >= 0:
            out.content += self.buf[:at]
            self.buf, self.mode = self.buf[at + len(fmt.open.strip()) :], "call"
            return
        keep = 0 if final else _held(self.buf, fmt.open.strip())
        out.content += self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]

    def _call(self, out: Parts, final: bool) -> None:
        """Inside a call block (after its opening marker)."""
        fmt = self.fmt
        assert fmt is not None
        if fmt.is_list:  # one array of calls to the end of the answer
            if final:
                calls = _calls_of(self.buf, fmt)
                if calls is not None:
                    out.calls += calls
                    self.calls += calls
                    self.buf, self.mode = "", "text"
                else:
                    self.buf, self.mode = fmt.open + self.buf, "done"
            return
        end = self.buf.find(fmt.close.strip())
        if end < 0:
            if final:
                self.buf, self.mode = fmt.open.strip() + self.buf, "done"
            return
        calls = _calls_of(self.buf[:end], fmt)
        if calls is None:  # not a call after all: its text is content
            out.content += fmt.open.strip() + self.buf[: end + len(fmt.close.strip())]
        else:
            out.calls += calls
            self.calls += calls
        self.buf, self.mode = self.buf[end + len(fmt.close.strip()) :], "text"
        self._lead = "\n"

    def _bare(self, out: Parts, final: bool) -> None:
        assert self.fmt is not None
        if not final:
            return
        calls = _calls_of(self.buf, self.fmt)
        if calls is not None:
            out.calls += calls
            self.calls += calls
            self.buf = ""
        self.mode = "done"

    def _done(self, out: Parts, final: bool) -> None:
        """An unparsable call: finish() gives the rest as content."""


def _calls_of(text: str, fmt: ToolFormat) -> list[ToolCall] | None:
    """The calls a block's JSON holds (an object, or a list for a list format); None when it is
    not calls."""
    try:
        value = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get(fmt.args_key, item.get("arguments", item.get("parameters", {})))
        if isinstance(args, str):  # (some models write the arguments as a JSON string)
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(new_call_id(), item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


class HarmonyParser(ReplyParser):
    """gpt-oss's harmony format: the answer is messages, each `<|channel|>NAME ...<|message|>`
    then its text up to `<|end|>` (the next opens with `<|start|>assistant`): the analysis
    channel is reasoning, final (and a commentary preamble) content, and a commentary message
    `to=functions.NAME` a call whose text is its arguments. (`<|call|>` and `<|return|>` end the
    turn: they never reach the text.)"""

    _ENDS = ("<|end|>", "<|start|>", "<|call|>", "<|return|>")

    def __init__(self, reasoning: bool = True) -> None:
        super().__init__(None, reasoning)
        self.mode = "header"
        self._fn: str | None = None  # the function the open message calls
        self._args = ""

    def _run(self, out: Parts, final: bool) -> None:
        while self.buf:
            if self.mode == "header":
                at = self.buf.find("<|message|>")
                if at < 0:
                    head = self.buf.lstrip()
                    if head.startswith("<|") or "<|".startswith(head):
                        if final:  # a header never finished: nothing of it is text
                            self.buf = ""
                        break
                    self.mode = "text"  # (text without a channel: content)
                    continue
                self._open(self.buf[:at])
                self.buf = self.buf[at + len("<|message|>") :]
                continue
            ends = [i for i in (self.buf.find(e) for e in self._ENDS) if i >= 0]
            cut = min(ends) if ends else len(self.buf)
            if not ends and not final:
                cut -= max(_held(self.buf, e) for e in self._ENDS)
            self._emit(out, self.buf[:cut])
            self.buf = self.buf[cut:]
            if not ends:
                break
            for e in ("<|end|>", "<|call|>", "<|return|>"):
                if self.buf.startswith(e):
                    self.buf = self.buf[len(e) :]
            self._close(out)
        if final:
            self._close(out)
        if not final:
            self.content += out.content

    def _open(self, header: str) -> None:
        if "to=functions." in header:
            name = header.split("to=functions.", 1)[1]
            self._fn = name.split()[0].split("<|")[0] if name.strip() else ""
            self._args, self.mode = "", "call"
        elif "analysis" in header and self.reasoning:
            self.mode = "think"
        else:
            self.mode = "text"

    def _emit(self, out: Parts, text: str) -> None:
        if self.mode == "think":
            out.reasoning += text
        elif self.mode == "call":
            self._args += text
        else:
            out.content += text

    def _close(self, out: Parts) -> None:
        if self.mode == "call" and self._fn is not None:
            try:
                args = json.loads(self._args.strip() or "{}")
            except json.JSONDecodeError:
                args = None
            if isinstance(args, dict):
                call = ToolCall(new_call_id(), self._fn, json.dumps(args, ensure_ascii=False))
                out.calls.append(call)
                self.calls.append(call)
            else:  # not a call after all: its text is content
                out.content += self._args
        self._fn, self._args, self.mode = None, "", "header"
