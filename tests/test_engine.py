"""Generation, batching of several sequences, sampling and the context rules, on real models."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.chain import submit_after
from potluck.engine.generate import generate, layer_ranges
from potluck.errors import ContextError
from potluck.model.stage import SeqChunk
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler, SamplingParams

from ggufgen import write_tiny_model


@pytest.fixture(scope="module")
def smol(smollm2_path: Path):
    return load_model(smollm2_path, n_ctx=256)


def test_layer_ranges() -> None:
    assert layer_ranges(30, ()) == [(0, 30)]
    assert layer_ranges(30, (10, 20)) == [(0, 10), (10, 20), (20, 30)]
    with pytest.raises(ValueError, match="increase strictly"):
        layer_ranges(30, (20, 10))
    with pytest.raises(ValueError, match="increase strictly"):
        layer_ranges(30, (30,))


def test_batched_sequences_equal_one_at_a_time(smol) -> None:
    """Two sequences decoded in one forward call give what each gives alone (prefill and decode)."""
    tok = smol.tokenizer
    prompts = [
        tok.encode("The quick brown fox"),
        tok.encode("In 1969, the first people to walk on"),
    ]
    alone = [list(generate(smol, p, 10, Sampler(GREEDY))) for p in prompts]
    pipe = smol.pipeline
    seqs = [smol.new_seq_id(), smol.new_seq_id()]
    # prefill both prompts in one call (different lengths), then decode both together
    logits = pipe.forward(
        np.array(prompts[0] + prompts[1]),
        [SeqChunk(s, len(p)) for s, p in zip(seqs, prompts, strict=True)],
    )
    together: list[list[int]] = [[], []]
    for _ in range(10):
        nxt = [int(row.argmax()) for row in logits]
        for out, t in zip(together, nxt, strict=True):
            out.append(t)
        logits = pipe.forward(np.array(nxt), [SeqChunk(s, 1) for s in seqs])
    for s in seqs:
        pipe.drop(s)
    assert together == alone


def test_kv_cache_freed_after_generation(smol) -> None:
    gen = generate(smol, smol.tokenizer.encode("Hello there"), 50, Sampler(GREEDY))
    next(gen)
    assert len(smol.pipeline.stages[0].caches) == 1
    gen.close()  # a client that goes away
    assert smol.pipeline.stages[0].caches == {}


def test_prompt_longer_than_context(smol) -> None:
    ids = smol.tokenizer.encode("word " * 300)
    with pytest.raises(ContextError, match=rf"prompt is {len(ids)} tokens but the context is 256"):
        list(generate(smol, ids, 5, Sampler(GREEDY)))


def test_generation_stops_at_full_context(smol) -> None:
    ids = smol.tokenizer.encode("count: " + "1 2 3 " * 40)
    out = list(generate(smol, ids, 500, Sampler(GREEDY), stop_ids=frozenset()))
    assert len(ids) + len(out) == 256


def test_context_beyond_training(smollm2_path: Path) -> None:
    with pytest.raises(
        ContextError, match=r"context 9000 is longer than the model was trained for \(8192\)"
    ):
        load_model(smollm2_path, n_ctx=9000)


def test_seed_reproducible_and_different(smol) -> None:
    ids = smol.tokenizer.encode("Once upon a time")
    hot = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    a = list(generate(smol, ids, 20, Sampler(hot), stop_ids=frozenset()))
    b = list(generate(smol, ids, 20, Sampler(hot), stop_ids=frozenset()))
    c = list(
        generate(
            smol,
            ids,
            20,
            Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=8)),
            stop_ids=frozenset(),
        )
    )
    assert a == b
    assert a != c


def _draws(params: SamplingParams, logits: np.ndarray, n: int = 2000, history=()) -> Counter:
    s = Sampler(params)
    return Counter(s.sample(logits, history) for _ in range(n))


def test_sampling_filters() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    assert set(
        _draws(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=1), logits)
    ) == {0, 1}
    # top_p 0.8: tokens 0 and 1 reach 0.8
    assert set(
        _draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=1), logits)
    ) == {0, 1}
    # min_p 0.2: keep p >= 0.1 -> tokens 0, 1, 2
    assert set(
        _draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=1), logits)
    ) == {0, 1, 2}
    # temperature 1 reproduces the distribution (±4 sigma over 2000 draws)
    c = _draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3), logits)
    for i, p in enumerate([0.5, 0.3, 0.15, 0.05]):
        assert abs(c[i] / 2000 - p) < 4 * (p * (1 - p) / 2000) ** 0.5
    assert Sampler(GREEDY).sample(logits) == 0


def test_greedy_is_argmax() -> None:
    """Greedy picks the first maximum, also on a strided row and a wide vocabulary."""
    assert Sampler(GREEDY).sample(np.array([1.0, 3.0, 3.0, 2.0])) == 1
    g = np.random.default_rng(0)
    for v in (7, 49152, 262144):
        logits = g.standard_normal(v).astype(np.float32)
        assert Sampler(GREEDY).sample(logits) == int(np.argmax(logits))
    wide = g.standard_normal((3, 64)).astype(np.float32)
    wide[1, 10] = wide[1, 30] = 99.0
    assert Sampler(GREEDY).sample(wide[1, ::2]) == 5


def test_penalties() -> None:
    logits = np.array([2.0, 1.9, -1.0])
    greedy_pen = SamplingParams(temperature=0.0, repeat_penalty=1.2)
    assert Sampler(greedy_pen).sample(logits, history=[0]) == 1  # 2.0/1.2 < 1.9
    assert Sampler(GREEDY).sample(logits, history=[0]) == 0
    pen = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.1))
    assert np.allclose(
        pen.penalize(logits, [0, 0, 2]), np.array([2.0 - 0.5 - 0.2, 1.9, -1.0 - 0.5 - 0.1])
    )
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"repeat_penalty": 1.1},
        {"repeat_penalty": 0.9},
        {"presence_penalty": 0.5},
        {"frequency_penalty": -0.2},
        {"repeat_penalty": 1.0, "repeat_last_n": 0},
        {"temperature": 0.0, "repeat_penalty": 1.3, "seed": 3},
    ],
)
def test_penalizes_on_the_wire_agrees_with_the_parameters(kw: dict) -> None:
    """A first node decides from the message whether to add a follow-up step's token to the
    recent ids (transport/codec.penalizes); it must agree with what the last node's sampler does."""
    from potluck.transport.codec import penalizes, sampling_from_proto, sampling_to_proto

    params = SamplingParams(**kw)
    msg = sampling_to_proto(params, 7)
    assert penalizes(msg) == params.penalizes == sampling_from_proto(msg).penalizes
    msg.repeat_penalty = 0.0  # an unset field reads as 0: no repeat penalty
    assert penalizes(msg) == sampling_from_proto(msg).penalizes


