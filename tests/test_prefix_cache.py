"""Cached prefixes on a real model: a stage rewinds and forks a sequence's KV, a chat whose turns
re-send their history computes only what is new, and the answers are those of a run without the
cache, in one process and over two real worker processes (whose stages rewind on the head's word,
SeqChunk.rewind on the wire). (The scheduler's logic against fakes: tests/unit/test_prefix_logic.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.generate import Model
from potluck.engine.scheduler import (
    Finished,
    QueueSink,
    Request,
    Scheduler,
    SchedulerConfig,
    TokenEvent,
)
from potluck.model.stage import SeqChunk
from potluck.pool.build import load_model
from potluck.sampling import GREEDY
from workers import Spawn, smollm2_pool
from workers import spawn_module_worker as spawn_module_worker

TURNS = [
    "Name three planets of the solar system.",
    "Which of them is the largest, and why?",
    "Now say the same in one short sentence.",
]
BIG = 1 << 30  # a prefix-cache budget nothing here reaches


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Model:
    return load_model(smollm2_path, n_ctx=512)


def test_a_stage_rewinds_and_forks_a_sequence(smol: Model) -> None:
    """Rewound to position 12 and fed 5 new ids, a sequence gives the logits of one that held
    those 12 and the same 5 ids (within rounding: its first 12 rows were computed in a batch of
    another size); a fork of its first 12 positions fed the same 5 gives them bit for bit."""
    (stage,) = smol.pipeline.stages
    a = np.arange(100, 120, dtype=np.int64)
    b = np.arange(300, 305, dtype=np.int64)
    stage(a, [SeqChunk(1, 20)])
    rewound = stage(b, [SeqChunk(1, 5, pos=12)])
    assert stage.position(1) == 17
    stage(a[:12], [SeqChunk(2, 12)])
    fresh = stage(b, [SeqChunk(2, 5)])
    np.testing.assert_allclose(rewound, fresh, rtol=0, atol=2e-2 * np.abs(fresh).max())
    assert rewound.argmax() == fresh.argmax()
    forked = stage(b, [SeqChunk(3, 5, pos=12, fork=1)])
    np.testing.assert_array_equal(forked, rewound)
    assert stage.position(3) == 17 and stage.position(1) == 17
    with pytest.raises(ValueError, match="positions between were never computed"):
        stage(b[:1], [SeqChunk(3, 1, pos=30)])
    with pytest.raises(ValueError, match="holds 0 here"):
        stage(b[:1], [SeqChunk(4, 1, pos=3, fork=99)])
    for seq in (1, 2, 3, 4):
        stage.drop(seq)


def _chat(sched: Scheduler, m: Model, turns: list[str]) -> list[tuple[list[int], Finished]]:
    """Each turn sends the whole conversation so far, as a chat UI does."""
    messages: list[dict[str, str]] = []
    out = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = m.tokenizer.encode(m.chat.render(messages))
        sink = QueueSink()
        sched.submit(Request(tuple(ids), GREEDY, 24, frozenset()), sink)
        evs = list(sink.events(timeout=300))
        toks = [e.token for e in evs if isinstance(e, TokenEvent)]
        fin = evs[-1]
        assert isinstance(fin, Finished), fin
        out.append((toks, fin))
        messages.append({"role": "assistant", "content": m.tokenizer.decode(toks)})
    return out


def _both(m: Model) -> tuple[list[tuple[list[int], Finished]], ...]:
    runs = []
    for budget in (BIG, 0):
        sched = Scheduler(m, SchedulerConfig(cache_bytes=budget))
        try:
            runs.append(_chat(sched, m, TURNS))
            assert sched.stats.prefix_hits == (len(TURNS) - 1 if budget else 0)
        finally:
            sched.close()
    return tuple(runs)


def test_a_chat_reuses_its_history_and_answers_the_same(smol: Model) -> None:
    cached, plain = _both(smol)
    assert [t for t, _ in cached] == [t for t, _ in plain]
    assert cached[0][1].n_cached == 0
    for (_, fin), (_, before) in zip(cached[1:], cached, strict=False):
        # everything the turn before held is reused: its prompt and answer but the answer's
        # last token (never fed) and what the template re-renders differently after it
        assert fin.n_cached >= before.n_prompt + before.n_generated - 8
        assert fin.n_cached < fin.n_prompt
    assert all(fin.n_cached == 0 for _, fin in plain)
    assert smol.pipeline.stages[0].caches == {}  # closing freed the cached sequences


@pytest.fixture(scope="module")
def pool(spawn_module_worker: Spawn, smollm2_path: Path) -> Iterator[Model]:
    with smollm2_pool(spawn_module_worker, smollm2_path) as m:
        yield m


def test_a_chat_over_two_workers_reuses_its_history(pool: Model, smol: Model) -> None:
    """The workers rewind the cached sequence to the shared prefix (a wire SeqChunk.rewind):
    the answers equal one process's without the cache."""
    cached, plain = _both(pool)
    want, _ = _both(smol)
    assert [t for t, _ in cached] == [t for t, _ in plain] == [t for t, _ in want]
    assert all(fin.n_cached > 0 for _, fin in cached[1:])


