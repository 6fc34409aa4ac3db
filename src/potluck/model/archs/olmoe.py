"""olmoe (OLMoE-1B-7B): llama's pre-norm block; q and k each RMS-normed over all their heads
together before RoPE (olmo2's, neox pairing); every FFN a mixture of experts (a softmax router,
the top k of them not renormalised; no shared expert), each expert feed_forward_length wide."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, attention_tensors, moe_tensors, norm, pre_norm
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("olmoe",)
RULES = ArchRules(
    rope_style="neox", activation="silu", qk_norm_full=True, expert_norm=False, experts_n_ff=True
)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p = f"blk.{i}."
    out = attention_tensors(hp, i)
    out += [norm(p + "attn_q_norm", hp.n_head * hp.head_dim)]
    out += [norm(p + "attn_k_norm", hp.n_head_kv * hp.head_dim)]
    return [*out, norm(p + "ffn_norm", hp.n_embd), *moe_tensors(hp, i)]


def block(g: Block, i: int, x: int) -> int:
    return pre_norm(g, i, x)
