"""Embeddings: one vector per input, from a model's final hidden states (after `output_norm`: what
the output head would multiply, as transformers' `last_hidden_state`), pooled as the file says
and scaled to unit length (as OpenAI's and llama.cpp's servers answer).

Pooling is the file's `{arch}.pooling_type` (llama.cpp's enum, gguf's `PoolingType`): mean over
the input's tokens, CLS (the first token's state) or last (the last token's: Qwen3-Embedding);
a file without the key (a chat model) is pooled by mean. "none" (a state per token) and "rank"
(a reranker's score) make no embedding: `Embedder.refusal` says so.

An `Embedder` computes sequences of its own (ids from `Model.new_seq_id`) through the model's
pipeline (`Pipeline.forward(..., hidden=True)`: in this process, or over a pool, whose last stage
then answers the rows' hidden states instead of tokens), in forwards of at most `n_batch` tokens
and `MAX_SEQS` sequences (a long input goes in several, its cache carrying the context between
them: decoder attention is causal), and drops each sequence once pooled. A stage computes one
forward at a time (its lock), so embeddings of the chat model run beside the scheduler's thread
on the same stages, taking turns with it and never touching its sequences.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from gguf import Keys, PoolingType

from potluck.engine.generate import Model
from potluck.engine.requests import DEFAULT_N_BATCH
from potluck.errors import ModelFileError, UnsupportedError
from potluck.model.stage import SeqChunk

# sequences in one forward: each has its own KV cache (at least MIN_CAPACITY positions) and its
# own attention nodes in the graph, so many short inputs go in several forwards, not one
MAX_SEQS = 16
POOLINGS = {PoolingType.MEAN: "mean", PoolingType.CLS: "cls", PoolingType.LAST: "last"}


def pooling_of(model: Model) -> PoolingType:
    """The file's pooling (`{arch}.pooling_type`); a file without the key (a chat model): mean."""
    key = Keys.LLM.POOLING_TYPE.format(arch=model.hp.arch)
    value = model.file.metadata.get(key)
    if value is None:
        return PoolingType.MEAN
    try:
        return PoolingType(int(value))
    except (TypeError, ValueError):
        kinds = ", ".join(f"{p.value} {p.name.lower()}" for p in PoolingType)
        raise ModelFileError(
            f"{model.path.name}: {key} = {value!r} is not a pooling type ({kinds})"
        ) from None


def text_ids(model: Model, text: str) -> list[int]:
    """An input text's ids as llama.cpp tokenizes it for embeddings: BOS by the file's
    `add_bos_token` rule, and EOS after it where the file says `add_eos_token` (Qwen3-Embedding
    pools that last token)."""
    ids = model.tokenizer.encode(text)
    eos = model.tokenizer.eos_id
    adds_eos = bool(model.file.metadata.get(Keys.Tokenizer.ADD_EOS))
    if adds_eos and eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return ids


