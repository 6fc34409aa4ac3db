"""GGML types as the native kernels' groups: w = scale * (u - offset) + min per group of 16 or 32.

One registered unit per type reads its blocks into 4-bit (u4: Q4_0, Q4_1, Q4_K) or 8-bit (u8:
Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, Q2_K; a 5- or 6-bit value takes a byte) values u with a scale and an
optional min per group; tests check each against gguf's dequantization. Field decoding reuses
dequant.py's helpers: GGML's layouts stay written down once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# with dequant's private field readers: the same decoding, not a second copy of GGML's layouts
from potluck.kernels.dequant import (  # noqa: I001
    _Q2K_D,
    _Q4K_QS,
    _Q6K_D,
    _Q6K_SCALES,
    _bits32,
    _bytes,
    _f16,
    _k_scales,
    _nibbles,
    as_blocks,
    dequantize,
)

T = GGMLQuantizationType

# blocks uint8 [n, type_size] -> u uint8 [n, block_size] (u4: packed, [n, block_size / 2]),
# scale [n, groups], min [n, groups] | None
Levels = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class NativeForm:
    u4: bool
    group: int
    offset: int
    levels: Levels
    half: bool  # scales and mins are fp16 values (the legacy types' d and m): held as fp16


_NATIVE: dict[GGMLQuantizationType, NativeForm] = {}
U4_OFFSET, U8_OFFSET = 8, 128  # centre of the values: signed types store q + offset


def _register(qtype: GGMLQuantizationType, u4: bool, group: int, offset: int, half: bool = False):
    def add(fn: Levels) -> Levels:
        _NATIVE[qtype] = NativeForm(u4, group, offset, fn, half)
        return fn

    return add


def _exact(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The blocks' exact values, float32 [n, block_size]."""
    return dequantize(blocks, qtype, (blocks.shape[0], GGML_QUANT_SIZES[qtype][0]))


def _solve(
    w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, offset: int
) -> torch.Tensor:
    """u = round((w - min) / scale) + offset per group, as uint8; w [n, G * g], scale [n, g].

    Exact: w = fl(scale * q + min) with small integer q, so the quotient is q up to ≈ 2^-20.
    """
    n, groups = scale.shape
    wg = w.view(n, groups, -1)
    t = wg - mins[..., None] if mins is not None else wg
    q = torch.where(scale[..., None] != 0, t / scale[..., None], 0.0).round_()
    return (q + offset).to(torch.uint8).view(n, -1)


# u4 values come packed, two per byte as the kernels read them: in each group of 32, byte j holds
# value j (low nibble) and value j + 16 (high nibble). That is Q4_0/Q4_1's own order, so their
# bytes are taken as they are (unpacking them to repack took most of SmolLM2's load time).


@_register(T.Q4_0, u4=True, group=32, offset=U4_OFFSET, half=True)
def _q4_0_levels(blocks: torch.Tensor):
    # d: f16 | qs: 16 bytes -> w = d * (q - 8)
    return blocks[:, 2:], _f16(blocks, 0), None


@_register(T.Q4_1, u4=True, group=32, offset=0, half=True)
def _q4_1_levels(blocks: torch.Tensor):
    # d: f16 | m: f16 | qs: 16 bytes -> w = d * q + m, kept as stored: d and m are fp16, so they
    # are held as fp16 (20 bytes per 32 weights like the file, not 24; ≈ 14 % of SmolLM2's bytes)
    return blocks[:, 4:], _f16(blocks, 0), _f16(blocks, 2)


@_register(T.Q4_K, u4=True, group=32, offset=U4_OFFSET)
def _q4_k_levels(blocks: torch.Tensor):
    # w = d sc_j * q - dmin m_j = (q - 8) * d sc_j + (8 d sc_j - dmin m_j) per sub-block j.
    # qs: 4 x 32 bytes; in each, the low nibbles are sub-block 2i and the high ones 2i + 1.
    n = blocks.shape[0]
    dl, ml = (t.squeeze(-1) for t in _k_scales(blocks))  # (n, 8)
    qs = _bytes(blocks, _Q4K_QS).view(n, 4, 2, 16)  # bytes [0, 16) and [16, 32) of each 32
    first, second = qs[:, :, 0], qs[:, :, 1]
    even = (first & 0x0F) | ((second & 0x0F) << 4)  # sub-block 2i: values j, j + 16
    odd = (first >> 4) | (second & 0xF0)  # sub-block 2i + 1
    return torch.stack([even, odd], dim=2).view(n, -1), dl, 8 * dl - ml


