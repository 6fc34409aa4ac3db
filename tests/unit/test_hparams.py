"""What parse_hparams makes of the keys some architectures' files carry: per-layer sliding
patterns, gemma's 27B attention scale, soft-capping defaults; and which whole-model tensors a
stage is shipped (LongRoPE's factors)."""

from __future__ import annotations

from typing import Any

import pytest
from gguf import GGMLQuantizationType as T

from potluck.errors import UnsupportedError
from potluck.model.archs import hparams_from_metadata
from potluck.model.layout import stage_tensor_names
from potluck.modelfile.gguf_file import TensorInfo
from potluck.modelfile.hparams import sliding_period


def _meta(arch: str, n_layer: int = 4, **keys: Any) -> dict[str, Any]:
    return {
        "general.architecture": arch,
        f"{arch}.block_count": n_layer,
        f"{arch}.context_length": 512,
        f"{arch}.embedding_length": 4608,
        f"{arch}.feed_forward_length": 256,
        f"{arch}.attention.head_count": 32,
        f"{arch}.attention.key_length": 128,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.vocab_size": 100,
        **{f"{arch}.{k}": v for k, v in keys.items()},
    }


def test_a_list_of_sliding_layers_is_read_as_its_period() -> None:
    assert sliding_period([True, True, True, False] * 2, "m") == 4  # Olmo3's
    assert sliding_period([True, False, True, False], "m") == 2
    assert sliding_period([True, True, True], "m") == 0  # every layer slides
    assert sliding_period(6, "m") == 6
    with pytest.raises(UnsupportedError, match=r"sliding layers \[0, 3\] are not"):
        sliding_period([True, False, False, True], "m")


def test_olmo2_slides_where_its_file_lists_the_layers() -> None:
    pattern = [True, True, True, False]
    hp = hparams_from_metadata(
        _meta(
            "olmo2", **{"attention.sliding_window": 8, "attention.sliding_window_pattern": pattern}
        )
    )
    assert (hp.sliding_window, [hp.is_sliding(i) for i in range(4)]) == (8, pattern)
    # phi3's files name a window that llama.cpp leaves off
    assert (
        hparams_from_metadata(_meta("phi3", **{"attention.sliding_window": 2047})).sliding_window
        == 0
    )


def test_gemma2_scales_and_caps() -> None:
    """The 27B (46 layers) scales q·k by (n_embd / n_head)^-1/2 = 144^-1/2, the others by
    head_dim^-1/2 (query_pre_attn_scalar, which GGUF does not carry); caps default to 50, 30."""
    assert hparams_from_metadata(_meta("gemma2", 46)).attn_scale == pytest.approx(144**-0.5)
    hp = hparams_from_metadata(_meta("gemma2", 42))
    assert hp.attn_scale == pytest.approx(128**-0.5)
    assert (hp.attn_softcap, hp.final_softcap) == (50.0, 30.0)
    assert hparams_from_metadata(_meta("gemma3", 62)).attn_scale == pytest.approx(144**-0.5)
    assert hparams_from_metadata(_meta("llama", 46)).attn_scale == pytest.approx(128**-0.5)


def test_longrope_factors_go_to_every_stage() -> None:
    names = ["token_embd.weight", "blk.0.attn_qkv.weight", "blk.1.attn_qkv.weight",
             "rope_factors_long.weight", "rope_factors_short.weight", "output_norm.weight"]  # fmt: skip
    infos = [TensorInfo(n, T.F32, (4,), 0, 16) for n in names]
    assert stage_tensor_names(infos, 2, 1, 2) == [
        "blk.1.attn_qkv.weight", "output_norm.weight", "token_embd.weight",
        "rope_factors_long.weight", "rope_factors_short.weight",
    ]  # fmt: skip
