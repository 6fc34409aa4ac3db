"""Speculative decoding in the scheduler, against the fake pipeline: drafted ids are checked in
one step, the kept ones and one more come back, the stages are rewound past the rest, and the
tokens are exactly those of decoding without drafts — greedy and seeded sampling alike, with
batches in flight and across a failover. (With a real model and real workers:
tests/test_spec.py.)"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from potluck.engine.scheduler import Finished, Scheduler, SchedulerConfig
from potluck.engine.spec import NgramDrafter, SpecConfig
from potluck.errors import NodeError
from potluck.model.stage import SeqChunk
from potluck.pool.failover import FailoverPipeline
from potluck.sampling import GREEDY, Accepted, Sampler, SamplingParams, tokens_of

from .fakes import FakeModel, FakePipeline, Releaser, alone, logits_after
from .test_scheduler_logic import WAIT_S, request, run
from .test_scheduler_logic import tokens_of as event_tokens

PROMPT = (5, 6, 7, 8, 9, 10)


class Oracle:
    """Drafts the fake model's greedy continuation, with one id in `wrong_every` made wrong (a
    seeded choice): the checks must keep the right ones and nothing after a wrong one."""

    def __init__(self, wrong_every: int = 3, seed: int = 0) -> None:
        self.wrong_every, self.rng = wrong_every, random.Random(seed)
        self.asked: list[tuple[int, int]] = []  # (seq id, k)
        self.forgotten: list[int] = []

    def draft(self, seq_id: int, history: Sequence[int], k: int) -> list[int]:
        self.asked.append((seq_id, k))
        out = alone(history, k)
        for i in range(k):
            if self.rng.randrange(self.wrong_every) == 0:
                out[i] = (out[i] + 1) % 97
        return out

    def forget(self, seq_id: int) -> None:
        self.forgotten.append(seq_id)


@pytest.fixture
def made() -> Iterator[list[tuple[Scheduler, FakePipeline]]]:
    out: list[tuple[Scheduler, FakePipeline]] = []
    yield out
    for s, pipe in out:
        pipe.hold = False
        pipe.release()
        s.close(WAIT_S)
        assert pipe.caches == {} and pipe.misuse == []


def sched(made: list, pipe, drafter, n_max: int = 4, **config: int) -> Scheduler:
    spec = SpecConfig("ngram-simple", n_max=n_max, max_streams=config.pop("max_streams", 2))
    s = Scheduler(FakeModel(pipe, 256), SchedulerConfig(spec=spec, **config), drafter)
    if isinstance(pipe, FakePipeline):  # (a failover's test closes its own)
        made.append((s, pipe))
    return s


def test_kept_drafts_give_the_tokens_of_plain_decoding(made: list) -> None:
    pipe = FakePipeline()
    oracle = Oracle()
    s = sched(made, pipe, oracle)
    (evs,) = run(s, [request(PROMPT, 40)])
    assert event_tokens(evs) == alone(PROMPT, 40)
    assert evs[-1] == Finished("length", len(PROMPT), 40)
    drafted = [b for b in pipe.sent if any(c.draft for c in b.chunks)]
    assert drafted and all(b.chunks[0].n == 1 + len(b.chunks[0].draft) for b in drafted)
    st = s.stats
    assert 0 < st.draft_kept < st.drafted and st.draft_steps == len(drafted)
    # fewer steps than tokens, and every step after a partly kept draft rewound the stages
    assert len([b for b in pipe.sent if b.sampled]) < 40
    pos = [b.chunks[0].pos for b in drafted]
    assert pos == sorted(pos) and len(set(pos)) == len(pos)
    # never more tokens than asked: the last drafts are cut to what max_tokens leaves
    assert all(k <= 40 - 1 for _, k in oracle.asked)
    assert oracle.forgotten == [1]


def test_a_stop_id_inside_a_kept_run_ends_there(made: list) -> None:
    pipe = FakePipeline()
    s = sched(made, pipe, Oracle(wrong_every=1000))  # every draft right
    want = alone(PROMPT, 30)
    stop = want[9]
    (evs,) = run(s, [request(PROMPT, 30, stop_ids={stop})])
    assert event_tokens(evs) == want[: want.index(stop) + 1]
    assert isinstance(evs[-1], Finished) and evs[-1].reason == "stop"


def test_seeded_sampling_is_the_same_with_and_without_drafts(made: list) -> None:
    """A token's random draw depends only on its position: drafts the samples reject or keep
    leave every token where it was."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    plain = Scheduler(FakeModel(FakePipeline(), 256), SchedulerConfig())
    try:
        (want,) = run(plain, [request(PROMPT, 40, params=params)])
    finally:
        plain.close(WAIT_S)
    s = sched(made, FakePipeline(), Oracle(wrong_every=4))
    (got,) = run(s, [request(PROMPT, 40, params=params)])
    assert event_tokens(got) == event_tokens(want)
    assert event_tokens(want) != alone(PROMPT, 40)  # (sampled: not the greedy tokens)
    assert s.stats.draft_kept > 0


