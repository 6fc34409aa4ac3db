"""transformers' own Qwen3.5, Qwen3.5-MoE and Qwen3-Next text models over a GGUF file's tensors:
the independent reference for the hybrid (Gated DeltaNet + gated attention) architectures.

transformers' GGUF loader does not read `qwen35`, `qwen35moe` or `qwen3next`, so `hf_hybrid`
inverts what llama.cpp's converter (conversion/qwen.py: Qwen3NextModel,
_LinearAttentionVReorderBase, Qwen3_5TextModel, Qwen3_5MoeTextModel; Qwen2MoeModel for the
experts) does to a checkpoint:

- Every zero-centred RMSNorm (transformers applies it as x̂ · (1 + w): the blocks' two norms,
  q_norm, k_norm, the final norm) is written as 1 + w; the linear attention's gated norm
  (linear_attn.norm, applied as x̂ · w) as it is.
- A_log is written as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the depthwise conv1d's
  [C, 1, K] squeezed to ssm_conv1d [C, K].
- qwen35 / qwen35moe with fewer K heads than V heads: transformers gives K head g the r = n_v / n_k
  consecutive V heads g·r … g·r + r - 1 (repeat_interleave: "grouped" order), ggml broadcasts
  K head j % n_k to V head j ("tiled" order), so the converter moves every V head from
  grouped slot g·r + i to tiled slot i·n_k + g: the V rows of in_proj_qkv (attn_qkv), the rows
  of in_proj_z (attn_gate), in_proj_b (ssm_beta), in_proj_a (ssm_alpha), A_log, dt_bias, the V
  channels of conv1d and the columns of out_proj (ssm_out).
- qwen3next keeps the grouped order: its fused in_proj_qkvz ([q, k, v, z] per K head) is split
  into attn_qkv (all q, all k, all v) and attn_gate (z); older files carry it whole as ssm_in.
  in_proj_ba (per K head: its r betas, then its r alphas) is ssm_ba as it is.
- The experts' fused gate_up_proj [E, 2F, D] (gate rows first) is split into ffn_gate_exps and
  ffn_up_exps; the shared expert's sigmoid gate [1, D] is written as it is (ggml {D, 1}).
- The full-attention layers' q_proj [2·H·hd, D] (per head its q rows, then its gate rows) is
  written as it is: llama.cpp's graph splits the interleave itself. (`--fuse-qkv` files hold
  q_proj, k_proj and v_proj stacked in one attn_qkv; `--fuse-gate-up-exps` ones the experts'
  gate and up stacked in one ffn_gate_up_exps: both are read too.)
- The rope: a quarter (rope.dimension_count / key_length) of each head, NeoX halves; qwen35's
  interleaved M-RoPE sections (rope.dimension_sections) change nothing for text, whose three
  position rows are equal.

`to_gguf` does the forward direction the way that converter does (and names tensors with
gguf-py's own name map for the architecture), for the self-test that proves the inverse
(tests/unit/test_hybrid_reference.py) and for anyone who needs such a file from a transformers
model. Both force the torch code paths: fp32, eager attention, eager experts (with neither fla
nor causal-conv1d installed, and on CPU, transformers' own torch delta rule and conv1d run).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from gguf import Keys

from potluck.modelfile.gguf_file import GGUFFile

from ggufgen import tiny_vocab

# (config class, model class) of transformers' text-only model for each GGUF architecture
HF_CLASSES: dict[str, tuple[str, str]] = {
    "qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}
_GGUF_ARCH = {
    "qwen35": gguf.MODEL_ARCH.QWEN35,
    "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE,
    "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT,
}
_TILED_V = {"qwen35", "qwen35moe"}  # files whose V heads llama.cpp's converter tiles
_MOE = {"qwen35moe", "qwen3next"}
# llama.cpp's LLM_KV_ATTENTION_RECURRENT_LAYERS (gguf-py 0.19's Keys lacks it): a bool per block
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"
_EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}


# --- GGUF -> transformers ------------------------------------------------------------------------


def hf_hybrid(path: Path) -> torch.nn.Module:
    """transformers' model of the file's architecture over its tensors, dequantized to fp32, in
    eval mode. The config comes from the file's metadata (and whether it has output.weight);
    MTP blocks after block_count - nextn_predict_layers are left out."""
    f = GGUFFile(path)
    arch = f.arch
    if arch not in HF_CLASSES:
        raise ValueError(f"{path}: architecture {arch!r} is not one of {sorted(HF_CLASSES)}")
    config = hf_config(f.metadata, tied=not f.has("output.weight"))
    model_cls = getattr(transformers, HF_CLASSES[arch][1])
    model = model_cls(config).float()
    state = _hf_state(f, config, arch)
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed:
        raise ValueError(f"{path}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    return model.eval()


def hf_config(meta: Mapping[str, Any], tied: bool) -> Any:
    """transformers' text config for a qwen35 / qwen35moe / qwen3next file's metadata."""
    arch = meta[Keys.General.ARCHITECTURE]
    missing = object()

    def key(template: str, default: Any = missing) -> Any:
        name = template.format(arch=arch)
        if name in meta:
            return meta[name]
        if default is missing:
            raise ValueError(f"metadata key {name} is missing")
        return default

    n_layer = key(Keys.LLM.BLOCK_COUNT) - key(Keys.LLM.NEXTN_PREDICT_LAYERS, 0)
    head_dim = key(Keys.Attention.KEY_LENGTH)
    if key(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise ValueError(f"{arch}: key_length {head_dim} ≠ value_length (transformers has one)")
    rope_dim = key(Keys.Rope.DIMENSION_COUNT)
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(key(Keys.Rope.FREQ_BASE)),
        "partial_rotary_factor": rope_dim / head_dim,
    }
    if int(head_dim * rope["partial_rotary_factor"]) != rope_dim:
        raise ValueError(f"{arch}: rope.dimension_count {rope_dim} is no fraction of {head_dim}")
    if arch in _TILED_V:  # interleaved M-RoPE: (t, h, w) sections of the rotated pairs
        sections = list(key(Keys.Rope.DIMENSION_SECTIONS))
        rope |= {"mrope_section": sections[:3], "mrope_interleaved": True}
    recurrent = key(RECURRENT_LAYERS, None)
    if recurrent is None:  # as llama.cpp: every interval-th layer is full attention
        interval = key(Keys.LLM.FULL_ATTENTION_INTERVAL, 4)
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
    n_v = key(Keys.SSM.TIME_STEP_RANK)
    n_ff = key(Keys.LLM.FEED_FORWARD_LENGTH, 0)
    kwargs: dict[str, Any] = {
        "vocab_size": key(Keys.LLM.VOCAB_SIZE, None) or len(meta[Keys.Tokenizer.LIST]),
        "hidden_size": key(Keys.LLM.EMBEDDING_LENGTH),
        "num_hidden_layers": n_layer,
        "num_attention_heads": key(Keys.Attention.HEAD_COUNT),
        "num_key_value_heads": key(Keys.Attention.HEAD_COUNT_KV),
        "head_dim": head_dim,
        "rms_norm_eps": key(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": key(Keys.LLM.CONTEXT_LENGTH),
        "rope_parameters": rope,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n_layer]],
        "linear_conv_kernel_dim": key(Keys.SSM.CONV_KERNEL),
        "linear_key_head_dim": key(Keys.SSM.STATE_SIZE),
        "linear_value_head_dim": key(Keys.SSM.INNER_SIZE) // n_v,
        "linear_num_key_heads": key(Keys.SSM.GROUP_COUNT),
        "linear_num_value_heads": n_v,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": tied,
        **_EAGER,
    }
    if arch in _MOE:
        used = key(Keys.LLM.EXPERT_USED_COUNT)
        kwargs |= {
            "num_experts": key(Keys.LLM.EXPERT_COUNT),
            "num_experts_per_tok": used,
            # (llama.cpp's defaults where a file lacks the widths)
            "moe_intermediate_size": key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, 0) or n_ff // used,
            "shared_expert_intermediate_size": key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)
            or n_ff,
        }
    else:
        kwargs["intermediate_size"] = n_ff
    if arch == "qwen3next":  # llama.cpp: every layer MoE, the top-k weights renormalised
        shexp = kwargs["shared_expert_intermediate_size"]
        kwargs |= {"intermediate_size": n_ff or shexp, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "norm_topk_prob": True}  # fmt: skip
    return getattr(transformers, HF_CLASSES[arch][0])(**kwargs)


def grouped_v_heads(w: torch.Tensor, dim: int, n_k: int, head: int) -> torch.Tensor:
    """Undo llama.cpp's _reorder_v_heads along `dim`: V heads (`head` rows each) from tiled
    order (slot i·n_k + g: the i-th V head of K head g) back to transformers' grouped order
    (slot g·r + i)."""
    n = w.shape[dim]
    r = n // (n_k * head)
    # idx[(g·r + i)·head + h] = (i·n_k + g)·head + h
    idx = torch.arange(n).reshape(r, n_k, head).transpose(0, 1).reshape(n)
    return w.index_select(dim, idx)


def _dequantized(f: GGUFFile, name: str) -> torch.Tensor:
    info = f.tensors.get(name)
    if info is None:
        raise ValueError(f"{f.path}: tensor {name!r} is missing")
    w = np.array(gguf.quants.dequantize(f.raw(name), info.qtype), np.float32)  # (writable)
    return torch.from_numpy(w.reshape(info.shape))


def _hf_state(f: GGUFFile, config: Any, arch: str) -> dict[str, torch.Tensor]:
    """transformers' state dict from the file's tensors (llama.cpp's conversion undone)."""

    def get(name: str) -> torch.Tensor:
        return _dequantized(f, name)

    def norm(name: str) -> torch.Tensor:  # zero-centred: the file holds 1 + w
        return get(name) - 1.0

    state = {
        "model.embed_tokens.weight": get("token_embd.weight"),
        "model.norm.weight": norm("output_norm.weight"),
    }
    if f.has("output.weight"):
        state["lm_head.weight"] = get("output.weight")
    for i, kind in enumerate(config.layer_types):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        state[q + "input_layernorm.weight"] = norm(p + "attn_norm.weight")
        state[q + "post_attention_layernorm.weight"] = norm(p + "post_attention_norm.weight")
        if kind == "full_attention":
            state |= _attention(f, p, q + "self_attn.", config)
        elif arch == "qwen3next":
            state |= _qwen3next_delta_net(f, p, q + "linear_attn.", config)
        else:
            state |= _qwen35_delta_net(f, p, q + "linear_attn.", config)
        state |= _moe(f, p, q + "mlp.") if arch in _MOE else _dense_ffn(f, p, q + "mlp.")
    return state


def _attention(f: GGUFFile, p: str, q: str, config: Any) -> dict[str, torch.Tensor]:
    """A full-attention layer's tensors; q_proj [2·H·hd, D] holds per head its q rows then its
    gate rows, in the file as in transformers. (--fuse-qkv files: q, k and v in one attn_qkv.)"""
    if f.has(p + "attn_qkv.weight"):
        nq = 2 * config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        wq, wk, wv = _dequantized(f, p + "attn_qkv.weight").split([nq, kv, kv])
    else:
        wq, wk, wv = (_dequantized(f, p + f"attn_{x}.weight") for x in "qkv")
    return {
        q + "q_proj.weight": wq,
        q + "k_proj.weight": wk,
        q + "v_proj.weight": wv,
        q + "o_proj.weight": _dequantized(f, p + "attn_output.weight"),
        q + "q_norm.weight": _dequantized(f, p + "attn_q_norm.weight") - 1.0,  # zero-centred
        q + "k_norm.weight": _dequantized(f, p + "attn_k_norm.weight") - 1.0,
    }


def _qwen35_delta_net(f: GGUFFile, p: str, q: str, config: Any) -> dict[str, torch.Tensor]:
    """A qwen35 / qwen35moe Gated DeltaNet's tensors, V heads back in grouped order."""
    n_k, hv = config.linear_num_key_heads, config.linear_value_head_dim
    key_dim = n_k * config.linear_key_head_dim
    tiled = n_k != config.linear_num_value_heads  # (the converter reorders only then)

    def get(name: str, dim: int = 0, head: int = 0) -> torch.Tensor:
        """The tensor; head > 0: its V heads of `head` rows along `dim` regrouped."""
        w = _dequantized(f, p + name)
        return grouped_v_heads(w, dim, n_k, head) if head and tiled else w

    qkv = get("attn_qkv.weight")  # [2·n_k·hk + n_v·hv, D]: all q, all k, then the V heads
    conv = get("ssm_conv1d.weight")  # [C, K]: the same channels
    v, conv_v = qkv[2 * key_dim :], conv[2 * key_dim :]
    if tiled:
        v, conv_v = grouped_v_heads(v, 0, n_k, hv), grouped_v_heads(conv_v, 0, n_k, hv)
    return {
        q + "in_proj_qkv.weight": torch.cat([qkv[: 2 * key_dim], v]),
        q + "in_proj_z.weight": get("attn_gate.weight", 0, hv),
        q + "in_proj_b.weight": get("ssm_beta.weight", 0, 1),
        q + "in_proj_a.weight": get("ssm_alpha.weight", 0, 1),
        q + "conv1d.weight": torch.cat([conv[: 2 * key_dim], conv_v]).unsqueeze(1),  # [C, 1, K]
        q + "dt_bias": get("ssm_dt.bias", 0, 1),
        q + "A_log": torch.log(-get("ssm_a", 0, 1)),  # the file holds -exp(A_log)
        q + "norm.weight": get("ssm_norm.weight"),  # (applied as w, not 1 + w: as it is)
        q + "out_proj.weight": get("ssm_out.weight", 1, hv),  # [D, n_v·hv]: its columns
    }


def _qwen3next_delta_net(f: GGUFFile, p: str, q: str, config: Any) -> dict[str, torch.Tensor]:
    """A qwen3next Gated DeltaNet's tensors: in_proj_qkvz rebuilt from attn_qkv and attn_gate
    (an older file's ssm_in is it already), the rest as they are (grouped order throughout)."""
    n_k, hk = config.linear_num_key_heads, config.linear_key_head_dim
    vr = config.linear_num_value_heads // n_k * config.linear_value_head_dim  # V rows per K head
    if f.has(p + "attn_qkv.weight"):  # (llama.cpp too takes these over an ssm_in)
        qkv = _dequantized(f, p + "attn_qkv.weight")  # [n_k·hk | n_k·hk | n_k·vr, D]
        z = _dequantized(f, p + "attn_gate.weight")  # [n_k·vr, D]
        d = qkv.shape[1]
        q_, k_, v_ = qkv.split([n_k * hk, n_k * hk, n_k * vr])
        # per K head g: its q, k, V heads and z rows, one K head after another
        parts = [x.reshape(n_k, -1, d) for x in (q_, k_, v_, z)]
        qkvz = torch.cat(parts, dim=1).reshape(-1, d)
    else:
        qkvz = _dequantized(f, p + "ssm_in.weight")
    return {
        q + "in_proj_qkvz.weight": qkvz,
        q + "in_proj_ba.weight": _dequantized(f, p + "ssm_ba.weight"),  # per K head: β's, α's
        q + "conv1d.weight": _dequantized(f, p + "ssm_conv1d.weight").unsqueeze(1),
        q + "dt_bias": _dequantized(f, p + "ssm_dt.bias"),
        q + "A_log": torch.log(-_dequantized(f, p + "ssm_a")),
        q + "norm.weight": _dequantized(f, p + "ssm_norm.weight"),
        q + "out_proj.weight": _dequantized(f, p + "ssm_out.weight"),
    }


def _dense_ffn(f: GGUFFile, p: str, q: str) -> dict[str, torch.Tensor]:
    return {
        q + f"{proj}_proj.weight": _dequantized(f, p + f"ffn_{proj}.weight")
        for proj in ("gate", "up", "down")
    }


def _moe(f: GGUFFile, p: str, q: str) -> dict[str, torch.Tensor]:
    """The router, the experts (gate and up fused again: [E, 2F, D], gate rows first) and the
    shared expert with its sigmoid gate ([1, D]; the file's {D, 1}, or {D} from other writers)."""
    if f.has(p + "ffn_gate_up_exps.weight"):  # (llama.cpp also reads them fused)
        gate_up = _dequantized(f, p + "ffn_gate_up_exps.weight")
    else:
        gate = _dequantized(f, p + "ffn_gate_exps.weight")  # [E, F, D]
        gate_up = torch.cat([gate, _dequantized(f, p + "ffn_up_exps.weight")], dim=1)
    state = {
        q + "gate.weight": _dequantized(f, p + "ffn_gate_inp.weight"),  # [E, D]
        q + "experts.gate_up_proj": gate_up,
        q + "experts.down_proj": _dequantized(f, p + "ffn_down_exps.weight"),  # [E, D, F]
        q + "shared_expert_gate.weight": _dequantized(f, p + "ffn_gate_inp_shexp.weight").reshape(
            1, -1
        ),
    }
    for proj in ("gate", "up", "down"):
        state[q + f"shared_expert.{proj}_proj.weight"] = _dequantized(
            f, p + f"ffn_{proj}_shexp.weight"
        )
    return state


# --- transformers -> GGUF (llama.cpp's converter) ------------------------------------------------


def to_gguf(
    model: torch.nn.Module,
    path: Path,
    arch: str,
    legacy_ssm_in: bool = False,
    recurrent_layers: bool = True,
    fused: bool = False,
) -> Path:
    """Write `model` (of HF_CLASSES[arch]) as llama.cpp's converter does (`--outtype f32`): its
    metadata keys, a tiny gpt2 vocabulary (ggufgen.tiny_vocab) padded with [PAD{i}] tokens to
    the model's vocab_size, every tensor F32. legacy_ssm_in (qwen3next): in_proj_qkvz whole as
    ssm_in, as the converter wrote it before it split it. recurrent_layers=False: without
    {arch}.attention.recurrent_layers, as from a config.json without layer_types (llama.cpp then
    counts full_attention_interval). fused: as `--fuse-qkv --fuse-gate-up-exps` (the full
    attention's q, k, v in one attn_qkv; the experts' gate and up in one ffn_gate_up_exps)."""
    w = gguf.GGUFWriter(str(path), arch)
    _write_metadata(w, model.config, arch, recurrent_layers)
    for name, data in gguf_tensors(model, arch, legacy_ssm_in, fused).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_tensors(
    model: torch.nn.Module, arch: str, legacy_ssm_in: bool = False, fused: bool = False
) -> dict[str, np.ndarray]:
    """The GGUF tensors (name -> fp32 array, torch's dim order) llama.cpp's converter makes of
    `model`'s state dict, named by gguf-py's tensor name map for `arch` (fused: see to_gguf)."""
    config = model.config
    names = gguf.get_tensor_name_map(_GGUF_ARCH[arch], config.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # (a tied checkpoint has none)
        for name, data in _converted(
            hf_name, t.detach().float().clone(), config, arch, legacy_ssm_in
        ):
            new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if new_name is None:
                raise ValueError(f"{arch}: gguf-py has no name for {name}")
            out[new_name] = data
    if fused:
        for i, kind in enumerate(config.layer_types):
            p = f"blk.{i}."
            if kind == "full_attention":  # (a Gated DeltaNet's attn_qkv is its in_proj_qkv)
                qkv = [out.pop(p + f"attn_{x}.weight") for x in "qkv"]
                out[p + "attn_qkv.weight"] = torch.cat(qkv)
            if p + "ffn_gate_exps.weight" in out:  # [E, F, D] twice -> [E, 2F, D]
                gate_up = [out.pop(p + f"ffn_{x}_exps.weight") for x in ("gate", "up")]
                out[p + "ffn_gate_up_exps.weight"] = torch.cat(gate_up, dim=1)
    return {name: t.contiguous().numpy() for name, t in out.items()}


def _converted(
    name: str, t: torch.Tensor, config: Any, arch: str, legacy_ssm_in: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """One transformers tensor as the converter's modify_tensors chain leaves it: (HF-style name
    for gguf-py's map, tensor). Its three stages, in its order."""
    # 1. _LinearAttentionVReorderBase (qwen35, qwen35moe): V heads grouped -> tiled
    n_k, n_v = config.linear_num_key_heads, config.linear_num_value_heads
    if arch in _TILED_V and n_k != n_v and "linear_attn." in name:
        t = _tile_v_heads(name, t, config)
    # 2. Qwen3NextModel
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    if "in_proj_qkvz.weight" in name and not legacy_ssm_in:
        yield from _split_qkvz(name, t, config)
        return
    # 3. Qwen2MoeModel: the fused experts
    if name.endswith("mlp.experts.down_proj"):
        name += ".weight"
    elif name.endswith("mlp.experts.gate_up_proj"):
        n_ff = t.shape[-2] // 2
        base = name.removesuffix(".gate_up_proj")
        yield base + ".gate_proj.weight", t[..., :n_ff, :]
        yield base + ".up_proj.weight", t[..., n_ff:, :]
        return
    yield name, t


def _reorder_v_heads(t: torch.Tensor, dim: int, n_k: int, r: int, head: int) -> torch.Tensor:
    """llama.cpp's _reorder_v_heads: along `dim`, [n_k, r, head] -> [r, n_k, head]."""
    shape = list(t.shape)
    dim %= len(shape)
    split = [*shape[:dim], n_k, r, head, *shape[dim + 1 :]]
    perm = list(range(len(split)))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.reshape(split).permute(perm).contiguous().reshape(shape)


def _tile_v_heads(name: str, t: torch.Tensor, config: Any) -> torch.Tensor:
    """The converter's reorder of one linear-attention tensor (tensors it names; others as is)."""
    n_k, hv = config.linear_num_key_heads, config.linear_value_head_dim
    r = config.linear_num_value_heads // n_k
    key_dim = n_k * config.linear_key_head_dim
    if ".in_proj_qkv." in name:
        return torch.cat([t[: 2 * key_dim], _reorder_v_heads(t[2 * key_dim :], 0, n_k, r, hv)])
    if ".in_proj_z." in name:
        return _reorder_v_heads(t, 0, n_k, r, hv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return _reorder_v_heads(t, 0, n_k, r, 1)
    if ".A_log" in name or ".dt_bias" in name:
        return _reorder_v_heads(t.unsqueeze(-1), 0, n_k, r, 1).squeeze(-1)
    if ".conv1d" in name:
        data = t.squeeze()
        return torch.cat(
            [data[: 2 * key_dim], _reorder_v_heads(data[2 * key_dim :], 0, n_k, r, hv)]
        )
    if ".out_proj." in name:
        return _reorder_v_heads(t, 1, n_k, r, hv)
    return t


def _split_qkvz(name: str, t: torch.Tensor, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3NextModel's split of in_proj_qkvz ([q, k, v, z] per K head) into attn_qkv (all q,
    all k, all v) and attn_gate (all z), already under their GGUF names."""
    n_k, hk = config.linear_num_key_heads, config.linear_key_head_dim
    vr = config.linear_num_value_heads // n_k * config.linear_value_head_dim
    d = config.hidden_size
    cols = t.permute(1, 0).contiguous().view(-1, n_k, 2 * hk + 2 * vr)  # [D, n_k, q+k+v+z]
    q, k, v, z = (x.contiguous().view(d, -1) for x in torch.split(cols, [hk, hk, vr, vr], dim=-1))
    bid = int(name.split(".")[2])  # model.layers.{bid}.linear_attn.in_proj_qkvz.weight
    yield _tensor_name(gguf.MODEL_TENSOR.ATTN_QKV, bid), torch.cat([q, k, v], dim=-1).T
    yield _tensor_name(gguf.MODEL_TENSOR.ATTN_GATE, bid), z.T


def _tensor_name(tensor: gguf.MODEL_TENSOR, bid: int) -> str:
    return gguf.TENSOR_NAMES[tensor].format(bid=bid) + ".weight"


def _write_metadata(
    w: gguf.GGUFWriter, config: Any, arch: str, recurrent_layers: bool = True
) -> None:
    """The keys llama.cpp's converter writes for these architectures (TextModel, Qwen2MoeModel,
    Qwen3NextModel, _Qwen35MRopeMixin), and a tokenizer."""
    rope = config.rope_parameters
    n_k, n_v = config.linear_num_key_heads, config.linear_num_value_heads
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    if (n_ff := getattr(config, "intermediate_size", None)) is not None:  # (not qwen35moe)
        w.add_feed_forward_length(n_ff)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    if "mrope_section" in rope:
        w.add_rope_dimension_sections([*rope["mrope_section"], 0, 0, 0, 0][:4])
    elif arch in _TILED_V:
        w.add_rope_dimension_sections([11, 11, 10, 0])  # (the mixin's default)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    if arch in _MOE:
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    w.add_ssm_state_size(config.linear_key_head_dim)
    w.add_ssm_group_count(n_k)
    w.add_ssm_time_step_rank(n_v)
    w.add_ssm_inner_size(config.linear_value_head_dim * n_v)
    full = [t == "full_attention" for t in config.layer_types]
    # (the converter writes config.json's full_attention_interval, which transformers' config
    # does not keep: the one its layer_types follow)
    interval = full.index(True) + 1 if any(full) else len(full) + 1
    if recurrent_layers:  # (from config.json's layer_types)
        w.add_array(RECURRENT_LAYERS.format(arch=arch), [not x for x in full])
    elif full != [(i + 1) % interval == 0 for i in range(len(full))]:
        raise ValueError(f"{arch}: layer_types {config.layer_types} follow no interval")
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(int(config.head_dim * rope["partial_rotary_factor"]))
    vocab = tiny_vocab()
    tokens, types = vocab[Keys.Tokenizer.LIST], vocab[Keys.Tokenizer.TOKEN_TYPE]
    if len(tokens) > config.vocab_size:
        raise ValueError(f"vocab_size {config.vocab_size} < the {len(tokens)} tokens of tiny_vocab")
    pad = range(len(tokens), config.vocab_size)  # (the converter's padding of a short vocab)
    w.add_tokenizer_model(vocab[Keys.Tokenizer.MODEL])
    w.add_tokenizer_pre(vocab[Keys.Tokenizer.PRE])
    w.add_token_list([*tokens, *(f"[PAD{i}]" for i in pad)])
    w.add_token_types([*types, *(gguf.TokenType.UNUSED for _ in pad)])
    w.add_token_merges(vocab[Keys.Tokenizer.MERGES])
    w.add_bos_token_id(vocab[Keys.Tokenizer.BOS_ID])
    w.add_eos_token_id(vocab[Keys.Tokenizer.EOS_ID])
    w.add_add_bos_token(vocab[Keys.Tokenizer.ADD_BOS])
