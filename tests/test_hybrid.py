"""Hybrid recurrent models (qwen35, qwen35moe, qwen3next) end to end: a stage keeps a Gated
DeltaNet layer's state per sequence beside its attention layers' KV, sequences of different
lengths batched together compute what each computes alone, a pool of real worker processes
gives one process's tokens whatever the split (a cut between a DeltaNet and an attention layer
included), a killed worker's layers are rebuilt by replay, and a rewind goes only where a
state was kept (its end, the checkpoint at a prompt's end, the states after each drafted token:
cached prefixes and speculative decoding) and is refused elsewhere, never computed from a wrong
state.

(The workers are separate OS processes on 127.0.0.1 standing in for separate machines.)
Logits against transformers are in tests/test_model_reference.py (its hybrid cases).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from potluck.engine.contract import Assignment
from potluck.engine.generate import Model, generate
from potluck.engine.scheduler import (
    Finished,
    QueueSink,
    Request,
    Scheduler,
    SchedulerConfig,
    TokenEvent,
)
from potluck.engine.spec import SpecConfig
from potluck.model.archs import hparams_from_metadata
from potluck.model.kv_cache import cache_bytes
from potluck.model.stage import SeqChunk, Stage
from potluck.modelfile.gguf_file import GGUFFile
from potluck.planner import footprint_from_gguf
from potluck.pool.build import load_model
from potluck.pool.failover import FailoverPipeline
from potluck.sampling import GREEDY, Sampler
from workers import Spawn
from workers import spawn_worker as spawn_worker

from ggufgen import write_tiny_model

PROMPT = [5, 70, 71, 72, 100, 3, 200, 150, 9, 33]
N = 16
ARCHS = ("qwen35", "qwen35moe", "qwen3next")
BIG = 1 << 30  # a prefix-cache budget nothing here reaches


def write_hybrid(directory: Path, arch: str, qtype: T = T.Q8_0, **shape: object) -> Path:
    """A 4-layer hybrid (DeltaNet layers 0-2, attention 3: the files' every-4th pattern) at the
    tiny models' scale; qwen35moe and qwen3next with 8 experts, 2 per token, and a shared one."""
    moe = (
        {"n_expert": 8, "n_ff_exp": 64, "n_ff_shexp": 64, "optional": True,
         "skip": ("gate_up_exps", "ssm_in")}
        if arch != "qwen35" else {}
    )  # fmt: skip
    kw = {"n_layer": 4, "head_dim": 32, "rope_dim": 8, "tied": False, **moe, **shape}
    return write_tiny_model(directory / f"{arch}.gguf", arch, None, qtype, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hybrid(tmp_path_factory.mktemp("hybrid"), "qwen35moe")


def _tokens(path: Path, **pool: object) -> list[int]:
    m = load_model(path, n_ctx=128, **pool)  # type: ignore[arg-type]
    try:
        return list(generate(m, PROMPT, N, Sampler(GREEDY)))
    finally:
        m.close()


def _stage(path: Path, n_ctx: int = 64) -> Stage:
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    return Stage(hp, f, 0, hp.n_layer, n_ctx, exact=True)


# -- a stage ---------------------------------------------------------------------------------------
def test_a_stage_holds_state_for_deltanet_layers_and_kv_for_attention(hybrid: Path) -> None:
    """Layers 0-2 keep a fixed state per sequence (no K/V rows), layer 3 K and V; the state's
    size does not grow with the sequence; dropping the sequence frees both."""
    stage = _stage(hybrid, n_ctx=512)
    hp = stage.hp
    stage(np.array(PROMPT), [SeqChunk(1, len(PROMPT))])
    cache = stage.caches[1]
    assert cache.attn_layers == [3] and list(cache.k) == [3]
    assert cache.state is not None and sorted(cache.state.conv) == [0, 1, 2]
    state = cache.state.nbytes()
    assert state == 3 * 4 * sum(hp.state_elements()) and cache.checkpoint is None
    # a checkpoint of it (SeqChunk.mark) doubles it, as the plan counts it
    stage(np.arange(300, 600) % hp.n_vocab, [SeqChunk(1, 300, mark=True)])  # KV past 256 rows
    assert cache.state.nbytes() == state and cache.capacity > 256
    assert cache.checkpoint is not None and hp.state_bytes(0, 4) == 2 * state
    row = hp.n_head_kv * (hp.head_dim + hp.head_dim_v)
    kv = cache_bytes(1, row, 512, stage.cache_type)
    assert stage.full_kv_bytes() == kv + 2 * state
    assert cache.nbytes() == cache_bytes(1, row, cache.capacity, stage.cache_type) + 2 * state
    stage.drop(1)
    assert stage.caches == {}


def test_a_recurrent_state_is_never_rewound_into_a_wrong_one(hybrid: Path) -> None:
    """A chunk that starts before the sequence's end (a rewind) or copies part of another
    sequence is refused with the reason; back to position 0 is a fresh state (the same logits
    as a new sequence), and a copy of a whole sequence goes on as that sequence does."""
    stage = _stage(hybrid)
    a, b = np.array(PROMPT), np.array([40, 41, 42])
    stage(a, [SeqChunk(1, len(a))])
    with pytest.raises(
        ValueError, match="cannot rewind a recurrent state from 10 to 4: it holds only its last"
    ):
        stage(b, [SeqChunk(1, 3, pos=4)])
    with pytest.raises(
        ValueError, match="cannot copy the first 4 positions of a recurrent state: it holds only"
    ):
        stage(b, [SeqChunk(2, 3, pos=4, fork=1)])
    whole = stage(b, [SeqChunk(3, 3, pos=len(a), fork=1)])  # a copy of all 10 positions
    assert np.array_equal(whole, stage(b, [SeqChunk(1, 3)]))
    again = stage(a, [SeqChunk(1, len(a), pos=0)])  # position 0: a fresh state
    assert np.array_equal(again, stage(a, [SeqChunk(4, len(a))]))


def test_a_marked_position_is_a_checkpoint_to_go_back_to(hybrid: Path) -> None:
    """A chunk marked (the end of a prompt) leaves a copy of the state there: a rewind to it, or
    a fork of it, gives the logits of a sequence that read only that far; other positions are
    still refused, and the error names the checkpoint."""
    stage = _stage(hybrid)
    a, b, c = np.array(PROMPT), np.array([40, 41, 42]), np.array([50, 51])
    stage(a, [SeqChunk(1, len(a), mark=True)])
    went_on = stage(b, [SeqChunk(1, 3)])
    back = stage(c, [SeqChunk(1, 2, pos=len(a))])  # to the checkpoint
    fresh = _stage(hybrid)
    fresh(a, [SeqChunk(9, len(a))])
    assert np.array_equal(back, fresh(c, [SeqChunk(9, 2)]))
    forked = stage(b, [SeqChunk(2, 3, pos=len(a), fork=1)])
    assert np.array_equal(forked, went_on)
    with pytest.raises(ValueError, match="its checkpoint is at 10"):
        stage(b, [SeqChunk(1, 3, pos=5)])
    stage(a[:3], [SeqChunk(1, 3, pos=0)])  # before the checkpoint: it is gone
    with pytest.raises(ValueError, match="holds only its last position 3$"):
        stage(b, [SeqChunk(3, 3, pos=1, fork=1)])


def test_sequences_of_different_lengths_batched_compute_what_each_does_alone(
    hybrid: Path,
) -> None:
    """Four sequences (prompts of 3, 7, 10 and 5 tokens) decoded together step by step, one of
    them still reading its prompt in the same batch: each one's logits are its own alone (the
    batched matmuls round alike: within 1e-5 of the logits' range)."""
    prompts = [PROMPT[:3], PROMPT[:7], PROMPT, PROMPT[2:7]]
    steps = [[60 + 7 * s + k for k in range(4)] for s in range(4)]
    alone = []
    for p, more in zip(prompts, steps, strict=True):
        st = _stage(hybrid)
        rows = [st(np.array(p), [SeqChunk(0, len(p))])]
        rows += [st(np.array([t]), [SeqChunk(0, 1)]) for t in more]
        alone.append(np.concatenate(rows))
    st = _stage(hybrid)
    for s, p in enumerate(prompts[:3]):
        st(np.array(p), [SeqChunk(s, len(p))])
    got: list[list[np.ndarray]] = [[] for _ in prompts]  # per sequence: its rows after its prompt
    # step 0: sequences 0-2 decode their first id while sequence 3 reads its whole prompt
    ids = [steps[0][0], steps[1][0], steps[2][0], *prompts[3]]
    chunks = [SeqChunk(0, 1), SeqChunk(1, 1), SeqChunk(2, 1), SeqChunk(3, len(prompts[3]))]
    out = st(np.array(ids), chunks)
    for s in range(4):
        got[s].append(out[s])
    for k in range(1, 4):
        ids = [steps[s][k] for s in range(3)] + [steps[3][k - 1]]
        out = st(np.array(ids), [SeqChunk(s, 1) for s in range(4)])
        for s in range(4):
            got[s].append(out[s])
    span = max(float(np.abs(a).max()) for a in alone)
    for s in range(3):  # alone: its prompt's last row, then 4 decode steps
        np.testing.assert_allclose(np.stack(got[s]), alone[s][1:5], rtol=0, atol=1e-5 * span)
    # (sequence 3: its prompt's last row, then 3 decode steps)
    np.testing.assert_allclose(np.stack(got[3]), alone[3][:4], rtol=0, atol=1e-5 * span)


# -- pools -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_pool_equals_one_process(arch: str, spawn_worker: Spawn, tmp_path: Path) -> None:
    """Two workers cut between the last DeltaNet layer and the attention layer (the head holding
    none), and three workers (DeltaNet | DeltaNet | attention): one process's greedy tokens."""
    path = write_hybrid(tmp_path, arch)
    want = _tokens(path)
    a, b, c = (spawn_worker().address for _ in range(3))
    assert _tokens(path, assignments=[Assignment(a, 0, 3), Assignment(b, 3, 4)]) == want
    plan = [Assignment(a, 0, 1), Assignment(b, 1, 3), Assignment(c, 3, 4)]
    assert _tokens(path, assignments=plan) == want


def test_a_killed_worker_is_rebuilt_by_replay(spawn_worker: Spawn, hybrid: Path) -> None:
    """The worker holding the DeltaNet layers is killed mid-stream: its successor rebuilds their
    states from the sequence's tokens (a state cannot be sent back in time) and the answer goes
    on with the same greedy tokens."""
    want = _tokens(hybrid)
    workers = [spawn_worker(), spawn_worker()]
    plan = [Assignment(workers[0].address, 0, 3), Assignment(workers[1].address, 3, 4)]
    m = load_model(hybrid, n_ctx=128, assignments=plan, failover_s=2.0)
    try:
        pipe = m.pipeline
        assert isinstance(pipe, FailoverPipeline)
        got = []
        for i, tok in enumerate(generate(m, PROMPT, N, Sampler(GREEDY))):
            got.append(tok)
            if i == 5:
                workers[0].kill()
        assert got == want
        assert len(pipe.events) == 1 and pipe.events[0].gone == (workers[0].address,)
    finally:
        m.close()


# -- the scheduler: cached prefixes, drafts --------------------------------------------------------
def _answer(sched: Scheduler, prompt: list[int]) -> tuple[list[int], Finished]:
    sink = QueueSink()
    sched.submit(Request(tuple(prompt), GREEDY, 12, frozenset()), sink)
    evs = list(sink.events(timeout=120))
    fin = evs[-1]
    assert isinstance(fin, Finished), fin
    return [e.token for e in evs if isinstance(e, TokenEvent)], fin


def _turns(m: Model, budget: int) -> tuple[list[list[int]], list[Finished], Scheduler]:
    """Turn 2 extends all of turn 1 (its prompt and answer): a whole cached sequence to go on
    from. Turn 3 re-sends turn 2's prompt with another answer after it (as Qwen's templates
    re-render an answer without its reasoning): back to the checkpoint at turn 2's prompt end.
    Turn 4 shares less than that: a recurrent state cannot go back there."""
    sched = Scheduler(m, SchedulerConfig(cache_bytes=budget))
    out, fins = [], []
    try:
        first, fin = _answer(sched, PROMPT)
        again = [*PROMPT, *first, 80, 81, 82]
        second, fin2 = _answer(sched, again)
        assert second[0] != 99
        third, fin3 = _answer(sched, [*again, 99, 98])
        fourth, fin4 = _answer(sched, [*PROMPT, *first[:4], 90, 91])
        out, fins = [first, second, third, fourth], [fin, fin2, fin3, fin4]
    finally:
        sched.close()
    return out, fins, sched


@pytest.mark.parametrize("where", ["one process", "two workers"])
def test_a_cached_sequence_goes_on_from_its_end_or_its_checkpoint(
    hybrid: Path, where: str, spawn_worker: Spawn
) -> None:
    """With the prefix cache on, a turn that extends the whole previous sequence reuses it (but
    the answer's last id, never fed), one that re-sends the previous prompt with another answer
    goes back to the checkpoint at that prompt's end, one that shares less is a miss; the
    answers are those of a run without the cache (over two workers too: SeqChunk.mark)."""
    pool = {}
    if where == "two workers":
        a, b = spawn_worker().address, spawn_worker().address
        pool = {"assignments": [Assignment(a, 0, 3), Assignment(b, 3, 4)]}
    m = load_model(hybrid, n_ctx=128, **pool)  # type: ignore[arg-type]
    try:
        cached, fins, sched = _turns(m, BIG)
        plain, plain_fins, _ = _turns(m, 0)
        assert cached == plain
        assert fins[1].n_cached == len(PROMPT) + len(cached[0]) - 1
        assert fins[2].n_cached == len(PROMPT) + len(cached[0]) + 2  # (one before its end)
        assert fins[3].n_cached == 0
        assert sched.stats.prefix_hits == 2 and sched.stats.prefix_misses == 2
        assert all(f.n_cached == 0 for f in plain_fins)
    finally:
        m.close()


class _Knowing:
    """Drafts the answer a plain run gave, with every third drafted id wrong (after the first
    draft): drafted steps keep part of their drafts and rewind the rest, through the snapshots
    of the states after each drafted token."""

    def __init__(self, prompt: int, answer: list[int]) -> None:
        self.prompt, self.answer, self.calls = prompt, answer, 0

    def draft(self, seq_id: int, history: list[int], k: int) -> list[int]:
        at = len(history) - self.prompt
        out = self.answer[at : at + k]
        self.calls += 1
        if len(out) >= 3 and self.calls % 2:
            out[2] = (out[2] + 1) % 200
        return out

    def forget(self, seq_id: int) -> None:
        pass


def test_drafted_steps_rewind_through_the_states_after_each_token(hybrid: Path) -> None:
    """A drafted chunk keeps the recurrent states after each of its tokens: rewound to any of
    them, the sequence goes on exactly as one that only ever read that far."""
    a, d, more = np.array(PROMPT), np.array([40, 41, 42, 43, 44]), np.array([77, 78])
    stage = _stage(hybrid)
    stage(a, [SeqChunk(1, len(a), mark=True)])  # (a checkpoint to start each draft again from)
    for keep in range(len(a) + 1, len(a) + len(d) + 1):
        stage(d, [SeqChunk(1, len(d), pos=len(a), draft=tuple(d[1:]))], np.arange(len(d)))
        got = stage(more, [SeqChunk(1, 2, pos=keep)])
        fresh = _stage(hybrid)
        fresh(np.concatenate([a, d[: keep - len(a)]]), [SeqChunk(9, keep)])
        assert np.array_equal(got, fresh(more, [SeqChunk(9, 2)])), keep
    stage(d, [SeqChunk(1, len(d), pos=len(a), draft=tuple(d[1:]))], np.arange(len(d)))
    stage(more, [SeqChunk(1, 2, pos=len(a) + 2)])  # positions 12, 13: other ids than d's
    with pytest.raises(ValueError, match="holds only its last position 14"):
        stage(more, [SeqChunk(1, 2, pos=len(a) + 3)])  # (the state after d[2] is not 13's)
    stage(more, [SeqChunk(1, 2, pos=len(a) + 2)])  # (after d[1]: still this history's)


@pytest.mark.parametrize("where", ["one process", "two workers"])
def test_speculative_decoding_gives_the_same_tokens(
    hybrid: Path, where: str, spawn_worker: Spawn
) -> None:
    """Drafts partly kept, the rest rewound (on the last worker too: the snapshots are every
    stage's): the greedy tokens of decoding without drafts."""
    pool = {}
    if where == "two workers":
        a, b = spawn_worker().address, spawn_worker().address
        pool = {"assignments": [Assignment(a, 0, 2), Assignment(b, 2, 4)]}
    m = load_model(hybrid, n_ctx=128, **pool)  # type: ignore[arg-type]
    prompt = tuple(PROMPT)
    try:
        plain = Scheduler(m, SchedulerConfig())
        evs = list(plain.run_one(Request(prompt, GREEDY, 40, frozenset())))
        plain.close()
        want = [e.token for e in evs if isinstance(e, TokenEvent)]
        spec = SpecConfig("ngram-simple", n_max=4, min_rate=0.0)
        sched = Scheduler(m, SchedulerConfig(spec=spec), _Knowing(len(prompt), want))
        evs = list(sched.run_one(Request(prompt, GREEDY, 40, frozenset())))
        sched.close()
        assert [e.token for e in evs if isinstance(e, TokenEvent)] == want
        st = sched.stats
        assert st.draft_steps >= 2 and 0 < st.draft_kept < st.drafted, (st.drafted, st.draft_kept)
    finally:
        m.close()


def test_a_hybrid_draft_model_is_refused_with_the_reason(hybrid: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "run", "-m", str(hybrid), "-md", str(hybrid),
         "-n", "4", "--raw", "hello"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    line = " ".join(run.stderr.split())
    assert "a hybrid model (qwen35moe) cannot draft" in line, run.stderr


# -- memory ----------------------------------------------------------------------------------------
def test_the_planner_counts_state_per_sequence_and_kv_for_attention_only(hybrid: Path) -> None:
    """DeltaNet layers cost their fixed state per sequence (-np), whatever the context; the
    attention layer K and V for the context."""
    f = GGUFFile(hybrid)
    hp = hparams_from_metadata(f.metadata)
    state = 2 * 4 * sum(hp.state_elements())  # (a state and its checkpoint, f32)
    for n_ctx, n_seq in ((128, 1), (4096, 4)):
        fp = footprint_from_gguf(f.tensors, hp, n_ctx, n_seq=n_seq)
        kv = hp.kv_bytes_per_token(1) * n_ctx * n_seq
        assert fp.layer_kv_bytes == (state * n_seq,) * 3 + (kv,)
