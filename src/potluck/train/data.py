"""Training data: JSONL lines of chats or plain text, as token ids with the positions to learn.

{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
    rendered with the model's chat template; only the assistant turns' tokens are learned
    (their text and the end-of-turn token the template writes after it).
{"text": "..."}
    every token is learned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from potluck.errors import PotluckError
from potluck.modelfile.chat import ChatTemplate
from potluck.modelfile.tokenizer import Tokenizer


class DataError(PotluckError):
    """A training file that cannot be used (no usable line, a line longer than --ctx)."""


@dataclass(frozen=True)
class Example:
    line: int  # 1-based, in its file
    ids: tuple[int, ...]
    learn: tuple[bool, ...]  # per position: is this token learned (predicted from the ones before)

    @property
    def n_learned(self) -> int:
        return sum(self.learn[1:])


def read_examples(
    path: Path, tok: Tokenizer, chat: ChatTemplate, ctx: int
) -> tuple[list[Example], list[tuple[int, str]]]:
    """The examples of a JSONL file, and the lines skipped with the reason ([(line, why)]).
    Raises DataError when no line is usable or a line is longer than ctx tokens."""
    if not path.is_file():
        raise DataError(f"training data {path} does not exist or is not a file")
    examples: list[Example] = []
    skipped: list[tuple[int, str]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                skipped.append((n, f"not JSON ({exc.msg} at column {exc.colno})"))
                continue
            ex, why = _example(n, obj, tok, chat)
            if ex is None:
                skipped.append((n, why))
                continue
            if len(ex.ids) > ctx:
                raise DataError(
                    f"{path} line {n} is {len(ex.ids)} tokens, longer than the context "
                    f"({ctx}): raise --ctx to {len(ex.ids)} or more, or shorten the line"
                )
            examples.append(ex)
    if not examples:
        first = f"; line {skipped[0][0]}: {skipped[0][1]}" if skipped else ""
        raise DataError(
            f"{path} has no usable line ({len(skipped)} skipped{first}): each line is "
            '{"messages": [...]} with an assistant turn, or {"text": "..."}'
        )
    return examples, skipped


def _example(n: int, obj: Any, tok: Tokenizer, chat: ChatTemplate) -> tuple[Example | None, str]:
    if isinstance(obj, dict) and isinstance(obj.get("text"), str) and obj["text"]:
        ids = tok.encode(obj["text"])
        return Example(n, tuple(ids), tuple(True for _ in ids)), ""
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        return _chat(n, obj["messages"], tok, chat)
    return None, 'neither {"messages": [...]} nor {"text": "..."} with text'


def _chat(
    n: int, messages: Sequence[Any], tok: Tokenizer, chat: ChatTemplate
) -> tuple[Example | None, str]:
    if not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m
        for m in messages
    ):
        return None, 'each message needs "role" and "content"'
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no assistant message: nothing to learn"
    ids = tok.encode(chat.render(messages, add_generation_prompt=False))
    learn = [False] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.encode(chat.render(messages[:k], add_generation_prompt=True))
        upto = tok.encode(chat.render(messages[: k + 1], add_generation_prompt=False))
        if upto[: len(before)] != before or ids[: len(upto)] != upto:
            return None, (
                f"the chat template renders the conversation up to message {k + 1} differently "
                "inside the whole one (it rewrites earlier turns): cannot tell which tokens to learn"
            )
        for i in range(len(before), len(upto)):
            learn[i] = True
    return Example(n, tuple(ids), tuple(learn)), ""
