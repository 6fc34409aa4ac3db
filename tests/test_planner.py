"""The planner's memory model against real loaded stages and tiny model files (the plans it makes
on synthetic numbers are tests/unit/test_planner.py)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from potluck.errors import PotluckError
from potluck.model.archs import hparams_from_metadata
from potluck.model.stage import Stage
from potluck.modelfile.gguf_file import GGUFFile
from potluck.planner import (
    ModelFootprint,
    NodeInfo,
    NotEnoughMemoryError,
    PlanError,
    footprint_from_gguf,
    held_bytes,
    plan_pool,
)
from potluck.planner.cost import CostModel
from potluck.pool.build import load_model

from ggufgen import write_tiny_model

KiB, MiB, GiB = 2**10, 2**20, 2**30
GB = 1e9


# -- the memory model against what a loaded stage really holds --------------------------------


def held_by(stage: Stage) -> int:
    """The bytes of every ggml weight tensor the stage computes with, read off ggml itself."""
    from potluck.model.ggml_lib import lib
    from potluck.model.stage import stage_shapes

    names = {name for name, _ in stage_shapes(stage.hp, stage.src, stage.start, stage.stop)}
    return sum(lib.ggml_nbytes(stage.weights.tensor(n)) for n in names)


def planned_weights(fp: ModelFootprint, start: int, stop: int) -> int:
    first, last = start == 0, stop == fp.n_layer
    return (
        fp.weights(start, stop)
        + first * fp.embd_bytes
        + last * fp.head_bytes
        - fp.shared_bytes(start, stop)
    )


def check_stages(fp: ModelFootprint, stages: list[Stage]) -> None:
    for st in stages:
        want = planned_weights(fp, st.start, st.stop)
        assert held_by(st) == want, f"stage [{st.start}, {st.stop})"
        assert st.weight_bytes() == want  # mapped in place: exactly the tensors' bytes
        cache = st.cache(0)
        cache.reserve(fp.n_ctx)  # the KV cache at a full context
        assert cache.nbytes() == fp.kv(st.start, st.stop)
        st.drop(0)


def footprint_of(path: Path, n_ctx: int) -> ModelFootprint:
    f = GGUFFile(path)
    return footprint_from_gguf(f.tensors, hparams_from_metadata(f.metadata), n_ctx)


def test_footprint_matches_loaded_smollm2(smollm2_path: Path) -> None:
    model = load_model(smollm2_path, n_ctx=256, splits=(10,))
    fp = footprint_from_gguf(model.file.tensors, model.hp, 256, held=held_bytes)
    check_stages(fp, model.pipeline.stages)
    # split, each end maps token_embd (tied head): the file's bytes plus one more embedding
    whole = sum(s.weight_bytes() for s in model.pipeline.stages)
    assert whole == model.file.size_bytes - model.file.data_start + fp.embd_bytes - _padding(model)
    costs = CostModel(fp, [NodeInfo("a", "cpu", 8 * GiB, 4, 10 * GB)], {})
    assert costs.stage(0, 0, 10).weight_bytes == held_by(model.pipeline.stages[0])
    assert costs.stage(0, 10, 30).weight_bytes == held_by(model.pipeline.stages[1])


def test_footprint_matches_loaded_gemma3_first_layers(gemma3_path: Path) -> None:
    """Q4_K, Q5_0, Q6_K and Q8_0 layers and the Q8_0 embedding; fast."""
    f = GGUFFile(gemma3_path)
    hp = hparams_from_metadata(f.metadata)
    fp = footprint_from_gguf(f.tensors, hp, 256, held=held_bytes)
    check_stages(fp, [Stage(hp, f, 0, 3, 256)])


def test_a_decoded_token_reads_its_weights_and_the_kv_it_attends_to(gemma3_path: Path) -> None:
    """Per layer: the weights, plus K and V of the positions attended (at most the context, and
    on Gemma-3's sliding layers at most the window); the KV held stays the full context's."""
    f = GGUFFile(gemma3_path)
    hp = hparams_from_metadata(f.metadata)
    assert 0 < hp.sliding_window < 4096
    row = hp.n_head_kv * (hp.head_dim + hp.head_dim_v) * 2  # f16 K and V of one position
    weights = footprint_from_gguf(f.tensors, hp, 4096, held=held_bytes).layer_weight_bytes
    for attended, n_ctx in ((1, 4096), (700, 4096), (4000, 4096), (4000, 600)):
        fp = footprint_from_gguf(f.tensors, hp, n_ctx, held=held_bytes, attended=attended)
        seen = min(attended, n_ctx)
        for i, (read, w) in enumerate(zip(fp.layer_read_bytes, weights, strict=True)):
            kv = min(seen, hp.sliding_window) if hp.is_sliding(i) else seen
            assert read == w + kv * row, (attended, n_ctx, i)
        assert fp.layer_kv_bytes[0] == row * n_ctx
    assert any(hp.is_sliding(i) for i in range(hp.n_layer))
    assert not all(hp.is_sliding(i) for i in range(hp.n_layer))


@pytest.mark.slow
def test_footprint_matches_loaded_gemma3(gemma3_path: Path) -> None:
    model = load_model(gemma3_path, n_ctx=256, splits=(10,))
    check_stages(
        footprint_from_gguf(model.file.tensors, model.hp, 256, held=held_bytes),
        model.pipeline.stages,
    )


TINY = {
    "llama-Q4_0": dict(arch="llama", qtype=T.Q4_0, n_head=4, n_head_kv=1, head_dim=8, tied=False),
    "qwen3-Q4_K": dict(arch="qwen3", qtype=T.Q4_K, n_embd=256, n_ff=256, n_head=2, n_head_kv=1),
    # biases, F16 and an F32 matrix
    "qwen2-Q8_0": dict(arch="qwen2", qtype=T.Q8_0, qtypes={"ffn_down": T.F16, "attn_v": T.F32}),
    "gemma3-Q5_0": dict(arch="gemma3", qtype=T.Q5_0, tied=False),
}


@pytest.mark.parametrize("case", sorted(TINY))
def test_footprint_matches_tiny_models(case: str, tmp_path: Path) -> None:
    kw = dict(TINY[case])
    path = write_tiny_model(tmp_path / "m.gguf", kw.pop("arch"), None, n_layer=3, **kw)
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    fp = footprint_from_gguf(f.tensors, hp, 64, held=held_bytes)
    whole = [Stage(hp, f, 0, 3, 64)]  # first and last at once: raw embedding + head
    check_stages(fp, whole)
    split = [Stage(hp, f, 0, 1, 64), Stage(hp, f, 1, 2, 64), Stage(hp, f, 2, 3, 64)]
    check_stages(fp, split)


def _padding(model) -> int:
    """Alignment bytes between the file's tensors (data that no tensor owns)."""
    return (
        model.file.size_bytes
        - model.file.data_start
        - sum(t.nbytes for t in model.file.tensors.values())
    )


def test_planner_does_not_import_torch_or_ggml() -> None:
    code = (
        "import sys, potluck.planner; assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'ggml' not in sys.modules, 'ggml loaded'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def cpu(name: str, mem: int, speed: float = 10 * GB) -> NodeInfo:
    return NodeInfo(name, "cpu", mem, 4, speed)


def test_unsupported_quant_type_is_refused_at_plan_time(smollm2_path: Path) -> None:
    """`potluck plan` sizes every tensor with the kernels' own rule, which refuses a type the
    kernels cannot read: the user hears it before a pool loads (Q8_K put in by hand)."""
    f = GGUFFile(smollm2_path)
    hp = hparams_from_metadata(f.metadata)
    tensors = dict(f.tensors)
    name = "blk.0.ffn_down.weight"
    tensors[name] = replace(tensors[name], qtype=T.Q8_K)  # an activation format, not a weight type
    with pytest.raises(PotluckError, match=rf"tensor {name}: quantization Q8_K is not supported"):
        footprint_from_gguf(tensors, hp, 256, held=held_bytes)


def test_kv_is_counted_for_every_sequence_at_once(tmp_path: Path) -> None:
    """serve's -np: the footprint holds the KV of n_seq sequences at the full context, a plan
    that fits one sequence may not fit four, and the error names -np with the numbers."""
    f = GGUFFile(write_tiny_model(tmp_path / "m.gguf", "llama", None, n_layer=3))
    hp = hparams_from_metadata(f.metadata)
    one = footprint_from_gguf(f.tensors, hp, 512)
    four = footprint_from_gguf(f.tensors, hp, 512, n_seq=4)
    assert four.kv(0, hp.n_layer) == 4 * one.kv(0, hp.n_layer) > 0
    assert four.weights(0, hp.n_layer) == one.weights(0, hp.n_layer)
    room = one.total_bytes + (four.total_bytes - one.total_bytes) // 2  # between the two
    node = [cpu("head", room)]
    assert plan_pool(one, node).stages
    with pytest.raises(NotEnoughMemoryError, match=r"KV at -c 512 × -np 4 .* lower -c or -np"):
        plan_pool(four, node)
    with pytest.raises(PlanError, match="-np"):
        footprint_from_gguf(f.tensors, hp, 512, n_seq=0)
