"""What a model costs, per layer, as Potluck's engine holds it: bytes in memory, bytes read per
decoded token, KV cache and activation buffers. Pure: numbers from the tensor index in, numbers out.

The in-memory rule mirrors model/weights.py (tests/test_planner.py loads real stages and compares
their bytes): every tensor is the file's own bytes, mapped in place, whatever its type.
  token_embd on the first stage: its bytes are mapped, but decode reads one row per token
  output head on the last stage: output.weight, or token_embd itself when the head is tied
  KV cache: f16 K and V for n_ctx positions in every layer, for each of n_seq sequences at once
      (serve's -np; model/kv_cache.py grows a sequence's cache by doubling up to n_ctx, so this
      is the most it can take; sliding-window layers keep all n_ctx positions too)

Activation buffers, per stage (they are reused layer after layer, so they do not grow with the
number of layers): one micro-batch of n_batch tokens in one block holds in fp32 the residual and
its norm (2 n_embd), q (n_head * head_dim), k and v (n_head_kv * (head_dim + head_dim_v)), the
attention output (n_head * head_dim_v) and the FFN's gate, up and product (3 n_ff; of a mixture
of experts, its k experts' and shared expert's, and the router's scores) per token, plus
the attention scores n_head x min(n_batch, n_ctx) x n_ctx. An estimate on the safe side: ggml's
allocator reuses these buffers within a graph, and flash attention never holds all the scores. Logits are one row per sequence: left out.

Decode reads every weight of a layer once per token, so a layer's read bytes are its in-memory
bytes — but of a mixture of experts' stacks only the n_expert_used of n_expert experts that the
router picks (a prompt's many tokens read nearly all of them: its cost counts every byte); the
first stage reads one embedding row, the last the whole head. Reading the KV cache
(it grows with the position) is left out: it is small next to the weights for short chats and it
scales every machine alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from potluck.errors import UnsupportedError
from potluck.model.archs.common import is_routed
from potluck.model.weights import SUPPORTED_TYPES
from potluck.modelfile.gguf_file import TensorInfo
from potluck.modelfile.hparams import STATE_COPIES, HParams
from potluck.planner.errors import PlanError

F32_BYTES, FP16_BYTES = 4, 2
KV_BYTES = FP16_BYTES  # the KV cache's element (f16, as llama.cpp's default)

DEFAULT_BATCH = 512  # -b: prompt tokens per micro-batch (llama.cpp's default)
# positions a decode step attends to, on average, where the caller does not know (plan, run,
# serve): a short conversation. Each step reads its cache's K and V for them, as it reads the
# weights: on SmolLM2 (Zen 5, one thread) a token took ≈ 1.35 µs more per position attended,
# what its 768 bytes of KV per position over 30 layers cost at the node's probed speed.
DEFAULT_ATTENDED = 256
# gRPC framing + protobuf fields (shape, dtype, sequence ids, plan id) around one message.
WIRE_HEADER_BYTES = 128
TOKEN_ID_BYTES = 4


def held_bytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a weight of logical `shape` (outermost first) occupies once loaded: its bytes in the
    file (ggml computes on them in place). UnsupportedError for a type ggml cannot compute."""
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedError(f"quantization {qtype.name} is not supported; supported: {names}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


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
    # K + V for n_ctx positions (a hybrid's recurrent layers: their state), per layer, of every
    # sequence at once
    layer_kv_bytes: tuple[int, ...]
    layer_read_bytes: tuple[int, ...]  # read per decoded token, per layer: weights and KV
    embd_bytes: int  # raw token_embd rows, held by the first stage
    embd_read_bytes: int  # one row per decoded token
    head_bytes: int  # output head + output_norm, held by the last stage
    head_read_bytes: int
    buffer_bytes: int  # activations of one micro-batch, once per stage
    wire_bytes: int  # one token's fp16 hidden state between two stages, with its header
    token_wire_bytes: int  # one token id from the last stage back to the first
    tied: bool = False  # the head is token_embd itself: a stage that is first and last maps it once
    n_seq: int = 1  # sequences at once, each up to n_ctx (serve's -np): the KV counts all of them
    # of layer_weight_bytes and layer_read_bytes, the routed experts' (a mixture of experts; ()
    # for a dense model): what may stay in RAM while the rest of a layer is on a GPU (--cpu-moe)
    layer_expert_bytes: tuple[int, ...] = ()
    layer_expert_read_bytes: tuple[int, ...] = ()

    @property
    def ctx_label(self) -> str:
        """The context the KV is counted for, as the user set it: '-c 4096' or '-c 4096 × -np 4'."""
        return f"-c {self.n_ctx}" + (f" × -np {self.n_seq}" if self.n_seq > 1 else "")

    @property
    def ctx_fix(self) -> str:
        """What lowers the KV: '-c', or '-c or -np' when several sequences are counted."""
        return "-c or -np" if self.n_seq > 1 else "-c"

    def __post_init__(self) -> None:
        per_layer = [self.layer_weight_bytes, self.layer_kv_bytes, self.layer_read_bytes]
        experts = (self.layer_expert_bytes, self.layer_expert_read_bytes)
        per_layer += [t for t in experts if t]
        if self.n_layer < 1 or any(len(t) != self.n_layer for t in per_layer):
            raise PlanError(
                f"footprint of {self.n_layer} layers has per-layer tables of "
                f"{[len(t) for t in per_layer]} entries"
            )

    def weights(self, start: int, stop: int) -> int:
        return sum(self.layer_weight_bytes[start:stop])

    def shared_bytes(self, start: int, stop: int) -> int:
        """Bytes counted in both embd_bytes and head_bytes that the stage [start, stop) maps once
        (a tied head on a stage that is first and last)."""
        return self.embd_bytes if self.tied and start == 0 and stop == self.n_layer else 0

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
            - self.shared_bytes(0, self.n_layer)
            + self.buffer_bytes
        )


