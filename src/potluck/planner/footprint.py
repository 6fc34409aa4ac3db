"""What a model costs, per layer, as Potluck's kernels hold it: bytes in memory, bytes read per
decoded token, KV cache and activation buffers. Pure: numbers from the tensor index in, numbers out.

The in-memory rule mirrors kernels/qlinear.py and model/stage.py (tests/test_planner.py loads real
stages and compares their bytes):
  Q4_0 / Q4_1 / Q4_K matrix with n_out % 16 == 0 and n_in % 32 == 0: torch's packed int4,
      n_out * n_in / 2 bytes, plus a bf16 scale and zero per group of 32: n_in / 32 * n_out * 2 * 2
  F32 matrix: 4 bytes per weight; any other matrix type: dense bf16, 2 bytes per weight
  1-D tensors (norms, biases): fp32, whatever the file stores
  token_embd on the first stage: the raw GGUF rows (QEmbedding dequantizes only the rows it looks up)
  output head on the last stage: output.weight by the matrix rule; with tied embeddings (no
      output.weight) a second copy of token_embd by the matrix rule
  KV cache: fp32 K and V for n_ctx positions in every layer (model/kv_cache.py keeps all n_ctx
      positions in sliding-window layers too)

Activation buffers, per stage (they are reused layer after layer, so they do not grow with the
number of layers): one micro-batch of n_batch tokens in one block holds in fp32 the residual and
its norm (2 n_embd), q (n_head * head_dim), k and v (n_head_kv * (head_dim + head_dim_v)), the
attention output (n_head * head_dim_v) and the FFN's gate, up and product (3 n_ff) per token, plus
the attention scores n_head x min(n_batch, n_ctx) x n_ctx. An estimate on the safe side: torch
frees most of these before the next one is made. Logits are one row per sequence: left out.

Decode reads every weight of a layer once per token, so a layer's read bytes are its in-memory
bytes; the first stage reads one embedding row, the last the whole head. Reading the KV cache
(it grows with the position) is left out: it is small next to the weights for short chats and it
scales every machine alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gguf import QK_K, GGMLQuantizationType

from potluck.errors import UnsupportedError
from potluck.modelfile.gguf_file import TensorInfo
from potluck.modelfile.hparams import HParams
from potluck.planner.errors import PlanError

# The int4 path of kernels/qlinear.py (a test checks these against kernels/ and qlinear.py).
INT4_TYPES = frozenset(
    {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K}
)
INT4_GROUP = QK_K // 8  # values per scale/zero pair: a Q4_0/Q4_1 block, a Q4_K sub-block
INT4_N_TILE = 16  # torch packs int4 weights in tiles of 16 output rows
BF16_BYTES, F32_BYTES, FP16_BYTES = 2, 4, 2

DEFAULT_BATCH = 512  # -b: prompt tokens per micro-batch (llama.cpp's default)
# gRPC framing + protobuf fields (shape, dtype, sequence ids, plan id) around one message.
WIRE_HEADER_BYTES = 128
TOKEN_ID_BYTES = 4


def _int4_fits(qtype: GGMLQuantizationType, n_out: int, n_in: int) -> bool:
    return qtype in INT4_TYPES and n_out % INT4_N_TILE == 0 and n_in % INT4_GROUP == 0


def held_bytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a weight of logical `shape` (outermost first) occupies once loaded by the kernels."""
    n = 1
    for d in shape:
        n *= d
    if len(shape) == 1 or qtype == GGMLQuantizationType.F32:
        return n * F32_BYTES
    if len(shape) == 2 and _int4_fits(qtype, shape[0], shape[1]):
        n_out, n_in = shape
        packed = n_out * n_in // 2  # two 4-bit values per byte
        scales_and_zeros = n_in // INT4_GROUP * n_out * 2 * BF16_BYTES
        return packed + scales_and_zeros
    return n * BF16_BYTES


HeldBytes = Callable[[GGMLQuantizationType, tuple[int, ...]], int]


