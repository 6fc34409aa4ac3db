"""A stage: the layers [start, stop) of a llama-family model, with its own KV caches.

Module attributes carry GGUF tensor names (`token_embd`, `blk["12"].attn_q`, `output_norm`), and a
stage keeps global layer indices. The first stage embeds token ids; the others take hidden states;
the last one ends in the output head and returns logits for the rows asked for. Several sequences
go through one call: their tokens are concatenated for the matmuls, attention runs per sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from potluck.errors import ModelFileError, UnsupportedError
from potluck.kernels.dequant import SUPPORTED_TYPES
from potluck.kernels.ops import RotaryTable, apply_rope, attention, rms_norm
from potluck.kernels.qlinear import QEmbedding, QLinear
from potluck.model.kv_cache import SeqCache
from potluck.modelfile.gguf_file import TensorInfo
from potluck.modelfile.hparams import HParams


class WeightSource(Protocol):
    """Where a stage's tensors come from: a GGUFFile, or tensors received over the network."""

    tensors: dict[str, TensorInfo]

    def raw(self, name: str) -> np.ndarray: ...


@dataclass(frozen=True)
class SeqChunk:
    """`n` consecutive new tokens of sequence `seq_id` in one forward call."""

    seq_id: int
    n: int


def _qlinear(src: WeightSource, name: str, shape: tuple[int, int], exact: bool) -> QLinear:
    info = _check(src, name, shape)
    return QLinear.from_raw(torch.from_numpy(np.array(src.raw(name))), info.qtype, shape, exact)


def _vector(src: WeightSource, name: str, n: int) -> torch.Tensor:
    info = _check(src, name, (n,))
    raw = np.array(src.raw(name)).reshape(-1)
    from potluck.kernels.dequant import dequantize

    return dequantize(torch.from_numpy(raw), info.qtype, (1, n)).reshape(n)


def _check(src: WeightSource, name: str, shape: tuple[int, ...]) -> TensorInfo:
    info = src.tensors.get(name)
    if info is None:
        raise ModelFileError(f"tensor {name} is missing from the model file")
    if info.shape != shape:
        raise ModelFileError(
            f"tensor {name} has shape {info.shape}, expected {shape} from the metadata"
        )
    if info.qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedError(
            f"tensor {name} uses quantization {info.qtype.name}, not supported; supported: {names}"
        )
    return info


class Block(nn.Module):
    """One transformer block: attention and a gated FFN, each behind an RMSNorm residual."""

    def __init__(self, hp: HParams, index: int, src: WeightSource, exact: bool = False) -> None:
        super().__init__()
        p, d = f"blk.{index}.", hp.n_embd
        self.index, self.hp = index, hp
        self.attn_norm = nn.Parameter(_vector(src, p + "attn_norm.weight", d), requires_grad=False)
        self.attn_q = _qlinear(src, p + "attn_q.weight", (hp.n_head * hp.head_dim, d), exact)
        self.attn_k = _qlinear(src, p + "attn_k.weight", (hp.n_head_kv * hp.head_dim, d), exact)
        self.attn_v = _qlinear(src, p + "attn_v.weight", (hp.n_head_kv * hp.head_dim_v, d), exact)
        self.attn_output = _qlinear(
            src, p + "attn_output.weight", (d, hp.n_head * hp.head_dim_v), exact
        )
        self.biases: dict[str, torch.Tensor] = {}
        for name, n in (("attn_q", hp.n_head * hp.head_dim), ("attn_k", hp.n_head_kv * hp.head_dim),
                        ("attn_v", hp.n_head_kv * hp.head_dim_v)):  # fmt: skip
            if p + name + ".bias" in src.tensors:  # qwen2
                self.biases[name] = _vector(src, p + name + ".bias", n)
        if hp.rules.qk_norm:
            self.attn_q_norm = _vector(src, p + "attn_q_norm.weight", hp.head_dim)
            self.attn_k_norm = _vector(src, p + "attn_k_norm.weight", hp.head_dim)
        self.ffn_norm = _vector(src, p + "ffn_norm.weight", d)
        self.ffn_gate = _qlinear(src, p + "ffn_gate.weight", (hp.n_ff, d), exact)
        self.ffn_up = _qlinear(src, p + "ffn_up.weight", (hp.n_ff, d), exact)
        self.ffn_down = _qlinear(src, p + "ffn_down.weight", (d, hp.n_ff), exact)
        if hp.rules.post_norms:
            self.post_attention_norm = _vector(src, p + "post_attention_norm.weight", d)
            self.post_ffw_norm = _vector(src, p + "post_ffw_norm.weight", d)
        self.window = hp.sliding_window if hp.is_sliding(index) else 0

    def _proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = getattr(self, name)(x)
        bias = self.biases.get(name)
        return y + bias if bias is not None else y

    def forward(
        self,
        x: torch.Tensor,
        chunks: Sequence[SeqChunk],
        caches: Sequence[SeqCache],
        rope: RotaryTable,
    ) -> torch.Tensor:
        """x: [T_total, D] -> [T_total, D]."""
        hp, eps = self.hp, self.hp.rms_eps
        h = rms_norm(x, self.attn_norm, eps)
        q = self._proj("attn_q", h).unflatten(-1, (hp.n_head, hp.head_dim))  # [T, H, hd]
        k = self._proj("attn_k", h).unflatten(-1, (hp.n_head_kv, hp.head_dim))  # [T, Hkv, hd]
        v = self._proj("attn_v", h).unflatten(-1, (hp.n_head_kv, hp.head_dim_v))
        if hp.rules.qk_norm:
            q, k = rms_norm(q, self.attn_q_norm, eps), rms_norm(k, self.attn_k_norm, eps)
        outs, t0 = [], 0
        for chunk, cache in zip(chunks, caches, strict=True):
            t1 = t0 + chunk.n
            start = cache.length
            cos, sin = rope.get(torch.arange(start, start + chunk.n))
            qs = apply_rope(q[t0:t1], cos, sin, hp.rules.rope_style).transpose(0, 1)  # [H, n, hd]
            ks = apply_rope(k[t0:t1], cos, sin, hp.rules.rope_style).transpose(0, 1)
            kall, vall = cache.write(self.index, ks, v[t0:t1].transpose(0, 1))
            o = attention(qs, kall, vall, start, hp.attn_scale, self.window)  # [H, n, hdv]
            outs.append(o.transpose(0, 1).flatten(1))  # [n, H*hdv]
            t0 = t1
        a = self.attn_output(torch.cat(outs) if len(outs) > 1 else outs[0])
        if hp.rules.post_norms:
            a = rms_norm(a, self.post_attention_norm, eps)
        x = x + a
        h = rms_norm(x, self.ffn_norm, eps)
        gate = self.ffn_gate(h)
        act = F.silu(gate) if hp.rules.activation == "silu" else F.gelu(gate, approximate="tanh")
        f = self.ffn_down(act * self.ffn_up(h))
        if hp.rules.post_norms:
            f = rms_norm(f, self.post_ffw_norm, eps)
        return x + f


