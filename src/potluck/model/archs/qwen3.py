"""qwen3: qwen2 without the biases, with an RMSNorm over each head of q and k before RoPE."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, attention_tensors, ffn_tensors, norm, pre_norm
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("qwen3",)
RULES = ArchRules(rope_style="neox", activation="silu", qk_norm=True)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    out = attention_tensors(hp, i, qk_norm=True)
    return [*out, norm(f"blk.{i}.ffn_norm", hp.n_embd), *ffn_tensors(hp, i)]


def block(g: Block, i: int, x: int) -> int:
    return pre_norm(g, i, x)
