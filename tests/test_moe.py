"""Mixtures of experts end to end: a pool of real worker processes gives one process's tokens
(all experts of a layer on one node, whatever the split), a worker without the file receives the
3-D expert stacks, the planner counts the experts a token reads, and the CLI shows an MoE as one.

(The workers are separate OS processes on 127.0.0.1 standing in for separate machines.)
Per-architecture logits against transformers are in tests/test_model_reference.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from potluck.engine.contract import Assignment
from potluck.engine.generate import generate
from potluck.model.archs import hparams_from_metadata
from potluck.model.archs.common import is_routed
from potluck.model.layout import stage_tensor_names
from potluck.modelfile.gguf_file import GGUFFile, layer_matrices
from potluck.planner import footprint_from_gguf
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler
from workers import Spawn
from workers import spawn_worker as spawn_worker

from ggufgen import write_tiny_model

PROMPT = [5, 70, 71, 72, 100, 3, 200, 150, 9, 33]
N = 16


def _write(directory: Path, arch: str) -> Path:
    """A 4-layer mixture of experts: 8 experts, 2 per token (gpt-oss: MXFP4 stacks with biases,
    sinks and a sliding window; llama: a Mixtral)."""
    qtypes = {"_exps": T.MXFP4} if arch == "gpt-oss" else {"ffn_down_exps": T.Q4_K}
    return write_tiny_model(
        directory / f"{arch}.gguf", arch, None, T.Q8_0, n_layer=4, n_embd=256, n_expert=8,
        n_ff_exp=256, qtypes=qtypes, tied=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("moe"), "qwen3moe")


def _tokens(path: Path, **pool: object) -> list[int]:
    m = load_model(path, n_ctx=128, **pool)  # type: ignore[arg-type]
    try:
        return list(generate(m, PROMPT, N, Sampler(GREEDY)))
    finally:
        m.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "llama"])
def test_pool_equals_one_process(arch: str, spawn_worker: Spawn, tmp_path: Path) -> None:
    """Splits over 2 and 3 workers (one of them without the file), the head holding a share or
    no layer at all: the same greedy tokens as one process."""
    moe = _write(tmp_path, arch)
    want = _tokens(moe)
    a, b = spawn_worker().address, spawn_worker().address
    assert _tokens(moe, peers=[a, b], tensor_split=[1, 1, 2]) == want
    bare = tmp_path / "bare"  # a worker with an empty cache: it is sent its layers' tensors
    c = spawn_worker(env={"POTLUCK_CACHE": str(bare), "HOME": str(bare)})
    plan = [Assignment(a, 0, 1), Assignment(c.address, 1, 3), Assignment(b, 3, 4)]
    assert _tokens(moe, assignments=plan) == want
    log = c.stop()
    f = GGUFFile(moe)  # only layers 1-2's tensors came over (qwen3moe: 12 each, 3 expert stacks)
    n = len(stage_tensor_names(f.tensors.values(), 4, 1, 3))
    assert n == sum(t.layer in (1, 2) for t in f.tensors.values())
    assert re.search(rf"layers 1–2: no local copy of the model; receiving {n} tensors", log), log


def test_a_token_reads_k_of_n_experts(moe: Path) -> None:
    """The planner's read bytes per layer: everything but the expert stacks, and 2 of 8 of
    those; memory counts all of them."""
    f = GGUFFile(moe)
    hp = hparams_from_metadata(f.metadata)
    fp = footprint_from_gguf(f.tensors, hp, n_ctx=64, attended=1)
    layer = [t for t in f.tensors.values() if t.layer == 1]
    experts = sum(t.nbytes for t in layer if is_routed(t.name))
    rest = sum(t.nbytes for t in layer) - experts
    assert experts > 4 * rest  # (what makes the difference matter)
    assert fp.layer_weight_bytes[1] == rest + experts
    kv = hp.kv_bytes_per_token(1)
    assert fp.layer_read_bytes[1] == rest + experts * 2 // 8 + kv
    # the speed probe streams what a token reads: 2 experts of each stack, as matrices
    probe = layer_matrices(f.tensors, 1, hp.n_expert_used)
    vectors = sum(t.nbytes for t in layer if len(t.shape) == 1)  # (norms: not probed)
    assert sum(m.nbytes for m in probe) == rest - vectors + experts * 2 // 8


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "potluck.cli", *args], capture_output=True, text=True,
        timeout=300, env={**os.environ, "COLUMNS": "300", **(env or {})},
    )  # fmt: skip


def test_plan_and_models_show_the_experts(moe: Path, tmp_path: Path) -> None:
    r = _cli("plan", "-m", str(moe), "--no-mdns")
    assert r.returncode == 0, r.stderr
    assert "qwen3moe, 4 layers," in r.stdout
    assert "active (mixture of 8 experts, 2 per token)" in r.stdout
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "moe.gguf").symlink_to(moe)
    r = _cli("models", env={"POTLUCK_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "active (mixture of 8 experts, 2 per token)" in r.stdout


def test_a_mixtral_of_the_old_layout_says_to_convert_it_again(tmp_path: Path) -> None:
    """Conversions before April 2024 wrote each expert as its own tensor (blk.0.ffn_gate.3.weight):
    refused with what to do, not a missing-tensor error."""
    import gguf
    import numpy as np

    from potluck.errors import UnsupportedError
    from potluck.model.stage import Stage

    stacked = GGUFFile(_write(tmp_path, "llama"))
    w = gguf.GGUFWriter(str(tmp_path / "old.gguf"), "llama")
    for key, value in stacked.metadata.items():
        if key != "general.architecture" and not key.startswith("GGUF."):
            _put(w, key, value)
    for name, info in stacked.tensors.items():
        raw = np.asarray(stacked.raw(name))
        if "_exps." in name:  # each expert of the stack as a tensor of its own
            for e in range(info.shape[0]):
                w.add_tensor(name.replace("_exps.", f".{e}."), np.ascontiguousarray(raw[e]),
                             raw_shape=raw[e].shape, raw_dtype=info.qtype)  # fmt: skip
        else:
            w.add_tensor(name, np.ascontiguousarray(raw), raw_shape=raw.shape, raw_dtype=info.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    old = GGUFFile(tmp_path / "old.gguf")
    with pytest.raises(UnsupportedError, match=r"each expert as a tensor of its own .* convert it"):
        Stage(hparams_from_metadata(old.metadata), old, 0, 4, 64)


def _put(w: object, key: str, value: object) -> None:
    from ggufgen import _add_value

    _add_value(w, key, value)  # type: ignore[arg-type]
