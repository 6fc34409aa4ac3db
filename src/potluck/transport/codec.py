"""Conversions between protobuf messages and tensors / dataclasses, checking everything received.

Every size and shape from the network is checked before use (no unpickling, no paths).
"""

from __future__ import annotations

import math

import numpy as np

from potluck.errors import PotluckError
from potluck.modelfile.gguf_file import Matrix
from potluck.sampling import SamplingParams
from potluck.transport import potluck_pb2 as pb

PROTOCOL_VERSION = 4
MAX_MESSAGE_BYTES = (
    512 * 2**20
)  # a prompt micro-batch of hidden states or a tensor chunk stays far below
TENSOR_CHUNK_BYTES = 4 * 2**20  # weights travel in pieces of this size
MAX_TENSOR_ELEMENTS = 1 << 28

# wire name -> numpy dtype of the bytes; bfloat16 travels as the upper 16 bits of an fp32
_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"),
}
_ITEMSIZE = {k: v.itemsize for k, v in _DTYPES.items()}  # bytes per element
WIRE_DTYPES = ("float32", "float16", "bfloat16")


class WireError(PotluckError):
    """A message from a peer that is malformed, oversized or of the wrong version."""


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> the bits of bf16 (uint16), rounded to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def tensor_to_proto(t: np.ndarray, wire_dtype: str | None = None) -> pb.Tensor:
    """Raw little-endian bytes + shape + dtype. wire_dtype ("float16", "bfloat16") casts floating
    arrays for the wire; integer arrays travel as int64."""
    t = np.asarray(t)
    if t.dtype.kind == "f":
        name = wire_dtype or "float32"
        raw = to_bf16_bits(t) if name == "bfloat16" else t.astype(_DTYPES[name], copy=False)
    else:
        name, raw = "int64", t.astype(np.int64, copy=False)
    return pb.Tensor(data=np.ascontiguousarray(raw).tobytes(), shape=list(t.shape), dtype=name)


def id_tensor(token: int) -> pb.Tensor:
    """One token id as tensor_to_proto writes it (one little-endian int64), without numpy: a
    follow-up batch's input, filled in on the first node."""
    return pb.Tensor(data=token.to_bytes(8, "little", signed=True), shape=[1], dtype="int64")


def tensor_from_proto(msg: pb.Tensor, max_elements: int = MAX_TENSOR_ELEMENTS) -> np.ndarray:
    """Check dtype, shape and byte count, then build the array (a copy; fp32 for floats)."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"tensor dtype {msg.dtype!r} is not one of {', '.join(_DTYPES)}")
    shape = tuple(msg.shape)
    if len(shape) > 4 or any(d < 0 for d in shape):
        raise WireError(f"tensor shape {shape} is not valid")
    n = math.prod(shape)
    if n > max_elements:
        raise WireError(f"tensor of {n:,} elements exceeds the limit of {max_elements:,}")
    itemsize = _ITEMSIZE[msg.dtype]
    if len(msg.data) != n * itemsize:
        raise WireError(
            f"tensor {shape} {msg.dtype} needs {n * itemsize:,} bytes, got {len(msg.data):,}"
        )
    raw = np.frombuffer(msg.data, dtype=dtype).reshape(shape)
    if msg.dtype == "bfloat16":
        return from_bf16_bits(raw)
    if msg.dtype == "int64":
        return raw.copy()
    return raw.astype(np.float32)  # (a copy: the message's buffer is read-only)


def sampling_to_proto(p: SamplingParams, seed: int) -> pb.SamplingConfig:
    return pb.SamplingConfig(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        repeat_penalty=p.repeat_penalty,
        repeat_last_n=p.repeat_last_n,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        has_seed=True,
        seed=seed,
        has_logprobs=p.logprobs is not None,
        top_logprobs=p.logprobs or 0,
    )


def penalizes(msg: pb.SamplingConfig) -> bool:
    """`sampling_from_proto(msg).penalizes`, read off the message without building (and checking)
    the parameters: for a node's per-token path."""
    return (msg.repeat_penalty or 1.0) != 1.0 or bool(msg.presence_penalty or msg.frequency_penalty)


def sampling_from_proto(msg: pb.SamplingConfig) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=msg.temperature,
            top_k=msg.top_k,
            top_p=msg.top_p or 1.0,
            min_p=msg.min_p,
            repeat_penalty=msg.repeat_penalty or 1.0,
            repeat_last_n=msg.repeat_last_n,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            seed=msg.seed if msg.has_seed else None,
            logprobs=msg.top_logprobs if msg.has_logprobs else None,
        )
    except ValueError as exc:
        raise WireError(f"bad sampling parameters: {exc}") from None


def matrix_to_proto(m: Matrix) -> pb.ProbeMatrix:
    return pb.ProbeMatrix(ggml_type=int(m.qtype), n_out=m.n_out, n_in=m.n_in)


def matrix_from_proto(msg: pb.ProbeMatrix) -> Matrix:
    """A matrix to time, checked: a type ggml multiplies, rows of whole blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from potluck.model.weights import SUPPORTED_TYPES

    try:
        qtype = GGMLQuantizationType(msg.ggml_type)
    except ValueError:
        raise WireError(f"probe matrix of unknown GGML type {msg.ggml_type}") from None
    if qtype not in SUPPORTED_TYPES:
        raise WireError(f"probe matrix of type {qtype.name}, which ggml does not multiply here")
    block = GGML_QUANT_SIZES[qtype][0]
    if msg.n_in % block or not (msg.n_out and msg.n_in):
        raise WireError(f"probe matrix {msg.n_out}x{msg.n_in}: rows must be whole {block}-blocks")
    return Matrix(qtype, msg.n_out, msg.n_in)


def lora_to_wire(lora: int | None) -> int:
    """SeqChunk.lora on the wire: None (every adapter) 0, -1 (none) -1, k as k + 1."""
    return 0 if lora is None else -1 if lora < 0 else lora + 1


def lora_from_wire(value: int) -> int | None:
    return None if value == 0 else -1 if value < 0 else value - 1
