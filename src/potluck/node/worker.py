"""`potluck worker`: a gRPC service that loads its stage of a plan and computes forward passes.

One compute lock: the stage runs one forward at a time (ggml already uses every core it is given);
gRPC's thread pool only does I/O around it. A stage forwards its hidden states straight to the next
stage's node and passes the reply (token ids) back up the chain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil

from potluck import __version__
from potluck.engine.sampling import Sampler, Token
from potluck.errors import ContextError, PotluckError
from potluck.model.layout import stage_tensor_names
from potluck.model.stage import SeqChunk, Stage, WeightSource, default_threads
from potluck.modelfile.gguf_file import GGUFFile, read_header
from potluck.modelfile.hparams import HParams, hparams_from_metadata
from potluck.modelfile.lora import LoraAdapter, open_lora
from potluck.node import doctor as node_doctor
from potluck.node.probe import (
    decode_bytes_per_s,
    gpu_offer,
    model_bytes_per_s,
    physical_cores,
    trim_heap,
    usable_memory_bytes,
)
from potluck.node.training import TrainingError, TrainSessions
from potluck.node.transfer import Received, pull, receive, send_tensors
from potluck.node.weights import (
    BlobSource,
    BlobStore,
    IntegrityError,
    find_local_model,
    lacking,
    sha256_bytes,
)
from potluck.transport import potluck_pb2 as pb
from potluck.transport import potluck_pb2_grpc as pb_grpc
from potluck.transport.auth import AuthService, Handshakes, PoolAuth, SessionTable
from potluck.transport.client import NODE_SERVER_OPTIONS, NodeClient
from potluck.transport.codec import (
    PROTOCOL_VERSION,
    WireError,
    lora_from_wire,
    matrix_from_proto,
    penalizes,
    sampling_from_proto,
    tensor_from_proto,
    tensor_to_proto,
)
from potluck.transport.dataplane import Answer, DataServer
from potluck.transport.guard import Guard
from potluck.transport.limits import check_message
from potluck.transport.linkprobe import quick_link
from potluck.transport.spin import DEFAULT_SPIN_S, computing, spin_wait
from potluck.transport.tls import server_credentials, server_ssl_context

ECHO_MAX_BYTES = 16 * 2**20  # the largest Echo reply (bandwidth probe)
log = logging.getLogger("potluck.worker")
DEFAULT_IDLE_S = 120.0  # a plan no head used or named for this long is freed (seconds)
REHEARSE_MAX_BYTES = 64 << 10  # largest input rehearsed while waiting (_rehearse)
ORDER_WAIT_S = 30.0  # longest a batch waits for an earlier batch of its sequence (seconds)
MAX_PLANS = 2  # stages a node holds at once: two heads, or one head's old and new plan
LIVE_S = 10.0  # a plan used or named in a heartbeat this recently is in use: never evicted
_WIRE = {"": "float32", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class Refused(Exception):
    """A forward request this node answers with an error status (not a crash)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class NodeMemoryError(PotluckError):
    """A stage does not fit in the memory this node offers (--mem)."""


class NodeBusyError(PotluckError):
    """Other heads use every plan this node can hold (MAX_PLANS)."""


class OrderError(PotluckError):
    """A batch waited too long for an earlier batch of the same sequence."""


@dataclass
class LoadedStage:
    plan_id: str
    stage: Stage
    next_hop: NodeClient | None
    wire_dtype: str  # hidden states to the next node: float32, float16 or bfloat16
    samplers: dict[int, Sampler] = field(default_factory=dict)
    reserved_bytes: int = 0  # weights + full-context KV of one sequence, counted against --mem
    last_used: float = field(default_factory=time.monotonic)
    head_id: str = ""  # the head that loaded it ("" from a head that does not say)
    last_compute: float = field(default_factory=time.monotonic)  # loaded, or last computed


