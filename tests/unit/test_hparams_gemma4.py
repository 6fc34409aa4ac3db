"""What parse_hparams makes of gemma4's and mistral3's keys, as llama.cpp's converter writes
them at the released sizes: sliding and global layers of different attention shapes (and the KV
cache rows that hold both), the small models refused, the tensors each layer declares; Ministral
3's YaRN and attention temperature."""

from __future__ import annotations

import math
from typing import Any

import pytest

from potluck.errors import UnsupportedError
from potluck.model.archs import hparams_from_metadata, layer_tensors, training_refusal
from potluck.modelfile.hparams import Heads


def _gemma4(n_layer: int, n_embd: int, n_head: int, kv: tuple[int, int], **more: Any) -> dict:
    """A gemma4 file's keys: five sliding layers (heads of 256) to one global (of 512, RoPE'd
    by rope_freqs), kv = (sliding layers' kv heads, global layers')."""
    slides = [(i + 1) % 6 != 0 for i in range(n_layer)]
    keys = {
        "block_count": n_layer, "context_length": 262144, "embedding_length": n_embd,
        "feed_forward_length": 4 * n_embd, "attention.head_count": n_head,
        "attention.head_count_kv": [kv[0] if s else kv[1] for s in slides],
        "attention.key_length": 512, "attention.value_length": 512,
        "attention.key_length_swa": 256, "attention.value_length_swa": 256,
        "rope.dimension_count": 512, "rope.dimension_count_swa": 256,
        "rope.freq_base": 1e6, "rope.freq_base_swa": 1e4, "attention.sliding_window": 1024,
        "attention.sliding_window_pattern": slides, "attention.layer_norm_rms_epsilon": 1e-6,
        "final_logit_softcapping": 30.0, "attention.shared_kv_layers": 0,
        "embedding_length_per_layer_input": 0, "vocab_size": 262144, **more,
    }  # fmt: skip
    return {"general.architecture": "gemma4", **{f"gemma4.{k}": v for k, v in keys.items()}}


def test_gemma4_layers_of_two_shapes_share_cache_rows_of_the_wider() -> None:
    hp = hparams_from_metadata(_gemma4(60, 5376, 32, (16, 4)))  # the 31B
    local, full = Heads(16, 256, 256, 256), Heads(4, 512, 512, 512)
    assert [hp.heads(i) for i in (0, 4, 5, 59)] == [local, local, full, full]
    assert [hp.rope_base_for(i) for i in (0, 5)] == [1e4, 1e6]
    # the sliding layers' K and V take 16 · 256 a token, the global ones' 4 · 512: every
    # layer's cache row is 4096 wide (the global layers fill half of theirs)
    assert (hp.n_head_kv, hp.head_dim, hp.head_dim_v, hp.rope_dim) == (16, 256, 256, 512)
    assert hp.kv_bytes_per_token(1) == 16 * (256 + 256) * 2
    assert (hp.attn_scale, hp.final_softcap, hp.sliding_window) == (1.0, 30.0, 1024)
    assert training_refusal(hp) is not None


def test_gemma4_declares_its_global_layers_v_and_rope_freqs_and_either_experts() -> None:
    hp = hparams_from_metadata(  # the 26B-A4B
        _gemma4(30, 2816, 16, (8, 2), expert_count=128, expert_used_count=8,
                expert_feed_forward_length=704)
    )  # fmt: skip
    shapes = {t.name: (t.shape, t.required) for t in layer_tensors(hp, 4, 6)}
    assert shapes["blk.4.attn_v.weight"] == ((8 * 256, 2816), True)
    assert shapes["blk.5.attn_v.weight"] == ((2 * 512, 2816), False)  # k serves as v
    assert shapes["blk.5.attn_q.weight"] == ((16 * 512, 2816), True)
    assert shapes["rope_freqs.weight"] == ((256,), True)  # read by the global layer alone
    assert shapes["blk.5.ffn_gate_up_exps.weight"] == ((128, 2 * 704, 2816), False)
    assert shapes["blk.5.ffn_gate_exps.weight"] == ((128, 704, 2816), False)
    assert shapes["blk.5.ffn_down_exps.scale"] == ((128,), False)
    assert shapes["blk.5.ffn_gate_inp.scale"] == ((2816,), True)
    assert "rope_freqs.weight" not in {t.name for t in layer_tensors(hp, 0, 5)}


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("embedding_length_per_layer_input", 256, "per_layer_token_embd"),
        ("attention.shared_kv_layers", 20, "reuse an earlier layer's KV cache"),
    ],
)
def test_gemma4_small_models_are_refused(key: str, value: int, match: str) -> None:
    meta = _gemma4(35, 1536, 8, (1, 1), **{key: value})  # E2B's
    with pytest.raises(UnsupportedError, match=match):
        hparams_from_metadata(meta)


def test_kv_heads_that_differ_within_a_kind_are_refused() -> None:
    meta = _gemma4(12, 2816, 16, (8, 2))
    meta["gemma4.attention.head_count_kv"][0] = 4
    with pytest.raises(UnsupportedError, match="other than between sliding-window and global"):
        hparams_from_metadata(meta)


def test_ministral3_yarn_and_temperature() -> None:
    """Ministral 3's keys: YaRN x16 over 16384 positions, mscale_all_dim 1 (cos and sin
    unscaled: ggml's own mscale cancelled), attention temperature beta 0.1."""
    keys = {
        "block_count": 34, "context_length": 262144, "embedding_length": 4096,
        "feed_forward_length": 14336, "attention.head_count": 32, "attention.head_count_kv": 8,
        "attention.key_length": 128, "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 1e6, "rope.scaling.type": "yarn", "rope.scaling.factor": 16.0,
        "rope.scaling.original_context_length": 16384, "rope.scaling.yarn_log_multiplier": 1.0,
        "attention.temperature_scale": 0.1, "vocab_size": 131072,
    }  # fmt: skip
    meta = {"general.architecture": "mistral3", **{f"mistral3.{k}": v for k, v in keys.items()}}
    hp = hparams_from_metadata(meta)
    n_orig, freq_scale, ext, attn, _, _ = hp.rope_ext()
    assert (n_orig, freq_scale, ext) == (16384, 1 / 16, 1.0)
    assert attn == pytest.approx(1 / (1 + 0.1 * math.log(16)))
    assert (hp.attn_temp_scale, hp.attn_scale) == (0.1, pytest.approx(128**-0.5))
    assert training_refusal(hp) is not None
