"""olmo2 (OLMo 2): no norm before attention or the FFN, one after each (before the residual add);
q and k each RMS-normed over all their heads together before RoPE (neox pairing); SwiGLU.
Olmo3's files, also olmo2, add a sliding window on most layers (a list in the file says which),
where RoPE keeps the unscaled frequencies while the global layers' take the file's YaRN."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, attention_tensors, ffn_tensors, norm
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("olmo2",)
RULES = ArchRules(
    rope_style="neox",
    activation="silu",
    qk_norm_full=True,
    local_rope_unscaled=True,
)
TRAINS = (
    "fine-tuning olmo2 is not supported yet: the trainer's block norms before attention and the "
    "FFN, olmo2's after them (and q/k over all heads); run it with potluck run/serve"
)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p, d = f"blk.{i}.", hp.n_embd
    out = [t for t in attention_tensors(hp, i) if t.name != p + "attn_norm.weight"]
    out += [norm(p + "attn_q_norm", hp.n_head * hp.head_dim)]
    out += [norm(p + "attn_k_norm", hp.n_head_kv * hp.head_dim)]
    out += [norm(p + "post_attention_norm", d), *ffn_tensors(hp, i)]
    return [*out, norm(p + "post_ffw_norm", d)]


def block(g: Block, i: int, x: int) -> int:
    p = f"blk.{i}."
    x = g.add(x, g.norm(g.attention(i, x), p + "post_attention_norm.weight"))
    return g.add(x, g.norm(g.ffn(i, x), p + "post_ffw_norm.weight"))
