"""`potluck worker`: a gRPC service that loads its stage of a plan and computes forward passes.

One compute lock: the stage runs one forward at a time (torch already uses every core it is given);
gRPC's thread pool only does I/O around it. A stage forwards its hidden states straight to the next
stage's node and passes the reply (token ids) back up the chain.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from potluck import __version__
from potluck.engine.sampling import Sampler
from potluck.errors import ContextError, PotluckError
from potluck.model.layout import stage_tensor_names
from potluck.model.stage import SeqChunk, Stage, WeightSource
from potluck.modelfile.gguf_file import GGUFFile, read_header
from potluck.modelfile.hparams import hparams_from_metadata
from potluck.node.probe import decode_bytes_per_s, physical_cores, usable_memory_bytes
from potluck.node.weights import BlobSource, BlobStore, IntegrityError, find_local_model
from potluck.transport import potluck_pb2 as pb
from potluck.transport import potluck_pb2_grpc as pb_grpc
from potluck.transport.client import CHANNEL_OPTIONS, NodeClient
from potluck.transport.codec import (
    PROTOCOL_VERSION,
    WireError,
    sampling_from_proto,
    tensor_from_proto,
    tensor_to_proto,
)

ORDER_WAIT_S = 30.0  # longest a batch waits for an earlier batch of its sequence (seconds)
MAX_PLANS = 2  # a node keeps the stage of the previous plan while the new one takes over
_WIRE = {
    "": torch.float32,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class OrderError(PotluckError):
    """A batch waited too long for an earlier batch of the same sequence."""


@dataclass
class LoadedStage:
    plan_id: str
    stage: Stage
    next_hop: NodeClient | None
    wire_dtype: torch.dtype
    samplers: dict[int, Sampler] = field(default_factory=dict)


class NodeService(pb_grpc.NodeServicer):
    def __init__(
        self, name: str, threads: int | None = None, model_dirs: tuple[Path, ...] = ()
    ) -> None:
        self.name, self.threads, self.model_dirs = name, threads, model_dirs
        self.store = BlobStore()
        self.plans: dict[str, LoadedStage] = {}
        self.compute = threading.Lock()
        self.turn = threading.Condition(self.compute)  # compute, and wait for a sequence's turn
        with self.compute:
            if threads:
                torch.set_num_threads(threads)
            self.speed = decode_bytes_per_s()  # measured once, before any stage is loaded

    # -- handshake ---------------------------------------------------------------------------------
    def Hello(self, request: pb.HelloRequest, context: grpc.ServicerContext) -> pb.HelloReply:
        if request.protocol_version != PROTOCOL_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} from the head, this node speaks "
                f"{PROTOCOL_VERSION} (potluck {__version__}); install the same Potluck version on every machine",
            )
        return pb.HelloReply(
            protocol_version=PROTOCOL_VERSION,
            node_name=self.name,
            potluck_version=__version__,
            devices=[pb.Device(kind="cpu", name="cpu", memory_bytes=usable_memory_bytes())],
            physical_cores=physical_cores(),
            decode_bytes_per_s=self.speed,
        )

    # -- loading -----------------------------------------------------------------------------------
    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadReply:
        t0 = time.perf_counter()
        header = bytes(request.metadata_gguf)
        try:
            meta, tensors, _ = read_header(
                io.BytesIO(header), len(header), "model header from the head"
            )
            hp = hparams_from_metadata(meta, "model header from the head")
            if not 0 <= request.start < request.stop <= hp.n_layer:
                raise WireError(
                    f"layer range [{request.start}, {request.stop}) is outside [0, {hp.n_layer})"
                )
            if not 1 <= request.n_ctx <= hp.n_ctx_train:
                raise WireError(f"context {request.n_ctx} is outside [1, {hp.n_ctx_train}]")
            wire = _WIRE.get(request.wire_dtype)
            if wire is None:
                raise WireError(
                    f"wire dtype {request.wire_dtype!r} is not one of float32, float16, bfloat16"
                )
            src: WeightSource
            local = find_local_model(request.model_sha256, request.model_bytes, self.model_dirs)
            if local is not None:
                src = GGUFFile(local)
            else:
                names = stage_tensor_names(
                    tensors.values(), hp.n_layer, request.start, request.stop
                )
                digests = dict(request.tensor_sha256)
                missing = [n for n in names if n not in digests or not self.store.has(digests[n])]
                if missing:
                    return pb.LoadReply(need_tensors=True, missing=missing)
                src = BlobSource(tensors, digests, self.store)
            with self.compute:
                if self.threads:
                    torch.set_num_threads(self.threads)
                stage = Stage(hp, src, request.start, request.stop, request.n_ctx)
        except (PotluckError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        nxt = NodeClient(request.next_hop) if request.next_hop else None
        self.plans[request.plan_id] = LoadedStage(request.plan_id, stage, nxt, wire)
        while len(self.plans) > MAX_PLANS:  # the oldest plan goes
            old = self.plans.pop(next(iter(self.plans)))
            if old.next_hop is not None:
                old.next_hop.close()
        return pb.LoadReply(
            weight_bytes=stage.weight_bytes(), load_seconds=time.perf_counter() - t0
        )

    def PutTensors(
        self, request_iterator: Iterator[pb.TensorChunk], context: grpc.ServicerContext
    ) -> pb.PutReply:
        received = 0
        it = iter(request_iterator)
        pending = next(it, None)
        try:
            while pending is not None:
                first = pending
                if not first.sha256 or not first.total_bytes:
                    raise WireError(
                        f"tensor {first.name!r}: the first chunk must carry sha256 and total_bytes"
                    )

                def pieces(first: pb.TensorChunk = first) -> Iterator[bytes]:
                    nonlocal pending
                    yield first.data
                    for chunk in it:
                        if chunk.sha256:  # the next tensor starts
                            pending = chunk
                            return
                        yield chunk.data
                    pending = None

                pending = None
                self.store.put(first.sha256, first.total_bytes, pieces())
                received += 1
        except (IntegrityError, WireError) as exc:
            context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        return pb.PutReply(received=received)

    # -- compute -----------------------------------------------------------------------------------
    def _plan(self, plan_id: str, context: grpc.ServicerContext) -> LoadedStage:
        loaded = self.plans.get(plan_id)
        if loaded is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"plan {plan_id[:12]} is not loaded on this node",
            )
        return loaded

    def Forward(self, request: pb.ForwardRequest, context: grpc.ServicerContext) -> pb.ForwardReply:
        loaded = self._plan(request.plan_id, context)
        stage = loaded.stage
        try:
            chunks = [SeqChunk(c.seq_id, c.n) for c in request.chunks]
            total = sum(c.n for c in chunks)
            if not chunks or any(c.n < 1 for c in chunks) or total > stage.n_ctx * len(chunks):
                raise WireError(
                    f"{len(chunks)} chunks of {[c.n for c in chunks]} tokens are not a valid batch"
                )
            if len({c.seq_id for c in chunks}) != len(chunks):
                raise WireError("a sequence appears twice in one batch")
            x = tensor_from_proto(request.input)
            if stage.is_first:
                if x.dtype != torch.int64 or x.shape != (total,):
                    raise WireError(
                        f"the first stage takes int64 token ids [{total}], got {x.dtype} {tuple(x.shape)}"
                    )
                if int(x.min()) < 0 or int(x.max()) >= stage.hp.n_vocab:
                    raise WireError(f"token ids must be in [0, {stage.hp.n_vocab})")
            elif x.dtype != torch.float32 or x.shape != (total, stage.hp.n_embd):
                raise WireError(
                    f"expected hidden states [{total}, {stage.hp.n_embd}], got {x.dtype} {tuple(x.shape)}"
                )
            rows = torch.arange(total) if request.want_logits else None
            wait = min(ORDER_WAIT_S, context.time_remaining() or ORDER_WAIT_S)
            with self.turn:
                self._wait_turn(stage, request.chunks, wait)
                t0 = time.perf_counter()
                try:
                    y = stage(x, chunks, rows) if stage.is_last else stage(x, chunks)
                finally:
                    self.turn.notify_all()
                stage_ms = (time.perf_counter() - t0) * 1e3
        except WireError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ContextError as exc:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        except OrderError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        if loaded.next_hop is not None:
            down = pb.ForwardRequest(
                plan_id=request.plan_id,
                chunks=request.chunks,
                input=tensor_to_proto(y, loaded.wire_dtype),
                want_logits=request.want_logits,
            )
            t1 = time.perf_counter()
            try:
                reply = loaded.next_hop.forward(down, timeout=context.time_remaining())
            except PotluckError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            hop_ms = (time.perf_counter() - t1) * 1e3 - sum(reply.stage_ms)
            return pb.ForwardReply(
                tokens=reply.tokens,
                logits=reply.logits,
                stage_ms=[stage_ms, *reply.stage_ms],
                hop_ms=[hop_ms, *reply.hop_ms],
            )
        if request.want_logits:
            return pb.ForwardReply(logits=tensor_to_proto(y), stage_ms=[stage_ms])
        tokens = []
        for row, chunk in zip(y, request.chunks, strict=True):
            if not chunk.sample:
                tokens.append(-1)
                continue
            sampler = loaded.samplers.get(chunk.seq_id)
            if sampler is None:
                try:
                    sampler = loaded.samplers[chunk.seq_id] = Sampler(
                        sampling_from_proto(chunk.sampling)
                    )
                except WireError as exc:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            tokens.append(sampler.sample(row, list(chunk.recent)))
        return pb.ForwardReply(tokens=tokens, stage_ms=[stage_ms])

    def _wait_turn(self, stage: Stage, chunks: Sequence[pb.SeqChunk], wait_s: float) -> None:
        """Hold `self.turn` until every chunk's sequence is exactly at the chunk's position: batches
        of one sequence may arrive out of order when several are in flight (pipelining)."""
        deadline = time.monotonic() + wait_s
        while True:
            late = None
            for c in chunks:
                at = stage.position(c.seq_id)
                if at > c.pos:
                    raise WireError(
                        f"sequence {c.seq_id} is at position {at} here, but a batch for position "
                        f"{c.pos} came: a repeated or stale batch"
                    )
                if at < c.pos:
                    late = (c, at)
            if late is None:
                return
            left = deadline - time.monotonic()
            if left <= 0 or not self.turn.wait(left):
                c, at = late
                raise OrderError(
                    f"waited {wait_s:.0f} s for sequence {c.seq_id}'s tokens {at}–{c.pos - 1} before "
                    f"the batch at position {c.pos}; the head or the previous node lost a batch"
                )

    def Drop(self, request: pb.DropRequest, context: grpc.ServicerContext) -> pb.DropReply:
        loaded = self.plans.get(request.plan_id)
        if loaded is not None:
            with self.compute:
                for s in request.seq_ids:
                    loaded.stage.drop(s)
                    loaded.samplers.pop(s, None)
            if loaded.next_hop is not None:
                with contextlib.suppress(
                    PotluckError
                ):  # a node that is gone frees its memory anyway
                    loaded.next_hop.drop(request)
        return pb.DropReply()


def serve(host: str, port: int, name: str | None = None, threads: int | None = None,
          model_dirs: tuple[Path, ...] = ()) -> tuple[grpc.Server, int]:  # fmt: skip
    """Start the node's gRPC server; returns it and the bound port (port 0 picks a free one)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=CHANNEL_OPTIONS)
    pb_grpc.add_NodeServicer_to_server(
        NodeService(name or f"{host}:{port}", threads, model_dirs), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise PotluckError(
            f"cannot listen on {host}:{port}: the port is taken or the address is not on this machine"
        )
    server.start()
    return server, bound
