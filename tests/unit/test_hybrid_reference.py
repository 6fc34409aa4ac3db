"""The hybrid reference (tests/hybrid_reference.py) inverts llama.cpp's conversion exactly: a random
transformers model of each class, written as llama.cpp's converter writes it and read back by
hf_hybrid, gives the original's logits (fp32: to round-off, which +1/-1 on the norms and
log(-(-exp)) on A_log leave). And the check can fail: without the V heads' regrouping the logits
move far."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import hybrid_reference
from hybrid_reference import HF_CLASSES, hf_hybrid, to_gguf

transformers = pytest.importorskip("transformers")

TOKENS = [5, 70, 71, 72, 100, 3, 200, 150, 260, 9, 33, 34, 35, 36, 40, 41, 42, 43, 44, 299]
# round-off of fp32 (the norms' 1 + w - 1, A_log's log(exp)) through 4 layers, relative to the
# largest logit; a wrong permutation moves them by O(1)
TOLERANCE = 1e-5


def _config(arch: str, tied: bool) -> Any:
    """Tiny: layers 0-2 Gated DeltaNet, 3 full attention; 2 K heads of 4 V heads (so the V
    heads' order matters), head 32 of which a quarter RoPE'd (8 dims: M-RoPE sections 2+1+1)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25}  # fmt: skip
    kwargs: dict[str, Any] = {
        "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4, "full_attention_interval": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": tied, "rope_parameters": rope,
        "attn_implementation": "eager", "experts_implementation": "eager",
    }  # fmt: skip
    if arch == "qwen35":
        kwargs["intermediate_size"] = 128
        rope |= {"mrope_section": [2, 1, 1], "mrope_interleaved": True}
    else:
        kwargs |= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32}  # fmt: skip
        if arch == "qwen35moe":
            rope |= {"mrope_section": [2, 1, 1], "mrope_interleaved": True}
    return getattr(transformers, HF_CLASSES[arch][0])(**kwargs)


def _random_model(arch: str, tied: bool, seed: int = 0) -> torch.nn.Module:
    """Every parameter random, spread so that no layer saturates: zero-centred norms near 0,
    the gated norm near 1, matrices of std 1/√fan-in, a router of spread 0.5 · √fan-in (its
    top-2 well apart, so round-off cannot swap an expert)."""
    model = getattr(transformers, HF_CLASSES[arch][1])(_config(arch, tied)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * r)
            elif name.endswith("norm.weight"):
                p.copy_(0.1 * r)
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * r)
            elif "conv1d" in name:
                p.copy_(0.3 * r)
            elif name.endswith(("embed_tokens.weight", "mlp.gate.weight")):
                p.copy_(r if "embed" in name else 0.5 * r)
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([TOKENS]), use_cache=False).logits[0]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(
    ("arch", "tied", "options"),
    [
        ("qwen35", True, {}),
        ("qwen35", False, {"fused": True}),
        ("qwen35moe", False, {}),
        ("qwen35moe", False, {"fused": True}),
        ("qwen3next", False, {}),
        # an older file: in_proj_qkvz whole as ssm_in, the layers' kinds by interval only
        ("qwen3next", True, {"legacy_ssm_in": True, "recurrent_layers": False}),
    ],
)
def test_round_trip(tmp_path: Path, arch: str, tied: bool, options: dict[str, bool]) -> None:
    model = _random_model(arch, tied)
    path = to_gguf(model, tmp_path / f"{arch}.gguf", arch, **options)
    ref = hf_hybrid(path)
    assert type(ref) is type(model)
    assert ref.config.layer_types == model.config.layer_types
    assert ref.config.tie_word_embeddings == tied
    for (name, a), (_, b) in zip(
        sorted(model.state_dict().items()), sorted(ref.state_dict().items()), strict=True
    ):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
    want = _logits(model)
    assert want.abs().max() > 1.0  # (logits that say something)
    assert _rel_err(_logits(ref), want) < TOLERANCE


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_without_v_regrouping_logits_differ(
    tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reference that left the V heads in llama.cpp's tiled order would be caught."""
    model = _random_model(arch, tied=False)
    path = to_gguf(model, tmp_path / f"{arch}.gguf", arch)
    monkeypatch.setattr(hybrid_reference, "grouped_v_heads", lambda w, dim, n_k, head: w)
    assert _rel_err(_logits(hf_hybrid(path)), _logits(model)) > 1e-2