def activation_bytes(hp: HParams, n_ctx: int, n_batch: int) -> int:
    """The per-stage buffer estimate described in the module docstring."""
    ff = hp.n_ff  # a mixture of experts: the router's scores and the k experts' products
    if hp.is_moe:
        ff = max(ff, hp.n_expert + hp.n_expert_used * hp.n_ff_exp + hp.n_ff_shexp)
    per_token = (
        2 * hp.n_embd
        + hp.n_head * hp.head_dim
        + hp.n_head_kv * (hp.head_dim + hp.head_dim_v)
        + hp.n_head * hp.head_dim_v
        + 3 * ff
    )
    scores = hp.n_head * min(n_batch, n_ctx) * n_ctx
    return F32_BYTES * (n_batch * per_token + scores)


def footprint_from_gguf(
    tensors: Mapping[str, TensorInfo],
    hp: HParams,
    n_ctx: int,
    n_batch: int = DEFAULT_BATCH,
    held: HeldBytes | None = None,
    n_seq: int = 1,
    attended: int | None = None,
) -> ModelFootprint:
    """The footprint of the model whose tensor index is `tensors` (GGUFFile.tensors) at `n_ctx`,
    with KV for `n_seq` sequences at once (each up to n_ctx). A decoded token reads each layer's
    weights and its KV for `attended` positions (default DEFAULT_ATTENDED; at most n_ctx, and
    a sliding-window layer's window).

    held(qtype, shape) gives the bytes a weight occupies once loaded (default: `held_bytes`, the
    file's own bytes)."""
    held = held or held_bytes
    if n_ctx < 1 or n_batch < 1:
        raise PlanError(f"context ({n_ctx}) and batch ({n_batch}) must be at least 1 token")
    if n_seq < 1:
        raise PlanError(f"sequences at once (-np) must be at least 1, got {n_seq}")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise PlanError("the model has no token_embd.weight: cannot size its first stage")

    def held_by(t: TensorInfo) -> int:
        try:
            return held(t.qtype, t.shape)
        except UnsupportedError as exc:  # said at plan time, not after a pool has loaded
            raise UnsupportedError(f"tensor {t.name}: {exc}") from None

    layers = [0] * hp.n_layer  # weight bytes held, per layer
    experts, expert_read = [0] * hp.n_layer, [0] * hp.n_layer  # ... of them the routed experts',
    for t in tensors.values():  # and what a decoded token reads of those: k of n
        if t.layer is not None and t.layer < hp.n_layer:
            n = held_by(t)
            layers[t.layer] += n
            if is_routed(t.name):
                experts[t.layer] += n
                expert_read[t.layer] += n * hp.n_expert_used // hp.n_expert
    # weight bytes one decoded token reads, per layer
    read = [w - x + xr for w, x, xr in zip(layers, experts, expert_read, strict=True)]
    head_matrix = tensors.get("output.weight", embd)  # tied: the head reads token_embd
    head = held_by(head_matrix)
    if norm := tensors.get("output_norm.weight"):
        head += held_by(norm)
    kv_row = hp.kv_bytes_per_token(1, KV_BYTES)  # one position of one layer
    kv = kv_row * n_ctx * n_seq
    state = sum(hp.state_elements()) * 4  # a recurrent layer's state of one sequence (f32)
    seen = min(n_ctx, DEFAULT_ATTENDED if attended is None else max(attended, 1))
    # a recurrent layer holds a fixed state per sequence (and a checkpoint of it) instead of K
    # and V, and a decoded token reads the state and writes it back
    reads = [
        w + 2 * state
        if hp.is_recurrent(i)
        else w + kv_row * (min(seen, hp.sliding_window) if hp.is_sliding(i) else seen)
        for i, w in enumerate(read)
    ]
    states = STATE_COPIES * state * n_seq
    layer_kv = [states if hp.is_recurrent(i) else kv for i in range(hp.n_layer)]
    return ModelFootprint(
        n_layer=hp.n_layer,
        n_embd=hp.n_embd,
        n_vocab=hp.n_vocab,
        n_ctx=n_ctx,
        n_batch=n_batch,
        layer_weight_bytes=tuple(layers),
        layer_kv_bytes=tuple(layer_kv),
        layer_read_bytes=tuple(reads),
        embd_bytes=embd.nbytes,
        embd_read_bytes=embd.nbytes // embd.shape[0],
        head_bytes=head,
        head_read_bytes=head,
        buffer_bytes=activation_bytes(hp, n_ctx, n_batch),
        wire_bytes=hp.n_embd * FP16_BYTES + WIRE_HEADER_BYTES,
        token_wire_bytes=TOKEN_ID_BYTES + WIRE_HEADER_BYTES,
        tied="output.weight" not in tensors,
        n_seq=n_seq,
        layer_expert_bytes=tuple(experts) if hp.is_moe else (),
        layer_expert_read_bytes=tuple(expert_read) if hp.is_moe else (),
    )
