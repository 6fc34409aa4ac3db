"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention, every FFN a mixture of experts
(a softmax router; the top k of them, their weights renormalised to sum to 1; no shared expert)."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, attention_tensors, moe_tensors, norm, pre_norm
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("qwen3moe",)
RULES = ArchRules(rope_style="neox", activation="silu", qk_norm=True, expert_norm=True)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    out = attention_tensors(hp, i, qk_norm=True)
    return [*out, norm(f"blk.{i}.ffn_norm", hp.n_embd), *moe_tensors(hp, i)]


def block(g: Block, i: int, x: int) -> int:
    return pre_norm(g, i, x)
