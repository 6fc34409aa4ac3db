"""Drop-in quantized linear and embedding layers built once from raw GGUF bytes.

QLinear picks, at construction, the fastest representation this machine has for the GGML type:
  u4 / u8  (native.py, needs AVX-512 VNNI and a C compiler) the group-quantized weight as 4-/8-bit
        values with a scale and min per group (levels.py), fp16 where that is exact (the legacy
        types' d and m), else fp32: Q4_0/Q4_1/Q4_K -> u4; Q5_0/Q5_1/Q5_K/Q6_K/Q8_0/Q2_K -> u8
        (a 5- or 6-bit value takes a byte). Batch <= GEMV_MAX_ROWS: the native matrix-vector
        kernel (fp32 in and out, 15-bit fixed-point activations); up to DENSE_MIN_ROWS: the
        native batched kernel (the same activations, a weight tile shared by 8 rows); larger
        batches: the weight dequantized to bf16 chunk by chunk and torch's bf16 matmul (oneDNN).
  int4  without native kernels, Q4_0/Q4_1/Q4_K with n_out % 16 == 0: torch's packed int4, group
        32, bf16 activations (its fp32-activation path is a scalar loop, ≈ 40x slower).
  bf16  every other type: dequantized once into a dense bf16 [n_out, n_in] weight.
  f32   F32 weights, and every type when exact=True: dense fp32.
Activations and results are float32 at the interface; model code never sees the representation.

Accuracy, relative to float64 x @ W.T with W the exact dequantized weight:
  u4 / u8 batch <= GEMV_MAX_ROWS: |dy| <= sum over groups g of max|x_g| / 32766 *
        sum|scale (u - offset)| (fixed-point activations) plus fp32 rounding; on random data
        max|dy| / max|y| 3-10e-5 against 2-4e-3 for the bf16 paths.
  u4 / u8 batch < DENSE_MIN_ROWS: the same with sum|scale (u - centre)|, centre 8 or 128 (the
        batched kernel centres the values); a row's result does not depend on the rows batched
        with it nor on the thread count. (8-bit activations, as llama.cpp's quantized dot
        products, were 35 % faster but 2.5-8e-3 on random data and, through the real models,
        twice the bf16 path's distance to the fp32 reference.)
  u4 / u8 larger batches, bf16: w, x and y each rounded to bf16 (2^-9 relative).
  int4: measured on real weights and activations (48 tokens of SmolLM2 Q4_1 blk.5, Gemma-3 Q4_K_M
        blk.3-5), worst row max|dy| / max|y| 3.3-6.4e-3, rms 2.5-3.3e-3, the same floor as dense
        bf16 (rms 2.2-2.9e-3): rounding activations and output to bf16 dominates, not the bf16
        rounding of scales and zeros (moving the zero term to fp32 cost 10-20 % of a batch-1 call
        for no gain on real activations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from potluck.kernels import native
from potluck.kernels.dequant import (
    INT4_GROUP,
    INT4_TYPES,
    as_blocks,
    check_supported,
    dequantize,
    int4_groups,
)
from potluck.kernels.levels import NATIVE_TYPES, U4_OFFSET, native_form, native_groups

T = GGMLQuantizationType

# torch's int4 packing works on tiles of 16 output rows.
INT4_N_TILE = 16
_INT4_PACK = torch.ops.aten._convert_weight_to_int4pack_for_cpu.default
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default

# Largest batch for the native matrix-vector kernel (≈ batch x one pass over the weight); above
# it, the batched kernel (the weight tile shared by 8 rows). Changing it changes which decode
# batches the scheduler keeps bit-identical to single rows (engine/scheduler.py).
GEMV_MAX_ROWS = 8
# Smallest batch for the dense path (the weight dequantized to bf16 chunk by chunk, oneDNN's bf16
# matmul, ≈ 200 GFLOP/s on one Zen 4 core plus ≈ 0.1 ns per weight per call to dequantize); below
# it, the batched kernel (100-135 GFLOP/s at any batch). One core, GFLOP/s batched / dense, at
# batch 16, 32 and 64: Q4_1 960 x 576 119/76, 120/106, 119/144; Q5_0 1536 x 640 101/78, 104/104,
# 98/148; Q6_K 640 x 2048 93/50, 94/74, 90/109.
DENSE_MIN_ROWS = 40
# Weights dequantized at once on the dense path: bounds the bf16 scratch of a large head (2 MiB);
# 256 Ki to whole-matrix measured alike at batch 512.
DENSE_CHUNK_WEIGHTS = 1 << 20

# Weights converted and tiled at once while a native layer is built (see _pack_native): 1 Mi
# weights keeps the scratch at a few MiB.
PACK_CHUNK_WEIGHTS = 1 << 20

NATIVE_KINDS = frozenset({"u4", "u8"})


def plan(
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    exact: bool = False,
    use_native: bool = True,
) -> tuple[str, int, int]:
    """(kind, group, offset) QLinear uses for a weight; weights with equal plans can share one
    layer."""
    n_out, n_in = shape
    if qtype == T.F32 or exact:
        return "f32", 0, 0
    if use_native and qtype in NATIVE_TYPES and native.library() is not None:
        form = native_form(qtype)
        if n_in % form.group == 0:
            return ("u4" if form.u4 else "u8"), form.group, form.offset
    if qtype in INT4_TYPES and n_out % INT4_N_TILE == 0 and n_in % INT4_GROUP == 0:
        return "int4", INT4_GROUP, U4_OFFSET
    return "bf16", 0, 0


# (raw GGUF bytes, GGML type, logical shape (n_out, n_in)) of one weight
RawWeight = tuple[torch.Tensor, GGMLQuantizationType, tuple[int, int]]


class QLinear(torch.nn.Module):
    """y = x @ W.T for a GGML-quantized W [n_out, n_in]; float32 in and out.

    kind: "u4" / "u8" (native tiles + scales, mins; `format` says which), "int4" (torch's packed
    int4 + bf16 scales/zeros), "bf16" or "f32" (dense). nbytes: bytes of weight data held.
    """

    def __init__(
        self,
        kind: str,
        n_out: int,
        n_in: int,
        group: int = 0,
        weight: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
        scales_and_zeros: torch.Tensor | None = None,
        mins: torch.Tensor | None = None,
        fmt: native.Format | None = None,
    ) -> None:
        super().__init__()
        self.kind, self.group, self.format = kind, group, fmt
        self.out_features = n_out
        self.in_features = n_in
        self.weight: torch.Tensor | None
        self.packed: torch.Tensor | None
        self.scales_and_zeros: torch.Tensor | None
        self.mins: torch.Tensor | None
        self.register_buffer("weight", weight)  # (n_out, n_in) bf16 or fp32
        # int4: torch's layout; u4/u8: tiles (ceil(n_out / 4), 4 * row bytes) uint8
        self.register_buffer("packed", packed)
        # int4: (n_in / 32, n_out, 2) bf16; u4/u8: (ceil(n_out / 4), n_chunks, 4, gpc) fp16/32
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("mins", mins)  # u4/u8: (n_out, n_in / group) fp16/32, or None
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers())
        self._gemv: native.Gemv | None = None
        self._bind()

    def _bind(self) -> None:
        """(Re)bind the native kernel to the current buffers."""
        if self.kind in NATIVE_KINDS:
            shape = (self.out_features, self.in_features)
            self._gemv = native.Gemv(
                self.packed, self.scales_and_zeros, self.mins, shape, self.format
            )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> QLinear:
        # .to() and friends replace the buffers: the kernel must point at the new ones
        out = super()._apply(fn, recurse)
        self._bind()
        return out

    @classmethod
    def from_raw(
        cls,
        raw: torch.Tensor,
        qtype: GGMLQuantizationType,
        shape: tuple[int, int],
        exact: bool = False,
        use_native: bool = True,
    ) -> QLinear:
        """Build from the raw GGUF bytes of a weight of logical shape (n_out, n_in).

        exact=True keeps the dequantized weight in fp32 (4 bytes per weight, slow): the reference
        precision that tests and `--exact` use to separate model errors from kernel rounding.
        use_native=False: torch's kernels only (what machines without the native ones run).
        """
        return cls.stacked([(raw, qtype, shape)], exact, use_native)

    @classmethod
    def stacked(
        cls, parts: Sequence[RawWeight], exact: bool = False, use_native: bool = True
    ) -> QLinear:
        """One layer whose output is the parts' outputs side by side (e.g. q, k and v: one call
        instead of three). The parts share n_in and must have equal `plan`s."""
        for _, qtype, _ in parts:
            check_supported(qtype)
        plans = {plan(q, s, exact, use_native) for _, q, s in parts}
        n_ins = {s[1] for _, _, s in parts}
        if len(plans) != 1 or len(n_ins) != 1:
            raise ValueError(f"cannot stack weights with plans {plans} and inputs {n_ins}")
        (kind, group, offset), n_in = plans.pop(), n_ins.pop()
        n_out = sum(s[0] for _, _, s in parts)
        if kind == "f32":
            w = torch.cat([dequantize(raw, q, s) for raw, q, s in parts])
            return cls("f32", n_out, n_in, weight=w)
        if kind == "bf16":
            w = torch.cat([dequantize(raw, q, s, torch.bfloat16) for raw, q, s in parts])
            return cls("bf16", n_out, n_in, weight=w)
        if kind == "int4":
            groups = [int4_groups(raw, q, s) for raw, q, s in parts]
            q, scale, zero = (torch.cat([g[i] for g in groups]) for i in range(3))
            packed = _INT4_PACK(q.to(torch.int32), 1)  # innerKTiles = 1
            sz = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()
            return cls("int4", n_out, n_in, INT4_GROUP, packed=packed, scales_and_zeros=sz)
        half = all(native_form(q).half for _, q, _ in parts)
        fmt = native.Format(kind == "u4", group, offset, half)
        qt, st, mins = _pack_native(parts, fmt, n_out, n_in)
        return cls(kind, n_out, n_in, group, packed=qt, scales_and_zeros=st, mins=mins, fmt=fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., n_in) -> (M, n_in) -> (M, n_out) -> (..., n_out); 2-D input skips the reshapes
        # (≈ 2.5 µs of a ≈ 25 µs batch-1 call at SmolLM2 shapes).
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            y = x2.new_empty(0, self.out_features, dtype=torch.float32)
        elif self._gemv is not None:
            m = x2.shape[0]
            if m <= GEMV_MAX_ROWS:
                y = self._gemv(x2.float().contiguous())
            elif m < DENSE_MIN_ROWS:
                y = self._gemv.batched(x2.float().contiguous())
            else:
                y = self._dense_native(x2)
        elif self.kind == "int4":
            y = _INT4_MM(x2.to(torch.bfloat16), self.packed, INT4_GROUP, self.scales_and_zeros)
            y = y.float()
        elif self.kind == "bf16":
            y = F.linear(x2.to(torch.bfloat16), self.weight).float()
        else:
            y = F.linear(x2.to(torch.float32), self.weight)
        return y if x.dim() == 2 else y.view(x.shape[:-1] + (self.out_features,))

    def _dense_native(self, x: torch.Tensor) -> torch.Tensor:
        """Large batches: bf16 weight chunks, dequantized as needed, through oneDNN's matmul."""
        xb = x.to(torch.bfloat16)
        n, k = self.out_features, self.in_features
        step = max(native.TILE_ROWS, DENSE_CHUNK_WEIGHTS // k)
        args = (self.packed, self.scales_and_zeros, self.mins)
        if step >= n:
            w = native.dequant_bf16(*args, (0, n), k, self.format)
            return F.linear(xb, w).float()
        y = torch.empty(x.shape[0], n)
        for start in range(0, n, step):
            stop = min(n, start + step)
            w = native.dequant_bf16(*args, (start, stop), k, self.format)
            y[:, start:stop] = F.linear(xb, w)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kind={self.kind}"


def _pack_native(
    parts: Sequence[RawWeight], fmt: native.Format, n_out: int, n_in: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The parts' rows one after the other as native.pack's (qt, st, mins), converted and tiled
    PACK_CHUNK_WEIGHTS-sized runs of rows at a time into the final tensors: the build's scratch stays
    a few MiB instead of two more copies of the weight (a 262144 x 640 Q8_0 head: 170 MiB held,
    +368 MiB peak when converted whole)."""
    tile = native.TILE_ROWS
    row_bytes = n_in // 2 if fmt.u4 else n_in
    n_tiles = -(-n_out // tile)
    gpc = 4 if fmt.u4 or fmt.group == 16 else 2
    qt = torch.empty(n_tiles, tile * row_bytes, dtype=torch.uint8)
    st = torch.empty(n_tiles, native.n_chunks(n_in, fmt.u4), tile, gpc, dtype=fmt.scale_dtype)
    with_mins = any(q in _HAS_MINS for _, q, _ in parts)
    mins = torch.empty(n_out, n_in // fmt.group, dtype=fmt.scale_dtype) if with_mins else None
    step = max(tile, PACK_CHUNK_WEIGHTS // n_in // tile * tile)  # rows per run, whole tiles
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    done = 0  # rows tiled so far

    def flush(last: bool) -> None:
        nonlocal pending, done
        u = torch.cat([p[0] for p in pending])
        scale = torch.cat([p[1] for p in pending])
        m = None
        if with_mins:  # a part without mins (stacked with one that has them): zeros
            m = torch.cat([p[2] if p[2] is not None else torch.zeros_like(p[1]) for p in pending])
        rows = u.shape[0] if last else u.shape[0] // tile * tile
        q_t, s_t, m_t = native.pack(u[:rows], scale[:rows], None if m is None else m[:rows], fmt)
        t0 = done // tile
        qt[t0 : t0 + q_t.shape[0]] = q_t
        st[t0 : t0 + s_t.shape[0]] = s_t
        if mins is not None and m_t is not None:
            mins[done : done + rows] = m_t
        done += rows
        rest = (u[rows:], scale[rows:], None if m is None else m[rows:])
        pending = [rest] if rows < u.shape[0] else []

    for raw, qtype, (n, k) in parts:
        rows_raw = as_blocks(raw, qtype, (n, k)).view(n, -1)  # [n, bytes per row]
        for a in range(0, n, step):
            b = min(n, a + step)
            pending.append(native_groups(rows_raw[a:b], qtype, (b - a, k)))
            if sum(p[0].shape[0] for p in pending) >= step:
                flush(last=False)
    if pending:
        flush(last=True)
    return qt, st, mins


class QEmbedding(torch.nn.Module):
    """Token embedding over the raw GGML rows; only the looked-up rows are dequantized."""

    def __init__(self, rows: torch.Tensor, qtype: GGMLQuantizationType, dim: int) -> None:
        super().__init__()
        self.qtype = qtype
        self.num_embeddings = rows.shape[0]
        self.embedding_dim = dim
        self.rows: torch.Tensor
        self.register_buffer("rows", rows)  # (n_vocab, bytes_per_row) uint8
        self.nbytes = rows.numel()

    @classmethod
    def from_raw(
        cls, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]
    ) -> QEmbedding:
        """Build from the raw GGUF bytes of an embedding of logical shape (n_vocab, dim)."""
        check_supported(qtype)
        n_vocab, dim = shape
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        rows = as_blocks(raw, qtype, shape).view(n_vocab, dim // block_size * type_size)
        return cls(rows, qtype, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        picked = self.rows.index_select(0, ids.reshape(-1))  # (n_ids, bytes_per_row)
        out = dequantize(picked, self.qtype, (picked.shape[0], self.embedding_dim))
        return out.view(*ids.shape, self.embedding_dim)

    def as_linear(self, exact: bool = False, use_native: bool = True) -> QLinear:
        """The tied output head (logits = h @ E.T) built from the same bytes."""
        shape = (self.num_embeddings, self.embedding_dim)
        return QLinear.from_raw(self.rows, self.qtype, shape, exact, use_native)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"


class QConcat(torch.nn.ModuleList):
    """QLinears over one input with their outputs side by side: the fallback of `stack` for
    weights whose representations differ (e.g. Q4_K attn_q next to a Q6_K attn_v)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self], dim=-1)


