"""Load a model into one or more in-process stages, and generate tokens through them."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from potluck.engine.contract import Pipeline
from potluck.engine.local import LocalPipeline
from potluck.engine.requests import DEFAULT_N_BATCH as DEFAULT_N_BATCH
from potluck.engine.requests import MIN_POOL_UBATCH as MIN_POOL_UBATCH  # (re-exported: their
from potluck.engine.requests import POOL_N_BATCH, Request, SchedulerConfig
from potluck.engine.requests import prompt_ubatch as prompt_ubatch  # home was here)
from potluck.engine.spec import NO_SPEC, Drafter, SpecConfig
from potluck.errors import ContextError
from potluck.model.archs import hparams_from_metadata
from potluck.model.stage import DEFAULT_COMPUTE, Compute, SeqChunk, Stage
from potluck.modelfile.chat import ChatTemplate
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.hparams import HParams
from potluck.modelfile.lora import LoraAdapter, open_lora
from potluck.modelfile.tokenizer import Tokenizer
from potluck.sampling import Sampler

DEFAULT_CTX = 4096


def layer_ranges(n_layer: int, splits: Sequence[int]) -> list[tuple[int, int]]:
    """Half-open ranges from split points: splits (10, 20) over 30 layers -> [0,10) [10,20) [20,30)."""
    bounds = [0, *splits, n_layer]
    if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(
            f"split points {list(splits)} must increase strictly inside (0, {n_layer})"
        )
    return list(zip(bounds, bounds[1:], strict=False))


@dataclass
class Model:
    """A loaded model: shape, tokenizer, chat template and the pipeline that computes it."""

    path: Path
    file: GGUFFile
    hp: HParams
    tokenizer: Tokenizer
    chat: ChatTemplate
    pipeline: Pipeline
    n_ctx: int
    n_seq: int = 1  # sequences at once the pool's memory was planned for (serve's -np)
    adapters: tuple[str, ...] = ()  # LoRA adapters' names (file stems), in SeqChunk.lora's order
    _next_seq: int = field(default=0, repr=False)
    # (the scheduler's thread and an embedding request's take ids at once)
    _seq_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def close(self) -> None:
        """Let go of the pool: stop the heartbeat, close the links (no-op for a local model)."""
        self.pipeline.close()

    def new_seq_id(self) -> int:
        with self._seq_lock:
            self._next_seq += 1
            return self._next_seq

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one position over every attention layer (f16: the planner's measure)."""
        return self.hp.kv_bytes_per_token()

    @property
    def state_bytes(self) -> int:
        """A hybrid's recurrent state per sequence over every layer (0: none; then the stages
        can rewind a sequence and copy any prefix of it, else neither)."""
        return self.hp.state_bytes()

    def summary(self) -> str:
        name = self.file.metadata.get("general.name") or self.path.stem
        mem = sum(s.weight_bytes() for s in self.pipeline.stages) / 2**20
        return (
            f"{name} ({self.hp.arch}) · {self.file.quant_mix()} · {self.hp.n_layer} layers · "
            f"{mem:.0f} MiB of weights in memory · context {self.n_ctx}"
        )


@dataclass(frozen=True)
class Opened:
    """A model file opened and checked, before its pipeline exists: what a builder needs."""

    path: Path
    file: GGUFFile
    hp: HParams
    n_ctx: int
    adapters: tuple[LoraAdapter, ...]


# what builds a model's pipeline from the opened file: local stages (the default), or the pool's
# (potluck.pool.build, chosen by the composition root: the engine never builds a pool)
Build = Callable[[Opened], Pipeline]


def load_model(
    path: str | Path,
    n_ctx: int | None = None,
    splits: Sequence[int] = (),
    on_layer: Callable[[int], None] | None = None,
    n_seq: int = 1,
    loras: Sequence[tuple[Path, float]] = (),
    compute: Compute = DEFAULT_COMPUTE,
    build: Build | None = None,
) -> Model:
    """Open `path`, check it, and build its pipeline: `build`'s (a pool: potluck.pool.build), or
    one local stage, or in-process stages split at `splits`. n_seq: sequences at once (serve's
    -np), which a pool's nodes plan memory for. loras: (adapter file, scale) each, applied where a
    SeqChunk asks (modelfile/lora.py). compute: this machine's threads, KV cache type, repacking
    and GPU (the CLI's -t, -ngl, ...)."""
    gguf = GGUFFile(path)
    hp = hparams_from_metadata(gguf.metadata, str(path))
    adapters = tuple(open_lora(p, hp.arch, gguf.tensors, scale) for p, scale in loras)
    n_ctx = n_ctx or min(hp.n_ctx_train, DEFAULT_CTX)
    if n_ctx > hp.n_ctx_train:
        raise ContextError(
            f"context {n_ctx} is longer than the model was trained for ({hp.n_ctx_train}); use -c {hp.n_ctx_train} or less"
        )
    if n_ctx < 1:
        raise ContextError(f"context must be at least 1 token, got {n_ctx}")
    tokenizer = Tokenizer(gguf.metadata)
    chat = ChatTemplate.from_metadata(gguf.metadata, hp.arch)
    opened = Opened(Path(path), gguf, hp, n_ctx, adapters)
    pipe = build(opened) if build is not None else local_pipeline(opened, compute, splits, on_layer)
    names = tuple(a.name for a in adapters)
    return Model(Path(path), gguf, hp, tokenizer, chat, pipe, n_ctx, n_seq, names)


