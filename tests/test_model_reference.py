"""Our stages against Hugging Face `transformers` (which dequantizes the GGUF to fp32) on tiny
random models of every architecture, and every quantization type.

Two precisions are checked: the exact path (weights dequantized to fp32 and an fp32 KV cache;
must agree to float round-off, which proves the graph) and the path that `potluck run` uses
(ggml's quantized kernels on the file's own blocks, activations rounded to 8 bits for the
quantized dot products, an f16 KV cache; agrees within a tolerance set by that rounding).
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from hybrid_reference import hf_hybrid
from potluck.model.archs import hparams_from_metadata
from potluck.model.stage import SeqChunk, Stage
from potluck.modelfile.gguf_file import GGUFFile

from ggufgen import write_tiny_model

transformers = pytest.importorskip("transformers")

TOKENS = [5, 70, 71, 72, 100, 3, 200, 150, 260, 9, 33, 34, 35, 36, 40, 41, 42, 43, 44, 45]

_YARN = {
    "gpt-oss.rope.scaling.type": "yarn",
    "gpt-oss.rope.scaling.factor": 8.0,
    "gpt-oss.rope.scaling.original_context_length": 64,
}
# gpt-oss's experts spread wide enough that a few percent of their gates and ups pass the
# SwiGLU's clamp at ±7 (graph.py SWIGLU_OAI)
_OAI_STDS = {"ffn_gate_exps": 0.5, "ffn_up_exps": 0.5}


def _longrope(n_orig: int) -> dict[str, float]:
    """phi3's LongRoPE keys as its converter writes them, for a context of 512 (write_tiny_model)
    pretrained at n_orig: cos and sin scaled by sqrt(1 + ln(512 / n_orig) / ln(n_orig))."""
    return {
        "phi3.rope.scaling.original_context_length": n_orig,
        "phi3.rope.scaling.attn_factor": math.sqrt(1 + math.log(512 / n_orig) / math.log(n_orig)),
    }


_DEEPSEEK_YARN = {  # DeepSeek-V2-Lite's mscale (0.707) as its converter writes it, factor 8
    "deepseek2.rope.scaling.type": "yarn",
    "deepseek2.rope.scaling.factor": 8.0,
    "deepseek2.rope.scaling.original_context_length": 64,
    "deepseek2.rope.scaling.yarn_log_multiplier": 0.1 * 0.707,
}


def _glm_keys(arch: str, groups: int) -> dict[str, object]:
    """GLM's routing keys (sigmoid, renormalised) with `groups` expert groups of which half
    are searched, and one MTP block after the model's layers."""
    return {
        f"{arch}.expert_gating_func": 2, f"{arch}.expert_weights_norm": True,
        f"{arch}.expert_group_count": groups, f"{arch}.expert_group_used_count": groups // 2,
        f"{arch}.nextn_predict_layers": 1,
    }  # fmt: skip


def _gemma4_keys(swa_head_dim: int, n_kv: list[int]) -> dict[str, object]:
    """Gemma 4's two kinds of layers for the tiny model's two (a sliding one, then a global
    one): the sliding one's head size (all of it RoPE'd), the kv heads of each."""
    return {
        "gemma4.attention.key_length_swa": swa_head_dim,
        "gemma4.attention.value_length_swa": swa_head_dim,
        "gemma4.rope.dimension_count_swa": swa_head_dim,
        "gemma4.attention.head_count_kv": n_kv,
    }


# Ministral 3's YaRN (mscale_all_dim 1, as its converter writes it) and attention temperature
# (beta 0.1), over an original context of 8, so that the 20 tokens see three temperatures
_MINISTRAL3 = {
    "mistral3.rope.scaling.type": "yarn",
    "mistral3.rope.scaling.factor": 64.0,
    "mistral3.rope.scaling.original_context_length": 8,
    "mistral3.rope.scaling.yarn_log_multiplier": 1.0,
    "mistral3.attention.temperature_scale": 0.1,
}