class Stage(nn.Module):
    """Layers [start, stop) of the model described by `hp`, loaded from `src`.

    forward(x, chunks): x is LongTensor [T_total] of token ids when start == 0, else fp32 hidden
    states [T_total, n_embd]. Returns hidden states [T_total, n_embd], or for the last stage logits
    [R, n_vocab] for the rows selected by `logits_rows` (default: the last token of each chunk).
    """

    def __init__(
        self,
        hp: HParams,
        src: WeightSource,
        start: int,
        stop: int,
        n_ctx: int,
        on_layer: Callable[[int], None] | None = None,
        exact: bool = False,
    ) -> None:
        super().__init__()
        if not 0 <= start < stop <= hp.n_layer:
            raise ValueError(f"layer range [{start}, {stop}) is not inside [0, {hp.n_layer})")
        self.hp, self.start, self.stop, self.n_ctx = hp, start, stop, n_ctx
        self.is_first, self.is_last = start == 0, stop == hp.n_layer
        if self.is_first or self.is_last:
            info = _check(src, "token_embd.weight", (hp.n_vocab, hp.n_embd))
            embd_raw = torch.from_numpy(np.array(src.raw("token_embd.weight")))
        if self.is_first:
            self.token_embd = QEmbedding.from_raw(embd_raw, info.qtype, (hp.n_vocab, hp.n_embd))
        self.blk = nn.ModuleDict()
        for i in range(start, stop):
            self.blk[str(i)] = Block(hp, i, src, exact)
            if on_layer is not None:
                on_layer(i)
        if self.is_last:
            self.output_norm = _vector(src, "output_norm.weight", hp.n_embd)
            if "output.weight" in src.tensors:
                self.output = _qlinear(src, "output.weight", (hp.n_vocab, hp.n_embd), exact)
            else:  # tied embeddings: the head reads the embedding matrix
                self.output = QLinear.from_raw(embd_raw, info.qtype, (hp.n_vocab, hp.n_embd), exact)
        self.ropes: dict[float, RotaryTable] = {}
        for i in range(start, stop):
            base = hp.rope_base_for(i)
            if base not in self.ropes:
                self.ropes[base] = RotaryTable(hp.rope_dim, base, hp.rope_scale)
        self.caches: dict[int, SeqCache] = {}

    # -- sequences -------------------------------------------------------------------------------
    def cache(self, seq_id: int) -> SeqCache:
        if seq_id not in self.caches:
            hp = self.hp
            self.caches[seq_id] = SeqCache(
                range(self.start, self.stop), hp.n_head_kv, hp.head_dim, hp.head_dim_v, self.n_ctx
            )
        return self.caches[seq_id]

    def drop(self, seq_id: int) -> None:
        self.caches.pop(seq_id, None)

    def weight_bytes(self) -> int:
        """Bytes of weights this stage holds in memory (packed int4, bf16 or fp32)."""
        total = 0
        for m in self.modules():
            if isinstance(m, QLinear | QEmbedding):
                total += m.nbytes
        for blk in self.blk.values():
            total += sum(
                t.numel() * t.element_size()
                for t in vars(blk).values()
                if isinstance(t, torch.Tensor)
            )
        return total

    # -- compute ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        x: torch.Tensor,
        chunks: Sequence[SeqChunk],
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        total = sum(c.n for c in chunks)
        if x.shape[0] != total:
            raise ValueError(f"input has {x.shape[0]} rows but the chunks add up to {total}")
        caches = [self.cache(c.seq_id) for c in chunks]
        for c, cache in zip(chunks, caches, strict=True):
            cache.reserve(c.n)
        if self.is_first:
            x = self.token_embd(x)
            if self.hp.rules.embed_scale_sqrt:
                x = x * torch.tensor(self.hp.n_embd**0.5, dtype=torch.float32)
        for i in range(self.start, self.stop):
            x = self.blk[str(i)](x, chunks, caches, self.ropes[self.hp.rope_base_for(i)])
        for c, cache in zip(chunks, caches, strict=True):
            cache.commit(c.n)
        if not self.is_last:
            return x
        if logits_rows is None:
            logits_rows = torch.tensor(np.cumsum([c.n for c in chunks]) - 1)
        h = rms_norm(x[logits_rows], self.output_norm, self.hp.rms_eps)
        return self.output(h)