def local_pipeline(
    opened: Opened,
    compute: Compute = DEFAULT_COMPUTE,
    splits: Sequence[int] = (),
    on_layer: Callable[[int], None] | None = None,
) -> LocalPipeline:
    """Every layer in this process: one stage, or stages split at `splits`."""
    hp = opened.hp
    return LocalPipeline(
        [
            Stage(
                hp,
                opened.file,
                a,
                b,
                opened.n_ctx,
                on_layer,
                adapters=opened.adapters,
                compute=compute,
            )  # fmt: skip
            for a, b in layer_ranges(hp.n_layer, splits)
        ]
    )


def split_points(n_layer: int, shares: Sequence[float]) -> list[int]:
    """Layer boundaries giving each node a contiguous range in proportion to its share
    (llama.cpp's --tensor-split); every node gets at least one layer."""
    if len(shares) > n_layer or any(s <= 0 for s in shares):
        raise ValueError(
            f"shares {list(shares)} must be positive and at most {n_layer} (one layer each)"
        )
    total, acc, bounds = sum(shares), 0.0, list[int]()
    for s in shares[:-1]:
        acc += s
        b = round(n_layer * acc / total)
        b = max(b, (bounds[-1] if bounds else 0) + 1)
        bounds.append(min(b, n_layer - (len(shares) - len(bounds) - 1)))
    return bounds


def prompt_batch(model: Model, n_batch: int | None = None) -> int:
    """Prompt tokens per forward pass: `n_batch` when given (-b), else DEFAULT_N_BATCH on one
    machine and POOL_N_BATCH over a pool (micro-batches small enough to overlap in the stages)."""
    return n_batch or (POOL_N_BATCH if model.pipeline.depth > 1 else DEFAULT_N_BATCH)


def prefill(
    pipeline: Pipeline,
    seq_id: int,
    ids: Sequence[int],
    sampler: Sampler,
    n_batch: int = DEFAULT_N_BATCH,
) -> int:
    """Run the prompt through in micro-batches of n_batch tokens; the first sampled token.

    Every micro-batch is submitted at once: over a pool, stage k works on micro-batch i while
    stage k+1 works on micro-batch i-1 (nodes keep each sequence's batches in order)."""
    history = {seq_id: list(ids)}
    pending = []
    for i in range(0, len(ids), n_batch):
        part = np.array(ids[i : i + n_batch], np.int64)
        last = i + n_batch >= len(ids)
        samplers = {seq_id: sampler} if last else {}
        pending.append(pipeline.submit(part, [SeqChunk(seq_id, len(part))], samplers, history))
    return [f.result() for f in pending][-1][0]


def check_prompt(model: Model, prompt_ids: Sequence[int]) -> None:
    """A prompt one command can run: not empty, shorter than the context (ContextError saying
    what to do)."""
    if not prompt_ids:
        raise ContextError("the prompt is empty after tokenization; give some text")
    if len(prompt_ids) >= model.n_ctx:
        raise ContextError(
            f"prompt is {len(prompt_ids)} tokens but the context is {model.n_ctx}; "
            f"shorten the prompt or raise -c (the model allows up to {model.hp.n_ctx_train})"
        )


def generate(
    model: Model,
    prompt_ids: Sequence[int],
    max_tokens: int,
    sampler: Sampler,
    stop_ids: frozenset[int] | None = None,
    n_batch: int = DEFAULT_N_BATCH,
    spec: SpecConfig = NO_SPEC,
    drafter: Drafter | None = None,
) -> Generator[int, None, None]:
    """Yield up to max_tokens sampled ids (a stop id is yielded, then generation ends), through
    a scheduler of its own (engine/scheduler.py: the one decode loop, with its follow-up steps
    over a pool and its drafts with `spec`).

    Ends early without error when the context is full. The sequence's KV cache is freed when the
    iterator finishes or is closed.
    """
    from potluck.engine.scheduler import Scheduler, TokenEvent

    check_prompt(model, prompt_ids)
    if max_tokens <= 0:
        return
    stop = model.tokenizer.eot_ids if stop_ids is None else stop_ids
    params = dataclasses.replace(sampler.params, seed=sampler.seed)  # this sampler's draws
    config = SchedulerConfig(n_batch=n_batch, max_active=1, max_queue=0, spec=spec)
    sched = Scheduler(model, config, drafter, inline=True)
    try:
        for ev in sched.run_one(Request(tuple(prompt_ids), params, max_tokens, frozenset(stop))):
            if isinstance(ev, TokenEvent):
                yield ev.token
    finally:
        sched.close()
