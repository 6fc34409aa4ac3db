"""The ggml graph of one forward step through the layers [start, stop) of a model.

Each layer is its architecture's block (model/archs/), written with the helpers here: norms,
linear maps (with LoRA adapters), attention over the KV caches, a dense FFN, a mixture of
experts. What differs inside the shared helpers (RoPE pairing, activation, QK-norm, sliding
windows, biases, expert gating and groups, latent attention) comes from `HParams` and its rules
as data, or from which tensors the file has. Shapes in comments are ggml's, innermost first:
hidden states are [D, T] for T tokens of all sequences together.

A built graph is reused for every step of the same shape (`StepShape`: per sequence its cache,
token count and attended length n_kv, padded to 256 as llama.cpp), so that a decode step costs
Python only the upload of its inputs: token ids or hidden states, positions, the rows its K/V go
to, the attention masks and the rows whose logits are wanted.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from potluck.errors import ModelFileError
from potluck.model.archs import architecture
from potluck.model.ggml_lib import (
    PREC_F32,
    ROPE_IMROPE,
    ROPE_NEOX,
    ROPE_NORMAL,
    TYPE_F16,
    TYPE_F32,
    TYPE_I32,
    TYPE_I64,
    BackendError,
    lib,
    tensor_ne,
)
from potluck.model.ggml_lib import context as new_context
from potluck.model.kv_cache import MIN_CAPACITY, SeqCache
from potluck.model.weights import Weights
from potluck.modelfile.hparams import HParams

_F32 = 4
# gpt-oss's clamped SwiGLU (alpha, limit): (min(g, limit) · sigmoid(alpha · min(g, limit))) times
# (clamp(u, ±limit) + 1); llama.cpp and transformers both fix these two numbers in code
SWIGLU_OAI = (1.702, 7.0)
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
    number of logits rows (-1: not the last stage; 0: the last stage, no head this step); the
    chunks whose recurrent states are kept after each token (`snaps`: drafted ones); hidden: the
    last stage ends at the output norm (the rows' final hidden states [D, R]: embeddings)."""

    chunks: tuple[tuple[int, int, int, int], ...]
    n_rows: int
    snaps: tuple[bool, ...] = ()
    hidden: bool = False

    @staticmethod
    def of(
        caches: Sequence[SeqCache],
        sizes: Sequence[int],
        n_rows: int,
        snaps: Sequence[bool] = (),
        hidden: bool = False,
    ) -> StepShape:
        return StepShape(
            tuple(
                (id(c), c.generation, n, attended(c, n)) for c, n in zip(caches, sizes, strict=True)
            ),
            n_rows,
            tuple(snaps) if any(snaps) else (),
            hidden and n_rows > 0,
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
        attends = [i for i in layers if not hp.is_recurrent(i)]
        self.windows = sorted({hp.sliding_window if hp.is_sliding(i) else 0 for i in attends})
        self.block = architecture(hp.arch).block
        per_layer = 40 + 16 * len(self.sizes) + 28 * len(loras)
        if hp.is_moe:  # router, top-k, weights, three mul_mat_id and biases, the sum, a shared
            per_layer += 48 + 2 * hp.n_expert_used  # expert
        if hp.n_expert_groups:  # the groups' scores, top groups, the mask
            per_layer += 16
        if hp.kv_lora_rank:  # MLA's bottlenecks, views, absorbed q and the heads' values
            per_layer += 24
        if hp.rules.post_norms:  # norms after attention and the FFN (gemma4's also after each
            per_layer += 24  # of its two FFNs, of v and of the router's input), their muls
        if hp.is_hybrid:  # a Gated DeltaNet's projections, then per sequence its convolution,
            per_layer += 32 + 40 * len(self.sizes)  # delta rule, state copies and gated norm
            # (and a drafted chunk's snapshots: five nodes per token)
            snaps = shape.snaps or (False,) * len(self.sizes)
            per_layer += 5 * sum(n for n, snap in zip(self.sizes, snaps, strict=True) if snap)
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
            if hp.embed_scale != 1.0:
                x = lib.ggml_scale(ctx, x, hp.embed_scale)
        else:
            self.inp_x = self._input(TYPE_F32, D, T)
            x = self.inp_x
        # positions (M-RoPE: four per token, section by section); stages of only recurrent
        # layers read none (windows is empty there: no masks, no K/V rows either)
        n_pos = 4 if hp.rules.rope_style == "imrope" else 1
        self.inp_pos = self._input(TYPE_I32, T * n_pos) if self.windows else 0
        # Llama 4's attention temperature: per token, the factor its q is multiplied by [1, T]
        self.inp_temp = self._input(TYPE_F32, 1, T) if hp.attn_temp_scale else 0
        # MLA: per token, the heads 0 .. H-1, which pick each head's matrix out of a stack
        # (mul_mat_id): i32 [H, T]
        self.inp_heads = self._input(TYPE_I32, hp.n_head, T) if hp.kv_lora_rank else 0
        self.inp_kv_rows = [self._input(TYPE_I64, n) for n in self.sizes] if self.windows else []
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
        if self.shape.hidden:  # what the head would multiply (embeddings pool these)
            return x
        head = "output.weight" if "output.weight" in self.w else "token_embd.weight"
        self._lora_on, self._lora_width = self.inp_lora_rows, self.shape.n_rows
        y = self._adapted(head, x, lib.ggml_mul_mat(ctx, self.w.tensor(head), x))  # [V, R]
        if hp.logit_scale != 1.0:
            y = lib.ggml_scale(ctx, y, 1.0 / hp.logit_scale)
        return self._softcap(y, hp.final_softcap)

    def _softcap(self, x: int, cap: float) -> int:
        """cap · tanh(x / cap) (0: x as it is)."""
        if cap:
            x = lib.ggml_scale(self.ctx, x, 1.0 / cap)
            x = lib.ggml_scale(self.ctx, lib.ggml_tanh(self.ctx, x), cap)
        return x

    # -- the helpers a block is written with (archs/common.py Block) -------------------------
    def norm(self, x: int, weight: str) -> int:
        x = lib.ggml_rms_norm(self.ctx, x, self.hp.rms_eps)
        x = lib.ggml_mul(self.ctx, x, self.w.tensor(weight))
        return x

    def add(self, a: int, b: int) -> int:
        y: int = lib.ggml_add(self.ctx, a, b)
        return y

    def scale(self, x: int, s: float) -> int:
        y: int = lib.ggml_scale(self.ctx, x, s) if s != 1.0 else x
        return y

    def mul(self, x: int, name: str) -> int:
        y: int = lib.ggml_mul(self.ctx, x, self.w.tensor(name)) if name in self.w else x
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
        up = self._linear(f"{p}ffn_up{suffix}", h)  # [F, T]
        if f"{p}ffn_gate{suffix}.weight" in self.w:
            gate = self._linear(f"{p}ffn_gate{suffix}", h)
        else:  # one matrix: up is [2F, T], the gate's F rows first (phi3), split by views
            F = tensor_ne(up)[0] // 2
            row = lib.ggml_row_size(TYPE_F32, 2 * F)
            gate = lib.ggml_view_2d(ctx, up, F, self.total, row, 0)
            up = lib.ggml_view_2d(ctx, up, F, self.total, row, F * _F32)
        return self._linear(f"{p}ffn_down{suffix}", self._glu(gate, up))  # [D, T]

    def _glu(self, gate: int, up: int) -> int:
        """The architecture's activation of gate, times up (same shapes, [F, ...])."""
        act = self.hp.rules.activation
        if act == "swiglu_oai":
            y: int = lib.ggml_swiglu_oai(self.ctx, gate, up, *SWIGLU_OAI)
        elif act == "silu":
            y = lib.ggml_swiglu_split(self.ctx, gate, up)
        else:
            y = lib.ggml_geglu_split(self.ctx, gate, up)
        return y

    def gate(self, name: str, h: int, y: int) -> int:
        g = lib.ggml_sigmoid(self.ctx, lib.ggml_mul_mat(self.ctx, self.w.tensor(name), h))  # [1, T]
        out: int = lib.ggml_mul(self.ctx, y, g)
        return out

    def delta_net(self, i: int, h: int) -> int:
        """Layer i's Gated DeltaNet (qwen35, qwen3next; as llama.cpp's delta-net-base over its
        fused ggml_gated_delta_net): the projections over all T tokens; then per sequence its
        C channels (q, k of the key heads, v of the value heads) through a causal convolution
        whose first d_conv - 1 inputs are the sequence's state (the last d_conv - 1 columns
        written back), SiLU, q and k L2-normed, the delta rule from the sequence's state matrices
        (the new ones written back) with its decay g = softplus(alpha + dt) · a and rate
        beta = sigmoid(b); its output RMS-normed per value head times SiLU(z); ssm_out."""
        hp, ctx, p = self.hp, self.ctx, f"blk.{i}."
        S, Hk, Hv = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
        C, K, r = hp.conv_channels, hp.ssm_d_conv, Hv // Hk
        qkv, z = self._delta_inputs(i, h)  # [C, T], [S Hv, T]
        beta, alpha = self._delta_rates(i, h)  # [Hv, T] each
        beta = lib.ggml_sigmoid(ctx, beta)
        g = lib.ggml_softplus(ctx, lib.ggml_add(ctx, alpha, self.w.tensor(p + "ssm_dt.bias")))
        g = lib.ggml_mul(ctx, g, self.w.tensor(p + "ssm_a"))  # [Hv, T]: the log decay
        weight = self.w.tensor(p + "ssm_conv1d.weight")  # [K, C]
        outs: list[int] = []
        t0 = 0
        snaps = self.shape.snaps or (False,) * len(self.sizes)
        for cache, n, snap in zip(self.caches, self.sizes, snaps, strict=True):
            assert cache.state is not None, "a recurrent layer's cache has a state"
            conv_state = cache.state.conv[i]  # f32 [(K - 1) C]
            state = lib.ggml_view_2d(ctx, conv_state, K - 1, C, (K - 1) * _F32, 0)
            x = lib.ggml_view_2d(ctx, qkv, C, n, C * _F32, t0 * C * _F32)  # [C, n]
            x = lib.ggml_concat(ctx, state, lib.ggml_transpose(ctx, x), 0)  # [K - 1 + n, C]
            last = lib.ggml_view_2d(ctx, x, K - 1, C, (K - 1 + n) * _F32, n * _F32)
            saved = lib.ggml_cpy(ctx, last, state)
            lib.ggml_build_forward_expand(self.gf, saved)
            if snap:  # the window after each token j: columns j + 1 .. j + K - 1
                assert cache.snaps is not None
                rows = (K - 1 + n) * _F32
                for j, slot in enumerate(cache.snaps.slots[:n]):
                    after = lib.ggml_view_2d(ctx, x, K - 1, C, rows, (j + 1) * _F32)
                    kept = lib.ggml_view_2d(ctx, slot.conv[i], K - 1, C, (K - 1) * _F32, 0)
                    lib.ggml_build_forward_expand(self.gf, lib.ggml_cpy(ctx, after, kept))
            x = lib.ggml_ssm_conv(ctx, lib.ggml_reshape_3d(ctx, x, K - 1 + n, C, 1), weight)
            x = lib.ggml_silu(ctx, x)  # [C, n, 1]
            row = C * _F32
            q = lib.ggml_view_4d(ctx, x, S, Hk, n, 1, S * _F32, row, row * n, 0)
            k = lib.ggml_view_4d(ctx, x, S, Hk, n, 1, S * _F32, row, row * n, S * Hk * _F32)
            v = lib.ggml_view_4d(ctx, x, S, Hv, n, 1, S * _F32, row, row * n, 2 * S * Hk * _F32)
            # x / sqrt(sum x² + eps), per head (as RMS-norm with eps / S, times S^-1/2)
            q = lib.ggml_scale(ctx, lib.ggml_rms_norm(ctx, q, hp.rms_eps / S), S**-0.5)
            k = lib.ggml_scale(ctx, lib.ggml_rms_norm(ctx, k, hp.rms_eps / S), S**-0.5)
            if r > 1 and hp.rules.delta_grouped:  # value head j reads key head j // r (the op
                q = self._repeat_heads(q, S, Hk, r, n)  # itself would read j % Hk)
                k = self._repeat_heads(k, S, Hk, r, n)
            rates = lib.ggml_row_size(TYPE_F32, Hv)  # [1, Hv, n, 1] views of this chunk's
            b_c = lib.ggml_view_4d(ctx, beta, 1, Hv, n, 1, _F32, rates, rates * n, t0 * rates)
            g_c = lib.ggml_view_4d(ctx, g, 1, Hv, n, 1, _F32, rates, rates * n, t0 * rates)
            s0 = lib.ggml_reshape_4d(ctx, cache.state.delta[i], S, S, Hv, 1)
            # [out | new state], or [out | the states after each token, the last first]
            y = lib.ggml_gated_delta_net(ctx, q, k, v, g_c, b_c, s0, n if snap else 1)
            new = lib.ggml_view_1d(ctx, y, S * S * Hv, S * Hv * n * _F32)
            lib.ggml_build_forward_expand(self.gf, lib.ggml_cpy(ctx, new, cache.state.delta[i]))
            if snap:  # the op's slot s: the state s tokens before the chunk's end
                assert cache.snaps is not None
                size = S * S * Hv
                for j, slot in enumerate(cache.snaps.slots[:n]):
                    at = (S * Hv * n + (n - 1 - j) * size) * _F32
                    after = lib.ggml_view_1d(ctx, y, size, at)
                    lib.ggml_build_forward_expand(self.gf, lib.ggml_cpy(ctx, after, slot.delta[i]))
            o = lib.ggml_view_3d(ctx, y, S, Hv, n, S * _F32, S * Hv * _F32, 0)  # [S, Hv, n]
            z_c = lib.ggml_view_3d(ctx, z, S, Hv, n, S * _F32, S * Hv * _F32, t0 * S * Hv * _F32)
            o = lib.ggml_mul(ctx, self.norm(o, p + "ssm_norm.weight"), lib.ggml_silu(ctx, z_c))
            outs.append(lib.ggml_reshape_2d(ctx, o, S * Hv, n))
            t0 += n
        y = outs[0]
        for more in outs[1:]:
            y = lib.ggml_concat(ctx, y, more, 1)
        return self._linear(p + "ssm_out", y)  # [D, T]

    def _repeat_heads(self, x: int, S: int, Hk: int, r: int, n: int) -> int:
        """[S, Hk, n, 1] -> [S, Hk r, n, 1], each head r times in a row (repeat-interleave)."""
        ctx = self.ctx
        x = lib.ggml_repeat_4d(ctx, lib.ggml_reshape_4d(ctx, x, S, 1, Hk, n), S, r, Hk, n)
        y: int = lib.ggml_reshape_4d(ctx, x, S, Hk * r, n, 1)
        return y

    def _delta_inputs(self, i: int, h: int) -> tuple[int, int]:
        """A Gated DeltaNet's convolved channels [C, T] (q's, k's, v's) and its output gate z
        [S Hv, T]: from attn_qkv and attn_gate, or from ssm_in, which holds per key head its q,
        k, r value heads' v and their z (older qwen3next files)."""
        hp, ctx, p, T = self.hp, self.ctx, f"blk.{i}.", self.total
        if p + "attn_qkv.weight" in self.w:
            return self._linear(p + "attn_qkv", h), self._linear(p + "attn_gate", h)
        if p + "ssm_in.weight" not in self.w:
            raise ModelFileError(
                f"layer {i} has neither {p}attn_qkv.weight (with attn_gate) nor {p}ssm_in.weight: "
                "its Gated DeltaNet's input projection is missing from the model file"
            )
        S, Hk, Hv = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
        w = S * Hv // Hk  # one key head's values (and z)
        mixed = self._linear(p + "ssm_in", h)  # [Hk (2S + 2w), T]
        row, at = (2 * S + 2 * w) * _F32, 0
        parts = []
        for width in (S, S, w, w):  # q, k, v, z of every key head: [width, Hk, T] -> [width Hk, T]
            view = lib.ggml_view_3d(ctx, mixed, width, Hk, T, row, row * Hk, at * _F32)
            parts.append(lib.ggml_reshape_2d(ctx, lib.ggml_cont(ctx, view), width * Hk, T))
            at += width
        q, k, v, z = parts
        return lib.ggml_concat(ctx, lib.ggml_concat(ctx, q, k, 0), v, 0), z

    def _delta_rates(self, i: int, h: int) -> tuple[int, int]:
        """A Gated DeltaNet's b and alpha per value head, [Hv, T] each: from ssm_beta and
        ssm_alpha, or from ssm_ba, which holds per key head its r values' b then their alpha."""
        hp, ctx, p, T = self.hp, self.ctx, f"blk.{i}.", self.total
        if p + "ssm_beta.weight" in self.w:
            return self._linear(p + "ssm_beta", h), self._linear(p + "ssm_alpha", h)
        Hk, Hv = hp.ssm_n_group, hp.ssm_dt_rank
        r = Hv // Hk
        ba = self._linear(p + "ssm_ba", h)  # [Hk 2r, T]
        row = 2 * r * _F32
        b = lib.ggml_view_3d(ctx, ba, r, Hk, T, row, row * Hk, 0)
        a = lib.ggml_view_3d(ctx, ba, r, Hk, T, row, row * Hk, r * _F32)
        b = lib.ggml_reshape_2d(ctx, lib.ggml_cont(ctx, b), Hv, T)
        return b, lib.ggml_reshape_2d(ctx, lib.ggml_cont(ctx, a), Hv, T)

    def moe(self, i: int, h: int, route: int | None = None) -> int:
        """The router (reading `route`, default h) picks k = n_expert_used of E experts per
        token; each runs as a gated FFN of h (three mul_mat_id over the stacked experts, or two
        where gate and up are one stack, each plus its expert's bias where the file has them)
        and their outputs are summed, weighted by the router's probabilities (renormalised over
        the k where the model says so; hparams.py Gating) times each expert's own scale where
        the file has `ffn_down_exps.scale`."""
        hp, ctx, p, T, D = self.hp, self.ctx, f"blk.{i}.", self.total, self.hp.n_embd
        E, k = hp.n_expert, hp.n_expert_used
        logits = self._linear(p + "ffn_gate_inp", h if route is None else route)  # [E, T]
        if hp.expert_gating == "softmax":
            probs = lib.ggml_soft_max(ctx, logits)
        elif hp.expert_gating == "sigmoid":
            probs = lib.ggml_sigmoid(ctx, logits)
        else:  # softmax_weight: chosen by their logits, the softmax taken over the k below
            probs = logits
        experts = lib.ggml_argsort_top_k(ctx, self._selection(i, probs), k)  # i32 [k, T]
        weights = lib.ggml_get_rows(ctx, lib.ggml_reshape_3d(ctx, probs, 1, E, T), experts)
        if hp.expert_gating == "softmax_weight":  # [1, k, T] -> a softmax over each token's k
            weights = lib.ggml_soft_max(ctx, lib.ggml_reshape_2d(ctx, weights, k, T))
            weights = lib.ggml_reshape_3d(ctx, weights, 1, k, T)
        if hp.expert_norm:  # [1, k, T] -> each token's k weights over their sum
            weights = lib.ggml_reshape_2d(ctx, weights, k, T)
            total = lib.ggml_clamp(ctx, lib.ggml_sum_rows(ctx, weights), 6.103515625e-5, 3.4e38)
            weights = lib.ggml_reshape_3d(ctx, lib.ggml_div(ctx, weights, total), 1, k, T)
        if hp.expert_scale != 1.0:
            weights = lib.ggml_scale(ctx, weights, hp.expert_scale)
        if p + "ffn_down_exps.scale" in self.w:  # times each chosen expert's scale [E]
            scales = lib.ggml_reshape_2d(ctx, self.w.tensor(p + "ffn_down_exps.scale"), 1, E)
            chosen = lib.ggml_reshape_1d(ctx, lib.ggml_cont(ctx, experts), k * T)
            chosen = lib.ggml_get_rows(ctx, scales, chosen)  # [1, k T]
            weights = lib.ggml_mul(ctx, weights, lib.ggml_reshape_3d(ctx, chosen, 1, k, T))
        x = lib.ggml_reshape_3d(ctx, h, D, 1, T)
        if p + "ffn_gate_up_exps.weight" in self.w:  # one stack: each expert's gate rows, then
            both = self._experts(p + "ffn_gate_up_exps", x, experts)  # up's: [2F, k, T]
            F = tensor_ne(both)[0] // 2
            row = lib.ggml_row_size(TYPE_F32, 2 * F)
            gate = lib.ggml_view_3d(ctx, both, F, k, T, row, row * k, 0)  # [F, k, T] (strided)
            up = lib.ggml_view_3d(ctx, both, F, k, T, row, row * k, F * _F32)
        elif p + "ffn_gate_exps.weight" in self.w:
            up = self._experts(p + "ffn_up_exps", x, experts)  # [F, k, T]
            gate = self._experts(p + "ffn_gate_exps", x, experts)
        else:
            raise ModelFileError(
                f"layer {i} has neither {p}ffn_gate_up_exps.weight nor {p}ffn_gate_exps.weight "
                "(and ffn_up_exps): the experts' gate and up are missing from the model file"
            )
        out = self._experts(p + "ffn_down_exps", self._glu(gate, up), experts)  # [D, k, T]
        out = lib.ggml_mul(ctx, out, weights)
        row = D * _F32  # the k outputs of a token are rows of out: summed by views
        y: int = lib.ggml_view_2d(ctx, out, D, T, k * row, 0)
        for j in range(1, k):
            y = lib.ggml_add(ctx, y, lib.ggml_view_2d(ctx, out, D, T, k * row, j * row))
        if k == 1:
            y = lib.ggml_cont(ctx, y)
        return y  # [D, T]

    def _selection(self, i: int, probs: int) -> int:
        """What layer i's router chooses its top k by, of probs [E, T]: plus the selection bias
        `exp_probs_b` where the file has it (it moves the choice, not the weights); with expert
        groups, -inf outside the n_group_used groups whose two best experts sum highest
        (DeepSeek-V3's routing, as llama.cpp's build_moe_ffn). [E, T]."""
        hp, ctx, T = self.hp, self.ctx, self.total
        bias = f"blk.{i}.exp_probs_b.bias"
        if bias in self.w:
            probs = lib.ggml_add(ctx, probs, self.w.tensor(bias))
        G = hp.n_expert_groups
        if not G:
            return probs
        n = hp.n_expert // G  # experts per group
        groups = lib.ggml_reshape_3d(ctx, probs, n, G, T)  # [n, G, T]
        best = lib.ggml_argsort_top_k(ctx, groups, 2)  # i32 [2, G, T]
        best = lib.ggml_get_rows(ctx, lib.ggml_reshape_4d(ctx, groups, 1, n, G, T), best)
        score = lib.ggml_sum_rows(ctx, lib.ggml_reshape_3d(ctx, best, 2, G, T))  # [1, G, T]
        chosen = lib.ggml_argsort_top_k(ctx, lib.ggml_reshape_2d(ctx, score, G, T), hp.n_group_used)
        kept = lib.ggml_get_rows(ctx, groups, chosen)  # [n, g, T]
        # (0 · p - inf: a tensor of -inf shaped as groups; its probabilities are all finite)
        none = lib.ggml_scale_bias(ctx, groups, 0.0, float("-inf"))
        masked = lib.ggml_set_rows(ctx, none, kept, chosen)  # [n, G, T]
        y: int = lib.ggml_reshape_2d(ctx, masked, hp.n_expert, T)
        return y

    def _experts(self, name: str, x: int, experts: int) -> int:
        """Each token's k chosen matrices of the stack `name` [E, n_out, n_in] times x [n_in, 1
        or k, T], plus each one's bias (`name`.bias [E, n_out]) where the file has them:
        [n_out, k, T]."""
        y: int = lib.ggml_mul_mat_id(self.ctx, self.w.tensor(name + ".weight"), x, experts)
        if name + ".bias" in self.w:
            y = lib.ggml_add_id(self.ctx, y, self.w.tensor(name + ".bias"), experts)
        return y

    def attention(self, i: int, h: int) -> int:
        hp, ctx, p, caches = self.hp, self.ctx, f"blk.{i}.", self.caches
        (Hkv, hd, hdv, _), H, T = hp.heads(i), hp.n_head, self.total
        gate = 0  # (an output gate per head: [H hdv, T])
        if hp.kv_lora_rank:  # MLA: RoPE'd within; one kv head, the latent
            q, k, v = self._mla_qkv(i, h)
        else:
            q, k, v, gate = self._qkv(i, h)  # [hd, H, T], [hd, Hkv, T], [Hkv hdv, T]
            optional = hp.rules.qk_norm_if_present and p + "attn_q_norm.weight" in self.w
            if hp.rules.qk_norm or optional:
                q = self.norm(q, p + "attn_q_norm.weight")
                k = self.norm(k, p + "attn_k_norm.weight")
            if hp.rules.v_norm:  # per head, no weight
                v = lib.ggml_rms_norm(ctx, lib.ggml_reshape_3d(ctx, v, hdv, Hkv, T), hp.rms_eps)
                v = lib.ggml_reshape_2d(ctx, v, Hkv * hdv, T)
            q, k = self._rope(i, q), self._rope(i, k)
        if self.inp_temp:  # Llama 4's attention temperature, per token [1, 1, T]
            q = lib.ggml_mul(ctx, q, lib.ggml_reshape_3d(ctx, self.inp_temp, 1, 1, T))
        window = hp.sliding_window if hp.is_sliding(i) else 0
        # per head, a logit that joins every row's softmax and adds nothing to the output
        # (gpt-oss): f32 [H]
        sinks = (
            self.w.tensor(p + "attn_sinks.weight") if p + "attn_sinks.weight" in self.w else None
        )
        outs: list[int] = []
        t0 = 0
        for c, (cache, n, n_kv) in enumerate(zip(caches, self.sizes, self.n_kv, strict=True)):
            ct = cache.cache_type
            row_k, row_v = Hkv * hd, Hkv * hdv  # this layer's K and V per token
            k_new = lib.ggml_view_2d(ctx, k, row_k, n, row_k * _F32, t0 * row_k * _F32)
            v_new = lib.ggml_view_2d(ctx, v, row_v, n, row_v * _F32, t0 * row_v * _F32)
            # the cache's rows [cache.row_k, cap], of which this layer fills the first row_k
            # elements where its kind is the narrower (hparams.py layer_heads)
            nb_k, nb_v = lib.ggml_row_size(ct, cache.row_k), lib.ggml_row_size(ct, cache.row_v)
            ks = self._rows(cache.k[i], row_k, cache.row_k, cache.capacity, nb_k)
            vs = self._rows(cache.v[i], row_v, cache.row_v, cache.capacity, nb_v)
            ks = lib.ggml_set_rows(ctx, ks, k_new, self.inp_kv_rows[c])  # [row_k, cap]
            vs = lib.ggml_set_rows(ctx, vs, v_new, self.inp_kv_rows[c])
            # the first n_kv positions, per kv head: [hd, n_kv, Hkv] (strided views)
            kk = lib.ggml_view_3d(ctx, ks, hd, n_kv, Hkv, nb_k, lib.ggml_row_size(ct, hd), 0)
            vv = lib.ggml_view_3d(ctx, vs, hdv, n_kv, Hkv, nb_v, lib.ggml_row_size(ct, hdv), 0)
            qc = lib.ggml_view_3d(ctx, q, hd, H, n, hd * _F32, hd * H * _F32, t0 * hd * H * _F32)
            qc = lib.ggml_permute(ctx, qc, 0, 2, 1, 3)  # [hd, n, H]
            mask = self.inp_masks[window][c]
            o = lib.ggml_flash_attn_ext(ctx, qc, kk, vv, mask, hp.attn_scale, 0.0, hp.attn_softcap)
            lib.ggml_flash_attn_ext_set_prec(o, PREC_F32)
            if sinks is not None:
                lib.ggml_flash_attn_ext_add_sinks(o, sinks)
            outs.append(lib.ggml_reshape_2d(ctx, o, hdv * H, n))  # [H hdv, n]
            t0 += n
        o = outs[0]
        for more in outs[1:]:
            o = lib.ggml_concat(ctx, o, more, 1)
        if hp.kv_lora_rank:  # each head's latent [r, H, T] times its attn_v_b [r -> v]
            o = lib.ggml_reshape_3d(ctx, o, hdv, H, self.total)
            o = lib.ggml_mul_mat_id(ctx, self.w.tensor(p + "attn_v_b.weight"), o, self.inp_heads)
            o = lib.ggml_reshape_2d(ctx, o, hp.head_dim_v_mla * H, self.total)  # [H v, T]
        if gate:
            o = lib.ggml_mul(ctx, o, lib.ggml_sigmoid(ctx, gate))
        return self._linear(p + "attn_output", o)

    def _rows(self, t: int, width: int, full: int, capacity: int, nb: int) -> int:
        """The first `width` elements of each of the cache tensor t's rows [full, capacity]
        (t itself where that is all of them)."""
        y: int = t if width == full else lib.ggml_view_2d(self.ctx, t, width, capacity, nb, 0)
        return y

    def _mla_qkv(self, i: int, h: int) -> tuple[int, int, int]:
        """Multi-head latent attention's q [r + R, H, T], k [r + R, 1, T] and v [r, T] of h
        [D, T], as llama.cpp's deepseek2 with its absorption: k and v are the latent (rank r,
        normed) that attn_kv_a_mqa makes with a shared key of R = rope_dim dims after it
        (RoPE'd), cached as one kv head; each head's q is its nope part times its attn_k_b (so
        that q·latent = q·k of the decompressed head), then its RoPE'd part. The heads' matrices
        (attn_k_b [H, r, nope], attn_v_b [H, v, r]) go through mul_mat_id, one per head: the
        CPU's repacked layouts serve it for 3-D stacks, not a batched mul_mat."""
        hp, ctx, p, T = self.hp, self.ctx, f"blk.{i}.", self.total
        H, r, R, dq = hp.n_head, hp.kv_lora_rank, hp.rope_dim, hp.head_dim_mla
        if hp.q_lora_rank:  # through the q bottleneck (GLM-4.7-Flash, DeepSeek-V2/V3)
            q = self.norm(self._linear(p + "attn_q_a", h), p + "attn_q_a_norm.weight")
            q = self._linear(p + "attn_q_b", q)
        else:  # (DeepSeek-V2-Lite)
            q = self._linear(p + "attn_q", h)  # [H dq, T]
        row = dq * _F32
        q_nope = lib.ggml_view_3d(ctx, q, dq - R, H, T, row, row * H, 0)
        q_nope = lib.ggml_cont(ctx, q_nope)  # [nope, H, T]
        q_pe = self._rope(i, lib.ggml_view_3d(ctx, q, R, H, T, row, row * H, (dq - R) * _F32))
        k_b = self.w.tensor(p + "attn_k_b.weight")
        q_lat = lib.ggml_mul_mat_id(ctx, k_b, q_nope, self.inp_heads)  # [r, H, T]
        q = lib.ggml_concat(ctx, q_lat, q_pe, 0)  # [r + R, H, T]
        kv = self._linear(p + "attn_kv_a_mqa", h)  # [r + R, T]
        row = (r + R) * _F32
        latent = self.norm(lib.ggml_view_2d(ctx, kv, r, T, row, 0), p + "attn_kv_a_norm.weight")
        k_pe = self._rope(i, lib.ggml_view_3d(ctx, kv, R, 1, T, row, row, r * _F32))
        k = lib.ggml_concat(ctx, lib.ggml_reshape_3d(ctx, latent, r, 1, T), k_pe, 0)
        return q, k, latent

    def _qkv(self, i: int, h: int) -> tuple[int, int, int, int]:
        """Layer i's q [hd, H, T], k [hd, Hkv, T] and v [Hkv hdv, T] of h [D, T]: from attn_q,
        attn_k and attn_v, or from one matrix attn_qkv where the file has it (its rows: q's, k's,
        v's); v is k's projection where the layer has no attn_v (gemma4's global layers); normed
        over all heads together where the rules say so (olmo2). With the rules' output gate,
        attn_q holds per head its q then its gate: q a strided view, and the gate [H hd, T]
        (else 0)."""
        hp, ctx, p, T = self.hp, self.ctx, f"blk.{i}.", self.total
        (Hkv, hd, hdv, _), H = hp.heads(i), hp.n_head
        if hp.rules.attn_output_gate:  # (qwen35's: q-norm follows, which makes q contiguous)
            both = self._linear(p + "attn_q", h)  # [2 hd H, T]
            row = 2 * hd * _F32
            q = lib.ggml_view_3d(ctx, both, hd, H, T, row, row * H, 0)
            gate = lib.ggml_view_3d(ctx, both, hd, H, T, row, row * H, hd * _F32)
            gate = lib.ggml_reshape_2d(ctx, lib.ggml_cont(ctx, gate), hd * H, T)
            k = lib.ggml_reshape_3d(ctx, self._linear(p + "attn_k", h), hd, Hkv, T)
            return q, k, self._linear(p + "attn_v", h), gate
        if p + "attn_qkv.weight" in self.w:
            qkv = self._linear(p + "attn_qkv", h)  # [H hd + Hkv hd + Hkv hdv, T]
            row = lib.ggml_row_size(TYPE_F32, H * hd + Hkv * (hd + hdv))
            q = lib.ggml_view_2d(ctx, qkv, H * hd, T, row, 0)
            k = lib.ggml_view_2d(ctx, qkv, Hkv * hd, T, row, H * hd * _F32)
            v = lib.ggml_view_2d(ctx, qkv, Hkv * hdv, T, row, (H + Hkv) * hd * _F32)
            # contiguous, as the reshapes here and attention's views of v's rows need
            q, k, v = (lib.ggml_cont(ctx, t) for t in (q, k, v))
        else:
            q, k = self._linear(p + "attn_q", h), self._linear(p + "attn_k", h)
            v = self._linear(p + "attn_v", h) if p + "attn_v.weight" in self.w else k
        if hp.rules.qk_norm_full:
            q = self.norm(q, p + "attn_q_norm.weight")
            k = self.norm(k, p + "attn_k_norm.weight")
        q = lib.ggml_reshape_3d(ctx, q, hd, H, T)
        k = lib.ggml_reshape_3d(ctx, k, hd, Hkv, T)
        return q, k, v, 0

    def _rope(self, i: int, x: int) -> int:
        hp = self.hp
        mode = ROPE_NEOX if hp.rules.rope_style == "neox" else ROPE_NORMAL
        freqs = self._rope_freqs()
        n_orig, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow = hp.rope_ext()
        if hp.rules.rope_style == "imrope":  # interleaved M-RoPE (half-split pairs)
            sections = (ctypes.c_int * 4)(*hp.rope_sections)
            y: int = lib.ggml_rope_multi(
                self.ctx, x, self.inp_pos, freqs, hp.heads(i).rope_dim, sections, ROPE_IMROPE,
                n_orig, hp.rope_base_for(i),
                freq_scale, ext_factor, attn_factor, beta_fast, beta_slow,
            )  # fmt: skip
            return y
        if hp.rules.local_rope_unscaled and hp.is_sliding(i):
            freq_scale, ext_factor, attn_factor, freqs = 1.0, 0.0, 1.0, None
        x = lib.ggml_rope_ext(
            self.ctx, x, self.inp_pos, freqs, hp.heads(i).rope_dim, mode, n_orig,
            hp.rope_base_for(i),
            freq_scale, ext_factor, attn_factor, beta_fast, beta_slow,
        )  # fmt: skip
        return x

    def _rope_freqs(self) -> int | None:
        """Divisors of RoPE's frequencies, f32 [rope_dim / 2], where the file has them: Llama
        3.1's rope_freqs; or LongRoPE's (phi3) long factors where a sequence's context exceeds
        the original training context, else its short ones (as llama.cpp chooses)."""
        if "rope_freqs.weight" in self.w:
            return self.w.tensor("rope_freqs.weight")
        if "rope_factors_long.weight" not in self.w:
            return None
        n_ctx = max(c.n_ctx for c in self.caches)
        long = n_ctx > (self.hp.rope_ctx_orig or self.hp.n_ctx_train)
        return self.w.tensor("rope_factors_long.weight" if long else "rope_factors_short.weight")

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
        [T, D] hidden states, or [R, V] logits on the last stage ([R, D] normed hidden states
        with `shape.hidden`)."""
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
        if self.inp_pos:
            if self.hp.rules.rope_style == "imrope":  # text: t, h, w all the position; e 0
                _set(self.inp_pos, np.concatenate([pos, pos, pos, np.zeros_like(pos)]))
            else:
                _set(self.inp_pos, pos)
        if self.inp_temp:  # 1 + beta ln(1 + floor(p / n_orig)), as llama.cpp and transformers
            n_orig = self.hp.rope_ctx_orig or self.hp.n_ctx_train
            temp = 1.0 + self.hp.attn_temp_scale * np.log1p(np.floor(pos / n_orig))
            _set(self.inp_temp, temp.astype(np.float32))
        if self.inp_heads:
            _set(self.inp_heads, np.tile(np.arange(self.hp.n_head, dtype=np.int32), self.total))
        t0 = 0
        for c, (s, n, n_kv) in enumerate(zip(starts, self.sizes, self.n_kv, strict=True)):
            if self.inp_kv_rows:
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
            n_out = max(self.shape.n_rows, 0)
            width = self.hp.n_embd if self.shape.hidden else self.hp.n_vocab
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