@dataclass(frozen=True)
class ModelFootprint:
    """Per-layer memory and read bytes of one model at one context; layers are global indices."""

    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx: int
    n_batch: int
    layer_weight_bytes: tuple[int, ...]  # in memory, per layer
    layer_kv_bytes: tuple[int, ...]  # fp32 K + V for n_ctx positions, per layer
    layer_read_bytes: tuple[int, ...]  # read per decoded token, per layer
    embd_bytes: int  # raw token_embd rows, held by the first stage
    embd_read_bytes: int  # one row per decoded token
    head_bytes: int  # output head + output_norm, held by the last stage
    head_read_bytes: int
    buffer_bytes: int  # activations of one micro-batch, once per stage
    wire_bytes: int  # one token's fp16 hidden state between two stages, with its header
    token_wire_bytes: int  # one token id from the last stage back to the first

    def __post_init__(self) -> None:
        per_layer = (self.layer_weight_bytes, self.layer_kv_bytes, self.layer_read_bytes)
        if self.n_layer < 1 or any(len(t) != self.n_layer for t in per_layer):
            raise PlanError(
                f"footprint of {self.n_layer} layers has per-layer tables of "
                f"{[len(t) for t in per_layer]} entries"
            )

    def weights(self, start: int, stop: int) -> int:
        return sum(self.layer_weight_bytes[start:stop])

    def kv(self, start: int, stop: int) -> int:
        return sum(self.layer_kv_bytes[start:stop])

    @property
    def total_bytes(self) -> int:
        """What one machine running every layer holds."""
        return (
            self.embd_bytes
            + self.weights(0, self.n_layer)
            + self.kv(0, self.n_layer)
            + self.head_bytes
            + self.buffer_bytes
        )


def activation_bytes(hp: HParams, n_ctx: int, n_batch: int) -> int:
    """The per-stage buffer estimate described in the module docstring."""
    per_token = (
        2 * hp.n_embd
        + hp.n_head * hp.head_dim
        + hp.n_head_kv * (hp.head_dim + hp.head_dim_v)
        + hp.n_head * hp.head_dim_v
        + 3 * hp.n_ff
    )
    scores = hp.n_head * min(n_batch, n_ctx) * n_ctx
    return F32_BYTES * (n_batch * per_token + scores)


def footprint_from_gguf(
    tensors: Mapping[str, TensorInfo],
    hp: HParams,
    n_ctx: int,
    n_batch: int = DEFAULT_BATCH,
    held: HeldBytes | None = None,
) -> ModelFootprint:
    """The footprint of the model whose tensor index is `tensors` (GGUFFile.tensors) at `n_ctx`.

    held(qtype, shape) gives the bytes a weight occupies once loaded; pass the kernels' own
    (`potluck.kernels.qlinear.held_bytes`, which knows the formats this CPU gets) — the default is
    the portable torch-kernel rule above (int4 for Q4 types, bf16 otherwise)."""
    held = held or held_bytes
    if n_ctx < 1 or n_batch < 1:
        raise PlanError(f"context ({n_ctx}) and batch ({n_batch}) must be at least 1 token")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise PlanError("the model has no token_embd.weight: cannot size its first stage")

    def held_by(t: TensorInfo) -> int:
        try:
            return held(t.qtype, t.shape)
        except UnsupportedError as exc:  # said at plan time, not after a pool has loaded
            raise UnsupportedError(f"tensor {t.name}: {exc}") from None

    layers = [0] * hp.n_layer
    for t in tensors.values():
        if t.layer is not None and t.layer < hp.n_layer:
            layers[t.layer] += held_by(t)
    head_matrix = tensors.get("output.weight", embd)  # tied: the head copies token_embd
    head = held_by(head_matrix)
    if norm := tensors.get("output_norm.weight"):
        head += held_by(norm)
    kv = hp.kv_bytes_per_token(1, F32_BYTES) * n_ctx
    return ModelFootprint(
        n_layer=hp.n_layer,
        n_embd=hp.n_embd,
        n_vocab=hp.n_vocab,
        n_ctx=n_ctx,
        n_batch=n_batch,
        layer_weight_bytes=tuple(layers),
        layer_kv_bytes=(kv,) * hp.n_layer,
        layer_read_bytes=tuple(layers),
        embd_bytes=embd.nbytes,
        embd_read_bytes=embd.nbytes // embd.shape[0],
        head_bytes=head,
        head_read_bytes=head,
        buffer_bytes=activation_bytes(hp, n_ctx, n_batch),
        wire_bytes=hp.n_embd * FP16_BYTES + WIRE_HEADER_BYTES,
        token_wire_bytes=TOKEN_ID_BYTES + WIRE_HEADER_BYTES,
    )