# (arch, main type, per-tensor overrides, shape options) — together they cover every type
CASES = [
    ("llama", T.Q4_0, {}, {}),
    ("llama", T.Q8_0, {"ffn_down": T.F16}, {"tied": False}),
    ("qwen2", T.Q5_0, {"attn_v": T.Q5_1}, {}),
    ("qwen3", T.Q4_1, {"ffn_": T.BF16}, {"head_dim": 128}),  # head_dim ≠ n_embd / n_head
    (
        "gemma3",
        T.Q4_K,
        {"ffn_down": T.Q6_K, "attn_v": T.Q5_K},
        # head_dim 256: transformers' query_pre_attn_scalar defaults to 256 (the GGUF has no
        # key for it), llama.cpp scales by 1/sqrt(head_dim); at 64 the two scales differ and
        # only the near-uniform random attention hid it
        {"n_embd": 256, "n_ff": 512, "n_head_kv": 1, "head_dim": 256},
    ),
    ("llama", T.Q2_K, {"attn_": T.Q3_K, "token_embd": T.F32}, {"n_embd": 256, "n_ff": 512}),
    # mixtures of experts: 8 experts, 2 per token (the last: a Mixtral, a llama file with experts)
    ("qwen3moe", T.Q8_0, {"ffn_down_exps": T.Q4_0}, {"n_expert": 8, "n_ff_exp": 64}),
    (
        "qwen2moe",
        T.Q4_K,  # the routed experts; a Q4_K shared expert of 512 alone doubles the rounding
        {"attn_": T.Q8_0, "shexp": T.Q8_0},
        {"n_expert": 8, "n_ff_exp": 256, "n_ff_shexp": 512, "n_embd": 256},
    ),
    # (a Mixtral's converted file has no expert width key: its experts are n_ff wide)
    ("llama", T.Q8_0, {"ffn_up_exps": T.Q6_K}, {"n_expert": 8, "n_ff": 256, "n_embd": 256,
                                               "extra": {"llama.expert_feed_forward_length": None}}),
    # gpt-oss: MXFP4 experts (as its files ship them), 4 of 8 per token, q wider than n_embd
    # (4 heads of 64), YaRN over an original context of 64 (so that both the interpolated and
    # the kept frequencies occur), a sliding window of 8 on layer 0
    (
        "gpt-oss",
        T.Q8_0,
        {"_exps": T.MXFP4},
        {
            "n_expert": 8,
            "n_expert_used": 4,
            "n_ff": 64,
            "head_dim": 64,
            "extra": _YARN,
            "stds": _OAI_STDS,
        },
    ),
    # phi3: fused attn_qkv and gate+up; then LongRoPE (Phi-3.5, Phi-4-mini): RoPE over 12 of 16
    # dims, its long factors (original context 16 < the stage's 64, and < the 20 tokens, so
    # that transformers takes them too), then its short ones (original context 64)
    ("phi3", T.Q8_0, {"ffn_down": T.Q4_0}, {"tied": False}),
    ("phi3", T.Q5_1, {"attn_qkv": T.Q8_0}, {"tied": False, "optional": True, "rope_dim": 12,
                                          "extra": _longrope(16)}),
    ("phi3", T.Q8_0, {}, {"tied": False, "optional": True, "rope_dim": 12,
                          "extra": _longrope(64)}),
    # gemma2: caps far below the released 50 and 30 (random attention is near uniform and its
    # logits small: at 50 and 30 soft-capping changes nothing measurable), Q8_0 attention whose
    # logits spread wide enough that the cap matters; the output's, of range 10.5, capped at 5
    # (a cap near their range would shrink it and so inflate the relative error); a sliding
    # window of 8 on layer 0
    (
        "gemma2",
        T.Q4_K,
        {"attn_": T.Q8_0, "ffn_down": T.Q6_K},
        {"n_embd": 256, "n_ff": 512, "head_dim": 256, "extra": {
            "gemma2.attn_logit_softcapping": 1.0, "gemma2.final_logit_softcapping": 5.0}},
    ),
    # olmo2: norms after attention and the FFN only, q/k normed over all heads
    ("olmo2", T.Q8_0, {"ffn_gate": T.Q4_1}, {"tied": False}),
    # Olmo3 (an olmo2 file with a sliding window): 4 layers, the last global, which alone takes
    # the YaRN scaling (original context 64)
    ("olmo2", T.Q5_0, {}, {"tied": False, "n_layer": 4, "extra": {
        "olmo2.attention.sliding_window": 8,
        "olmo2.attention.sliding_window_pattern": [True, True, True, False],
        "olmo2.rope.scaling.type": "yarn", "olmo2.rope.scaling.factor": 8.0,
        "olmo2.rope.scaling.original_context_length": 64}}),
    # olmoe: llama's block with olmo2's q/k norms over all heads, 8 experts of 128 (the file's
    # feed_forward_length: it has no expert width), 2 per token, not renormalised
    ("olmoe", T.Q8_0, {"ffn_down_exps": T.Q4_0}, {"n_expert": 8, "n_ff": 128, "tied": False}),
    # granite: its four scales (q·k's larger than granite-3's 1/128, which makes random
    # attention uniform), with every optional bias
    ("granite", T.Q8_0, {"ffn_down": T.Q5_0}, {"optional": True,
                                                "extra": {"granite.attention.scale": 0.5}}),
    # glm4moe as GLM-4.5: q/k norms, RoPE on half of each head, layer 0 dense, 8 experts in 4
    # groups of which the best 2 are searched, a file of 3 blocks whose last is the MTP block
    # (nextn_predict_layers 1); then as GLM-4.5-Air (no q/k norms, weight scale 1, no groups).
    # Seed 4: groups make near-ties in the routing likelier, and at seed 0 the fast path's
    # rounding changes one token's experts (0.33 of the logits' range at that token)
    ("glm4moe", T.Q8_0, {"ffn_down_exps": T.Q4_0}, {
        "n_expert": 8, "n_ff_exp": 64, "rope_dim": 8, "optional": True, "n_layer": 3,
        "tied": False, "seed": 4, "extra": _glm_keys("glm4moe", groups=4)}),
    ("glm4moe", T.Q5_0, {"attn_": T.Q8_0}, {
        "n_expert": 8, "n_ff_exp": 64, "rope_dim": 8, "extra": {
            "glm4moe.expert_weights_scale": 1.0}}),
    # deepseek2 as DeepSeek-V2-Lite: MLA (latent 64, heads of 32 + 16 RoPE'd dims and values of
    # 48), no q bottleneck, softmax router, YaRN with its mscale (original context 64); then as
    # GLM-4.7-Flash: a q bottleneck of 32, sigmoid router with selection bias in 4 groups,
    # renormalised, times 1.8, one shared expert, an MTP block, and Q4_0 heads' matrices
    # (attn_k_b, attn_v_b), which CPUs with AVX2 repack (graph.py's mul_mat_id over them)
    ("deepseek2", T.Q8_0, {"ffn_up_exps": T.Q4_1}, {
        "n_expert": 8, "n_ff_exp": 64, "head_dim": 48, "rope_dim": 16, "kv_lora_rank": 64,
        "extra": _DEEPSEEK_YARN}),
    ("deepseek2", T.Q8_0, {"_exps": T.Q4_0, "attn_k_b": T.Q4_0, "attn_v_b": T.Q4_0}, {
        "n_expert": 8, "n_ff_exp": 64, "head_dim": 48, "rope_dim": 16, "kv_lora_rank": 64,
        "q_lora_rank": 32, "n_layer": 3, "tied": False, "optional": True,
        "extra": _glm_keys("deepseek2", groups=4)
        | {"deepseek2.expert_weights_scale": 1.8, "deepseek2.expert_shared_count": 1}}),
    # gemma4 as the 26B-A4B: a sliding layer of 4 kv heads of 64, then a global one of 1 kv head
    # of 128 (k as v) whose RoPE turns a quarter of each head; a dense GeGLU beside 4 of 8
    # experts, their gate and up in one stack. n_embd 256: ggml's GELU reads a table of f16
    # inputs (≈ 2^-11 relative) and, with q·k unscaled, fp32 round-off of the reference itself
    # reaches 1e-4; at n_embd 64 the two together come near 5e-4
    ("gemma4", T.Q8_0, {"ffn_gate_up_exps": T.Q4_K, "ffn_down_exps": T.Q5_K}, {
        "n_embd": 256, "n_ff": 512, "head_dim": 128, "n_expert": 8, "n_expert_used": 4,
        "n_ff_exp": 256, "optional": True, "skip": ("attn_v", "ffn_gate_exps", "ffn_up_exps"),
        "extra": _gemma4_keys(64, [4, 1])}),
    # gemma4 as the 31B: dense, K-quants
    ("gemma4", T.Q4_K, {"attn_": T.Q8_0, "ffn_down": T.Q6_K}, {
        "n_embd": 256, "n_ff": 512, "head_dim": 128, "optional": True, "skip": ("attn_v",),
        "extra": _gemma4_keys(64, [4, 1])}),
    # mistral3 as Ministral 3 (Devstral Small 2): llama's block, YaRN and attention temperature
    # (n_embd 128: at 64 the tiny logits' range is 2.8 and near-ties flip 3 of 20 argmaxes)
    ("mistral3", T.Q8_0, {"ffn_up": T.Q4_1}, {"tied": False, "n_embd": 128,
                                              "extra": _MINISTRAL3}),
    # hybrids (Qwen3.5/3.6, Qwen3-Next): Gated DeltaNet layers 0-2 (2 key heads, 4 value
    # heads: the converter's head order matters), gated attention on layer 3, an MoE with a
    # shared expert; qwen3next's q/k/v/z in attn_qkv + attn_gate, and in the older ssm_in
    ("qwen35", T.Q8_0, {"ssm_out": T.Q4_0, "attn_qkv": T.Q5_0},
     {"n_layer": 4, "head_dim": 32, "rope_dim": 8, "n_ff": 128, "tied": False}),
    ("qwen35moe", T.Q8_0, {"_exps": T.Q4_1},
     {"n_layer": 4, "head_dim": 32, "rope_dim": 8, "n_expert": 8, "n_ff_exp": 64,
      "n_ff_shexp": 64, "optional": True, "skip": ("gate_up_exps",)}),
    ("qwen3next", T.Q8_0, {},
     {"n_layer": 4, "head_dim": 32, "rope_dim": 8, "n_expert": 8, "n_ff_exp": 64,
      "n_ff_shexp": 64, "optional": True, "skip": ("gate_up_exps", "ssm_in")}),
    ("qwen3next", T.Q4_0, {"ssm_in": T.Q8_0},
     {"n_layer": 4, "head_dim": 32, "rope_dim": 8, "n_expert": 8, "n_ff_exp": 64,
      "n_ff_shexp": 64, "optional": True, "skip": ("gate_up_exps", "attn_qkv", "attn_gate")}),
]  # fmt: skip
HYBRIDS = ("qwen35", "qwen35moe", "qwen3next")
# what transformers' GGUF loader does not read from the file (it keeps its config's defaults)
HF_CONFIG = {"n_ff_exp": "moe_intermediate_size", "n_ff_shexp": "shared_expert_intermediate_size"}
HF_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")  # {arch}.key, named the same


