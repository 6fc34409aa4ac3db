"""The architectures Potluck runs, one module each, as llama.cpp's `src/models/*.cpp`.

A module declares its rules (modelfile/hparams.py `ArchRules`: what the shared helpers read), its
tensors per layer and its block graph (archs/common.py). Everything else derives from that
declaration: the stage's tensor list (model/stage.py), the planner's footprint (its experts are
read top-k of n), the tests' model generator (tests/ggufgen.py), and the trainer's support.
Adding an architecture is one module and one line in `_MODULES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from potluck.errors import UnsupportedError
from potluck.model.archs import (
    deepseek2,
    gemma2,
    gemma3,
    gemma4,
    glm4moe,
    gpt_oss,
    granite,
    llama,
    mistral3,
    olmo2,
    olmoe,
    phi3,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    qwen3next,
    qwen35,
)
from potluck.model.archs.common import Block, Tensor, is_routed
from potluck.modelfile.gguf_file import TensorInfo
from potluck.modelfile.hparams import ArchRules, HParams, parse_hparams


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    rules: ArchRules
    tensors: Callable[[HParams, int], list[Tensor]]  # layer i's tensors
    block: Callable[[Block, int, int], int]  # (graph, layer i, hidden states) -> hidden states
    trains: str | None = None  # None: the LoRA trainer runs it; else why not


_MODULES = (
    llama, qwen2, qwen3, gemma3, qwen3moe, qwen2moe, gpt_oss, phi3, gemma2, olmo2, granite,
    glm4moe, deepseek2, gemma4, mistral3, olmoe, qwen35, qwen3next,
)  # fmt: skip
ARCHITECTURES: dict[str, Architecture] = {
    name: Architecture(name, m.RULES, m.tensors, m.block, getattr(m, "TRAINS", None))
    for m in _MODULES
    for name in m.NAMES
}


def supported_list() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def architecture(name: str, source: str = "model") -> Architecture:
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise UnsupportedError(
            f"{source}: architecture {name!r} is not supported; supported: {supported_list()}"
        )
    return arch


def hparams_from_metadata(meta: dict[str, Any], source: str = "model") -> HParams:
    """HParams from GGUF metadata under its architecture's rules; an unknown architecture or a
    missing key -> one clear error."""
    arch = architecture(str(meta.get("general.architecture")), source)
    return parse_hparams(meta, arch.rules, source)


def layer_tensors(hp: HParams, start: int, stop: int) -> list[Tensor]:
    """Every tensor the blocks [start, stop) read, as their architecture declares them (once
    each: a tensor of the whole model that every layer reads, phi3's rope factors, is declared
    by each)."""
    tensors = architecture(hp.arch).tensors
    return list({t.name: t for i in range(start, stop) for t in tensors(hp, i)}.values())


def training_refusal(hp: HParams) -> str | None:
    """Why the LoRA trainer cannot fine-tune this model (None: it can)."""
    arch = architecture(hp.arch)
    if arch.trains is not None:
        return arch.trains
    if hp.is_moe:
        return (
            f"fine-tuning a mixture of experts ({hp.arch}: {hp.n_expert} experts, "
            f"{hp.n_expert_used} per token) is not supported yet; run it with potluck run/serve"
        )
    if hp.rope_scaling == "yarn":  # (train/model.py's RoPE scales positions linearly)
        return "fine-tuning a model with YaRN RoPE scaling is not supported yet"
    # what the trainer's forward leaves out, wherever a file of another architecture sets it
    unused = {
        "attn_logit_softcapping": hp.attn_softcap, "final_logit_softcapping": hp.final_softcap,
        "embedding_scale": hp.embed_scale - 1.0, "residual_scale": hp.residual_scale - 1.0,
        "logit_scale": hp.logit_scale - 1.0, "attention.temperature_scale": hp.attn_temp_scale,
    }  # fmt: skip
    if named := [f"{hp.arch}.{k}" for k, v in unused.items() if v]:
        return f"fine-tuning is not supported yet for a model that sets {', '.join(named)}"
    return None


def _count(n: float) -> str:
    """1_234_567_890 -> '1.2B', 134_515_008 -> '135M'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def parameters(hp: HParams, tensors: Mapping[str, TensorInfo]) -> tuple[int, int]:
    """(all parameters, those a token computes with): of a mixture of experts' routed stacks,
    k of n experts; never the MTP blocks a file keeps after the model's layers (glm4moe's,
    deepseek2's nextn_predict_layers), which Potluck does not run."""
    total = active = 0
    for t in tensors.values():
        if t.layer is not None and t.layer >= hp.n_layer:
            continue
        n = math.prod(t.shape)
        total += n
        active += n * hp.n_expert_used // hp.n_expert if hp.is_moe and is_routed(t.name) else n
    return total, active


def describe(hp: HParams, tensors: Mapping[str, TensorInfo]) -> str:
    """One line for listings and plans: 'llama, 30 layers, 135M parameters', or for a mixture
    of experts 'qwen3moe, 48 layers, 30.5B parameters, 3.3B active (mixture of 128 experts, 8
    per token)'; a hybrid adds its recurrent layers and their state per sequence."""
    total, active = parameters(hp, tensors)
    line = f"{hp.arch}, {hp.n_layer} layers, {_count(total)} parameters"
    if hp.is_moe:
        line += (
            f", {_count(active)} active (mixture of {hp.n_expert} experts, "
            f"{hp.n_expert_used} per token)"
        )
    if hp.is_hybrid:
        n = hp.n_layer - hp.attention_layers()
        line += (
            f"; hybrid: {n} of {hp.n_layer} layers recurrent (Gated DeltaNet: "
            f"{_size(hp.state_bytes())} of state per sequence, no KV)"
        )
    return line


def _size(n: int) -> str:
    """Bytes as 'x KiB' / 'x MiB'."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Block",
    "Tensor",
    "architecture",
    "describe",
    "hparams_from_metadata",
    "layer_tensors",
    "parameters",
    "supported_list",
    "training_refusal",
]
