"""qwen3next (Qwen3-Next-80B-A3B): qwen35moe's hybrid block (model/archs/qwen35.py) with plain
half-split RoPE, its Gated DeltaNet's beta and alpha in one matrix `ssm_ba` per key-head group,
q, k, v and z either split as qwen35's (`attn_qkv`, `attn_gate`) or in one `ssm_in` (older
conversions), and its value heads in HF's grouped order."""

from __future__ import annotations

from potluck.model.archs.common import Tensor
from potluck.model.archs.qwen35 import TRAINS, block, ffn_of, mixer_tensors
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("qwen3next",)
RULES = ArchRules(
    rope_style="neox",
    activation="silu",
    qk_norm=True,
    expert_norm=True,
    attn_output_gate=True,
    delta_grouped=True,
)
__all__ = ["NAMES", "RULES", "TRAINS", "block", "tensors"]


def tensors(hp: HParams, i: int) -> list[Tensor]:
    return [*mixer_tensors(hp, i, fused=None, ba=True), *ffn_of(hp, i)]
