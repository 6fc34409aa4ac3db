"""A batch-1 product through ggml's own kernels: what a decode step does to each weight matrix.

Used to measure a machine (node/probe.py: bytes/s that one decode step streams; node/doctor.py:
throughput under sustained load). The weights are synthetic blocks of a given GGML type (random
quants, every fp16 scale finite), held in ordinary memory; one graph per matrix, built once.
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from potluck.model.ggml_lib import TYPE_F32, TYPE_I32, BackendError, lib
from potluck.model.ggml_lib import context as new_context
from potluck.model.weights import Weights, cpu_buffer_over
from potluck.modelfile.gguf_file import Matrix, TensorInfo

_SCALE = 0.01  # every block's fp16 scale fields: finite and normal, like a real weight's
_T = GGMLQuantizationType
# Byte offsets of the fp16 scale fields in one block of each type (ggml's block structs: d, and
# m / dmin where the type has one). Every other byte is quant bits or packed sub-scales, valid
# whatever its value. Left random, these fields hold NaNs, infinities and subnormals, which some
# kernels run at half speed: Q4_1 with a random m streamed 6.9 GB/s against 14.6 with a finite
# one (one Zen 5 core), and the planner took SmolLM2 for 40 % slower than it decodes.
_F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    _T.Q4_0: (0,), _T.Q4_1: (0, 2), _T.Q5_0: (0,), _T.Q5_1: (0, 2), _T.Q8_0: (0,),
    _T.Q2_K: (80, 82), _T.Q3_K: (108,), _T.Q4_K: (0, 2), _T.Q5_K: (0, 2), _T.Q6_K: (208,),
    _T.IQ2_XXS: (0,), _T.IQ2_XS: (0,), _T.IQ2_S: (0,), _T.IQ3_XXS: (0,), _T.IQ3_S: (0,),
    _T.IQ1_S: (0,), _T.IQ4_NL: (0,), _T.IQ4_XS: (0,), _T.TQ1_0: (52,), _T.TQ2_0: (64,),
}  # fmt: skip
_FLOATS = {_T.F32: np.float32, _T.F16: np.float16}


def random_blocks(
    qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0
) -> npt.NDArray[np.uint8]:
    """Bytes of an (n, k) matrix of `qtype`: random quants with every fp16 scale field finite
    (_F16_FIELDS), or normal floats (std 0.02) for F32/F16/BF16. A type without a rule here
    (IQ1_M, MXFP4: scales packed with the quants) keeps random bytes."""
    rng = np.random.default_rng(seed)
    if qtype in _FLOATS or qtype == _T.BF16:
        w = (0.02 * rng.standard_normal(n * k)).astype(np.float32)
        if qtype == _T.BF16:  # the upper half of each float32
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return w.astype(_FLOATS[qtype]).view(np.uint8)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n * k // block
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS.get(qtype, ()):
        raw[:, offset : offset + 2] = np.full((n_blocks, 1), _SCALE, np.float16).view(np.uint8)
    return raw.reshape(-1)


class MatVec:
    """y = W x for synthetic weights W (n_out, n_in) of `qtype`, `layers` of them in turn."""

    def __init__(
        self,
        qtype: GGMLQuantizationType,
        n_out: int,
        n_in: int,
        layers: int,
        threads: int,
        device: int | None = None,
    ) -> None:
        """device: a ggml GPU device handle (ggml_lib.gpu_device): the weights are uploaded there
        and the products run there; None: this CPU, the weights in ordinary memory."""
        self._ctx = new_context(4 * layers + 8, 4 * layers + 8)
        self._raw = [random_blocks(qtype, n_out, n_in, seed=i) for i in range(layers)]
        self.nbytes = self._raw[0].nbytes  # weight bytes of one layer
        self._bufs: list[int] = []
        self.backend: int | None = (
            lib.ggml_backend_cpu_init()
            if device is None
            else lib.ggml_backend_dev_init(device, None)
        )
        if not self.backend:
            raise BackendError("ggml's backend could not start for the speed probe")
        if device is None:
            lib.ggml_backend_cpu_set_n_threads(self.backend, threads)
        self.x: int = lib.ggml_new_tensor_2d(self._ctx, TYPE_F32, n_in, 1)
        self.graphs: list[int] = []
        ws: list[int] = []
        wctx = new_context(layers + 1) if device is not None else 0
        for raw in self._raw:
            if device is None:
                w = lib.ggml_new_tensor_2d(self._ctx, int(qtype), n_in, n_out)
                buf = cpu_buffer_over(raw.ctypes.data, raw.nbytes)
                lib.ggml_backend_tensor_alloc(buf, w, raw.ctypes.data)
                self._bufs.append(buf)
            else:
                w = lib.ggml_new_tensor_2d(wctx, int(qtype), n_in, n_out)
            ws.append(w)
        if device is not None:  # one device buffer for the weights, then upload them
            buf = lib.ggml_backend_alloc_ctx_tensors(wctx, self.backend)
            if not buf:
                raise BackendError("no device memory for the speed probe's weights")
            self._bufs.append(buf)
            for w, raw in zip(ws, self._raw, strict=True):
                lib.ggml_backend_tensor_set(w, raw.ctypes.data, 0, raw.nbytes)
            self._raw = []
        self._wctx = wctx
        outs = [lib.ggml_mul_mat(self._ctx, w, self.x) for w in ws]
        # x and the outputs
        self._act: int | None = lib.ggml_backend_alloc_ctx_tensors(self._ctx, self.backend)
        if not self._act:
            raise BackendError("ggml could not allocate the probe's activations")
        x = np.random.default_rng(0).standard_normal(n_in).astype(np.float32)
        lib.ggml_backend_tensor_set(self.x, x.ctypes.data_as(ctypes.c_void_p), 0, x.nbytes)
        gctx = new_context(8 * layers, 8 * layers)
        self._gctx = gctx
        for y in outs:
            gf = lib.ggml_new_graph_custom(gctx, 8, False)
            lib.ggml_build_forward_expand(gf, y)
            self.graphs.append(gf)

    def __len__(self) -> int:
        return len(self.graphs)

    def run(self, i: int) -> None:
        """One product through layer i (waits for the device to finish)."""
        if lib.ggml_backend_graph_compute(self.backend, self.graphs[i]) != 0:
            raise BackendError("ggml compute failed in the speed probe")
        lib.ggml_backend_synchronize(self.backend)

    def close(self) -> None:
        for buf in [*self._bufs, self._act]:
            if buf:
                lib.ggml_backend_buffer_free(buf)
        self._bufs, self._act = [], 0
        for ctx in (self._ctx, self._gctx, getattr(self, "_wctx", 0)):
            if ctx:
                lib.ggml_free(ctx)
        self._ctx = self._gctx = self._wctx = 0
        if self.backend:
            lib.ggml_backend_free(self.backend)
            self.backend = 0

    def __del__(self) -> None:
        self.close()


class _Synthetic:
    """A WeightSource over random blocks (Weights takes it as it takes a GGUF file)."""

    def __init__(self, named: dict[str, Matrix]) -> None:
        self.tensors = {
            name: TensorInfo(name, m.qtype, _shape(m), 0, m.nbytes) for name, m in named.items()
        }
        self._raw = {
            name: random_blocks(m.qtype, max(1, m.n_experts) * m.n_out, m.n_in, seed=i)
            for i, (name, m) in enumerate(named.items())
        }

    def raw(self, name: str) -> npt.NDArray[np.uint8]:
        return self._raw[name]


def _shape(m: Matrix) -> tuple[int, ...]:
    """A probe matrix's logical shape: (n_out, n_in), or a stack's (n_experts, n_out, n_in)."""
    return (m.n_experts, m.n_out, m.n_in) if m.n_experts else (m.n_out, m.n_in)


class LayerProbe:
    """Batch-1 products through copies of one layer's matrices, held as a stage holds them
    (repacked where ggml has a faster layout for the type, as model/weights.py does): what a
    decode step costs per weight byte for *this model's* types and shapes on this CPU. A stack
    of experts goes through mul_mat_id, as a stage runs it, choosing every expert it holds (the
    k a token reads: a stack of k, not of all n, so that the probe stays small)."""

    def __init__(self, matrices: list[Matrix], copies: int, threads: int) -> None:
        named = {f"blk.{c}.m{j}.weight": m for c in range(copies) for j, m in enumerate(matrices)}
        src = _Synthetic(named)
        shapes = [(name, _shape(m)) for name, m in named.items()]
        self._weights = Weights(src, shapes, repack=lambda name: True, threads=threads)
        self.nbytes = sum(m.nbytes for m in matrices)  # weight bytes of one copy
        widths = sorted({m.n_in for m in matrices})
        stacks = sorted({m.n_experts for m in matrices if m.n_experts})
        n = len(named) + len(widths) + len(stacks) + 8
        self._ctx = new_context(n, n)
        xs = {k: lib.ggml_new_tensor_2d(self._ctx, TYPE_F32, k, 1) for k in widths}
        # a stack's input: the token [n_in, 1, 1] for each of its k experts, chosen by ids [k, 1]
        x3 = {k: lib.ggml_new_tensor_3d(self._ctx, TYPE_F32, k, 1, 1) for k in widths}
        ids = {e: lib.ggml_new_tensor_2d(self._ctx, TYPE_I32, e, 1) for e in stacks}

        def product(c: int, j: int, m: Matrix) -> int:
            w = self._weights.tensor(f"blk.{c}.m{j}.weight")
            if m.n_experts:
                y: int = lib.ggml_mul_mat_id(self._ctx, w, x3[m.n_in], ids[m.n_experts])
            else:
                y = lib.ggml_mul_mat(self._ctx, w, xs[m.n_in])
            return y

        outs = [[product(c, j, m) for j, m in enumerate(matrices)] for c in range(copies)]
        self.backend: int | None = lib.ggml_backend_cpu_init()
        if not self.backend:
            raise BackendError("ggml's CPU backend could not start for the speed probe")
        lib.ggml_backend_cpu_set_n_threads(self.backend, threads)
        self._act: int | None = lib.ggml_backend_alloc_ctx_tensors(self._ctx, self.backend)
        if not self._act:
            raise BackendError("ggml could not allocate the probe's activations")
        for k, x in [*xs.items(), *x3.items()]:
            v = np.random.default_rng(k).standard_normal(k).astype(np.float32)
            lib.ggml_backend_tensor_set(x, v.ctypes.data_as(ctypes.c_void_p), 0, v.nbytes)
        for e, t in ids.items():
            chosen = np.arange(e, dtype=np.int32)
            lib.ggml_backend_tensor_set(t, chosen.ctypes.data_as(ctypes.c_void_p), 0, chosen.nbytes)
        self._gctx = new_context(8 * len(named) + 8, 8 * len(named) + 8)
        self.graphs: list[int] = []
        for ys in outs:
            gf = lib.ggml_new_graph_custom(self._gctx, 4 * len(ys) + 8, False)
            for y in ys:
                lib.ggml_build_forward_expand(gf, y)
            self.graphs.append(gf)

    def __len__(self) -> int:
        return len(self.graphs)

    def run(self, i: int) -> None:
        """The products of copy i."""
        if lib.ggml_backend_graph_compute(self.backend, self.graphs[i]) != 0:
            raise BackendError("ggml compute failed in the speed probe")

    def close(self) -> None:
        if self._act:
            lib.ggml_backend_buffer_free(self._act)
            self._act = 0
        for name in ("_ctx", "_gctx"):
            if getattr(self, name, 0):
                lib.ggml_free(getattr(self, name))
                setattr(self, name, 0)
        if self.backend:
            lib.ggml_backend_free(self.backend)
            self.backend = 0
        self._weights.free()

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError):
            self.close()