def test_a_long_chain_of_follow_up_steps_keeps_the_stack_flat(tmp_path: Path) -> None:
    """`submit_after` on a pipeline that computes at once (every stage here, as after a failover
    that left this machine alone): steps chained on a future that is not done yet all run when it
    is, each after the one before returns. They used to nest (≈ 8 frames a token): a chain of 300
    ended in RecursionError. The tokens equal a plain loop's."""
    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_layer=2)
    m = load_model(path, n_ctx=512)
    pipe, sampler = m.pipeline, Sampler(GREEDY)
    prompt = [1, 2, 3]
    want = list(generate(m, prompt, 301, sampler))
    seq = m.new_seq_id()
    first = pipe.submit(np.array(prompt), [SeqChunk(seq, 3)], {seq: sampler}, {})
    root: Future[list[int]] = Future()  # the first token, known only once every step is chained
    steps, prev = [], root
    for _ in range(300):
        prev = submit_after(pipe, prev, [SeqChunk(seq, 1)], {seq: sampler}, {}, frozenset())
        steps.append(prev)
    root.set_result(first.result())
    got = [first.result()[0]] + [s.result(timeout=60)[0] for s in steps]
    pipe.drop(seq)
    assert got == want


def test_tiny_temperatures_are_greedy_and_bad_penalties_are_refused() -> None:
    """A temperature below GREEDY_BELOW divides logits past fp32's range (inf, then NaN, then a
    crash): it samples greedily instead. Penalties that would do the same, and NaN, are refused."""
    logits = np.array([0.5, 3.0, -1.0, 2.9])
    for t in (1e-45, 1e-6, 0.0, -1.0):
        assert Sampler(SamplingParams(temperature=t, seed=1)).sample(logits) == 1
    for bad in ({"repeat_penalty": 1e-9}, {"repeat_penalty": 1e9}, {"temperature": float("nan")}):
        with pytest.raises(ValueError, match="must be"):
            SamplingParams(**bad)


