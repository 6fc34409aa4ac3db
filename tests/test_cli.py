"""The `potluck` command as a user runs it: real subprocesses, real model, real errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from potluck.engine.generate import generate
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler


def potluck(
    *args: str, stdin: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "potluck.cli", *args]
    return subprocess.run(
        cmd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_run_default_model_greedy_equals_engine(smollm2_path: Path) -> None:
    """No -m: the packaged default model; greedy output equals the engine's for the same prompt."""
    done = potluck("run", "-n", "24", "--temp", "0", "-t", "2", "What is the capital of France?")
    assert done.returncode == 0, done.stderr
    m = load_model(smollm2_path)
    ids = m.tokenizer.encode(
        m.chat.render([{"role": "user", "content": "What is the capital of France?"}])
    )
    out = [t for t in generate(m, ids, 24, Sampler(GREEDY)) if t not in m.tokenizer.eot_ids]
    assert done.stdout == m.tokenizer.decode(out) + "\n"
    # (what the text says is not checked: here SmolLM2 Q4_1 greedy answers "L'Étoile, la
    # Marseillaise, …", exactly as llama-completion does; the exact path opens with "The" —
    # a near-tie at the first token, 0.08 nats)
    assert "(llama) · Q4_1 ×210, Q8_0 ×1 · 30 layers" in done.stderr  # the one-line summary
    assert "generated" in done.stderr and "tok/s" in done.stderr


def test_run_raw_with_split(smollm2_path: Path) -> None:
    a = potluck(
        "run",
        "-m",
        str(smollm2_path),
        "--raw",
        "-n",
        "12",
        "--temp",
        "0",
        "The capital of France is",
    )
    b = potluck(
        "run",
        "-m",
        str(smollm2_path),
        "--raw",
        "-n",
        "12",
        "--temp",
        "0",
        "--split",
        "10,20",
        "The capital of France is",
    )
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


