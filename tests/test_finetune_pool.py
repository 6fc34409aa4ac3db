"""Data-parallel LoRA training over real worker processes (loopback): two workers sharing every
batch give the adapter of one process; a worker SIGKILLed mid-run costs nothing but time (its
share is computed by the head) and, started again, joins at the next checkpoint."""

from __future__ import annotations

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
from potluck.train.loop import TrainConfig, Trainer, run
from workers import Spawn
from workers import spawn_worker as spawn_worker

from ggufgen import write_tiny_model
from traindata import write_rotations

pytest.importorskip("torch")

CONFIG = TrainConfig(rank=4, lr=1e-2, epochs=3, batch=4, checkpoint_every=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("models")
    model = write_tiny_model(d / "tiny.gguf", "llama", None, T.Q8_0)
    data = write_rotations(d / "data.jsonl")
    return model, data


@pytest.fixture(scope="module")
def want(tiny, tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The adapter of one process alone (CONFIG): what every pooled run must give."""
    model, data = tiny
    f, hp, examples = _examples(model, data)
    out = tmp_path_factory.mktemp("alone") / "alone.gguf"
    run(Trainer(hp, f, examples, CONFIG), out)
    return _pairs(out, f)


def _examples(model: Path, data: Path):
    f = GGUFFile(model)
    hp = hparams_from_metadata(f.metadata)
    tok, chat = Tokenizer(f.metadata), ChatTemplate.from_metadata(f.metadata, hp.arch)
    return f, hp, read_examples(data, tok, chat, 64)[0]


def _pairs(path: Path, f: GGUFFile) -> dict[str, np.ndarray]:
    a = open_lora(path, "llama", f.tensors)
    return {
        t: np.array(a.file.raw(t)).view(np.float32)
        for name in a.pairs
        for t in (name + ".lora_a", name + ".lora_b")
    }


def _close(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(float(np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()) for k in want)


def test_two_workers_train_as_one_process(spawn_worker: Spawn, tiny, want, tmp_path: Path) -> None:
    model, data = tiny
    f = GGUFFile(model)
    workers = [spawn_worker("--model-dir", str(model.parent)) for _ in range(2)]
    r = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "finetune", "-m", str(model), "--data",
         str(data), "-o", str(tmp_path / "pool.gguf"), "--rank", "4", "--lr", "1e-2",
         "--epochs", "3", "--batch", "4", "--checkpoint-every", "2", "--mem", "0",
         "--no-mdns", *[x for w in workers for x in ("--peer", w.address)]],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    for w in workers:
        w.kill()
    assert r.returncode == 0, r.stderr
    assert "data parallel over 127.0.0.1:" in r.stderr and "this machine" not in r.stderr
    # the same sums in another order: float round-off, amplified a little by 9 AdamW steps
    err = _close(_pairs(tmp_path / "pool.gguf", f), want)
    assert err < 1e-4, f"the pool's adapter differs from one process's by {err:.2e}"


def test_a_worker_killed_and_back_costs_nothing(
    spawn_worker: Spawn, tiny, want, tmp_path: Path
) -> None:
    from potluck.train.pool import PoolTrainer
    from potluck.transport.client import NodeClient

    model, data = tiny
    f, hp, examples = _examples(model, data)
    a, b = (spawn_worker("--model-dir", str(model.parent)) for _ in range(2))
    addr_a, addr_b = a.address, b.address
    events: list[str] = []
    pool = PoolTrainer(
        hp, f, examples, CONFIG, (), [addr_a, addr_b], NodeClient, True, events.append
    )

    def on_step(r) -> None:
        if r.step == 2:  # b dies (SIGKILL) ...
            b.kill()
        if r.step == 4:  # ... and comes back on its port: it joins at the checkpoint after step 4
            again = spawn_worker("--model-dir", str(model.parent), port=b.port)
            assert again.address == addr_b

    pool.start()
    assert pool.alive == sorted([addr_a, addr_b])
    run(pool, tmp_path / "pool.gguf", on_step)
    assert any(e.startswith(f"{addr_b} left the training at step 2") for e in events), events
    assert f"{addr_b} joins again at step 4" in events, events
    assert pool.alive == sorted([addr_a, addr_b])  # both took part in the last steps
    err = _close(_pairs(tmp_path / "pool.gguf", f), want)
    assert err < 1e-4, f"the adapter differs from the fault-free one by {err:.2e}"


def test_a_worker_without_room_is_left_out_with_the_numbers(
    spawn_worker: Spawn, tiny, tmp_path: Path
) -> None:
    """A worker whose --mem cannot hold a step of its share says so, and the training goes on
    without it (here: on this machine alone)."""
    from potluck.train.pool import PoolTrainer
    from potluck.transport.client import NodeClient

    model, data = tiny
    f, hp, examples = _examples(model, data)
    small = spawn_worker("--model-dir", str(model.parent), "--mem", "1K")
    events: list[str] = []
    pool = PoolTrainer(
        hp, f, examples, CONFIG, (), [small.address], NodeClient, True, events.append
    )
    pool.start()
    run(pool, tmp_path / "a.gguf")
    small.kill()
    assert pool.alive == [] and (tmp_path / "a.gguf").exists()
    assert len(events) == 1 and "training step of this node's share needs about" in events[0]
    assert "GiB, it offers 0.0 GiB" in events[0], events


def test_a_worker_without_the_model_file_receives_it_once(
    spawn_worker: Spawn, tiny, want, tmp_path: Path
) -> None:
    """A worker with an empty cache (no model file): the head sends it the model's tensors
    (kept by hash), and it trains its share as one with the file would."""
    from potluck.train.pool import PoolTrainer
    from potluck.transport.client import NodeClient

    model, data = tiny
    f, hp, examples = _examples(model, data)
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    w = spawn_worker(env={"POTLUCK_CACHE": str(empty), "HOME": str(empty)})
    addr = w.address
    events: list[str] = []
    pool = PoolTrainer(hp, f, examples, CONFIG, (), [addr], NodeClient, False, events.append)
    pool.start()
    assert pool.alive == [addr], events
    run(pool, tmp_path / "pool.gguf")
    w.kill()
    assert len(events) == 1 and events[0].startswith(f"{addr} has no copy of the model: sending"), (
        events
    )
    assert any((empty / "blobs").iterdir())  # kept by hash, for the next time
    err = _close(_pairs(tmp_path / "pool.gguf", f), want)
    assert err < 1e-4, f"the adapter differs from one process's by {err:.2e}"
