"""Chaining decode steps: a step whose input ids are the tokens of the step before it.

A follow-up step may be submitted before its input ids are known (Pipeline.submit_next); these
helpers make it an ordinary step once they are (`follow_inputs`), or run the whole chain from this
machine (`submit_after`) for a pipeline that cannot start it anywhere else. Pure future plumbing:
no model, no network.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from typing import Protocol

import numpy as np

from potluck.model.stage import SeqChunk
from potluck.sampling import Sampler


def submit_after(
    pipe: Submitter,
    prev: Future[list[int]],
    chunks: Sequence[SeqChunk],
    samplers: Mapping[int, Sampler],
    histories: Mapping[int, Sequence[int]],
    stop_ids: Collection[int],
) -> Future[list[int]]:
    """`submit_next` done from this machine: submit prev's tokens when they are here (a pipeline
    whose first stage runs in this process). [] when a token is in stop_ids.

    A pipeline whose submit computes at once (all stages here) finishes the step inside prev's
    callback, and that finish starts the next chained step: through `_soon`, each step runs
    after the one before it returns instead of inside it, so a chain of any length keeps the
    stack flat (it used to nest ≈ 8 frames per token: RecursionError ≈ 120 tokens after a pool
    fell back to this machine alone)."""
    out: Future[list[int]] = Future()

    def go(f: Future[list[int]]) -> None:
        try:
            inputs = follow_inputs(f.result(), chunks, histories, stop_ids)
            if inputs is None:
                out.set_result([])
                return
            nxt = pipe.submit(inputs[0], chunks, samplers, inputs[1])
        except BaseException as exc:  # the caller sees it from out.result()
            out.set_exception(exc)
            return
        nxt.add_done_callback(lambda g: _copy(g, out))

    prev.add_done_callback(lambda f: _soon(lambda: go(f)))
    return out


_trampoline = threading.local()


def _soon(fn: Callable[[], None]) -> None:
    """Run fn now, or, when this thread is already running one inside `_soon`, right after it."""
    queue: deque[Callable[[], None]] | None = getattr(_trampoline, "queue", None)
    if queue is not None:
        queue.append(fn)
        return
    _trampoline.queue = queue = deque([fn])
    first: BaseException | None = None
    try:
        while queue:
            try:
                queue.popleft()()
            except BaseException as exc:  # the others still run (their futures must resolve)
                first = first or exc
    finally:
        _trampoline.queue = None
    if first is not None:
        raise first


def follow_inputs(
    tokens: Sequence[int],
    chunks: Sequence[SeqChunk],
    histories: Mapping[int, Sequence[int]],
    stop_ids: Collection[int],
) -> tuple[np.ndarray, dict[int, list[int]]] | None:
    """A follow-up step made ordinary once the tokens of the step before it are known: its input
    ids and the histories with those ids added; None when the generation ended there (no token,
    or a stop id)."""
    if not tokens or any(t in stop_ids for t in tokens):
        return None
    hist = {
        c.seq_id: [*histories.get(c.seq_id, ()), int(t)]
        for c, t in zip(chunks, tokens, strict=True)
    }
    return np.array([int(t) for t in tokens], np.int64), hist


def _copy(src: Future[list[int]], dst: Future[list[int]]) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


class Submitter(Protocol):
    def submit(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> Future[list[int]]: ...
