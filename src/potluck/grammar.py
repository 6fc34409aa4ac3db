"""Constrained decoding: grammars compiled by llguidance over a GGUF's vocabulary, and the
per-sequence `Constraint` a sampler applies to each token's logits.

A grammar is llguidance's own grammar text (what `LLMatcher` takes), made here from a JSON schema,
any JSON object, a GBNF grammar (llama.cpp's), a Lark grammar or a regular expression. It is plain
text, so it travels to a pool's last stage inside the sampling settings and is compiled there
again. The matcher's state is a function of the tokens it has consumed: a constraint records them
by position, so that the sampler can be rewound (rejected drafts), caught up (a new last stage after
a failover), or started over by a new request in the same sequence, always from positions alone.

llguidance (guidance-ai) is the grammar engine llama.cpp and vLLM use: it takes the vocabulary as
token byte strings and computes a token mask per step from a lexer + Earley parser.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from potluck.errors import PotluckError
from potluck.modelfile.tokenizer import Tokenizer


class GrammarError(PotluckError):
    """A grammar or schema that cannot be compiled (HTTP 400, with llguidance's reason)."""


class ConstraintError(PotluckError):
    """A constraint asked for a position whose earlier tokens it has not seen."""


# JSON the way models write it: ", " and ": " between items, no free runs of whitespace (a small
# model given free whitespace can fill max_tokens with newlines inside a valid object).
JSON_OPTIONS: dict[str, Any] = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


def _llg() -> Any:
    import llguidance  # (imported on first use: a server without constraints never loads it)
    import llguidance.numpy

    return llguidance


def json_schema_grammar(schema: Any) -> str:
    """A grammar for JSON that validates against `schema` (a dict, or True / {} for any value).
    Raises GrammarError when the schema is not a JSON object (compiling checks the rest)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return str(_llg().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema cannot be read: {exc}") from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


def gbnf_grammar(text: str) -> str:
    """llama.cpp's GBNF (or Lark) grammar text."""
    try:
        return str(_llg().grammar_from("gbnf", text))
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def lark_grammar(text: str) -> str:
    """A Lark grammar in llguidance's dialect (`%json {...}` embeds a JSON schema)."""
    return str(_llg().LLMatcher.grammar_from_lark(text))


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Vocabulary:
    """llguidance's view of a model's vocabulary: each token's bytes, which ones are special (they
    never match grammar text), and the end-of-turn ids (allowed once the grammar is complete).
    Built once per tokenizer (`of`): a few hundred ms for a 150k vocabulary."""

    _cache: weakref.WeakKeyDictionary[Tokenizer, Vocabulary] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Tokenizer) -> None:
        llg = _llg()
        self.n_vocab = tokenizer.vocab_size
        eot = sorted(tokenizer.eot_ids) or (
            [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        )
        if not eot:
            raise GrammarError("the model names no end-of-sequence token: a grammar cannot end")
        self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(tokenizer, eot[0])), eos_token=eot)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Vocabulary:
        with cls._lock:
            vocab = cls._cache.get(tokenizer)
            if vocab is None:
                vocab = cls._cache[tokenizer] = cls(tokenizer)
            return vocab

    def check(self, grammar: str) -> None:
        """Raises GrammarError with llguidance's reason when `grammar` does not compile here."""
        message = _llg().LLMatcher.validate_grammar(grammar, self.ll)
        if message:
            raise GrammarError(" ".join(message.split()))


class _Wrapped:
    """What llguidance's TokenizerWrapper reads off a tokenizer."""

    def __init__(self, tokenizer: Tokenizer, eos: int) -> None:
        n = tokenizer.vocab_size
        self.eos_token_id, self.bos_token_id = eos, tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]
        self._tok = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_bos=False, parse_special=False)


class Constraint:
    """One sequence's grammar state: the matcher and the tokens it consumed, at positions
    start, start + 1, ... (start: the first generated token's position, the prompt's length)."""

    def __init__(self, vocab: Vocabulary, grammar: str, start: int) -> None:
        self.vocab, self.start = vocab, start
        self.matcher = _llg().LLMatcher(vocab.ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(" ".join(self.matcher.get_error().split()))
        self.ids: list[int] = []
        self._mask = np.empty((1, (vocab.n_vocab + 31) // 32), np.int32)

    @property
    def end(self) -> int:
        """The position of the next token the matcher expects."""
        return self.start + len(self.ids)

    def sync(self, at: int, tail: Sequence[int] = ()) -> None:
        """Bring the matcher to position `at`: roll back what it consumed at `at` or later (a
        rewind, a new request in the same sequence), or consume the tokens it has not seen from
        `tail` (the ids just before `at`: tail[-1] is at position at - 1)."""
        if at < self.start:
            raise ConstraintError(
                f"position {at} is before the constrained answer's start {self.start}"
            )
        if at < self.end:
            n = self.end - at
            self.matcher.rollback(n)
            del self.ids[-n:]
        elif at > self.end:
            n = at - self.end
            if len(tail) < n:
                raise ConstraintError(
                    f"the constraint is at position {self.end} and cannot catch up to {at}: "
                    f"{n} tokens are missing"
                )
            for t in tail[len(tail) - n :]:
                self.accept(int(t))

    def apply(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """A copy of `logits` [V] with every token the grammar forbids next at -inf."""
        _llg().numpy.fill_next_token_bitmask(self.matcher, self._mask)
        allowed = np.unpackbits(self._mask[0].view(np.uint8), bitorder="little").view(bool)
        n = min(logits.shape[0], self.vocab.n_vocab)
        out = np.full_like(logits, -np.inf)
        keep = allowed[:n]
        out[:n][keep] = logits[:n][keep]
        if not keep.any():  # (cannot happen: a complete grammar allows the end of turn)
            raise ConstraintError(
                f"the grammar allows no token at position {self.end}: "
                f"{self.matcher.get_error() or 'it is complete and the model has no end token'}"
            )
        return out

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(
                f"token {token} at position {self.end} breaks the grammar: "
                f"{' '.join(self.matcher.get_error().split())}"
            )
        self.ids.append(token)
