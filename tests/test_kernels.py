"""potluck.kernels: bit-exact dequantization against gguf-py, and the quantized layers' accuracy."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from potluck.errors import ModelFileError, UnsupportedError
from potluck.kernels import native, ops
from potluck.kernels.dequant import (
    INT4_GROUP,
    INT4_TYPES,
    SUPPORTED_TYPES,
    dequantize,
    int4_groups,
)
from potluck.kernels.levels import NATIVE_TYPES, native_form, native_groups
from potluck.kernels.qlinear import (
    DENSE_MIN_ROWS,
    GEMV_MAX_ROWS,
    QConcat,
    QEmbedding,
    QLinear,
    plan,
    stack,
)

T = GGMLQuantizationType
HAS_NATIVE = native.library() is not None
# Both kernel sets where this machine has the native ones; torch's alone elsewhere.
KERNELS = (
    [pytest.param(True, id="native"), pytest.param(False, id="torch")]
    if HAS_NATIVE
    else [pytest.param(False, id="torch")]
)
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
U_CENTRE = {"u4": 8, "u8": 128}  # where the batched kernel centres the native kinds' values


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


@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_native_groups_reproduce_the_weights(qtype: GGMLQuantizationType) -> None:
    rows, cols = 16, _cols(qtype, 2)
    raw = raw_matrix(qtype, rows, cols)
    u, scale, mins = native_groups(as_bytes(raw), qtype, (rows, cols))
    u4, offset = native_form(qtype).u4, native_form(qtype).offset
    if native_form(qtype).half:  # held as fp16: must be exact
        for t in (scale, mins) if mins is not None else (scale,):
            assert torch.equal(t.half().float(), t)
    if u4:  # two per byte: value j of each group of 32 low, value j + 16 high
        pairs = u.view(rows, -1, 1, 16)
        u = torch.cat([pairs & 0x0F, pairs >> 4], dim=2).view(rows, cols)
    assert u.dtype == torch.uint8 and u.shape == (rows, cols)
    group = cols // scale.shape[1]
    assert group in (16, 32) and (mins is None or mins.shape == scale.shape)
    w = (u.double().view(rows, -1, group) - offset) * scale.double()[..., None]
    if mins is not None:
        w = w + mins.double()[..., None]
    w, want = w.view(rows, cols), reference(raw, qtype).double()
    # Same reordering of gguf's float32 arithmetic as the int4 form: a few ulps of the terms.
    m = mins.abs().double() if mins is not None else torch.zeros_like(scale).double()
    eps = 2.0**-24 * (300 * scale.abs().double() + 2 * m).repeat_interleave(group, 1)
    assert ((w - want).abs() <= eps).all()


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
    u4 / u8, up to GEMV_MAX_ROWS rows: x in 15-bit fixed point per group g, |dx| <= max|x_g| /
    32766, times sum over the group of |s (u - offset)| (the part the fixed-point x multiplies);
    fp32 scaling and accumulation as for f32. More rows, below DENSE_MIN_ROWS: the batched
    kernel, the same bound with u - centre (8 or 128: it centres the values, whatever the stored
    offset). From DENSE_MIN_ROWS: dense bf16, as for bf16.
    """
    n_out, n_in = layer.out_features, layer.in_features
    w_abs = reference(raw, qtype).double().abs()
    if layer.kind == "f32":
        return 1e-5 * x.double().abs() @ w_abs.T
    if layer.kind in ("u4", "u8") and x.shape[0] < DENSE_MIN_ROWS:
        u, scale, _ = native_groups(as_bytes(raw), qtype, (n_out, n_in))
        if layer.kind == "u4":
            pairs = u.view(n_out, -1, 1, 16)
            u = torch.cat([pairs & 0x0F, pairs >> 4], dim=2).view(n_out, n_in)
        offset = layer.format.offset if x.shape[0] <= GEMV_MAX_ROWS else U_CENTRE[layer.kind]
        g = layer.group
        scaled = (u.double().view(n_out, -1, g) - offset).abs() * scale.double().abs()[..., None]
        x_max = x.double().abs().view(x.shape[0], -1, g).amax(-1)  # (M, n_in / g)
        return x_max / 32766 @ scaled.sum(-1).T + 1e-5 * x.double().abs() @ w_abs.T
    if layer.kind == "int4":
        _, scale, zero = int4_groups(as_bytes(raw), qtype, (n_out, n_in))
        dw = U * (8 * scale.abs() + zero.abs()).double().repeat_interleave(INT4_GROUP, 1)
        return x.double().abs() @ (4 * U * w_abs + 2 * dw).T
    return 4 * U * (x.double().abs() @ w_abs.T)


