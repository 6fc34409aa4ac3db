"""The head's side of a pool: an optional local first stage, then a chain of remote stages.

The head sends token ids (or, with a local first stage, hidden states) to the first remote node;
each node forwards to the next; the last samples, and only token ids come back.

One class, RemotePipeline, and the plan id it carries; over 400 lines on purpose (loading, shipping
weights, the forward path and letting go share the pipeline's state).
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from potluck.engine.chain import submit_after
from potluck.engine.contract import LOCAL, Assignment, Held, NodeStatus
from potluck.errors import PotluckError
from potluck.model.layout import stage_tensor_names
from potluck.model.stage import DEFAULT_COMPUTE, Compute, SeqChunk, Stage
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.hparams import HParams
from potluck.modelfile.lora import LoraAdapter, adapter_part
from potluck.node.transfer import PULL_TIMEOUT_S, push_chunks
from potluck.node.weights import sha256_file, tensor_digests
from potluck.sampling import Accepted, Sampler, Token
from potluck.transport.auth import PoolAuth
from potluck.transport.client import NodeClient, NodeError
from potluck.transport.codec import (
    PROTOCOL_VERSION,
    WIRE_DTYPES,
    forward_request,
    load_request,
    seq_chunks,
    tensor_from_proto,
)

if TYPE_CHECKING:  # replies are read here; requests are built in transport/codec.py
    from potluck.transport import potluck_pb2 as pb

# This process as a head: its plans give way to each other on a node, never to another head's
# live one (node/plans.py); two processes with the same model and split get different plan ids.
HEAD_ID = secrets.token_hex(8)
LOAD_TIMEOUT_S = 300.0  # a node's Load of weights it has (seconds)
RELEASE_WAIT_S = 1.0  # longest a closing head waits for the nodes to free its plan (seconds)


def status_of(address: str, reply: pb.HelloReply) -> NodeStatus:
    """A node's name and memory from its Hello."""
    memory = reply.devices[0].memory_bytes if reply.devices else 0
    return NodeStatus(reply.node_name or address, int(memory), True)


def held_of(reply: pb.LoadReply) -> Held:
    """What a node's LoadReply says it holds."""
    return Held(
        weight_bytes=reply.weight_bytes,
        kv_bytes=reply.kv_bytes,
        rss_bytes=reply.rss_bytes,
        load_seconds=reply.load_seconds,
        pulled_from=reply.pulled_from,
        pulled_bytes=reply.pulled_bytes,
        pull_seconds=reply.pull_seconds,
    )


