"""The model for LoRA training, in PyTorch: the same llama-family function as model/graph.py
(rules as data from HParams), over the GGUF's own quantized bytes.

The base weights stay quantized in memory (the file's pages, mapped): each matrix is dequantized
to f32 when the forward pass reaches it and again when the backward pass does (`_Frozen`), and
never kept, so the whole model is never held in fp32 (QLoRA-style). Only the adapters train: for
each targeted matrix W (GGUF name, shape (n_out, n_in)), A (r, n_in) and B (n_out, r) in fp32,
y = W x + (alpha / r) · B (A x), initialised as PEFT does (A Kaiming-uniform, B zero), so that
training starts from the base model. Shapes in comments are torch's: x is (B, T, D).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn
from torch.utils.checkpoint import checkpoint

from potluck.errors import UnsupportedError
from potluck.model.archs import training_refusal
from potluck.model.ggml_lib import dequantize_rows
from potluck.model.weights import WeightSource
from potluck.modelfile.hparams import HParams

# targets by short name, as --targets takes them (GGUF names: blk.N.<name>.weight)
ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN = ("ffn_gate", "ffn_up", "ffn_down")
DEFAULT_TARGETS = ATTENTION + FFN


def dequantized(f: WeightSource, name: str, rows: np.ndarray | None = None) -> torch.Tensor:
    """The tensor (or some of its rows) as f32, made now from the file's bytes by ggml's own
    dequantization (every type ggml reads), on torch's threads."""
    info = f.tensors[name]
    raw = np.asarray(f.raw(name))
    if rows is not None:
        raw = raw[rows]
    n_in = info.shape[-1]
    out = torch.empty(raw.shape[0], n_in, dtype=torch.float32)
    if info.qtype == GGMLQuantizationType.F32:
        out.numpy()[:] = raw.view(np.float32).reshape(-1, n_in)
    else:
        dequantize_rows(int(info.qtype), np.ascontiguousarray(raw), out.numpy(),
                        torch.get_num_threads())  # fmt: skip
    return out


