"""An answer's text split into reasoning, content and tool calls (api/reply.py), for each call
format, whole and in every way a stream can cut it; and the forced-call grammars (api/tools.py)
over a vocabulary whose markers are control tokens."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from potluck.api.reply import HarmonyParser, Parts, ReplyParser
from potluck.api.tools import HARMONY, HERMES, LLAMA3, MISTRAL, ToolFormat, calls_grammar
from potluck.grammar import Constraint, Vocabulary
from potluck.modelfile.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ggufgen import tiny_vocab  # noqa: E402


def _split(make: Any, text: str, cuts: list[int]) -> tuple[str, str, list[tuple[str, dict]]]:
    parser = make()
    whole = Parts()
    at = 0
    for cut in [*cuts, len(text)]:
        whole.add(parser.push(text[at:cut]))
        at = cut
    whole.add(parser.finish())
    return whole.reasoning, whole.content, [(c.name, json.loads(c.arguments)) for c in whole.calls]


def _every_cut(make: Any, text: str) -> tuple[str, str, list[tuple[str, dict]]]:
    """The parts of `text` whole, checked equal for one-character pieces and random cuts."""
    want = _split(make, text, [])
    assert _split(make, text, list(range(1, len(text)))) == want
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(5, len(text) - 1)))
        assert _split(make, text, cuts) == want
    return want


CASES: list[tuple[ToolFormat, str, tuple[str, str, list[tuple[str, dict]]]]] = [
    (
        HERMES,
        'Let me look.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n',
        ("", "Let me look.", [("f", {"x": 1}), ("g", {})]),
    ),
    (
        HERMES,
        "<think>Which one?</think>\n\nA <b>plain</b> answer <tool_ca",
        ("Which one?", "A <b>plain</b> answer <tool_ca", []),
    ),
    (HERMES, "<tool_call>\nnot json\n</tool_call> then", ("", "<tool_call>\nnot json\n</tool_call> then", [])),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"x": "y"}}]', ("", "", [("f", {"x": "y"})])),
    (LLAMA3, ' {"name": "f", "parameters": {"a": [1, 2]}}', ("", "", [("f", {"a": [1, 2]})])),
    (LLAMA3, '{"not": "a call"}', ("", '{"not": "a call"}', [])),
    (LLAMA3, 'Text first {"name": "f", "parameters": {}}', ("", 'Text first {"name": "f", "parameters": {}}', [])),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text", "want"), CASES)
def test_parts_whole_and_streamed(fmt: ToolFormat, text: str, want: Any) -> None:
    assert _every_cut(lambda: ReplyParser(fmt), text) == want


def test_reasoning_inline_and_a_prompt_that_opened_the_block() -> None:
    text = "<think>hm</think>Yes."
    assert _every_cut(lambda: ReplyParser(None, reasoning=False), text) == ("", text, [])
    assert _every_cut(lambda: ReplyParser(None, thinking=True), "hm</think>Yes.") == (
        "hm",
        "Yes.",
        [],
    )
    assert _every_cut(lambda: ReplyParser(None), "<thin") == ("", "<thin", [])


def test_harmony_channels() -> None:
    text = (
        "<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    )
    want = ("User wants weather.", "", [("get_weather", {"city": "Oslo"})])
    assert _every_cut(lambda: HarmonyParser(), text) == want
    answer = (
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4"
    )
    assert _every_cut(lambda: HarmonyParser(), answer) == ("Easy.", "4", [])
    assert _every_cut(lambda: HarmonyParser(reasoning=False), answer) == ("", "Easy.4", [])
    assert _every_cut(lambda: HarmonyParser(), "no channels") == ("", "no channels", [])


MARKERS = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "<|channel|>",
    "<|constrain|>",
    "<|message|>",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": n,
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer", "maximum": 99}},
                "required": ["x"],
            },
        },
    }
    for n in ("f", "g")
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The tests' tiny byte-level vocabulary with the formats' markers as control tokens."""
    meta = tiny_vocab()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *MARKERS]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *[3] * len(MARKERS)]
    return Tokenizer(meta)


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        (HERMES, '<tool_call>\n{"name": "g", "arguments": {"x": 7}}\n</tool_call>', '<tool_call>\n{"name": "h"'),
        (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', '[TOOL_CALLS][{"name": "f", "arguments": {"y"'),
        (LLAMA3, '{"name": "f", "parameters": {"x": 12}}', '{"name": "f", "arguments"'),
        (HARMONY, '<|channel|>commentary to=functions.g <|constrain|>json<|message|>{"x": 3}', "<|channel|>final"),
    ],
)  # fmt: skip
def test_forced_call_grammars(fmt: ToolFormat, good: str, bad: str, tokenizer: Tokenizer) -> None:
    """A valid call is accepted to its end (then only an end of turn), a wrong one is not: the
    markers are matched as their control tokens, not as text."""
    grammar = calls_grammar(TOOLS, fmt, False, tokenizer)
    vocab = Vocabulary(tokenizer)
    vocab.check(grammar)
    logits = np.zeros(tokenizer.vocab_size, np.float32)
    c = Constraint(vocab, grammar, 0)
    for t in tokenizer.encode(good, add_bos=False):
        assert np.isfinite(c.apply(logits)[t]), tokenizer.decode([t])
        c.accept(t)
    assert set(np.flatnonzero(np.isfinite(c.apply(logits)))) <= set(tokenizer.eot_ids)
    c = Constraint(vocab, grammar, 0)
    ids = tokenizer.encode(bad, add_bos=False)
    ok = True
    for t in ids:
        if not np.isfinite(c.apply(logits)[t]):
            ok = False
            break
        c.accept(t)
    assert not ok, bad
