"""qwen2: llama's block with q/k/v biases and RoPE on the two halves of each head (neox)."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, attention_tensors, ffn_tensors, norm, pre_norm
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("qwen2",)
RULES = ArchRules(rope_style="neox", activation="silu")


def tensors(hp: HParams, i: int) -> list[Tensor]:
    out = attention_tensors(hp, i, bias=True)
    return [*out, norm(f"blk.{i}.ffn_norm", hp.n_embd), *ffn_tensors(hp, i)]


def block(g: Block, i: int, x: int) -> int:
    return pre_norm(g, i, x)
