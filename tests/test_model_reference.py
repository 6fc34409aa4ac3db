"""Our stages against Hugging Face `transformers` (which dequantizes the GGUF to fp32) on tiny
random models of every architecture, and every quantization type.

Two precisions are checked: the exact path (weights dequantized to fp32 and an fp32 KV cache;
must agree to float round-off, which proves the graph) and the path that `potluck run` uses
(ggml's quantized kernels on the file's own blocks, activations rounded to 8 bits for the
quantized dot products, an f16 KV cache; agrees within a tolerance set by that rounding).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from potluck.model.archs import hparams_from_metadata
from potluck.model.stage import SeqChunk, Stage
from potluck.modelfile.gguf_file import GGUFFile

from ggufgen import write_tiny_model

transformers = pytest.importorskip("transformers")

TOKENS = [5, 70, 71, 72, 100, 3, 200, 150, 260, 9, 33, 34, 35, 36, 40, 41, 42, 43, 44, 45]

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
    ("llama", T.Q8_0, {"ffn_up_exps": T.Q6_K}, {"n_expert": 8, "n_ff_exp": 128, "n_embd": 256}),
]
# what transformers' GGUF loader does not read from the file (it keeps its config's defaults)
HF_CONFIG = {"n_ff_exp": "moe_intermediate_size", "n_ff_shexp": "shared_expert_intermediate_size"}


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
    else:
        config = {HF_CONFIG[k]: v for k, v in shape.items() if k in HF_CONFIG}
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, **config
        )
    with torch.no_grad():
        ref_logits = ref(torch.tensor([TOKENS])).logits[0].double()  # [T, V]
    return path, ref_logits


def _mixtral(path: Path) -> torch.nn.Module:
    """transformers' Mixtral over the file's tensors, dequantized (its GGUF loader reads a llama
    file with experts as a dense llama): q and k un-permuted as its llama loader does."""
    from gguf.quants import dequantize

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
        info = f.tensors[name]
        w = np.array(dequantize(f.raw(name), info.qtype), np.float32)  # (a writable copy)
        return torch.from_numpy(w.reshape(info.shape))

    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:  # GGUF's rope pairs -> halves
        return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)

    state = {"model.embed_tokens.weight": get("token_embd.weight"),
             "model.norm.weight": get("output_norm.weight")}  # fmt: skip
    if "output.weight" in f.tensors:
        state["lm_head.weight"] = get("output.weight")
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
    mean = float((ours - ref).abs().mean() / ref.abs().max())
    assert mean < 1.5e-2, f"mean rel err {mean:.2e} (max {_rel(ours, ref):.2e})"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.9, f"argmax agrees on only {agree:.0%} of positions"


def test_split_equals_whole(tiny) -> None:
    path, _ = tiny
    whole = _ours(path, exact=True)
    assert torch.equal(_ours(path, exact=True, splits=(1,)), whole)


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
