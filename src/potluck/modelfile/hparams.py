"""Model shape from GGUF metadata: one frozen dataclass, with per-architecture rules as data.

The rules of each architecture are declared by its module (model/archs/); `parse_hparams` reads
the keys every architecture shares (`{arch}.block_count`, ...; the experts' keys where a file
has them) under those rules. model/archs `hparams_from_metadata` picks the module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from potluck.errors import ModelFileError, UnsupportedError


@dataclass(frozen=True)
class ArchRules:
    """What differs between architectures that the shared graph helpers read, as data (each
    architecture's module in model/archs/ declares its own)."""

    rope_style: Literal["norm", "neox"]  # adjacent pairs (llama's GGUF permutation) or half-split
    activation: Literal["silu", "gelu_tanh"]
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (qwen3, gemma3)
    post_norms: bool = False  # norms after attention and after the FFN, before the residual add
    embed_scale_sqrt: bool = False  # multiply embeddings by sqrt(n_embd) (gemma)
    sliding_pattern: int = 0  # every Nth layer is global, the rest use the sliding window (gemma3)
    local_rope_base: float | None = None  # RoPE base of sliding-window layers (gemma3: 10 000)
    expert_norm: bool = True  # routed experts' top-k weights renormalised to sum to 1 (where the
    # file has no {arch}.expert_weights_norm key: qwen3moe and Mixtral do, qwen2moe does not)


GATING = {1: "softmax", 2: "sigmoid"}  # {arch}.expert_gating_func, as llama.cpp numbers them


@dataclass(frozen=True)
class HParams:
    arch: str
    rules: ArchRules
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # per-head size of q and k
    head_dim_v: int  # per-head size of v
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int  # rotated dims per head (≤ head_dim)
    rope_scale: float  # linear position scaling factor (1.0 = none)
    sliding_window: int  # 0 = none
    sliding_pattern: int  # every Nth layer is global when sliding_window > 0 (0 = all sliding)
    attn_scale: float  # softmax scale on q·k
    # a mixture of experts (n_expert = 0: a dense model): per layer n_expert FFNs of n_ff_exp,
    # n_expert_used of them per token chosen by a router; n_ff_shexp: a shared expert every
    # token goes through (0: none); the first n_dense_lead layers have a dense FFN instead
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    expert_gating: Literal["softmax", "sigmoid"] = "softmax"
    expert_norm: bool = True
    expert_scale: float = 1.0
    n_dense_lead: int = 0

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_expert > 0 and layer >= self.n_dense_lead

    def is_sliding(self, layer: int) -> bool:
        """Whether global layer `layer` attends only to the last `sliding_window` positions."""
        p = self.sliding_pattern
        return bool(self.sliding_window) and (p == 0 or (layer + 1) % p != 0)

    def rope_base_for(self, layer: int) -> float:
        if self.is_sliding(layer) and self.rules.local_rope_base is not None:
            return self.rules.local_rope_base
        return self.rope_base

    def kv_bytes_per_token(self, n_layers: int | None = None, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token costs over `n_layers` layers (default all), f16 by default."""
        n = self.n_layer if n_layers is None else n_layers
        return n * self.n_head_kv * (self.head_dim + self.head_dim_v) * dtype_bytes


def parse_hparams(meta: dict[str, Any], rules: ArchRules, source: str = "model") -> HParams:
    """HParams from GGUF metadata under `rules` (the architecture's); a missing key -> one clear
    error."""
    arch = str(meta.get("general.architecture"))

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is None:
            raise ModelFileError(f"{source}: metadata key {full} is missing (needed for {arch})")
        return default

    n_embd = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_head_kv = get("attention.head_count_kv", n_head)
    head_dim = int(get("attention.key_length", n_embd // n_head))
    n_vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    if not n_vocab:
        raise ModelFileError(
            f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present"
        )
    n_ff = get("feed_forward_length")
    if isinstance(n_ff, list) or isinstance(n_head_kv, list):
        raise UnsupportedError(
            f"{source}: per-layer head counts or FFN sizes are not supported yet"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    rope_scale = 1.0
    if scaling == "linear":
        rope_scale = float(get("rope.scaling.factor", 1.0))
    elif scaling not in ("none", None):
        raise UnsupportedError(
            f"{source}: RoPE scaling type {scaling!r} is not supported (none, linear are)"
        )
    n_expert = int(get("expert_count", 0))
    n_used = int(get("expert_used_count", 0))
    if n_expert and not 0 < n_used <= n_expert:
        raise ModelFileError(
            f"{source}: {arch}.expert_used_count is {n_used}; a mixture of {n_expert} experts "
            f"needs 1 to {n_expert}"
        )
    gating = int(get("expert_gating_func", 1))
    if gating not in GATING:
        raise UnsupportedError(
            f"{source}: {arch}.expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)"
        )
    return HParams(
        arch=arch,
        rules=rules,
        n_layer=int(get("block_count")),
        n_embd=n_embd,
        n_ff=int(n_ff),
        n_head=n_head,
        n_head_kv=int(n_head_kv),
        head_dim=head_dim,
        head_dim_v=int(get("attention.value_length", head_dim)),
        n_vocab=int(n_vocab),
        n_ctx_train=int(get("context_length")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_base=float(get("rope.freq_base", 10_000.0)),
        rope_dim=int(get("rope.dimension_count", head_dim)),
        rope_scale=rope_scale,
        sliding_window=int(get("attention.sliding_window", 0)) if rules.sliding_pattern else 0,
        sliding_pattern=int(get("attention.sliding_window_pattern", rules.sliding_pattern)),
        attn_scale=float(get("attention.scale", head_dim**-0.5)),
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=int(get("expert_feed_forward_length", 0)) or (n_ff // n_used if n_used else 0),
        n_ff_shexp=int(get("expert_shared_feed_forward_length", 0)),
        expert_gating=GATING[gating],  # type: ignore[arg-type]
        expert_norm=bool(get("expert_weights_norm", rules.expert_norm)),
        expert_scale=float(get("expert_weights_scale", 1.0)),
        n_dense_lead=int(get("leading_dense_block_count", 0)),
    )
