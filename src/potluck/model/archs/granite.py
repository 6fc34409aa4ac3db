"""granite (IBM Granite 3.x dense): llama's block (RoPE on adjacent pairs, SwiGLU; biases where
a file has them) with four numbers from the file: the embeddings multiplied by
{arch}.embedding_scale, each branch's output by {arch}.residual_scale before its residual add,
q·k by {arch}.attention.scale, and the logits divided by {arch}.logit_scale."""

from __future__ import annotations

from potluck.model.archs.common import Block, Tensor, attention_tensors, ffn_tensors, norm
from potluck.modelfile.hparams import ArchRules, HParams

NAMES = ("granite",)
RULES = ArchRules(rope_style="norm", activation="silu", divide_logits=True)
TRAINS = (
    "fine-tuning granite is not supported yet: the trainer has no embedding, residual or logit "
    "scales; run it with potluck run/serve"
)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p, d, f = f"blk.{i}.", hp.n_embd, hp.n_ff
    out = [*attention_tensors(hp, i, bias=None), norm(p + "ffn_norm", d), *ffn_tensors(hp, i)]
    widths = {"ffn_gate": f, "ffn_up": f, "ffn_down": d}  # (biases some files carry)
    return out + [Tensor(f"{p}{name}.bias", (n,), required=False) for name, n in widths.items()]


def block(g: Block, i: int, x: int) -> int:
    p, s = f"blk.{i}.", g.hp.residual_scale
    x = g.add(x, g.scale(g.attention(i, g.norm(x, p + "attn_norm.weight")), s))
    return g.add(x, g.scale(g.ffn(i, g.norm(x, p + "ffn_norm.weight")), s))
