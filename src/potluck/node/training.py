"""A worker's side of data-parallel LoRA training (potluck finetune over the pool).

The head opens a session with the adapters' and the optimizer's state; for every step it sends
this node its share of the global batch (token ids and which to learn) and gets back the gradient
of the share's summed loss divided by the global batch's learned-token count; then it sends the
sum over every share and the node takes the same AdamW step as the head. So every node holds the
same adapters after every step, and a node that goes away costs nothing but its share's time.

PyTorch is imported only here, when a session opens: a worker without it says so.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from potluck.errors import PotluckError
from potluck.node.weights import BlobStore, LocalModels
from potluck.transport import codec
from potluck.transport import potluck_pb2 as pb


class TrainingError(PotluckError):
    """A training request this node cannot serve (no PyTorch, no model file, an unknown session,
    a step out of order)."""


def flat_grads(params: Sequence[Any]) -> bytes:
    """Every parameter's gradient, flattened in order, as f32 bytes."""
    import torch

    return torch.cat([p.grad.reshape(-1) for p in params]).numpy().astype(np.float32).tobytes()


def set_grads(params: Sequence[Any], data: bytes) -> None:
    """The inverse of flat_grads: each parameter's .grad from the flat f32 bytes."""
    import torch

    flat = torch.from_numpy(np.frombuffer(data, np.float32).copy())
    n = sum(p.numel() for p in params)
    if flat.numel() != n:
        raise TrainingError(f"gradient has {flat.numel()} values, the adapters {n}")
    at = 0
    for p in params:
        p.grad = flat[at : at + p.numel()].view_as(p).clone()
        at += p.numel()


def state_bytes(model: Any, opt: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save({"adapters": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    return buf.getvalue()


def load_state(model: Any, opt: Any, data: bytes) -> None:
    import torch

    state = torch.load(io.BytesIO(data), weights_only=True)
    model.load_state_dict(state["adapters"])
    opt.load_state_dict(state["optimizer"])


class _Session:
    def __init__(self, model: Any, opt: Any, step: int) -> None:
        self.model, self.opt, self.step = model, opt, step
        self.params = list(model.parameters())


class TrainSessions:
    """The training sessions of one worker, by session id (one compute at a time)."""

    def __init__(
        self,
        models: LocalModels,
        threads: int,
        memory: Callable[[], int],
        store: BlobStore,
    ) -> None:
        """memory(): what this node offers now (usable RAM, or less with --mem). store: where
        a model's tensors are kept when the node has no file of it (received from the head)."""
        self.models, self.threads, self.memory = models, threads, memory
        self.store = store
        self.sessions: dict[str, _Session] = {}
        self.lock = threading.Lock()

    def open(self, request: pb.TrainOpenRequest) -> pb.TrainOpenReply:
        try:
            import torch
        except ImportError:
            raise TrainingError(
                "this worker has no PyTorch, which training needs: pip install 'potluck[train]' "
                "on it (CPU build: torch==2.13.0)"
            ) from None
        from potluck.model.archs import hparams_from_metadata
        from potluck.model.stage import WeightSource
        from potluck.modelfile.gguf_file import GGUFFile, read_header
        from potluck.node.weights import BlobSource, lacking
        from potluck.train.loop import big_blocks_to_the_os
        from potluck.train.model import LoraModel

        if request.need_bytes > (free := self.memory()):
            raise TrainingError(
                f"a training step of this node's share needs about "
                f"{request.need_bytes / 2**30:.1f} GiB, it offers {free / 2**30:.1f} GiB"
            )
        path = self.models.find(request.model_sha256, request.model_bytes)
        src: WeightSource
        if path is not None:
            f = GGUFFile(path)
            src, metadata = f, f.metadata
        elif not request.metadata_gguf:
            return codec.train_need_model_reply()  # the head sends the header and digests
        else:
            header = bytes(request.metadata_gguf)
            meta, tensors, _ = read_header(header, "the head's header")
            digests = dict(request.tensor_sha256)
            missing, partial, _ = lacking(self.store, list(tensors), digests, tensors)
            if missing:
                return codec.train_need_tensors_reply(missing, partial)
            src, metadata = BlobSource(tensors, digests, self.store), meta
        torch.set_num_threads(self.threads)
        big_blocks_to_the_os()
        hp = hparams_from_metadata(metadata, "the model")
        model = LoraModel(
            hp, src, tuple(request.targets), request.rank, request.alpha, request.seed,
            request.recompute,
        )  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=request.lr, weight_decay=0.0)
        load_state(model, opt, request.state)
        with self.lock:
            self.sessions[request.session_id] = _Session(model, opt, request.step)
        return codec.train_opened_reply(sum(p.numel() for p in model.parameters()))

    def _session(self, sid: str, step: int) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            raise TrainingError(f"no training session {sid[:12]} on this worker (restarted?)")
        if s.step != step:
            raise TrainingError(
                f"step {step} asked, this worker's adapters are after step {s.step}"
            )
        return s

    def grad(self, request: pb.TrainGradRequest) -> pb.TrainGradReply:
        from potluck.train.data import Example
        from potluck.train.loop import collate

        with self.lock:
            s = self._session(request.session_id, request.step)
            t0 = time.perf_counter()
            if not request.sequences or any(len(q.ids) != len(q.learn) for q in request.sequences):
                raise TrainingError("a share needs sequences with one learn flag per token")
            part = [Example(0, tuple(q.ids), tuple(q.learn)) for q in request.sequences]
            ids, learn = collate(part)
            s.opt.zero_grad(set_to_none=True)
            loss = s.model.loss_sum(ids, learn) / max(request.n_learned, 1)
            loss.backward()
            return codec.train_grad_reply(
                float(loss.detach()), flat_grads(s.params), (time.perf_counter() - t0) * 1e3
            )

    def apply(self, request: pb.TrainApplyRequest) -> pb.TrainApplyReply:
        with self.lock:
            s = self._session(request.session_id, request.step)
            set_grads(s.params, request.grads)
            s.opt.step()
            s.step += 1
        return codec.train_apply_reply()

    def close(self, request: pb.TrainCloseRequest) -> pb.TrainCloseReply:
        with self.lock:
            self.sessions.pop(request.session_id, None)
        return codec.train_close_reply()
