"""What parse_hparams makes of the keys of glm4moe and deepseek2 files, with the numbers of the
released models: MTP blocks after the model's layers, a shared expert's width from its count,
expert groups, multi-head latent attention's cache and q·k scale (with DeepSeek's YaRN)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from gguf import GGMLQuantizationType as T

from potluck.errors import ModelFileError, UnsupportedError
from potluck.model.archs import (
    hparams_from_metadata,
    layer_tensors,
    parameters,
    training_refusal,
)
from potluck.modelfile.gguf_file import TensorInfo


def _meta(arch: str, **keys: Any) -> dict[str, Any]:
    return {
        "general.architecture": arch,
        f"{arch}.context_length": 4096,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.vocab_size": 100,
        **{f"{arch}.{k}": v for k, v in keys.items()},
    }


def _v2_lite(**more: Any) -> dict[str, Any]:
    """DeepSeek-V2-Lite's keys as llama.cpp's converter writes them."""
    keys = {
        "block_count": 27, "embedding_length": 2048, "feed_forward_length": 10944,
        "attention.head_count": 16, "attention.head_count_kv": 1,
        "attention.key_length": 576, "attention.value_length": 512,
        "attention.key_length_mla": 192, "attention.value_length_mla": 128,
        "attention.kv_lora_rank": 512, "rope.dimension_count": 64,
        "expert_count": 64, "expert_used_count": 6, "expert_feed_forward_length": 1408,
        "expert_shared_count": 2, "leading_dense_block_count": 1, "expert_gating_func": 1,
        "expert_weights_scale": 1.0, "rope.scaling.type": "yarn", "rope.scaling.factor": 40.0,
        "rope.scaling.original_context_length": 4096,
        "rope.scaling.yarn_log_multiplier": 0.0707,
    }  # fmt: skip
    return _meta("deepseek2", **(keys | more))


def test_deepseek_v2_lite_caches_its_latent_and_scales_q_k_by_its_yarn_mscale() -> None:
    hp = hparams_from_metadata(_v2_lite())
    assert (hp.n_layer, hp.n_head, hp.n_head_kv) == (27, 16, 1)
    # the cache: one kv head of the latent (512) and the shared rope key (64); v the latent
    assert (hp.head_dim, hp.head_dim_v, hp.kv_lora_rank, hp.q_lora_rank) == (576, 512, 512, 0)
    assert hp.kv_bytes_per_token(1) == (576 + 512) * 2
    assert (hp.head_dim_mla, hp.head_dim_v_mla) == (192, 128)
    assert hp.n_ff_shexp == 2 * 1408  # two shared experts' width
    assert (hp.expert_gating, hp.expert_norm, hp.n_dense_lead) == ("softmax", False, 1)
    # q·k by 192^-1/2 times mscale², mscale = 1 + 0.1 · 0.707 · ln 40; cos and sin unscaled:
    # the factor given to ggml's rope cancels the 1 + 0.1 ln 40 it applies itself
    mscale = 1 + 0.1 * 0.707 * math.log(40)
    assert hp.attn_scale == pytest.approx(mscale**2 / math.sqrt(192), rel=1e-6)
    assert hp.rope_ext()[3] == pytest.approx(1 / (1 + 0.1 * math.log(40)))
    names = {t.name for t in layer_tensors(hp, 0, 2)}
    assert {"blk.0.ffn_up.weight", "blk.1.ffn_up_exps.weight", "blk.1.attn_k_b.weight"} <= names
    assert "blk.0.ffn_up_exps.weight" not in names  # layer 0 is dense


def test_an_mla_file_of_an_old_conversion_is_refused() -> None:
    meta = _v2_lite()
    del meta["deepseek2.attention.key_length_mla"], meta["deepseek2.attention.value_length_mla"]
    with pytest.raises(UnsupportedError, match="attn_k_b / attn_v_b"):
        hparams_from_metadata(meta)


def _glm45_air(**more: Any) -> dict[str, Any]:
    """GLM-4.5-Air's keys: 46 layers and the MTP block after them (block_count 47)."""
    keys = {
        "block_count": 47, "nextn_predict_layers": 1, "embedding_length": 4096,
        "feed_forward_length": 10944, "attention.head_count": 96, "attention.head_count_kv": 8,
        "attention.key_length": 128, "attention.value_length": 128,
        "rope.dimension_count": 64, "expert_count": 128, "expert_used_count": 8,
        "expert_feed_forward_length": 1408, "expert_shared_count": 1,
        "leading_dense_block_count": 1, "expert_gating_func": 2, "expert_weights_norm": True,
        "expert_weights_scale": 1.0, "expert_group_count": 1, "expert_group_used_count": 1,
    }  # fmt: skip
    return _meta("glm4moe", **(keys | more))


def test_glm45_air_runs_its_46_layers_and_counts_no_mtp_block() -> None:
    hp = hparams_from_metadata(_glm45_air())
    assert hp.n_layer == 46
    assert (hp.n_ff_shexp, hp.expert_gating, hp.n_expert_groups) == (1408, "sigmoid", 0)
    assert hp.attn_scale == pytest.approx(128**-0.5)
    names = {t.name for t in layer_tensors(hp, 0, hp.n_layer)}
    assert "blk.45.exp_probs_b.bias" in names and not any(n.startswith("blk.46.") for n in names)
    # a tensor of the MTP block (blk.46) is in the file but not among the model's parameters
    tensors = {
        n: TensorInfo(n, T.F32, (4096,), 0, 4 * 4096)
        for n in ("blk.45.attn_norm.weight", "blk.46.attn_norm.weight")
    }
    assert parameters(hp, tensors) == (4096, 4096)


def test_expert_groups_must_divide_the_experts() -> None:
    hp = hparams_from_metadata(_glm45_air(expert_group_count=8, expert_group_used_count=4))
    assert (hp.n_expert_groups, hp.n_group_used) == (8, 4)
    with pytest.raises(ModelFileError, match="128 experts in 6 groups"):
        hparams_from_metadata(_glm45_air(expert_group_count=6, expert_group_used_count=2))


def test_the_trainer_refuses_both() -> None:
    assert "multi-head latent attention" in str(training_refusal(hparams_from_metadata(_v2_lite())))
    refusal = str(training_refusal(hparams_from_metadata(_glm45_air())))
    assert "fine-tuning a mixture of experts (glm4moe" in refusal
