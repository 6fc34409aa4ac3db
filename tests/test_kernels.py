"""potluck.kernels: bit-exact dequantization against gguf-py, and the quantized layers' accuracy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from potluck.errors import ModelFileError, UnsupportedError
from potluck.kernels.dequant import (
    INT4_GROUP,
    INT4_TYPES,
    SUPPORTED_TYPES,
    dequantize,
    int4_groups,
)
from potluck.kernels.qlinear import QEmbedding, QLinear

T = GGMLQuantizationType
ALL = sorted(SUPPORTED_TYPES, key=lambda t: t.value)
FLOATS = (T.F32, T.F16, T.BF16)
# Byte offsets of the fp16 scale fields in each block (ggml's block layouts). Random bytes there
# would give NaN/inf, and NaN never compares equal; every other byte may be anything.
FP16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
# bf16 unit roundoff: every rounding to bf16 is off by at most U relative.
U = 2.0**-9


def _cols(qtype: GGMLQuantizationType, n_blocks: int) -> int:
    return GGML_QUANT_SIZES[qtype][0] * n_blocks


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid raw bytes [rows, bytes_per_row]: random bytes, finite random fp16 scale fields."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        field = rng.uniform(-0.05, 0.05, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off : off + 2] = field.view(np.uint8)
    return blocks.reshape(rows, -1)


def quantized(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray | None:
    """gguf's own quantization of random normal data, or None where gguf cannot quantize qtype."""
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    try:
        return quants.quantize(data, qtype)
    except NotImplementedError:  # gguf-py has no quantizer for the K-quants
        return None


def raw_matrix(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    q = quantized(qtype, rows, cols, seed)
    return q if q is not None else random_blocks(qtype, rows, cols, seed)


def reference(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, qtype), dtype=np.float32))


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # also tells -0.0 from 0.0


def as_bytes(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())


# --- dequantize ---------------------------------------------------------------------------------


def test_gguf_quantizes_the_float_and_legacy_types() -> None:
    # So those are tested on gguf's own quantizer output; gguf-py 0.19 cannot quantize the
    # K-quants, which are tested on random valid blocks (and on quantized data once it can).
    legacy = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
    assert all(quantized(t, 1, _cols(t, 1), 0) is not None for t in FLOATS + legacy)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,n_blocks", [(1, 1), (5, 3)])
def test_dequantize_bit_exact_quantized(
    qtype: GGMLQuantizationType, rows: int, n_blocks: int
) -> None:
    cols = _cols(qtype, n_blocks) * (7 if qtype in FLOATS else 1)
    raw = raw_matrix(qtype, rows, cols, seed=rows)
    want = reference(raw, qtype)
    assert_bit_exact(dequantize(as_bytes(raw), qtype, (rows, cols)), want)  # flat bytes
    rows_raw = as_bytes(raw).view(rows, -1)  # [rows, bytes_per_row]
    assert_bit_exact(dequantize(rows_raw, qtype, (rows, cols)), want)


@pytest.mark.parametrize("qtype", sorted(FP16_FIELDS, key=lambda t: t.value), ids=lambda t: t.name)
def test_dequantize_bit_exact_random_blocks(qtype: GGMLQuantizationType) -> None:
    # Every bit pattern outside the scale fields, including ones gguf's quantizer never emits.
    rows, cols = 6, _cols(qtype, 4)
    raw = random_blocks(qtype, rows, cols, seed=7)
    assert_bit_exact(dequantize(as_bytes(raw), qtype, (rows, cols)), reference(raw, qtype))