def _ids(case: tuple) -> str:
    arch, q, over, _ = case
    return f"{arch}-{q.name}" + "".join(f"+{v.name}" for v in over.values())


@pytest.fixture(scope="module", params=CASES, ids=_ids)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, qtype, over, shape = request.param
    path = write_tiny_model(
        tmp_path_factory.mktemp("m") / f"{arch}.gguf", arch, None, qtype, qtypes=over, **shape
    )
    if arch == "llama" and shape.get("n_expert"):
        ref = _mixtral(path)
    elif arch == "gpt-oss":
        ref = _gpt_oss(path)
    elif arch in ("olmo2", "granite", "olmoe"):
        ref = _own_class(path)
    elif arch in ("glm4moe", "deepseek2"):
        ref = _glm_deepseek(path)
    elif arch == "gemma4":
        ref = _gemma4(path)
    elif arch == "mistral3":
        ref = _mistral3(path)
    elif arch in HYBRIDS:
        ref = hf_hybrid(path)
    else:
        config = _hf_config(path, arch, shape)
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, **config
        )
    with torch.no_grad():
        ref_logits = ref(torch.tensor([TOKENS])).logits[0].double()  # [T, V]
    return path, ref_logits


def _hf_config(path: Path, arch: str, shape: dict) -> dict:
    """transformers' config keywords for what its GGUF loader does not read from the file."""
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    config = {HF_CONFIG[k]: v for k, v in shape.items() if k in HF_CONFIG}
    config |= {k: f.metadata[f"{arch}.{k}"] for k in HF_KEYS if f"{arch}.{k}" in f.metadata}
    if arch == "phi3":
        config["pad_token_id"] = None  # (its default, 32000, is outside the tiny vocabulary)
        if "rope_factors_long.weight" in f.tensors:  # LongRoPE: its factors, from the file
            n_orig = f.metadata["phi3.rope.scaling.original_context_length"]
            factors = {
                k: _dequantized(f, f"rope_factors_{k.split('_')[0]}.weight").reshape(-1).tolist()
                for k in ("long_factor", "short_factor")
            }
            n_rot, n_head = f.metadata["phi3.rope.dimension_count"], hp.n_head
            config["original_max_position_embeddings"] = n_orig
            config["rope_parameters"] = {
                "rope_type": "longrope",
                "rope_theta": f.metadata["phi3.rope.freq_base"],
                "original_max_position_embeddings": n_orig,
                "partial_rotary_factor": n_rot * n_head / hp.n_embd,
                **factors,
            }
    return config