def test_a_new_request_in_a_cached_sequence_samples_with_its_own_settings(
    pool: Model, smol: Model
) -> None:
    """The second turn takes over the first's sequence on the workers; its last stage must
    sample with the second request's settings and seed, not keep the first's sampler."""
    from potluck.sampling import SamplingParams

    hot = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)

    def two_turns(m: Model, budget: int) -> list[int]:
        sched = Scheduler(m, SchedulerConfig(cache_bytes=budget))
        try:
            msgs = [{"role": "user", "content": TURNS[0]}]
            ids = m.tokenizer.encode(m.chat.render(msgs))
            first = [
                e.token
                for e in sched.run_one(Request(tuple(ids), GREEDY, 12, frozenset()))
                if isinstance(e, TokenEvent)
            ]
            msgs += [
                {"role": "assistant", "content": m.tokenizer.decode(first)},
                {"role": "user", "content": TURNS[1]},
            ]
            ids = m.tokenizer.encode(m.chat.render(msgs))
            evs = list(sched.run_one(Request(tuple(ids), hot, 16, frozenset())))
            assert isinstance(evs[-1], Finished)
            assert (evs[-1].n_cached > 0) == bool(budget)
            return [e.token for e in evs if isinstance(e, TokenEvent)]
        finally:
            sched.close()

    # (one process with the same cache computes the same floats: a seeded draw picks the same)
    want = two_turns(smol, BIG)
    assert two_turns(pool, BIG) == want
    assert two_turns(pool, 0)[:2] == want[:2]  # (without the cache: the same until rounding)


SYSTEM = (
    "You are the help desk of the Brindlemoor town library. Answer in one or two plain "
    "sentences, politely, and never invent opening hours, fees or the names of staff."
)
ASKS = ["Can I renew a book online?", "Do you lend board games?", "Is there a reading room?"]


def _asks(m: Model, budget: int) -> tuple[list[list[int]], Scheduler, int]:
    """The answers, the scheduler, and how many conversations it held cached at the end."""
    sched = Scheduler(m, SchedulerConfig(cache_bytes=budget))
    out = []
    try:
        for ask in ASKS:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]
            ids = m.tokenizer.encode(m.chat.render(msgs))
            evs = list(sched.run_one(Request(tuple(ids), GREEDY, 16, frozenset())))
            out.append([e.token for e in evs if isinstance(e, TokenEvent)])
        held = sched.stats.prefix_entries
    finally:
        sched.close()
    return out, sched, held


def test_requests_that_share_a_system_prompt_copy_it(smol: Model, pool: Model) -> None:
    """Each request after the first copies the system prompt's KV from the first conversation
    (a fork on every stage, workers included) and answers as without the cache."""
    want, _, _ = _asks(smol, 0)
    for m in (smol, pool):
        got, sched, held = _asks(m, BIG)
        assert got == want
        assert sched.stats.prefix_hits == len(ASKS) - 1
        assert sched.stats.cached_tokens >= (len(ASKS) - 1) * 30
        assert held == len(ASKS)  # copied, not taken over: every conversation stayed cached