class NodeService(pb_grpc.NodeServicer):
    def __init__(
        self,
        name: str,
        threads: int | None = None,
        model_dirs: tuple[Path, ...] = (),
        auth: PoolAuth | None = None,
        mem_limit: int | None = None,
        idle_s: float = DEFAULT_IDLE_S,
        spin_s: float = DEFAULT_SPIN_S,
    ) -> None:
        """The GPU it offers is the process's -ngl / --device / --vram (model.stage.set_gpu)."""
        self.name, self.threads, self.model_dirs = name, threads, model_dirs
        self.mem_limit, self.idle_s = mem_limit, idle_s
        self.last_request: pb.ForwardRequest | None = None  # see _rehearse
        # before each read on a data connection (in and out)
        self.wait = spin_wait(spin_s, rehearse=self._rehearse)
        self.auth = auth  # this node proves pool membership to the next hop with it
        self.data_port = 0  # the data port (transport/dataplane.py) once serve() opened it
        self.store = BlobStore()
        self.expected_bytes = 0  # what the last Load asked the head for (PutTensors' progress)
        self.plans: dict[str, LoadedStage] = {}
        # Load's room check, insertion and eviction, as one step against concurrent Loads (the
        # compute lock is held for a whole forward: too long to wait for here)
        self.plans_lock = threading.Lock()
        self.compute = threading.Lock()
        self.turn = threading.Condition(self.compute)  # compute, and wait for a sequence's turn
        # Follow-up decode steps (a first stage): the last token the pool sampled for each
        # (plan, sequence) as this node relayed it, with the position right after its batch; and
        # the follow-up batches that wait for their token, by (plan, sequence, position), with
        # how to answer them (the head may send the next before this node ran the last).
        self.follow_lock = threading.Lock()
        self.sampled: dict[tuple[str, int], tuple[int, int]] = {}
        self.parked: dict[tuple[str, int, int], tuple[pb.ForwardRequest, Answer]] = {}
        with self.compute:
            self.speed = decode_bytes_per_s(threads=threads)  # once, before any stage is loaded
            self.gpu = gpu_offer()  # its speed measured once too
            trim_heap()  # the probe's buffers go back to the OS
        self.training = TrainSessions(
            model_dirs, threads or default_threads(), self._memory_bytes, self.store
        )
        threading.Thread(target=self._janitor, name="potluck-janitor", daemon=True).start()

    def _memory_bytes(self) -> int:
        """What this node offers: usable RAM, or less with --mem."""
        free = usable_memory_bytes()
        return free if self.mem_limit is None else min(free, self.mem_limit)

    def _janitor(self) -> None:
        """Free the stages of plans no head has used or named in a heartbeat for idle_s: a head
        that vanished does not hold this machine's memory forever."""
        while True:
            time.sleep(max(0.05, self.idle_s / 4))
            now = time.monotonic()
            # a snapshot (Load and Drop change the dict meanwhile) that keeps no stage alive
            stale = [p for p, lo in list(self.plans.items()) if now - lo.last_used > self.idle_s]
            for plan_id in stale:
                self._free(plan_id, f"unused for {self.idle_s:.0f} s")
                trim_heap()

    # -- handshake ---------------------------------------------------------------------------------
    def Hello(self, request: pb.HelloRequest, context: grpc.ServicerContext) -> pb.HelloReply:
        if request.protocol_version != PROTOCOL_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} from the head, this node speaks "
                f"{PROTOCOL_VERSION} (potluck {__version__}); install the same Potluck version on every machine",
            )
        now = time.monotonic()
        for plan_id in request.plan_ids[: MAX_PLANS * 4]:
            if (loaded := self.plans.get(plan_id)) is not None:
                loaded.last_used = now
        return pb.HelloReply(
            protocol_version=PROTOCOL_VERSION,
            node_name=self.name,
            potluck_version=__version__,
            devices=self._devices(),
            physical_cores=physical_cores(),
            decode_bytes_per_s=self.speed,
            data_port=self.data_port,
        )

    def _devices(self) -> list[pb.Device]:
        cpu = pb.Device(
            kind="cpu", name="CPU", memory_bytes=self._memory_bytes(), bytes_per_s=self.speed
        )
        if self.gpu is None:
            return [cpu]
        now = gpu_offer()  # free memory now (the speed is the one measured first)
        free = now.memory_bytes if now is not None else 0
        return [
            cpu,
            pb.Device(
                kind="gpu", name=self.gpu.name, memory_bytes=free,
                bytes_per_s=self.gpu.bytes_per_s, max_layers=self.gpu.max_layers,
            ),
        ]  # fmt: skip

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
            with self.plans_lock:
                self._check_room(request)  # early: before seconds of loading
            need = self._check_memory(tensors, hp, request)  # and before any transfer
            src: WeightSource
            pulled: tuple[str, Received | None] = ("", None)  # from which peer, how much
            local = find_local_model(request.model_sha256, request.model_bytes, self.model_dirs)
            if local is not None:
                src = GGUFFile(local)
            else:
                names = stage_tensor_names(
                    tensors.values(), hp.n_layer, request.start, request.stop
                )
                digests = dict(request.tensor_sha256)
                pulled = self._pull_from_peers(request, names, digests, tensors)
                missing, partial, total = self._lacking(names, digests, tensors)
                if missing:
                    self.expected_bytes = total
                    log.info(
                        "layers %d–%d: no local copy of the model; receiving %d tensors, %.1f MiB "
                        "from the head",
                        request.start, request.stop - 1, len(missing), total / 2**20,
                    )  # fmt: skip
                    if partial:
                        log.info(
                            "resuming %d tensors of a broken transfer (%.1f MiB kept)",
                            len(partial), sum(partial.values()) / 2**20,
                        )  # fmt: skip
                    return pb.LoadReply(need_tensors=True, missing=missing, partial=partial)
                src = BlobSource(tensors, digests, self.store)
            adapters = [self._adapter(part, hp, tensors) for part in request.adapters]
            with self.compute:
                stage = Stage(
                    hp, src, request.start, request.stop, request.n_ctx, threads=self.threads,
                    n_gpu_layers=self._gpu_layers(request), adapters=adapters,
                )  # fmt: skip
        except (NodeMemoryError, NodeBusyError) as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (PotluckError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        nxt = NodeClient(request.next_hop, self.auth) if request.next_hop else None
        if nxt is not None:
            try:  # a next hop of another pool (or gone) is said now, not at the first token
                nxt.hello(pb.HelloRequest(protocol_version=PROTOCOL_VERSION, head_name=self.name))
                nxt.use_data_port(self.wait)
            except PotluckError as exc:
                nxt.close()
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"this node cannot reach its next stage {request.next_hop}: {exc}",
                )
        with self.plans_lock:
            try:
                self._check_room(request)  # again: another head may have loaded meanwhile
            except NodeBusyError as exc:
                if nxt is not None:
                    nxt.close()
                stage.close()
                trim_heap()
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            keep = {p.plan_id for p in self._kept_beside(request)}
            self.plans[request.plan_id] = LoadedStage(
                request.plan_id, stage, nxt, wire, reserved_bytes=need, head_id=request.head_id
            )
            evicted = [p for p in self.plans if p != request.plan_id and p not in keep]
        for plan_id in evicted:
            self._free(plan_id, "room for a new plan")
        trim_heap()  # the replaced plan's stage and the load's buffers go back to the OS
        reply = pb.LoadReply(
            weight_bytes=stage.weight_bytes(), load_seconds=time.perf_counter() - t0,
            kv_bytes=stage.full_kv_bytes() * max(1, request.n_seq),
            rss_bytes=psutil.Process().memory_info().rss,
            pulled_from=pulled[0],
            pulled_bytes=pulled[1].nbytes if pulled[1] else 0,
            pull_seconds=pulled[1].seconds if pulled[1] else 0.0,
        )  # fmt: skip
        mib = 2**20
        log.info(
            "loaded plan %s: layers %d–%d · weights %.1f MiB + KV %.1f MiB at -c %d × %d "
            "sequences · process RSS %.1f MiB · %.1f s",
            request.plan_id[:12], request.start, request.stop - 1, reply.weight_bytes / mib,
            reply.kv_bytes / mib, request.n_ctx, max(1, request.n_seq), reply.rss_bytes / mib,
            reply.load_seconds,
        )  # fmt: skip
        return reply

    def _adapter(self, part: pb.AdapterPart, hp: HParams, tensors: dict) -> LoraAdapter:
        """A LoRA adapter the head sent (its tensors for this stage), kept by content hash beside
        the received weights and checked against the model as a local file is."""
        data = bytes(part.gguf)  # (bounded by the message size limit)
        path = self.store.root / f"lora-{sha256_bytes(data)}.gguf"
        if not path.exists():
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        adapter = open_lora(path, hp.arch, tensors, part.scale)
        name = Path(part.name).name or "adapter"  # a label only: never a path opened
        return dataclasses.replace(adapter, path=Path(name + ".gguf"))

    def _gpu_layers(self, request: pb.LoadRequest) -> int:
        """The layers the plan puts on this node's GPU, at most its -ngl (0 without a GPU)."""
        if self.gpu is None:
            return 0
        return min(request.n_gpu_layers, self.gpu.max_layers)

    def _check_memory(self, tensors: dict, hp: HParams, request: pb.LoadRequest) -> int:
        """Bytes the stage reserves (its tensors + the KV caches of the plan's n_seq sequences at
        full context); with
        --mem, refuse a stage that does not fit beside the plan kept from before."""
        names = stage_tensor_names(tensors.values(), hp.n_layer, request.start, request.stop)
        weights = sum(tensors[n].nbytes for n in names)
        n_seq = max(1, request.n_seq)
        kv = hp.kv_bytes_per_token(request.stop - request.start) * request.n_ctx * n_seq
        need = weights + kv
        if self.mem_limit is None:
            return need
        held = sum(p.reserved_bytes for p in self._kept_beside(request))
        if need + held > self.mem_limit:
            mib = 2**20
            raise NodeMemoryError(
                f"node {self.name} has --mem {self.mem_limit / mib:.0f} MiB: layers "
                f"{request.start}–{request.stop - 1} need {need / mib:.1f} MiB ({weights / mib:.1f} "
                f"weights + {kv / mib:.1f} KV at -c {request.n_ctx}"
                + (f" × -np {n_seq})" if n_seq > 1 else ")")
                + (f" beside {held / mib:.1f} MiB of the previous plan" if held else "")
                + "; give it fewer layers (--tensor-split), a smaller -c"
                + (" or -np" if n_seq > 1 else "")
                + ", or more --mem"
            )
        return need

    def _in_use(self, loaded: LoadedStage, request: pb.LoadRequest) -> bool:
        """Whether another head loaded `loaded` or computed on it in the last LIVE_S. (A plan
        only named in heartbeats, a chat waiting for its user, may go: its head fails over and
        replays the conversation when it next needs it.)"""
        return not self._mine(loaded, request) and time.monotonic() - loaded.last_compute <= LIVE_S

    def _mine(self, loaded: LoadedStage, request: pb.LoadRequest) -> bool:
        return bool(request.head_id) and loaded.head_id == request.head_id

    def _kept_beside(self, request: pb.LoadRequest) -> list[LoadedStage]:
        """The plans that stay when `request`'s loads: those other heads use, then other heads'
        idle ones, then this head's older ones, the most recently computed first, MAX_PLANS - 1
        in all. The rest go."""
        others = [p for p in list(self.plans.values()) if p.plan_id != request.plan_id]
        others.sort(
            key=lambda p: (self._in_use(p, request), not self._mine(p, request), p.last_compute),
            reverse=True,
        )
        return others[: MAX_PLANS - 1]

    def _check_room(self, request: pb.LoadRequest) -> None:
        """Refuse a plan while MAX_PLANS - 1 others are in use by other heads: loading it would
        evict a live conversation (which would fail over, and evict another...)."""
        if request.plan_id in self.plans:
            return
        busy = [p for p in list(self.plans.values()) if self._in_use(p, request)]
        if len(busy) >= MAX_PLANS:
            ago = ", ".join(f"{time.monotonic() - p.last_compute:.1f} s" for p in busy)
            raise NodeBusyError(
                f"it is running the stages of {len(busy)} other heads (last computed {ago} ago) "
                f"and holds at most {MAX_PLANS} plans: try again when one of them ends, or leave "
                "this node out"
            )

    def _free(self, plan_id: str, why: str) -> None:
        """Free a plan's stage and its follow-up state; close its next hop."""
        with self.compute:
            gone = self.plans.pop(plan_id, None)
        self._forget(plan_id)
        if gone is None:
            return
        log.info("freed plan %s: %s", plan_id[:12], why)
        if gone.next_hop is not None:
            gone.next_hop.close()

    def _lacking(
        self, names: list[str], digests: dict[str, str], tensors: dict
    ) -> tuple[list[str], dict[str, int], int]:
        return lacking(self.store, names, digests, tensors)

    def _pull_from_peers(
        self, request: pb.LoadRequest, names: list[str], digests: dict[str, str], tensors: dict
    ) -> tuple[str, Received | None]:
        """Ask the request's tensor sources, in order, for the stage's tensors this node lacks,
        until it has them all: (the peer that sent the last of them, what came from peers). A
        peer without the file, or whose link breaks, passes the rest on to the next (the head
        is the last resort: Load answers need_tensors)."""
        source, got = "", None
        for peer in request.tensor_sources:
            missing, partial, total = self._lacking(names, digests, tensors)
            if not missing:
                break
            log.info(
                "layers %d–%d: no local copy of the model; asking peer %s for %d tensors, "
                "%.1f MiB", request.start, request.stop - 1, peer, len(missing), total / 2**20,
            )  # fmt: skip
            try:
                more = pull(self.store, peer, self.auth, request, missing, partial, total)
            except (PotluckError, OSError) as exc:
                log.warning("peer %s did not send them: %s", peer, exc)
                continue
            source = peer
            got = more if got is None else Received(
                got.tensors + more.tensors, got.nbytes + more.nbytes, got.seconds + more.seconds
            )  # fmt: skip
        return source, got

    def PutTensors(
        self, request_iterator: Iterator[pb.TensorChunk], context: grpc.ServicerContext
    ) -> pb.PutReply:
        try:
            got = receive(self.store, request_iterator, self.expected_bytes, "the head")
        except (IntegrityError, WireError) as exc:
            context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        return pb.PutReply(received=got.tensors)

    def GetTensors(
        self, request: pb.GetTensorsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TensorChunk]:
        local = find_local_model(request.model_sha256, request.model_bytes, self.model_dirs)
        if local is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"node {self.name} does not have model {request.model_sha256[:12]}",
            )
        try:
            yield from send_tensors(GGUFFile(local), list(request.tensors), context.peer())
        except (PotluckError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    # -- compute -----------------------------------------------------------------------------------
    def _loaded(self, plan_id: str) -> LoadedStage:
        """The stage of a plan; Refused when this node does not hold it."""
        loaded = self.plans.get(plan_id)
        if loaded is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"plan {plan_id[:12]} is not loaded on this node",
            )
        return loaded

    def _prepare(
        self, request: pb.ForwardRequest
    ) -> tuple[LoadedStage, list[SeqChunk], np.ndarray, np.ndarray | None]:
        """Check a forward request against its stage: (stage, chunks, input, logits rows). Changes
        nothing. Raises Refused with the status to answer."""
        loaded = self._loaded(request.plan_id)
        stage = loaded.stage
        try:
            chunks = [SeqChunk(c.seq_id, c.n, lora_from_wire(c.lora)) for c in request.chunks]
            total = sum(c.n for c in chunks)
            if not chunks or any(c.n < 1 for c in chunks) or total > stage.n_ctx * len(chunks):
                raise WireError(
                    f"{len(chunks)} chunks of {[c.n for c in chunks]} tokens are not a valid batch"
                )
            if len({c.seq_id for c in chunks}) != len(chunks):
                raise WireError("a sequence appears twice in one batch")
            if any(c.follow for c in request.chunks):
                raise WireError("a follow-up batch goes on the forward stream or the data port")
            n_vocab = stage.hp.n_vocab
            if any(t >= n_vocab for c in request.chunks for t in c.recent):
                raise WireError(f"recent token ids (for penalties) must be in [0, {n_vocab})")
            x = tensor_from_proto(request.input)
            if stage.is_first:
                if x.dtype != np.int64 or x.shape != (total,):
                    raise WireError(
                        f"the first stage takes int64 token ids [{total}], got {x.dtype} {tuple(x.shape)}"
                    )
                if int(x.min()) < 0 or int(x.max()) >= stage.hp.n_vocab:
                    raise WireError(f"token ids must be in [0, {stage.hp.n_vocab})")
            elif x.dtype != np.float32 or x.shape != (total, stage.hp.n_embd):
                raise WireError(
                    f"expected hidden states [{total}, {stage.hp.n_embd}], got {x.dtype} {tuple(x.shape)}"
                )
            rows = np.arange(total) if request.want_logits else None
            if stage.is_last and rows is None and not any(c.sample for c in request.chunks):
                rows = np.empty(0, np.int64)  # an early prompt micro-batch: no head
            return loaded, chunks, x, rows
        except WireError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def _rehearse(self) -> None:
        """Check the last request computed here again (`_prepare`), computing nothing: run while
        the node polls for the next one, so that that one's path is in the core's caches
        (transport/spin.py says why)."""
        request = self.last_request
        if request is not None:
            with contextlib.suppress(Refused, WireError):  # e.g. its plan was freed meanwhile
                check_message(request)
                self._prepare(request)

    def _compute(
        self, request: pb.ForwardRequest, wait_s: float
    ) -> tuple[LoadedStage, np.ndarray, float]:
        """Check a forward request, wait for its sequences' turn, run the stage: (stage, output,
        compute ms). Raises Refused with the status to answer."""
        loaded, chunks, x, rows = self._prepare(request)
        loaded.last_used = loaded.last_compute = time.monotonic()
        # a decode step is rehearsed while this node waits for the next (not a prompt's batch)
        self.last_request = request if request.input.ByteSize() <= REHEARSE_MAX_BYTES else None
        stage = loaded.stage
        try:
            with self.turn:
                self._wait_turn(stage, request.chunks, wait_s)
                t0 = time.perf_counter()
                try:
                    with computing():  # no thread of this process spins meanwhile
                        y = stage(x, chunks, rows) if stage.is_last else stage(x, chunks)
                finally:
                    self.turn.notify_all()
                return loaded, y, (time.perf_counter() - t0) * 1e3
        except WireError as exc:  # a repeated or stale batch (_wait_turn)
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except ContextError as exc:
            raise Refused(grpc.StatusCode.OUT_OF_RANGE, str(exc)) from None
        except OrderError as exc:
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None

    def _downstream(
        self, loaded: LoadedStage, request: pb.ForwardRequest, y: np.ndarray
    ) -> pb.ForwardRequest:
        return pb.ForwardRequest(
            plan_id=request.plan_id,
            chunks=request.chunks,
            input=tensor_to_proto(y, loaded.wire_dtype),
            want_logits=request.want_logits,
        )

    @staticmethod
    def _relay(reply: pb.ForwardReply, stage_ms: float, wall_ms: float) -> pb.ForwardReply:
        """The downstream reply (changed in place: its logits may be large) with this stage's
        compute and the hop to the next node in front."""
        stages, hops = list(reply.stage_ms), list(reply.hop_ms)
        del reply.stage_ms[:], reply.hop_ms[:]
        reply.stage_ms.extend([stage_ms, *stages])
        reply.hop_ms.extend([wall_ms - sum(stages) - sum(hops), *hops])
        reply.request_id = 0  # the downstream link's id; the caller sets its own
        return reply

    def _finish(
        self, loaded: LoadedStage, request: pb.ForwardRequest, y: np.ndarray, stage_ms: float
    ) -> pb.ForwardReply:
        """The last stage's answer: logits of every row, or one sampled token per chunk."""
        if request.want_logits:
            return pb.ForwardReply(logits=tensor_to_proto(y), stage_ms=[stage_ms])
        if y.shape[0] == 0:  # nothing to sample in this batch (the output head was skipped)
            return pb.ForwardReply(tokens=[-1] * len(request.chunks), stage_ms=[stage_ms])
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
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            tokens.append(sampler.sample(row, list(chunk.recent)))
        reply = pb.ForwardReply(tokens=tokens, stage_ms=[stage_ms])
        if any(isinstance(t, Token) for t in tokens):  # logprobs asked: one entry per chunk
            for t in tokens:
                lp = t.logprob if isinstance(t, Token) else 0.0
                top = t.top if isinstance(t, Token) else ()
                reply.logprobs.append(lp)
                reply.top.add(ids=[i for i, _ in top], logprobs=[v for _, v in top])
        return reply

    def Forward(self, request: pb.ForwardRequest, context: grpc.ServicerContext) -> pb.ForwardReply:
        try:
            loaded, y, stage_ms = self._compute(
                request, min(ORDER_WAIT_S, context.time_remaining() or ORDER_WAIT_S)
            )
            if loaded.next_hop is None:
                return self._finish(loaded, request, y, stage_ms)
        except Refused as exc:
            context.abort(exc.code, exc.message)
        t1 = time.perf_counter()
        try:
            reply = loaded.next_hop.forward(
                self._downstream(loaded, request, y), timeout=context.time_remaining()
            )
        except PotluckError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return self._relay(reply, stage_ms, (time.perf_counter() - t1) * 1e3)

    def serve_forward(self, request: pb.ForwardRequest, answer: Answer) -> None:
        """Compute one request (in the calling thread) and answer it: the last stage answers at
        once; any other sends its output on to the next node and answers when that node does
        (from the thread that reads the next node's replies). Used by ForwardStream and by the
        data port (transport/dataplane.py). A follow-up batch waits for its input token (see
        `_follow_up`)."""
        rid = request.request_id
        if any(c.follow for c in request.chunks):
            self._follow_up(request, answer)
            return
        try:
            loaded, y, stage_ms = self._compute(request, ORDER_WAIT_S)
            if loaded.next_hop is None:
                reply = self._finish(loaded, request, y, stage_ms)
                reply.request_id = rid
                answer(reply)  # first: a follow-up step's answer must come after this one
                if loaded.stage.is_first:
                    self._run_ready(self._took(request, list(reply.tokens), ""), "")
                return
        except Refused as exc:
            answer(pb.ForwardReply(request_id=rid, error=exc.message, error_code=exc.code.name))
            return
        t1 = time.perf_counter()
        first = loaded.stage.is_first

        def relay(f: Future[pb.ForwardReply]) -> None:
            exc = f.exception()
            if exc is not None:
                answer(pb.ForwardReply(request_id=rid, error=str(exc), error_code="UNAVAILABLE"))
                if first:
                    self._run_ready(self._took(request, None, str(exc)), str(exc))
                return
            reply = self._relay(f.result(), stage_ms, (time.perf_counter() - t1) * 1e3)
            reply.request_id = rid
            if first:
                # The follow-up steps that waited for these tokens run before the answer goes
                # up: the head then reads it while the next node computes, not before this one
                # does (a head on this machine would otherwise be woken on this core first;
                # measured 0.5 ms per token of a two-node pool on loopback).
                self._run_ready(self._took(request, list(reply.tokens), reply.error), reply.error)
            answer(reply)

        loaded.next_hop.link.send(self._downstream(loaded, request, y)).add_done_callback(relay)

    # -- follow-up decode steps: the next token starts here, without a round trip to the head ----
    def _follow_up(self, request: pb.ForwardRequest, answer: Answer) -> None:
        """A decode step whose input id is the token the pool samples for its sequence's previous
        batch: run it as soon as this node relays that token (now, if it already did), so the
        pool computes the next token while the head is still receiving the last one."""
        rid = request.request_id
        c = request.chunks[0]
        try:
            loaded = self._loaded(request.plan_id)
        except Refused as exc:
            answer(pb.ForwardReply(request_id=rid, error=exc.message, error_code=exc.code.name))
            return
        why = ""
        if len(request.chunks) != 1 or c.n != 1:
            why = (
                f"a follow-up batch is one chunk of one token, got {[x.n for x in request.chunks]}"
            )
        elif not loaded.stage.is_first:
            why = f"a follow-up batch came to layers {loaded.stage.start}–{loaded.stage.stop - 1}; only the first stage takes one"
        if why:
            answer(pb.ForwardReply(request_id=rid, error=why, error_code="INVALID_ARGUMENT"))
            return
        with self.follow_lock:
            got = self.sampled.get((request.plan_id, c.seq_id))
            if got is None or got[0] != c.pos:
                key = (request.plan_id, c.seq_id, c.pos)
                if key in self.parked:
                    why = f"a second follow-up batch for sequence {c.seq_id} at position {c.pos}"
                else:
                    self.parked[key] = (request, answer)
                    return
        if why:
            answer(pb.ForwardReply(request_id=rid, error=why, error_code="INVALID_ARGUMENT"))
            return
        self._run_follow_up(request, answer, got[1])

    def _run_follow_up(self, request: pb.ForwardRequest, answer: Answer, token: int) -> None:
        """The follow-up batch with its input id filled in (and added to its recent ids for the
        penalties), computed like any other; skipped if the id ends the generation."""
        if token in request.stop_ids:
            answer(pb.ForwardReply(request_id=request.request_id, tokens=[-1], skipped=True))
            return
        c = request.chunks[0]
        c.follow = False
        # (tensor_to_proto's layout: one little-endian int64)
        request.input.CopyFrom(
            pb.Tensor(data=token.to_bytes(8, "little", signed=True), shape=[1], dtype="int64")
        )
        if c.sample and penalizes(c.sampling):  # the head sent the recent ids before this one
            c.recent.append(token)
            if c.sampling.repeat_last_n > 0:
                del c.recent[: -c.sampling.repeat_last_n]
        self.serve_forward(request, answer)

    def _took(
        self, request: pb.ForwardRequest, tokens: list[int] | None, error: str
    ) -> list[tuple[pb.ForwardRequest, Answer, int]]:
        """This first stage has the tokens sampled for `request` (None: the request failed, and
        `error` says why): note them, and hand back the follow-up batches that waited for them,
        each with its input id (-1: none)."""
        ready = []
        with self.follow_lock:
            for i, c in enumerate(request.chunks):
                if not c.sample:
                    continue
                token = tokens[i] if tokens is not None and not error else -1
                if token >= 0:
                    self.sampled[(request.plan_id, c.seq_id)] = (c.pos + c.n, token)
                parked = self.parked.pop((request.plan_id, c.seq_id, c.pos + c.n), None)
                if parked is not None:
                    ready.append((*parked, token))
        return ready

    def _run_ready(self, ready: list[tuple[pb.ForwardRequest, Answer, int]], error: str) -> None:
        """Run the follow-up batches `_took` handed back (in this thread), or fail them."""
        for req, ans, token in ready:
            if token >= 0:
                self._run_follow_up(req, ans, token)
            else:
                ans(
                    pb.ForwardReply(
                        request_id=req.request_id,
                        error=f"the batch before this follow-up failed: {error or 'no token'}",
                        error_code="UNAVAILABLE",
                    )
                )

    def _forget(self, plan_id: str, seq_ids: Sequence[int] | None = None) -> None:
        """Drop the follow-up state of a plan (or of some of its sequences); a batch still waiting
        for its token is answered with an error."""

        def mine(key: tuple) -> bool:
            return key[0] == plan_id and (seq_ids is None or key[1] in seq_ids)

        with self.follow_lock:
            for k in [k for k in self.sampled if mine(k)]:
                del self.sampled[k]
            parked = [self.parked.pop(k) for k in [k for k in self.parked if mine(k)]]
        for req, ans in parked:
            ans(
                pb.ForwardReply(
                    request_id=req.request_id,
                    error=f"sequence {req.chunks[0].seq_id} was dropped while this follow-up batch "
                    "waited for its token",
                    error_code="CANCELLED",
                )
            )

    def ForwardStream(
        self, request_iterator: Iterator[pb.ForwardRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ForwardReply]:
        """Forward for a stream of requests: each is computed as it arrives (in order) and sent on
        down this node's own link to the next node; replies go back as they complete."""
        out: queue.SimpleQueue[pb.ForwardReply | None] = queue.SimpleQueue()
        lock = threading.Lock()
        state = {"pending": 0, "ended": False}

        def emit(reply: pb.ForwardReply) -> None:
            out.put(reply)
            with lock:
                state["pending"] -= 1
                last = state["ended"] and state["pending"] == 0
            if last:
                out.put(None)

        def pump() -> None:
            try:
                for request in request_iterator:
                    with lock:
                        state["pending"] += 1
                    self.serve_forward(request, emit)
            except grpc.RpcError:
                pass  # the upstream went away; its in-flight answers have no one to go to
            finally:
                with lock:
                    state["ended"] = True
                    last = state["pending"] == 0
                if last:
                    out.put(None)

        threading.Thread(target=pump, name="potluck-forward-stream", daemon=True).start()
        while (reply := out.get()) is not None:
            yield reply

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
        if request.release:  # the head is done with the plan: the chain frees it, this node last
            if loaded is not None and loaded.next_hop is not None:
                with contextlib.suppress(PotluckError):
                    loaded.next_hop.drop(request, timeout=2.0)
            self._free(request.plan_id, "its head is done with it")
            trim_heap()
            return pb.DropReply()
        self._forget(request.plan_id, list(request.seq_ids))
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

    # -- diagnostics (potluck nodes / doctor; node/doctor.py) ---------------------------------------
    # -- data-parallel LoRA training (node/training.py) -------------------------------------------
    def TrainOpen(
        self, request: pb.TrainOpenRequest, context: grpc.ServicerContext
    ) -> pb.TrainOpenReply:
        return self._training(context, self.training.open, request)

    def TrainGrad(
        self, request: pb.TrainGradRequest, context: grpc.ServicerContext
    ) -> pb.TrainGradReply:
        with self.compute:  # never beside a forward pass
            return self._training(context, self.training.grad, request)

    def TrainApply(
        self, request: pb.TrainApplyRequest, context: grpc.ServicerContext
    ) -> pb.TrainApplyReply:
        return self._training(context, self.training.apply, request)

    def TrainClose(
        self, request: pb.TrainCloseRequest, context: grpc.ServicerContext
    ) -> pb.TrainCloseReply:
        return self._training(context, self.training.close, request)

    @staticmethod
    def _training(context: grpc.ServicerContext, call: Callable, request: Any) -> Any:
        try:
            return call(request)
        except TrainingError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except PotluckError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def Echo(self, request: pb.EchoRequest, context: grpc.ServicerContext) -> pb.EchoReply:
        if request.reply_bytes > ECHO_MAX_BYTES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"echo of {request.reply_bytes} bytes asked, at most {ECHO_MAX_BYTES}",
            )
        return pb.EchoReply(payload=bytes(request.reply_bytes))

    def ProbeLink(
        self, request: pb.ProbeLinkRequest, context: grpc.ServicerContext
    ) -> pb.ProbeLinkReply:
        host, _, port = request.address.rpartition(":")
        if not host or not port.isdigit() or len(request.address) > 300:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{request.address[:80]!r} is not host:port"
            )
        client = NodeClient(request.address, self.auth)
        try:
            m = quick_link(client, timeout=min(10.0, context.time_remaining() or 10.0))
        except PotluckError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except grpc.RpcError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{request.address}: {exc.details()}")
        finally:
            client.close()
        return pb.ProbeLinkReply(latency_s=m.latency_s, bytes_per_s=m.bytes_per_s)

    def ProbeSpeed(
        self, request: pb.ProbeSpeedRequest, context: grpc.ServicerContext
    ) -> pb.ProbeSpeedReply:
        try:
            matrices = tuple(matrix_from_proto(m) for m in request.matrices)
        except (ValueError, PotluckError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not matrices:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no matrices to probe")
        with self.compute:  # never beside a forward pass: it would time both
            speed = model_bytes_per_s(matrices, self.threads)
        return pb.ProbeSpeedReply(bytes_per_s=speed)

    def Describe(
        self, request: pb.DescribeRequest, context: grpc.ServicerContext
    ) -> pb.DescribeReply:
        d = node_doctor.describe(self.threads)
        return pb.DescribeReply(
            threads=d.threads,
            physical_cores=d.physical_cores,
            logical_cores=d.logical_cores,
            os=d.os,
            memory_bytes=d.memory_bytes,
        )

    def Stress(
        self, request: pb.StressRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StressSample]:
        seconds, interval = request.seconds, request.interval
        if not (0 < seconds <= node_doctor.MAX_LOAD_S) or not (
            node_doctor.MIN_INTERVAL_S <= interval <= node_doctor.MAX_INTERVAL_S
        ):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"load probe of {seconds} s in intervals of {interval} s: seconds must be in "
                f"(0, {node_doctor.MAX_LOAD_S:.0f}], the interval in [{node_doctor.MIN_INTERVAL_S}, "
                f"{node_doctor.MAX_INTERVAL_S}]",
            )
        for t, speed in node_doctor.load_samples(seconds, interval, self.compute):
            if not context.is_active():  # the head went away: stop loading the CPU
                return
            yield pb.StressSample(t=t, bytes_per_s=speed)


