"""`potluck finetune`: checkpoints that resume bit-for-bit, clear errors for unusable input, and
learning for real (made-up facts about a fictional town, asked again in other words)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from potluck.model.archs import hparams_from_metadata
from potluck.modelfile.chat import ChatTemplate
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.lora import open_lora
from potluck.modelfile.tokenizer import Tokenizer
from potluck.train.data import read_examples
from potluck.train.loop import CheckpointError, TrainConfig, Trainer, run

from ggufgen import write_tiny_model
from traindata import write_lines, write_rotations

pytest.importorskip("torch")
DATA = Path(__file__).parent / "data"


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "potluck.cli", *args], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _tiny(tmp_path: Path) -> tuple[Path, GGUFFile]:
    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", None, T.Q8_0)
    return path, GGUFFile(path)


def _trainer(path: Path, f: GGUFFile, data: Path, **kw) -> Trainer:
    hp = hparams_from_metadata(f.metadata)
    tok, chat = Tokenizer(f.metadata), ChatTemplate.from_metadata(f.metadata, hp.arch)
    examples, _ = read_examples(data, tok, chat, 64)
    return Trainer(hp, f, examples, TrainConfig(rank=4, lr=1e-2, epochs=2, batch=3, **kw))


def test_resume_continues_bit_for_bit(tmp_path: Path) -> None:
    path, f = _tiny(tmp_path)
    data = write_rotations(tmp_path / "d.jsonl")
    whole = _trainer(path, f, data, checkpoint_every=100)
    losses = []
    run(whole, tmp_path / "whole.gguf", lambda r: losses.append(r.loss))
    assert whole.step == whole.total == 8 and losses[-1] < losses[0]  # it learns
    part = _trainer(path, f, data, checkpoint_every=100)
    run(part, tmp_path / "part.gguf", stop_after=3)  # interrupted after step 3 (a checkpoint)
    assert not (tmp_path / "part.gguf").exists()
    again = _trainer(path, f, data, checkpoint_every=100)
    again.load(tmp_path / "part.gguf.ckpt")
    assert again.step == 3
    run(again, tmp_path / "part.gguf")
    assert not (tmp_path / "part.gguf.ckpt").exists()  # done: the checkpoint goes
    a = open_lora(tmp_path / "whole.gguf", "llama", f.tensors)
    b = open_lora(tmp_path / "part.gguf", "llama", f.tensors)
    assert a.pairs.keys() == b.pairs.keys() and len(a.pairs) == 2 * 7
    for name in a.pairs:
        for t in (name + ".lora_a", name + ".lora_b"):
            np.testing.assert_array_equal(a.file.raw(t), b.file.raw(t))
    # a checkpoint of another run is refused with what differs
    other = _trainer(path, f, data, checkpoint_every=100, seed=5)
    other.save(tmp_path / "other.ckpt")
    with pytest.raises(CheckpointError, match="another set of settings"):
        _trainer(path, f, data, checkpoint_every=100).load(tmp_path / "other.ckpt")


def test_chat_lines_learn_only_the_assistant(smollm2_path: Path, tmp_path: Path) -> None:
    f = GGUFFile(smollm2_path)
    hp = hparams_from_metadata(f.metadata)
    tok, chat = Tokenizer(f.metadata), ChatTemplate.from_metadata(f.metadata, hp.arch)
    data = write_lines(tmp_path / "c.jsonl", [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
                      {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Farewell."}]},
        "{broken", {"messages": [{"role": "user", "content": "only a question"}]}, {"other": 1},
    ])  # fmt: skip
    (ex,), skipped = read_examples(data, tok, chat, 512)
    learned = tok.decode([i for i, on in zip(ex.ids, ex.learn, strict=True) if on])
    assert learned == "Hello there.<|im_end|>\nFarewell.<|im_end|>\n"
    assert [line for line, _ in skipped] == [2, 3, 4]
    assert "not JSON" in skipped[0][1] and "no assistant message" in skipped[1][1]


def test_errors_are_one_line_with_the_numbers(smollm2_path: Path, tmp_path: Path) -> None:
    path, _ = _tiny(tmp_path)
    out = str(tmp_path / "a.gguf")
    empty = write_lines(tmp_path / "e.jsonl", ["{oops", {"messages": []}])
    r = _cli("finetune", "-m", str(path), "--data", str(empty), "-o", out)
    assert r.returncode != 0 and "has no usable line (2 skipped; line 1: not JSON" in r.stderr
    long = write_lines(tmp_path / "l.jsonl", [{"text": "alpha " * 300}])
    r = _cli("finetune", "-m", str(path), "--data", str(long), "-o", out, "--ctx", "64")
    assert r.returncode != 0 and "longer than the context (64): raise --ctx to" in r.stderr
    data = write_rotations(tmp_path / "d.jsonl")
    r = _cli("finetune", "-m", str(path), "--data", str(data), "-o", out, "--targets", "attn_qkv")
    assert r.returncode != 0 and "--targets attn_qkv: not a matrix" in r.stderr
    big = write_lines(tmp_path / "b.jsonl", [{"text": f"{i} " + "word " * 480} for i in range(64)])
    r = _cli(
        "finetune",
        "-m",
        str(smollm2_path),
        "--data",
        str(big),
        "-o",
        out,
        "--batch",
        "64",
        "--ctx",
        "512",
    )  # fmt: skip  (64 × 482 tokens of SmolLM2 at once: ~60 GiB)
    assert r.returncode != 0 and "GiB free: lower --batch" in r.stderr, r.stderr
    moe = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", None, T.Q8_0, n_expert=4)
    r = _cli("finetune", "-m", str(moe), "--data", str(data), "-o", out)
    assert (
        r.returncode != 0
        and "fine-tuning a mixture of experts (qwen3moe: 4 experts, 2 "
        "per token) is not supported yet"
        in r.stderr
    ), r.stderr
    assert "Traceback" not in r.stderr
    (tmp_path / "a.gguf.ckpt").write_bytes(b"x")
    r = _cli("finetune", "-m", str(path), "--data", str(data), "-o", out)
    assert r.returncode != 0 and "holds an unfinished run: --resume" in r.stderr
    assert "Traceback" not in r.stderr


def _questions() -> list[dict]:
    return [json.loads(x) for x in (DATA / "town_heldout.jsonl").read_text().splitlines()]


def _answers(model: Path, lora: Path | None, n: int = 40) -> tuple[int, list[str]]:
    """Greedy answers to the first n held-out questions: (how many name the fact, the answers)."""
    from potluck.engine.generate import generate
    from potluck.pool.build import load_model
    from potluck.sampling import GREEDY, Sampler

    m = load_model(model, 512, loras=[(lora, 1.0)] if lora else [])
    hits, said = 0, []
    for q in _questions()[:n]:
        prompt = m.tokenizer.encode(m.chat.render([{"role": "user", "content": q["question"]}]))
        ids = generate(m, prompt, 24, Sampler(GREEDY))
        text = m.tokenizer.decode([t for t in ids if t not in m.tokenizer.eot_ids])
        hits += q["key"].lower() in text.lower()
        said.append(text)
    m.close()
    return hits, said


@pytest.fixture(scope="module")
def town(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter trained on 40 made-up facts about a town (≈ 2.5 min: 25 steps of SmolLM2)."""
    out = tmp_path_factory.mktemp("town") / "town.gguf"
    r = _cli("finetune", "-m", str(smollm2_path), "--data", str(DATA / "town_train.jsonl"),
             "-o", str(out), "--epochs", "5", "--batch", "8", "--lr", "2e-3", "--rank", "16",
             "--alpha", "32", "--seed", "0")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "adapter written" in r.stderr
    return out


