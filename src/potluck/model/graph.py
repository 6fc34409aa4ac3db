"""The ggml graph of one forward step through the layers [start, stop) of a model.

Each layer is its architecture's block (model/archs/), written with the helpers here: norms,
linear maps (with LoRA adapters), attention over the KV caches, a dense FFN, a mixture of
experts. What differs inside the shared helpers (RoPE pairing, activation, QK-norm, sliding
windows, biases, expert gating) comes from `HParams` and its rules as data. Shapes in comments
are ggml's, innermost first: hidden states are [D, T] for T tokens of all sequences together.

A built graph is reused for every step of the same shape (`StepShape`: per sequence its cache,
token count and attended length n_kv, padded to 256 as llama.cpp), so that a decode step costs
Python only the upload of its inputs: token ids or hidden states, positions, the rows its K/V go
to, the attention masks and the rows whose logits are wanted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from potluck.model.archs import architecture
from potluck.model.ggml_lib import (
    PREC_F32,
    ROPE_NEOX,
    ROPE_NORMAL,
    TYPE_F16,
    TYPE_F32,
    TYPE_I32,
    TYPE_I64,
    BackendError,
    lib,
)
from potluck.model.ggml_lib import context as new_context
from potluck.model.kv_cache import MIN_CAPACITY, SeqCache
from potluck.model.weights import Weights
from potluck.modelfile.hparams import HParams

_F32 = 4
# A LoRA adapter as a stage holds it: its .lora_a/.lora_b tensors, and per adapted base tensor
# the factor s of W x + s · B (A x) (modelfile/lora.py)
Lora = tuple[Weights, Mapping[str, float]]


def attended(cache: SeqCache, n_new: int) -> int:
    """Cache rows attention reads when `n_new` tokens follow `cache.length`: the end padded to
    MIN_CAPACITY (so that one graph serves 256 decode steps), at most the capacity."""
    end = cache.length + n_new
    return min(cache.capacity, -(-end // MIN_CAPACITY) * MIN_CAPACITY)


@dataclass(frozen=True)
class StepShape:
    """What a graph depends on: per chunk (cache id, cache generation, tokens, n_kv), and the
    number of logits rows (-1: not the last stage; 0: the last stage, no head this step)."""

    chunks: tuple[tuple[int, int, int, int], ...]
    n_rows: int

    @staticmethod
    def of(caches: Sequence[SeqCache], sizes: Sequence[int], n_rows: int) -> StepShape:
        return StepShape(
            tuple(
                (id(c), c.generation, n, attended(c, n)) for c, n in zip(caches, sizes, strict=True)
            ),
            n_rows,
        )


class StepGraph:
    """A built graph with its input tensors; `run` sets the inputs, computes, reads the output."""

    def __init__(
        self,
        hp: HParams,
        weights: Weights,
        layers: range,
        shape: StepShape,
        caches: Sequence[SeqCache],
        sched: int,
        loras: Sequence[Lora] = (),
    ) -> None:
        self.hp, self.w, self.layers, self.shape = hp, weights, layers, shape
        self.sched, self.loras = sched, loras
        self.is_first = layers.start == 0
        self.is_last = layers.stop == hp.n_layer
        self.sizes = [n for _, _, n, _ in shape.chunks]
        self.n_kv = [k for _, _, _, k in shape.chunks]
        self.total = sum(self.sizes)
        self.windows = sorted({hp.sliding_window if hp.is_sliding(i) else 0 for i in layers})
        self.block = architecture(hp.arch).block
        per_layer = 40 + 16 * len(self.sizes) + 28 * len(loras)
        if hp.is_moe:  # router, top-k, weights, three mul_mat_id, the sum, a shared expert
            per_layer += 40 + hp.n_expert_used
        n_nodes = len(layers) * per_layer + 64
        self.ctx = new_context(2 * n_nodes + 16, n_nodes)
        self.gf: int = lib.ggml_new_graph_custom(self.ctx, n_nodes, False)
        self._inputs: list[int] = []
        self.out = self._build(caches)
        lib.ggml_set_output(self.out)
        lib.ggml_build_forward_expand(self.gf, self.out)
        lib.ggml_backend_sched_reset(sched)
        if not lib.ggml_backend_sched_alloc_graph(sched, self.gf):
            raise BackendError(
                f"ggml could not allocate the compute buffers for {self.total} tokens over "
                f"{len(layers)} layers; lower -b (prompt batch) or -np"
            )

    # -- inputs ------------------------------------------------------------------------------
    def _input(self, qtype: int, *ne: int) -> int:
        new = {1: lib.ggml_new_tensor_1d, 2: lib.ggml_new_tensor_2d}[len(ne)]
        t: int = new(self.ctx, qtype, *ne)
        lib.ggml_set_input(t)
        self._inputs.append(t)
        return t

    # -- the graph ---------------------------------------------------------------------------
    def _build(self, caches: Sequence[SeqCache]) -> int:
        hp, ctx, T, D = self.hp, self.ctx, self.total, self.hp.n_embd
        x: int  # the hidden states [D, T]
        if self.is_first:
            self.inp_ids = self._input(TYPE_I32, T)
            x = lib.ggml_get_rows(ctx, self.w.tensor("token_embd.weight"), self.inp_ids)  # [D, T]
            if hp.rules.embed_scale_sqrt:
                x = lib.ggml_scale(ctx, x, float(D) ** 0.5)
        else:
            self.inp_x = self._input(TYPE_F32, D, T)
            x = self.inp_x
        self.inp_pos = self._input(TYPE_I32, T)
        self.inp_kv_rows = [self._input(TYPE_I64, n) for n in self.sizes]
        self.inp_masks = {
            w: [self._input(TYPE_F16, k, n) for n, k in zip(self.sizes, self.n_kv, strict=True)]
            for w in self.windows
        }
        # per adapter, 1 for the tokens whose sequence uses it, else 0: [1, T] (and [1, R] at the
        # head), made where an adapted matrix first needs it (an input no op reads gets no buffer)
        self.inp_lora: dict[int, int] = {}
        self.inp_lora_rows: dict[int, int] = {}
        self._lora_on, self._lora_width = self.inp_lora, T
        self.caches = caches
        for i in self.layers:
            x = self.block(self, i, x)
        if not self.is_last or self.shape.n_rows == 0:
            return x
        self.inp_rows = self._input(TYPE_I32, self.shape.n_rows)
        x = lib.ggml_get_rows(ctx, x, self.inp_rows)  # [D, R]
        x = self.norm(x, "output_norm.weight")
        head = "output.weight" if "output.weight" in self.w else "token_embd.weight"
        self._lora_on, self._lora_width = self.inp_lora_rows, self.shape.n_rows
        return self._adapted(head, x, lib.ggml_mul_mat(ctx, self.w.tensor(head), x))  # [V, R]

    # -- the helpers a block is written with (archs/common.py Block) -------------------------
    def norm(self, x: int, weight: str) -> int:
        x = lib.ggml_rms_norm(self.ctx, x, self.hp.rms_eps)
        x = lib.ggml_mul(self.ctx, x, self.w.tensor(weight))
        return x

    def add(self, a: int, b: int) -> int:
        y: int = lib.ggml_add(self.ctx, a, b)
        return y

    def _linear(self, name: str, x: int) -> int:
        w = name + ".weight"
        y = self._adapted(w, x, lib.ggml_mul_mat(self.ctx, self.w.tensor(w), x))
        if name + ".bias" in self.w:
            y = lib.ggml_add(self.ctx, y, self.w.tensor(name + ".bias"))
        return y

    def _adapted(self, w: str, x: int, y: int) -> int:
        """y = W x, plus s · B (A x) for each LoRA adapter of W (as llama.cpp, before the bias)."""
        ctx = self.ctx
        for k, (weights, factors) in enumerate(self.loras):
            if w in factors:
                if k not in self._lora_on:
                    self._lora_on[k] = self._input(TYPE_F32, 1, self._lora_width)
                on = self._lora_on[k]
                ax = lib.ggml_mul_mat(ctx, weights.tensor(w + ".lora_a"), x)  # [r, T]
                bax = lib.ggml_mul_mat(ctx, weights.tensor(w + ".lora_b"), ax)  # [n_out, T]
                bax = lib.ggml_mul(ctx, lib.ggml_scale(ctx, bax, factors[w]), on)  # its tokens only
                y = lib.ggml_add(ctx, y, bax)
        return y

    def ffn(self, i: int, h: int, suffix: str = "") -> int:
        ctx, p = self.ctx, f"blk.{i}."
        gate = self._linear(f"{p}ffn_gate{suffix}", h)  # [F, T]
        up = self._linear(f"{p}ffn_up{suffix}", h)
        glu = lib.ggml_swiglu_split if self.hp.rules.activation == "silu" else lib.ggml_geglu_split
        return self._linear(f"{p}ffn_down{suffix}", glu(ctx, gate, up))  # [D, T]

    def gate(self, name: str, h: int, y: int) -> int:
        g = lib.ggml_sigmoid(self.ctx, lib.ggml_mul_mat(self.ctx, self.w.tensor(name), h))  # [1, T]
        out: int = lib.ggml_mul(self.ctx, y, g)
        return out

    def moe(self, i: int, h: int) -> int:
        """The router picks k = n_expert_used of E experts per token; each runs as a gated FFN
        (three mul_mat_id over the stacked experts) and their outputs are summed, weighted by
        the router's probabilities (renormalised over the k where the model says so)."""
        hp, ctx, p, T, D = self.hp, self.ctx, f"blk.{i}.", self.total, self.hp.n_embd
        E, k = hp.n_expert, hp.n_expert_used
        logits = self._linear(p + "ffn_gate_inp", h)  # [E, T]
        if hp.expert_gating == "softmax":
            probs = lib.ggml_soft_max(ctx, logits)
        else:
            probs = lib.ggml_sigmoid(ctx, logits)
        experts = lib.ggml_argsort_top_k(ctx, probs, k)  # i32 [k, T]
        weights = lib.ggml_get_rows(ctx, lib.ggml_reshape_3d(ctx, probs, 1, E, T), experts)
        if hp.expert_norm:  # [1, k, T] -> each token's k weights over their sum
            weights = lib.ggml_reshape_2d(ctx, weights, k, T)
            total = lib.ggml_clamp(ctx, lib.ggml_sum_rows(ctx, weights), 6.103515625e-5, 3.4e38)
            weights = lib.ggml_reshape_3d(ctx, lib.ggml_div(ctx, weights, total), 1, k, T)
        if hp.expert_scale != 1.0:
            weights = lib.ggml_scale(ctx, weights, hp.expert_scale)
        x = lib.ggml_reshape_3d(ctx, h, D, 1, T)
        up = lib.ggml_mul_mat_id(ctx, self.w.tensor(p + "ffn_up_exps.weight"), x, experts)
        gate = lib.ggml_mul_mat_id(ctx, self.w.tensor(p + "ffn_gate_exps.weight"), x, experts)
        glu = lib.ggml_swiglu_split if hp.rules.activation == "silu" else lib.ggml_geglu_split
        act = glu(ctx, gate, up)  # [F, k, T]
        out = lib.ggml_mul_mat_id(ctx, self.w.tensor(p + "ffn_down_exps.weight"), act, experts)
        out = lib.ggml_mul(ctx, out, weights)  # [D, k, T]
        row = D * _F32  # the k outputs of a token are rows of out: summed by views
        y: int = lib.ggml_view_2d(ctx, out, D, T, k * row, 0)
        for j in range(1, k):
            y = lib.ggml_add(ctx, y, lib.ggml_view_2d(ctx, out, D, T, k * row, j * row))
        if k == 1:
            y = lib.ggml_cont(ctx, y)
        return y  # [D, T]

    def attention(self, i: int, h: int) -> int:
        hp, ctx, p, T, caches = self.hp, self.ctx, f"blk.{i}.", self.total, self.caches
        H, Hkv, hd, hdv = hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
        q = lib.ggml_reshape_3d(ctx, self._linear(p + "attn_q", h), hd, H, T)  # [hd, H, T]
        k = lib.ggml_reshape_3d(ctx, self._linear(p + "attn_k", h), hd, Hkv, T)
        v = self._linear(p + "attn_v", h)  # [Hkv hdv, T]
        if hp.rules.qk_norm:
            q = self.norm(q, p + "attn_q_norm.weight")
            k = self.norm(k, p + "attn_k_norm.weight")
        q, k = self._rope(i, q), self._rope(i, k)
        window = hp.sliding_window if hp.is_sliding(i) else 0
        outs: list[int] = []
        t0 = 0
        for c, (cache, n, n_kv) in enumerate(zip(caches, self.sizes, self.n_kv, strict=True)):
            ct = cache.cache_type
            row_k, row_v = Hkv * hd, Hkv * hdv
            k_new = lib.ggml_view_2d(ctx, k, row_k, n, row_k * _F32, t0 * row_k * _F32)
            v_new = lib.ggml_view_2d(ctx, v, row_v, n, row_v * _F32, t0 * row_v * _F32)
            ks = lib.ggml_set_rows(ctx, cache.k[i], k_new, self.inp_kv_rows[c])  # [row_k, cap]
            vs = lib.ggml_set_rows(ctx, cache.v[i], v_new, self.inp_kv_rows[c])
            # the first n_kv positions, per kv head: [hd, n_kv, Hkv] (strided views)
            kk = lib.ggml_view_3d(
                ctx, ks, hd, n_kv, Hkv, lib.ggml_row_size(ct, row_k), lib.ggml_row_size(ct, hd), 0
            )
            vv = lib.ggml_view_3d(
                ctx, vs, hdv, n_kv, Hkv, lib.ggml_row_size(ct, row_v), lib.ggml_row_size(ct, hdv), 0
            )
            qc = lib.ggml_view_3d(ctx, q, hd, H, n, hd * _F32, hd * H * _F32, t0 * hd * H * _F32)
            qc = lib.ggml_permute(ctx, qc, 0, 2, 1, 3)  # [hd, n, H]
            mask = self.inp_masks[window][c]
            o = lib.ggml_flash_attn_ext(ctx, qc, kk, vv, mask, hp.attn_scale, 0.0, 0.0)
            lib.ggml_flash_attn_ext_set_prec(o, PREC_F32)
            outs.append(lib.ggml_reshape_2d(ctx, o, hdv * H, n))  # [H hdv, n]
            t0 += n
        o = outs[0]
        for more in outs[1:]:
            o = lib.ggml_concat(ctx, o, more, 1)
        return self._linear(p + "attn_output", o)

    def _rope(self, i: int, x: int) -> int:
        hp = self.hp
        mode = ROPE_NEOX if hp.rules.rope_style == "neox" else ROPE_NORMAL
        freqs = self.w.tensor("rope_freqs.weight") if "rope_freqs.weight" in self.w else None
        x = lib.ggml_rope_ext(
            self.ctx, x, self.inp_pos, freqs, hp.rope_dim, mode, hp.n_ctx_train,
            hp.rope_base_for(i), 1.0 / hp.rope_scale, 0.0, 1.0, 32.0, 1.0,
        )  # fmt: skip
        return x

    # -- running -----------------------------------------------------------------------------
    def run(
        self,
        x: npt.NDArray[np.generic],
        starts: Sequence[int],
        rows: npt.NDArray[np.int32] | None,
        lora_on: Sequence[npt.NDArray[np.float32]] = (),
    ) -> npt.NDArray[np.float32]:
        """x: int ids [T] (first stage) or f32 hidden states [T, D]; starts: each chunk's first
        position; lora_on: per adapter, f32 [T] 1/0 (which tokens it applies to). Returns f32
        [T, D] hidden states, or [R, V] logits on the last stage."""
        if self.is_first:
            _set(self.inp_ids, np.ascontiguousarray(x, np.int32))
        else:
            _set(self.inp_x, np.ascontiguousarray(x, np.float32))
        if len(starts) == 1:  # (one sequence: every decode step alone and every prompt)
            pos = np.arange(starts[0], starts[0] + self.total, dtype=np.int32)
        else:
            pos = np.concatenate(
                [
                    np.arange(s, s + n, dtype=np.int32)
                    for s, n in zip(starts, self.sizes, strict=True)
                ]
            )
        _set(self.inp_pos, pos)
        t0 = 0
        for c, (s, n, n_kv) in enumerate(zip(starts, self.sizes, self.n_kv, strict=True)):
            _set(self.inp_kv_rows[c], pos[t0 : t0 + n].astype(np.int64))
            for w, masks in self.inp_masks.items():
                _set(masks[c], causal_mask(s, n, n_kv, w))
            t0 += n
        for k, t in self.inp_lora.items():
            _set(t, np.ascontiguousarray(lora_on[k], np.float32))
        if self.is_last and self.shape.n_rows > 0:
            assert rows is not None
            _set(self.inp_rows, np.ascontiguousarray(rows, np.int32))
            for k, t in self.inp_lora_rows.items():
                _set(t, np.ascontiguousarray(lora_on[k][rows], np.float32))
        status = lib.ggml_backend_sched_graph_compute(self.sched, self.gf)
        if status != 0:
            raise BackendError(f"ggml compute failed (status {status})")
        if self.is_last:
            n_out, width = max(self.shape.n_rows, 0), self.hp.n_vocab
        else:
            n_out, width = self.total, self.hp.n_embd
        out = np.empty((n_out, width), np.float32)
        if n_out:
            lib.ggml_backend_tensor_get(self.out, out.ctypes.data, 0, out.nbytes)
        return out

    def free(self) -> None:
        if self.ctx:
            lib.ggml_free(self.ctx)
            self.ctx = 0


def causal_mask(start: int, n: int, n_kv: int, window: int) -> npt.NDArray[np.float16]:
    """f16 [n, n_kv]: 0 where token t (at position start + t) may attend to cache row j, -inf
    elsewhere: j ≤ its position, and with a sliding window, its position - j < window."""
    if n == 1:  # a decode step: one row, a run of zeros
        row = np.full((1, n_kv), -np.inf, np.float16)
        row[0, max(0, start - window + 1) if window else 0 : start + 1] = 0
        return row
    pos = np.arange(start, start + n)[:, None]
    j = np.arange(n_kv)[None, :]
    ok = j <= pos
    if window:
        ok &= pos - j < window
    return np.where(ok, np.float16(0), np.float16(-np.inf))


def _set(t: int, a: npt.NDArray[np.generic]) -> None:
    lib.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.nbytes)