def _ends(f: GGUFFile) -> dict[str, torch.Tensor]:
    """A transformers state dict's embedding, final norm and (untied) head, from the file."""
    state = {"model.embed_tokens.weight": _dequantized(f, "token_embd.weight"),
             "model.norm.weight": _dequantized(f, "output_norm.weight")}  # fmt: skip
    if "output.weight" in f.tensors:
        state["lm_head.weight"] = _dequantized(f, "output.weight")
    return state


def _mixtral(path: Path) -> torch.nn.Module:
    """transformers' Mixtral over the file's tensors, dequantized (its GGUF loader reads a llama
    file with experts as a dense llama): q and k un-permuted as its llama loader does."""
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    config = transformers.MixtralConfig(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, intermediate_size=hp.n_ff_exp,
        num_hidden_layers=hp.n_layer, num_attention_heads=hp.n_head,
        num_key_value_heads=hp.n_head_kv, head_dim=hp.head_dim, rms_norm_eps=hp.rms_eps,
        rope_theta=hp.rope_base, num_local_experts=hp.n_expert,
        num_experts_per_tok=hp.n_expert_used, tie_word_embeddings="output.weight" not in f.tensors,
        max_position_embeddings=hp.n_ctx_train,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).float()

    def get(name: str) -> torch.Tensor:
        return _dequantized(f, name)

    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:  # GGUF's rope pairs -> halves
        return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)

    state = _ends(f)
    for i in range(hp.n_layer):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        state |= {
            q + "input_layernorm.weight": get(p + "attn_norm.weight"),
            q + "post_attention_layernorm.weight": get(p + "ffn_norm.weight"),
            q + "self_attn.q_proj.weight": unpermute(get(p + "attn_q.weight"), hp.n_head),
            q + "self_attn.k_proj.weight": unpermute(get(p + "attn_k.weight"), hp.n_head_kv),
            q + "self_attn.v_proj.weight": get(p + "attn_v.weight"),
            q + "self_attn.o_proj.weight": get(p + "attn_output.weight"),
            q + "mlp.gate.weight": get(p + "ffn_gate_inp.weight"),
            # [E, 2F, D]: gate then up, as transformers' fused experts hold them
            q + "mlp.experts.gate_up_proj": torch.cat(
                [get(p + "ffn_gate_exps.weight"), get(p + "ffn_up_exps.weight")], dim=1
            ),
            q + "mlp.experts.down_proj": get(p + "ffn_down_exps.weight"),
        }
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def _dequantized(f: GGUFFile, name: str) -> torch.Tensor:
    from gguf.quants import dequantize

    info = f.tensors[name]
    w = np.array(dequantize(f.raw(name), info.qtype), np.float32)  # (a writable copy)
    return torch.from_numpy(w.reshape(info.shape))


