"""gemma4 (Gemma 4 31B, and 26B-A4B, a mixture of experts beside a dense FFN): gemma3's blocks
(norms before and after attention and the FFN, GeGLU, embeddings scaled by sqrt(n_embd), q/k
norms) with:

- sliding-window and global layers of different shapes (the file lists which slide): the
  sliding ones of `key_length_swa` per head, RoPE over `rope.dimension_count_swa` dims at
  `rope.freq_base_swa`; the global ones wider heads and fewer kv heads (`head_count_kv` per
  layer), and no `attn_v` (the 31B's and 26B's attention_k_eq_v: v is k's projection); their
  RoPE proportional, rotating only the dims that `rope_freqs` does not divide by 1e30;
- v normed per head (no weight); q·k not scaled (1), q and k being normed;
- the output logits soft-capped (`final_logit_softcapping`, 30);
- each layer's output times its `layer_output_scale`;
- (26B-A4B) beside the dense FFN, routed experts of the same normed residual: a softmax router
  that reads the residual normed without a weight, times `ffn_gate_inp.scale` / sqrt(n_embd);
  the top k renormalised, each times its expert's `ffn_down_exps.scale`; GeGLU experts whose
  gate and up are one stack (`ffn_gate_up_exps`, or two in other converters' files); the dense
  FFN's output and the experts' normed apart (`post_ffw_norm_1`, `_2`) and added, then normed
  as the dense FFN of the 31B.

Refused: the small models (E2B, E4B). Their per-layer token embeddings (`per_layer_token_embd`,
one slice per layer added inside every block) would need the token ids on every stage rather than
the first only, and their last layers reuse earlier layers' KV caches (`shared_kv_layers`):
more than this module's share of work for now (llama.cpp's gemma4.cpp shows both).
"""

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

NAMES = ("gemma4",)
RULES = ArchRules(
    rope_style="neox",
    activation="gelu_tanh",
    qk_norm=True,
    v_norm=True,
    post_norms=True,
    embed_scale_sqrt=True,
    sliding_pattern=6,  # (where the file lists no pattern: five sliding layers to one global)
    local_rope_base=10_000.0,
    local_rope_unscaled=True,  # rope_freqs are the global layers' alone
    attn_scale=1.0,
    final_softcap=30.0,
    unsupported=(
        (
            "embedding_length_per_layer_input",
            "per-layer token embeddings (per_layer_token_embd: Gemma 4 E2B/E4B) are not "
            "supported: every stage would need the token ids, not only the first",
        ),
        (
            "attention.shared_kv_layers",
            "layers that reuse an earlier layer's KV cache (Gemma 4 E2B/E4B) are not supported",
        ),
    ),
)
TRAINS = (
    "fine-tuning gemma4 is not supported yet: the trainer has no layers of different head "
    "sizes, v norm, k-as-v attention, layer output scales or soft-capped logits (nor the "
    "26B-A4B's experts); run it with potluck run/serve"
)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p, d, glob = f"blk.{i}.", hp.n_embd, not hp.is_sliding(i)
    out = attention_tensors(hp, i, qk_norm=True, v=not glob)
    out += [norm(p + "post_attention_norm", d), norm(p + "ffn_norm", d), *ffn_tensors(hp, i)]
    out += [norm(p + "post_ffw_norm", d), Tensor(p + "layer_output_scale.weight", (1,), False)]
    if glob:  # proportional RoPE: 1 for the rotated dims, 1e30 for the rest
        out.append(Tensor("rope_freqs.weight", (hp.rope_dim // 2,)))
    if hp.is_moe_layer(i):
        out += [
            Tensor(p + "ffn_gate_inp.scale", (d,)),
            norm(p + "pre_ffw_norm_2", d),
            norm(p + "post_ffw_norm_1", d),
            norm(p + "post_ffw_norm_2", d),
            *moe_tensors(hp, i, gate_up=None, scales=True),
        ]
    return out


def block(g: Block, i: int, x: int) -> int:
    p = f"blk.{i}."
    a = g.attention(i, g.norm(x, p + "attn_norm.weight"))
    x = g.add(x, g.norm(a, p + "post_attention_norm.weight"))
    f = g.ffn(i, g.norm(x, p + "ffn_norm.weight"))
    if g.hp.is_moe_layer(i):
        route = g.scale(g.norm(x, p + "ffn_gate_inp.scale"), g.hp.n_embd**-0.5)
        e = g.moe(i, g.norm(x, p + "pre_ffw_norm_2.weight"), route)
        f = g.norm(f, p + "post_ffw_norm_1.weight")
        f = g.add(f, g.norm(e, p + "post_ffw_norm_2.weight"))
    x = g.add(x, g.norm(f, p + "post_ffw_norm.weight"))
    return g.mul(x, p + "layer_output_scale.weight")