def test_dequantize_chunks_large_matrix() -> None:
    # More blocks than one chunk (CHUNK_ELEMENTS), with a ragged last chunk.
    rows, cols = 37, _cols(T.Q4_K, 31)
    raw = random_blocks(T.Q4_K, rows, cols, seed=3)
    assert_bit_exact(dequantize(as_bytes(raw), T.Q4_K, (rows, cols)), reference(raw, T.Q4_K))


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_dequantize_float_types(qtype: GGMLQuantizationType) -> None:
    special = [0.0, -0.0, float("inf"), -float("inf"), 1e-40, 3e-8, 65504.0, -1.5]
    data = np.array(special * 3, dtype=np.float32).reshape(3, 8)
    raw = quants.quantize(data, qtype)  # float32, float16, or uint8 bytes for BF16
    want = reference(raw, qtype)
    if qtype == T.BF16:
        typed = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
    else:
        typed = torch.from_numpy(raw.copy())
    assert_bit_exact(dequantize(typed, qtype, (3, 8)), want)  # the typed tensor
    unaligned = torch.zeros(raw.nbytes + 1, dtype=torch.uint8)
    unaligned[1:] = as_bytes(raw)
    assert_bit_exact(dequantize(unaligned[1:], qtype, (3, 8)), want)  # odd byte offset


def test_dequantize_to_bf16_rounds_the_float32_values() -> None:
    raw = raw_matrix(T.Q6_K, 4, 512)
    got = dequantize(as_bytes(raw), T.Q6_K, (4, 512), torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, reference(raw, T.Q6_K).to(torch.bfloat16))


def test_unsupported_type_names_it() -> None:
    with pytest.raises(UnsupportedError, match="TQ1_0") as err:
        dequantize(torch.zeros(54, dtype=torch.uint8), T.TQ1_0, (1, 256))
    assert "Q4_K" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UnsupportedError, match="IQ2_XXS"):
        QLinear.from_raw(torch.zeros(66 * 16, dtype=torch.uint8), T.IQ2_XXS, (16, 256))


def test_wrong_byte_count_is_a_model_file_error() -> None:
    with pytest.raises(ModelFileError, match="needs 36 bytes, got 35"):
        dequantize(torch.zeros(35, dtype=torch.uint8), T.Q4_0, (2, 32))
    with pytest.raises(ModelFileError, match="not whole"):
        dequantize(torch.zeros(18, dtype=torch.uint8), T.Q4_0, (1, 31))


@pytest.mark.parametrize("qtype", sorted(INT4_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_int4_groups_reproduce_the_weights(qtype: GGMLQuantizationType) -> None:
    rows, cols = 16, _cols(qtype, 2)
    raw = raw_matrix(qtype, rows, cols)
    q, scale, zero = int4_groups(as_bytes(raw), qtype, (rows, cols))
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    w = (q.double().view(rows, -1, INT4_GROUP) - 8) * scale.double()[..., None]
    w = (w + zero.double()[..., None]).view(rows, cols)
    want = reference(raw, qtype).double()
    # The affine form reorders gguf's float32 arithmetic: gguf rounds d * q (|d q| <= 15|d|) and
    # the sum (|w| <= 23|d| + |z|), we round z = m + 8d: under 2^-24 (39|s| + 2|z|) in all.
    eps = 2.0**-24 * (40 * scale.abs() + 2 * zero.abs()).double()
    bound = eps.repeat_interleave(INT4_GROUP, 1)
    assert ((w - want).abs() <= bound).all()


# --- QLinear ------------------------------------------------------------------------------------


def error_bound(
    layer: QLinear, raw: np.ndarray, qtype: GGMLQuantizationType, x: torch.Tensor
) -> torch.Tensor:
    """An elementwise bound on |y - x @ W.T| for the layer's representation, in float64.

    bf16: W, x and the output are each rounded to bf16 once (relative U each), accumulation is
    fp32 (negligible here): |dy| <= (2U + U) * |x| @ |W|.T, to first order; we allow 4U.
    int4: each group's scale s and zero z are rounded to bf16, so |dw| <= U * (8|s| + |z|)
    (|q - 8| <= 8), not U * |w| (the two terms may cancel); plus x and output rounding as above.
    f32: only float32 accumulation: 1e-5 relative is generous at these sizes.
    """
    n_out, n_in = layer.out_features, layer.in_features
    w_abs = reference(raw, qtype).double().abs()
    if layer.kind == "f32":
        return 1e-5 * x.double().abs() @ w_abs.T
    if layer.kind == "int4":
        _, scale, zero = int4_groups(as_bytes(raw), qtype, (n_out, n_in))
        dw = U * (8 * scale.abs() + zero.abs()).double().repeat_interleave(INT4_GROUP, 1)
        return x.double().abs() @ (4 * U * w_abs + 2 * dw).T
    return 4 * U * (x.double().abs() @ w_abs.T)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 7])