@pytest.mark.slow
def test_learns_made_up_facts(smollm2_path: Path, town: Path) -> None:
    """Asked again in other words (held out), SmolLM2 names the fact far more often with the
    adapter than without."""
    # the base model knows none of the facts (0 of 40 on a Zen 3): 12 questions show it
    before, _ = _answers(smollm2_path, None, n=12)
    after, said = _answers(smollm2_path, town)
    # here (Zen 3, 2 threads; 5 epochs at lr 2e-3): 0 of 40 before, 20 after (4 epochs: 17;
    # 8 epochs at lr 1e-3 on a Zen 4: 20)
    assert before <= 1 and after >= 12, (before, after, said)


LLAMA_BIN = Path(
    os.environ.get(
        "LLAMA_CPP_BIN", "/work/cache/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
    )
)  # fmt: skip


@pytest.mark.slow
def test_llama_cpp_applies_our_adapter(smollm2_path: Path, town: Path) -> None:
    """llama.cpp's own `llama-completion --lora` reads the adapter we write and answers as
    `potluck run --lora` does: greedy text equal until a near-tie (llama.cpp rounds activations
    to 8 bits for its quantized products; DESIGN.md), and as often right."""
    tool = LLAMA_BIN / "llama-completion"
    if not tool.exists():
        pytest.skip(
            f"no llama-completion in {LLAMA_BIN} (LLAMA_CPP_BIN; bench/README.md builds it)"
        )
    from potluck.model.stage import SeqChunk
    from potluck.pool.build import load_model

    _, ours = _answers(smollm2_path, town)
    m = load_model(smollm2_path, 512, loras=[(town, 1.0)])
    stage = m.pipeline.stages[0]
    equal, ties, theirs_hits, ours_hits = 0, 0, 0, 0
    for q, mine in zip(_questions(), ours, strict=True):
        prompt = m.chat.render([{"role": "user", "content": q["question"]}])
        r = subprocess.run(
            [str(tool), "-m", str(smollm2_path), "--lora", str(town), "-p", prompt, "-n", "24",
             "--temp", "0", "-no-cnv", "--no-display-prompt", "-t", "2"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        theirs = r.stdout.removeprefix("\n").split(" [end of text]")[0].rstrip("\n")
        theirs_hits += q["key"].lower() in theirs.lower()
        ours_hits += q["key"].lower() in mine.lower()
        if theirs == mine or theirs.startswith(mine) or mine.startswith(theirs):
            equal += 1
            continue
        # where they part: our top two next tokens there must be nearly tied
        cut = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
        ids = m.tokenizer.encode(prompt + mine[:cut])
        seq = m.new_seq_id()
        logits = stage.forward(np.array(ids), [SeqChunk(seq, len(ids))])[0].astype(np.float64)
        stage.drop(seq)
        logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        top2 = np.sort(logp)[-2:]
        assert top2[1] - top2[0] < 1.0, (q["question"], mine, theirs, top2)
        ties += 1
    m.close()
    assert equal >= 30, (equal, ties)  # here (Zen 4): 40 of 40 equal, 20 right on both
    assert theirs_hits >= ours_hits - 3, (theirs_hits, ours_hits)