def _gpt_oss(path: Path) -> torch.nn.Module:
    """transformers' GptOss over the file's tensors, dequantized. (Its GGUF loader fails on a
    gpt-oss file: it reads each rope.scaling value as the key's length, takes the sliding window
    from a key that does not exist, and leaves the sinks and every expert tensor unloaded.)
    YaRN's correction range is truncated to whole dims, as ggml's rope (and so llama.cpp)
    always does; gpt-oss's own config says not to (truncate: false)."""
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    rope = {"rope_type": "default", "rope_theta": hp.rope_base}
    if hp.rope_scaling == "yarn":
        rope |= {
            "rope_type": "yarn", "factor": hp.rope_scale, "beta_fast": hp.yarn_beta_fast,
            "beta_slow": hp.yarn_beta_slow, "truncate": True,
            "original_max_position_embeddings": hp.rope_ctx_orig or hp.n_ctx_train,
        }  # fmt: skip
    config = transformers.GptOssConfig(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, intermediate_size=hp.n_ff_exp,
        num_hidden_layers=hp.n_layer, num_attention_heads=hp.n_head,
        num_key_value_heads=hp.n_head_kv, head_dim=hp.head_dim, rms_norm_eps=hp.rms_eps,
        sliding_window=hp.sliding_window, num_local_experts=hp.n_expert,
        num_experts_per_tok=hp.n_expert_used, max_position_embeddings=hp.n_ctx_train,
        tie_word_embeddings="output.weight" not in f.tensors, rope_parameters=rope,
    )  # fmt: skip
    assert [hp.is_sliding(i) for i in range(hp.n_layer)] == [
        t == "sliding_attention" for t in config.layer_types
    ]
    model = transformers.GptOssForCausalLM(config).float()

    def get(name: str) -> torch.Tensor:
        return _dequantized(f, name)

    def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """[..., F] gate and up -> [..., 2F], gate at the even places (transformers' layout)."""
        return torch.stack([gate, up], dim=-1).flatten(-2)

    state = _ends(f)
    for i in range(hp.n_layer):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        state |= {
            q + "input_layernorm.weight": get(p + "attn_norm.weight"),
            q + "post_attention_layernorm.weight": get(p + "post_attention_norm.weight"),
            q + "self_attn.sinks": get(p + "attn_sinks.weight"),
            q + "mlp.router.weight": get(p + "ffn_gate_inp.weight"),
            q + "mlp.router.bias": get(p + "ffn_gate_inp.bias"),
            # [E, D, 2F] and [E, 2F]; the file's stacks are [E, F, D] and [E, F]
            q + "mlp.experts.gate_up_proj": interleave(
                get(p + "ffn_gate_exps.weight").transpose(1, 2),
                get(p + "ffn_up_exps.weight").transpose(1, 2),
            ),
            q + "mlp.experts.gate_up_proj_bias": interleave(
                get(p + "ffn_gate_exps.bias"), get(p + "ffn_up_exps.bias")
            ),
            q + "mlp.experts.down_proj": get(p + "ffn_down_exps.weight").transpose(1, 2),
            q + "mlp.experts.down_proj_bias": get(p + "ffn_down_exps.bias"),
        }
        for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            for part in ("weight", "bias"):
                state[f"{q}self_attn.{theirs}_proj.{part}"] = get(f"{p}attn_{ours}.{part}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def _own_class(path: Path) -> torch.nn.Module:
    """transformers' Olmo2 (Olmo3 where the file has a sliding window), Olmoe or Granite over
    the file's tensors, dequantized (its GGUF loader does not read these architectures);
    granite's q and k un-permuted (llama's GGUF order; olmo2's and olmoe's are HF's, their RoPE
    neox)."""
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    shape = dict(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, intermediate_size=hp.n_ff,
        num_hidden_layers=hp.n_layer, num_attention_heads=hp.n_head,
        num_key_value_heads=hp.n_head_kv, rms_norm_eps=hp.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": hp.rope_base},
        max_position_embeddings=hp.n_ctx_train, pad_token_id=None,
        tie_word_embeddings="output.weight" not in f.tensors,
    )  # fmt: skip
    # GGUF name in blk.i -> transformers' in layers.i
    names = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }  # fmt: skip
    if hp.arch == "granite":
        bias = "blk.0.attn_q.bias" in f.tensors
        config = transformers.GraniteConfig(
            **shape, embedding_multiplier=hp.embed_scale, residual_multiplier=hp.residual_scale,
            attention_multiplier=hp.attn_scale, logits_scaling=hp.logit_scale,
            attention_bias=bias, mlp_bias="blk.0.ffn_up.bias" in f.tensors,
        )  # fmt: skip
        model = transformers.GraniteForCausalLM(config)
        names |= {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    elif hp.arch == "olmoe":
        config = transformers.OlmoeConfig(
            **shape | {"intermediate_size": hp.n_ff_exp}, num_experts=hp.n_expert,
            num_experts_per_tok=hp.n_expert_used, norm_topk_prob=hp.expert_norm,
        )  # fmt: skip
        model = transformers.OlmoeForCausalLM(config)
        names |= {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                  "ffn_gate_inp": "mlp.gate"}  # fmt: skip
    else:
        names |= {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                  "post_attention_norm": "post_attention_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"}  # fmt: skip
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**shape))
    if hp.arch == "olmo2" and hp.sliding_window:  # Olmo3: YaRN on the global layers only
        rope = {"rope_type": "default", "rope_theta": hp.rope_base}
        yarn = {
            "rope_type": "yarn", "rope_theta": hp.rope_base, "factor": hp.rope_scale,
            "original_max_position_embeddings": hp.rope_ctx_orig, "truncate": True,
        }  # fmt: skip
        shape["rope_parameters"] = {"sliding_attention": rope, "full_attention": yarn}
        kinds = ["sliding_attention" if hp.is_sliding(i) else "full_attention"
                 for i in range(hp.n_layer)]  # fmt: skip
        config = transformers.Olmo3Config(
            **shape, sliding_window=hp.sliding_window, layer_types=kinds
        )
        model = transformers.Olmo3ForCausalLM(config)

    def get(name: str) -> torch.Tensor:
        w = _dequantized(f, name)
        if hp.arch == "granite" and name.split(".")[2:3] in (["attn_q"], ["attn_k"]):
            heads = hp.n_head if ".attn_q." in name else hp.n_head_kv  # rope pairs -> halves
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)
        return w

    state = _ends(f)
    for name in f.tensors:
        parts = name.split(".")
        if parts[0] == "blk" and not parts[2].endswith("_exps"):
            state[f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"] = get(name)
    for i in range(hp.n_layer if hp.is_moe else 0):  # olmoe's stacks [E, F, D], [E, D, F]
        p, q = f"blk.{i}.", f"model.layers.{i}.mlp.experts."
        gate_up = [get(p + "ffn_gate_exps.weight"), get(p + "ffn_up_exps.weight")]
        state[q + "gate_up_proj"] = torch.cat(gate_up, dim=1)  # [E, 2F, D]: gate's rows first
        state[q + "down_proj"] = get(p + "ffn_down_exps.weight")
    missing, unexpected = model.float().load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def _glm_deepseek(path: Path) -> torch.nn.Module:
    """transformers' Glm4Moe (glm4moe), DeepseekV2 (deepseek2 with a softmax router) or
    Glm4MoeLite (GLM-4.7-Flash: deepseek2 with a sigmoid router) over the file's tensors,
    dequantized (its GGUF loader reads neither architecture). Only the model's own layers: the
    MTP block after them is left out, as we do. MLA's kv_b_proj is remade from the file's split
    attn_k_b [H, r, nope] and attn_v_b [H, v, r]: per head, k's rows then v's."""
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    rope = {"rope_type": "default", "rope_theta": hp.rope_base}
    if hp.rope_scaling == "yarn":
        rope |= {
            "rope_type": "yarn", "factor": hp.rope_scale, "truncate": True,
            "original_max_position_embeddings": hp.rope_ctx_orig or hp.n_ctx_train,
            "mscale": hp.yarn_log_mul, "mscale_all_dim": hp.yarn_log_mul,
        }  # fmt: skip
    shape = dict(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, intermediate_size=hp.n_ff,
        moe_intermediate_size=hp.n_ff_exp, num_hidden_layers=hp.n_layer,
        num_attention_heads=hp.n_head, rms_norm_eps=hp.rms_eps, n_routed_experts=hp.n_expert,
        num_experts_per_tok=hp.n_expert_used, n_shared_experts=hp.n_ff_shexp // hp.n_ff_exp,
        routed_scaling_factor=hp.expert_scale, norm_topk_prob=hp.expert_norm,
        n_group=hp.n_expert_groups or 1, topk_group=hp.n_group_used or 1,
        max_position_embeddings=hp.n_ctx_train, rope_parameters=rope, pad_token_id=None,
        tie_word_embeddings="output.weight" not in f.tensors,
    )  # fmt: skip
    # GGUF name in blk.i -> transformers' in layers.i
    names = {
        "attn_norm": "input_layernorm", "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
        "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate.e_score_correction_bias",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj", "ffn_down_exps": "mlp.experts.down_proj",
    }  # fmt: skip
    if hp.arch == "glm4moe":
        names |= {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_q_norm": "self_attn.q_norm",
                  "attn_k_norm": "self_attn.k_norm",
                  "post_attention_norm": "post_attention_layernorm"}  # fmt: skip
        rope["partial_rotary_factor"] = hp.rope_dim / hp.head_dim
        config = transformers.Glm4MoeConfig(
            **shape, num_key_value_heads=hp.n_head_kv, head_dim=hp.head_dim, attention_bias=True,
            use_qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
            first_k_dense_replace=hp.n_dense_lead,
        )  # fmt: skip
        model = transformers.Glm4MoeForCausalLM(config)
    else:
        names |= {"attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
                  "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
                  "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm",
                  "ffn_norm": "post_attention_layernorm"}  # fmt: skip
        mla = dict(
            kv_lora_rank=hp.kv_lora_rank, q_lora_rank=hp.q_lora_rank or None,
            qk_nope_head_dim=hp.head_dim_mla - hp.rope_dim, qk_rope_head_dim=hp.rope_dim,
            v_head_dim=hp.head_dim_v_mla, num_key_value_heads=hp.n_head,
        )  # fmt: skip
        if hp.expert_gating == "sigmoid":  # GLM-4.7-Flash
            kinds = ["dense" if i < hp.n_dense_lead else "sparse" for i in range(hp.n_layer)]
            config = transformers.Glm4MoeLiteConfig(
                **shape, **mla, head_dim=hp.rope_dim, mlp_layer_types=kinds
            )
            model = transformers.Glm4MoeLiteForCausalLM(config)
        else:  # DeepSeek-V2(-Lite): greedy top k of a softmax
            assert hp.expert_gating == "softmax" and not hp.n_expert_groups
            config = transformers.DeepseekV2Config(
                **shape, **mla, first_k_dense_replace=hp.n_dense_lead
            )
            model = transformers.DeepseekV2ForCausalLM(config)

    def get(name: str) -> torch.Tensor:
        return _dequantized(f, name)

    state = _ends(f)
    for i in range(hp.n_layer):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        for name in f.tensors:
            parts = name.split(".")
            if name.startswith(p) and parts[2] in names:
                suffix = "" if parts[2] == "exp_probs_b" else "." + parts[3]
                suffix = "" if parts[2] == "ffn_down_exps" else suffix
                state[q + names[parts[2]] + suffix] = get(name)
        if hp.is_moe_layer(i):  # [E, 2F, D]: gate then up, as transformers' fused experts
            gate_up = [get(p + "ffn_gate_exps.weight"), get(p + "ffn_up_exps.weight")]
            state[q + "mlp.experts.gate_up_proj"] = torch.cat(gate_up, dim=1)
        if hp.kv_lora_rank:  # [H (nope + v), r]
            k_b, v_b = get(p + "attn_k_b.weight"), get(p + "attn_v_b.weight")
            kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
            state[q + "self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, hp.kv_lora_rank)
    missing, unexpected = model.float().load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def _gemma4(path: Path) -> torch.nn.Module:
    """transformers' Gemma4 text model over the file's tensors, dequantized. (Its GGUF loader
    fails on a gemma4 file: it takes the per-layer head_count_kv for one number, and without
    that list it reads none of the *_swa keys, so that the sliding layers' tensors do not fit
    its default head size; nor does it map the experts' keys.) Its global layers' proportional
    RoPE turns the dims that rope_freqs leaves at 1; k is v where they have no attn_v."""
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    kinds = ["sliding_attention" if hp.is_sliding(i) else "full_attention"
             for i in range(hp.n_layer)]  # fmt: skip
    g = kinds.index("full_attention")
    local, full = hp.heads(kinds.index("sliding_attention")), hp.heads(g)
    turned = int((_dequantized(f, "rope_freqs.weight") == 1.0).sum())  # of full.head_dim / 2
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": hp.local_rope_base},
        "full_attention": {"rope_type": "proportional", "rope_theta": hp.rope_base,
                           "partial_rotary_factor": 2 * turned / full.head_dim},
    }  # fmt: skip
    config = transformers.Gemma4TextConfig(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, intermediate_size=hp.n_ff,
        num_hidden_layers=hp.n_layer, num_attention_heads=hp.n_head,
        num_key_value_heads=local.n_head_kv, head_dim=local.head_dim,
        global_head_dim=full.head_dim, num_global_key_value_heads=full.n_head_kv,
        attention_k_eq_v=f"blk.{g}.attn_v.weight" not in f.tensors, layer_types=kinds,
        sliding_window=hp.sliding_window, final_logit_softcapping=hp.final_softcap or None,
        hidden_size_per_layer_input=0, rms_norm_eps=hp.rms_eps, rope_parameters=rope,
        max_position_embeddings=hp.n_ctx_train, enable_moe_block=hp.is_moe,
        num_experts=hp.n_expert or None, top_k_experts=hp.n_expert_used or None,
        moe_intermediate_size=hp.n_ff_exp or None,
        tie_word_embeddings="output.weight" not in f.tensors,
    )  # fmt: skip
    model = transformers.Gemma4ForCausalLM(config)
    # GGUF name in blk.i (with its .weight where it is not one) -> transformers' in layers.i
    names = {
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm", "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
        "post_ffw_norm": "post_feedforward_layernorm", "pre_ffw_norm_2":
        "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
        "post_ffw_norm_2": "post_feedforward_layernorm_2", "ffn_gate_inp": "router.proj",
        "layer_output_scale.weight": "layer_scalar", "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale",
        "ffn_gate_up_exps.weight": "experts.gate_up_proj",
        "ffn_down_exps.weight": "experts.down_proj",
    }  # fmt: skip
    state = {"model.embed_tokens.weight": _dequantized(f, "token_embd.weight"),
             "model.norm.weight": _dequantized(f, "output_norm.weight")}  # fmt: skip
    if "output.weight" in f.tensors:
        state["lm_head.weight"] = _dequantized(f, "output.weight")
    for name in f.tensors:
        parts = name.split(".", 2)
        if parts[0] != "blk" or parts[2].split(".")[0] in ("ffn_gate_exps", "ffn_up_exps"):
            continue
        base, part = parts[2].split(".")
        ours = names.get(parts[2]) or f"{names[base]}.{part}"
        state[f"model.layers.{parts[1]}.{ours}"] = _dequantized(f, name)
    for i in range(hp.n_layer):  # (gate and up as two stacks: [E, 2F, D], gate's rows first)
        if f"blk.{i}.ffn_gate_exps.weight" in f.tensors:
            gate_up = [_dequantized(f, f"blk.{i}.ffn_{m}_exps.weight") for m in ("gate", "up")]
            state[f"model.layers.{i}.experts.gate_up_proj"] = torch.cat(gate_up, dim=1)
    missing, unexpected = model.float().load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def _mistral3(path: Path) -> torch.nn.Module:
    """transformers' Ministral3 (its YaRN, Llama 4's attention temperature) or, for a file
    without a temperature, Mistral, over the file's tensors, dequantized (its GGUF loader does
    not read mistral3); q and k un-permuted (llama's GGUF order)."""
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    n_orig = hp.rope_ctx_orig or hp.n_ctx_train
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": hp.rope_base}
    if hp.rope_scaling == "yarn":
        rope |= {
            "rope_type": "yarn", "factor": hp.rope_scale, "truncate": True,
            "original_max_position_embeddings": n_orig, "beta_fast": hp.yarn_beta_fast,
            "beta_slow": hp.yarn_beta_slow, "mscale": 1.0, "mscale_all_dim": hp.yarn_mscale_all,
        }  # fmt: skip
    shape = dict(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, intermediate_size=hp.n_ff,
        num_hidden_layers=hp.n_layer, num_attention_heads=hp.n_head,
        num_key_value_heads=hp.n_head_kv, head_dim=hp.head_dim, rms_norm_eps=hp.rms_eps,
        max_position_embeddings=hp.n_ctx_train, pad_token_id=None, sliding_window=None,
        tie_word_embeddings="output.weight" not in f.tensors,
    )  # fmt: skip
    if hp.attn_temp_scale:
        rope |= {"llama_4_scaling_beta": hp.attn_temp_scale,
                 "original_max_position_embeddings": n_orig}  # fmt: skip
        config = transformers.Ministral3Config(**shape, rope_parameters=rope)
        model = transformers.Ministral3ForCausalLM(config)
    else:
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**shape, rope_parameters=rope)
        )
    names = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }  # fmt: skip
    state = {"model.embed_tokens.weight": _dequantized(f, "token_embd.weight"),
             "model.norm.weight": _dequantized(f, "output_norm.weight")}  # fmt: skip
    if "output.weight" in f.tensors:
        state["lm_head.weight"] = _dequantized(f, "output.weight")
    for name in f.tensors:
        parts = name.split(".")
        if parts[0] != "blk":
            continue
        w = _dequantized(f, name)
        if parts[2] in ("attn_q", "attn_k"):  # rope pairs -> halves
            heads = hp.n_head if parts[2] == "attn_q" else hp.n_head_kv
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)
        state[f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"] = w
    missing, unexpected = model.float().load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def _ours(path: Path, exact: bool, splits: tuple[int, ...] = ()) -> torch.Tensor:
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    bounds = [0, *splits, hp.n_layer]
    stages = [Stage(hp, f, a, b, 64, exact=exact) for a, b in zip(bounds, bounds[1:], strict=False)]
    x = np.array(TOKENS)
    chunks = [SeqChunk(0, len(TOKENS))]
    for s in stages[:-1]:
        x = s(x, chunks)
    return torch.from_numpy(stages[-1](x, chunks, np.arange(len(TOKENS)))).double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_exact_path_matches_transformers(tiny) -> None:
    path, ref = tiny
    ours = _ours(path, exact=True)
    assert ours.shape == ref.shape
    # fp32 round-off, amplified by random weights (gemma3 reaches 1.3e-4: its reference also
    # recomputes 1 + (w - 1) for every norm); a wrong rope, mask or norm gives errors of O(1e-1)
    assert _rel(ours, ref) < 5e-4, f"max rel err {_rel(ours, ref):.2e}"


def test_fast_path_close_to_transformers(tiny) -> None:
    path, ref = tiny
    ours = _ours(path, exact=False)
    # 8-bit activations (ggml's q8 dot products) and the f16 cache round at 2^-8..2^-11 relative;
    # through 2 random layers the logits move by ~1e-3..1e-2 of their range on average (random
    # K-quant attention is peaked: the max reaches 0.17 where a near-tie flips). A wrong graph (a
    # rope, a mask, a norm) moves them by O(1) everywhere; the exact path above proves the graph.
    # The hybrids' 4 layers move them by 1.4e-2..3.3e-2 (their Gated DeltaNet's q/k/v matrix
    # alone by 1e-2); llama.cpp's logits on the same files equal ours to 2e-8 (the test below).
    hybrid = GGUFFile(path).metadata["general.architecture"] in HYBRIDS
    mean = float((ours - ref).abs().mean() / ref.abs().max())
    limit = 4e-2 if hybrid else 1.5e-2
    assert mean < limit, f"mean rel err {mean:.2e} (max {_rel(ours, ref):.2e})"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    # (the hybrids: 17 of 20, as llama.cpp's own)
    assert agree >= (0.8 if hybrid else 0.9), f"argmax agrees on only {agree:.0%} of positions"


LLAMA_BIN = Path(
    os.environ.get(
        "LLAMA_CPP_BIN", "/work/cache/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
    )
)  # fmt: skip


@pytest.fixture(scope="module")
def llama_logits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/tools/llama_logits.c built against the reference llama.cpp (its source tree and
    build, bench/README.md), or the tests that need it skipped."""
    root = LLAMA_BIN.parent.parent
    if not (LLAMA_BIN / "libllama.so").exists() or not (root / "include" / "llama.h").exists():
        pytest.skip(f"no llama.cpp build in {LLAMA_BIN} (LLAMA_CPP_BIN; bench/README.md)")
    tool = tmp_path_factory.mktemp("tool") / "llama_logits"
    source = Path(__file__).parent / "tools" / "llama_logits.c"
    subprocess.run(
        ["cc", "-O2", "-o", str(tool), str(source), f"-I{root / 'include'}",
         f"-I{root / 'ggml' / 'include'}", f"-L{LLAMA_BIN}", "-lllama",
         f"-Wl,-rpath,{LLAMA_BIN}"],
        check=True,
    )  # fmt: skip
    return tool


# tiny files llama.cpp's loader refuses or reads otherwise, and why (none is a hybrid)
LLAMA_CPP_DIFFERS = {
    "qwen2moe": "its loader requires output.weight (the tiny file ties the head)",
    "gpt-oss": "its loader requires output.weight (the tiny file ties the head)",
    "olmoe": "it sizes q/k norms by n_embd (OLMoE has as many kv heads as heads; this file not)",
    "gemma4": "it requires gemma4.embedding_length_per_layer_input, which Potluck refuses",
}


def test_fast_path_equals_llama_cpp(tiny, llama_logits: Path) -> None:
    """llama.cpp's own graph of the architecture over the same file, on the same ggml kernels
    (8-bit activations, f16 cache): the same logits as our fast path, to float rounding. (Not
    in CI, which has no llama.cpp build: run locally after bench/README.md's build.)"""
    path, _ = tiny
    meta = GGUFFile(path).metadata
    arch = meta["general.architecture"]
    if arch in LLAMA_CPP_DIFFERS:
        pytest.skip(f"llama.cpp and this tiny {arch} file: {LLAMA_CPP_DIFFERS[arch]}")
    if meta.get("phi3.rope.scaling.original_context_length", 0) >= 64:
        pytest.skip(
            "phi3 with LongRoPE's short factors (context 64, original 64): llama.cpp's logits "
            "differ by 0.53 of their range; not investigated yet (its long factors agree)"
        )
    if arch == "deepseek2" and "deepseek2.attention.q_lora_rank" not in meta:
        pytest.skip("llama.cpp requires deepseek2.attention.q_lora_rank (this file has none)")
    out = subprocess.run(
        [str(llama_logits), str(path), "64", *map(str, TOKENS)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    theirs = torch.tensor(np.loadtxt(out.stdout.splitlines()), dtype=torch.float64)
    ours = _ours(path, exact=False)
    assert _rel(ours, theirs) < 1e-5, f"max rel err {_rel(ours, theirs):.2e}"


def test_split_equals_whole(tiny) -> None:
    """(A hybrid's cuts: between two DeltaNet layers, and between a DeltaNet and attention.)"""
    path, _ = tiny
    whole = _ours(path, exact=True)
    hybrid = GGUFFile(path).metadata["general.architecture"] in HYBRIDS
    assert torch.equal(_ours(path, exact=True, splits=(1, 3) if hybrid else (1,)), whole)


def test_decode_steps_match_transformers(tiny) -> None:
    """A prompt of 5, then one token a step through the KV cache (the decode masks: past the
    sliding windows of 8 where a model has them), agrees with the reference as the whole does."""
    path, ref = tiny
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    stage = Stage(hp, f, 0, hp.n_layer, 64, exact=True)
    rows = [stage(np.array(TOKENS[:5]), [SeqChunk(0, 5)], np.arange(5))]
    rows += [stage(np.array([t]), [SeqChunk(0, 1)]) for t in TOKENS[5:]]
    ours = torch.from_numpy(np.concatenate(rows)).double()
    assert _rel(ours, ref) < 5e-4, f"max rel err {_rel(ours, ref):.2e}"


def test_bad_inputs_are_refused_before_ggml_sees_them(tmp_path: Path) -> None:
    """An empty chunk made ggml abort the whole process (get_rows' assert); shapes and ids that do
    not fit are refused the same way, with what was wrong."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", None, T.Q8_0, n_layer=2)
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    first, middle = Stage(hp, f, 0, 1, 64), Stage(hp, f, 1, 2, 64)
    with pytest.raises(ValueError, match=r"at least one token, got \[0\]"):
        first(np.array([], np.int64), [SeqChunk(1, 0)])
    with pytest.raises(ValueError, match=r"at least one token, got \[\]"):
        first(np.array([], np.int64), [])
    with pytest.raises(ValueError, match=r"at least one token, got \[2, 0\]"):
        first(np.array([5, 6]), [SeqChunk(1, 2), SeqChunk(2, 0)])
    with pytest.raises(ValueError, match="input has 3 rows but the chunks add up to 2"):
        first(np.array([5, 6, 7]), [SeqChunk(1, 2)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        first(np.array([hp.n_vocab]), [SeqChunk(1, 1)])
    with pytest.raises(ValueError, match="hidden states have shape"):
        middle(np.zeros((1, hp.n_embd + 1), np.float32), [SeqChunk(1, 1)])
    assert first(np.array([5]), [SeqChunk(1, 1)]).shape == (1, hp.n_embd)  # still computes