class _Frozen(torch.autograd.Function):
    """x @ W.T for a frozen quantized W: dequantized in forward, again in backward (for the
    input's gradient); W itself is never saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: WeightSource, name: str) -> torch.Tensor:
        ctx.f, ctx.name = f, name  # ctx: Any as in torch's own signature (attributes set freely)
        return x @ dequantized(f, name).T

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g @ dequantized(ctx.f, ctx.name), None, None


def _frozen_matmul(x: torch.Tensor, f: WeightSource, name: str) -> torch.Tensor:
    """x @ W.T through `_Frozen` (W = the tensor `name` of `f`, dequantized when needed)."""
    # torch leaves Function.apply unannotated
    y: torch.Tensor = _Frozen.apply(x, f, name)  # type: ignore[no-untyped-call]
    return y


class Adapter(nn.Module):
    """A (r, n_in) and B (n_out, r) of one matrix."""

    def __init__(self, n_out: int, n_in: int, rank: int, gen: torch.Generator) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(rank, n_in))
        self.b = nn.Parameter(torch.zeros(n_out, rank))
        bound = 1.0 / math.sqrt(n_in)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
        with torch.no_grad():
            self.a.uniform_(-bound, bound, generator=gen)


class LoraModel(nn.Module):
    """The base model (frozen, quantized, from `f`: a GGUF file, or the tensors a worker was
    sent) with trainable adapters on `targets`."""

    def __init__(
        self,
        hp: HParams,
        f: WeightSource,
        targets: Sequence[str] = DEFAULT_TARGETS,
        rank: int = 8,
        alpha: float = 16.0,
        seed: int = 0,
        recompute: bool = False,
    ) -> None:
        """recompute: keep only each layer's input for the backward pass and compute the layer
        again there (activation checkpointing): a layer's activations instead of all of them, for
        about a third more compute."""
        super().__init__()
        self.recompute = recompute
        if why := training_refusal(hp):
            raise UnsupportedError(why)
        if "rope_freqs.weight" in f.tensors:
            raise UnsupportedError(
                "the model has per-frequency RoPE factors (rope_freqs, Llama 3.1+), which "
                "training does not support yet"
            )
        self.hp, self.f, self.rank, self.alpha = hp, f, rank, alpha
        self.scaling = alpha / rank
        gen = torch.Generator().manual_seed(seed)
        self.adapters = nn.ModuleDict()
        for i in range(hp.n_layer):
            for t in targets:
                name = f"blk.{i}.{t}.weight"
                n_out, n_in = f.tensors[name].shape
                self.adapters[_key(name)] = Adapter(n_out, n_in, rank, gen)
        self._norms = {  # small: kept as f32 tensors
            n: dequantized(f, n).reshape(-1) for n, t in f.tensors.items() if len(t.shape) == 1
        }
        self.head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"

    # -- pieces ------------------------------------------------------------------------------
    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """W x (+ the adapter) (+ the bias), x (..., n_in) -> (..., n_out)."""
        w = name + ".weight"
        y = _frozen_matmul(x, self.f, w)
        if _key(w) in self.adapters:
            ad = self.adapter(w)
            y = y + self.scaling * ((x @ ad.a.T) @ ad.b.T)
        if (bias := self._norms.get(name + ".bias")) is not None:
            y = y + bias
        return y

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x32 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hp.rms_eps)
        return x32 * self._norms[name]

    def rope(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x (B, H, T, hd): rotate the first rope_dim dims by position (adjacent pairs for
        "norm", halves for "neox", as ggml's modes)."""
        hp, T = self.hp, x.shape[2]
        n = hp.rope_dim
        theta = hp.rope_base_for(layer) ** (-torch.arange(0, n, 2, dtype=torch.float64) / n)
        pos = torch.arange(T, dtype=torch.float64) / hp.rope_scale
        ang = (pos[:, None] * theta[None, :]).float()  # (T, n/2)
        cos, sin = ang.cos(), ang.sin()
        rot, rest = x[..., :n], x[..., n:]
        if hp.rules.rope_style == "neox":
            x0, x1 = rot[..., : n // 2], rot[..., n // 2 :]
            out = torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1)
        else:
            x0, x1 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)
        return torch.cat([out, rest], -1)

    def attention(self, i: int, h: torch.Tensor) -> torch.Tensor:
        hp, p = self.hp, f"blk.{i}."
        B, T, _ = h.shape
        H, Hkv, hd, hdv = hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
        q = self.linear(p + "attn_q", h).view(B, T, H, hd)
        k = self.linear(p + "attn_k", h).view(B, T, Hkv, hd)
        v = self.linear(p + "attn_v", h).view(B, T, Hkv, hdv).transpose(1, 2)  # (B, Hkv, T, hdv)
        if hp.rules.qk_norm:
            q, k = self.norm(q, p + "attn_q_norm.weight"), self.norm(k, p + "attn_k_norm.weight")
        q = self.rope(q.transpose(1, 2), i)  # (B, H, T, hd)
        k = self.rope(k.transpose(1, 2), i)
        if Hkv != H:  # grouped-query attention: each kv head serves H / Hkv query heads
            k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        pos = torch.arange(T)
        ok = pos[None, :] <= pos[:, None]  # (T, T): key j ≤ query i
        if hp.is_sliding(i):
            ok &= pos[:, None] - pos[None, :] < hp.sliding_window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=ok, scale=hp.attn_scale)
        return self.linear(p + "attn_output", o.transpose(1, 2).reshape(B, T, H * hdv))

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        hp, p = self.hp, f"blk.{i}."
        a = self.attention(i, self.norm(x, p + "attn_norm.weight"))
        if hp.rules.post_norms:
            a = self.norm(a, p + "post_attention_norm.weight")
        x = x + a
        h = self.norm(x, p + "ffn_norm.weight")
        gate, up = self.linear(p + "ffn_gate", h), self.linear(p + "ffn_up", h)
        act = F.silu(gate) if hp.rules.activation == "silu" else F.gelu(gate, approximate="tanh")
        f = self.linear(p + "ffn_down", act * up)
        if hp.rules.post_norms:
            f = self.norm(f, p + "post_ffw_norm.weight")
        return x + f

    # -- the model -----------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, V)."""
        hp = self.hp
        flat = ids.reshape(-1).numpy()
        x = dequantized(self.f, "token_embd.weight", flat).view(*ids.shape, hp.n_embd)
        if hp.rules.embed_scale_sqrt:
            x = x * math.sqrt(hp.n_embd)
        for i in range(hp.n_layer):
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(self.block, i, x, use_reentrant=False)
            else:
                x = self.block(i, x)
        x = self.norm(x, "output_norm.weight")
        if _key(self.head) in self.adapters:
            raise UnsupportedError("an adapter on the output head is not trained yet")
        return _frozen_matmul(x, self.f, self.head)

    def loss_sum(self, ids: torch.Tensor, learn: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of each next token where learn (B, T) is 1 (learn[:, 0] unused)."""
        logits = self.forward(ids[:, :-1])
        labels = ids[:, 1:].masked_fill(learn[:, 1:] == 0, -100)
        flat = logits.reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, labels.reshape(-1), reduction="sum")

    def loss(self, ids: torch.Tensor, learn: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy per learned token."""
        return self.loss_sum(ids, learn) / max(int((learn[:, 1:] != 0).sum()), 1)

    def adapter(self, name: str) -> Adapter:
        """The adapter of the matrix `name` (its GGUF name)."""
        ad = self.adapters[_key(name)]
        assert isinstance(ad, Adapter)
        return ad

    def lora_pairs(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{GGUF base name: (A, B)} as numpy f32 (modelfile.lora.write_lora takes them)."""
        out = {}
        for name in map(_name, self.adapters):
            ad = self.adapter(name)
            out[name] = (ad.a.detach().numpy().copy(), ad.b.detach().numpy().copy())
        return out

    def load_pairs(self, pairs: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                ad = self.adapter(name)
                ad.a.copy_(torch.from_numpy(np.asarray(a, np.float32)))
                ad.b.copy_(torch.from_numpy(np.asarray(b, np.float32)))


def _key(name: str) -> str:  # ModuleDict keys cannot hold '.'
    return name.replace(".", "_")


def _name(key: str) -> str:  # blk_3_attn_q_weight -> blk.3.attn_q.weight
    head, layer, rest = key.split("_", 2)
    return f"{head}.{layer}.{rest.removesuffix('_weight')}.weight"
