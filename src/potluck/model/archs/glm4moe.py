"""glm4moe (GLM-4.5, GLM-4.5-Air, GLM-4.6): pre-norm blocks; attention with q/k/v biases, per-head
q/k norms where the file has them (GLM-4.5 and 4.6 do, Air does not), RoPE (neox pairing) on the
first half of each head (`rope.dimension_count`); the first `leading_dense_block_count` layers
a dense SwiGLU, the rest a mixture of experts: a sigmoid router whose probabilities plus a
learnt bias (`exp_probs_b`) choose the top k (within the best expert groups where the file has
groups), weighted by the unbiased probabilities renormalised and times `expert_weights_scale`,
plus a shared expert every token goes through. The norm before the FFN is named
`post_attention_norm`. Files carry the multi-token-prediction (MTP) block after the model's own
layers (`block_count` counts it, `nextn_predict_layers` says how many): never read here."""

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

NAMES = ("glm4moe",)
RULES = ArchRules(
    rope_style="neox",
    activation="silu",
    qk_norm_if_present=True,
    expert_gating="sigmoid",  # (its files say so too: expert_gating_func 2)
)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p, d = f"blk.{i}.", hp.n_embd
    out = attention_tensors(hp, i, bias=True)
    out += [
        Tensor(p + n + ".weight", (hp.head_dim,), False) for n in ("attn_q_norm", "attn_k_norm")
    ]
    out.append(norm(p + "post_attention_norm", d))
    if not hp.is_moe_layer(i):
        return out + ffn_tensors(hp, i)
    out += [*moe_tensors(hp, i), Tensor(p + "exp_probs_b.bias", (hp.n_expert,))]
    return out + (ffn_tensors(hp, i, "_shexp", hp.n_ff_shexp) if hp.n_ff_shexp else [])


def block(g: Block, i: int, x: int) -> int:
    return pre_norm(g, i, x, "post_attention_norm")
