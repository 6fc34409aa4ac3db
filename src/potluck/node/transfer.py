"""Weights on the wire: a node receives the tensors of its stage that it lacks, and sends tensors
of a model file it has to another node of the pool.

Three ways bytes move, one receiving loop (`receive`): the head pushes them (PutTensors), or a
node pulls them from a peer that has the file (`pull`, over the peer's GetTensors, which
`send_tensors` answers). Every tensor lands in the BlobStore, checked against the sha256 the head
announced; a transfer that breaks off keeps what arrived, and the next one (from the same peer,
another one, or the head) starts where it ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from potluck.modelfile.gguf_file import GGUFFile
from potluck.node.weights import BlobStore
from potluck.transport import codec
from potluck.transport import potluck_pb2 as pb
from potluck.transport.auth import PoolAuth
from potluck.transport.client import NodeClient, NodeError
from potluck.transport.codec import TENSOR_CHUNK_BYTES, WireError

log = logging.getLogger("potluck.worker")
REPORT_EVERY_BYTES = 32 * 2**20  # progress lines in steps of this size when the total is unknown
PULL_TIMEOUT_S = 3600.0  # one pull of a stage's tensors (a 14B's half over 100 Mbit/s: ≈ 6 min)


@dataclass(frozen=True)
class Received:
    tensors: int
    nbytes: int
    seconds: float


def receive(
    store: BlobStore, chunks: Iterator[pb.TensorChunk], total: int, whence: str
) -> Received:
    """Store the tensors of a stream of chunks (a tensor's first chunk carries its sha256, size
    and offset; the rest only data), logging progress with MB/s and time left against `total`
    (the bytes expected; 0: unknown). Raises IntegrityError or WireError; what arrived of the
    tensor in flight stays in the store, to be resumed."""
    t0 = time.perf_counter()
    step = max(total // 10, 1) if total else REPORT_EVERY_BYTES  # tenths, when it is known
    tensors, got, next_report = 0, 0, step
    it = iter(chunks)
    while (first := next(it, None)) is not None:
        if not first.sha256 or not first.total_bytes:
            raise WireError(
                f"tensor {first.name!r}: the first chunk must carry sha256 and total_bytes"
            )

        def pieces(first: pb.TensorChunk = first) -> Iterator[bytes]:
            """The tensor's bytes; stops at its last byte without waiting for the next chunk, so
            that a link breaking after it does not hold back a tensor that arrived whole."""
            left, data = first.total_bytes - first.offset, first.data
            while True:
                yield data
                left -= len(data)
                if left <= 0 or (chunk := next(it, None)) is None:
                    return  # whole (or longer: put says so), or the sender ended early
                if chunk.sha256:
                    raise WireError(
                        f"tensor {first.name!r}: the next tensor began {left:,} bytes before "
                        "its end"
                    )
                data = chunk.data

        store.put(first.sha256, first.total_bytes, pieces(), first.offset)
        tensors += 1
        got += first.total_bytes - first.offset
        if got >= next_report and (not total or got < total):
            rate = got / max(time.perf_counter() - t0, 1e-9)
            of = (
                f" of {total / 2**20:.1f} MiB ({got / total:.0%}), "
                f"{rate / 1e6:.0f} MB/s, {(total - got) / rate:.0f} s left"
                if total
                else f", {rate / 1e6:.0f} MB/s"
            )
            log.info("from %s: received %.1f MiB%s", whence, got / 2**20, of)
            next_report = got + step
    dt = time.perf_counter() - t0
    log.info(
        "from %s: received %d tensors, %.1f MiB in %.1f s, %.0f MB/s (checked, cached)",
        whence, tensors, got / 2**20, dt, got / max(dt, 1e-9) / 1e6,
    )  # fmt: skip
    return Received(tensors, got, dt)


def push_chunks(
    file: GGUFFile,
    node: str,
    names: list[str],
    digests: Mapping[str, str],
    partial: Mapping[str, int] | None = None,
    on_sent: Callable[[int, int], None] | None = None,
) -> Iterator[pb.TensorChunk]:
    """PutTensors' stream from a head: the tensors' bytes in chunks, each tensor's first chunk
    with its sha256; a tensor the node kept part of (`partial`, from a transfer that broke off)
    starts where that part ends. on_sent(bytes sent, bytes to send) as it goes."""
    partial = partial or {}
    starts = {n: partial.get(n, 0) for n in names}
    for name, start in starts.items():
        if not 0 <= start < file.tensors[name].nbytes:
            raise NodeError(f"node {node} says it kept {start:,} bytes of tensor {name}")
    total = sum(file.tensors[n].nbytes - starts[n] for n in names)
    sent = 0
    for name in names:
        data = file.raw(name).reshape(-1).data
        start = starts[name]
        for off in range(start, len(data), TENSOR_CHUNK_BYTES):
            piece = bytes(data[off : off + TENSOR_CHUNK_BYTES])
            sent += len(piece)
            if on_sent is not None:
                on_sent(sent, total)
            if off == start:
                yield codec.tensor_chunk(name, piece, digests[name], len(data), start)
            else:
                yield codec.tensor_chunk(name, piece)


def send_tensors(file: GGUFFile, ranges: list[pb.TensorRange], to: str) -> Iterator[pb.TensorChunk]:
    """GetTensors' answer: the named tensors of `file` from their offsets, in chunks (no sha256:
    the receiver checks against the digests its head sent). Raises WireError for a name the file
    lacks or an offset past a tensor's end, before sending anything."""
    for r in ranges:
        info = file.tensors.get(r.name)
        if info is None:
            raise WireError(f"tensor {r.name!r} is not in this model file")
        if r.offset >= info.nbytes:
            raise WireError(f"tensor {r.name!r} has {info.nbytes:,} bytes, asked from {r.offset:,}")
    total = sum(file.tensors[r.name].nbytes - r.offset for r in ranges)
    log.info("sending %d tensors, %.1f MiB, to %s", len(ranges), total / 2**20, to)
    t0 = time.perf_counter()
    for r in ranges:
        data = file.raw(r.name).reshape(-1).data
        for off in range(r.offset, len(data), TENSOR_CHUNK_BYTES):
            piece = bytes(data[off : off + TENSOR_CHUNK_BYTES])
            if off == r.offset:  # no sha256: the receiver has its head's
                yield codec.tensor_chunk(r.name, piece, total_bytes=len(data), offset=off)
            else:
                yield codec.tensor_chunk(r.name, piece)
    dt = time.perf_counter() - t0
    log.info(
        "sent %.1f MiB to %s in %.1f s, %.0f MB/s",
        total / 2**20, to, dt, total / max(dt, 1e-9) / 1e6,
    )  # fmt: skip


def pull(
    store: BlobStore,
    source: str,
    auth: PoolAuth | None,
    request: pb.LoadRequest,
    missing: list[str],
    partial: Mapping[str, int],
    total: int,
) -> Received:
    """Ask the peer `source` for the `missing` tensors of the model `request` names (each from
    what `partial` says is kept) and store them, checked against the request's digests. Raises
    PotluckError when the peer lacks the file or the link breaks (what arrived stays)."""
    digests = request.tensor_sha256
    client = NodeClient(source, auth)
    try:
        client.hello("peer")
        ranges = {n: partial.get(n, 0) for n in missing}
        ask = codec.get_tensors_request(request.model_sha256, request.model_bytes, ranges)
        wanted = set(missing)

        def chunks() -> Iterator[pb.TensorChunk]:
            for chunk in client.get_tensors(ask, PULL_TIMEOUT_S):
                if chunk.total_bytes:  # a tensor's first chunk: the digest is the head's word
                    if chunk.name not in wanted:
                        raise WireError(f"peer {source} sent tensor {chunk.name!r}, not asked for")
                    chunk.sha256 = digests[chunk.name]
                yield chunk

        return receive(store, chunks(), total, f"peer {source}")
    finally:
        client.close()
