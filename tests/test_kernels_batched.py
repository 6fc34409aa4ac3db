"""The native batched product (QLinear from GEMV_MAX_ROWS + 1 rows to below DENSE_MIN_ROWS: prompt
micro-batches) against a float64 reference, the dense path's fast dequantization, and the
properties the engine relies on: a row's result does not depend on the rows batched with it nor on
the thread count, and the matrix-vector path (<= GEMV_MAX_ROWS rows, the scheduler's decode
batches) still gives every row exactly what a batch of one gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from potluck.kernels import native
from potluck.kernels.levels import NATIVE_TYPES, native_groups
from potluck.kernels.qlinear import DENSE_MIN_ROWS, GEMV_MAX_ROWS, QLinear
from test_kernels import U_CENTRE, _cols, as_bytes, raw_matrix, reference

T = GGMLQuantizationType
pytestmark = pytest.mark.skipif(native.library() is None, reason="no native kernels here")
TYPES = sorted(NATIVE_TYPES, key=lambda t: t.value)


def _layer(qtype: GGMLQuantizationType, n_out: int, blocks: int, seed: int = 0):
    n_in = _cols(qtype, blocks)
    raw = raw_matrix(qtype, n_out, n_in, seed)
    return QLinear.from_raw(as_bytes(raw), qtype, (n_out, n_in)), raw


def batched_bound(layer: QLinear, raw: np.ndarray, qtype: GGMLQuantizationType, x: torch.Tensor):
    """|y - x @ W.T| bound of the batched kernel, float64: each group g of x becomes 15-bit fixed
    point with the scale max|x_g| / 16383, so |dx| <= max|x_g| / 32766, times sum over the group
    of |s (u - centre)| (the kernel centres u at 8 or 128, whatever the stored offset; the min
    term uses the exact sum of x); plus fp32 accumulation."""
    n_out, n_in = layer.out_features, layer.in_features
    u, scale, _ = native_groups(as_bytes(raw), qtype, (n_out, n_in))
    if layer.kind == "u4":
        pairs = u.view(n_out, -1, 1, 16)
        u = torch.cat([pairs & 0x0F, pairs >> 4], dim=2).view(n_out, n_in)
    centre, g = U_CENTRE[layer.kind], layer.group
    scaled = (u.double().view(n_out, -1, g) - centre).abs() * scale.double().abs()[..., None]
    x_max = x.double().abs().view(x.shape[0], -1, g).amax(-1)  # (M, n_in / g)
    w_abs = reference(raw, qtype).double().abs()
    return x_max / 32766 @ scaled.sum(-1).T + 1e-5 * x.double().abs() @ w_abs.T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [GEMV_MAX_ROWS + 1, 12, 16, 37])
def test_batched_matches_float64_reference(qtype: GGMLQuantizationType, m: int) -> None:
    # 2 blocks per row: K-quants 512 wide (2 chunks), legacy 64 (a short chunk: the tail path);
    # 37 output rows: a last tile of one row
    layer, raw = _layer(qtype, 37, 2, seed=m)
    assert GEMV_MAX_ROWS < m < DENSE_MIN_ROWS
    x = torch.randn(m, layer.in_features, generator=torch.Generator().manual_seed(m))
    x[0, :8] *= 50.0  # an outlier group: its scale must stay its own
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (m, 37)
    w = reference(raw, qtype).double()
    want = x.double() @ w.T
    bound = batched_bound(layer, raw, qtype, x)
    assert ((y.double() - want).abs() <= bound).all()
    # negative control: the bound catches a nibble-order bug (halves of each group swapped)
    swapped = w.view(37, -1, 2, 16).flip(2).reshape(37, -1)
    assert ((x.double() @ swapped.T - want).abs() > bound).any()


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_batched_row_does_not_depend_on_its_batch(qtype: GGMLQuantizationType) -> None:
    # A row gives bit-identical output whatever rows are batched with it, wherever it sits in the
    # batch (a full block of 8 rows, a short last block) and however many threads run: a prompt's
    # logits do not depend on the micro-batch size's effect on the linear layers.
    layer, _ = _layer(qtype, 200, 4)
    m = DENSE_MIN_ROWS - 1
    x = torch.randn(m, layer.in_features, generator=torch.Generator().manual_seed(1))
    whole = layer(x)
    for lo, hi in [(0, 9), (3, 20), (m - 9, m), (5, m - 2)]:
        assert torch.equal(layer(x[lo:hi]), whole[lo:hi]), (lo, hi)
    row = x[17:18].expand(GEMV_MAX_ROWS + 1, -1).contiguous()  # one row, 9 times
    assert (layer(row) == whole[17]).all()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(layer(x), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dense_dequantization_is_the_bf16_of_the_weight(qtype: GGMLQuantizationType) -> None:
    # The dense path (DENSE_MIN_ROWS rows and more) dequantizes row ranges of the tiled weight to
    # bf16: every row range, also ones that start and end inside a tile, must give exactly
    # fma(scale, u - offset, min) of the native form rounded to bf16 (that is the reference weight
    # rounded to bf16 where the native form is exact), 37 rows: a last tile of one row.
    layer, raw = _layer(qtype, 37, 3)
    n, k = 37, layer.in_features
    u, scale, mins = native_groups(as_bytes(raw), qtype, (n, k))
    if layer.kind == "u4":
        pairs = u.view(n, -1, 1, 16)
        u = torch.cat([pairs & 0x0F, pairs >> 4], dim=2).view(n, k)
    g = layer.group
    w = (u.double().view(n, -1, g) - layer.format.offset) * scale.double()[..., None]
    if mins is not None:  # a product and a sum of fp32 values: exact in float64, one rounding
        w = w + mins.double()[..., None]
    want = w.view(n, k).float().to(torch.bfloat16)
    args = (layer.packed, layer.scales_and_zeros, layer.mins)
    for lo, hi in [(0, 37), (1, 6), (5, 36), (36, 37)]:
        got = native.dequant_bf16(*args, (lo, hi), layer.in_features, layer.format)
        assert torch.equal(got, want[lo:hi]), (lo, hi)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_decode_batches_stay_bit_identical_to_single_rows(qtype: GGMLQuantizationType) -> None:
    # the scheduler batches up to GEMV_MAX_ROWS decode rows on the promise that each row gets
    # exactly what it would alone (greedy output independent of the other streams)
    layer, _ = _layer(qtype, 96, 6)
    x = torch.randn(GEMV_MAX_ROWS, layer.in_features, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(GEMV_MAX_ROWS)])
    for m in range(2, GEMV_MAX_ROWS + 1):
        assert torch.equal(layer(x[:m]), alone[:m]), m


def test_no_rows_gives_an_empty_result() -> None:
    layer, _ = _layer(T.Q4_0, 32, 2)
    y = layer(torch.empty(0, layer.in_features))
    assert y.shape == (0, 32) and y.dtype == torch.float32


def test_micro_batched_prefill_matches_one_batch(tmp_path) -> None:
    # A tiny model's prompt in micro-batches of 9 and 16 (the batched kernel, attention over a
    # growing cache) against one batch of the whole prompt: the same logits up to the 8-bit
    # activations' rounding.
    from potluck.model.stage import SeqChunk, Stage
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.modelfile.hparams import hparams_from_metadata

    from ggufgen import write_tiny_model

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", None, T.Q4_1)
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    stage = Stage(hp, f, 0, hp.n_layer, 64)
    tokens = torch.tensor([5, 70, 71, 72, 100, 3, 200, 150, 260, 9, 33, 34, 35, 36, 40, 41, 42] * 2)
    whole = stage(tokens, [SeqChunk(0, len(tokens))], torch.arange(len(tokens)))
    scale = float(whole.abs().max())
    for seq, size in ((1, 9), (2, 16)):
        parts = []
        for i in range(0, len(tokens), size):
            part = tokens[i : i + size]
            parts.append(stage(part, [SeqChunk(seq, len(part))], torch.arange(len(part))))
        err = float((torch.cat(parts) - whole).abs().max()) / scale
        assert err < 2e-2, f"micro-batches of {size}: {err:.2e} of the logit range"


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize(("n_head", "n_kv"), [(6, 2), (4, 4), (4, 1)])
def test_chunked_attention_matches_float64(n_head: int, n_kv: int, window: int) -> None:
    # ops.attention for micro-batches after the first (start > 0: the explicit-mask path, GQA
    # query heads grouped per kv head) against softmax(q k^T) v in float64 with the causal (and
    # sliding-window) rule; a wrong head grouping or mask row order moves it by O(1).
    from potluck.kernels.ops import attention

    hd, total, scale = 16, 23, 0.25
    g = torch.Generator().manual_seed(n_head * 10 + n_kv + window)
    q = torch.randn(total, n_head, hd, generator=g)
    k = torch.randn(total, n_kv, hd, generator=g)
    v = torch.randn(total, n_kv, hd, generator=g)
    for start, t in [(0, 9), (9, 7), (16, 7)]:
        got = attention(q[start : start + t], k[: start + t], v[: start + t], start, scale, window)
        want = torch.empty(t, n_head, hd, dtype=torch.float64)
        for i in range(t):
            p = start + i
            keys = [j for j in range(p + 1) if not window or p - j < window]
            for h in range(n_head):
                kv = h // (n_head // n_kv)
                s = (k[keys, kv].double() @ q[p, h].double()) * scale
                want[i, h] = torch.softmax(s, 0) @ v[keys, kv].double()
        assert torch.allclose(got.double(), want.reshape(t, -1), rtol=0, atol=1e-5), (start, t)
