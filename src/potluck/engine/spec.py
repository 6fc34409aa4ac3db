"""Speculative decoding's drafts: ids the model is likely to produce next, checked in one pass.

A decode step normally feeds one id and gives one token. With a draft of k ids, the step feeds the
last token and the k drafts (SeqChunk.draft); the last stage samples after each of them and keeps
the drafts its own samples agree with (sampling.Sampler.verify), so one pass through the pool —
one crossing of every link — gives 1 to k + 1 tokens, those decoding without drafts gives (each
sampled from the same logits with the same draw; where ggml computes a step of several rows with
other kernels than a one-row step — repacked K-quants from 4 rows — the logits differ in the last
bits, and a near-tie may go the other way, as with a prompt's micro-batches).

Two drafters, as llama.cpp's `--spec-type`: `ngram-simple` (prompt lookup: the ids that followed
the last occurrence of the sequence's last few ids, free to compute; it pays where the answer
repeats its prompt: quoting, editing, code) and `draft-simple` (a small model with the same
vocabulary, run greedily on the head). The scheduler asks a `Drafter` for each decode step of a
sequence (engine/scheduler.py) and steps aside where drafting does not pay (many streams, low
acceptance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from potluck.errors import PotluckError
from potluck.model.stage import SeqChunk
from potluck.sampling import GREEDY, Sampler

if TYPE_CHECKING:
    from potluck.engine.generate import Model

SPEC_TYPES = ("none", "ngram-simple", "draft-simple")
DEFAULT_DRAFT_MAX = 8  # drafted ids per step at most (llama.cpp's --spec-draft-n-max)
NGRAM_SIZES = (3, 2)  # the n-grams prompt lookup matches, longest first


@dataclass(frozen=True)
class SpecConfig:
    """How a scheduler drafts. max_streams: drafting steps aside while more sequences decode at
    once (their rows already fill each step); min_rate: and for `probe` steps (then it tries
    again) when a sequence's drafts were kept less often than this after `probe` drafted ids, or
    its drafted steps gave fewer tokens per ms than plain steps (measured: on a CPU a step's
    rows can cost nearly as much as separate steps)."""

    kind: str = "none"
    n_max: int = DEFAULT_DRAFT_MAX
    max_streams: int = 2
    min_rate: float = 0.2
    probe: int = 32

    def __post_init__(self) -> None:
        if self.kind not in SPEC_TYPES:
            raise ValueError(f"--spec-type must be one of {', '.join(SPEC_TYPES)}, got {self.kind}")
        if self.n_max < 1:
            raise ValueError(f"--spec-draft-n-max must be at least 1, got {self.n_max}")

    @property
    def on(self) -> bool:
        return self.kind != "none"


NO_SPEC = SpecConfig()


def draft_refusal(name: str, arch: str) -> str:
    """Why a hybrid model (recurrent layers) cannot be a draft model: ModelDrafter rewinds its
    own sequence to wherever the target's text parted from its drafts, and a recurrent state
    keeps no such positions (a target's stages keep the states of its drafted steps)."""
    return (
        f"-md {name}: a hybrid model ({arch}) cannot draft: its recurrent (Gated DeltaNet) "
        "layers cannot be rewound to the positions a draft model goes back to; use a "
        "transformer draft model of the same vocabulary, or --spec-type ngram-simple"
    )


PAYOFF_STEPS = 4  # drafted steps measured before drafting is judged against plain steps
MAX_REST = 512  # the longest a sequence goes without drafts before it tries them again
DRAFT, PLAIN, REST = "draft", "plain", "rest"  # Pace.next's answers


@dataclass
class Pace:
    """Whether one sequence drafts its next step, from what its drafts gave: it rests (`probe`
    plain steps, doubling up to MAX_REST while drafting keeps not paying) after its drafts were
    kept less than `min_rate` of the time, or after its drafted steps gave fewer tokens per ms
    than plain steps do (on a CPU a step's rows can cost nearly as much as separate steps)."""

    drafted: int = 0  # ids drafted since it last rested, and how many were kept
    kept: int = 0
    rate: float = 0.0  # tokens per ms of its drafted steps (drafting included)
    steps: int = 0  # drafted steps measured for `rate`
    resting: int = 0  # plain steps left in its rest
    rest: int = 0  # the length of its next rest

    def next(self, spec: SpecConfig, plain_rate: float) -> str:
        """DRAFT, PLAIN, or REST (a rest begins); plain_rate: tokens per ms of plain steps."""
        if self.resting:
            self.resting -= 1
            return PLAIN
        seldom = self.drafted >= spec.probe and self.kept < spec.min_rate * self.drafted
        slower = self.steps >= PAYOFF_STEPS and self.rate < plain_rate
        if seldom or slower:
            self.drafted = self.kept = self.steps = 0
            self.rate = 0.0
            self.rest = min(MAX_REST, 2 * self.rest) if self.rest else spec.probe
            self.resting = self.rest
            return REST
        if self.steps >= PAYOFF_STEPS and not plain_rate:
            return PLAIN  # one plain step, to have something to judge the drafted ones against
        if self.steps >= PAYOFF_STEPS:
            self.rest = 0  # it pays: a later rest starts short again
        return DRAFT

    def took(self, drafted: int, kept: int, ms: float | None) -> None:
        """A drafted step came back: `kept` of its `drafted` ids kept, in `ms` (None: not
        timed alone)."""
        self.drafted += drafted
        self.kept += kept
        if ms:
            rate = (kept + 1) / ms
            self.rate = rate if not self.steps else self.rate + 0.3 * (rate - self.rate)
            self.steps += 1


class Drafter(Protocol):
    def draft(self, seq_id: int, history: Sequence[int], k: int) -> list[int]:
        """Up to k ids likely to follow `history` (the sequence's ids so far); [] for none."""
        ...

    def forget(self, seq_id: int) -> None:
        """The sequence ended: drop what was kept for it."""
        ...


class NgramDrafter:
    """Prompt lookup: the ids that followed the most recent earlier occurrence of the sequence's
    last n ids (n from NGRAM_SIZES, longest first). Keeps an index per sequence, extended as the
    sequence grows (rebuilt when a sequence id is reused for other ids: a cached prefix)."""

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES) -> None:
        self.sizes = tuple(sizes)
        # per sequence: its ids as indexed, and for each n-gram the position right after its
        # latest occurrence
        self._ids: dict[int, list[int]] = {}
        self._index: dict[int, dict[tuple[int, ...], int]] = {}

    def draft(self, seq_id: int, history: Sequence[int], k: int) -> list[int]:
        ids, index = self._indexed(seq_id, history)
        for n in self.sizes:
            if len(ids) <= n:
                continue
            # the latest occurrence that ends before the last id (the last n-gram itself is
            # indexed only after this lookup: see _indexed)
            after = index.get(tuple(ids[-n:]))
            if after is not None:
                return ids[after : after + k]
        return []

    def _indexed(
        self, seq_id: int, history: Sequence[int]
    ) -> tuple[list[int], dict[tuple[int, ...], int]]:
        ids = self._ids.get(seq_id)
        if ids is None or len(ids) > len(history) or ids != list(history[: len(ids)]):
            ids, self._index[seq_id] = [], {}
        index = self._index[seq_id]
        start = len(ids)
        ids.extend(int(t) for t in history[start:])
        self._ids[seq_id] = ids
        # every n-gram that ends before the last id, with the position after it
        for end in range(max(start, 1), len(ids)):
            for n in self.sizes:
                if end >= n:
                    index[tuple(ids[end - n : end])] = end
        return ids, index

    def forget(self, seq_id: int) -> None:
        self._ids.pop(seq_id, None)
        self._index.pop(seq_id, None)


