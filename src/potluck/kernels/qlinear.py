"""Drop-in quantized linear and embedding layers built once from raw GGUF bytes.

QLinear picks, at construction, the fastest representation torch has on this CPU:
  int4  Q4_0 / Q4_1 / Q4_K with n_out % 16 == 0: torch's packed int4 weight, group 32, bf16
        activations (its fp32-activation path is a scalar loop, ≈ 40x slower).
  bf16  every other type: dequantized once into a dense bf16 [n_out, n_in] weight.
  f32   F32 weights stay fp32.
Activations and results are float32 at the interface; model code never sees the representation.

Accuracy, measured on real weights with real activations (48 tokens captured from the two
packaged models: SmolLM2 Q4_1 blk.5, Gemma-3 Q4_K_M blk.3-5), against float64 x @ W.T with W the
exact dequantized weight; "max" is the worst row's max|dy| / max|y|, "rms" is ||dy|| / ||y||:
  int4 (Q4_1, Q4_K), zero rounded to bf16 in the packed call     max 3.3-6.4e-3   rms 2.5-3.3e-3
  int4, zero = 0 in the call, fp32 term xsum @ zeros added       max 3.6-6.9e-3   rms 2.3-3.3e-3
  int4, bf16 zero in the call + fp32 term for its rounding       max 3.2-6.5e-3   rms 2.4-3.2e-3
  dense bf16 weight, same tensors                                max 4.2-5.9e-3   rms 2.2-2.9e-3
  dense bf16, Q5_0 / Q6_K (Gemma)                                max 4.1-5.2e-3   rms 2.3-2.7e-3
All sit at one floor: rounding the activations and the matmul's output to bf16 (2^-9 relative
each) dominates, not the rounding of `zero`. The fp32 zero term costs 10-20 % of a batch-1 call
(≈ 5 µs of 25-55 µs at SmolLM2 shapes, one core). With all-positive synthetic activations,
moving the whole zero out is worse (rms 1.2e-2 vs 6.3e-3 on Gemma's Q4_K ffn_down: the packed
call then rounds a large partial sum that the zero term cancels) and correcting only its bf16
rounding helps (4.5e-3). Not worth 10-20 % of decode on real activations: we keep the plain
mapping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from potluck.kernels.dequant import (
    INT4_GROUP,
    INT4_TYPES,
    as_blocks,
    check_supported,
    dequantize,
    int4_groups,
)

# torch's int4 packing works on tiles of 16 output rows.
INT4_N_TILE = 16
_INT4_PACK = torch.ops.aten._convert_weight_to_int4pack_for_cpu.default
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


def _int4_fits(qtype: GGMLQuantizationType, n_out: int, n_in: int) -> bool:
    return qtype in INT4_TYPES and n_out % INT4_N_TILE == 0 and n_in % INT4_GROUP == 0


class QLinear(torch.nn.Module):
    """y = x @ W.T for a GGML-quantized W [n_out, n_in]; float32 in and out.

    kind: "int4" (packed int4 + bf16 scales/zeros), "bf16" (dense) or "f32" (dense).
    nbytes: bytes of weight data held.
    """

    def __init__(
        self,
        kind: str,
        n_out: int,
        n_in: int,
        weight: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
        scales_and_zeros: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.kind = kind
        self.out_features = n_out
        self.in_features = n_in
        self.weight: torch.Tensor | None
        self.packed: torch.Tensor | None
        self.scales_and_zeros: torch.Tensor | None
        self.register_buffer("weight", weight)  # (n_out, n_in) bf16 or fp32
        self.register_buffer("packed", packed)  # torch's int4 layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # (n_in / 32, n_out, 2) bf16
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers())

    @classmethod
    def from_raw(
        cls,
        raw: torch.Tensor,
        qtype: GGMLQuantizationType,
        shape: tuple[int, int],
        exact: bool = False,
    ) -> QLinear:
        """Build from the raw GGUF bytes of a weight of logical shape (n_out, n_in).

        exact=True keeps the dequantized weight in fp32 (4 bytes per weight, slow): the reference
        precision that tests and `--exact` use to separate model errors from kernel rounding.
        """
        check_supported(qtype)
        n_out, n_in = shape
        if qtype == GGMLQuantizationType.F32 or exact:
            return cls("f32", n_out, n_in, weight=dequantize(raw, qtype, shape))
        if not _int4_fits(qtype, n_out, n_in):
            return cls("bf16", n_out, n_in, weight=dequantize(raw, qtype, shape, torch.bfloat16))
        q, scale, zero = int4_groups(raw, qtype, shape)  # (n_out, n_in), (n_out, n_in / 32) x2
        packed = _INT4_PACK(q.to(torch.int32), 1)  # innerKTiles = 1
        scales_and_zeros = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()
        return cls("int4", n_out, n_in, packed=packed, scales_and_zeros=scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., n_in) -> (M, n_in) -> (M, n_out) -> (..., n_out); 2-D input skips the reshapes
        # (≈ 2.5 µs of a ≈ 25 µs batch-1 call at SmolLM2 shapes).
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.kind == "int4":
            y = _INT4_MM(x2.to(torch.bfloat16), self.packed, INT4_GROUP, self.scales_and_zeros)
        elif self.kind == "bf16":
            y = F.linear(x2.to(torch.bfloat16), self.weight)
        else:
            y = F.linear(x2.to(torch.float32), self.weight)
        y = y.to(torch.float32)
        return y if x.dim() == 2 else y.view(x.shape[:-1] + (self.out_features,))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kind={self.kind}"


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

    def as_linear(self, exact: bool = False) -> QLinear:
        """The tied output head (logits = h @ E.T) built from the same bytes."""
        shape = (self.num_embeddings, self.embedding_dim)
        return QLinear.from_raw(self.rows, self.qtype, shape, exact)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"
