"""Write tiny random GGUF models of any architecture Potluck runs and any quantization mix.

The tensors written are those the architecture's module declares (potluck.model.archs), so a new
architecture needs no change here beyond its metadata keys (ARCH_KEYS) and any tensors whose
values its files fix (FIXED: gemma4's rope_freqs).

Types that `gguf.quants.quantize` supports are quantized from random fp32 weights; K-quants (which
it cannot quantize) are written as random blocks whose fp16 scale fields are set to small finite
values, so every reader — ours and the references — decodes the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from potluck.model.archs import architecture, hparams_from_metadata, layer_tensors
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.hparams import HParams

# byte offsets of the fp16 super-block scales (d, dmin) inside one K-quant block (ggml's layout)
_K_SCALE_OFFSETS = {
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
_TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)  # fmt: skip

# metadata an architecture's files carry beyond the keys every file has, with the values of the
# released models (`extra` overrides them); None: a key those files lack
ARCH_KEYS: dict[str, dict[str, Any]] = {
    "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    # granite-3.x-8b's (its attention_multiplier, embedding_multiplier, ... in its HF config)
    "granite": {
        "embedding_scale": 12.0,
        "residual_scale": 0.22,
        "attention.scale": 0.0078125,
        "logit_scale": 16.0,
    },
    # GLM-4.5's: layer 0 dense, one shared expert, a sigmoid router renormalised, times 2.5
    "glm4moe": {
        "leading_dense_block_count": 1,
        "expert_shared_count": 1,
        "expert_gating_func": 2,
        "expert_weights_norm": True,
        "expert_weights_scale": 2.5,
    },
    # DeepSeek-V2-Lite's: layer 0 dense, two shared experts, a softmax router not renormalised
    "deepseek2": {
        "leading_dense_block_count": 1,
        "expert_shared_count": 2,
        "expert_gating_func": 1,
        "expert_weights_scale": 1.0,
    },
    # OLMoE's: no expert width (its experts are feed_forward_length wide)
    "olmoe": {"expert_feed_forward_length": None},
    # Gemma 4's: a sliding layer then a global one (the tiny model's two), their RoPE bases, the
    # output's cap (the tests give the two kinds their shapes: key_length_swa, ...)
    "gemma4": {
        "attention.sliding_window_pattern": [True, False],
        "rope.freq_base": 1_000_000.0,
        "rope.freq_base_swa": 10_000.0,
        "final_logit_softcapping": 30.0,
    },
    # the hybrids' Gated DeltaNet, at the tiny models' scale (n_embd 64): 2 key heads and 4
    # value heads of 16, a convolution of 4 taps; every 4th layer full attention
    **{
        arch: {
            "ssm.conv_kernel": 4,
            "ssm.state_size": 16,
            "ssm.group_count": 2,
            "ssm.time_step_rank": 4,
            "ssm.inner_size": 64,
            "full_attention_interval": 4,
        }
        | ({"rope.dimension_sections": [2, 1, 1, 0]} if arch != "qwen3next" else {})
        for arch in ("qwen35", "qwen35moe", "qwen3next")
    },
}


def _proportional_rope(hp: HParams) -> dict[str, np.ndarray]:
    """gemma4's rope_freqs: its global layers' RoPE rotates a quarter of each head's dims (its
    partial_rotary_factor), the rest divided to a standstill (llama.cpp's converter)."""
    n = hp.rope_dim // 2
    return {"rope_freqs.weight": np.array([1.0] * (n // 4) + [1e30] * (n - n // 4), np.float32)}


# tensors whose values an architecture's files fix rather than learn
FIXED: dict[str, Callable[[HParams], dict[str, np.ndarray]]] = {"gemma4": _proportional_rope}


def random_blocks(
    rng: np.random.Generator, qtype: T, shape: tuple[int, int], std: float
) -> np.ndarray:
    """Raw bytes [rows, bytes_per_row] of a random tensor of logical shape (rows, cols)."""
    rows, cols = shape
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    assert cols % block == 0, f"{qtype.name} needs rows that are a multiple of {block}, got {cols}"
    if qtype in _K_SCALE_OFFSETS:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
        # pick d so that typical |w| is ~std: the quant levels reach ~63*15 for Q4_K-like types
        levels = {
            T.Q2_K: 15 * 3,
            T.Q3_K: 32 * 4,
            T.Q4_K: 63 * 15,
            T.Q5_K: 63 * 31,
            T.Q6_K: 128 * 32,
        }[qtype]
        for off in _K_SCALE_OFFSETS[qtype]:
            d = (rng.uniform(0.5, 1.5, size=(rows, cols // block)) * std * 2 / levels).astype(
                np.float16
            )
            raw[:, :, off : off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
        return raw.reshape(rows, -1)
    w = (rng.standard_normal(shape) * std).astype(np.float32)
    if qtype == T.F32:
        return w
    return gguf.quants.quantize(w, qtype)


def tiny_vocab() -> dict[str, Any]:
    """A byte-level BPE vocabulary: 3 specials + 256 byte tokens + 8 merges (267 tokens)."""
    # GPT-2's printable stand-ins for the 256 byte values
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chars[b] for b in range(256)]
    merges = []
    pairs = [
        ("Ġ", "t"),
        ("Ġ", "a"),
        ("h", "e"),
        ("i", "n"),
        ("r", "e"),
        ("o", "n"),
        ("Ġt", "he"),
        ("e", "r"),
    ]
    for a, b in pairs:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
    }


def write_tiny_model(
    path: Path,
    arch: str,
    tokenizer_from: GGUFFile | None = None,
    qtype: T = T.Q8_0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    n_ff: int = 256,
    tied: bool = True,
    qtypes: dict[str, T] | None = None,
    seed: int = 0,
    extra: dict[str, Any] | None = None,
    add: dict[str, np.ndarray] | None = None,
    n_expert: int = 0,
    n_expert_used: int = 2,
    n_ff_exp: int | None = None,
    n_ff_shexp: int | None = None,
    optional: bool = False,
    rope_dim: int | None = None,
    stds: dict[str, float] | None = None,
    kv_lora_rank: int = 0,
    q_lora_rank: int = 0,
    skip: tuple[str, ...] = (),
) -> Path:
    """A random model of `arch` with the vocabulary of `tokenizer_from` (default: tiny_vocab()).
    qtypes overrides the
    quantization per tensor-name suffix (e.g. {"ffn_down": T.Q6_K}). add: arrays added to F32
    matrices by name (the same seed otherwise gives the same model: a merged LoRA, say).
    n_expert > 0: a mixture of experts (n_expert_used per token, each n_ff_exp wide, default
    n_ff; n_ff_shexp: the shared expert's width where the architecture has one). optional: also
    the tensors the architecture takes where a file has them (llama's q/k/v biases, phi3's
    LongRoPE factors), but those whose names contain one of `skip` (gemma4's attn_v of its
    global layers, one of two forms of the experts' gate and up). rope_dim: dims of each head
    RoPE rotates (default all). stds: the spread of random matrices per tensor-name suffix
    (default 0.08; a router's 1.0). kv_lora_rank > 0:
    multi-head latent attention (deepseek2) whose heads' q·k and v have head_dim dims, rope_dim
    of them RoPE'd, written as llama.cpp's converter does (one kv head of the latent, the heads'
    sizes in key_length_mla / value_length_mla); q_lora_rank > 0: q through that bottleneck."""
    rng = np.random.default_rng(seed)
    hd = head_dim or n_embd // n_head
    tok_meta = tokenizer_from.metadata if tokenizer_from is not None else tiny_vocab()
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    if kv_lora_rank:  # MLA: the cache holds one head, the latent and the shared rope key
        w.add_head_count_kv(1)
        w.add_key_length(kv_lora_rank + (rope_dim or hd))
        w.add_value_length(kv_lora_rank)
        w.add_key_length_mla(hd)
        w.add_value_length_mla(hd)
        w.add_kv_lora_rank(kv_lora_rank)
        if q_lora_rank:
            w.add_q_lora_rank(q_lora_rank)
    else:
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_dimension_count(rope_dim or hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if arch != "gemma3" else 1_000_000.0)
    w.add_vocab_size(vocab)
    if architecture(arch).rules.sliding_pattern:  # (gemma3, gpt-oss)
        w.add_sliding_window(8)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff_exp or n_ff)
        if n_ff_shexp:
            w.add_expert_shared_feed_forward_length(n_ff_shexp)
    for key in _TOKENIZER_KEYS:
        if key in tok_meta:
            _add_value(w, key, tok_meta[key])
    own = {f"{arch}.{key}": value for key, value in ARCH_KEYS.get(arch, {}).items()}
    for key, value in (own | (extra or {})).items():
        w.kv_data[0].pop(key, None)  # (they replace what was written above)
        if value is not None:
            _add_value(w, key, value)

    def tensor(name: str, shape: tuple[int, ...], q: T) -> None:
        for suffix, override in (qtypes or {}).items():
            if suffix in name:
                q = override
        if name.endswith(".ssm_a"):  # -exp(A_log): a decay, negative (as every file's)
            w.add_tensor(name, -np.exp(rng.standard_normal(shape) * 0.5).astype(np.float32))
            return
        if len(shape) == 1 or name.endswith(".bias"):  # F32, as llama.cpp's converter writes
            # norm weights around 1 (gemma's GGUF stores 1 + w already), biases small (also
            # the experts' stacked [E, rows]), attention sinks logits of O(1) either sign
            v = rng.standard_normal(shape).astype(np.float32)
            if "attn_sinks" in name:
                w.add_tensor(name, v)
            elif name.endswith(".bias"):
                w.add_tensor(name, v * 0.1)
            else:
                w.add_tensor(name, v * 0.2 + 1.0)
            return
        # a router's logits spread wide, so that rounding rarely flips an expert's choice
        std = 1.0 if "ffn_gate_inp" in name else 0.08
        for suffix, spread in (stds or {}).items():
            if suffix in name:
                std = spread
        if len(shape) == 3:  # a stack of experts: [E, rows, cols]
            raw = random_blocks(rng, q, (shape[0] * shape[1], shape[2]), std=std)
            raw = raw.reshape(shape[0], shape[1], -1)
        else:
            raw = random_blocks(rng, q, shape, std=std)  # type: ignore[arg-type]
        if add and name in add:
            assert q == T.F32, f"add needs an F32 {name}"
            raw = (raw + add[name]).astype(np.float32)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=q)

    tensor("token_embd.weight", (vocab, n_embd), qtype)
    hp = hparams_from_metadata(_metadata(w), str(path))
    fixed = FIXED[arch](hp) if arch in FIXED else {}
    for t in layer_tensors(hp, 0, n_layer):
        if t.name in fixed:
            w.add_tensor(t.name, fixed[t.name])
        elif t.required or (optional and not any(s in t.name for s in skip)):
            # the router and the shared expert's gate stay F32, as in the files people run
            # (and a convolution's few taps: F32 in every file)
            q = T.F32 if "gate_inp" in t.name or "ssm_conv1d" in t.name else qtype
            tensor(t.name, t.shape, q)
    tensor("output_norm.weight", (n_embd,), T.F32)
    if not tied:
        tensor("output.weight", (vocab, n_embd), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _metadata(w: gguf.GGUFWriter) -> dict[str, Any]:
    """The key-value pairs written so far, as GGUFFile.metadata gives them."""
    return {k: v.value for k, v in w.kv_data[0].items()}


def _add_value(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)
    else:
        raise TypeError(f"cannot write {key}={value!r}")