def test_seeded_sampling_is_reproducible(smollm2_path: Path) -> None:
    args = (
        "run",
        "-m",
        str(smollm2_path),
        "-n",
        "16",
        "--temp",
        "1.0",
        "--seed",
        "42",
        "Tell me a joke.",
    )
    a, b = potluck(*args), potluck(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout


def test_missing_model() -> None:
    done = potluck("run", "-m", "/nonexistent/model.gguf", "hi")
    assert done.returncode == 1
    assert "no model file or known model named '/nonexistent/model.gguf'" in done.stderr
    assert "Traceback" not in done.stderr


def test_foreign_file(tmp_path: Path) -> None:
    p = tmp_path / "notes.gguf"
    p.write_text("just some text\n" * 20)
    done = potluck("run", "-m", str(p), "hi")
    assert done.returncode == 1
    assert "not a GGUF file (starts with b'just', expected b'GGUF')" in done.stderr
    assert "Traceback" not in done.stderr


def test_context_too_long_for_model(smollm2_path: Path) -> None:
    done = potluck("run", "-m", str(smollm2_path), "-c", "100000", "hi")
    assert done.returncode == 1
    assert (
        "context 100000 is longer than the model was trained for (8192); use -c 8192 or less"
        in done.stderr
    )


def test_prompt_too_long_for_context(smollm2_path: Path) -> None:
    done = potluck("run", "-m", str(smollm2_path), "-c", "32", "--raw", "word " * 100)
    assert done.returncode == 1
    assert "but the context is 32; shorten the prompt or raise -c" in done.stderr


def test_tensor_split_without_workers_is_not_ignored(smollm2_path: Path) -> None:
    done = potluck("run", "-m", str(smollm2_path), "--no-mdns", "--tensor-split", "1,1", "hi")
    assert done.returncode == 1
    assert "--tensor-split 1,1 needs workers, and none was found" in done.stderr


def test_head_mem_0_without_workers_is_not_ignored(smollm2_path: Path) -> None:
    done = potluck("run", "-m", str(smollm2_path), "--no-mdns", "--mem", "0", "hi")
    assert done.returncode == 1
    assert "--mem 0 keeps every layer off this machine, and no worker was found" in done.stderr


def test_chat_session(smollm2_path: Path) -> None:
    done = potluck(
        "chat",
        "-m",
        str(smollm2_path),
        "--temp",
        "0",
        "-n",
        "20",
        stdin="What is 2+2?\n/reset\nSay hi.\n/exit\n",
    )
    assert done.returncode == 0, done.stderr
    answers = [line for line in done.stdout.split("> ") if line.strip()]
    assert len(answers) == 2, done.stdout


def test_models_lists_cache(smollm2_path: Path) -> None:
    done = potluck("models")
    assert done.returncode == 0, done.stderr
    assert "SmolLM2-135M-Instruct.Q4_1" in done.stdout and "potluck" in done.stdout


def test_models_finds_ollama_blobs(tmp_path: Path, smollm2_path: Path) -> None:
    """An Ollama store: a manifest naming a model-layer blob that is a GGUF file."""
    root = tmp_path / "ollama"
    blob = root / "blobs" / "sha256-abc123"
    blob.parent.mkdir(parents=True)
    blob.symlink_to(smollm2_path)
    man = root / "manifests" / "registry.ollama.ai" / "library" / "smol" / "135m"
    man.parent.mkdir(parents=True)
    man.write_text(
        '{"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:abc123"}]}'
    )
    env = {**os.environ, "OLLAMA_MODELS": str(root), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "models"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert "smol:135m" in done.stdout and "ollama" in done.stdout
    run = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "run", "-m", "smol:135m", "--raw", "-n", "4", "--temp", "0", "Hello"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr


def test_perplexity_command(tmp_path: Path, smollm2_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text(("The sun rises in the east and sets in the west. " * 30).strip())
    done = potluck("perplexity", "-m", str(smollm2_path), "-f", str(text), "-c", "64")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("perplexity: ") and "chunks of 64 tokens" in done.stdout
    ppl = float(done.stdout.split()[1])
    assert 1.0 < ppl < 3.0, ppl  # a sentence repeated 30 times is almost perfectly predictable


@pytest.mark.parametrize("args", [["run"], ["run", "--top-p", "0", "x"]])
def test_bad_arguments(args: list[str]) -> None:
    done = potluck(*args)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr


def test_run_with_a_json_schema_answers_valid_json(smollm2_path: Path) -> None:
    """llama.cpp's -j / --json-schema (and --grammar): the answer is constrained to the schema."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "stars": {"type": "integer"}},
        "required": ["city", "stars"],
        "additionalProperties": False,
    }
    done = potluck(
        "run", "-n", "60", "--temp", "0.7", "-s", "3", "-j", json.dumps(schema), "Rate Paris."
    )
    assert done.returncode == 0, done.stderr
    value = json.loads(done.stdout)
    assert set(value) == {"city", "stars"} and isinstance(value["stars"], int), done.stdout
    done = potluck("run", "-n", "8", "--temp", "0", "--grammar", 'root ::= "yes" | "no"', "Is it?")
    assert done.returncode == 0 and done.stdout.strip() in ("yes", "no"), done.stdout


def _said(done: subprocess.CompletedProcess) -> str:
    """stderr as one line: rich draws usage errors in a box and wraps them at its width."""
    return " ".join(done.stderr.replace("│", " ").split())


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["worker", "-p", "70000"], "port must be 1-65535 (or 0: any free one), got 70000"),
        (["worker", "--data-port", "70000"], "port must be 1-65535 (or 0: any free one), got"),
        (["serve", "--port", "-1"], "port must be 1-65535 (or 0: any free one), got -1"),
        (["run", "-t", "-1", "x"], "-t must be ≥ 1 (or 0 = all physical cores), got -1"),
        (["worker", "-t", "-2"], "-t must be ≥ 1 (or 0 = all physical cores), got -2"),
        (["run", "-b", "-3", "x"], "-b must be ≥ 1, got -3"),
        (["chat", "-b", "0"], "-b must be ≥ 1, got 0"),
        (["run", "-n", "-2", "x"], "-n must be ≥ 0 (or -1 = until the end of text or a full"),
        (["bench", "-p", "0"], "-p must be ≥ 1, got 0"),
        (["nodes", "--timeout", "0"], "--timeout must be > 0, got 0"),
        (["worker", "--mem", "0"], "--mem '0' is 0 bytes: give a size like 4G"),
        (["serve", "--failover-timeout", "-1"], "--failover-timeout must be 0 (off) or positive"),
        (["run", "--spec-type", "draft-simple", "x"], "draft-simple needs a draft model: -md"),
        (["chat", "--spec-type", "ngram-simple", "-md", "a.gguf"], "ngram-simple drafts without"),
        (["serve", "--spec-type", "eagle"], "--spec-type must be one of none, ngram-simple"),
        (["run", "--spec-draft-n-max", "0", "x"], "--spec-draft-n-max"),
        (["serve", "--cache-ram", "-1"], "--cache-ram"),
        (["run", "--grammar", "root ::= (", "x"], "--grammar: Failed to convert the grammar"),
        (["run", "-j", "{nope", "x"], "--json-schema is not JSON"),
        (["chat", "-j", '{"type": "foo"}', "--grammar", "root ::= x"], "both constrain the answer"),
    ],
)
def test_bad_numbers_say_so_in_one_line(args: list[str], says: str) -> None:
    """Checked before anything loads or listens: a usage error with the flag and the number."""
    done = potluck(*args, "--no-mdns", timeout=60)
    assert done.returncode == 2, done.stderr
    assert says in _said(done) and "Traceback" not in done.stderr, done.stderr


COUNT = ["--raw", "--temp", "0", "-c", "64", "Count: 1, 2, 3, 4, 5,"]  # 17 tokens, never ends


@pytest.mark.parametrize("n", ["200", "-1"])
def test_run_says_the_context_is_full(smollm2_path: Path, n: str) -> None:
    """-n 200 or -n -1 (until the end of text or a full context) in a context of 64: the same
    text, and one line on stderr says why it stopped."""
    done = potluck("run", "-m", str(smollm2_path), "-n", n, *COUNT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(" 6, 7, 8, 9, 10,"), done.stdout
    said = _said(done)
    assert "stopped after 47 tokens: the context of 64 tokens is full; raise -c" in said, said
    assert "prompt 17 tokens" in said and "generated 47 tokens" in said, said


def test_chat_says_the_conversation_fills_the_context(smollm2_path: Path) -> None:
    """The first answer fills the context: said when it stops; the next message is refused as
    the conversation's length (not the short message's), and /reset makes room again."""
    done = potluck(
        "chat", "-m", str(smollm2_path), "--temp", "0", "-c", "96",
        stdin="Count from 1 to 100.\nHi\n/reset\nSay hi.\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = _said(done)
    assert re.search(r"stopped after \d+ tokens: the context of 96 tokens is full; /reset", said)
    assert re.search(r"error: the conversation is \d+ tokens, the context 96: /reset to", said)
    assert "shorten the prompt" not in said, said
    assert said.count("generated") == 2, said  # the first answer and the one after /reset


def test_run_with_drafts_prints_the_same_text(smollm2_path: Path) -> None:
    """Prompt lookup on a text the answer repeats: the same greedy text, and the drafts kept."""
    text = "The keeper climbed the ninety steps, lit the lamp and watched the ships pass below."
    args = ["run", "-m", str(smollm2_path), "-n", "40", "--temp", "0", f"Repeat exactly: {text}"]
    plain = potluck(*args)
    drafted = potluck(*args, "--spec-type", "ngram-simple")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout
    kept = re.search(r"drafts kept (\d+) of (\d+)", drafted.stderr)
    assert kept is not None and int(kept.group(1)) > 0, drafted.stderr
