"""gemma2: norms before and after attention and the FFN, GeGLU, embeddings scaled by
sqrt(n_embd); attention's scaled logits soft-capped (cap · tanh(s / cap), 50 by default) and
the output logits too (30); a sliding window on every other layer (the first of each pair);
q·k scaled by query_pre_attn_scalar^-1/2, which is (n_embd / n_head) for the 27B."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, attention_tensors, ffn_tensors, norm, sandwich
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("gemma2",)
RULES = ArchRules(
    rope_style="neox",
    activation="gelu_tanh",
    post_norms=True,
    embed_scale_sqrt=True,
    sliding_pattern=2,  # layers 0, 2, 4, ... slide; 1, 3, 5, ... attend to everything
    attn_softcap=50.0,
    final_softcap=30.0,
    wide_query_scale_layers=46,  # gemma2-27B
)
TRAINS = (
    "fine-tuning gemma2 is not supported yet: the trainer has no soft-capping of attention or "
    "output logits; run it with potluck run/serve"
)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p, d = f"blk.{i}.", hp.n_embd
    out = [*attention_tensors(hp, i), norm(p + "ffn_norm", d), *ffn_tensors(hp, i)]
    return [*out, norm(p + "post_attention_norm", d), norm(p + "post_ffw_norm", d)]


def block(g: Block, i: int, x: int) -> int:
    return sandwich(g, i, x)