def stack(
    parts: Sequence[RawWeight], exact: bool = False, use_native: bool = True
) -> QLinear | QConcat:
    """One QLinear for weights over the same input: SmolLM2's q, k, v as one 960 x 576 call take
    27 µs against 19 + 2 x 9 µs for three (one core). Where plans differ, each run of equal
    plans becomes one layer."""
    runs: list[list[RawWeight]] = []
    for raw, qtype, shape in parts:
        key = plan(qtype, shape, exact, use_native)
        if runs and plan(*runs[-1][0][1:], exact, use_native) == key:
            runs[-1].append((raw, qtype, shape))
        else:
            runs.append([(raw, qtype, shape)])
    layers = [QLinear.stacked(run, exact, use_native) for run in runs]
    return layers[0] if len(layers) == 1 else QConcat(layers)


# Types whose native form has a per-group min (the others are symmetric: min is None).
_HAS_MINS = frozenset({T.Q4_1, T.Q4_K, T.Q5_1, T.Q5_K, T.Q2_K})


def held_bytes(qtype: GGMLQuantizationType, shape: tuple[int, ...], exact: bool = False) -> int:
    """Bytes a weight of logical `shape` (outermost first) occupies once QLinear has built it
    (vectors: fp32). The planner's memory model (planner/footprint.py) takes this function.
    Raises UnsupportedError for a type the kernels cannot read (as loading would)."""
    check_supported(qtype)
    n = 1
    for d in shape:
        n *= d
    if len(shape) == 1:
        return n * 4
    n_out, n_in = shape
    kind, group, _ = plan(qtype, (n_out, n_in), exact)
    if kind == "f32":
        return n * 4
    if kind == "bf16":
        return n * 2
    if kind == "int4":
        return n // 2 + n_in // INT4_GROUP * n_out * 2 * 2
    form = native_form(qtype)
    u4 = kind == "u4"
    sb = 2 if form.half else 4
    n_pad = -(-n_out // native.TILE_ROWS) * native.TILE_ROWS
    qt = n_pad * (n_in // 2 if u4 else n_in)
    gpc = 4 if u4 or group == 16 else 2
    st = n_pad * native.n_chunks(n_in, u4) * gpc * sb
    mins = n // group * sb if qtype in _HAS_MINS else 0
    return qt + st + mins
