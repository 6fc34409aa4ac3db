"""qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): qwen2's attention (q/k/v biases); the FFN is a
mixture of experts (softmax router, top k not renormalised) plus a shared expert every token
goes through, scaled by its own sigmoid gate."""

from __future__ import annotations

from potluck.model.archs.common import (
    Block,
    Tensor,
    attention_tensors,
    ffn_tensors,
    moe_tensors,
    norm,
)
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("qwen2moe",)
RULES = ArchRules(rope_style="neox", activation="silu", expert_norm=False)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p = f"blk.{i}."
    out = attention_tensors(hp, i, bias=True)
    out += [norm(p + "ffn_norm", hp.n_embd), *moe_tensors(hp, i)]
    out += ffn_tensors(hp, i, "_shexp", hp.n_ff_shexp or hp.n_ff)
    return [*out, Tensor(p + "ffn_gate_inp_shexp.weight", (hp.n_embd,))]


def block(g: Block, i: int, x: int) -> int:
    p = f"blk.{i}."
    x = g.add(x, g.attention(i, g.norm(x, p + "attn_norm.weight")))
    h = g.norm(x, p + "ffn_norm.weight")
    shared = g.gate(p + "ffn_gate_inp_shexp.weight", h, g.ffn(i, h, "_shexp"))
    return g.add(x, g.add(g.moe(i, h), shared))