def test_qlinear_matches_float64_reference(qtype: GGMLQuantizationType, m: int) -> None:
    n_out, n_in = 32, _cols(qtype, 2 if GGML_QUANT_SIZES[qtype][0] > 1 else 64)
    raw = raw_matrix(qtype, n_out, n_in, seed=m)
    layer = QLinear.from_raw(as_bytes(raw), qtype, (n_out, n_in))
    expected_kind = "int4" if qtype in INT4_TYPES else "f32" if qtype == T.F32 else "bf16"
    assert layer.kind == expected_kind
    x = torch.randn(m, n_in, generator=torch.Generator().manual_seed(m))
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (m, n_out)
    w = reference(raw, qtype).double()
    want = x.double() @ w.T
    bound = error_bound(layer, raw, qtype, x)
    assert ((y.double() - want).abs() <= bound).all()
    # Negative control: the bound is tight enough to catch a nibble-order bug (halves swapped).
    swapped = w.view(n_out, -1, 2, 16).flip(2).reshape(n_out, n_in)
    assert ((x.double() @ swapped.T - want).abs() > bound).any()


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0], ids=lambda t: t.name)
def test_qlinear_keeps_leading_dims(qtype: GGMLQuantizationType) -> None:
    layer = QLinear.from_raw(as_bytes(raw_matrix(qtype, 16, 64)), qtype, (16, 64))
    x = torch.randn(2, 3, 64)
    assert torch.equal(layer(x), layer(x.view(6, 64)).view(2, 3, 16))


def test_qlinear_int4_only_when_shape_fits() -> None:
    raw = raw_matrix(T.Q4_0, 24, 64)  # 24 output rows: not a multiple of 16
    layer = QLinear.from_raw(as_bytes(raw), T.Q4_0, (24, 64))
    assert layer.kind == "bf16"
    assert layer.nbytes == 24 * 64 * 2


def test_qlinear_nbytes_int4() -> None:
    n_out, n_in = 32, 512
    layer = QLinear.from_raw(as_bytes(raw_matrix(T.Q4_K, n_out, n_in)), T.Q4_K, (n_out, n_in))
    # 4 bits per weight + a bf16 (scale, zero) pair per group of 32
    assert layer.kind == "int4"
    assert layer.nbytes == n_out * n_in // 2 + (n_in // INT4_GROUP) * n_out * 2 * 2


# --- QEmbedding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_qembedding_rows_bit_exact(qtype: GGMLQuantizationType) -> None:
    n_vocab, dim = 48, _cols(qtype, 2 if qtype != T.F16 else 64)
    raw = raw_matrix(qtype, n_vocab, dim, seed=11)
    emb = QEmbedding.from_raw(as_bytes(raw), qtype, (n_vocab, dim))
    assert emb.nbytes == raw.nbytes
    ids = torch.tensor([[3, 0, 47], [3, 12, 5]])
    got = emb(ids)
    assert got.shape == (2, 3, dim)
    want = reference(raw, qtype)[ids]
    assert torch.equal(got, want)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("qtype,kind", [(T.Q8_0, "bf16"), (T.Q4_0, "int4")])
def test_qembedding_as_linear_is_the_tied_head(qtype: GGMLQuantizationType, kind: str) -> None:
    n_vocab, dim = 64, 96
    raw = raw_matrix(qtype, n_vocab, dim, seed=5)
    head = QEmbedding.from_raw(as_bytes(raw), qtype, (n_vocab, dim)).as_linear()
    assert head.kind == kind and (head.in_features, head.out_features) == (dim, n_vocab)
    h = torch.randn(3, dim, generator=torch.Generator().manual_seed(0))
    want = h.double() @ reference(raw, qtype).double().T
    assert ((head(h).double() - want).abs() <= error_bound(head, raw, qtype, h)).all()
