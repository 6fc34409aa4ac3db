"""Speculative decoding on real models: prompt lookup on an extractive task and a draft model
(SmolLM2 drafting for itself: the one pair with the same vocabulary here) give the greedy tokens
of decoding without drafts, in one process and over two real worker processes (the last one
checks the drafts and answers with the kept ones: ForwardReply.runs). (The scheduler's logic
against fakes: tests/unit/test_spec_logic.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.generate import Model
from potluck.engine.scheduler import Finished, Request, Scheduler, SchedulerConfig, TokenEvent
from potluck.engine.spec import (
    Drafter,
    ModelDrafter,
    NgramDrafter,
    SpecConfig,
    check_draft_vocab,
)
from potluck.errors import PotluckError
from potluck.model.stage import SeqChunk
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, SamplingParams
from workers import Spawn, smollm2_pool
from workers import spawn_module_worker as spawn_module_worker

TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. "
    "Every evening the keeper climbed the ninety steps, lit the lamp, and watched the ships pass "
    "far below on the grey water."
)
N = 48


def _ids(m: Model) -> list[int]:
    msg = f"Repeat the following text exactly, word for word:\n\n{TEXT}"
    return m.tokenizer.encode(m.chat.render([{"role": "user", "content": msg}]))


def _decode(
    m: Model,
    spec: SpecConfig,
    drafter: Drafter | None,
    params: SamplingParams = GREEDY,
) -> tuple[list[int], Scheduler]:
    sched = Scheduler(m, SchedulerConfig(spec=spec), drafter)
    try:
        evs = list(sched.run_one(Request(tuple(_ids(m)), params, N, frozenset())))
    finally:
        sched.close()
    assert isinstance(evs[-1], Finished)
    return [e.token for e in evs if isinstance(e, TokenEvent)], sched


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Model:
    return load_model(smollm2_path, n_ctx=512)


@pytest.fixture(scope="module")
def plain(smol: Model) -> list[int]:
    toks, _ = _decode(smol, SpecConfig(), None)
    return toks


def test_prompt_lookup_gives_the_same_tokens_in_fewer_steps(smol: Model, plain: list[int]) -> None:
    got, sched = _decode(smol, SpecConfig("ngram-simple"), NgramDrafter())
    assert got == plain
    st = sched.stats
    # the answer repeats the prompt: most drafts are kept, and steps are far fewer than tokens
    assert st.draft_kept > N / 2 and st.draft_steps < N / 2


def _until_a_near_tie(m: Model, want: list[int], got: list[int], gap: float = 0.1) -> None:
    """`got` is `want`, or parts from it where the two tokens' logits after the common part are
    within `gap` (a near-tie that other kernels' rounding may flip: DESIGN.md)."""
    i = next((k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    if i is None:
        assert len(got) == len(want)
        return
    ids = [*_ids(m), *want[:i]]
    seq = m.new_seq_id()
    logits = m.pipeline.forward(np.array(ids, np.int64), [SeqChunk(seq, len(ids))])[0]
    m.pipeline.drop(seq)
    assert abs(float(logits[want[i]]) - float(logits[got[i]])) < gap, (i, want[i], got[i])


def test_prompt_lookup_on_gemma3(gemma3_path: Path) -> None:
    """A K-quant model whose matrices ggml repacks: a checked step of 4 rows or more computes
    through ggml's gemm kernels, which round otherwise than a one-row step; the tokens are
    those of decoding without drafts until a near-tie, if any."""
    m = load_model(gemma3_path, n_ctx=512)
    want, _ = _decode(m, SpecConfig(), None)
    got, sched = _decode(m, SpecConfig("ngram-simple"), NgramDrafter())
    _until_a_near_tie(m, want, got)
    assert sched.stats.draft_kept > 0


def test_a_draft_model_drafting_for_itself(
    smol: Model, smollm2_path: Path, plain: list[int]
) -> None:
    draft = load_model(smollm2_path, n_ctx=512)
    check_draft_vocab(smol, draft)
    got, sched = _decode(smol, SpecConfig("draft-simple", n_max=4), ModelDrafter(draft))
    assert got == plain
    st = sched.stats
    # the same model drafting greedily: nearly every draft is kept (a near-tie between a row
    # computed alone and in a checked batch may differ)
    assert st.draft_kept >= 0.9 * st.drafted and st.draft_steps <= N / 4 + 2
    assert draft.pipeline.stages[0].caches == {}  # its sequence went with the request


def test_a_draft_model_with_another_vocabulary_is_refused(smol: Model, gemma3_path: Path) -> None:
    other = load_model(gemma3_path, n_ctx=64)
    with pytest.raises(PotluckError, match="must share its target's vocabulary"):
        check_draft_vocab(smol, other)


def test_seeded_sampling_keeps_its_tokens_with_drafts(smol: Model) -> None:
    params = SamplingParams(temperature=0.7, seed=11)
    want, _ = _decode(smol, SpecConfig(), None, params)
    got, sched = _decode(smol, SpecConfig("ngram-simple"), NgramDrafter(), params)
    assert got == want and sched.stats.draft_kept > 0


@pytest.fixture(scope="module")
def pool(spawn_module_worker: Spawn, smollm2_path: Path) -> Iterator[Model]:
    with smollm2_pool(spawn_module_worker, smollm2_path) as m:
        yield m


def test_prompt_lookup_over_two_workers(pool: Model, plain: list[int]) -> None:
    got, sched = _decode(pool, SpecConfig("ngram-simple"), NgramDrafter())
    assert got == plain
    assert sched.stats.draft_kept > N / 2
