"""gpt-oss (OpenAI gpt-oss-20b, gpt-oss-120b): pre-norm blocks; attention with q/k/v/output
biases and a learnt sink logit per head, a sliding window on every other layer (the first of
each pair), YaRN-scaled RoPE (neox pairing); every FFN a mixture of experts whose router and
experts carry biases, chosen by their top k logits and weighted by a softmax over those k, each
expert a clamped SwiGLU (llama.cpp's LLM_ARCH_OPENAI_MOE)."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, attention_tensors, moe_tensors, norm
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("gpt-oss",)
RULES = ArchRules(
    rope_style="neox",
    activation="swiglu_oai",
    sliding_pattern=2,  # layers 0, 2, 4, ... slide; 1, 3, 5, ... attend to everything
    expert_norm=False,  # (the softmax over the k already sums to 1)
    expert_gating="softmax_weight",
)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    out = attention_tensors(hp, i, bias=True, out_bias=True, sinks=True)
    # (named post_attention_norm, it is the norm before the FFN: of the residual stream)
    return [*out, norm(f"blk.{i}.post_attention_norm", hp.n_embd), *moe_tensors(hp, i, bias=True)]


def block(g: Block, i: int, x: int) -> int:
    p = f"blk.{i}."
    x = g.add(x, g.attention(i, g.norm(x, p + "attn_norm.weight")))
    return g.add(x, g.moe(i, g.norm(x, p + "post_attention_norm.weight")))
