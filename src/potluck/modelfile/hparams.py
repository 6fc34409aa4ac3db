"""Model shape from GGUF metadata: one frozen dataclass, with per-architecture rules as data.

The rules of each architecture are declared by its module (model/archs/); `parse_hparams` reads
the keys every architecture shares (`{arch}.block_count`, ...; the experts' keys where a file
has them) under those rules. model/archs `hparams_from_metadata` picks the module."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple, get_args

from potluck.errors import ModelFileError, UnsupportedError

# how the router's logits become the chosen experts' weights: a softmax (or a sigmoid) over all
# experts, the top k of those taken; or "softmax_weight" (gpt-oss): the top k logits taken, a
# softmax over those k
Gating = Literal["softmax", "sigmoid", "softmax_weight"]
GATING: dict[int, Gating] = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}  # as llama.cpp
# numbers {arch}.expert_gating_func
RopeScaling = Literal["none", "linear", "yarn"]  # {arch}.rope.scaling.type
_SCALINGS: dict[str, RopeScaling] = {s: s for s in get_args(RopeScaling)}
# a hybrid's recurrent state per layer and sequence, with the one checkpoint a stage may keep
STATE_COPIES = 2


@dataclass(frozen=True)
class ArchRules:
    """What differs between architectures that the shared graph helpers read, as data (each
    architecture's module in model/archs/ declares its own)."""

    # adjacent pairs (llama's GGUF permutation), half-split, or half-split with interleaved
    # M-RoPE sections (qwen35: {arch}.rope.dimension_sections; text gives every section the
    # token's position)
    rope_style: Literal["norm", "neox", "imrope"]
    # the gated FFN's activation: SwiGLU, GeGLU (tanh), or gpt-oss's clamped SwiGLU
    # (model/graph.py SWIGLU_OAI)
    activation: Literal["silu", "gelu_tanh", "swiglu_oai"]
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (qwen3, gemma3)
    post_norms: bool = False  # norms after attention and after the FFN, before the residual add
    embed_scale_sqrt: bool = False  # multiply embeddings by sqrt(n_embd) (gemma)
    sliding_pattern: int = 0  # every Nth layer is global, the rest use the sliding window (gemma3)
    # RoPE base of sliding-window layers (gemma3: 10 000), where the file has no
    # {arch}.rope.freq_base_swa key
    local_rope_base: float | None = None
    expert_norm: bool = True  # routed experts' top-k weights renormalised to sum to 1 (where the
    # file has no {arch}.expert_weights_norm key: qwen3moe and Mixtral do, qwen2moe does not)
    expert_gating: Gating = "softmax"  # where the file has no {arch}.expert_gating_func key
    qk_norm_full: bool = False  # RMSNorm over all heads of q (of k) together, before RoPE (olmo2)
    # the routed experts' width where the file has no {arch}.expert_feed_forward_length key:
    # feed_forward_length itself (olmoe's converter writes no other), rather than that over
    # expert_used_count (qwen2moe's and qwen3moe's, as llama.cpp reads each)
    experts_n_ff: bool = False
    # soft-capping, cap · tanh(s / cap), of attention's scaled q·k and of the output logits,
    # where the file has no {arch}.attn_logit_softcapping / final_logit_softcapping key (0: none)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # gemma's query_pre_attn_scalar, which GGUF does not carry: the size with this many layers
    # (gemma2's 27B: 46) scales q·k by (n_embd / n_head)^-1/2, every other size by
    # head_dim^-1/2, as llama.cpp (a file's {arch}.attention.scale wins)
    wide_query_scale_layers: int = 0
    divide_logits: bool = False  # the output logits divided by {arch}.logit_scale (granite)
    # sliding-window layers' RoPE without the file's scaling: YaRN's (olmo2's, for Olmo3) and
    # rope_freqs' divisors (gemma4's, which make its global layers' RoPE proportional)
    local_rope_unscaled: bool = False
    # per-head RMSNorms of q and k before RoPE where the file has them (glm4moe: GLM-4.5 has
    # them, GLM-4.5-Air not)
    qk_norm_if_present: bool = False
    # {arch}.rope.scaling.yarn_log_multiplier holds 0.1 · YaRN's mscale_all_dim (deepseek2's
    # converter), which is also its mscale: cos and sin stay unscaled and q·k is scaled by
    # (1 + 0.1 mscale_all_dim ln factor)², as DeepSeek's reference (and llama.cpp) do
    yarn_log_mul_tenths: bool = False
    # {arch}.rope.scaling.yarn_log_multiplier holds YaRN's mscale_all_dim itself (mistral3's
    # converter; mscale 1): cos and sin scaled by mscale(1) / mscale(mscale_all_dim), as
    # transformers' YaRN (and llama.cpp) do, where mscale(m) = 1 + 0.1 m ln factor
    yarn_mscale_all_dim: bool = False
    v_norm: bool = False  # RMSNorm over each head of v, without a weight (gemma4)
    # q·k's scale where the file has no {arch}.attention.scale (0: head_dim^-1/2, or gemma's
    # above; gemma4: 1, its q and k being normed per head)
    attn_scale: float = 0.0
    # q's projection carries a per-head output gate beside each head's q ([q, gate] per head):
    # attention's output times sigmoid(gate) before attn_output (qwen35, qwen3next)
    attn_output_gate: bool = False
    # Gated DeltaNet layers whose value heads outnumber their key heads take key head j // r
    # for value head j (HF's grouped order, qwen3next's files) rather than j % n_k (the tiled
    # order llama.cpp's converter gives qwen35's files)
    delta_grouped: bool = False
    # (metadata key under {arch}., why): files that set one of these (not 0) are refused with
    # the reason (gemma4's per-layer token embeddings)
    unsupported: tuple[tuple[str, str], ...] = ()


class Heads(NamedTuple):
    """One layer's attention shape: its kv heads, the per-head sizes of q and k (head_dim) and
    of v (head_dim_v), and the dims of each head that RoPE rotates."""

    n_head_kv: int
    head_dim: int
    head_dim_v: int
    rope_dim: int


@dataclass(frozen=True)
class HParams:
    arch: str
    rules: ArchRules
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    # kv heads, per-head sizes of q and k, and of v; where sliding-window and global layers
    # differ (layer_heads), those of the kind whose K and V take more per token, which every
    # layer's KV cache rows are then sized by (model/stage.py): heads(i) is layer i's own
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int  # rotated dims per head (≤ head_dim; the global layers' where kinds differ)
    rope_scale: float  # position scaling factor, linear or YaRN's (1.0 = none)
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
    expert_gating: Gating = "softmax"
    expert_norm: bool = True
    expert_scale: float = 1.0
    n_dense_lead: int = 0
    # experts in n_expert_groups groups (0 or 1: none): a token's k are chosen from the
    # n_group_used groups whose two best experts score highest (DeepSeek-V3's routing)
    n_expert_groups: int = 0
    n_group_used: int = 0
    # multi-head latent attention (DeepSeek-V2's MLA; kv_lora_rank = 0: none): k and v of every
    # head come from one latent of kv_lora_rank per token (plus a shared RoPE'd key of rope_dim),
    # cached as one kv head (n_head_kv = 1, head_dim = kv_lora_rank + rope_dim, head_dim_v =
    # kv_lora_rank); each head's q·k has head_dim_mla dims (head_dim_mla - rope_dim without
    # RoPE) and its v head_dim_v_mla; q through a q_lora_rank bottleneck where > 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    head_dim_mla: int = 0
    head_dim_v_mla: int = 0
    # YaRN (rope_scaling "yarn"): frequencies interpolated by 1/rope_scale below the dims that
    # turn fewer than beta_slow times over rope_ctx_orig positions, kept above beta_fast turns,
    # blended between; rope_ctx_orig: the context the model was pretrained with
    rope_scaling: RopeScaling = "none"
    rope_ctx_orig: int = 0  # 0: n_ctx_train
    rope_attn_factor: float = 1.0  # {arch}.rope.scaling.attn_factor: scales cos and sin
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_log_mul: float = 0.0  # YaRN's mscale_all_dim where the rules read it (deepseek2)
    attn_softcap: float = 0.0  # cap of attention's scaled q·k logits (0: none)
    final_softcap: float = 0.0  # cap of the output logits (0: none)
    embed_scale: float = 1.0  # {arch}.embedding_scale: the embeddings multiplied (granite)
    residual_scale: float = 1.0  # {arch}.residual_scale: each branch's output, before its add
    logit_scale: float = 1.0  # the output logits divided by it (granite's {arch}.logit_scale)
    # (sliding-window layers', global layers') attention shapes where they differ (gemma4:
    # {arch}.attention.key_length_swa, value_length_swa, rope.dimension_count_swa and a
    # head_count_kv per layer); None: every layer's is the one above
    layer_heads: tuple[Heads, Heads] | None = None
    local_rope_base: float | None = None  # sliding-window layers' RoPE base (None: rope_base)
    # Llama 4's attention temperature ({arch}.attention.temperature_scale, mistral3's Ministral
    # 3): q at position p times 1 + attn_temp_scale · ln(1 + floor(p / n_orig)), n_orig the
    # original context (rope_ctx_orig or n_ctx_train); 0: none
    attn_temp_scale: float = 0.0
    yarn_mscale_all: float = 0.0  # YaRN's mscale_all_dim where the rules read it (mistral3)
    # M-RoPE's sections (rope_style "imrope"): rotated dim pairs per position kind
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)
    # hybrid recurrent models (qwen35, qwen3next): the layers that are Gated DeltaNet layers
    # (a fixed-size state per sequence instead of a KV cache) and their shape: a short causal
    # convolution of ssm_d_conv taps over q, k and v, then the delta rule over ssm_n_group key
    # heads and ssm_dt_rank value heads of ssm_d_state each (ssm_d_inner = value heads × their
    # size); () for a model without any
    recurrent: tuple[bool, ...] = ()
    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    ssm_dt_rank: int = 0

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_expert > 0 and layer >= self.n_dense_lead

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a recurrent state instead of a KV cache: such a state cannot be
        rewound to an earlier position."""
        return any(self.recurrent)

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent) and self.recurrent[layer]

    def attention_layers(self, start: int = 0, stop: int | None = None) -> int:
        """How many of the layers [start, stop) attend over a KV cache."""
        stop = self.n_layer if stop is None else stop
        return sum(not self.is_recurrent(i) for i in range(start, stop))

    @property
    def conv_channels(self) -> int:
        """A Gated DeltaNet layer's convolved channels: q and k (key heads), v (value heads)."""
        return 2 * self.ssm_n_group * self.ssm_d_state + self.ssm_d_inner

    @property
    def delta_head_v(self) -> int:
        return self.ssm_d_inner // self.ssm_dt_rank if self.ssm_dt_rank else 0

    def state_elements(self) -> tuple[int, int]:
        """f32 elements of one recurrent layer's state per sequence: the convolution's last
        ssm_d_conv - 1 inputs, and the delta rule's matrix per value head."""
        conv = (self.ssm_d_conv - 1) * self.conv_channels
        return conv, self.delta_head_v**2 * self.ssm_dt_rank

    def state_bytes(self, start: int = 0, stop: int | None = None) -> int:
        """Bytes of recurrent state one sequence may hold over the layers [start, stop): its
        state and one checkpoint of it (model/kv_cache.py), fixed whatever its length (f32, as
        llama.cpp keeps it)."""
        stop = self.n_layer if stop is None else stop
        n = sum(self.is_recurrent(i) for i in range(start, stop))
        return n * STATE_COPIES * sum(self.state_elements()) * 4

    def is_sliding(self, layer: int) -> bool:
        """Whether global layer `layer` attends only to the last `sliding_window` positions."""
        p = self.sliding_pattern
        return bool(self.sliding_window) and (p == 0 or (layer + 1) % p != 0)

    def heads(self, layer: int) -> Heads:
        """Layer `layer`'s attention shape (of its kind where sliding and global layers differ)."""
        if self.layer_heads is not None:
            return self.layer_heads[0 if self.is_sliding(layer) else 1]
        return Heads(self.n_head_kv, self.head_dim, self.head_dim_v, self.rope_dim)

    def rope_base_for(self, layer: int) -> float:
        if self.is_sliding(layer) and self.local_rope_base is not None:
            return self.local_rope_base
        return self.rope_base

    def rope_ext(self) -> tuple[int, float, float, float, float, float]:
        """ggml_rope_ext's (n_ctx_orig, freq_scale, ext_factor, attn_factor, beta_fast,
        beta_slow), as llama.cpp derives them from the file (llama-context.cpp)."""
        n_orig = self.rope_ctx_orig or self.n_ctx_train
        factor = self.rope_scale
        if self.rope_scaling != "yarn":
            return n_orig, 1.0 / factor, 0.0, self.rope_attn_factor, 32.0, 1.0
        # YaRN scales cos and sin by 1 + 0.1 ln(factor) (for factor > 1); ggml's rope multiplies
        # by that itself whenever ext_factor is not 0, so the factor passed here cancels it
        mscale = 1.0 + 0.1 * math.log(factor) if factor > 1.0 else 1.0
        if self.yarn_log_mul:  # (deepseek2: mscale = mscale_all_dim, their ratio 1)
            mscale = 1.0
        elif self.yarn_mscale_all and factor > 1.0:  # mscale(1) / mscale(mscale_all_dim)
            mscale /= 1.0 + 0.1 * self.yarn_mscale_all * math.log(factor)
        attn = mscale / (1.0 + 0.1 * math.log(factor)) * self.rope_attn_factor
        return n_orig, 1.0 / factor, 1.0, attn, self.yarn_beta_fast, self.yarn_beta_slow

    def kv_bytes_per_token(self, n_layers: int | None = None, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token costs over `n_layers` attention layers (default all the
        model's: a hybrid's recurrent layers keep none), f16 by default."""
        n = self.attention_layers() if n_layers is None else n_layers
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

    for key, why in rules.unsupported:
        if value := get(key, 0):
            raise UnsupportedError(f"{source}: {arch}.{key} is {value}: {why}")
    n_embd = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_head_kv = get("attention.head_count_kv", n_head)  # a number, or one per layer (gemma4)
    head_dim = int(get("attention.key_length", n_embd // n_head))
    n_vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    if not n_vocab:
        raise ModelFileError(
            f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present"
        )
    n_ff = get("feed_forward_length")
    if isinstance(n_ff, list):
        raise UnsupportedError(f"{source}: per-layer FFN sizes are not supported yet")
    scaling = _SCALINGS.get(str(meta.get(f"{arch}.rope.scaling.type") or "none"))
    if scaling is None:
        raise UnsupportedError(
            f"{source}: RoPE scaling type {meta[f'{arch}.rope.scaling.type']!r} is not "
            f"supported ({', '.join(_SCALINGS)} are)"
        )
    rope_scale = float(get("rope.scaling.factor", 1.0)) if scaling != "none" else 1.0
    pattern = get("attention.sliding_window_pattern", rules.sliding_pattern)
    # a sliding window where the architecture has one, or where a file lists its sliding layers
    # (Olmo3's, as olmo2); phi3's files name a window that llama.cpp leaves off
    windowed = bool(rules.sliding_pattern) or isinstance(pattern, list)
    wide = rules.wide_query_scale_layers == int(get("block_count"))
    query_size = n_embd / n_head if wide else head_dim  # gemma's query_pre_attn_scalar
    # MLA (deepseek2): key_length and value_length are the cached latent's; q·k has the
    # decompressed heads' key_length_mla dims, and scales by their size
    kv_lora_rank = int(get("attention.kv_lora_rank", 0))
    head_dim_mla = int(get("attention.key_length_mla", 0)) if kv_lora_rank else 0
    query_size = head_dim_mla or query_size
    fixed_scale = f"{arch}.attention.scale" in meta or bool(rules.attn_scale)
    attn_scale = float(get("attention.scale", rules.attn_scale or query_size**-0.5))
    log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    log_mul = log_mul if rules.yarn_log_mul_tenths and scaling == "yarn" else 0.0
    if log_mul and rope_scale > 1.0:  # DeepSeek's YaRN: q·k scaled by mscale_all_dim's mscale²
        attn_scale *= (1.0 + 0.1 * log_mul * math.log(rope_scale)) ** 2
    if kv_lora_rank and not head_dim_mla:
        raise UnsupportedError(
            f"{source}: an MLA file without {arch}.attention.key_length_mla (a conversion "
            "older than llama.cpp's split attn_k_b / attn_v_b) is not supported; convert it again"
        )
    n_expert = int(get("expert_count", 0))
    n_used = int(get("expert_used_count", 0))
    if n_expert and not 0 < n_used <= n_expert:
        raise ModelFileError(
            f"{source}: {arch}.expert_used_count is {n_used}; a mixture of {n_expert} experts "
            f"needs 1 to {n_expert}"
        )
    gating = get("expert_gating_func", -1)
    if gating != -1 and gating not in GATING:
        known = ", ".join(f"{k} {v}" for k, v in GATING.items())
        raise UnsupportedError(
            f"{source}: {arch}.expert_gating_func {gating} is not supported ({known})"
        )
    n_groups = int(get("expert_group_count", 0))
    n_groups_used = int(get("expert_group_used_count", 0))
    if n_groups > 1 and not (n_expert % n_groups == 0 and 0 < n_groups_used <= n_groups):
        raise ModelFileError(
            f"{source}: {n_expert} experts in {n_groups} groups, {n_groups_used} used: the "
            "groups must divide the experts, and 1 to all of the groups be used"
        )
    n_nextn = int(get("nextn_predict_layers", 0))  # MTP blocks after the model's own layers
    n_ff_exp = int(get("expert_feed_forward_length", 0)) or (
        (n_ff if rules.experts_n_ff else n_ff // n_used) if n_used else 0
    )
    hp = HParams(
        arch=arch,
        rules=rules,
        n_layer=int(get("block_count")) - n_nextn,
        n_embd=n_embd,
        n_ff=int(n_ff),
        n_head=n_head,
        n_head_kv=int(n_head_kv[0] if isinstance(n_head_kv, list) else n_head_kv),
        head_dim=head_dim,
        head_dim_v=int(get("attention.value_length", head_dim)),
        n_vocab=int(n_vocab),
        n_ctx_train=int(get("context_length")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_base=float(get("rope.freq_base", 10_000.0)),
        rope_dim=int(get("rope.dimension_count", head_dim)),
        rope_scale=rope_scale,
        sliding_window=int(get("attention.sliding_window", 0)) if windowed else 0,
        sliding_pattern=sliding_period(pattern, f"{source}: {arch}"),
        attn_scale=attn_scale,
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp,
        # its own key (qwen2moe), or so many experts' width together (glm4moe, deepseek2)
        n_ff_shexp=int(get("expert_shared_feed_forward_length", 0))
        or int(get("expert_shared_count", 0)) * n_ff_exp,
        expert_gating=GATING[gating] if gating != -1 else rules.expert_gating,
        expert_norm=bool(get("expert_weights_norm", rules.expert_norm)),
        expert_scale=float(get("expert_weights_scale", 1.0)) or 1.0,  # (0: none, as llama.cpp)
        n_dense_lead=int(get("leading_dense_block_count", 0)),
        n_expert_groups=n_groups if n_groups > 1 else 0,
        n_group_used=n_groups_used if n_groups > 1 else 0,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=int(get("attention.q_lora_rank", 0)),
        head_dim_mla=head_dim_mla,
        head_dim_v_mla=int(get("attention.value_length_mla", 0)) if kv_lora_rank else 0,
        rope_scaling=scaling,
        rope_ctx_orig=int(get("rope.scaling.original_context_length", 0)),
        rope_attn_factor=float(get("rope.scaling.attn_factor", 1.0)),
        yarn_beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
        yarn_beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
        yarn_log_mul=log_mul,
        attn_softcap=float(get("attn_logit_softcapping", rules.attn_softcap)),
        final_softcap=float(get("final_logit_softcapping", rules.final_softcap)),
        embed_scale=float(get("embedding_scale", 1.0)),
        residual_scale=float(get("residual_scale", 1.0)),
        logit_scale=float(get("logit_scale", 1.0)) if rules.divide_logits else 1.0,
        local_rope_base=None
        if rules.local_rope_base is None
        else float(get("rope.freq_base_swa", rules.local_rope_base)),
        attn_temp_scale=float(get("attention.temperature_scale", 0.0)),
        yarn_mscale_all=float(get("rope.scaling.yarn_log_multiplier", 0.0))
        if rules.yarn_mscale_all_dim and scaling == "yarn"
        else 0.0,
    )
    return _layer_heads(_recurrent(hp, get, int(get("block_count")), source), n_head_kv, get,
                        fixed_scale, source)  # fmt: skip


def _recurrent(hp: HParams, get: Any, n_blocks: int, source: str) -> HParams:
    """hp with its Gated DeltaNet layers and their shape where the file has them
    ({arch}.ssm.*: qwen35, qwen3next), and its M-RoPE sections (rope_style "imrope")."""
    where = f"{source}: {hp.arch}"
    if hp.rules.rope_style == "imrope":
        sections = [int(s) for s in get("rope.dimension_sections")]
        if len(sections) != 4 or sum(sections) * 2 > hp.rope_dim:
            raise ModelFileError(
                f"{where}.rope.dimension_sections {sections}: 4 sections of at most "
                f"{hp.rope_dim // 2} rotated pairs in all are needed"
            )
        hp = replace(hp, rope_sections=(sections[0], sections[1], sections[2], sections[3]))
    if not get("ssm.conv_kernel", 0):
        return hp
    marked = get("attention.recurrent_layers", [])
    if marked:  # one flag per block (MTP blocks after the model's own are not recurrent)
        recurrent = tuple(bool(r) for r in marked[: hp.n_layer])
    else:
        every = int(get("full_attention_interval", 4))
        recurrent = tuple((i + 1) % every != 0 for i in range(hp.n_layer))
    hp = replace(
        hp,
        recurrent=recurrent,
        ssm_d_conv=int(get("ssm.conv_kernel")),
        ssm_d_inner=int(get("ssm.inner_size")),
        ssm_d_state=int(get("ssm.state_size")),
        ssm_n_group=int(get("ssm.group_count")),
        ssm_dt_rank=int(get("ssm.time_step_rank")),
    )
    if len(recurrent) < hp.n_layer or hp.ssm_dt_rank % max(hp.ssm_n_group, 1):
        raise ModelFileError(
            f"{where}: {len(recurrent)} recurrent-layer flags for {n_blocks} blocks, "
            f"{hp.ssm_dt_rank} value heads over {hp.ssm_n_group} key heads: the flags must "
            "cover every layer and the key heads divide the value heads"
        )
    if hp.ssm_d_inner != hp.ssm_dt_rank * hp.ssm_d_state:
        raise UnsupportedError(
            f"{where}: value heads of {hp.ssm_d_inner // hp.ssm_dt_rank} and key heads of "
            f"{hp.ssm_d_state}: the delta rule here needs them equal"
        )
    return hp


def _layer_heads(
    hp: HParams, kv: int | list[int], get: Any, fixed_scale: bool, source: str
) -> HParams:
    """hp with its sliding-window and global layers' attention shapes where they differ (gemma4:
    {arch}.attention.key_length_swa, value_length_swa, rope.dimension_count_swa, a head_count_kv
    per layer); kv: head_count_kv as the file has it; fixed_scale: whether q·k's scale is given
    (by the file or the rules) rather than derived from one head size."""
    where = f"{source}: {hp.arch}"
    slides = [hp.is_sliding(i) for i in range(hp.n_layer)]
    counts = [int(c) for c in kv] if isinstance(kv, list) else [int(kv)] * hp.n_layer
    by_kind = {
        s: {c for c, t in zip(counts, slides, strict=False) if t == s} for s in (True, False)
    }
    if len(counts) < hp.n_layer or any(len(c) > 1 for c in by_kind.values()):
        raise UnsupportedError(
            f"{where}.attention.head_count_kv {counts}: kv heads that differ other than between "
            "sliding-window and global layers are not supported"
        )
    n_kv = {s: min(c) if c else counts[0] for s, c in by_kind.items()}
    full = Heads(n_kv[False], hp.head_dim, hp.head_dim_v, hp.rope_dim)
    local = Heads(
        n_kv[True],
        int(get("attention.key_length_swa", hp.head_dim)),
        int(get("attention.value_length_swa", hp.head_dim_v)),
        int(get("rope.dimension_count_swa", hp.rope_dim)),
    )
    used = [h for h, kind in ((local, True), (full, False)) if kind in slides]
    if any(h.head_dim != hp.head_dim for h in used) and not fixed_scale:
        raise UnsupportedError(
            f"{where}: sliding-window layers' heads of {local.head_dim} and global ones of "
            f"{full.head_dim} without {hp.arch}.attention.scale: which q·k scale each takes is "
            "not known"
        )
    if len(set(used)) == 1:  # one shape for every layer
        (only,) = set(used)
        return replace(hp, n_head_kv=only.n_head_kv, head_dim=only.head_dim,
                       head_dim_v=only.head_dim_v, rope_dim=only.rope_dim)  # fmt: skip
    wide = max(full, local, key=lambda h: h.n_head_kv * (h.head_dim + h.head_dim_v))
    return replace(hp, n_head_kv=wide.n_head_kv, head_dim=wide.head_dim,
                   head_dim_v=wide.head_dim_v, layer_heads=(local, full))  # fmt: skip


def sliding_period(pattern: int | list[bool], where: str) -> int:
    """{arch}.attention.sliding_window_pattern as HParams.sliding_pattern: a number as it is; a
    list (per layer, whether it slides: Olmo3's files) as the N where every Nth layer is global
    (0: all slide); any other list -> UnsupportedError."""
    if not isinstance(pattern, list):
        return int(pattern)
    for n in range(len(pattern) + 1):
        if all(bool(s) == (n == 0 or (i + 1) % n != 0) for i, s in enumerate(pattern)):
            return n
    slides = [i for i, s in enumerate(pattern) if s]
    raise UnsupportedError(
        f"{where}.attention.sliding_window_pattern: sliding layers {slides} are not all but "
        "every Nth layer; such a pattern is not supported"
    )