def unit(v: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    """v [..., D] scaled to unit L2 length along its last axis (a zero vector stays zero, as
    llama.cpp's)."""
    v = np.asarray(v, np.float64)
    norm = np.linalg.norm(v, axis=-1, keepdims=True)
    return (v / np.where(norm > 0, norm, 1.0)).astype(np.float32)


def shorten(vectors: npt.NDArray[np.float32], dims: int) -> npt.NDArray[np.float32]:
    """The first `dims` of each unit vector, scaled to unit length again (OpenAI's `dimensions`,
    the Matryoshka way its v3 models are trained for)."""
    if not 1 <= dims <= vectors.shape[-1]:
        raise ValueError(f"dimensions {dims} is outside [1, {vectors.shape[-1]}]")
    return vectors if dims == vectors.shape[-1] else unit(vectors[..., :dims])


@dataclass(eq=False)
class _Input:
    """One input on its way through: its own sequence, how many of its ids the stages hold, and
    its pooled state so far (mean: the sum of its rows)."""

    index: int
    ids: Sequence[int]
    seq_id: int
    fed: int = 0
    pooled: npt.NDArray[np.float64] | None = None


class Embedder:
    """Embeddings of one loaded model (the served chat model, or an embedding model beside it)."""

    def __init__(self, model: Model, n_batch: int = DEFAULT_N_BATCH) -> None:
        self.model, self.n_batch = model, max(1, n_batch)
        self._bad_file: str | None = None  # (a chat model is served whatever its pooling key)
        try:
            self.pooling = pooling_of(model)
        except ModelFileError as exc:
            self.pooling, self._bad_file = PoolingType.NONE, str(exc)
        self._lock = threading.Lock()  # one request's forwards at a time

    @property
    def n_embd(self) -> int:
        return self.model.hp.n_embd

    @property
    def refusal(self) -> str | None:
        """Why this model cannot make embeddings here (None: it can)."""
        if self._bad_file is not None:
            return self._bad_file
        if self.pooling not in POOLINGS:
            why = {
                PoolingType.NONE: "none (a state per token, no one vector per input)",
                PoolingType.RANK: "rank (a reranker: a score per query and document)",
            }[self.pooling]
            return f"{self.model.path.stem}'s pooling type is {why}: it cannot make embeddings"
        return None

    def embed(
        self, inputs: Sequence[Sequence[int]], lora: int | None = None
    ) -> npt.NDArray[np.float32]:
        """Unit vectors [len(inputs), n_embd], one per input of token ids (each 1..n_ctx ids
        inside the vocabulary: the caller's checks; a stage refuses other ids with ValueError).
        lora: which adapters apply (SeqChunk.lora). Raises UnsupportedError with `refusal`."""
        if self.refusal is not None:
            raise UnsupportedError(self.refusal)
        out = np.empty((len(inputs), self.n_embd), np.float32)
        with self._lock:
            todo = deque(_Input(i, ids, self.model.new_seq_id()) for i, ids in enumerate(inputs))
            try:
                while todo:
                    for item in self._step(todo, lora):
                        out[item.index] = self._vector(item)
                        self.model.pipeline.drop(item.seq_id)
                        todo.remove(item)
            finally:
                for item in todo:  # (a failed forward: free what the others hold)
                    self.model.pipeline.drop(item.seq_id)
        return out

    def _step(self, todo: deque[_Input], lora: int | None) -> list[_Input]:
        """One forward of the next pieces of the first inputs (at most n_batch ids, MAX_SEQS
        inputs, one piece each); the inputs it finished."""
        pieces: list[tuple[_Input, int, int]] = []  # (input, its first id here, end)
        room = self.n_batch
        for item in todo:
            if room == 0 or len(pieces) == MAX_SEQS:
                break
            a = item.fed
            b = min(len(item.ids), a + room)
            pieces.append((item, a, b))
            room -= b - a
        ids = np.concatenate([np.asarray(it.ids[a:b], np.int32) for it, a, b in pieces])
        chunks = [SeqChunk(it.seq_id, b - a, lora) for it, a, b in pieces]
        reads = [self._reads(it, a, b) for it, a, b in pieces]
        starts = np.cumsum([0] + [b - a for _, a, b in pieces])[:-1]
        rows = np.array([t0 + j for t0, r in zip(starts, reads, strict=True) for j in r], np.int32)
        hidden = self._forward(ids, chunks, rows)  # [len(rows), D]
        at = 0
        done: list[_Input] = []
        for (it, _, b), r in zip(pieces, reads, strict=True):
            if r:  # (its rows' sum: one row for CLS and last)
                part = hidden[at : at + len(r)].sum(axis=0, dtype=np.float64)
                it.pooled = part if it.pooled is None else it.pooled + part
                at += len(r)
            it.fed = b
            if b == len(it.ids):
                done.append(it)
        return done

    def _reads(self, item: _Input, a: int, b: int) -> range:
        """The rows of an input's ids [a, b) that its pooling reads (offsets in that piece)."""
        n = b - a
        if self.pooling == PoolingType.MEAN:
            return range(n)
        if self.pooling == PoolingType.CLS:
            return range(1 if a == 0 else 0)
        return range(n - 1, n) if b == len(item.ids) else range(0)  # last

    def _forward(
        self, ids: npt.NDArray[np.int32], chunks: list[SeqChunk], rows: npt.NDArray[np.int32]
    ) -> npt.NDArray[np.float32]:
        """The rows' final hidden states [R, D] (after the output norm)."""
        tokens = np.asarray(ids, np.int64)
        return self.model.pipeline.forward(tokens, chunks, rows, hidden=True)

    def _vector(self, item: _Input) -> npt.NDArray[np.float32]:
        assert item.pooled is not None
        pooled = item.pooled / len(item.ids) if self.pooling == PoolingType.MEAN else item.pooled
        return unit(pooled)
