"""qwen35, qwen35moe (Qwen3.5 / Qwen3.6: 27B, 35B-A3B, 122B-A10B) and qwen3next (Qwen3-Next-80B-A3B):
hybrids. Three of every four layers are Gated DeltaNet layers (a recurrent state per sequence,
no KV cache: model/kv_cache.py RecurrentState); every fourth is full attention whose q carries a
per-head output gate, with QK-norm and partial RoPE (interleaved M-RoPE on qwen35's, plain
half-split on qwen3next's). Each layer: x + mixer(norm(x)), then + FFN(post_attention_norm(x)):
dense (qwen35), or a mixture of experts (softmax router, top k renormalised) plus a shared
expert scaled by its own sigmoid gate. An MTP block after the layers is not run."""

from __future__ import annotations

from potluck.model.archs.common import (
    Block,
    Tensor,
    attention_tensors,
    delta_net_tensors,
    ffn_tensors,
    moe_tensors,
    norm,
)
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("qwen35", "qwen35moe")
RULES = ArchRules(
    rope_style="imrope", activation="silu", qk_norm=True, expert_norm=True, attn_output_gate=True
)
TRAINS = "fine-tuning a hybrid recurrent model (Gated DeltaNet layers) is not supported yet"


def mixer_tensors(
    hp: HParams, i: int, fused: bool | None = False, ba: bool = False
) -> list[Tensor]:
    """Layer i's norms and its mixer's tensors: a Gated DeltaNet or gated attention."""
    p = f"blk.{i}."
    if hp.is_recurrent(i):
        out = [norm(p + "attn_norm", hp.n_embd), *delta_net_tensors(hp, i, fused, ba)]
    else:
        out = attention_tensors(hp, i, qk_norm=True, q_gate=True)
    return [*out, norm(p + "post_attention_norm", hp.n_embd)]


def ffn_of(hp: HParams, i: int) -> list[Tensor]:
    """A dense FFN, or the routed experts and the gated shared expert."""
    if not hp.is_moe:
        return ffn_tensors(hp, i)
    p = f"blk.{i}."
    out = [
        *moe_tensors(hp, i, gate_up=None),
        *ffn_tensors(hp, i, "_shexp", hp.n_ff_shexp or hp.n_ff),
    ]
    return [*out, Tensor(p + "ffn_gate_inp_shexp.weight", (hp.n_embd,))]


def tensors(hp: HParams, i: int) -> list[Tensor]:
    return [*mixer_tensors(hp, i), *ffn_of(hp, i)]


def block(g: Block, i: int, x: int) -> int:
    p = f"blk.{i}."
    h = g.norm(x, p + "attn_norm.weight")
    x = g.add(x, g.delta_net(i, h) if g.hp.is_recurrent(i) else g.attention(i, h))
    h = g.norm(x, p + "post_attention_norm.weight")
    if not g.hp.is_moe:
        return g.add(x, g.ffn(i, h))
    shared = g.gate(p + "ffn_gate_inp_shexp.weight", h, g.ffn(i, h, "_shexp"))
    return g.add(x, g.add(g.moe(i, h), shared))
