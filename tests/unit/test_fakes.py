"""The fakes stay true to what they stand for: FakePipeline has every member of the Pipeline
protocol, and its tokens depend on every id fed before them, in order."""

from __future__ import annotations

import numpy as np

from potluck.engine.contract import Pipeline
from potluck.model.stage import SeqChunk

from .fakes import FakePipeline, alone, next_token


def test_the_fake_pipeline_has_the_whole_contract() -> None:
    pipe = FakePipeline(["a:1"])
    members = {m for m in vars(Pipeline) if not m.startswith("_")}
    assert members and not [m for m in sorted(members) if not hasattr(pipe, m)]


def test_the_fake_models_tokens_follow_the_cache() -> None:
    assert next_token([1, 2, 3]) != next_token([2, 1, 3])  # order matters
    pipe = FakePipeline()
    pipe.forward(np.array([1, 2, 3, 4], np.int64), [SeqChunk(1, 2), SeqChunk(2, 2)])
    logits = pipe.forward(np.array([5, 6], np.int64), [SeqChunk(1, 1), SeqChunk(2, 1)])
    assert logits.argmax(axis=1).tolist() == [alone([1, 2, 5], 1)[0], alone([3, 4, 6], 1)[0]]
    pipe.drop(1)
    assert pipe.caches == {2: [3, 4, 6]}