class ModelDrafter:
    """A small model with the target's vocabulary, run greedily in this process: for each
    sequence it keeps a sequence of its own (the ids it was fed), rewound to what the target's
    history shares with it before each draft (SeqChunk.pos)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.pipeline = model.pipeline
        self._fed: dict[int, list[int]] = {}
        self._sampler = Sampler(GREEDY)

    def draft(self, seq_id: int, history: Sequence[int], k: int) -> list[int]:
        fed = self._fed.get(seq_id, [])
        keep = 0
        while keep < min(len(fed), len(history) - 1) and fed[keep] == history[keep]:
            keep += 1
        new = [int(t) for t in history[keep:]]
        if keep + len(new) + k > self.model.n_ctx:
            return []  # the draft model's context is full: no drafts from here on
        out: list[int] = []
        chunk = SeqChunk(seq_id, len(new), pos=keep)
        ids = np.array(new, np.int64)
        for _ in range(k):
            logits = self.pipeline.forward(ids, [chunk])
            tok = int(self._sampler.sample(logits[0], (), 0))
            out.append(tok)
            chunk, ids = SeqChunk(seq_id, 1), np.array([tok], np.int64)
        self._fed[seq_id] = [*history[:keep], *new, *out[:-1]]
        return out

    def forget(self, seq_id: int) -> None:
        if self._fed.pop(seq_id, None) is not None:
            self.pipeline.drop(seq_id)


def check_draft_vocab(target: Model, draft: Model) -> None:
    """A draft model must share the target's vocabulary (the same ids for the same tokens)."""
    a = target.file.metadata.get("tokenizer.ggml.tokens") or []
    b = draft.file.metadata.get("tokenizer.ggml.tokens") or []
    if len(a) != len(b) or a != b:
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        where = f"; they differ first at id {same} ({a[same]!r} vs {b[same]!r})" if same else ""
        raise PotluckError(
            f"the draft model {draft.path.name} has a vocabulary of {len(b)} tokens, the model "
            f"{target.path.name} one of {len(a)}{where}: a draft model must share its target's "
            "vocabulary (a smaller model of the same family), or use --spec-type ngram-simple"
        )
