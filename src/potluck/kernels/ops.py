"""Element-wise and attention kernels of the llama family, in fp32 (see BENCHMARKS.md: fp32
attention is ≈ 6× faster than bf16 at decode on these CPUs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from potluck.kernels import native


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, use_native: bool = True
) -> torch.Tensor:
    """x * rsqrt(mean(x²) + eps) * weight over the last dim. (GGUF stores Gemma's 1 + w already.)

    weight: [D], or [W, D] for x [..., W, D] (q/k norms of all heads at once). A contiguous x
    takes the native kernel where there is one: one call instead of six ops (2.8 vs 12.9 µs at
    D = 576, one core).
    """
    if use_native and x.is_contiguous() and native.library() is not None:
        return native.rms_norm(x, weight, eps)[1]
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def add_rms_norm(
    x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float, use_native: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) for the residual stream s = x + a: one native call where possible."""
    if use_native and x.is_contiguous() and a.is_contiguous() and native.library() is not None:
        return native.rms_norm(x, weight, eps, residual=a)
    s = x + a
    return s, rms_norm(s, weight, eps, use_native)


def gated_act(gate_up: torch.Tensor, activation: str, use_native: bool = True) -> torch.Tensor:
    """act(gate) * up for gate_up = [gate | up] [T, 2F] -> [T, F]; activation "silu" or
    "gelu_tanh" (GELU's tanh approximation)."""
    if use_native and gate_up.is_contiguous() and native.library() is not None:
        return native.gated(gate_up, activation)
    n_ff = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :n_ff], gate_up[..., n_ff:]
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act.mul_(up)


def neox_to_pairs(head_dim: int, rope_dim: int) -> torch.Tensor:
    """Index [head_dim] that reorders one head from neox RoPE order to adjacent pairs.

    neox rotates (x[i], x[i + rope_dim/2]); after `x[perm]` those sit at (2i, 2i + 1), the "norm"
    order llama GGUFs already use, so one complex multiply rotates every architecture. Applied to
    the rows of W_q and W_k (and to q/k norm weights) at load: q·k is unchanged, as both move alike.
    """
    half = rope_dim // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    return torch.cat([pairs, torch.arange(rope_dim, head_dim)])


class RotaryTable:
    """e^(i·pos·θ_j) for one base, pairs j < head_dim/2, grown on demand; pairs past rope_dim/2
    get 1 (partial rotary: those dims pass through unchanged, with no copy)."""

    def __init__(self, rope_dim: int, head_dim: int, base: float, scale: float = 1.0) -> None:
        self.rope_dim, self.head_dim = rope_dim, head_dim
        # (rope_dim/2,) inverse frequencies, computed in fp64 then rounded once
        exponents = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
        self.inv_freq = (1.0 / (base**exponents) / scale).to(torch.float64)
        self.table = torch.ones(0, head_dim // 2, dtype=torch.complex64)

    def get(self, start: int, n: int) -> torch.Tensor:
        """Rotations of positions [start, start + n): complex64 [n, 1, head_dim/2]."""
        return self.upto(start + n)[start : start + n, None, :]

    def upto(self, stop: int) -> torch.Tensor:
        """The whole table, complex64 [>= stop, head_dim/2] (row p: position p)."""
        if stop > self.table.shape[0]:
            size = max(stop, 2 * self.table.shape[0], 256)
            angles = torch.arange(size, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
            # cos and sin each rounded to fp32, as a real-valued table would be
            rot = torch.complex(angles.cos().float(), angles.sin().float())
            table = torch.ones(size, self.head_dim // 2, dtype=torch.complex64)
            table[:, : self.rope_dim // 2] = rot
            self.table = table
        return self.table


def rotate_pairs_(x: torch.Tensor, rot: torch.Tensor) -> None:
    """In place: (x[2j], x[2j+1]) of each head rotated by rot[..., j]. x: [T, heads, hd] fp32 with
    a contiguous last dim (a column slice of a wider tensor is fine); rot: [T, 1, hd/2] complex64."""
    torch.view_as_complex(x.unflatten(-1, (-1, 2))).mul_(rot)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    window: int,
    use_native: bool = True,
) -> torch.Tensor:
    """Causal attention of T new queries at positions [start, start+T) over L = start+T keys.

    q: [T, H, hd]; k: [L, Hkv, hd]; v: [L, Hkv, hdv] (token-major, as the KV cache holds them)
    -> [T, H * hdv]. Query head h reads kv head h // (H / Hkv). window > 0: a query at p sees keys
    at j with p - j < window (the sliding-window rule of llama.cpp and transformers).
    """
    T, H, hd = q.shape
    L, n_kv, hdv = k.shape[0], k.shape[1], v.shape[2]
    if T == 1:  # decode: every key is visible, bar those that left the window
        first = L - window if window and L > window else 0
        if use_native and native.library() is not None and native.attention_decode_fits(hd, hdv):
            # SmolLM2's 9 heads at L = 20 / 300: 11 / 34 µs against SDPA's 18 / 51 (one core)
            return native.attention_decode(q[0].contiguous(), k[first:], v[first:], 0, scale)
        kh, vh = k[first:].transpose(0, 1), v[first:].transpose(0, 1)  # [Hkv, L', dim]
        # SDPA wants [1, heads, L, dim] and 4-D inputs: with 3-D or enable_gqa it takes its
        # unfused path, 2-3x slower at decode and ≈ 5x at a 512-token prefill (SmolLM2 shapes).
        # The G = H / Hkv query heads that share a kv head go in as G queries: no K/V copy.
        qg = q.view(1, n_kv, H // n_kv, hd)
        o = F.scaled_dot_product_attention(qg, kh[None], vh[None], scale=scale)
        return o.reshape(1, H * hdv)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, dim]
    if start == 0 and (not window or T <= window):
        if n_kv != H:  # the fused causal kernel has no GQA: repeat each kv head G times
            kh = kh[:, None].expand(n_kv, H // n_kv, L, hd).reshape(H, L, hd)
            vh = vh[:, None].expand(n_kv, H // n_kv, L, hdv).reshape(H, L, hdv)
        qh = q.transpose(0, 1)[None]  # [1, H, T, hd]
        o = F.scaled_dot_product_attention(qh, kh[None], vh[None], is_causal=True, scale=scale)
        return o[0].transpose(0, 1).reshape(T, H * hdv)
    # A micro-batch after the first (or past the window): an explicit mask. The G = H / Hkv query
    # heads of a kv head go in as G * T queries of that head, the mask repeated G times, so K and
    # V are not copied G times (SmolLM2, G = 3, 64-row micro-batches of a 512-token prompt:
    # 5.5 instead of 6.9 ms per layer, one core).
    G = H // n_kv
    qpos = torch.arange(start, start + T)[:, None]
    kpos = torch.arange(L)[None, :]
    mask = kpos <= qpos  # [T, L]
    if window:
        mask &= (qpos - kpos) < window
    qg = q.view(T, n_kv, G, hd).permute(1, 2, 0, 3).reshape(1, n_kv, G * T, hd)  # rows g * T + t
    o = F.scaled_dot_product_attention(
        qg, kh[None], vh[None], attn_mask=mask.repeat(G, 1), scale=scale
    )  # [1, Hkv, G * T, hdv]
    return o[0].view(n_kv, G, T, hdv).permute(2, 0, 1, 3).reshape(T, H * hdv)
