"""deepseek2 (DeepSeek-V2, DeepSeek-V2-Lite, DeepSeek-V3, GLM-4.7-Flash): pre-norm blocks with
multi-head latent attention (MLA) and, after the first `leading_dense_block_count` dense layers,
a mixture of experts (a softmax router, or a sigmoid one whose choice a learnt bias
`exp_probs_b` moves, within the best expert groups where the file has groups; weights times
`expert_weights_scale`) plus a shared expert.

MLA: each token's k and v for every head come from one latent of rank r = kv_lora_rank
(`attn_kv_a_mqa`, then `attn_kv_a_norm`), plus one RoPE'd key of R = rope_dim dims all heads
share; RoPE on adjacent pairs. Each head's q (through the q_lora_rank bottleneck `attn_q_a`,
`attn_q_a_norm`, `attn_q_b` where the file has one, else `attn_q`) is nope = key_length_mla - R
dims without RoPE and R with. As llama.cpp does, the cache holds the latent rather than the
decompressed heads: q's nope part is multiplied by each head's `attn_k_b` [r, nope] into the
latent's space, so that attention runs over one kv head (k: latent and rope key, r + R; v: the
latent, r), and each head's output r goes through its `attn_v_b` [v, r] to v dims. This is what
the file's metadata describes (head_count_kv 1, key_length r + R, value_length r), and the
ordinary cache (model/kv_cache.py) keeps it: per token and layer 2r + R elements, where
llama.cpp's MLA cache keeps r + R (its v is a view of k's first r); decompressed heads would
take H (key_length_mla + value_length_mla). For DeepSeek-V2-Lite (r 512, R 64, 16 heads of 192
and 128) that is 1088 against llama.cpp's 576 and the decompressed 5120, f16 each.

YaRN as DeepSeek's (`rope.scaling.yarn_log_multiplier`): cos and sin unscaled, q·k scaled by
(1 + 0.1 mscale_all_dim ln factor)². GLM-4.7-Flash files carry their MTP block after the model's
own layers (`nextn_predict_layers`): never read here. Files converted before llama.cpp split
`attn_kv_b` into `attn_k_b` and `attn_v_b` are refused (modelfile/hparams.py)."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, ffn_tensors, moe_tensors, norm, pre_norm
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("deepseek2",)
RULES = ArchRules(
    rope_style="norm",
    activation="silu",
    expert_norm=False,  # (DeepSeek-V2's; files of sigmoid routers say expert_weights_norm)
    yarn_log_mul_tenths=True,
)
TRAINS = (
    "fine-tuning deepseek2 is not supported yet: the trainer has no multi-head latent "
    "attention; run it with potluck run/serve"
)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p, d, H = f"blk.{i}.", hp.n_embd, hp.n_head
    r, R, dq, dv = hp.kv_lora_rank, hp.rope_dim, hp.head_dim_mla, hp.head_dim_v_mla
    out = [norm(p + "attn_norm", d)]
    if hp.q_lora_rank:
        out += [
            Tensor(p + "attn_q_a.weight", (hp.q_lora_rank, d)),
            norm(p + "attn_q_a_norm", hp.q_lora_rank),
            Tensor(p + "attn_q_b.weight", (H * dq, hp.q_lora_rank)),
        ]
    else:
        out.append(Tensor(p + "attn_q.weight", (H * dq, d)))
    out += [
        Tensor(p + "attn_kv_a_mqa.weight", (r + R, d)),
        norm(p + "attn_kv_a_norm", r),
        Tensor(p + "attn_k_b.weight", (H, r, dq - R)),  # per head [r, nope]
        Tensor(p + "attn_v_b.weight", (H, dv, r)),  # per head [v, r]
        Tensor(p + "attn_output.weight", (d, H * dv)),
        norm(p + "ffn_norm", d),
    ]
    if not hp.is_moe_layer(i):
        return out + ffn_tensors(hp, i)
    out += [*moe_tensors(hp, i), Tensor(p + "exp_probs_b.bias", (hp.n_expert,), False)]
    return out + (ffn_tensors(hp, i, "_shexp", hp.n_ff_shexp) if hp.n_ff_shexp else [])


def block(g: Block, i: int, x: int) -> int:
    return pre_norm(g, i, x)
