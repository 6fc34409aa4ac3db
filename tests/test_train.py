"""LoRA training against an independent reference: Hugging Face `transformers` (which loads the
GGUF and dequantizes it to fp32) with `peft`'s LoRA on the same matrices, the same adapter
values and the same tokens: one step gives the same loss and the same adapter gradients."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from potluck.errors import UnsupportedError
from potluck.model.archs import hparams_from_metadata
from potluck.modelfile.gguf_file import GGUFFile
from potluck.train.model import DEFAULT_TARGETS, LoraModel

from ggufgen import write_tiny_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0
HF = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
      "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}  # fmt: skip


def _permute(w: np.ndarray, n_head: int, inverse: bool = False) -> np.ndarray:
    """llama.cpp's q/k row order for llama GGUFs (its converter permutes HF's rows so that
    ggml's adjacent-pair RoPE applies); inverse: GGUF rows back to HF's."""
    half = w.shape[0] // n_head // 2
    if inverse:
        return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_rows(hp, arch: str, target: str):
    """GGUF -> HF row order of B for a target (identity except llama-style q/k)."""
    if arch in ("llama", "mistral") and target in ("attn_q", "attn_k"):
        n = hp.n_head if target == "attn_q" else hp.n_head_kv
        return lambda w, inverse=True: _permute(w, n, inverse)
    return lambda w, inverse=True: w


# head_dim as transformers assumes where the GGUF says nothing (qwen3: 128; gemma3: its
# query_pre_attn_scalar defaults to 256, llama.cpp's scale is 1/sqrt(head_dim): equal at 256)
CASES = [("llama", T.Q8_0, {}), ("qwen2", T.Q4_0, {}), ("qwen3", T.Q4_1, {"head_dim": 128}),
         ("gemma3", T.Q4_K, {"n_embd": 256, "n_ff": 512, "n_head_kv": 1, "head_dim": 256})]  # fmt: skip


@pytest.mark.parametrize("arch,qtype,shape", CASES, ids=[c[0] for c in CASES])
def test_one_step_equals_transformers_peft(tmp_path: Path, arch: str, qtype: T, shape) -> None:
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, None, qtype, n_layer=2, **shape)
    _one_step(path, arch)


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "olmo2", "granite", "gemma4"])
def test_blocks_the_trainer_cannot_express_are_refused(tmp_path: Path, arch: str) -> None:
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, None, T.Q8_0, tied=False)
    f = GGUFFile(path)
    with pytest.raises(UnsupportedError, match=f"fine-tuning {arch} is not supported yet"):
        LoraModel(hparams_from_metadata(f.metadata), f)


def test_a_soft_capped_llama_is_refused(tmp_path: Path) -> None:
    """Keys the trainer's forward leaves out are refused whatever the architecture."""
    extra = {"llama.final_logit_softcapping": 30.0}
    path = write_tiny_model(tmp_path / "m.gguf", "llama", None, T.Q8_0, extra=extra)
    f = GGUFFile(path)
    with pytest.raises(UnsupportedError, match="sets llama.final_logit_softcapping"):
        LoraModel(hparams_from_metadata(f.metadata), f)


@pytest.mark.slow  # ≈ 1 min: transformers loads SmolLM2's GGUF
def test_one_step_on_smollm2_equals_transformers_peft(smollm2_path: Path) -> None:
    _one_step(smollm2_path, "llama")


def _one_step(path: Path, arch: str) -> None:
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    ours = LoraModel(hp, f, DEFAULT_TARGETS, RANK, ALPHA, seed=0)
    rng = np.random.default_rng(1)
    pairs = {  # B not zero, so that A gets a gradient too
        name: (a, rng.standard_normal(b.shape).astype(np.float32) * 0.1)
        for name, (a, b) in ours.lora_pairs().items()
    }
    ours.load_pairs(pairs)

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                             target_modules=list(HF.values()))  # fmt: skip
    ref = peft.get_peft_model(ref, config)
    found = {}
    for mod_name, mod in ref.named_modules():
        m = re.search(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)$", mod_name)
        if m and hasattr(mod, "lora_A"):
            target = {v: k for k, v in HF.items()}[m.group(2)]
            found[f"blk.{m.group(1)}.{target}.weight"] = (mod, target)
    assert set(found) == set(pairs)
    with torch.no_grad():
        for name, (mod, target) in found.items():
            a, b = pairs[name]
            mod.lora_A["default"].weight.copy_(torch.from_numpy(a))
            mod.lora_B["default"].weight.copy_(torch.from_numpy(_hf_rows(hp, arch, target)(b)))

    ids = torch.tensor([[5, 70, 71, 72, 100, 3, 200, 150, 9, 33, 34, 35],
                        [40, 41, 42, 43, 44, 45, 60, 61, 62, 63, 64, 65]])  # fmt: skip
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a prompt whose tokens are not learned
    loss = ours.loss(ids, mask)
    loss.backward()
    logits = ref(input_ids=ids[:, :-1]).logits
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    ref_loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    )
    ref_loss.backward()
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * float(ref_loss), (
        float(loss),
        float(ref_loss),
    )
    worst = 0.0
    for name, (mod, target) in found.items():
        ad = ours.adapters[name.replace(".", "_")]
        ga_ref = mod.lora_A["default"].weight.grad
        gb_ref = torch.from_numpy(
            _hf_rows(hp, arch, target)(mod.lora_B["default"].weight.grad.numpy(), False)
        )
        for g, want in ((ad.a.grad, ga_ref), (ad.b.grad, gb_ref)):
            assert g is not None
            worst = max(worst, float((g - want).abs().max() / want.abs().max()))
    # fp32 round-off (our fp32 gradients are within 3e-6 of fp64 ones); a wrong rope, scale, mask
    # or norm moves the q/k gradients by O(1) of their range
    assert worst < 5e-4, f"adapter gradients differ by {worst:.2e} of their range"


def test_recompute_gives_the_same_gradients(tmp_path: Path) -> None:
    """Activation checkpointing: each layer computed again in backward, the same gradients."""
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", None, T.Q8_0, n_layer=3)
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    ids = torch.tensor([[5, 70, 71, 72, 100, 3, 200, 150, 9, 33]])
    grads = []
    for recompute in (False, True):
        m = LoraModel(hp, f, DEFAULT_TARGETS, RANK, ALPHA, seed=0, recompute=recompute)
        m.load_pairs({n: (a, np.full_like(b, 0.05)) for n, (a, b) in m.lora_pairs().items()})
        m.loss(ids, torch.ones_like(ids)).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
