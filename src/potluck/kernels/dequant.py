"""GGML block formats -> float32, in torch, bit-exact with `gguf.quants.dequantize`.

One small registered function per GGML type. Each reads raw blocks as uint8 `[n_blocks,
type_size]` and writes their values into a float `[n_blocks, block_size]`; block and byte sizes
come from `gguf.GGML_QUANT_SIZES`. The arithmetic repeats gguf's exactly (same operands, same order,
no fused multiply-add), which is what makes the results bit-identical.

Large tensors are dequantized in chunks of blocks so that the several element-wise passes of each
format stay in cache (≈ 2x faster than whole-tensor passes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType
from gguf.quants import Q4_K as _GgufQ4K

from potluck.errors import ModelFileError, UnsupportedError

T = GGMLQuantizationType

# K-quants pack 6-bit sub-block scales and mins into 12 bytes (llama.cpp's K_SCALE_SIZE).
K_SCALE_SIZE: int = _GgufQ4K.K_SCALE_SIZE
# Values per chunk (1 MiB of float32). Measured best between 2^17 and 2^19: smaller chunks pay the
# per-op overhead (≈ 3 µs x 10-20 ops), larger ones fall out of cache.
CHUNK_ELEMENTS = 1 << 18

# (blocks uint8 [n, type_size], out float [n, block_size]) -> None; writes the values into out.
Dequant = Callable[[torch.Tensor, torch.Tensor], None]
_REGISTRY: dict[GGMLQuantizationType, Dequant] = {}


def _register(qtype: GGMLQuantizationType) -> Callable[[Dequant], Dequant]:
    def add(fn: Dequant) -> Dequant:
        _REGISTRY[qtype] = fn
        return fn

    return add


def _field(blocks: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [start, stop) of every block reinterpreted as `dtype`: [n_blocks, (stop-start)/size].

    Copied first: a column slice of the blocks is neither contiguous nor aligned for `dtype`.
    """
    return blocks[:, start:stop].clone(memory_format=torch.contiguous_format).view(dtype)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte `start` of every block, as float32 [n_blocks, 1]."""
    return _field(blocks, start, start + 2, torch.float16).float()


def _bytes(blocks: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
    """Bytes [start, stop) (stop None: to the block's end) of every block, contiguous uint8.

    Bit operations on a strided column slice run ≈ 4x slower than on a contiguous copy.
    """
    return blocks[:, start:stop].clone(memory_format=torch.contiguous_format)


def _shifted(packed: torch.Tensor, shifts: range | list[int], mask: int) -> torch.Tensor:
    """Bit fields (packed >> s) & mask of packed [..., L], one per shift: [..., len(shifts), L].

    Scalar shifts then a stack: a broadcast uint8 shift by a tensor of shifts is ≈ 10x slower.
    """
    return torch.stack([(packed >> s) & mask for s in shifts], dim=-2)


def _bits32(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The 32-bit mask at byte `start` of every block as [n_blocks, 32] uint8 0/1, bit i at i.

    Read as a native int32, like gguf's numpy view: assumes a little-endian host, as GGUF does.
    """
    h = _field(blocks, start, start + 4, torch.int32)  # (n, 1)
    return ((h >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0/Q4_1/Q5_x order: [n, 16] bytes -> [n, 32], low nibbles first then high nibbles."""
    return _shifted(qs, [0, 4], 0x0F).view(qs.shape[0], -1)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K order: [n, 128] bytes -> [n, 8, 32]; each 32 bytes give two 32-wide sub-blocks."""
    n = qs.shape[0]
    return _shifted(qs.view(n, -1, 32), [0, 4], 0x0F).view(n, -1, 32)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte scale fields [n, 12] -> 6-bit (scale, min) per sub-block, [n, 8] each.

    Bytes 0-3: low 6 bits = scale 0-3; bytes 4-7: low 6 bits = min 0-3; bytes 8-11: low nibble =
    low 4 bits of scale 4-7, high nibble = of min 4-7; the top 2 bits of bytes 0-7 give the rest.
    """
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


@_register(T.F32)
def _f32(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.float32))


@_register(T.F16)
def _f16_type(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.float16))


@_register(T.BF16)
def _bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.bfloat16))


@_register(T.Q4_0)
def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | qs: 16 bytes -> w = d * (q - 8)
    d = _f16(blocks, 0)
    q = _nibbles(_bytes(blocks, 2)).view(torch.int8) - 8
    torch.mul(d, q.float(), out=out)


@_register(T.Q4_1)
def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | m: f16 | qs: 16 bytes -> w = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    torch.add(d * _nibbles(_bytes(blocks, 4)).float(), m, out=out)


@_register(T.Q5_0)
def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | qh: u32 (bit i = bit 4 of value i) | qs: 16 bytes -> w = d * (q - 16)
    d = _f16(blocks, 0)
    q = _nibbles(_bytes(blocks, 6)) | (_bits32(blocks, 2) << 4)
    torch.mul(d, (q.view(torch.int8) - 16).float(), out=out)


@_register(T.Q5_1)
def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | m: f16 | qh: u32 | qs: 16 bytes -> w = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(_bytes(blocks, 8)) | (_bits32(blocks, 4) << 4)
    torch.add(d * q.float(), m, out=out)


@_register(T.Q8_0)
def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | qs: 32 x int8 -> w = q * d
    d = _f16(blocks, 0)
    torch.mul(blocks[:, 2:].view(torch.int8).float(), d, out=out)


# K-quants: super-blocks of QK_K = 256 values. Byte offsets of each field, in block order.
_Q2K_SCALES, _Q2K_QS, _Q2K_D = 0, QK_K // 16, QK_K // 16 + QK_K // 4
_Q3K_HMASK, _Q3K_QS, _Q3K_SCALES = 0, QK_K // 8, QK_K // 8 + QK_K // 4
_Q3K_D = _Q3K_SCALES + K_SCALE_SIZE
_Q4K_SCALES, _Q4K_QS = 4, 4 + K_SCALE_SIZE
_Q5K_QH, _Q5K_QS = 4 + K_SCALE_SIZE, 4 + K_SCALE_SIZE + QK_K // 8
_Q6K_QL, _Q6K_QH, _Q6K_SCALES = 0, QK_K // 2, QK_K // 2 + QK_K // 4
_Q6K_D = _Q6K_SCALES + QK_K // 16


@_register(T.Q2_K)
def _q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # scales: 16 bytes (low nibble scale, high nibble min) | qs: 64 bytes (2-bit) | d | dmin
    n = blocks.shape[0]
    scales = _bytes(blocks, _Q2K_SCALES, _Q2K_QS)
    d, dmin = _f16(blocks, _Q2K_D), _f16(blocks, _Q2K_D + 2)
    dl = (d * (scales & 0x0F).float()).view(n, -1, 1)  # (n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, -1, 1)
    qs = _bytes(blocks, _Q2K_QS, _Q2K_D).view(n, -1, 32)
    q = _shifted(qs, [0, 2, 4, 6], 0x03).view(n, QK_K // 16, 16)
    torch.sub(dl * q.float(), ml, out=out.view(n, QK_K // 16, 16))


@_register(T.Q3_K)
def _q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # hmask: 32 bytes (bit 2, inverted) | qs: 64 bytes (bits 0-1) | scales: 12 bytes | d
    n = blocks.shape[0]
    scales = _bytes(blocks, _Q3K_SCALES, _Q3K_D)
    d = _f16(blocks, _Q3K_D)
    # 16 6-bit scales, offset 32. Bytes 0-7: low 4 bits of scales 0-7 (low nibbles) and 8-15
    # (high nibbles); bytes 8-11: top 2 bits, scale i in byte 8 + i % 4 at bit 2 * (i // 4).
    lo = _shifted(scales[:, :8], [0, 4], 0x0F).view(n, 16)
    hi = _shifted(scales[:, 8:], [0, 2, 4, 6], 0x03).view(n, 16)
    sc = (lo | (hi << 4)).view(torch.int8) - 32
    dl = (d * sc.float()).view(n, 16, 1)
    qs = _bytes(blocks, _Q3K_QS, _Q3K_SCALES).view(n, -1, 32)
    ql = _shifted(qs, [0, 2, 4, 6], 0x03).view(n, 16, QK_K // 16)
    hmask = _bytes(blocks, _Q3K_HMASK, _Q3K_QS)
    qh = _shifted(hmask, range(8), 0x01).view(n, 16, QK_K // 16)
    # A set hmask bit means "no offset": q = ql - 4 * (1 - bit).
    q = ql.view(torch.int8) - ((qh ^ 1) << 2).view(torch.int8)
    torch.mul(dl, q.float(), out=out.view(n, 16, QK_K // 16))


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K per-sub-block scale d * sc_j and offset dmin * m_j, float32 [n, 8, 1] each."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(_bytes(blocks, _Q4K_SCALES, _Q4K_SCALES + K_SCALE_SIZE))
    return (d * sc.float()).view(n, -1, 1), (dmin * mn.float()).view(n, -1, 1)


@_register(T.Q4_K)
def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d | dmin | scales: 12 bytes (8 x 6-bit scale, 8 x 6-bit min) | qs: 128 bytes
    n = blocks.shape[0]
    dl, ml = _k_scales(blocks)
    q = _k_nibbles(_bytes(blocks, _Q4K_QS))
    torch.sub(dl * q.float(), ml, out=out.view(n, -1, 32))


@_register(T.Q5_K)
def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d | dmin | scales: 12 bytes | qh: 32 bytes (bit 4, a bit plane per sub-block) | qs: 128 B
    n = blocks.shape[0]
    dl, ml = _k_scales(blocks)
    qh = _shifted(_bytes(blocks, _Q5K_QH, _Q5K_QS), range(8), 0x01)  # (n, 8, 32)
    q = _k_nibbles(_bytes(blocks, _Q5K_QS)) | (qh << 4)
    torch.sub(dl * q.float(), ml, out=out.view(n, -1, 32))


@_register(T.Q6_K)
def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # ql: 128 bytes (bits 0-3) | qh: 64 bytes (bits 4-5) | scales: 16 x int8 | d
    # -> w = d * sc * (q - 32)
    n = blocks.shape[0]
    d = _f16(blocks, _Q6K_D)
    scales = _bytes(blocks, _Q6K_SCALES, _Q6K_D).view(torch.int8)
    dl = (d * scales.float()).view(n, QK_K // 16, 1)
    ql = _bytes(blocks, _Q6K_QL, _Q6K_QH).view(n, -1, 64)
    qh = _bytes(blocks, _Q6K_QH, _Q6K_SCALES).view(n, -1, 32)
    lo = _shifted(ql, [0, 4], 0x0F).view(n, -1, 32)  # (n, 8, 32)
    hi = _shifted(qh, [0, 2, 4, 6], 0x03).view(n, -1, 32)
    q = (lo | (hi << 4)).view(torch.int8) - 32
    torch.mul(dl, q.view(n, QK_K // 16, -1).float(), out=out.view(n, QK_K // 16, -1))


SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_REGISTRY)


def check_supported(qtype: GGMLQuantizationType) -> None:
    """Raise UnsupportedError (one line, names the type and the supported ones) if not supported."""
    if qtype not in _REGISTRY:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedError(
            f"GGML type {GGMLQuantizationType(qtype).name} is not supported (supported: {names})"
        )


def as_blocks(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> torch.Tensor:
    """The bytes of a [rows, cols] `qtype` matrix as uint8 blocks [n_blocks, type_size]."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    if cols % block_size:
        raise ModelFileError(
            f"a {qtype.name} row of {cols} values is not whole {block_size}-value blocks"
        )
    n_blocks = rows * (cols // block_size)
    if raw.dtype != torch.uint8:
        raw = raw.contiguous().view(torch.uint8)
    if raw.numel() != n_blocks * type_size:
        raise ModelFileError(
            f"{qtype.name} matrix {rows}x{cols} needs {n_blocks * type_size} bytes, "
            f"got {raw.numel()}"
        )
    return raw.reshape(n_blocks, type_size)


def dequantize(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize a GGML matrix to float32 [rows, cols], bit-exact with `gguf.quants.dequantize`.

    raw: uint8 bytes [rows, bytes_per_row] or flat (for F32/F16/BF16 also the typed tensor);
    shape: (rows, cols) = (GGUF ne[1], ne[0]). The result is always a new tensor.
    dtype: another float dtype gives those float32 values rounded, chunk by chunk (no float32
    copy of the whole matrix is made).
    """
    check_supported(qtype)
    fn = _REGISTRY[qtype]
    rows, cols = shape
    blocks = as_blocks(raw, qtype, shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if block_size == 1 and blocks.storage_offset() % type_size:
        blocks = blocks.clone()  # workaround: viewing bytes as fp32/fp16 needs an aligned offset
    out = torch.empty(blocks.shape[0], block_size, dtype=dtype)
    step = max(1, CHUNK_ELEMENTS // block_size)
    # Narrower dtypes go through a float32 chunk: an op writing bf16 directly runs ≈ 2x slower.
    scratch = None if dtype == torch.float32 else torch.empty(step, block_size)
    for start in range(0, blocks.shape[0], step):
        chunk = blocks[start : start + step]
        if scratch is None:
            fn(chunk, out[start : start + step])
        else:
            fn(chunk, scratch[: chunk.shape[0]])
            out[start : start + step].copy_(scratch[: chunk.shape[0]])
    return out.view(rows, cols)


# The int4 formats as one affine form, for torch's packed int4 matmul: w = (q - 8) * scale + zero
# per group of INT4_GROUP consecutive values of a row (a Q4_0/Q4_1 block, a Q4_K sub-block).
INT4_GROUP = QK_K // 8
Int4Groups = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
_INT4: dict[GGMLQuantizationType, Int4Groups] = {}


def _register_int4(qtype: GGMLQuantizationType) -> Callable[[Int4Groups], Int4Groups]:
    def add(fn: Int4Groups) -> Int4Groups:
        _INT4[qtype] = fn
        return fn

    return add


@_register_int4(T.Q4_0)
def _q4_0_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _f16(blocks, 0)
    return _nibbles(_bytes(blocks, 2)), d, torch.zeros_like(d)


@_register_int4(T.Q4_1)
def _q4_1_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # d * q + m = (q - 8) * d + (m + 8 d)
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _nibbles(_bytes(blocks, 4)), d, m + 8 * d


@_register_int4(T.Q4_K)
def _q4_k_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # d sc_j * q - dmin m_j = (q - 8) * d sc_j + (8 d sc_j - dmin m_j)
    dl, ml = _k_scales(blocks)  # (n, 8, 1)
    q = _k_nibbles(_bytes(blocks, _Q4K_QS))
    return q, dl, 8 * dl - ml


INT4_TYPES: frozenset[GGMLQuantizationType] = frozenset(_INT4)


def int4_groups(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An INT4_TYPES matrix [rows, cols] as w = (q - 8) * scale + zero per group of INT4_GROUP.

    Returns q uint8 [rows, cols] in 0..15 and scale, zero float32 [rows, cols / INT4_GROUP].
    Equal to `dequantize` up to float32 rounding (the affine form reorders gguf's arithmetic).
    """
    if qtype not in _INT4:
        names = ", ".join(sorted(t.name for t in INT4_TYPES))
        raise UnsupportedError(f"GGML type {qtype.name} has no int4 form (only {names})")
    rows, cols = shape
    q, scale, zero = _INT4[qtype](as_blocks(raw, qtype, shape))
    return q.reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1)
