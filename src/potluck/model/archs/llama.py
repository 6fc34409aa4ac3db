"""llama and mistral: pre-norm blocks, RoPE on adjacent pairs (GGUF's permuted q and k), SwiGLU.
A llama file with expert tensors is a Mixtral: a softmax router, the top k renormalised."""

from __future__ import annotations

from potluck.model.archs.common import (
    Block,
    Tensor,
    attention_tensors,
    ffn_tensors,
    moe_tensors,
    norm,
    pre_norm,
)
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("llama", "mistral")
# (a Mixtral's experts are feed_forward_length wide: its converter writes no expert width)
RULES = ArchRules(rope_style="norm", activation="silu", experts_n_ff=True)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    out = attention_tensors(hp, i, bias=None)  # (some llama files carry q/k/v biases)
    out.append(norm(f"blk.{i}.ffn_norm", hp.n_embd))
    return out + (moe_tensors(hp, i) if hp.is_moe_layer(i) else ffn_tensors(hp, i))


def block(g: Block, i: int, x: int) -> int:
    return pre_norm(g, i, x)
