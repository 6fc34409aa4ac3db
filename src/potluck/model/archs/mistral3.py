"""mistral3 (the text model of Mistral Small 3.1 / 3.2 and Devstral Small files converted from
Mistral3ForConditionalGeneration; Ministral 3 and Devstral Small 2): llama's pre-norm block (RoPE
on adjacent pairs of GGUF's permuted q and k, SwiGLU; biases where a file has them; experts where
a file has them, as Mixtral). What a Ministral 3 file adds, as its keys say: YaRN whose
`rope.scaling.yarn_log_multiplier` is mscale_all_dim itself (cos and sin scaled by mscale(1) /
mscale(mscale_all_dim), 1 for its released 1), and Llama 4's attention temperature
(`attention.temperature_scale` beta: q at position p times 1 + beta ln(1 + floor(p / n_orig)),
n_orig the original context of its YaRN). The trainer runs the files without those two, whose
block is exactly llama's (archs/__init__.py training_refusal refuses the others)."""

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

NAMES = ("mistral3",)
RULES = ArchRules(
    rope_style="norm", activation="silu", yarn_mscale_all_dim=True, experts_n_ff=True
)  # (experts, where a file has them, are feed_forward_length wide, as llama's)


def tensors(hp: HParams, i: int) -> list[Tensor]:
    p, d, f = f"blk.{i}.", hp.n_embd, hp.n_ff
    out = [*attention_tensors(hp, i, bias=None), norm(p + "ffn_norm", d)]
    if hp.is_moe_layer(i):
        return out + moe_tensors(hp, i)
    widths = {"ffn_gate": f, "ffn_up": f, "ffn_down": d}  # (biases some files carry)
    biases = [Tensor(f"{p}{name}.bias", (n,), required=False) for name, n in widths.items()]
    return out + ffn_tensors(hp, i) + biases


def block(g: Block, i: int, x: int) -> int:
    return pre_norm(g, i, x)
