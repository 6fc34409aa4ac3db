"""Bounds on what a node accepts from the network, checked before any handler runs.

Sizes: gRPC refuses a message above the receive limit before reading it. A node receives at most
MAX_REQUEST_BYTES per message: the largest legitimate one is a prompt micro-batch of fp32 hidden
states (2048 tokens × 16384 dims × 4 B = 128 MiB covers a 405B-class model at -b 2048, a 70B one at
-b 4096); tensors travel in 4 MiB chunks and a model header is a few MiB. Replies may be larger
(logits of every row for perplexity: rows × vocabulary × 4 B), so a client accepts up to
MAX_REPLY_BYTES, from nodes it has authenticated.

Counts: `check_message` bounds every repeated field and string of each request type, so that no
message can make a node loop or allocate far beyond its size; shapes, dtypes and values that
depend on the loaded model are checked by the worker (node/compute.py, node/loading.py) and the codec.
"""

from __future__ import annotations

import re

from potluck.transport import potluck_pb2 as pb
from potluck.transport.codec import MAX_MESSAGE_BYTES, TENSOR_CHUNK_BYTES, WireError

MAX_REQUEST_BYTES = 128 * 2**20
MAX_REPLY_BYTES = MAX_MESSAGE_BYTES
MAX_HEADER_BYTES = 64 * 2**20  # a GGUF header: metadata (vocabulary, merges) + tensor index
MAX_CHUNKS = 4096  # sequences in one forward batch
MAX_RECENT = 1 << 18  # recent token ids for the penalties of one sequence (≥ any context length)
MAX_TOKEN_ID = 1 << 31
MAX_TENSORS = 1 << 16  # tensors in one stage / one PutTensors stream
MAX_SEQ_IDS = 1 << 16  # sequences dropped in one call
MAX_STOP_IDS = 1 << 12  # stop ids of one follow-up batch
MAX_ID_CHARS = 64  # plan ids
MAX_NAME_CHARS = 256  # tensor and node names
MAX_SOURCES = 64  # peers a node may ask for tensors
MAX_THREADS = 4096
MAX_TENSOR_BYTES = 1 << 40
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]{1,253}):[0-9]{1,5}")

# gRPC options: a node's server, and a client (a head, or a node calling the next one).
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_send_message_length", MAX_REPLY_BYTES),
]
CLIENT_SIZE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
]


def _at_most(what: str, n: int, limit: int) -> None:
    if n > limit:
        raise WireError(f"{what}: {n:,} exceeds the limit of {limit:,}")


def _sha(what: str, digest: str, optional: bool = False) -> None:
    if not (optional and digest == "") and not _HEX64.fullmatch(digest):
        raise WireError(f"{what} {digest[:80]!r} is not a sha256 hex digest")


def _check_forward(m: pb.ForwardRequest) -> None:
    _at_most("plan id characters", len(m.plan_id), MAX_ID_CHARS)
    _at_most("chunks in one batch", len(m.chunks), MAX_CHUNKS)
    _at_most("stop ids", len(m.stop_ids), MAX_STOP_IDS)
    for c in m.chunks:
        _at_most(f"recent token ids of sequence {c.seq_id}", len(c.recent), MAX_RECENT)
        if c.recent and not (0 <= min(c.recent) and max(c.recent) < MAX_TOKEN_ID):
            raise WireError(f"recent token ids of sequence {c.seq_id} must be in [0, 2^31)")
    _at_most("tensor dimensions", len(m.input.shape), 4)


def _check_load(m: pb.LoadRequest) -> None:
    _at_most("plan id characters", len(m.plan_id), MAX_ID_CHARS)
    _sha("model sha256", m.model_sha256, optional=True)
    if m.next_hop and not _HOST_PORT.fullmatch(m.next_hop):
        raise WireError(f"next hop {m.next_hop[:80]!r} is not host:port")
    _at_most("model header bytes", len(m.metadata_gguf), MAX_HEADER_BYTES)
    _at_most("threads", m.threads, MAX_THREADS)
    _at_most("tensors of one stage", len(m.tensor_sha256), MAX_TENSORS)
    for name, digest in m.tensor_sha256.items():
        _at_most("tensor name characters", len(name), MAX_NAME_CHARS)
        _sha(f"sha256 of tensor {name[:80]!r}", digest)
    _at_most("tensor sources", len(m.tensor_sources), MAX_SOURCES)
    for source in m.tensor_sources:
        if not _HOST_PORT.fullmatch(source):
            raise WireError(f"tensor source {source[:80]!r} is not host:port")


def _check_get_tensors(m: pb.GetTensorsRequest) -> None:
    _sha("model sha256", m.model_sha256)
    _at_most("tensors asked for", len(m.tensors), MAX_TENSORS)
    for t in m.tensors:
        _at_most("tensor name characters", len(t.name), MAX_NAME_CHARS)


def _check_chunk(m: pb.TensorChunk) -> None:
    _at_most("tensor name characters", len(m.name), MAX_NAME_CHARS)
    _sha(f"sha256 of tensor {m.name[:80]!r}", m.sha256, optional=True)
    _at_most("bytes in one tensor chunk", len(m.data), 2 * TENSOR_CHUNK_BYTES)
    _at_most("tensor bytes", m.total_bytes, MAX_TENSOR_BYTES)


def _check_drop(m: pb.DropRequest) -> None:
    _at_most("plan id characters", len(m.plan_id), MAX_ID_CHARS)
    _at_most("sequences in one drop", len(m.seq_ids), MAX_SEQ_IDS)


MAX_PROBE_MATRICES = 16  # one layer's matrices (q, k, v, o, gate, up, down, and a few more)
MAX_PROBE_DIM = 1 << 20
MAX_PROBE_EXPERTS = 64  # experts a token reads from one stack (Qwen3: 8; Kimi K2: 8; some 16)


def _check_probe(m: pb.ProbeSpeedRequest) -> None:
    _at_most("matrices to probe", len(m.matrices), MAX_PROBE_MATRICES)
    for x in m.matrices:
        if not (1 <= x.n_out <= MAX_PROBE_DIM and 1 <= x.n_in <= MAX_PROBE_DIM):
            raise WireError(f"probe matrix {x.n_out}x{x.n_in} is outside 1..{MAX_PROBE_DIM}")
        _at_most("experts of a probe matrix", x.n_experts, MAX_PROBE_EXPERTS)


def _check_hello(m: pb.HelloRequest) -> None:
    _at_most("head name characters", len(m.head_name), MAX_NAME_CHARS)


_CHECKS = {
    pb.ForwardRequest: _check_forward,
    pb.LoadRequest: _check_load,
    pb.TensorChunk: _check_chunk,
    pb.DropRequest: _check_drop,
    pb.HelloRequest: _check_hello,
    pb.ProbeSpeedRequest: _check_probe,
    pb.GetTensorsRequest: _check_get_tensors,
}


def check_message(m: object) -> None:
    """Raise WireError if a received message breaks a bound (types without bounds pass)."""
    check = _CHECKS.get(type(m))
    if check is not None:
        check(m)  # type: ignore[operator]


class StreamCounter:
    """Counts tensors (first chunks) in one PutTensors stream."""

    def __init__(self) -> None:
        self.tensors = 0

    def see(self, m: object) -> None:
        if isinstance(m, pb.TensorChunk) and m.sha256:
            self.tensors += 1
            _at_most("tensors in one stream", self.tensors, MAX_TENSORS)