@_register(T.Q8_0, u4=False, group=32, offset=U8_OFFSET, half=True)
def _q8_0_levels(blocks: torch.Tensor):
    # d: f16 | 32 x int8: u = q + 128 is the byte with its top bit flipped
    return blocks[:, 2:] ^ 0x80, _f16(blocks, 0), None


@_register(T.Q5_0, u4=False, group=32, offset=U8_OFFSET, half=True)
def _q5_0_levels(blocks: torch.Tensor):
    # d: f16 | qh: u32 (bit i = bit 4 of value i) | qs: 16 bytes -> w = d * (q - 16); read the
    # bits as dequant does (solving from the float values instead took 2/3 of Gemma-3's load)
    q = _nibbles(_bytes(blocks, 6)) | (_bits32(blocks, 2) << 4)
    return q + (U8_OFFSET - 16), _f16(blocks, 0), None


# Types with a min store q - center (centred like the signed ones) and min + center * scale:
# the kernel's fixed-point error scales with |u - offset|, so 0..31 would double it (measured
# 1.4e-4 vs 4e-5 relative on random Q5_1 data).


@_register(T.Q5_1, u4=False, group=32, offset=U8_OFFSET)
def _q5_1_levels(blocks: torch.Tensor):
    d, m = _f16(blocks, 0), _f16(blocks, 2)  # w = d * q + m, q in 0..31
    mins = m + 16 * d
    return _solve(_exact(blocks, T.Q5_1), d, mins, U8_OFFSET), d, mins


@_register(T.Q5_K, u4=False, group=32, offset=U8_OFFSET)
def _q5_k_levels(blocks: torch.Tensor):
    dl, ml = (t.squeeze(-1) for t in _k_scales(blocks))  # (n, 8): w = dl * q - ml, q in 0..31
    mins = 16 * dl - ml
    return _solve(_exact(blocks, T.Q5_K), dl, mins, U8_OFFSET), dl, mins


@_register(T.Q6_K, u4=False, group=16, offset=U8_OFFSET)
def _q6_k_levels(blocks: torch.Tensor):
    sc = blocks[:, _Q6K_SCALES:_Q6K_D].contiguous().view(torch.int8).float()
    dl = _f16(blocks, _Q6K_D) * sc  # (n, 16): w = dl * q
    return _solve(_exact(blocks, T.Q6_K), dl, None, U8_OFFSET), dl, None


@_register(T.Q2_K, u4=False, group=16, offset=U8_OFFSET)
def _q2_k_levels(blocks: torch.Tensor):
    sc = blocks[:, :16]  # low nibble: scale, high nibble: min, per 16 values
    dl = _f16(blocks, _Q2K_D) * (sc & 0x0F).float()
    ml = _f16(blocks, _Q2K_D + 2) * (sc >> 4).float()  # w = dl * q - ml, q in 0..3
    mins = 2 * dl - ml
    return _solve(_exact(blocks, T.Q2_K), dl, mins, U8_OFFSET), dl, mins


NATIVE_TYPES: frozenset[GGMLQuantizationType] = frozenset(_NATIVE)
# Rows of blocks converted at once: bounds the float32 scratch (≈ 4 MiB) for large heads.
_LEVELS_CHUNK_WEIGHTS = 1 << 20


def native_groups(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A NATIVE_TYPES matrix [rows, cols] as u uint8 [rows, cols] (u4: two per byte, [rows,
    cols / 2], see above), scale and min fp32 [rows, cols / group] (min None when zero) with
    w = scale * (u - offset) + min (offset and group: native_form(qtype))."""
    form = _NATIVE[qtype]
    rows, cols = shape
    blocks = as_blocks(raw, qtype, shape)
    u = torch.empty(rows * cols // (2 if form.u4 else 1), dtype=torch.uint8)
    scale = torch.empty(rows * cols // form.group)
    mins = None
    step = max(1, _LEVELS_CHUNK_WEIGHTS // GGML_QUANT_SIZES[qtype][0])  # blocks per chunk
    for i in range(0, blocks.shape[0], step):  # filled in place: no second copy of a large head
        q, s, m = form.levels(blocks[i : i + step])
        u[i * q.shape[1] : i * q.shape[1] + q.numel()] = q.reshape(-1)
        scale[i * s.shape[1] : i * s.shape[1] + s.numel()] = s.reshape(-1)
        if m is not None:
            mins = torch.empty_like(scale) if mins is None else mins
            mins[i * m.shape[1] : i * m.shape[1] + m.numel()] = m.reshape(-1)
    return u.view(rows, -1), scale.view(rows, -1), None if mins is None else mins.view(rows, -1)


def native_form(qtype: GGMLQuantizationType) -> NativeForm:
    """Format of a NATIVE_TYPES type: u4 or u8, group size, offset."""
    return _NATIVE[qtype]