def expected_kind(qtype: GGMLQuantizationType, use_native: bool) -> str:
    if qtype == T.F32:
        return "f32"
    if use_native and qtype in NATIVE_TYPES:
        return "u4" if qtype in INT4_TYPES else "u8"
    return "int4" if qtype in INT4_TYPES else "bf16"


@pytest.mark.parametrize("use_native", KERNELS)
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
# 9 and 40: the native kinds' batched and dense paths
@pytest.mark.parametrize("m", [1, 7, GEMV_MAX_ROWS + 1, max(40, DENSE_MIN_ROWS)])
def test_qlinear_matches_float64_reference(
    qtype: GGMLQuantizationType, m: int, use_native: bool
) -> None:
    n_out, n_in = 32, _cols(qtype, 2 if GGML_QUANT_SIZES[qtype][0] > 1 else 64)
    raw = raw_matrix(qtype, n_out, n_in, seed=m)
    layer = QLinear.from_raw(as_bytes(raw), qtype, (n_out, n_in), use_native=use_native)
    assert layer.kind == expected_kind(qtype, use_native)
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


@pytest.mark.parametrize("use_native", KERNELS)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0], ids=lambda t: t.name)
def test_qlinear_keeps_leading_dims(qtype: GGMLQuantizationType, use_native: bool) -> None:
    raw = as_bytes(raw_matrix(qtype, 16, 64))
    layer = QLinear.from_raw(raw, qtype, (16, 64), use_native=use_native)
    x = torch.randn(2, 3, 64)
    assert torch.equal(layer(x), layer(x.view(6, 64)).view(2, 3, 16))


def test_qlinear_int4_only_when_shape_fits() -> None:
    raw = raw_matrix(T.Q4_0, 24, 64)  # 24 output rows: not a multiple of 16
    layer = QLinear.from_raw(as_bytes(raw), T.Q4_0, (24, 64), use_native=False)
    assert layer.kind == "bf16"
    assert layer.nbytes == 24 * 64 * 2


def test_qlinear_nbytes_int4() -> None:
    n_out, n_in = 32, 512
    raw = as_bytes(raw_matrix(T.Q4_K, n_out, n_in))
    layer = QLinear.from_raw(raw, T.Q4_K, (n_out, n_in), use_native=False)
    # 4 bits per weight + a bf16 (scale, zero) pair per group of 32
    assert layer.kind == "int4"
    assert layer.nbytes == n_out * n_in // 2 + (n_in // INT4_GROUP) * n_out * 2 * 2


@pytest.mark.skipif(not HAS_NATIVE, reason="no native kernels on this machine")
@pytest.mark.parametrize(
    "qtype,kind,group,has_min,scale_bytes",
    [(T.Q4_0, "u4", 32, False, 2), (T.Q4_1, "u4", 32, True, 2), (T.Q4_K, "u4", 32, True, 4),
     (T.Q8_0, "u8", 32, False, 2), (T.Q6_K, "u8", 16, False, 4), (T.Q5_K, "u8", 32, True, 4)],
    ids=lambda v: getattr(v, "name", None),
)  # fmt: skip
def test_qlinear_nbytes_native(
    qtype: GGMLQuantizationType, kind: str, group: int, has_min: bool, scale_bytes: int
) -> None:
    # fp16 scales and mins where the file's are fp16 (legacy types), fp32 for the K-quants' d * sc
    n_out, n_in = 22, 768  # rows pad to tiles of 4; 768 = 6 u4 / 12 u8 chunks of 64 bytes
    layer = QLinear.from_raw(as_bytes(raw_matrix(qtype, n_out, n_in)), qtype, (n_out, n_in))
    assert (layer.kind, layer.group) == (kind, group)
    assert layer.format.half == (scale_bytes == 2)
    rows = 24  # whole tiles
    values = rows * n_in // (2 if kind == "u4" else 1)  # 4 or 8 bits per weight
    scales = rows * n_in // group * scale_bytes  # per group (no chunk padding at this n_in)
    mins = n_out * n_in // group * scale_bytes if has_min else 0
    assert layer.nbytes == values + scales + mins


