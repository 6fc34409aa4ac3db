"""Token sampling: greedy, temperature, top-k, top-p, min-p and penalties, reproducible by seed.

The order follows llama.cpp's default chain: penalties -> top-k -> top-p -> min-p -> temperature.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from potluck.grammar import Constraint, Vocabulary

MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs limit)


class Token(int):
    """A sampled id (an `int` everywhere) that also carries its log-probability under the model's
    distribution (raw logits: before penalties, filters and temperature, as vLLM reports them) and
    the `top` alternatives as (id, logprob), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]

    def __new__(
        cls, token_id: int, logprob: float, top: tuple[tuple[int, float], ...] = ()
    ) -> Token:
        self = super().__new__(cls, token_id)
        self.logprob = logprob
        self.top = top
        return self

    def __repr__(self) -> str:
        return f"Token({int(self)}, logprob={self.logprob:.4f})"


class Accepted(int):
    """What a chunk with drafted ids gives (SeqChunk.draft): every token its samples gave, in
    order (`tokens`: the drafts they agreed with, then one more); as an int, the last of them
    (the next step's input id)."""

    tokens: tuple[int, ...]

    def __new__(cls, tokens: Sequence[int]) -> Accepted:
        if not tokens:
            raise ValueError("a drafted chunk gives at least one token")
        self = super().__new__(cls, int(tokens[-1]))
        self.tokens = tuple(tokens)
        return self

    def __repr__(self) -> str:
        return f"Accepted({list(self.tokens)})"


def tokens_of(sampled: int) -> tuple[int, ...]:
    """The tokens one chunk's result stands for: an Accepted's, else the one."""
    return sampled.tokens if isinstance(sampled, Accepted) else (sampled,)


GREEDY_BELOW = 1e-5  # a smaller temperature is greedy: logits / t overflow fp32 (vLLM's eps too)
# The repeat penalty divides or multiplies fp32 logits (|logit| < 1e4) before the temperature
# (>= GREEDY_BELOW) divides them: within these bounds no logit overflows to inf (then NaN).
REPEAT_PENALTY_MIN, REPEAT_PENALTY_MAX = 1e-6, 1e6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # below GREEDY_BELOW (0 or less too) means greedy
    top_k: int = 40  # ≤ 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repeat_penalty: float = 1.0  # 1.0 disables (llama.cpp's --repeat-penalty)
    repeat_last_n: int = 64  # how many recent tokens the penalties look at
    presence_penalty: float = 0.0  # OpenAI-style, subtracted once per token seen
    frequency_penalty: float = 0.0  # OpenAI-style, subtracted per occurrence
    seed: int | None = None
    # None: plain ids. k >= 0: each sampled id carries its log-probability and the k most likely
    # alternatives (a `Token`), as OpenAI's logprobs / top_logprobs ask.
    logprobs: int | None = None
    # constrained decoding (grammar.py): llguidance's grammar text, and the position of the first
    # token it constrains (the prompt's length; the scheduler sets it)
    grammar: str | None = None
    grammar_from: int = 0

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not REPEAT_PENALTY_MIN <= self.repeat_penalty <= REPEAT_PENALTY_MAX:
            raise ValueError(
                f"repeat_penalty must be in [{REPEAT_PENALTY_MIN:g}, {REPEAT_PENALTY_MAX:g}] "
                f"(1 = off), got {self.repeat_penalty}"
            )
        for name in ("temperature", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalizes(self) -> bool:
        """Whether sampling looks at the recent tokens (repeat, presence or frequency penalty)."""
        return self.repeat_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)


GREEDY = SamplingParams(temperature=0.0)


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that scatters every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform_at(seed: int, at: int) -> float:
    """The random number in [0, 1) a seeded sequence draws for its token at position `at`: a
    function of (seed, position) only, so that whichever stage samples the token, after a
    failover, a rewind or a speculative run, draws the same number for it."""
    z = _mix64((_mix64(seed & _MASK64) + (at & _MASK64) * _GOLDEN) & _MASK64)
    return (z >> 11) / float(1 << 53)