class NodeServer:
    """A node's gRPC server and its data port (transport/dataplane.py), started and stopped
    together."""

    def __init__(self, grpc_server: grpc.Server, data: DataServer | None, data_port: int) -> None:
        self.grpc, self.data, self.data_port = grpc_server, data, data_port

    def stop(self, grace: float | None) -> threading.Event:
        if self.data is not None:
            self.data.stop()
        return self.grpc.stop(grace)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc.wait_for_termination(timeout)


def serve(host: str, port: int, name: str | None = None, threads: int | None = None,
          model_dirs: tuple[Path, ...] = (), auth: PoolAuth | None = None,
          mem_limit: int | None = None, idle_s: float = DEFAULT_IDLE_S,
          data_port: int | None = -1, spin_s: float = DEFAULT_SPIN_S,
          ) -> tuple[NodeServer, int]:  # fmt: skip
    """Start the node's gRPC server and its data port; returns them and the bound gRPC port
    (port 0 picks a free one). data_port: -1 = the gRPC port + 1, or any free port if that one is
    taken; 0 = any free port; None = no data port (forward requests then come on gRPC streams).
    With TLS the data port speaks TLS with the node's certificate. spin_s: how long the node polls
    its data connections for the next frame before it blocks (transport/spin.py; 0 = never).

    With a pool secret in `auth`, every call but Hello and the handshake needs a session
    (transport/guard.py); with `auth.tls` the node serves TLS with its own certificate."""
    auth = auth if auth is not None else PoolAuth()
    sessions = SessionTable()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=32),
        options=NODE_SERVER_OPTIONS,
        interceptors=[Guard(auth, sessions)],
    )
    service = NodeService(
        name or f"{host}:{port}", threads, model_dirs, auth, mem_limit, idle_s, spin_s
    )
    pb_grpc.add_NodeServicer_to_server(service, server)
    pb_grpc.add_NodeAuthServicer_to_server(AuthService(Handshakes(auth, sessions)), server)
    if auth.tls and auth.identity is None:
        raise PotluckError("a worker with --tls needs its certificate (auth.identity)")
    try:
        if auth.tls and auth.identity is not None:
            bound = server.add_secure_port(f"{host}:{port}", server_credentials(auth.identity))
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise PotluckError(
            f"cannot listen on {host}:{port}: the port is taken (a worker also takes port + 1 for "
            "hidden states: give workers on one machine ports two apart, e.g. -p 50052 and -p "
            "50054) or the address is not on this machine"
        )
    server.start()
    data = None
    if data_port is not None:
        tls = server_ssl_context(auth.identity) if auth.tls and auth.identity else None
        data = DataServer(auth, service.serve_forward, tls=tls, wait=service.wait)
        try:
            service.data_port = data.listen(host, bound + 1 if data_port == -1 else data_port)
        except OSError as exc:
            if data_port != -1:
                server.stop(0)
                raise PotluckError(
                    f"cannot listen on data port {host}:{data_port} ({exc.strerror or exc}): pick a "
                    "free one with --data-port, or leave the flag out (port + 1, else any free port)"
                ) from None
            service.data_port = data.listen(host, 0)  # port + 1 is taken: any free one
    return NodeServer(server, data, service.data_port), bound
