"""The training loop: batches in a seeded order, AdamW on the adapters only, checkpoints that
resume bit-for-bit, and the adapter written as a GGUF LoRA file (modelfile/lora.py).

One step takes the next `batch` examples of the epoch's order (a permutation seeded by (seed,
epoch)), pads them to the longest, and minimises the mean cross-entropy of the learned tokens
(the sum over the batch's learned tokens / their count: every token weighs the same, however the
batch is split). Step s is epoch s // steps_per_epoch, position s % steps_per_epoch: so a run
resumed at step s from a checkpoint (adapters, optimizer state, step) takes exactly the steps
that the uninterrupted run would have taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from potluck.errors import PotluckError
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.hparams import HParams
from potluck.modelfile.lora import write_lora
from potluck.train.data import Example
from potluck.train.model import DEFAULT_TARGETS, LoraModel

CHECKPOINT_SUFFIX = ".ckpt"


class CheckpointError(PotluckError):
    """A checkpoint that does not belong to this run (another model, data or settings)."""


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    lr: float = 2e-4
    epochs: int = 1
    batch: int = 4
    ctx: int = 512
    seed: int = 0
    checkpoint_every: int = 50  # steps
    recompute: bool = False  # activation checkpointing (train/model.py): less memory, more compute


@dataclass(frozen=True)
class StepReport:
    step: int  # steps done, 1-based
    total: int
    epoch: int  # 0-based
    loss: float
    eval_loss: float | None  # at the end of each epoch (with --eval)
    tokens: int  # tokens (padded batch) this step computed
    seconds: float  # this step's wall time


def big_blocks_to_the_os() -> None:
    """glibc: every allocation of 1 MiB or more gets its own mapping, given back when freed.
    Training allocates and frees tens of megabytes per matrix per step (dequantized weights,
    activations); with glibc's sliding threshold they stay in the heap, fragmented: SmolLM2's
    steps peaked at 1.9 GiB instead of 1.5 (0.9 with recompute). No-op elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL(name).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


class Trainer:
    """Trains one LoraModel on `examples` (all of them: one process)."""

    def __init__(
        self,
        hp: HParams,
        f: GGUFFile,
        examples: Sequence[Example],
        config: TrainConfig,
        evals: Sequence[Example] = (),
    ) -> None:
        self.hp, self.f, self.examples, self.config, self.evals = hp, f, examples, config, evals
        big_blocks_to_the_os()
        torch.manual_seed(config.seed)
        self.model = LoraModel(
            hp, f, config.targets, config.rank, config.alpha, config.seed, config.recompute
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=0.0)
        self.steps_per_epoch = math.ceil(len(examples) / config.batch)
        self.total = self.steps_per_epoch * config.epochs
        self.step = 0  # steps done

    # -- one step --------------------------------------------------------------------------------
    def batch_of(self, step: int) -> list[Example]:
        epoch, i = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.config.seed, epoch]).permutation(len(self.examples))
        b = self.config.batch
        return [self.examples[j] for j in order[i * b : (i + 1) * b]]

    def train_step(self) -> StepReport:
        t0 = time.perf_counter()
        batch = self.batch_of(self.step)
        n = sum(e.n_learned for e in batch)
        loss = self.gradients(batch, n)  # every parameter's .grad: d(summed loss / n)
        self.opt.step()
        self.applied()
        self.step += 1
        epoch = (self.step - 1) // self.steps_per_epoch
        end_of_epoch = self.step % self.steps_per_epoch == 0
        ev = self.eval_loss() if self.evals and end_of_epoch else None
        tokens = len(batch) * max(len(e.ids) for e in batch)
        return StepReport(
            self.step, self.total, epoch, loss, ev, tokens, time.perf_counter() - t0
        )  # fmt: skip

    def gradients(self, batch: Sequence[Example], n_learned: int) -> float:
        """Set each parameter's .grad for one step's batch; the loss (summed over the batch's
        learned tokens / n_learned). Here: the whole batch in this process."""
        self.opt.zero_grad(set_to_none=True)
        ids, learn = collate(batch)
        loss = self.model.loss_sum(ids, learn) / max(n_learned, 1)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        return float(loss.detach())

    def applied(self) -> None:
        """After the optimizer's step (a pool: every node takes the same one)."""

    def checkpoint(self, path: Path) -> None:
        self.save(path)

    def close(self) -> None:
        """Let go of whatever the run holds besides this process (a pool's sessions)."""

    def eval_loss(self, examples: Sequence[Example] | None = None) -> float:
        """Mean cross-entropy per learned token over `examples` (default: the eval set)."""
        examples = self.evals if examples is None else examples
        total, n = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(examples), self.config.batch):
                ids, learn = collate(examples[i : i + self.config.batch])
                total += float(self.model.loss_sum(ids, learn))
                n += int(learn[:, 1:].sum())
        return total / max(n, 1)

    # -- checkpoints -----------------------------------------------------------------------------
    def identity(self) -> dict[str, object]:
        """What a checkpoint must match to be resumed by this run."""
        return {
            "model": str(self.f.path.resolve()),
            "model_bytes": self.f.size_bytes,
            "examples": [(e.line, len(e.ids)) for e in self.examples],
            "config": {
                k: v for k, v in dataclasses.asdict(self.config).items() if k != "checkpoint_every"
            },  # fmt: skip
        }

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        state = {"identity": self.identity(), "step": self.step,
                 "adapters": self.model.state_dict(), "optimizer": self.opt.state_dict()}  # fmt: skip
        torch.save(state, tmp)
        os.replace(tmp, path)  # whole or not at all

    def load(self, path: Path) -> None:
        state = torch.load(path, weights_only=True)
        mine = self.identity()
        theirs = state.get("identity", {})
        for key in ("model", "model_bytes", "config", "examples"):
            if theirs.get(key) != mine[key]:
                raise CheckpointError(
                    f"checkpoint {path} was made for another {_what[key]}: "
                    f"{_short(theirs.get(key))} (this run: {_short(mine[key])}); "
                    "run with the same settings, or delete it to start over"
                )
        self.model.load_state_dict(state["adapters"])
        self.opt.load_state_dict(state["optimizer"])
        self.step = int(state["step"])

    def write_adapter(self, out: Path) -> None:
        write_lora(out, self.hp.arch, self.config.alpha, self.model.lora_pairs())