class Sampler:
    """Samples one sequence's tokens. A token's random draw depends only on the seed and its
    position in the sequence (`uniform_at`), so a seed reproduces a run on any stage. With a
    grammar (params.grammar, over `vocab`) only the tokens it allows next can be drawn."""

    def __init__(self, params: SamplingParams, vocab: Vocabulary | None = None) -> None:
        self.params = params
        self.constraint: Constraint | None = None
        if params.grammar is not None:
            if vocab is None:
                raise ValueError("a grammar needs the model's vocabulary")
            self.constraint = Constraint(vocab, params.grammar, params.grammar_from)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.seed = seed  # a remote last stage rebuilds the same sampler from params + seed
        self._drawn = 0  # draws made without a position (`sample(..., at=None)`)

    def penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = self.params
        if not history or (
            p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
        ):
            return logits
        recent = history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history
        counts = Counter(recent)
        ids = np.fromiter(counts, dtype=np.int64, count=len(counts))
        n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        logits = logits.copy()
        sel = logits[ids]
        if p.repeat_penalty != 1.0:  # CTRL-style: shrink positive logits, grow negative ones
            sel = np.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
        sel = sel - p.presence_penalty - p.frequency_penalty * n
        logits[ids] = sel
        return logits

    def sample(self, logits: np.ndarray, history: Sequence[int] = (), at: int | None = None) -> int:
        """logits: [V] fp32 -> one token id (a `Token` with its logprobs when params.logprobs is
        set). at: the token's position in its sequence (its random draw is keyed by it); None:
        the next of this sampler's own draws."""
        logits = np.asarray(logits, dtype=np.float32)
        c = self.constraint
        if c is not None:
            c.sync(c.end if at is None else at, history)
        if at is None:
            at, self._drawn = -1 - self._drawn, self._drawn + 1  # (apart from any position)
        tok = self._pick(logits, history, at)
        if c is not None:
            c.accept(tok)
        k = self.params.logprobs
        if k is None:
            return tok
        logp = log_softmax(logits)  # [V]
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            ids = _top_ids(logp, min(k, logp.shape[0]))
            top = tuple((int(i), float(logp[i])) for i in ids)
        return Token(tok, float(logp[tok]), top)

    def verify(
        self, rows: np.ndarray, draft: Sequence[int], history: Sequence[int], at: int
    ) -> list[int]:
        """Speculative decoding's check: rows [len(draft) + 1, V] are the logits after the token
        at position at - 1 and after each drafted id. Samples at each row in turn (the token at
        position at + i), keeping the drafts the samples agree with; ends with the first sample
        that differs, or the one after the last draft. Each token is sampled exactly as without
        drafts (same logits, history and draw), so the output is the same tokens: drafts that
        are single ids (n-grams, a greedy draft model) leave the distribution as it was."""
        out: list[int] = []
        hist = list(history)
        for i, row in enumerate(rows):
            tok = self.sample(row, hist, at + i)
            out.append(tok)
            if i >= len(draft) or int(tok) != draft[i]:
                break
            hist.append(int(tok))
        return out

    def _pick(self, logits: np.ndarray, history: Sequence[int], at: int) -> int:
        p = self.params
        logits = self.penalize(logits, history)
        if self.constraint is not None:
            logits = self.constraint.apply(logits)
        if p.greedy:
            return int(logits.argmax())  # the first maximum
        k = p.top_k if 0 < p.top_k < logits.shape[0] else logits.shape[0]
        ids = _top_ids(logits, k)
        vals = logits[ids].astype(np.float64)
        probs = _softmax(vals)
        keep = vals.shape[0]
        if p.top_p < 1.0:  # smallest prefix whose mass reaches top_p
            cum = np.cumsum(probs)
            keep = min(keep, int(np.searchsorted(cum, p.top_p)) + 1)
        if p.min_p > 0.0:  # drop tokens below min_p × the top probability
            keep = min(keep, max(1, int((probs >= p.min_p * probs[0]).sum())))
        vals, ids = vals[:keep], ids[:keep]
        probs = _softmax(vals / p.temperature)
        cum = np.cumsum(probs)
        u = uniform_at(self.seed, at)
        pick = int(np.searchsorted(cum, u * cum[-1], side="right"))
        return int(ids[min(pick, keep - 1)])


def _top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties: the lower index first)."""
    if k >= x.shape[0]:
        return np.argsort(-x, kind="stable")
    part = np.argpartition(-x, k - 1)[:k]
    return part[np.lexsort((part, -x[part]))]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return np.asarray(e / e.sum())


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, computed in float64 and returned as float32."""
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return np.asarray(x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True)), np.float32)
