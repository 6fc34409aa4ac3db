"""engine/chain.py: follow-up steps made ordinary once their input is known, and a chain of them
run from this machine (submit_after) over a pipeline that computes at once."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from potluck.engine.chain import follow_inputs
from potluck.errors import NodeError
from potluck.model.stage import SeqChunk
from potluck.sampling import GREEDY, Sampler

from .fakes import FakePipeline, alone


def test_follow_inputs() -> None:
    chunks = [SeqChunk(1, 1), SeqChunk(2, 1)]
    tokens, hist = follow_inputs([7, 8], chunks, {1: [1, 2]}, frozenset({9}))
    assert tokens.tolist() == [7, 8] and tokens.dtype == np.int64
    assert hist == {1: [1, 2, 7], 2: [8]}
    assert follow_inputs([7, 9], chunks, {}, frozenset({9})) is None  # a stop id ends it
    assert follow_inputs([], chunks, {}, frozenset()) is None  # the step before gave nothing


def test_a_long_chain_submitted_ahead_runs_with_a_flat_stack() -> None:
    """1000 follow-up steps chained before the first token is known, over a pipeline that
    computes inside submit: each runs after the one before returns (a nested chain would raise
    RecursionError), and they give the tokens of plain decoding."""
    pipe = FakePipeline()
    prompt = (2, 7, 1, 8)
    samplers = {1: Sampler(GREEDY)}
    first: Future[list[int]] = Future()
    chain = [first]
    for _ in range(1000):
        chain.append(pipe.submit_next(chain[-1], [SeqChunk(1, 1)], samplers, {}))
    pipe.forward(np.array(prompt[:-1], np.int64), [SeqChunk(1, 3)])  # the prompt but its last id
    first.set_result([prompt[-1]])
    got = [f.result(timeout=5.0)[0] for f in chain[1:]]
    assert got == alone(prompt, 1000)


def test_a_chain_fails_with_the_step_it_follows() -> None:
    pipe = FakePipeline()
    first: Future[list[int]] = Future()
    second = pipe.submit_next(first, [SeqChunk(1, 1)], {1: Sampler(GREEDY)}, {})
    third = pipe.submit_next(second, [SeqChunk(1, 1)], {1: Sampler(GREEDY)}, {})
    first.set_exception(NodeError("node a:1 closed the stream"))
    with pytest.raises(NodeError, match="closed the stream"):
        third.result(timeout=5.0)
    assert pipe.sent == []
