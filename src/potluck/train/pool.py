"""Data-parallel LoRA training over the pool: the head and its workers each compute the gradient
of a share of every global batch; the head sums them (in a fixed order) and every node takes the
same AdamW step, so all hold the same adapters after each step.

Gradients of the adapters only (megabytes) cross the pool's own authenticated gRPC links (the
pool secret admits a node; TLS where the pool uses it), reduced at the head: a star, which a home
pool of two or three machines does not outgrow, and which loses nothing when a node goes away.
A node that fails mid-step has its share computed here (the step is the same), is dropped, and is
asked to join again at the next checkpoint (the state travels with TrainOpen).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from potluck.errors import PotluckError
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.hparams import HParams
from potluck.node.training import set_grads, state_bytes
from potluck.node.transfer import push_chunks
from potluck.node.weights import sha256_file, tensor_digests
from potluck.train.data import Example
from potluck.train.loop import TrainConfig, Trainer, memory_needed
from potluck.transport.client import NodeClient, NodeError
from potluck.transport.codec import add_model_file, train_open_request

if TYPE_CHECKING:
    from potluck.transport import potluck_pb2 as pb

log = logging.getLogger(__name__)
HEAD = "this machine"


class PoolTrainer(Trainer):
    """A Trainer whose steps are shared with `nodes` (addresses; dial(address) connects, again
    after a node went away: a fresh connection, not one in backoff). head_share: whether
    this machine computes a share too (--mem 0: it only sums). on_event(text): what happened to
    a node (gone, back). cache: where the model's hashes are remembered (Places.cache; None:
    hashed each time)."""

    def __init__(
        self,
        hp: HParams,
        f: GGUFFile,
        examples: Sequence[Example],
        config: TrainConfig,
        evals: Sequence[Example],
        nodes: Sequence[str],
        dial: Callable[[str], NodeClient],
        head_share: bool = True,
        on_event: Callable[[str], None] = lambda text: None,
        cache: Path | None = None,
    ) -> None:
        super().__init__(hp, f, examples, config, evals)
        self.dial, self.head_share, self.on_event = dial, head_share, on_event
        self.nodes = {a: dial(a) for a in nodes}
        self.session = uuid.uuid4().hex
        self.cache = cache
        self.sha = sha256_file(f.path, cache)
        self.alive: list[str] = []
        self.dropped: list[str] = []
        self._refused: dict[str, str] = {}  # why a node could not open a session, last time
        self._total = b""  # the last step's summed gradient (for TrainApply)
        self._tensor_sha: dict[str, str] = {}  # for a node without the file (_open_session)
        self.pool = ThreadPoolExecutor(max(1, len(nodes)), thread_name_prefix="potluck-train")

    # -- membership ------------------------------------------------------------------------------
    def start(self) -> None:
        """Open a session on every node (its state: this process's, at self.step)."""
        for address in self.nodes:
            self._open(address)
        if not self.alive and not self.head_share:
            raise PotluckError(
                "no worker could take part in the training, and --mem 0 keeps it off this machine"
            )

    def _open(self, address: str) -> bool:
        request = train_open_request(
            session_id=self.session, model_sha256=self.sha, model_bytes=self.f.size_bytes,
            rank=self.config.rank, alpha=self.config.alpha, targets=list(self.config.targets),
            lr=self.config.lr, seed=self.config.seed, step=self.step,
            state=state_bytes(self.model, self.opt), recompute=self.config.recompute,
            need_bytes=self.share_bytes(),
        )  # fmt: skip
        try:
            self._open_session(address, request)
        except PotluckError as exc:
            if address in self.dropped and self._refused.get(address) != str(exc):
                self.on_event(f"{address} answers but cannot join at step {self.step}: {exc}")
            self._refused[address] = str(exc)  # said once per reason
            self._drop(address, f"could not open a training session: {exc}")
            return False
        if address in self.dropped:
            self.dropped.remove(address)
            self.on_event(f"{address} joins again at step {self.step}")
        self.alive = sorted({*self.alive, address})
        return True

    def share_bytes(self) -> int:
        """What a step of one node's share needs at most: a batch cut over this machine and
        one node (the fewest members a node can share with)."""
        members = 2 if self.head_share else 1
        share = dataclasses.replace(self.config, batch=-(-self.config.batch // members))
        longest = max(len(e.ids) for e in self.examples)
        return memory_needed(self.hp, self.f, share, longest, len(self.examples))

    def _open_session(self, address: str, request: pb.TrainOpenRequest) -> None:
        """TrainOpen; a node without the model file gets the header and the tensor digests,
        then the tensors it lacks (PutTensors: kept by hash, resumable), then opens again."""
        client = self.nodes[address]
        reply = client.train_open(request)
        if reply.need_model:
            add_model_file(request, self.f.header_bytes(), self._digests())
            reply = client.train_open(request)
        if reply.need_tensors:
            missing = list(reply.missing)
            if unknown := [n for n in missing if n not in self.f.tensors]:
                raise NodeError(f"node {address} asks for tensors the model lacks: {unknown[:3]}")
            size = sum(self.f.tensors[n].nbytes for n in missing) - sum(reply.partial.values())
            self.on_event(
                f"{address} has no copy of the model: sending it {len(missing)} tensors, "
                f"{size / 2**20:.0f} MiB"
            )
            digests = self._digests()
            client.put_tensors(push_chunks(self.f, address, missing, digests, dict(reply.partial)))
            reply = client.train_open(request)
            if reply.need_tensors:
                raise NodeError(f"node {address} still lacks {len(reply.missing)} tensors")

    def _digests(self) -> dict[str, str]:
        if not self._tensor_sha:
            self._tensor_sha = tensor_digests(
                self.sha, self.f.raw, list(self.f.tensors), self.cache
            )
        return self._tensor_sha

    def _drop(self, address: str, why: str) -> None:
        if address in self.alive:
            self.alive.remove(address)
        if address not in self.dropped:
            self.dropped.append(address)
            self.on_event(f"{address} left the training at step {self.step}: {why}")

    def checkpoint(self, path: Path) -> None:
        super().checkpoint(path)
        for address in list(self.dropped):  # a node that came back joins here
            self.nodes[address].close()
            self.nodes[address] = self.dial(address)
            try:  # a fresh channel to a busy machine: generous, but a node that is down
                self.nodes[address].hello(timeout=10.0)  # answers at once (connection refused)
            except PotluckError:
                continue
            self._open(address)

    def close(self) -> None:
        for address in self.alive:
            with contextlib.suppress(PotluckError):  # it frees the session when it restarts
                self.nodes[address].train_close(self.session)
        self.pool.shutdown(wait=False)
        for client in self.nodes.values():
            client.close()

    # -- one step --------------------------------------------------------------------------------
    def shares(self, batch: Sequence[Example]) -> list[tuple[str, list[Example]]]:
        """The batch cut into consecutive parts, one per member (this machine first), in order."""
        owners = ([HEAD] if self.head_share or not self.alive else []) + list(self.alive)
        cuts = np.array_split(np.arange(len(batch)), len(owners))
        return [
            (o, [batch[i] for i in idx]) for o, idx in zip(owners, cuts, strict=True) if len(idx)
        ]

    def _here(self, part: list[Example], n_learned: int) -> tuple[float, torch.Tensor]:
        """A share's loss and flat gradient, computed in this process."""
        loss = super().gradients(part, n_learned)
        return loss, torch.cat(
            [cast(torch.Tensor, p.grad).reshape(-1) for p in self.model.parameters()]
        )

    def gradients(self, batch: Sequence[Example], n_learned: int) -> float:
        parts = self.shares(batch)
        asked = {
            owner: self.pool.submit(self._remote, owner, part, n_learned)
            for owner, part in parts
            if owner != HEAD
        }
        results: list[tuple[float, torch.Tensor]] = []
        for owner, part in parts:
            if owner == HEAD:
                results.append(self._here(part, n_learned))
                continue
            try:
                results.append(asked[owner].result())
            except PotluckError as exc:
                self._drop(owner, str(exc))
                results.append(self._here(part, n_learned))  # its share, done here: same step
        total = results[0][1].clone()
        for _, g in results[1:]:
            total += g
        params = list(self.model.parameters())
        self._total = total.numpy().astype(np.float32).tobytes()
        set_grads(params, self._total)
        return sum(loss for loss, _ in results)

    def _remote(
        self, owner: str, part: list[Example], n_learned: int
    ) -> tuple[float, torch.Tensor]:
        sequences = [(e.ids, e.learn) for e in part]
        reply = self.nodes[owner].train_grad(self.session, self.step, n_learned, sequences)
        n = sum(p.numel() for p in self.model.parameters())
        if len(reply.grads) != 4 * n:
            raise NodeError(
                f"node {owner} sent a gradient of {len(reply.grads)} bytes, the adapters have "
                f"{n} values ({4 * n} bytes): another Potluck version?"
            )
        return reply.loss_sum, torch.from_numpy(np.frombuffer(reply.grads, np.float32).copy())

    def applied(self) -> None:
        sent = {
            a: self.pool.submit(self.nodes[a].train_apply, self.session, self.step, self._total)
            for a in self.alive
        }
        for address, fut in sent.items():
            try:
                fut.result()
            except PotluckError as exc:
                self._drop(address, str(exc))


__all__ = ["HEAD", "PoolTrainer"]
