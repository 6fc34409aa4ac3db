"""The plans a worker holds: one `LoadedStage` per plan id, at most `MAX_PLANS` of them.

`PlanStore` owns the dict, the lock that makes a Load's room check, insertion and eviction one
step, the `--mem` check (`check_memory`) and the eviction order (`kept_beside`): a Load keeps the
plans other heads computed on in the last `LIVE_S`, then other heads' idle ones, then its own
head's older ones, and is refused (`NodeBusyError`) while other heads compute on all of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from potluck.errors import PotluckError
from potluck.grammar import Vocabulary
from potluck.model.layout import stage_tensor_names
from potluck.model.stage import Stage
from potluck.modelfile.gguf_file import TensorInfo
from potluck.modelfile.hparams import HParams
from potluck.modelfile.tokenizer import Tokenizer
from potluck.sampling import Sampler
from potluck.transport import potluck_pb2 as pb
from potluck.transport.client import NodeClient

DEFAULT_IDLE_S = 120.0  # a plan no head used or named for this long is freed (seconds)
MAX_PLANS = 2  # stages a node holds at once: two heads, or one head's old and new plan
LIVE_S = 10.0  # a plan used or named in a heartbeat this recently is in use: never evicted


class Refused(Exception):
    """A forward request this node answers with an error status (not a crash)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class NodeMemoryError(PotluckError):
    """A stage does not fit in the memory this node offers (--mem)."""


class NodeBusyError(PotluckError):
    """Other heads use every plan this node can hold (MAX_PLANS)."""


@dataclass
class LoadedStage:
    plan_id: str
    stage: Stage
    next_hop: NodeClient | None
    wire_dtype: str  # hidden states to the next node: float32, float16 or bfloat16
    # per sequence: the sampler made of the sampling settings its last stage was sent
    samplers: dict[int, Sampler] = field(default_factory=dict)
    reserved_bytes: int = 0  # weights + full-context KV of one sequence, counted against --mem
    last_used: float = field(default_factory=time.monotonic)
    head_id: str = ""  # the head that loaded it ("" from a head that does not say)
    last_compute: float = field(default_factory=time.monotonic)  # loaded, or last computed
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the model's GGUF metadata
    _vocab: Vocabulary | None = None

    def vocabulary(self) -> Vocabulary:
        """The model's vocabulary for grammars (built from the metadata at the first use)."""
        if self._vocab is None:
            try:
                self._vocab = Vocabulary(Tokenizer(self.metadata))
            except (PotluckError, ValueError, KeyError) as exc:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"this node cannot read the model's vocabulary for a grammar: {exc}",
                ) from None
        return self._vocab


class PlanStore:
    """The stages of the plans this node holds, by plan id, and which of them a Load keeps."""

    def __init__(self, name: str, mem_limit: int | None) -> None:
        self.name, self.mem_limit = name, mem_limit
        self.by_id: dict[str, LoadedStage] = {}
        # Load's room check, insertion and eviction, as one step against concurrent Loads (the
        # compute lock is held for a whole forward: too long to wait for here)
        self.lock = threading.Lock()

    def get(self, plan_id: str) -> LoadedStage | None:
        return self.by_id.get(plan_id)

    def loaded(self, plan_id: str) -> LoadedStage:
        """The stage of a plan; Refused when this node does not hold it."""
        loaded = self.by_id.get(plan_id)
        if loaded is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"plan {plan_id[:12]} is not loaded on this node",
            )
        return loaded

    def check_memory(
        self, tensors: Mapping[str, TensorInfo], hp: HParams, request: pb.LoadRequest
    ) -> int:
        """Bytes the stage reserves (its tensors + the KV caches of the plan's n_seq sequences at
        full context); with
        --mem, refuse a stage that does not fit beside the plan kept from before."""
        names = stage_tensor_names(tensors.values(), hp.n_layer, request.start, request.stop)
        weights = sum(tensors[n].nbytes for n in names)
        n_seq = max(1, request.n_seq)
        attends = hp.attention_layers(request.start, request.stop)
        kv = hp.kv_bytes_per_token(attends) * request.n_ctx * n_seq
        kv += hp.state_bytes(request.start, request.stop) * n_seq  # a hybrid's recurrent state
        need = weights + kv
        if self.mem_limit is None:
            return need
        held = sum(p.reserved_bytes for p in self.kept_beside(request))
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

    def kept_beside(self, request: pb.LoadRequest) -> list[LoadedStage]:
        """The plans that stay when `request`'s loads: those other heads use, then other heads'
        idle ones, then this head's older ones, the most recently computed first, MAX_PLANS - 1
        in all. The rest go."""
        others = [p for p in list(self.by_id.values()) if p.plan_id != request.plan_id]
        others.sort(
            key=lambda p: (self._in_use(p, request), not self._mine(p, request), p.last_compute),
            reverse=True,
        )
        return others[: MAX_PLANS - 1]

    def check_room(self, request: pb.LoadRequest) -> None:
        """Refuse a plan while MAX_PLANS - 1 others are in use by other heads: loading it would
        evict a live conversation (which would fail over, and evict another...)."""
        if request.plan_id in self.by_id:
            return
        busy = [p for p in list(self.by_id.values()) if self._in_use(p, request)]
        if len(busy) >= MAX_PLANS:
            ago = ", ".join(f"{time.monotonic() - p.last_compute:.1f} s" for p in busy)
            raise NodeBusyError(
                f"it is running the stages of {len(busy)} other heads (last computed {ago} ago) "
                f"and holds at most {MAX_PLANS} plans: try again when one of them ends, or leave "
                "this node out"
            )
