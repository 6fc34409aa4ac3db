"""gemma3: norms before and after attention and the FFN, GeGLU, embeddings scaled by
sqrt(n_embd), q/k norms, five sliding-window layers (their own RoPE base) to one global."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, attention_tensors, ffn_tensors, norm, sandwich
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("gemma3",)
RULES = ArchRules(
    rope_style="neox",
    activation="gelu_tanh",
    qk_norm=True,
    post_norms=True,
    embed_scale_sqrt=True,
    sliding_pattern=6,
    local_rope_base=10_000.0,
    wide_query_scale_layers=62,  # gemma3-27B: q·k scaled by (n_embd / n_head)^-1/2
)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p, d = f"blk.{i}.", hp.n_embd
    out = [*attention_tensors(hp, i, qk_norm=True), norm(p + "ffn_norm", d), *ffn_tensors(hp, i)]
    return [*out, norm(p + "post_attention_norm", d), norm(p + "post_ffw_norm", d)]


def block(g: Block, i: int, x: int) -> int:
    return sandwich(g, i, x)
