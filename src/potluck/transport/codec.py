"""Conversions between protobuf messages and tensors / dataclasses, checking everything received.

Every size and shape from the network is checked before use (no unpickling, no paths).
"""

from __future__ import annotations

import math

import torch

from potluck.engine.sampling import SamplingParams
from potluck.errors import PotluckError
from potluck.transport import potluck_pb2 as pb

PROTOCOL_VERSION = 3
MAX_MESSAGE_BYTES = (
    512 * 2**20
)  # a prompt micro-batch of hidden states or a tensor chunk stays far below
TENSOR_CHUNK_BYTES = 4 * 2**20  # weights travel in pieces of this size
MAX_TENSOR_ELEMENTS = 1 << 28

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE = {k: v.itemsize for k, v in _DTYPES.items()}  # bytes per element


class WireError(PotluckError):
    """A message from a peer that is malformed, oversized or of the wrong version."""


def tensor_to_proto(t: torch.Tensor, wire_dtype: torch.dtype | None = None) -> pb.Tensor:
    """Raw little-endian bytes + shape + dtype. wire_dtype casts floating tensors (e.g. to fp16)."""
    if wire_dtype is not None and t.is_floating_point() and t.dtype != wire_dtype:
        t = t.to(wire_dtype)
    t = t.contiguous()
    # (few ops: on a node this runs right after a stage streamed its weights through the
    # caches, where each torch op costs 10-30 µs instead of 1-3)
    raw = t.numpy() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy()
    return pb.Tensor(data=raw.tobytes(), shape=list(t.shape), dtype=_NAMES[t.dtype])


def tensor_from_proto(msg: pb.Tensor, max_elements: int = MAX_TENSOR_ELEMENTS) -> torch.Tensor:
    """Check dtype, shape and byte count, then build the tensor (a copy; fp32 for floats)."""
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
    if n == 0:  # (a zero-length buffer cannot be viewed as a wider dtype)
        return torch.empty(shape, dtype=torch.float32 if dtype.is_floating_point else dtype)
    t = torch.frombuffer(bytearray(msg.data), dtype=dtype).view(shape)  # one copy, writable
    return t.float() if t.is_floating_point() and t.dtype != torch.float32 else t


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
