"""Element-wise and attention kernels of the llama family, in fp32 (see BENCHMARKS.md: fp32
attention is ≈ 6× faster than bf16 at decode on these CPUs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x²) + eps) * weight over the last dim. (GGUF stores Gemma's 1 + w already.)"""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RotaryTable:
    """cos/sin of RoPE angles for one base, grown on demand. positions: LongTensor [T]."""

    def __init__(self, rope_dim: int, base: float, scale: float = 1.0) -> None:
        self.rope_dim = rope_dim
        # (rope_dim/2,) inverse frequencies, computed in fp64 then rounded once
        exponents = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
        self.inv_freq = (1.0 / (base**exponents) / scale).to(torch.float64)
        self.cos = torch.empty(0, rope_dim // 2)
        self.sin = torch.empty(0, rope_dim // 2)

    def get(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, rope_dim/2] fp32."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 256)
            angles = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
            self.cos, self.sin = angles.cos().float(), angles.sin().float()
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate the first rope_dim dims of each head. x: [T, H, hd]; cos/sin: [T, rope_dim/2].

    style "norm": pairs (x[2i], x[2i+1]) — llama GGUFs (the converter permutes q/k for this);
    style "neox": pairs (x[i], x[i + rope_dim/2]) — qwen2/3, gemma3.
    """
    rd = cos.shape[-1] * 2
    rot, rest = x[..., :rd], x[..., rd:]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, rd/2]
    if style == "norm":
        pairs = rot.unflatten(-1, (rd // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = rot[..., : rd // 2], rot[..., rd // 2 :]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, window: int
) -> torch.Tensor:
    """Causal attention of T new queries at positions [start, start+T) over L = start+T keys.

    q: [H, T, hd]; k: [Hkv, L, hd]; v: [Hkv, L, hdv] -> [H, T, hdv]. window > 0: a query at p sees
    keys at j with p - j < window (the sliding-window rule of llama.cpp and transformers).
    """
    T, L = q.shape[1], k.shape[1]
    if T == 1:
        if window and L > window:  # decode: just drop the keys that fell out of the window
            k, v = k[:, L - window :], v[:, L - window :]
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    if start == 0 and (not window or T <= window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    qpos = torch.arange(start, start + T)[:, None]
    kpos = torch.arange(L)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= (qpos - kpos) < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
