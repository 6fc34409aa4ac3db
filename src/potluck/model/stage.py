"""A stage: the layers [start, stop) of a model on ggml, with its own KV caches.

The weights are the model file's tensors mapped in place (model/weights.py) under their GGUF
names (`token_embd.weight`, `blk.12.attn_q.weight`, ...); a stage keeps global layer indices.
The first stage embeds token ids; the others take hidden states; the last one ends in the output
head and returns logits for the rows asked for. Several sequences go through one call: their
tokens are concatenated for the matmuls, attention runs per sequence against its own cache.
One graph is built per step shape and reused while the shape repeats (model/graph.py).

One class over one stage's ggml state (weights, backends, scheduler, caches, graph); over 400 lines
on purpose.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from potluck.errors import UnsupportedError
from potluck.model.archs import layer_tensors
from potluck.model.archs.common import is_routed
from potluck.model.ggml_lib import BackendError, Device, gpu_device, lib
from potluck.model.graph import Lora, StepGraph, StepShape
from potluck.model.kv_cache import CACHE_TYPES, SeqCache, cache_bytes
from potluck.model.weights import SUPPORTED_TYPES, Weights, WeightSource, check
from potluck.modelfile.hparams import HParams
from potluck.modelfile.lora import LoraAdapter

__all__ = [
    "DEFAULT_COMPUTE",
    "SUPPORTED_TYPES",
    "Compute",
    "GpuConfig",
    "SeqChunk",
    "Stage",
    "WeightSource",
    "check",
]

_SCHED_GRAPH_SIZE = 1 << 16  # the most graph nodes a stage's scheduler plans for
# ggml's Vulkan backend (0.25.3) keeps state between graphs that can point into a KV buffer freed
# since: after a sequence is dropped (or its cache grows) the next graph of another size crashed
# inside the driver (Mesa's lavapipe: prompt, drop, decode a new sequence; decode past 256
# positions, then a prompt chunk). A fresh backend (≈ 0.01 ms) does not; so a stage restarts
# its Vulkan backend before the next graph whenever one of its KV buffers on the device was freed.
_RESTART_AFTER_FREE = {b"Vulkan"}


def _layer_of(name: str) -> int | None:
    """The block index of a `blk.N.` tensor name, None for the others."""
    if not name.startswith("blk."):
        return None
    return int(name.split(".", 2)[1])


def every_core() -> int:
    """Threads when none are given: every core the OS reports (the CLI gives the physical ones)."""
    return max(1, os.cpu_count() or 2)


@dataclass(frozen=True)
class GpuConfig:
    """A process's GPU settings: -ngl, --device, --vram (the most GPU memory used, bytes), a
    GPU speed given instead of measured (tests on a software GPU), and --n-cpu-moe (the first
    that many layers keep their routed experts in RAM, whether or not their layer is on the GPU;
    --cpu-moe: every layer)."""

    n_gpu_layers: int = 0
    device: str | None = None
    vram: int | None = None
    bytes_per_s: float | None = None
    n_cpu_moe: int = 0


@dataclass(frozen=True)
class Compute:
    """How a process computes, made once by the CLI (-t, --cache-type, --no-repack, -ngl,
    --device, --vram) and handed to every stage, probe and node service it builds; a stage's own
    arguments override it. threads None: every core."""

    threads: int | None = None
    cache_type: str = "f16"  # the KV cache's element type: "f16" (llama.cpp's default) or "f32"
    repack: bool = True  # weights in ggml's CPU_REPACK layout where it has one (--repack)
    gpu: GpuConfig = GpuConfig()

    def __post_init__(self) -> None:
        if self.cache_type not in CACHE_TYPES:
            raise ValueError(f"--cache-type {self.cache_type}: use one of {', '.join(CACHE_TYPES)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"-t {self.threads}: give 1 thread or more")

    @property
    def n_threads(self) -> int:
        return self.threads or every_core()


DEFAULT_COMPUTE = Compute()


def _within(a: np.ndarray, end: int) -> bool:
    """Every value of a non-empty integer array in [0, end). (A decode step's one or few values
    are checked in Python: two numpy reductions cost more there than the whole check.)"""
    if a.size <= 16:
        values: list[int] = a.ravel().tolist()
        return min(values) >= 0 and max(values) < end
    return int(a.min()) >= 0 and int(a.max()) < end


def _no(name: str) -> bool:
    return False


@dataclass(frozen=True)
class SeqChunk:
    """`n` consecutive new tokens of sequence `seq_id` in one forward call. lora: which of the
    stage's adapters apply to them (None: every one; -1: none; k: the k-th only).

    pos: the position of the chunk's first token; -1: where the sequence ends now (append). A
    stage that holds more positions of the sequence forgets those from `pos` on first (a rewind:
    rejected drafts, a cached prefix reused in part). fork: a sequence whose first `pos`
    positions this one starts from (copied; a cached prefix shared by another request).
    draft: the chunk's last len(draft) ids are drafted (speculative decoding): the last stage
    samples after each of them too and keeps those its samples agree with (sampling.verify).
    mark: a stage with recurrent layers keeps their state as it is after this chunk (one
    checkpoint per sequence, the last marked): a later rewind or fork to that position starts
    from it (a recurrent state holds no other earlier position)."""

    seq_id: int
    n: int
    lora: int | None = None
    pos: int = -1
    fork: int | None = None
    draft: tuple[int, ...] = ()
    mark: bool = False


def sample_rows(chunks: Sequence[SeqChunk]) -> np.ndarray:
    """The rows a batch's last stage samples at: each chunk's last, and before it one per
    drafted id (the row of the id before each draft)."""
    rows: list[int] = []
    end = 0
    for c in chunks:
        end += c.n
        if len(c.draft) >= c.n:
            raise ValueError(f"a chunk of {c.n} ids cannot hold {len(c.draft)} drafted ones")
        rows.extend(range(end - 1 - len(c.draft), end))
    return np.array(rows, np.int64)


def stage_shapes(
    hp: HParams, src: WeightSource, start: int, stop: int
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, logical shape) of every tensor the stage [start, stop) computes with: its blocks'
    as their architecture declares them (model/archs/), the embedding on the first stage, the
    output norm and head on the last."""
    d = hp.n_embd
    out: list[tuple[str, tuple[int, ...]]] = []
    if start == 0:
        out.append(("token_embd.weight", (hp.n_vocab, d)))
    for t in layer_tensors(hp, start, stop):
        if t.required or t.name in src.tensors:
            out.append((t.name, t.shape))
        if t.required and is_routed(t.name) and t.name not in src.tensors:
            one = t.name.replace("_exps.", ".0.")  # (blk.0.ffn_gate.0.weight: expert 0 alone)
            if one in src.tensors:
                raise UnsupportedError(
                    f"the model stores each expert as a tensor of its own ({one}, ...), as "
                    "conversions before April 2024 did; convert it again with a current llama.cpp "
                    f"(its experts stacked: {t.name})"
                )
    if stop == hp.n_layer:
        out.append(("output_norm.weight", (d,)))
        head = "output.weight" if "output.weight" in src.tensors else "token_embd.weight"
        out.append((head, (hp.n_vocab, d)))  # tied: the head reads the embedding matrix
    if "rope_freqs.weight" in src.tensors:
        out.append(("rope_freqs.weight", (hp.rope_dim // 2,)))
    return out


class Stage:
    """Layers [start, stop) of the model described by `hp`, loaded from `src`.

    forward(x, chunks): x holds token ids [T_total] when start == 0, else f32 hidden states
    [T_total, n_embd]. Returns f32 hidden states [T_total, n_embd], or for the last stage logits
    [R, n_vocab] for the rows selected by `logits_rows` (default: the last token of each chunk);
    with `hidden`, the last stage gives those rows' hidden states after the output norm
    [R, n_embd] instead (what the head would multiply: embeddings, engine/embed.py).

    One forward (or drop) at a time: a lock, so that another thread (an embedding request) may
    compute its own sequences on the stages the scheduler's thread drives.
    """

    def __init__(
        self,
        hp: HParams,
        src: WeightSource,
        start: int,
        stop: int,
        n_ctx: int,
        on_layer: Callable[[int], None] | None = None,
        exact: bool = False,
        cache_type: str | None = None,
        threads: int | None = None,
        n_gpu_layers: int | None = None,
        device: str | None = None,
        repack: bool | None = None,
        adapters: Sequence[LoraAdapter] = (),
        compute: Compute = DEFAULT_COMPUTE,
        ram_experts: int = 0,
    ) -> None:
        """exact: weights dequantized to f32 and an f32 KV cache (reference precision, tests);
        cache_type: "f16" (default) or "f32". n_gpu_layers: the last that many layers of the
        stage on the GPU `device` (a ggml device name, default the first GPU), as llama.cpp's
        -ngl: more than the stage's layers puts the output head there too; the rest on the CPU.
        None: compute's. repack: weights in ggml's CPU_REPACK layout where it has one
        (model/weights.py; None: compute's, on by default). adapters: LoRA adapters applied to
        this stage's matrices (their tensors for these layers, beside the weights). compute: the
        process's settings, for every argument left None. ram_experts: the first that many of
        the GPU layers keep their routed experts in RAM (a plan's; --n-cpu-moe, compute's, counts
        from layer 0: the larger of the two holds)."""
        if not 0 <= start < stop <= hp.n_layer:
            raise ValueError(f"layer range [{start}, {stop}) is not inside [0, {hp.n_layer})")
        cache_type = cache_type or ("f32" if exact else compute.cache_type)
        repack = compute.repack if repack is None else repack
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"cache type {cache_type!r}: use one of {', '.join(CACHE_TYPES)}")
        self.hp, self.start, self.stop, self.n_ctx = hp, start, stop, n_ctx
        self.is_first, self.is_last = start == 0, stop == hp.n_layer
        self.layers = range(start, stop)
        self.cache_type = CACHE_TYPES[cache_type]
        self.threads = threads or compute.n_threads
        self.src = src
        gpu = compute.gpu  # (a count given here, as a plan's, still goes to the chosen device)
        n_gpu_layers = gpu.n_gpu_layers if n_gpu_layers is None else n_gpu_layers
        device, vram = device or gpu.device, gpu.vram
        if n_gpu_layers < 0:
            raise ValueError(f"-ngl must be 0 or more, got {n_gpu_layers}")
        self.gpu_layers = range(max(start, stop - n_gpu_layers), stop) if n_gpu_layers else range(0)
        # layers [0, n_cpu_moe) keep their experts in RAM
        self.n_cpu_moe = max(
            gpu.n_cpu_moe, self.gpu_layers.start + ram_experts if ram_experts else 0
        )
        self.head_on_gpu = self.is_last and n_gpu_layers > stop - start
        self.gpu: int | None = None  # ggml handles (pointers as ints)
        self.gpu_device: Device | None = None
        self._gpu_buft: int | None = None
        self._gpu_dev: int | None = None
        self._restart_after_free = False  # its backend is one of _RESTART_AFTER_FREE
        self._gpu_stale = False  # ... and a KV buffer on the device was freed since the last graph
        self.cpu: int | None = None
        self.sched: int | None = None
        self.caches: dict[int, SeqCache] = {}
        self._graph: StepGraph | None = None
        self._lock = threading.Lock()  # one forward or drop at a time
        if n_gpu_layers:
            dev, self.gpu_device = gpu_device(device)
            self._gpu_dev = dev
            reg = lib.ggml_backend_dev_backend_reg(dev)
            self._restart_after_free = lib.ggml_backend_reg_name(reg) in _RESTART_AFTER_FREE
            self.gpu = lib.ggml_backend_dev_init(dev, None)
            if not self.gpu:
                raise BackendError(f"ggml could not start {self.gpu_device.name}")
            self._gpu_buft = lib.ggml_backend_dev_buffer_type(dev)
        shapes = stage_shapes(hp, src, start, stop)
        if self.gpu_device is not None:
            self._check_room(src, shapes, n_gpu_layers, vram)
        self.weights = Weights(
            src, shapes, exact, self._placement, self._repack if repack else _no, self.threads
        )
        self.loras: list[Lora] = []
        for adapter in adapters:
            self.loras.append(self._lora(adapter, shapes, exact))
        if on_layer is not None:
            for i in self.layers:
                on_layer(i)
        self.cpu = lib.ggml_backend_cpu_init()
        if not self.cpu:
            raise BackendError("ggml's CPU backend could not start")
        lib.ggml_backend_cpu_set_n_threads(self.cpu, self.threads)
        self._cpu_buft: int = lib.ggml_backend_get_default_buffer_type(self.cpu)
        self.sched = self._new_sched()
        self._graph = None

    def _new_sched(self) -> int:
        order = [b for b in (self.gpu, self.cpu) if b]  # the CPU last: ggml's scheduler wants it
        backends = (ctypes.c_void_p * len(order))(*order)
        sched: int = lib.ggml_backend_sched_new(
            backends, None, len(order), _SCHED_GRAPH_SIZE, False, True
        )
        return sched

    def _device_kv_freed(self) -> None:
        """Called when a KV buffer of this stage's device is freed (see _RESTART_AFTER_FREE)."""
        if self._restart_after_free and self.gpu_layers:
            self._gpu_stale = True

    def _restart_gpu(self) -> None:
        """A fresh backend (and scheduler) for the device; its buffers (weights, caches) stay."""
        self._release_graph()
        lib.ggml_backend_sched_free(self.sched)
        lib.ggml_backend_free(self.gpu)
        self.gpu = lib.ggml_backend_dev_init(self._gpu_dev, None)
        if not self.gpu:
            raise BackendError(
                f"ggml could not restart {self.gpu_device.name if self.gpu_device else 'the GPU'}"
            )
        self.sched = self._new_sched()
        self._gpu_stale = False

    def _lora(
        self, adapter: LoraAdapter, shapes: list[tuple[str, tuple[int, ...]]], exact: bool
    ) -> Lora:
        """The adapter's tensors for the matrices this stage multiplies by, placed as those are."""
        if "token_embd.weight" in adapter.pairs:
            raise UnsupportedError(
                f"{adapter.path}: adapts token_embd.weight (the embedding); Potluck applies "
                "adapters to the layers' matrices and the output head only"
            )
        mine = [adapter.pairs[n] for n, shape in shapes if len(shape) == 2 and n in adapter.pairs]
        tensors = [(t, adapter.file.tensors[t].shape) for p in mine for t in (p.a, p.b)]
        place = lambda t: self._placement(t.rsplit(".lora_", 1)[0])  # noqa: E731 (as its matrix)
        weights = Weights(adapter.file, tensors, exact, place, _no, self.threads)
        return weights, {p.base: adapter.factor(p.base) for p in mine}

    def _placement(self, name: str) -> int | None:
        """The device buffer type a weight is uploaded to, None: this CPU, mapped in place."""
        if self._gpu_buft is None:
            return None
        layer = _layer_of(name)
        if layer is not None and is_routed(name) and layer < self.n_cpu_moe:
            return None  # (--cpu-moe: ggml's scheduler runs their mul_mat_id on the CPU)
        if layer is not None:
            return self._gpu_buft if layer in self.gpu_layers else None
        if name in ("output.weight", "output_norm.weight") and self.head_on_gpu:
            return self._gpu_buft
        if name == "token_embd.weight" and self.head_on_gpu and not self.is_first:
            return self._gpu_buft  # a tied head on a stage that embeds nothing
        return None

    def _check_room(
        self,
        src: WeightSource,
        shapes: list[tuple[str, tuple[int, ...]]],
        asked: int,
        vram: int | None,
    ) -> None:
        """Refuse, before any upload, GPU layers whose weights exceed the device's free memory
        (or `vram`, when smaller), saying how many fit."""
        assert self.gpu_device is not None
        per_layer: dict[int, int] = {}
        rest = 0
        for name, _ in shapes:
            if self._placement(name) is None:
                continue
            layer = _layer_of(name)
            n = src.tensors[name].nbytes
            if layer is None:
                rest += n
            else:
                per_layer[layer] = per_layer.get(layer, 0) + n
        need = sum(per_layer.values()) + rest
        free = self.gpu_device.free_bytes if vram is None else min(vram, self.gpu_device.free_bytes)
        if need <= free:
            return
        fits, total = 0, 0
        for layer in reversed(self.gpu_layers):
            total += per_layer.get(layer, 0)
            if total > free:
                break
            fits += 1
        mib = 2**20
        raise BackendError(
            f"{self.gpu_device.name}: -ngl {asked} needs {need / mib:.0f} MiB of weights there, "
            f"{free / mib:.0f} MiB are free: at most {fits} layers fit (-ngl {fits})"
        )

    def _repack(self, name: str) -> bool:
        """Matmul weights may be repacked; token_embd never (get_rows reads it, also as a tied
        head)."""
        return (
            name.endswith(".weight")
            and name != "token_embd.weight"
            and (_layer_of(name) is not None or name == "output.weight")
        )

    def _kv_buffer_type(self, layer: int) -> int:
        if layer in self.gpu_layers and self._gpu_buft is not None:
            return self._gpu_buft
        return self._cpu_buft

    # -- sequences -------------------------------------------------------------------------------
    def cache(self, seq_id: int) -> SeqCache:
        if seq_id not in self.caches:
            hp = self.hp
            self.caches[seq_id] = SeqCache(
                self.layers, hp.n_head_kv, hp.head_dim, hp.head_dim_v, self.n_ctx,
                self.cache_type, self._kv_buffer_type,
                [i for i in self.layers if hp.is_recurrent(i)], hp.state_elements(),
            )  # fmt: skip
        return self.caches[seq_id]

    def drop(self, seq_id: int) -> None:
        with self._lock:
            self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        cache = self.caches.pop(seq_id, None)
        if cache is not None:
            if self._graph is not None and any(
                key[0] == id(cache) for key in self._graph.shape.chunks
            ):
                self._release_graph()  # (it points into that cache)
            cache.free()
            self._device_kv_freed()

    def place(self, chunk: SeqChunk) -> SeqCache:
        """The cache a chunk writes into, at the chunk's position: forked from `chunk.fork`'s
        first `pos` positions, or rewound to `pos` (raises ValueError when the stage holds fewer
        positions of the sequence than the chunk starts at: it would compute from a wrong state)."""
        cache = self.cache(chunk.seq_id)
        if chunk.fork is not None:
            src = self.caches.get(chunk.fork)
            if src is None or src.length < chunk.pos or chunk.pos < 0:
                held = 0 if src is None else src.length
                raise ValueError(
                    f"sequence {chunk.seq_id} forks the first {chunk.pos} positions of sequence "
                    f"{chunk.fork}, which holds {held} here"
                )
            moves = cache.generation
            cache.copy_from(src, chunk.pos)
            if cache.generation != moves:
                self._device_kv_freed()
        elif 0 <= chunk.pos < cache.length:
            cache.truncate(chunk.pos)
        elif chunk.pos > cache.length:
            raise ValueError(
                f"sequence {chunk.seq_id} holds {cache.length} positions here, but a chunk for "
                f"position {chunk.pos} came: the positions between were never computed"
            )
        return cache

    def position(self, seq_id: int) -> int:
        """Tokens of `seq_id` already in this stage's cache (0 for a sequence it has not seen)."""
        cache = self.caches.get(seq_id)
        return 0 if cache is None else cache.length

    def weight_bytes(self) -> int:
        """Bytes of weights this stage holds: its tensors' bytes in the file (mapped in place)."""
        return self.weights.nbytes + sum(w.nbytes for w, _ in self.loras)

    def device_weight_bytes(self) -> int:
        """Of weight_bytes, those uploaded to the GPU (-ngl)."""
        return sum(self.weights.device_bytes.values())

    def kv_bytes(self) -> int:
        return sum(c.nbytes() for c in self.caches.values())

    def full_kv_bytes(self) -> int:
        """Bytes one sequence's KV cache takes here at the full context (it grows up to that),
        with a hybrid's recurrent state (fixed)."""
        hp = self.hp
        row = hp.n_head_kv * (hp.head_dim + hp.head_dim_v)
        kv = cache_bytes(
            hp.attention_layers(self.start, self.stop), row, self.n_ctx, self.cache_type
        )
        return kv + hp.state_bytes(self.start, self.stop)

    # -- compute ---------------------------------------------------------------------------------
    def forward(
        self,
        x: np.ndarray,
        chunks: Sequence[SeqChunk],
        logits_rows: np.ndarray | Sequence[int] | None = None,
        hidden: bool = False,
    ) -> npt.NDArray[np.float32]:
        with self._lock:
            return self._forward(x, chunks, logits_rows, hidden)

    __call__ = forward

    def _forward(
        self,
        x: np.ndarray,
        chunks: Sequence[SeqChunk],
        logits_rows: np.ndarray | Sequence[int] | None,
        hidden: bool,
    ) -> npt.NDArray[np.float32]:
        x = np.asarray(x)
        total = sum(c.n for c in chunks)
        if not chunks or any(c.n < 1 for c in chunks):  # (ggml would abort the process)
            raise ValueError(f"every chunk needs at least one token, got {[c.n for c in chunks]}")
        if x.shape[0] != total:
            raise ValueError(f"input has {x.shape[0]} rows but the chunks add up to {total}")
        if self.is_first and x.size and not _within(x, self.hp.n_vocab):
            bad = x[(x < 0) | (x >= self.hp.n_vocab)][0]
            raise ValueError(
                f"token id {int(bad)} is outside the vocabulary [0, {self.hp.n_vocab})"
            )
        if not self.is_first and x.shape[1:] != (self.hp.n_embd,):
            raise ValueError(f"hidden states have shape {x.shape}, expected [T, {self.hp.n_embd}]")
        caches = [self.place(c) for c in chunks]
        # a drafted chunk's recurrent states are kept after each token (its drafts not kept
        # are rewound by the next step)
        snaps = [
            bool(c.draft) and cache.state is not None
            for c, cache in zip(chunks, caches, strict=True)
        ]
        for c, cache, snap in zip(chunks, caches, snaps, strict=True):
            moves = cache.generation
            cache.reserve(c.n)
            if snap:
                cache.will_snap(c.n)
            if cache.generation != moves:  # grown: its old buffers were freed
                self._device_kv_freed()
        rows: npt.NDArray[np.int32] | None = None
        n_rows = -1
        if self.is_last:
            if logits_rows is not None:
                rows = np.asarray(logits_rows, np.int32).reshape(-1)
                if rows.size and not _within(rows, total):
                    raise ValueError(f"logits rows {rows.tolist()} are outside [0, {total})")
            elif len(chunks) == 1:
                rows = np.array([total - 1], np.int32)
            else:
                rows = (np.cumsum([c.n for c in chunks]) - 1).astype(np.int32)
            n_rows = int(rows.size)
        shape = StepShape.of(caches, [c.n for c in chunks], n_rows, snaps, hidden)
        if self._graph is None or self._graph.shape != shape:
            self._release_graph()
            assert self.sched is not None, "this stage is closed"
            if self._gpu_stale:
                self._restart_gpu()
            self._graph = StepGraph(
                self.hp, self.weights, self.layers, shape, caches, self.sched, self.loras
            )
        lora_on = [
            np.concatenate(
                [np.full(c.n, c.lora is None or c.lora == k, np.float32) for c in chunks]
            )
            for k in range(len(self.loras))
        ]
        out = self._graph.run(x, [cache.length for cache in caches], rows, lora_on)
        for c, cache, snap in zip(chunks, caches, snaps, strict=True):
            cache.commit(c.n)
            if c.mark:
                cache.mark()
            if snap:
                cache.snapped(c.n)
        return out

    def _release_graph(self) -> None:
        if self._graph is not None:
            self._graph.free()
            self._graph = None

    def close(self) -> None:
        """Free the graph, the caches, the scheduler and the backend (the weights' maps go with
        the last reference to the source)."""
        self._release_graph()
        for cache in self.caches.values():
            cache.free()
        self.caches = {}
        if getattr(self, "sched", None):
            lib.ggml_backend_sched_free(self.sched)
            self.sched = None
        if getattr(self, "weights", None) is not None:
            self.weights.free()
        for weights, _ in getattr(self, "loras", ()):
            weights.free()
        self.loras = []
        for name in ("cpu", "gpu"):
            if getattr(self, name, None):
                lib.ggml_backend_free(getattr(self, name))
                setattr(self, name, None)

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError):  # a half-built stage
            self.close()
