"""The one codec between Potluck and the wire: every protobuf message Potluck builds, and every
conversion between protobuf and tensors / dataclasses, checking everything received.

The first half converts the values inside messages (tensors, sampling, probe matrices, adapters);
every size and shape from the network is checked before use (no unpickling, no paths). The second
half builds the messages themselves from plain values: the requests a head sends its nodes, and the
answers a node gives (its servicer's, its forward replies, its training replies). Outside
transport/ no module constructs a wire message (tests/test_layering.py): the pool, the trainer,
discovery and the node call these (or NodeClient's typed methods, which call them) and read what
comes back.

Over 400 lines on purpose: one file is the whole of what crosses the wire, so that a change of the
protocol (PROTOCOL_VERSION) is read and reviewed in one place.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from potluck.errors import PotluckError
from potluck.modelfile.gguf_file import Matrix
from potluck.sampling import Accepted, Sampler, SamplingParams, Token
from potluck.transport import potluck_pb2 as pb

if TYPE_CHECKING:
    from potluck.model.stage import SeqChunk

PROTOCOL_VERSION = 7  # 5: SeqChunk.rewind / fork (cached prefixes); 6: SeqChunk.mark;
# 7: SamplingConfig.grammar (constrained decoding), SeqChunk.constrained, ForwardRequest.want_hidden
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
        grammar=p.grammar or "",
        grammar_from=p.grammar_from,
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
            grammar=msg.grammar or None,
            grammar_from=msg.grammar_from,
        )
    except ValueError as exc:
        raise WireError(f"bad sampling parameters: {exc}") from None


def matrix_to_proto(m: Matrix) -> pb.ProbeMatrix:
    return pb.ProbeMatrix(ggml_type=int(m.qtype), n_out=m.n_out, n_in=m.n_in, n_experts=m.n_experts)


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
    return Matrix(qtype, msg.n_out, msg.n_in, msg.n_experts)


def lora_to_wire(lora: int | None) -> int:
    """SeqChunk.lora on the wire: None (every adapter) 0, -1 (none) -1, k as k + 1."""
    return 0 if lora is None else -1 if lora < 0 else lora + 1


def lora_from_wire(value: int) -> int | None:
    return None if value == 0 else -1 if value < 0 else value - 1


# -- what a node is, and its links ----------------------------------------------------------------
def hello_request(head_name: str = "", plan_ids: Sequence[str] = ()) -> pb.HelloRequest:
    """head_name: who asks (the node's log); plan_ids: plans this head still uses."""
    return pb.HelloRequest(
        protocol_version=PROTOCOL_VERSION, head_name=head_name, plan_ids=list(plan_ids)
    )


def describe_request() -> pb.DescribeRequest:
    return pb.DescribeRequest()


def echo_request(payload_bytes: int = 0, reply_bytes: int = 0) -> pb.EchoRequest:
    """payload_bytes zero bytes to the node (head -> node), reply_bytes asked back (node -> head)."""
    return pb.EchoRequest(payload=bytes(payload_bytes), reply_bytes=reply_bytes)


def stress_request(seconds: float, interval: float) -> pb.StressRequest:
    return pb.StressRequest(seconds=seconds, interval=interval)


def probe_speed_request(matrices: Iterable[Matrix]) -> pb.ProbeSpeedRequest:
    return pb.ProbeSpeedRequest(matrices=[matrix_to_proto(m) for m in matrices])


def probe_link_request(address: str) -> pb.ProbeLinkRequest:
    return pb.ProbeLinkRequest(address=address)


# -- a node's answers about itself and its links (node/service.py) ---------------------------------
@dataclass(frozen=True)
class DeviceOffer:
    """One device a node offers in its Hello: kind "cpu" or "gpu", ggml's name, the memory it
    offers (bytes), its measured decode speed (weight bytes/s), and for a GPU the most layers."""

    kind: str
    name: str
    memory_bytes: int
    bytes_per_s: float
    max_layers: int = 0


def hello_reply(
    node_name: str, version: str, devices: Sequence[DeviceOffer], physical_cores: int,
    decode_bytes_per_s: float, data_port: int, models: Sequence[str] = (),
) -> pb.HelloReply:  # fmt: skip
    """models: sha256 of the model files the node has (the pool's weight sources)."""
    return pb.HelloReply(
        protocol_version=PROTOCOL_VERSION,
        node_name=node_name,
        potluck_version=version,
        devices=[
            pb.Device(
                kind=d.kind,
                name=d.name,
                memory_bytes=d.memory_bytes,
                bytes_per_s=d.bytes_per_s,
                max_layers=d.max_layers,
            )  # fmt: skip
            for d in devices
        ],
        physical_cores=physical_cores,
        decode_bytes_per_s=decode_bytes_per_s,
        model_sha256=list(models),
        data_port=data_port,
    )


def put_reply(received: int) -> pb.PutReply:
    """received: tensors stored (PutTensors)."""
    return pb.PutReply(received=received)


def drop_reply() -> pb.DropReply:
    return pb.DropReply()


def echo_reply(reply_bytes: int) -> pb.EchoReply:
    return pb.EchoReply(payload=bytes(reply_bytes))


def probe_link_reply(latency_s: float, bytes_per_s: float) -> pb.ProbeLinkReply:
    return pb.ProbeLinkReply(latency_s=latency_s, bytes_per_s=bytes_per_s)


def probe_speed_reply(bytes_per_s: float) -> pb.ProbeSpeedReply:
    return pb.ProbeSpeedReply(bytes_per_s=bytes_per_s)


def describe_reply(
    threads: int, physical_cores: int, logical_cores: int, os: str, memory_bytes: int
) -> pb.DescribeReply:
    return pb.DescribeReply(
        threads=threads, physical_cores=physical_cores, logical_cores=logical_cores, os=os,
        memory_bytes=memory_bytes,
    )  # fmt: skip


def stress_sample(t: float, bytes_per_s: float) -> pb.StressSample:
    """One interval of a load probe: seconds since its start, weight bytes/s in it."""
    return pb.StressSample(t=t, bytes_per_s=bytes_per_s)


# -- a plan: load, forward, drop --------------------------------------------------------------------
def load_request(
    *,
    plan_id: str,
    model_sha256: str,
    start: int,
    stop: int,
    n_ctx: int,
    next_hop: str,
    metadata_gguf: bytes,
    tensor_sha256: Mapping[str, str],
    wire_dtype: str,
    model_bytes: int,
    head_id: str,
    n_gpu_layers: int,
    tensor_sources: Sequence[str],
    n_seq: int,
    adapters: Sequence[tuple[str, float, bytes]] = (),
    ram_experts: int = 0,
) -> pb.LoadRequest:
    """Layers [start, stop) of the model (by hash; its GGUF header and each tensor's digest) for
    a plan; adapters: (name, scale, the bytes of an adapter GGUF cut to this stage's tensors)."""
    return pb.LoadRequest(
        plan_id=plan_id, model_sha256=model_sha256, start=start, stop=stop, n_ctx=n_ctx,
        next_hop=next_hop, metadata_gguf=metadata_gguf, tensor_sha256=tensor_sha256,
        wire_dtype=wire_dtype, model_bytes=model_bytes, head_id=head_id,
        n_gpu_layers=n_gpu_layers, tensor_sources=list(tensor_sources), n_seq=n_seq,
        adapters=[pb.AdapterPart(gguf=gguf, scale=scale, name=name) for name, scale, gguf in adapters],
        ram_experts=ram_experts,
    )  # fmt: skip


def seq_chunks(
    chunks: Sequence[SeqChunk],
    samplers: Mapping[int, Sampler],
    histories: Mapping[int, Sequence[int]],
    follow: bool = False,
    opened: Collection[int] = (),
) -> list[pb.SeqChunk]:
    """A batch's chunks on the wire, each with the recent ids its penalties need and its
    sampling settings (none for a chunk without a sampler: a prompt micro-batch that is not the
    last). opened: sequences whose last stage has their sampler already: no settings (a
    follow-up chunk always carries them: the first node reads its penalties). follow: follow-up
    chunks, whose input id (not in `histories` yet) the first node adds to the recent ids
    itself. The sender sets each chunk's `pos`."""
    wire = []
    for c in chunks:
        s = samplers.get(c.seq_id)
        if s is None:
            wire.append(
                pb.SeqChunk(
                    seq_id=c.seq_id,
                    n=c.n,
                    sample=False,
                    follow=follow,
                    lora=lora_to_wire(c.lora),
                    mark=c.mark,
                )
            )
            continue
        recent: list[int] = []
        if s.params.penalizes:
            n = s.params.repeat_last_n
            hist = histories.get(c.seq_id, ())
            keep = n - 1 if follow else n
            recent = list(hist[-keep:]) if keep > 0 else [] if n > 0 else list(hist)
        settings = (
            None if c.seq_id in opened and not follow else sampling_to_proto(s.params, s.seed)
        )
        # a grammar's matcher on a last stage that has not seen this request's tokens (the first
        # chunk of a plan: after a failover) catches up on the ids generated so far
        constrained: Sequence[int] = ()
        if settings is not None and s.params.grammar is not None and not follow:
            constrained = histories.get(c.seq_id, ())[s.params.grammar_from :]
        wire.append(
            pb.SeqChunk(
                seq_id=c.seq_id,
                n=c.n,
                sampling=settings,
                recent=recent,
                sample=True,
                follow=follow,
                lora=lora_to_wire(c.lora),
                draft=c.draft,
                mark=c.mark,
                constrained=constrained,
            )
        )
    return wire


def forward_request(
    plan_id: str,
    chunks: Sequence[pb.SeqChunk],
    x: np.ndarray,
    wire_dtype: str | None,
    want_logits: bool,
    stop_ids: Sequence[int] = (),
    want_hidden: bool = False,
) -> pb.ForwardRequest:
    """One batch for the next node (from the head, or a stage's output relayed down the chain):
    token ids [T] or hidden states [T, d] (floats cast to wire_dtype), one chunk per sequence.
    The per-step path: nothing here but the message."""
    return pb.ForwardRequest(
        plan_id=plan_id,
        chunks=chunks,
        input=tensor_to_proto(x, wire_dtype),
        want_logits=want_logits,
        stop_ids=stop_ids,
        want_hidden=want_hidden,
    )


def drop_request(
    plan_id: str, seq_ids: Sequence[int] = (), release: bool = False
) -> pb.DropRequest:
    """Free these sequences' caches, or (release) the whole plan, down the chain."""
    return pb.DropRequest(plan_id=plan_id, seq_ids=list(seq_ids), release=release)


# -- training (node/training.py) --------------------------------------------------------------------
def train_open_request(
    *,
    session_id: str,
    model_sha256: str,
    model_bytes: int,
    rank: int,
    alpha: float,
    targets: Sequence[str],
    lr: float,
    seed: int,
    step: int,
    state: bytes,
    recompute: bool,
    need_bytes: int,
) -> pb.TrainOpenRequest:
    """A training session at `step` with the adapters' and optimizer's `state`."""
    return pb.TrainOpenRequest(
        session_id=session_id, model_sha256=model_sha256, model_bytes=model_bytes, rank=rank,
        alpha=alpha, targets=list(targets), lr=lr, seed=seed, step=step, state=state,
        recompute=recompute, need_bytes=need_bytes,
    )  # fmt: skip


def add_model_file(
    request: pb.TrainOpenRequest, metadata_gguf: bytes, tensor_sha256: Mapping[str, str]
) -> None:
    """For a node without the model file (TrainOpenReply.need_model): its header and digests."""
    request.metadata_gguf = metadata_gguf
    request.tensor_sha256.update(tensor_sha256)


def train_grad_request(
    session_id: str,
    step: int,
    n_learned: int,
    sequences: Iterable[tuple[Sequence[int], Sequence[bool]]],
) -> pb.TrainGradRequest:
    """A share of a batch: (ids, learned per position) per sequence; n_learned: the whole
    batch's learned tokens (the loss's denominator)."""
    return pb.TrainGradRequest(
        session_id=session_id, step=step, n_learned=n_learned,
        sequences=[pb.TrainSequence(ids=list(ids), learn=list(learn)) for ids, learn in sequences],
    )  # fmt: skip


def train_apply_request(session_id: str, step: int, grads: bytes) -> pb.TrainApplyRequest:
    return pb.TrainApplyRequest(session_id=session_id, step=step, grads=grads)


def train_close_request(session_id: str) -> pb.TrainCloseRequest:
    return pb.TrainCloseRequest(session_id=session_id)


# -- a node's answers to a forward request (node/compute.py, node/followup.py) ---------------------
def error_reply(request_id: int, error: str, code: str) -> pb.ForwardReply:
    """A forward request that failed: why, and the grpc.StatusCode name the head raises it as."""
    return pb.ForwardReply(request_id=request_id, error=error, error_code=code)


def skipped_reply(request_id: int) -> pb.ForwardReply:
    """A follow-up batch not computed: its input id was one of its stop ids."""
    return pb.ForwardReply(request_id=request_id, tokens=[-1], skipped=True)


def logits_reply(logits: np.ndarray, stage_ms: float) -> pb.ForwardReply:
    """The last stage's logits of every row [T, V] (perplexity)."""
    return pb.ForwardReply(logits=tensor_to_proto(logits), stage_ms=[stage_ms])


def tokens_reply(tokens: Sequence[int], stage_ms: float) -> pb.ForwardReply:
    """One sampled id per chunk (-1: none sampled); with each one's logprobs and alternatives
    when any of them is a `Token` (its sampling asked for logprobs); a drafted chunk's tokens
    (an `Accepted`) in `runs`."""
    reply = pb.ForwardReply(tokens=tokens, stage_ms=[stage_ms])
    if any(isinstance(t, Accepted) for t in tokens):
        for t in tokens:
            reply.runs.add(tokens=list(t.tokens) if isinstance(t, Accepted) else [])
    if any(isinstance(t, Token) for t in tokens):  # logprobs asked: one entry per chunk
        for t in tokens:
            lp = t.logprob if isinstance(t, Token) else 0.0
            top = t.top if isinstance(t, Token) else ()
            reply.logprobs.append(lp)
            reply.top.add(ids=[i for i, _ in top], logprobs=[v for _, v in top])
    return reply


# -- weights (node/loading.py, node/transfer.py) ---------------------------------------------------
def need_tensors_reply(missing: Sequence[str], partial: Mapping[str, int]) -> pb.LoadReply:
    """Load's answer when the node lacks tensors: their names, and what it kept of each."""
    return pb.LoadReply(need_tensors=True, missing=missing, partial=partial)


def loaded_reply(
    *,
    weight_bytes: int,
    load_seconds: float,
    kv_bytes: int,
    rss_bytes: int,
    pulled_from: str = "",
    pulled_bytes: int = 0,
    pull_seconds: float = 0.0,
) -> pb.LoadReply:
    """Load's answer once the stage is loaded: what the node holds (the head's `Held`)."""
    return pb.LoadReply(
        weight_bytes=weight_bytes, load_seconds=load_seconds, kv_bytes=kv_bytes,
        rss_bytes=rss_bytes, pulled_from=pulled_from, pulled_bytes=pulled_bytes,
        pull_seconds=pull_seconds,
    )  # fmt: skip


def tensor_chunk(
    name: str, data: bytes, sha256: str = "", total_bytes: int = 0, offset: int = 0
) -> pb.TensorChunk:
    """A piece of a tensor's bytes; a tensor's first chunk carries its size and the offset it
    starts at (and, from a head, its sha256), the rest only data."""
    return pb.TensorChunk(
        name=name, sha256=sha256, total_bytes=total_bytes, data=data, offset=offset
    )


def get_tensors_request(
    model_sha256: str, model_bytes: int, ranges: Mapping[str, int]
) -> pb.GetTensorsRequest:
    """Ask a peer for tensors of a model file (by hash), each from the byte `ranges` names."""
    return pb.GetTensorsRequest(
        model_sha256=model_sha256, model_bytes=model_bytes,
        tensors=[pb.TensorRange(name=n, offset=off) for n, off in ranges.items()],
    )  # fmt: skip


# -- a node's answers to the training calls (node/training.py) ------------------------------------
def train_opened_reply(n_params: int) -> pb.TrainOpenReply:
    return pb.TrainOpenReply(n_params=n_params)


def train_need_model_reply() -> pb.TrainOpenReply:
    """No model file here: the head opens again with its header and digests."""
    return pb.TrainOpenReply(need_model=True)


def train_need_tensors_reply(
    missing: Sequence[str], partial: Mapping[str, int]
) -> pb.TrainOpenReply:
    return pb.TrainOpenReply(need_tensors=True, missing=missing, partial=partial)


def train_grad_reply(loss_sum: float, grads: bytes, compute_ms: float) -> pb.TrainGradReply:
    return pb.TrainGradReply(loss_sum=loss_sum, grads=grads, compute_ms=compute_ms)


def train_apply_reply() -> pb.TrainApplyReply:
    return pb.TrainApplyReply()


def train_close_reply() -> pb.TrainCloseReply:
    return pb.TrainCloseReply()
