"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): llama's pre-norm block with q, k and v in one matrix
(`attn_qkv`, rows of q then k then v) and the FFN's gate and up in one (`ffn_up`, the gate's rows
first), RoPE on the two halves of the first rope_dim dims of each head (Phi-4-mini rotates 3/4).
Phi-3.5 and Phi-4-mini files carry LongRoPE's factors (`rope_factors_long`, `_short`) and
`{arch}.rope.scaling.attn_factor`; the sliding window some files name is off, as in llama.cpp."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, norm, rope_factor_tensors
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("phi3",)
RULES = ArchRules(rope_style="neox", activation="silu")
TRAINS = (
    "fine-tuning phi3 is not supported yet: the trainer has no fused attn_qkv or gate+up ffn_up "
    "(nor LongRoPE); run it with potluck run/serve"
)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p, d, f = f"blk.{i}.", hp.n_embd, hp.n_ff
    qkv = hp.n_head * hp.head_dim + hp.n_head_kv * (hp.head_dim + hp.head_dim_v)
    return [
        norm(p + "attn_norm", d),
        Tensor(p + "attn_qkv.weight", (qkv, d)),
        Tensor(p + "attn_output.weight", (d, hp.n_head * hp.head_dim_v)),
        norm(p + "ffn_norm", d),
        Tensor(p + "ffn_up.weight", (2 * f, d)),  # [gate; up]
        Tensor(p + "ffn_down.weight", (d, f)),
        *rope_factor_tensors(hp),
    ]


def block(g: Block, i: int, x: int) -> int:
    p = f"blk.{i}."
    x = g.add(x, g.attention(i, g.norm(x, p + "attn_norm.weight")))
    return g.add(x, g.ffn(i, g.norm(x, p + "ffn_norm.weight")))