def test_drafting_steps_aside_for_many_streams_and_low_acceptance(made: list) -> None:
    pipe = FakePipeline()
    s = sched(made, pipe, Oracle(wrong_every=1), max_streams=2, max_rows=4)
    prompts = [tuple(range(k, k + 5)) for k in range(4)]
    got = run(s, [request(p, 12) for p in prompts])
    for p, evs in zip(prompts, got, strict=True):
        assert event_tokens(evs) == alone(p, 12)
    # four streams decoding at once: no drafts while more than two decode
    wide = [b for b in pipe.sent if len(b.chunks) > 2]
    assert wide and not any(c.draft for b in wide for c in b.chunks)
    # one stream whose drafts are always wrong: it stops drafting after `probe` ids
    pipe2 = FakePipeline()
    s2 = sched(made, pipe2, Oracle(wrong_every=1), n_max=4)
    (evs,) = run(s2, [request(PROMPT, 60)])
    assert event_tokens(evs) == alone(PROMPT, 60)
    steps = [bool(b.chunks[0].draft) for b in pipe2.sent if b.sampled]
    first = steps.index(True)
    after = steps[steps.index(False, first) :]  # once it stopped: 32 plain steps in a row
    assert after[:32] == [False] * 32 and s2.stats.draft_rests >= 1


def test_drafts_with_batches_in_flight(made: list) -> None:
    pipe = FakePipeline(depth=2, hold=True)
    s = sched(made, pipe, Oracle(seed=5), n_batch=3)
    rel = Releaser(pipe, seed=7)
    try:
        prompts = [PROMPT, (1, 2, 3, 4)]
        got = run(s, [request(p, 25) for p in prompts])
        for p, evs in zip(prompts, got, strict=True):
            assert event_tokens(evs) == alone(p, 25)
    finally:
        rel.stop()