def plan_id_of(
    model_sha: str,
    assignments: Sequence[Assignment],
    n_ctx: int,
    epoch: int = 0,
    head_id: str = "",
) -> str:
    """The id every message of a plan carries; `epoch` > 0 after a failover, so that a node never
    mixes the caches of a plan it held before with the replayed ones; `head_id` (random per opened
    process) keeps two heads with the same model and split apart (their sequence ids would collide
    in one stage, and one's Load would replace the other's caches)."""
    text = (
        head_id
        + "|"
        + model_sha
        + "|"
        + ";".join(
            f"{a.node}:{a.start}-{a.stop}/{a.n_gpu_layers}"
            + (f"/{a.ram_experts}" * bool(a.ram_experts))
            for a in assignments
        )
        + f"|{n_ctx}"
        + (f"|{epoch}" if epoch else "")
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RemotePipeline:
    """Runs a plan whose first assignment may be local and whose others are remote nodes, in order."""

    supports_logprobs = True  # the last stage sends each sampled token's logprobs when asked

    def __init__(
        self,
        file: GGUFFile,
        hp: HParams,
        assignments: Sequence[Assignment],
        n_ctx: int,
        wire_dtype: str = "float32",
        auth: PoolAuth | None = None,
        epoch: int = 0,
        on_transfer: Callable[[str, int, int], None] | None = None,
        head_id: str = "",
        n_seq: int = 1,
        adapters: Sequence[LoraAdapter] = (),
        compute: Compute = DEFAULT_COMPUTE,
        cache: Path | None = None,
    ) -> None:
        """adapters: LoRA adapters, each node getting the part for its own layers (LoadRequest).
        compute: how this machine computes a first stage it holds (threads, GPU, ...). cache:
        where the model's file and tensor hashes are remembered (Places.cache; None: hashed
        each time).
        on_transfer(node, bytes sent, bytes to send) reports weights shipped to a node that
        lacks the model file. head_id: who loads the plan (this process by default): a node lets
        that head's older plans go first when it needs room. n_seq: sequences at once (serve's
        -np), each up to n_ctx: what each node counts KV memory for."""
        self.n_seq = n_seq
        self.on_transfer = on_transfer
        if any(a.node == LOCAL for a in assignments[1:]):
            raise ValueError("only the first stage can run on this machine")
        if assignments[0].node == LOCAL and len(assignments) == 1:
            raise ValueError("a plan with no remote node is a LocalPipeline")
        self.file, self.hp, self.assignments, self.n_ctx = file, hp, list(assignments), n_ctx
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {wire_dtype!r}: use one of {', '.join(WIRE_DTYPES)}")
        self.wire = wire_dtype
        self.cache = cache
        self.model_sha = sha256_file(file.path, cache)
        self.adapters = list(adapters)
        self.head_id = head_id or HEAD_ID
        with_adapters = self.model_sha + "".join(sha256_file(a.path, cache) for a in self.adapters)
        self.plan_id = plan_id_of(with_adapters, self.assignments, n_ctx, epoch, self.head_id)
        self.local: Stage | None = None
        if assignments[0].node == LOCAL:
            a = assignments[0]
            self.local = Stage(
                hp, file, a.start, a.stop, n_ctx, n_gpu_layers=a.n_gpu_layers, adapters=adapters,
                compute=compute, ram_experts=a.ram_experts,
            )  # fmt: skip
        remotes = [a for a in self.assignments if a.node != LOCAL]
        self.auth = auth  # the pool secret and TLS: how this head proves membership to nodes
        self.clients = [NodeClient(a.node, auth) for a in remotes]
        loaded: list[NodeClient] = []
        self.held: dict[str, Held] = {}  # per node: what it holds once loaded
        self.node_status: dict[str, NodeStatus] = {}  # per node: its Hello when it was loaded
        try:
            self._load_nodes(file, hp, remotes, n_ctx, wire_dtype, loaded)
        except BaseException:  # a node refused or failed: the ones loaded so far let it go
            for client in loaded:
                self._release(client)
            for client in self.clients:
                client.close()
            raise
        self.last_stage_ms: list[float] = []
        self.last_hop_ms: list[float] = []
        self._lock = threading.Lock()
        self._pos: dict[int, int] = {}  # tokens of each sequence sent down the chain so far
        # the sampler whose settings each sequence's last stage was sent (a sequence is opened
        # once per request: later steps carry no settings; a new request's sampler opens it again)
        self._opened: dict[int, Sampler] = {}
        # the local first stage computes on one thread, in submission order
        self._local_thread = ThreadPoolExecutor(1, thread_name_prefix="potluck-local-stage")

    def _adapter_parts(self, names: set[str]) -> list[tuple[str, float, bytes]]:
        """Each adapter cut to a stage's tensors (`names`): (name, scale, bytes of a small
        adapter GGUF)."""
        parts = []
        for a in self.adapters:
            with tempfile.TemporaryDirectory(prefix="potluck-lora-") as tmp:
                path = Path(tmp) / "part.gguf"
                adapter_part(a, names, path)
                parts.append((a.name, a.scale, path.read_bytes()))
        return parts

    def _load_nodes(
        self,
        file: GGUFFile,
        hp: HParams,
        remotes: Sequence[Assignment],
        n_ctx: int,
        wire_dtype: str,
        loaded: list[NodeClient],
    ) -> None:
        """Hello every node (protocol, data port), then Load each its stage, shipping the tensors
        a node lacks; `loaded` collects the nodes that hold the plan."""
        for client in self.clients:
            reply = client.hello("head")
            if reply.protocol_version != PROTOCOL_VERSION:
                raise NodeError(
                    f"node {client.address} speaks protocol {reply.protocol_version}, this head {PROTOCOL_VERSION}"
                )
            self.node_status[client.address] = status_of(client.address, reply)
            client.use_data_port()  # the forward path's fast lane, if the node's port is reachable
        header = file.header_bytes()

        def load_one(i: int) -> None:
            a, client = remotes[i], self.clients[i]
            nxt = remotes[i + 1].node if i + 1 < len(remotes) else ""
            names = stage_tensor_names(file.tensors.values(), hp.n_layer, a.start, a.stop)
            digests = tensor_digests(self.model_sha, file.raw, names, self.cache)
            req = load_request(
                plan_id=self.plan_id, model_sha256=self.model_sha, start=a.start, stop=a.stop, n_ctx=n_ctx,
                next_hop=nxt, metadata_gguf=header, tensor_sha256=digests, wire_dtype=wire_dtype,
                model_bytes=file.size_bytes, head_id=self.head_id, n_gpu_layers=a.n_gpu_layers,
                tensor_sources=[p for p in a.sources if p != a.node], n_seq=self.n_seq,
                adapters=self._adapter_parts(set(names)), ram_experts=a.ram_experts,
            )  # fmt: skip
            # a node that pulls its layers from a peer does it within Load: as long as a push
            reply = client.load(req, LOAD_TIMEOUT_S if not a.sources else PULL_TIMEOUT_S)
            if reply.need_tensors:
                chunks = self._tensor_chunks(
                    a.node, list(reply.missing), digests, dict(reply.partial)
                )
                client.put_tensors(chunks)
                reply = client.load(req)
                if reply.need_tensors:
                    raise NodeError(
                        f"node {a.node} still lacks {len(reply.missing)} tensors after the transfer"
                    )
            self.held[a.node] = held_of(reply)
            loaded.append(client)

        # every node loads (and receives its tensors) at once: a 14B's halves take seconds each
        with ThreadPoolExecutor(len(remotes), thread_name_prefix="potluck-load") as pool:
            futures = [pool.submit(load_one, i) for i in range(len(remotes))]
        for f in futures:
            f.result()  # the first node's error, after every load has ended

    def _tensor_chunks(
        self,
        node: str,
        names: list[str],
        digests: Mapping[str, str],
        partial: Mapping[str, int] | None = None,
    ) -> Iterator[pb.TensorChunk]:
        on_sent = None
        if self.on_transfer is not None:
            report = self.on_transfer

            def on_sent(sent: int, total: int) -> None:
                report(node, sent, total)

        return push_chunks(self.file, node, names, digests, partial, on_sent)

    def _start(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        wire_chunks: list[pb.SeqChunk],
        want_logits: bool,
        after: Future[list[int]] | None = None,
        stop_ids: Sequence[int] = (),
        hidden: bool = False,
    ) -> Future[pb.ForwardReply]:
        """Send one batch down the chain without waiting. Each chunk gets its position in its
        sequence, so that nodes compute a sequence's batches in order even when several batches
        are in flight; the local first stage (if any) runs on its own thread, in submission order.
        after: for a follow-up batch, the previous step (its reply's time starts the first hop's)."""
        with self._lock:
            for c, w in zip(chunks, wire_chunks, strict=True):
                held = self._pos.get(w.seq_id, 0)
                if c.fork is not None:  # the first pos positions of another sequence
                    w.fork, w.fork_from = True, c.fork
                    w.pos = c.pos
                elif 0 <= c.pos < held:  # the head rewound the sequence
                    w.rewind, w.pos = True, c.pos
                elif c.pos > held:
                    raise ValueError(
                        f"sequence {c.seq_id} has {held} positions on the pool, a chunk came "
                        f"for position {c.pos}"
                    )
                else:
                    w.pos = held
                self._pos[w.seq_id] = w.pos + w.n
        out: Future[pb.ForwardReply] = Future()

        def remote(x: np.ndarray, local_ms: list[float]) -> None:
            wire_dtype = self.wire if self.local else None
            req = forward_request(
                self.plan_id, wire_chunks, x, wire_dtype, want_logits, stop_ids, hidden
            )
            t1 = time.perf_counter()
            began = [t1]  # a follow-up batch starts on the pool when the previous reply is out
            if after is not None:
                after.add_done_callback(lambda _: began.append(time.perf_counter()))

            def done(f: Future[pb.ForwardReply]) -> None:
                exc = f.exception()
                if exc is not None:
                    out.set_exception(exc)
                    return
                reply = f.result()
                wall = (time.perf_counter() - max(began)) * 1e3
                # a follow-up step starts on the first node before the head hears of the token
                # it follows: its head -> node hop is off the path, and this difference can go
                # below 0 (it did, -18 ms, on the 14B): 0 then
                first_hop = max(0.0, wall - sum(reply.stage_ms) - sum(reply.hop_ms))
                self.last_stage_ms = local_ms + list(reply.stage_ms)
                self.last_hop_ms = [first_hop, *reply.hop_ms]
                out.set_result(reply)

            self.clients[0].link.send(req).add_done_callback(done)

        if self.local is None:
            remote(tokens, [])
            return out
        local = self.local

        def run_local() -> None:
            t0 = time.perf_counter()
            try:
                x = local(tokens, chunks)
            except Exception as exc:  # handed to the caller through the future
                out.set_exception(exc)
                return
            remote(x, [(time.perf_counter() - t0) * 1e3])

        self._local_thread.submit(run_local)
        return out

    def submit(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> Future[list[int]]:
        """Start one forward of the chunks through every stage; its future gives one sampled token
        per chunk (-1 for a chunk whose sequence has no sampler here: an earlier prompt
        micro-batch)."""
        wire = seq_chunks(chunks, samplers, histories, opened=self._open(samplers, chunks))
        return self._tokens_of(self._start(tokens, chunks, wire, False), chunks, samplers)

    def _open(self, samplers: Mapping[int, Sampler], chunks: Sequence[SeqChunk]) -> set[int]:
        """Of the batch's sequences with a sampler, those whose last stage has this very sampler
        already; the others count as opened from this batch on (it carries their settings). Only
        the batch's own: a sequence of `samplers` with no chunk here gets no settings from it
        (marked opened anyway, its next batch went without them: the last stage refused it)."""
        present = {c.seq_id for c in chunks if c.seq_id in samplers}
        with self._lock:
            known = {q for q in present if self._opened.get(q) is samplers[q]}
            self._opened.update({q: samplers[q] for q in present})
        return known

    @property
    def chains(self) -> bool:
        """Whether `submit_next` starts on the pool without this machine (the first stage is a node,
        which takes the token from the reply it relays)."""
        return self.local is None

    def submit_next(
        self,
        prev: Future[list[int]],
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
        stop_ids: Collection[int] = frozenset(),
    ) -> Future[list[int]]:
        """The decode step after `prev` (one chunk of one token): its input id is the token `prev`
        samples, and the first node starts it as soon as it relays that token, while this machine
        is still receiving it. Gives [] (nothing computed) when that token is in `stop_ids`.
        `histories` are the ids before prev's token."""
        if self.local is not None:  # the first stage is here: nothing to gain on the pool
            return submit_after(self, prev, chunks, samplers, histories, stop_ids)
        if len(chunks) != 1 or chunks[0].n != 1:
            raise ValueError(f"a follow-up step is one chunk of one token, got {list(chunks)}")
        wire = seq_chunks(chunks, samplers, histories, follow=True)
        placeholder = np.zeros(1, np.int64)
        return self._tokens_of(
            self._start(placeholder, chunks, wire, False, after=prev, stop_ids=sorted(stop_ids)),
            chunks,
            samplers,
        )

    @staticmethod
    def _tokens_of(
        pending: Future[pb.ForwardReply],
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
    ) -> Future[list[int]]:
        """The sampled tokens of a batch's reply (`Token`s where the sampler asked for logprobs);
        [] for a skipped follow-up batch."""
        out: Future[list[int]] = Future()
        asked = [
            c.seq_id in samplers and samplers[c.seq_id].params.logprobs is not None for c in chunks
        ]

        def done(f: Future[pb.ForwardReply]) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            reply = f.result()
            if reply.skipped:
                out.set_result([])
                return
            if reply.runs:  # drafted chunks: each one's tokens (no logprobs: none are drafted)
                out.set_result(
                    [
                        Accepted(run.tokens) if run.tokens else t
                        for t, run in zip(reply.tokens, reply.runs, strict=True)
                    ]
                )
                return
            if not reply.logprobs:
                out.set_result(list(reply.tokens))
                return
            out.set_result(
                [
                    Token(t, lp, tuple(zip(top.ids, top.logprobs, strict=True)))
                    if t >= 0 and a
                    else t
                    for t, lp, top, a in zip(
                        reply.tokens, reply.logprobs, reply.top, asked, strict=True
                    )
                ]
            )

        pending.add_done_callback(done)
        return out

    def step(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> list[int]:
        """`submit` and wait."""
        return self.submit(tokens, chunks, samplers, histories).result()

    @property
    def depth(self) -> int:
        return len(self.assignments)

    def forward(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        logits_rows: np.ndarray | None = None,
        hidden: bool = False,
    ) -> np.ndarray:
        """Logits of every row (perplexity), selected by logits_rows (default: last of each chunk);
        hidden: the rows' final hidden states instead (embeddings)."""
        wire = seq_chunks(chunks, {}, {})
        reply = self._start(tokens, chunks, wire, True, hidden=hidden).result()
        logits = tensor_from_proto(reply.logits, max_elements=1 << 31)
        if logits_rows is None:
            logits_rows = np.cumsum([c.n for c in chunks]) - 1
        return np.asarray(logits[logits_rows])

    def drop(self, seq_id: int) -> None:
        with self._lock:
            self._pos.pop(seq_id, None)
            self._opened.pop(seq_id, None)
        if self.local is not None:
            # abandoned (a failover, or the pool lost with failover off): the stage goes with this
            # pipeline; a forward may still be running on it, so it is not touched from here. The
            # hang-up may come before this call (RuntimeError: shut down) or while it waits in the
            # queue (CancelledError): either way there is nothing left to free
            with contextlib.suppress(RuntimeError, CancelledError):
                self._local_thread.submit(self.local.drop, seq_id).result()
        with contextlib.suppress(PotluckError):  # a node that is gone took its caches with it
            self.clients[0].drop_sequences(self.plan_id, [seq_id])

    @property
    def nodes(self) -> list[str]:
        """The remote nodes of this plan (host:port), in pipeline order."""
        return [c.address for c in self.clients]

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every batch still in flight (a node was declared gone: its replies never come)."""
        for client in self.clients:
            client.link.fail_all(exc)

    def close(self) -> None:
        """Free the plan's stages on the nodes (the first passes it down the chain) and hang up."""
        self._release(self.clients[0])
        self.abandon()

    def _release(self, client: NodeClient) -> None:
        """Ask a node to free this plan (best effort, at most RELEASE_WAIT_S: a node that is gone
        frees it by itself after its idle timeout)."""
        with contextlib.suppress(PotluckError):
            client.release(self.plan_id, timeout=RELEASE_WAIT_S)

    def abandon(self) -> None:
        """Hang up without a word to the nodes (a failover: the first may be the one that hangs;
        the next plan's Load lets this head's older plans go)."""
        for client in self.clients:
            client.close()
        self._local_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def stages(self) -> list[Stage]:
        return [self.local] if self.local is not None else []
