"""A batch-1 product through ggml's own kernels: what a decode step does to each weight matrix.

Used to measure a machine (node/probe.py: bytes/s that one decode step streams; node/doctor.py:
throughput under sustained load). The weights are synthetic blocks of a given GGML type (random
quants, every fp16 scale finite), held in ordinary memory; one graph per matrix, built once.
"""

from __future__ import annotations

import ctypes

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from potluck.model.ggml_lib import TYPE_F32, BackendError, lib
from potluck.model.ggml_lib import context as new_context
from potluck.model.weights import cpu_buffer_over

_SCALE = 0.01  # every block's fp16 d: finite, like a real weight's


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Bytes of an (n, k) matrix of `qtype` (Q4_0/Q4_1/Q8_0-like: fp16 d first in each block)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n * k // block
    raw = np.random.default_rng(seed).integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    raw[:, :2] = np.full((n_blocks, 1), _SCALE, dtype=np.float16).view(np.uint8)
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
    ) -> None:
        self.nbytes = 0  # weight bytes of one layer
        self._ctx = new_context(4 * layers + 8, 4 * layers + 8)
        self._raw = [random_blocks(qtype, n_out, n_in, seed=i) for i in range(layers)]
        self.nbytes = self._raw[0].nbytes
        self._bufs: list[int] = []
        self.cpu = lib.ggml_backend_cpu_init()
        if not self.cpu:
            raise BackendError("ggml's CPU backend could not start")
        lib.ggml_backend_cpu_set_n_threads(self.cpu, threads)
        self.x = lib.ggml_new_tensor_2d(self._ctx, TYPE_F32, n_in, 1)
        self.graphs = []
        ws = []
        for raw in self._raw:
            w = lib.ggml_new_tensor_2d(self._ctx, int(qtype), n_in, n_out)
            buf = cpu_buffer_over(raw.ctypes.data, raw.nbytes)
            lib.ggml_backend_tensor_alloc(buf, w, raw.ctypes.data)
            self._bufs.append(buf)
            ws.append(w)
        outs = [lib.ggml_mul_mat(self._ctx, w, self.x) for w in ws]
        self._act = lib.ggml_backend_alloc_ctx_tensors(self._ctx, self.cpu)  # x and the outputs
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
        """One product through layer i."""
        if lib.ggml_backend_graph_compute(self.cpu, self.graphs[i]) != 0:
            raise BackendError("ggml compute failed in the speed probe")

    def close(self) -> None:
        for buf in [*self._bufs, self._act]:
            if buf:
                lib.ggml_backend_buffer_free(buf)
        self._bufs, self._act = [], 0
        for ctx in (self._ctx, self._gctx):
            if ctx:
                lib.ggml_free(ctx)
        self._ctx = self._gctx = 0
        if self.cpu:
            lib.ggml_backend_free(self.cpu)
            self.cpu = 0

    def __del__(self) -> None:
        self.close()