def test_cache_type_f32_holds_twice_the_bytes_and_agrees(tmp_path: Path) -> None:
    """--cache-type f32: K and V in f32 (twice f16's bytes); the logits stay close to the default
    cache's (with f16 K/V ggml's flash attention also rounds q to f16 and sums V·p in f16, as
    llama.cpp's: through two random layers ≈ 3 % of the logits' range at most)."""
    from potluck.model.archs import hparams_from_metadata
    from potluck.model.stage import Stage
    from potluck.modelfile.gguf_file import GGUFFile

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_layer=2)
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    ids = np.array([1, 2, 3, 4, 5])
    out = {}
    for ct in ("f16", "f32"):
        st = Stage(hp, f, 0, hp.n_layer, 64, cache_type=ct)
        out[ct] = st(ids, [SeqChunk(0, 5)], np.arange(5))
        out[ct + " bytes"] = st.cache(0).nbytes()
    assert out["f32 bytes"] == 2 * out["f16 bytes"]
    scale = float(np.abs(out["f32"]).max())
    assert float(np.abs(out["f32"] - out["f16"]).max()) < 6e-2 * scale
    assert not np.array_equal(out["f32"], out["f16"])  # the type is really used
    with pytest.raises(ValueError, match="cache type 'q4'"):
        Stage(hp, f, 0, hp.n_layer, 64, cache_type="q4")


def test_repacked_weights_compute_the_same(tmp_path: Path) -> None:
    """Q4_0 and Q4_K matrices go into ggml's CPU_REPACK layout where this CPU has one; the stage
    holds the same bytes, and its logits equal the in-place weights' within the kernels'
    rounding (the interleaved kernels sum the same products in another order)."""
    from gguf import GGMLQuantizationType as T

    from potluck.model.archs import hparams_from_metadata
    from potluck.model.stage import Stage
    from potluck.modelfile.gguf_file import GGUFFile

    for qtype in (T.Q4_0, T.Q4_K):
        path = write_tiny_model(
            tmp_path / f"{qtype.name}.gguf", "llama", None, qtype, n_layer=2, n_embd=256, n_ff=512
        )
        f = GGUFFile(path)
        hp = hparams_from_metadata(f.metadata)
        ids = np.array([1, 2, 3, 4, 5, 6, 7, 8])
        flat = Stage(hp, f, 0, hp.n_layer, 64, repack=False)
        packed = Stage(hp, f, 0, hp.n_layer, 64, repack=True)
        assert packed.weight_bytes() == flat.weight_bytes()
        if not packed.weights.repacked_bytes:
            pytest.skip("this CPU's ggml has no repacked layout for these types")
        a = flat(ids, [SeqChunk(0, 8)], np.arange(8))
        b = packed(ids, [SeqChunk(0, 8)], np.arange(8))
        assert float(np.abs(a - b).max()) < 2e-2 * float(np.abs(a).max()), qtype.name
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_running_a_model_imports_no_torch(tmp_path: Path) -> None:
    """Installing Potluck installs no PyTorch: loading a model, generating, the worker and the
    server's modules run without it (it is only the tests' reference)."""
    import subprocess
    import sys

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_layer=2)
    code = (
        "import sys\n"
        "from potluck.engine.generate import load_model, generate\n"
        "from potluck.sampling import Sampler, GREEDY\n"
        "import potluck.cli, potluck.node.worker, potluck.api.server, potluck.engine.scheduler\n"
        f"m = load_model({str(path)!r}, n_ctx=64)\n"
        "assert len(list(generate(m, [1, 2, 3], 4, Sampler(GREEDY)))) >= 1\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_prompt_is_cut_so_that_every_stage_of_a_pool_works() -> None:
    """Over a pool of d stages a prompt goes in 2 d micro-batches (every stage busy while the
    others work), never above -b and never under MIN_POOL_UBATCH tokens; one machine: -b."""
    from potluck.engine.generate import MIN_POOL_UBATCH, prompt_ubatch

    assert prompt_ubatch(512, 512, 1) == 512
    assert prompt_ubatch(512, 128, 2) == 128  # 4 micro-batches of 128
    assert prompt_ubatch(128, 128, 2) == 32  # 4 of 32, not one of 128 (no overlap at all)
    assert prompt_ubatch(300, 128, 3) == 50  # 6 of 50
    assert prompt_ubatch(40, 128, 2) == MIN_POOL_UBATCH  # short prompts: not below the floor
    assert prompt_ubatch(128, 16, 2) == 16  # the user's -b caps it
    for n in range(1, 600, 7):
        for depth in (2, 3, 4):
            ub = prompt_ubatch(n, 128, depth)
            assert 1 <= ub <= 128 and (ub >= MIN_POOL_UBATCH or ub == 128)
            assert -(-n // ub) >= min(2 * depth, -(-n // MIN_POOL_UBATCH))
