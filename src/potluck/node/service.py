"""`NodeService`: the gRPC servicer of `potluck worker`, thin methods over the node's parts.

It builds them in one place: the plan store (node/plans.py), the loader (node/loading.py), the
forwarder with its follow-up batches (node/compute.py, node/followup.py) and the training
sessions (node/training.py), all sharing one compute lock. It answers Hello, frees plans (Drop,
and a janitor for plans no head used or named for idle_s), serves tensors to peers (GetTensors)
and from the head (PutTensors), and the diagnostics of `potluck nodes` / `doctor`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc

from potluck import __version__
from potluck.errors import PotluckError
from potluck.model.stage import DEFAULT_COMPUTE, Compute
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.sources import Places
from potluck.node import doctor as node_doctor
from potluck.node.compute import ORDER_WAIT_S, Forwarder
from potluck.node.loading import Loader
from potluck.node.plans import DEFAULT_IDLE_S, MAX_PLANS, PlanStore, Refused
from potluck.node.probe import (
    decode_bytes_per_s,
    gpu_offer,
    model_bytes_per_s,
    physical_cores,
    trim_heap,
    usable_memory_bytes,
)
from potluck.node.training import TrainingError, TrainSessions
from potluck.node.transfer import receive, send_tensors
from potluck.node.weights import IntegrityError, LocalModels
from potluck.transport import codec
from potluck.transport import potluck_pb2 as pb
from potluck.transport import potluck_pb2_grpc as pb_grpc
from potluck.transport.auth import PoolAuth
from potluck.transport.client import NodeClient
from potluck.transport.codec import PROTOCOL_VERSION, WireError, matrix_from_proto
from potluck.transport.linkprobe import quick_link
from potluck.transport.spin import DEFAULT_SPIN_S, spin_wait

_Request = TypeVar("_Request")
_Reply = TypeVar("_Reply")

ECHO_MAX_BYTES = 16 * 2**20  # the largest Echo reply (bandwidth probe)
KNOWN_TTL_S = 30.0  # how long Hellos reuse the list of model files this node has (it walks the
# model caches; a head's heartbeat says Hello every second)
log = logging.getLogger("potluck.worker")


PROBE_WAITS_FOR_HASHING_S = 60.0  # (hashing reads ≈ 1-2 GB/s: a 60 GB model dir takes this long)


class NodeService(pb_grpc.NodeServicer):
    def __init__(
        self,
        name: str,
        settings: Compute = DEFAULT_COMPUTE,
        models: LocalModels | None = None,
        auth: PoolAuth | None = None,
        mem_limit: int | None = None,
        idle_s: float = DEFAULT_IDLE_S,
        spin_s: float = DEFAULT_SPIN_S,
    ) -> None:
        """settings: how this node computes (threads, KV cache type, repacking); the GPU it
        offers is settings.gpu (the worker's -ngl / --device / --vram)."""
        self.name, self.settings = name, settings
        # the files it may open (default: this user's caches, under its home folder)
        self.models = models or LocalModels(Places.of({}, Path.home()))
        self.threads = settings.n_threads
        self.mem_limit, self.idle_s = mem_limit, idle_s
        self.plans = PlanStore(name, mem_limit)
        self.compute = threading.Lock()
        self.forwarder = Forwarder(self.plans, self.compute)
        # before each read on a data connection (in and out)
        self.wait = spin_wait(spin_s, rehearse=self.forwarder.rehearse)
        self.auth = auth  # this node proves pool membership to the next hop with it
        self.data_port = 0  # the data port (transport/dataplane.py) once serve() opened it
        self.store = self.models.blobs()
        with self.compute:
            self.speed = decode_bytes_per_s(threads=self.threads)  # once, before any stage loads
            self.gpu = gpu_offer(settings.gpu)  # its speed measured once too
            trim_heap()  # the probe's buffers go back to the OS
        self.loader = Loader(
            name, settings, self.models, auth, self.store, self.plans, self.compute, self.gpu,
            self.wait, self._free,
        )  # fmt: skip
        self.training = TrainSessions(self.models, self.threads, self._memory_bytes, self.store)
        threading.Thread(target=self._janitor, name="potluck-janitor", daemon=True).start()
        self._known: tuple[float, list[str]] = (-KNOWN_TTL_S, [])  # (looked, models.known())
        self._hashed_at = 0.0  # when the background hashing ended (Hellos look again after it)
        self._hashed = threading.Event()  # ... and that it has
        threading.Thread(  # (after the speed probe: it reads disk and takes a core)
            target=self._hash_models, name="potluck-hash-models", daemon=True
        ).start()

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
            stale = [
                p for p, lo in list(self.plans.by_id.items()) if now - lo.last_used > self.idle_s
            ]
            for plan_id in stale:
                self._free(plan_id, f"unused for {self.idle_s:.0f} s")
                trim_heap()

    def _free(self, plan_id: str, why: str) -> None:
        """Free a plan's stage and its follow-up state; close its next hop."""
        with self.compute:
            gone = self.plans.by_id.pop(plan_id, None)
        self.forwarder.follow.forget(plan_id)
        if gone is None:
            return
        log.info("freed plan %s: %s", plan_id[:12], why)
        if gone.next_hop is not None:
            gone.next_hop.close()

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
        return codec.hello_reply(
            self.name, __version__, self._devices(), physical_cores(), self.speed,
            self.data_port, self._known_models(),
        )  # fmt: skip

    def _hash_models(self) -> None:
        """Hash the --model-dir files once (remembered on disk), then let the next Hello look."""
        try:
            self.models.hash_extra_dirs()
        finally:
            self._hashed_at = time.monotonic()
            self._hashed.set()

    def _known_models(self) -> list[str]:
        """The model files this node has, by hash; looked up at most every KNOWN_TTL_S."""
        when, known = self._known
        now = time.monotonic()
        if now - when >= KNOWN_TTL_S or when < self._hashed_at:
            known = self.models.known()
            self._known = (now, known)
        return known

    def _devices(self) -> list[codec.DeviceOffer]:
        cpu = codec.DeviceOffer("cpu", "CPU", self._memory_bytes(), self.speed)
        if self.gpu is None:
            return [cpu]
        now = gpu_offer(self.settings.gpu)  # free memory now (the speed is the one measured first)
        free = now.memory_bytes if now is not None else 0
        return [
            cpu,
            codec.DeviceOffer(
                "gpu", self.gpu.name, free, self.gpu.bytes_per_s, self.gpu.max_layers
            ),
        ]  # fmt: skip

    # -- loading (node/loading.py) -----------------------------------------------------------------
    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadReply:
        return self.loader.load(request, context)

    def PutTensors(
        self, request_iterator: Iterator[pb.TensorChunk], context: grpc.ServicerContext
    ) -> pb.PutReply:
        try:
            got = receive(self.store, request_iterator, self.loader.expected_bytes, "the head")
        except (IntegrityError, WireError) as exc:
            context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        return codec.put_reply(got.tensors)

    def GetTensors(
        self, request: pb.GetTensorsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TensorChunk]:
        local = self.models.find(request.model_sha256, request.model_bytes)
        if local is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"node {self.name} does not have model {request.model_sha256[:12]}",
            )
        try:
            yield from send_tensors(GGUFFile(local), list(request.tensors), context.peer())
        except (PotluckError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    # -- compute (node/compute.py) -----------------------------------------------------------------
    def Forward(self, request: pb.ForwardRequest, context: grpc.ServicerContext) -> pb.ForwardReply:
        f = self.forwarder
        try:
            loaded, y, stage_ms = f.compute(
                request, min(ORDER_WAIT_S, context.time_remaining() or ORDER_WAIT_S)
            )
            if loaded.next_hop is None:
                return f.finish(loaded, request, y, stage_ms)
        except Refused as exc:
            context.abort(exc.code, exc.message)
        t1 = time.perf_counter()
        try:
            reply = loaded.next_hop.forward(
                f.downstream(loaded, request, y), timeout=context.time_remaining()
            )
        except PotluckError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return f.relay(reply, stage_ms, (time.perf_counter() - t1) * 1e3)

    def ForwardStream(
        self, request_iterator: Iterator[pb.ForwardRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ForwardReply]:
        return self.forwarder.serve_stream(request_iterator)

    def Drop(self, request: pb.DropRequest, context: grpc.ServicerContext) -> pb.DropReply:
        loaded = self.plans.get(request.plan_id)
        if request.release:  # the head is done with the plan: the chain frees it, this node last
            if loaded is not None and loaded.next_hop is not None:
                with contextlib.suppress(PotluckError):
                    loaded.next_hop.drop(request, timeout=2.0)
            self._free(request.plan_id, "its head is done with it")
            trim_heap()
            return codec.drop_reply()
        self.forwarder.follow.forget(request.plan_id, list(request.seq_ids))
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
        return codec.drop_reply()

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
    def _training(
        context: grpc.ServicerContext, call: Callable[[_Request], _Reply], request: _Request
    ) -> _Reply:
        try:
            return call(request)
        except TrainingError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except PotluckError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    # -- diagnostics (potluck nodes / doctor; node/doctor.py) ---------------------------------------
    def Echo(self, request: pb.EchoRequest, context: grpc.ServicerContext) -> pb.EchoReply:
        if request.reply_bytes > ECHO_MAX_BYTES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"echo of {request.reply_bytes} bytes asked, at most {ECHO_MAX_BYTES}",
            )
        return codec.echo_reply(request.reply_bytes)

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
        return codec.probe_link_reply(m.latency_s, m.bytes_per_s)

    def ProbeSpeed(
        self, request: pb.ProbeSpeedRequest, context: grpc.ServicerContext
    ) -> pb.ProbeSpeedReply:
        try:
            matrices = tuple(matrix_from_proto(m) for m in request.matrices)
        except (ValueError, PotluckError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not matrices:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no matrices to probe")
        # never beside the background hashing of --model-dir, which takes a core and reads the
        # disk: a probe beside it times far below what the stage then runs at, and is remembered
        # for minutes (bench/RESULTS.md, issue 29). Wait for it, up to a bound; past that, time
        # now and remember nothing.
        if not self._hashed.is_set():
            log.info("speed probe: waiting for the model files' hashing to end")
        quiet = self._hashed.wait(PROBE_WAITS_FOR_HASHING_S)
        with self.compute:  # never beside a forward pass: it would time both
            speed = model_bytes_per_s(matrices, self.threads, remember=quiet)
        return codec.probe_speed_reply(speed)

    def Describe(
        self, request: pb.DescribeRequest, context: grpc.ServicerContext
    ) -> pb.DescribeReply:
        d = node_doctor.describe(self.threads)
        return codec.describe_reply(
            d.threads, d.physical_cores, d.logical_cores, d.os, d.memory_bytes
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
        for t, speed in node_doctor.load_samples(seconds, interval, self.threads, self.compute):
            if not context.is_active():  # the head went away: stop loading the CPU
                return
            yield codec.stress_sample(t, speed)
