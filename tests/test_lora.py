"""LoRA adapters (llama.cpp's GGUF format) applied in the ggml graph without merging.

The reference is the merged model: the same random F32 model written again with
W + s · B A added to each adapted matrix (numpy, in the test), computed by the plain graph. The
adapter path (two extra products per matrix, added before the bias) must give the same logits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from potluck.errors import ModelFileError, UnsupportedError
from potluck.model.archs import hparams_from_metadata
from potluck.model.stage import SeqChunk, Stage
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.lora import open_lora, parse_lora_arg, write_lora
from workers import Spawn
from workers import spawn_worker as spawn_worker

from ggufgen import write_tiny_model

RANK, ALPHA, SCALE = 4, 8.0, 0.7
IDS = np.array([1, 5, 9, 2, 7, 3, 11, 4, 6, 8, 10, 12], np.int32)


def _adapter(model: GGUFFile, targets: list[str], seed: int = 1, std: float = 0.2) -> dict:
    rng = np.random.default_rng(seed)
    pairs = {}
    for name in targets:
        n_out, n_in = model.tensors[name].shape
        a = rng.standard_normal((RANK, n_in)).astype(np.float32) * std
        b = rng.standard_normal((n_out, RANK)).astype(np.float32) * std
        pairs[name] = (a, b)
    return pairs


def _logits(path: Path, adapters=(), splits=((0, None),), exact=True) -> np.ndarray:
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata, str(path))
    x: np.ndarray = IDS
    for start, stop in splits:
        stage = Stage(hp, f, start, stop or hp.n_layer, 64, exact=exact, adapters=adapters)
        rows = np.arange(len(IDS)) if stage.is_last else None
        x = stage.forward(x, [SeqChunk(0, len(IDS))], rows)
        stage.close()
    return x


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_adapter_equals_the_merged_model(tmp_path: Path, arch: str) -> None:
    base = write_tiny_model(tmp_path / "base.gguf", arch, qtype=T.F32, tied=False)
    f = GGUFFile(base)
    targets = [f"blk.{i}.{m}.weight" for i in (0, 1) for m in ("attn_q", "attn_v", "attn_output",
               "ffn_gate", "ffn_down")] + ["output.weight"]  # fmt: skip
    pairs = _adapter(f, targets)
    write_lora(tmp_path / "a.gguf", arch, ALPHA, pairs)
    s = SCALE * ALPHA / RANK
    merged = write_tiny_model(tmp_path / "merged.gguf", arch, qtype=T.F32, tied=False,
                              add={n: s * b @ a for n, (a, b) in pairs.items()})  # fmt: skip
    adapter = open_lora(tmp_path / "a.gguf", arch, f.tensors, SCALE)
    got = _logits(base, [adapter])
    want = _logits(merged)
    plain = _logits(base)
    assert np.abs(want - plain).max() > 0.1  # the adapter changes the answer ...
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # ... as merging it would
    # any split of the layers gives the same logits (each stage holds its layers' adapter part)
    split = _logits(base, [adapter], splits=((0, 1), (1, None)))
    np.testing.assert_allclose(split, got, rtol=1e-5, atol=1e-5)


def test_two_adapters_add_up_and_scale_zero_is_the_base(tmp_path: Path) -> None:
    base = write_tiny_model(tmp_path / "base.gguf", "llama", qtype=T.Q8_0)
    f = GGUFFile(base)
    p1 = _adapter(f, ["blk.0.attn_q.weight", "blk.1.ffn_up.weight"], seed=1)
    p2 = _adapter(f, ["blk.0.attn_q.weight", "blk.0.ffn_down.weight"], seed=2)
    write_lora(tmp_path / "1.gguf", "llama", ALPHA, p1)
    write_lora(tmp_path / "2.gguf", "llama", 0.0, p2, dtype=np.float16)  # alpha 0: s = scale
    one = open_lora(tmp_path / "1.gguf", "llama", f.tensors, 0.0)
    np.testing.assert_array_equal(_logits(base, [one], exact=False), _logits(base, exact=False))
    both = [open_lora(tmp_path / n, "llama", f.tensors, 0.5) for n in ("1.gguf", "2.gguf")]
    assert both[1].factor("blk.0.attn_q.weight") == 0.5
    assert both[0].factor("blk.0.attn_q.weight") == 0.5 * ALPHA / RANK
    assert np.abs(_logits(base, both) - _logits(base)).max() > 0.01
    # split: the second stage holds none of adapter 2's matrices (it adapts blk.0 only)
    split = _logits(base, both, splits=((0, 1), (1, None)), exact=False)
    np.testing.assert_allclose(split, _logits(base, both, exact=False), rtol=1e-5, atol=1e-5)


def test_bad_adapters_are_refused_with_the_reason(tmp_path: Path) -> None:
    base = write_tiny_model(tmp_path / "base.gguf", "llama")
    f = GGUFFile(base)
    with pytest.raises(ModelFileError, match="is not a LoRA adapter"):
        open_lora(base, "llama", f.tensors)  # a model given as the adapter
    write_lora(tmp_path / "q.gguf", "qwen2", ALPHA, _adapter(f, ["blk.0.attn_q.weight"]))
    with pytest.raises(ModelFileError, match="adapts a qwen2 model, but the model is llama"):
        open_lora(tmp_path / "q.gguf", "llama", f.tensors)
    a, b = _adapter(f, ["blk.0.attn_q.weight"])["blk.0.attn_q.weight"]
    write_lora(tmp_path / "s.gguf", "llama", ALPHA, {"blk.0.attn_k.weight": (a, b)})  # k is 32×64
    with pytest.raises(ModelFileError, match=r"lora_b 32×4; they are 4×64 and 64×4"):
        open_lora(tmp_path / "s.gguf", "llama", f.tensors)
    write_lora(tmp_path / "n.gguf", "llama", ALPHA, {"blk.7.attn_q.weight": (a, b)})
    with pytest.raises(ModelFileError, match="blk.7.attn_q.weight, which the model has no"):
        open_lora(tmp_path / "n.gguf", "llama", f.tensors)
    e = _adapter(f, ["token_embd.weight"])
    write_lora(tmp_path / "e.gguf", "llama", ALPHA, e)
    emb = open_lora(tmp_path / "e.gguf", "llama", f.tensors)
    with pytest.raises(UnsupportedError, match="adapts token_embd.weight"):
        _logits(base, [emb])
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "q.gguf").read_bytes()[:-100])
    with pytest.raises(ModelFileError, match="truncated"):
        open_lora(tmp_path / "cut.gguf", "llama", f.tensors)


def test_parse_lora_arg() -> None:
    assert parse_lora_arg("a.gguf") == (Path("a.gguf"), 1.0)
    assert parse_lora_arg("a.gguf:0.5") == (Path("a.gguf"), 0.5)
    assert parse_lora_arg("C:/x/a.gguf") == (Path("C:/x/a.gguf"), 1.0)
    assert parse_lora_arg("dir:x/a.gguf") == (Path("dir:x/a.gguf"), 1.0)


def _run(model: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "potluck.cli", "run", "-m", str(model), "-n", "12", "--temp", "0",
         "--no-mdns", *extra, "The capital of France is"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


# a strong random adapter (0.2 N(0, 1), alpha 16) on SmolLM2: ffn_down of every third layer and
# the last layer's attn_q
STRONG = [f"blk.{i}.ffn_down.weight" for i in range(0, 30, 3)] + ["blk.29.attn_q.weight"]
Ran = subprocess.CompletedProcess
Strong = tuple[Path, Ran]  # the adapter, and `potluck run --lora` with it


@pytest.fixture(scope="module")
def plain(smollm2_path: Path) -> Ran:
    """`potluck run` without an adapter (each test compares with it: run once per module)."""
    r = _run(smollm2_path)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def strong(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Strong:
    """The strong adapter (STRONG) and `potluck run --lora` with it on this machine alone."""
    path = tmp_path_factory.mktemp("strong") / "a.gguf"
    f = GGUFFile(smollm2_path)
    write_lora(path, f.arch, 16.0, _adapter(f, STRONG))
    r = _run(smollm2_path, "--lora", str(path))
    assert r.returncode == 0, r.stderr
    return path, r


def test_run_with_lora_on_smollm2(smollm2_path: Path, plain: Ran, strong: Strong) -> None:
    """`potluck run --lora`: a strong random adapter changes the greedy text, scale 0 does not;
    a model passed as the adapter is a one-line error."""
    adapter, on = strong
    zero = _run(smollm2_path, "--lora", f"{adapter}:0")
    assert zero.returncode == 0, zero.stderr
    assert zero.stdout == plain.stdout
    assert on.stdout != plain.stdout and "a.gguf" in on.stderr
    bad = _run(smollm2_path, "--lora", str(smollm2_path))
    assert bad.returncode != 0 and "is not a LoRA adapter" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_serve_picks_the_adapter_per_request(
    smollm2_path: Path, plain: Ran, tmp_path: Path
) -> None:
    """`potluck serve --lora A.gguf`: /v1/models lists the base and BASE+A; a request alone
    answers as `potluck run` with and without the adapter; requests for either at once (in the
    same decode batches) each get their own: the base's rows give the base's tokens, the
    adapter's rows the adapter's, each until a near-tie of the request alone.
    The adapter is gentle (A, B ~ 0.05 N(0, 1), alpha 16; it still changes the answer): the
    adapter's products are f32 matmuls, which ggml sums in another order for one row (a dot
    product) than for several (tinyBLAS), ~1e-7 apart; a strong random adapter (0.2 N(0, 1))
    multiplied that ~50× per adapted layer, so that batched and alone rows parted by up to 0.2
    in logprob margins and which rows shared a step decided the text (EPYC Zen 3, AVX2,
    2026-12-03). The base's products (quantized: integer dot products) are bit-identical either
    way."""
    import re
    import threading

    import openai

    f = GGUFFile(smollm2_path)
    targets = [f"blk.{i}.ffn_down.weight" for i in range(0, 30, 3)]
    write_lora(tmp_path / "a.gguf", f.arch, 16.0, _adapter(f, targets, std=0.05))
    adapted = _run(smollm2_path, "--lora", str(tmp_path / "a.gguf"))
    assert adapted.returncode == 0 and plain.stdout != adapted.stdout
    proc = subprocess.Popen(
        [sys.executable, "-m", "potluck.cli", "serve", "-m", str(smollm2_path), "--port", "0",
         "--no-mdns", "-np", "4", "--lora", str(tmp_path / "a.gguf")],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        url = None
        for line in proc.stderr:
            if found := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line):
                url = found.group(1)
                break
        assert url, "the server did not start"
        threading.Thread(target=lambda: proc.stderr and proc.stderr.read(), daemon=True).start()
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        base = smollm2_path.stem
        assert [m.id for m in c.models.list().data] == [base, f"{base}+a"]
        got: dict[str, str] = {}
        toks: dict[str, list[str]] = {}
        margins: dict[str, list[float]] = {}

        def ask(model: str, key: str) -> None:
            r = c.chat.completions.create(
                model=model, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
                messages=[{"role": "user", "content": "The capital of France is"}],
            )  # fmt: skip
            got[key] = r.choices[0].message.content or ""
            content = r.choices[0].logprobs.content or []  # type: ignore[union-attr]
            toks[key] = [t.token for t in content]
            margins[key] = [t.top_logprobs[0].logprob - t.top_logprobs[1].logprob for t in content]

        ask(base, "plain")  # alone: one row per step, as `potluck run`
        ask(f"{base}+a", "a")
        asks = [("plain1", base), ("a1", f"{base}+a"), ("plain2", base), ("a2", f"{base}+a")]
        threads = [threading.Thread(target=ask, args=(m, k)) for k, m in asks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(
                model=f"{base}+b", messages=[{"role": "user", "content": "x"}]
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert got["plain"] == plain.stdout.strip()
    assert got["a"] == adapted.stdout.strip()
    for alone, together in [("plain", "plain1"), ("plain", "plain2"), ("a", "a1"), ("a", "a2")]:
        want, have = toks[alone], toks[together]
        first = next((i for i, (x, y) in enumerate(zip(want, have, strict=False)) if x != y), None)
        if first is None:
            assert len(want) == len(have), (want, have)
        else:  # they part at a near-tie of the request alone, and only there
            assert margins[alone][first] < 0.05, (together, first, want, have)
    assert toks["a"] != toks["plain"]  # the adapter's answer is its own (where it parts: by build)


def test_adapter_over_a_pool_equals_one_machine(
    spawn_worker: Spawn, smollm2_path: Path, plain: Ran, strong: Strong
) -> None:
    """`potluck run --lora` over two workers (this machine holding no layers): each node gets
    its layers' part of the adapter (LoadRequest.adapters) and the text is one machine's."""
    adapter, alone = strong
    assert alone.stdout != plain.stdout
    workers = [spawn_worker(), spawn_worker()]
    peers = [x for w in workers for x in ("--peer", w.address)]
    pooled = _run(smollm2_path, "--lora", str(adapter), "--mem", "0", *peers)
    for w in workers:
        w.kill()
    assert pooled.returncode == 0, pooled.stderr
    assert "→ 127.0.0.1:" in pooled.stderr  # it ran on the workers
    assert pooled.stdout == alone.stdout