@pytest.mark.parametrize("use_native", KERNELS)
@pytest.mark.parametrize(
    "qtypes",
    [(T.Q4_1, T.Q4_1, T.Q4_1), (T.Q5_0, T.Q8_0, T.Q5_0), (T.Q4_K, T.Q4_K, T.Q6_K)],
    ids=lambda ts: "+".join(t.name for t in ts),
)
def test_stack_equals_separate_layers(qtypes: tuple, use_native: bool) -> None:
    n_in, rows = 256, (64, 32, 48)
    parts = [
        (as_bytes(raw_matrix(q, n, n_in, seed=i)), q, (n, n_in))
        for i, (q, n) in enumerate(zip(qtypes, rows, strict=True))
    ]
    stacked = stack(parts, use_native=use_native)
    plans = {plan(q, s, use_native=use_native) for _, q, s in parts}
    assert isinstance(stacked, QLinear) == (len(plans) == 1)
    assert isinstance(stacked, QLinear | QConcat)
    for m in (1, 40):
        x = torch.randn(m, n_in)
        separate = torch.cat([QLinear.from_raw(*p, use_native=use_native)(x) for p in parts], -1)
        assert torch.allclose(stacked(x), separate, rtol=0, atol=1e-6 * float(separate.abs().max()))


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


@pytest.mark.parametrize("use_native", KERNELS)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_qembedding_as_linear_is_the_tied_head(
    qtype: GGMLQuantizationType, use_native: bool
) -> None:
    n_vocab, dim = 64, 96
    raw = raw_matrix(qtype, n_vocab, dim, seed=5)
    emb = QEmbedding.from_raw(as_bytes(raw), qtype, (n_vocab, dim))
    head = emb.as_linear(use_native=use_native)
    assert head.kind == expected_kind(qtype, use_native)
    assert (head.in_features, head.out_features) == (dim, n_vocab)
    h = torch.randn(3, dim, generator=torch.Generator().manual_seed(0))
    want = h.double() @ reference(raw, qtype).double().T
    assert ((head(h).double() - want).abs() <= error_bound(head, raw, qtype, h)).all()


# --- native kernels and ops -----------------------------------------------------------------------


def test_native_kernels_build_where_the_cpu_has_them() -> None:
    # A compile error would otherwise pass silently: everything falls back to torch's kernels.
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    if "avx512_vnni" not in flags or not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no AVX-512 VNNI CPU or no C compiler here")
    assert native.library() is not None, native.unavailable_reason()


