"""A worker's Load: check the request, find the stage's weights (a local file by size + hash, else
the tensor sources in order, else `need_tensors` from the head), build the `Stage` under the
compute lock, reach the next hop, and put it in the plan store (evicting what it does not keep).

A Load is refused (`NodeBusyError`) while other heads compute on every plan this node can hold:
checked before the stage is built and again, under the store's lock, before it goes in; the
`--mem` check runs before any transfer.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil

from potluck.errors import PotluckError
from potluck.files import private_tmp
from potluck.model.archs import hparams_from_metadata
from potluck.model.layout import stage_tensor_names
from potluck.model.stage import Compute, Stage, WeightSource
from potluck.modelfile.gguf_file import GGUFFile, TensorInfo, read_header
from potluck.modelfile.hparams import HParams
from potluck.modelfile.lora import LoraAdapter, open_lora
from potluck.node.plans import LoadedStage, NodeBusyError, NodeMemoryError, PlanStore
from potluck.node.probe import GpuOffer, trim_heap
from potluck.node.transfer import Received, pull
from potluck.node.weights import BlobSource, BlobStore, LocalModels, lacking, sha256_bytes
from potluck.transport import codec
from potluck.transport import potluck_pb2 as pb
from potluck.transport.auth import PoolAuth
from potluck.transport.client import NodeClient
from potluck.transport.codec import WireError
from potluck.transport.dataplane import Wait

log = logging.getLogger("potluck.worker")
_WIRE = {"": "float32", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class Loader:
    """Loads the stages of plans into `plans`; `free(plan_id, why)` frees one it evicts."""

    def __init__(
        self,
        name: str,
        settings: Compute,
        models: LocalModels,
        auth: PoolAuth | None,
        store: BlobStore,
        plans: PlanStore,
        compute: threading.Lock,
        gpu: GpuOffer | None,
        wait: Wait | None,
        free: Callable[[str, str], None],
    ) -> None:
        self.name, self.settings, self.models, self.auth = name, settings, models, auth
        self.store, self.plans, self.compute, self.gpu = store, plans, compute, gpu
        self.wait, self.free = wait, free  # wait: the next hop's data link polls with it
        self.expected_bytes = 0  # what the last Load asked the head for (PutTensors' progress)

    def load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadReply:
        t0 = time.perf_counter()
        header = bytes(request.metadata_gguf)
        try:
            meta, tensors, _ = read_header(header, "model header from the head")
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
            with self.plans.lock:
                self.plans.check_room(request)  # early: before seconds of loading
            need = self.plans.check_memory(tensors, hp, request)  # and before any transfer
            src: WeightSource
            pulled: tuple[str, Received | None] = ("", None)  # from which peer, how much
            local = self.models.find(request.model_sha256, request.model_bytes)
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
                    return codec.need_tensors_reply(missing, partial)
                src = BlobSource(tensors, digests, self.store)
            adapters = [self._adapter(part, hp, tensors) for part in request.adapters]
            with self.compute:
                stage = Stage(
                    hp, src, request.start, request.stop, request.n_ctx,
                    n_gpu_layers=self._gpu_layers(request), adapters=adapters,
                    compute=self.settings, ram_experts=request.ram_experts,
                )  # fmt: skip
        except (NodeMemoryError, NodeBusyError) as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (PotluckError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        nxt = NodeClient(request.next_hop, self.auth) if request.next_hop else None
        if nxt is not None:
            try:  # a next hop of another pool (or gone) is said now, not at the first token
                nxt.hello(self.name)
                nxt.use_data_port(self.wait)
            except PotluckError as exc:
                nxt.close()
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"this node cannot reach its next stage {request.next_hop}: {exc}",
                )
        with self.plans.lock:
            try:
                self.plans.check_room(request)  # again: another head may have loaded meanwhile
            except NodeBusyError as exc:
                if nxt is not None:
                    nxt.close()
                stage.close()
                trim_heap()
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            keep = {p.plan_id for p in self.plans.kept_beside(request)}
            self.plans.by_id[request.plan_id] = LoadedStage(
                request.plan_id, stage, nxt, wire, reserved_bytes=need, head_id=request.head_id,
                metadata=meta,
            )  # fmt: skip
            evicted = [p for p in self.plans.by_id if p != request.plan_id and p not in keep]
        for plan_id in evicted:
            self.free(plan_id, "room for a new plan")
        trim_heap()  # the replaced plan's stage and the load's buffers go back to the OS
        reply = codec.loaded_reply(
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

    def _adapter(
        self, part: pb.AdapterPart, hp: HParams, tensors: dict[str, TensorInfo]
    ) -> LoraAdapter:
        """A LoRA adapter the head sent (its tensors for this stage), kept by content hash beside
        the received weights and checked against the model as a local file is."""
        data = bytes(part.gguf)  # (bounded by the message size limit)
        path = self.store.root / f"lora-{sha256_bytes(data)}.gguf"
        if not path.exists():
            tmp = private_tmp(path)  # two workers sharing the cache may write it at once
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

    def _lacking(
        self, names: list[str], digests: dict[str, str], tensors: dict[str, TensorInfo]
    ) -> tuple[list[str], dict[str, int], int]:
        return lacking(self.store, names, digests, tensors)

    def _pull_from_peers(
        self,
        request: pb.LoadRequest,
        names: list[str],
        digests: dict[str, str],
        tensors: dict[str, TensorInfo],
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