def test_a_failover_in_the_middle_of_drafted_runs(made: list) -> None:
    """The pool fails between drafted steps of a seeded sampled stream: the new plan replays
    what the stages held (rejected drafts cut), and the stream goes on with the very tokens of a
    run without the fault."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    plain = Scheduler(FakeModel(FakePipeline(), 256), SchedulerConfig())
    try:
        (want,) = run(plain, [request(PROMPT, 40, params=params)])
    finally:
        plain.close(WAIT_S)
    first, second = FakePipeline(["a:1", "b:2"]), FakePipeline(["a:1"])
    n = {"steps": 0}

    def fail(sent) -> BaseException | None:
        n["steps"] += 1
        return NodeError("b:2 went away") if n["steps"] == 9 else None

    first.fail_if = fail
    fo = FailoverPipeline(first, lambda gone, epoch: second, 30.0)
    try:
        s = sched(made, fo, Oracle(wrong_every=3, seed=1))
        (got,) = run(s, [request(PROMPT, 40, params=params)])
        assert event_tokens(got) == event_tokens(want)
        assert fo.epoch == 1 and second.misuse == []
        s.close(WAIT_S)
        assert second.caches == {}
    finally:
        fo.close()


def test_verify_keeps_the_drafts_the_samples_agree_with() -> None:
    ids = [3, 1, 4]
    greedy = alone(ids, 4)
    rows = np.stack([logits_after([*ids, *greedy[:i]]) for i in range(4)])
    s = Sampler(GREEDY)
    assert s.verify(rows, greedy[:3], (), 3) == greedy[:4]  # all kept, and one more
    wrong = [greedy[0], (greedy[1] + 1) % 97, greedy[2]]
    assert s.verify(rows, wrong, (), 3) == greedy[:2]  # kept one, then the model's own
    assert tokens_of(Accepted([5, 6])) == (5, 6) and int(Accepted([5, 6])) == 6
    assert tokens_of(9) == (9,)
    with pytest.raises(ValueError):
        Accepted([])


def test_prompt_lookup_drafts_what_followed_the_last_ngram() -> None:
    d = NgramDrafter()
    assert d.draft(1, [7, 8, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert d.draft(1, [7, 8, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4], 8) == [5, 9, 1, 2, 3, 4]
    assert d.draft(1, [1, 2, 3, 4, 5], 4) == []  # nothing repeats
    assert d.draft(2, [5, 6, 1, 5, 6], 2) == [1, 5]  # a 2-gram
    d.forget(1)
    assert d.draft(1, [1, 2, 3, 1, 2], 2) == [3, 1]


def test_the_chunk_rows_a_stage_samples() -> None:
    from potluck.model.stage import sample_rows

    chunks = [SeqChunk(1, 3), SeqChunk(2, 4, draft=(5, 6, 7)), SeqChunk(3, 1)]
    assert sample_rows(chunks).tolist() == [2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError):
        sample_rows([SeqChunk(1, 2, draft=(1, 2))])


def test_follow_up_steps_leave_room_for_drafts(made: list) -> None:
    """Over a pool that chains follow-up steps (each sent before the token it follows is back),
    a sequence whose first steps find nothing to draft drafts later: while drafting, no
    follow-up is chained on a follow-up, so the step after one goes back to the drafter. The
    batches are released one at a time, as a slow link would: a chain then never ends."""
    import threading
    import time

    class Late(Oracle):
        def draft(self, seq_id: int, history: Sequence[int], k: int) -> list[int]:
            return [] if len(history) < len(PROMPT) + 2 else super().draft(seq_id, history, k)

    pipe = FakePipeline(["a:1", "b:2"], depth=2, chains=True, hold=True)
    s = sched(made, pipe, Late(wrong_every=1000))
    out: list = []
    t = threading.Thread(target=lambda: out.extend(run(s, [request(PROMPT, 30)])))
    t.start()
    deadline = time.monotonic() + WAIT_S
    while t.is_alive() and time.monotonic() < deadline:
        try:
            pipe.wait_held(1, timeout=0.05)
        except TimeoutError:
            continue
        time.sleep(0.01)  # (the scheduler settles: it may chain a follow-up meanwhile)
        pipe.release(1)
    t.join(WAIT_S)
    assert out and event_tokens(out[0]) == alone(PROMPT, 30)
    assert s.stats.follow_ups > 0 and s.stats.draft_kept > 10


def test_drafting_steps_aside_where_a_checked_step_costs_more_than_it_gives(made: list) -> None:
    """Every draft right, but a step of n rows costs n^1.5 of one (as on a CPU where a small
    quantized model's rows cost nearly as much as separate steps, or more): drafted steps give
    fewer tokens per ms than plain ones, and the sequence stops drafting a while."""
    import time

    class Costly(FakePipeline):
        def _run(self, job) -> None:  # type: ignore[no-untyped-def]
            time.sleep(0.002 * sum(c.n for c in job.sent.chunks) ** 1.5)
            super()._run(job)

    pipe = Costly()
    s = sched(made, pipe, Oracle(wrong_every=10**6), n_max=8)
    (evs,) = run(s, [request(PROMPT, 60)])
    assert event_tokens(evs) == alone(PROMPT, 60)
    assert s.stats.draft_rests >= 1
    steps = [bool(b.chunks[0].draft) for b in pipe.sent if b.sampled]
    assert steps[5:25] == [False] * 20  # resting: plain steps although every draft was right