@pytest.mark.skipif(not HAS_NATIVE, reason="no native kernels on this machine")
def test_native_norm_and_activations_match_torch() -> None:
    g = torch.Generator().manual_seed(0)
    x, a = torch.randn(3, 5, 48, generator=g) * 3, torch.randn(3, 5, 48, generator=g)
    w, w_rows = torch.randn(48, generator=g), torch.randn(5, 48, generator=g)
    for weight in (w, w_rows):  # one weight, or one per row of the second-last dim
        want = ops.rms_norm(x, weight, 1e-6, use_native=False)
        assert torch.allclose(ops.rms_norm(x, weight, 1e-6), want, rtol=1e-5, atol=1e-6)
    s, h = ops.add_rms_norm(x, a, w, 1e-6)
    assert torch.equal(s, x + a)
    assert torch.allclose(h, ops.rms_norm(x + a, w, 1e-6, use_native=False), rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(4, 2 * 40, generator=g) * 4
    for act in ("silu", "gelu_tanh"):
        exact = ops.gated_act(gate_up.double(), act, use_native=False)
        err = (ops.gated_act(gate_up, act) - exact).abs()
        # torch's own fp32 result is the yardstick: its 1 + tanh cancels for negative gates
        torch_err = (ops.gated_act(gate_up, act, use_native=False) - exact).abs()
        assert (err <= torch_err + 1e-6 * exact.abs() + 1e-7).all()


@pytest.mark.parametrize("n_head,n_kv,hd,length,window", [(9, 3, 64, 37, 0), (4, 1, 256, 20, 8),
                                                            (4, 4, 32, 1, 0), (6, 2, 48, 70, 16)])  # fmt: skip
def test_decode_attention_matches_sdpa(
    n_head: int, n_kv: int, hd: int, length: int, window: int
) -> None:
    g = torch.Generator().manual_seed(length)
    q = torch.randn(1, n_head, hd, generator=g)
    k, v = torch.randn(length, n_kv, hd, generator=g), torch.randn(length, n_kv, hd, generator=g)
    want = ops.attention(q, k, v, length - 1, hd**-0.5, window, use_native=False)
    # the same query as the last row of a prefill (SDPA's causal / masked path)
    rows = torch.cat([torch.zeros(length - 1, n_head, hd), q])
    full = ops.attention(rows, k, v, 0, hd**-0.5, window, use_native=False)[-1:]
    assert torch.allclose(want, full, rtol=1e-5, atol=1e-6)
    got = ops.attention(q, k, v, length - 1, hd**-0.5, window)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def _rope_reference(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, base: float, style: str):
    """RoPE as written before the pair reordering: x [T, H, hd] at positions pos [T]."""
    inv = 1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    ang = pos[:, None].double() * inv[None, :]
    c, s = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    if style == "norm":
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = rot[..., : rope_dim // 2], rot[..., rope_dim // 2 :]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((out, rest), dim=-1)


@pytest.mark.parametrize("style", ["norm", "neox"])
@pytest.mark.parametrize("rope_dim", [64, 32])  # 32 < head_dim: partial rotary
def test_rope_in_pair_order_matches_reference(style: str, rope_dim: int) -> None:
    hd, start, n = 64, 5, 7
    x = torch.randn(n, 3, hd, generator=torch.Generator().manual_seed(1))
    want = _rope_reference(x, torch.arange(start, start + n), rope_dim, 10000.0, style)
    order = ops.neox_to_pairs(hd, rope_dim) if style == "neox" else torch.arange(hd)
    got = x[..., order].contiguous()  # what the reordered rows of W_q / W_k produce
    ops.rotate_pairs_(got, ops.RotaryTable(rope_dim, hd, 10000.0).get(start, n))
    assert torch.allclose(got, want[..., order], rtol=0, atol=1e-6)


@pytest.mark.parametrize("use_native", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_decode_matches_prefill(arch: str, use_native: bool, tmp_path) -> None:
    # Token-by-token decode (the fused native step, or ops' per-op path) against one prefill of
    # the same tokens; gemma3's sliding window (8) is crossed. Exact weights: fp32 round-off only.
    from potluck.model.stage import SeqChunk, Stage
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.modelfile.hparams import hparams_from_metadata

    from ggufgen import write_tiny_model

    shape = {"n_head_kv": 1, "head_dim": 64} if arch == "gemma3" else {}
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, None, T.Q8_0, **shape)
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    tokens = torch.tensor([5, 70, 71, 72, 100, 3, 200, 150, 260, 9, 33, 34, 35, 36, 40, 41, 42])
    for exact in (True, False):
        stage = Stage(hp, f, 0, hp.n_layer, 64, exact=exact, use_native=use_native)
        whole = stage(tokens, [SeqChunk(0, len(tokens))], torch.arange(len(tokens)))
        stage(tokens[:3], [SeqChunk(1, 3)])
        steps = [stage(tokens[i : i + 1], [SeqChunk(1, 1)]) for i in range(3, len(tokens))]
        stepped = torch.cat(steps)
        scale = float(whole.abs().max())
        # exact: fp32 only; fast: bf16 prefill vs fixed-point decode (both ≈ 1e-3 of the range)
        tol = 1e-4 if exact else 2e-2
        assert (stepped - whole[3:]).abs().max() / scale < tol