_what = {"model": "model", "model_bytes": "model file", "config": "set of settings",
         "examples": "training data"}  # fmt: skip


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) < 120 else text[:117] + "..."


def collate(batch: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, T) padded with 0 to the longest, learn (B, T) 0/1 (padding never learned)."""
    width = max(len(e.ids) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    learn = torch.zeros(len(batch), width, dtype=torch.long)
    for r, e in enumerate(batch):
        ids[r, : len(e.ids)] = torch.tensor(e.ids)
        learn[r, : len(e.ids)] = torch.tensor(e.learn, dtype=torch.long)
    return ids, learn


def run(
    trainer: Trainer,
    out: Path,
    on_step: Callable[[StepReport], None] = lambda r: None,
    stop_after: int | None = None,
) -> None:
    """Train to the end (from trainer.step), checkpointing to OUT.ckpt every checkpoint_every
    steps; write the adapter to `out` at the end and remove the checkpoint. stop_after: stop
    (after a checkpoint) once that many steps are done (tests: an interrupted run)."""
    ckpt = out.with_name(out.name + CHECKPOINT_SUFFIX)
    every = trainer.config.checkpoint_every
    try:
        while trainer.step < trainer.total:
            on_step(trainer.train_step())
            if trainer.step % every == 0 or trainer.step == stop_after:
                trainer.checkpoint(ckpt)
            if stop_after is not None and trainer.step >= stop_after:
                return
    finally:
        trainer.close()
    trainer.write_adapter(out)
    ckpt.unlink(missing_ok=True)


def memory_needed(
    hp: HParams, f: GGUFFile, config: TrainConfig, longest: int, n_examples: int
) -> int:
    """Bytes a step needs beyond the mapped model, roughly: the activations autograd keeps for
    `batch` sequences of `longest` tokens (with recompute: each layer's input, and one layer's
    activations), the logits and their gradient, two dequantized matrices at once, and the
    adapters with their gradients and AdamW's two moments."""
    B, T = min(config.batch, n_examples), longest
    D, F_, H = hp.n_embd, hp.n_ff, hp.n_head
    # what one layer keeps per token (measured on SmolLM2: ≈ 56 KiB at D 576, F 1536, H·hd 576)
    per_token = 4 * (10 * D + 4 * F_ + 4 * H * hp.head_dim)
    scores = 4 * 3 * B * H * T * T  # attention weights (and their gradient)
    layer = B * T * per_token + scores
    acts = (hp.n_layer * B * T * D * 4 + layer) if config.recompute else hp.n_layer * layer
    logits = 4 * 3 * B * T * hp.n_vocab
    matrices = [t for t in f.tensors.values() if len(t.shape) == 2]
    biggest = 2 * 4 * max(t.shape[0] * t.shape[1] for t in matrices)
    params = sum(
        config.rank * sum(f.tensors[f"blk.{i}.{t}.weight"].shape)
        for i in range(hp.n_layer)
        for t in config.targets
    )
    return acts + logits + biggest + 16 * params
