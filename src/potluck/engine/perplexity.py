"""Perplexity the way llama.cpp's llama-perplexity computes it, so figures are comparable.

The text is tokenized once and cut into chunks of n_ctx tokens (a trailing partial chunk is
dropped). With a BOS-using model the first token of each chunk is replaced by BOS. Each chunk is
evaluated from an empty cache, and only the second half of its positions is scored: the negative
log-likelihood of token j+1 given logits at j, for j in [n_ctx/2, n_ctx - 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from potluck.errors import ContextError
from potluck.model.stage import SeqChunk

from .generate import Model


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token
    n_chunks: int
    n_scored: int
    chunk_ppl: tuple[float, ...]  # running estimate after each chunk, as llama-perplexity prints


def perplexity(
    model: Model,
    text: str,
    n_ctx: int,
    n_batch: int = 512,
    on_chunk: Callable[[int, int, float], None] | None = None,
) -> PerplexityResult:
    if n_ctx < 8 or n_ctx > model.n_ctx:
        raise ContextError(
            f"perplexity context {n_ctx} must be in [8, {model.n_ctx}] (the loaded context)"
        )
    tok = model.tokenizer
    ids = tok.encode(text, add_bos=tok.add_bos, parse_special=False)
    n_chunks = len(ids) // n_ctx
    if n_chunks == 0:
        raise ContextError(
            f"the text is {len(ids)} tokens, fewer than one chunk of {n_ctx}; give more text or a smaller -c"
        )
    first = n_ctx // 2
    total_nll, count, running = 0.0, 0, []
    for c in range(n_chunks):
        chunk = list(ids[c * n_ctx : (c + 1) * n_ctx])
        if tok.add_bos and tok.bos_id is not None:
            chunk[0] = tok.bos_id
        seq = model.new_seq_id()
        try:
            rows_logits = []
            for i in range(0, n_ctx, n_batch):
                part = np.array(chunk[i : i + n_batch], np.int64)
                rows = np.arange(len(part))
                logits = model.pipeline.forward(part, [SeqChunk(seq, len(part))], rows)
                rows_logits.append(logits)
        finally:
            model.pipeline.drop(seq)
        logits = np.concatenate(rows_logits)[first : n_ctx - 1].astype(np.float64)  # [n, V]
        targets = np.array(chunk[first + 1 : n_ctx])
        m = logits.max(axis=1)
        log_z = m + np.log(np.exp(logits - m[:, None]).sum(axis=1))
        nll = log_z - logits[np.arange(len(targets)), targets]
        total_nll += float(nll.sum())
        count += len(targets)
        running.append(math.exp(total_nll / count))
        if on_chunk is not None:
            on_chunk(c + 1, n_chunks, running[-1])
    mean = total_nll / count
    return PerplexityResult(math.exp(mean), mean, n_chunks, count, tuple(running))
