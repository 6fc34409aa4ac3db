"""What every architecture module is made of: tensor declarations and the graph helpers a block
is written with.

An architecture declares, per layer, the tensors its block reads (`Tensor`: GGUF name, logical
shape outermost first, whether a file must have it) and writes its block as a function over a
`Block` (model/graph.py's StepGraph implements it): norms, linear maps, attention over the
stage's KV cache, a dense FFN, a mixture of experts. The helpers below declare the tensors of
those shared pieces so that each module lists its own in a few lines.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from potluck.modelfile.hparams import HParams

# the routed experts' matrices, stacked [n_expert, rows, cols]: a token reads n_expert_used of
# each stack's n_expert matrices (the planner's read bytes; --n-cpu-moe keeps them in RAM); the
# gate and up of each expert in one stack where a file has `ffn_gate_up_exps` (gate rows first)
ROUTED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")


def is_routed(name: str) -> bool:
    """Whether `name` (a GGUF tensor name) is a stack of routed experts (or their biases)."""
    parts = name.split(".")
    return len(parts) >= 3 and parts[2] in ROUTED


class Tensor(NamedTuple):
    name: str  # "blk.3.attn_q.weight"
    shape: tuple[int, ...]  # logical, outermost first: (n_out, n_in) for a matrix
    required: bool = True  # False: used when the file has it (a bias some files carry)


class Block(Protocol):
    """The graph helpers a block is written with; tensors are ggml addresses, hidden states
    [D, T] for the step's T tokens (model/graph.py)."""

    hp: HParams

    def norm(self, x: int, weight: str) -> int:
        """RMSNorm times `weight` (a GGUF name)."""
        ...

    def add(self, a: int, b: int) -> int: ...

    def scale(self, x: int, s: float) -> int:
        """x times the number s (granite's residual scale)."""
        ...

    def mul(self, x: int, name: str) -> int:
        """x times the tensor `name` (broadcast: gemma4's layer_output_scale [1]) where the file
        has it; x itself where it does not."""
        ...

    def attention(self, i: int, h: int) -> int:
        """Layer i's self-attention of h [D, T] over the stage's KV caches (with its sinks,
        `attn_sinks`, where the file has them), output projection included: [D, T]. q, k and v
        come from one matrix `attn_qkv` where the file has it (phi3); where a layer has no
        `attn_v`, v is k's projection (gemma4's global layers)."""
        ...

    def ffn(self, i: int, h: int, suffix: str = "") -> int:
        """Layer i's gated FFN (`ffn_gate{suffix}`, `ffn_up{suffix}`, `ffn_down{suffix}`; the
        architecture's activation): [D, T]. Where the file has no `ffn_gate{suffix}`, the gate's
        rows come first in `ffn_up{suffix}` (phi3)."""
        ...

    def moe(self, i: int, h: int, route: int | None = None) -> int:
        """Layer i's routed experts of h (router `ffn_gate_inp`, stacks `ffn_*_exps`; their
        biases, and a scale per expert `ffn_down_exps.scale`, where the file has them), weighted
        and summed: [D, T]. route: what the router reads, [D, T] (default h; gemma4's)."""
        ...

    def gate(self, name: str, h: int, y: int) -> int:
        """y [D, T] times sigmoid(`name` · h), a scalar per token (qwen2moe's shared expert)."""
        ...

    def delta_net(self, i: int, h: int) -> int:
        """Layer i's Gated DeltaNet of h [D, T] (a hybrid's recurrent layer: q, k, v through a
        short causal convolution over the sequence's state, the gated delta rule over its
        state matrices, a gated norm, `ssm_out`): [D, T]."""
        ...


# -- blocks the families share ------------------------------------------------------------------
def feed_forward(g: Block, i: int, h: int) -> int:
    """Layer i's FFN of h: a dense one, or on a mixture of experts' layers the routed experts
    plus, where the model has one, the shared expert every token goes through."""
    if not g.hp.is_moe_layer(i):
        return g.ffn(i, h)
    y = g.moe(i, h)
    return g.add(y, g.ffn(i, h, "_shexp")) if g.hp.n_ff_shexp else y


def pre_norm(g: Block, i: int, x: int, ffn_norm: str = "ffn_norm") -> int:
    """llama's block: x + attention(norm(x)), then that + feed_forward(norm(that)); the second
    norm's name (`ffn_norm`; glm4moe's `post_attention_norm`)."""
    p = f"blk.{i}."
    x = g.add(x, g.attention(i, g.norm(x, p + "attn_norm.weight")))
    return g.add(x, feed_forward(g, i, g.norm(x, f"{p}{ffn_norm}.weight")))


def sandwich(g: Block, i: int, x: int) -> int:
    """gemma's block: attention and FFN each between two norms, then the residual add."""
    p = f"blk.{i}."
    a = g.attention(i, g.norm(x, p + "attn_norm.weight"))
    x = g.add(x, g.norm(a, p + "post_attention_norm.weight"))
    f = feed_forward(g, i, g.norm(x, p + "ffn_norm.weight"))
    return g.add(x, g.norm(f, p + "post_ffw_norm.weight"))


# -- tensor declarations --------------------------------------------------------------------------
def norm(name: str, width: int) -> Tensor:
    return Tensor(name + ".weight", (width,))


def attention_tensors(
    hp: HParams,
    i: int,
    bias: bool | None = False,
    qk_norm: bool = False,
    out_bias: bool = False,
    sinks: bool = False,
    v: bool = True,
    q_gate: bool = False,
) -> list[Tensor]:
    """Layer i's attention (of its own shape, hp.heads(i)): q, k, v, output; bias: q/k/v biases
    required (True), used where the file has them (None; the output's bias too) or absent
    (False); qk_norm: per-head norms of q and k; out_bias: the output's bias required; sinks:
    one sink logit per head (gpt-oss); v: v's matrix required (else used where the file has it,
    k's projection serving as v where not: gemma4's global layers); q_gate: each head's q
    followed by its output gate in attn_q (qwen35's)."""
    p, d, (n_kv, hd, hdv, _) = f"blk.{i}.", hp.n_embd, hp.heads(i)
    q, kv, o = hp.n_head * hd * (2 if q_gate else 1), n_kv * hd, hp.n_head * hdv
    out = [norm(p + "attn_norm", d)]
    rows = {"attn_q": q, "attn_k": kv, "attn_v": n_kv * hdv}
    out += [Tensor(f"{p}{name}.weight", (n, d), v or name != "attn_v") for name, n in rows.items()]
    out.append(Tensor(p + "attn_output.weight", (d, o)))
    if bias is not False:
        out += [Tensor(f"{p}{name}.bias", (n,), required=bool(bias)) for name, n in rows.items()]
    if bias is None or out_bias:
        out.append(Tensor(p + "attn_output.bias", (d,), required=out_bias))
    if qk_norm:
        out += [norm(p + "attn_q_norm", hd), norm(p + "attn_k_norm", hd)]
    if sinks:
        out.append(Tensor(p + "attn_sinks.weight", (hp.n_head,)))
    return out


def ffn_tensors(hp: HParams, i: int, suffix: str = "", n_ff: int | None = None) -> list[Tensor]:
    """A gated FFN's three matrices (`blk.i.ffn_gate{suffix}`, ...), n_ff wide (default hp's)."""
    p, d, f = f"blk.{i}.", hp.n_embd, hp.n_ff if n_ff is None else n_ff
    return [
        Tensor(f"{p}ffn_gate{suffix}.weight", (f, d)),
        Tensor(f"{p}ffn_up{suffix}.weight", (f, d)),
        Tensor(f"{p}ffn_down{suffix}.weight", (d, f)),
    ]


def moe_tensors(
    hp: HParams, i: int, bias: bool = False, gate_up: bool | None = False, scales: bool = False
) -> list[Tensor]:
    """The router and the stacks of routed experts; bias: the router's bias and one bias per
    expert and matrix, stacked [n_expert, rows] (gpt-oss); gate_up: each expert's gate and up
    in one stack `ffn_gate_up_exps` [n_expert, 2 rows, cols] (True), in two (False), or either,
    as the file has them (None: none of the three required; model/graph.py refuses a layer with
    neither); scales: one scale per expert of its output, `ffn_down_exps.scale` [n_expert],
    where the file has it (gemma4)."""
    p, d, e, f = f"blk.{i}.", hp.n_embd, hp.n_expert, hp.n_ff_exp
    out = [Tensor(p + "ffn_gate_inp.weight", (e, d))]
    if gate_up is not False:
        out.append(Tensor(p + "ffn_gate_up_exps.weight", (e, 2 * f, d), bool(gate_up)))
    if gate_up is not True:
        out += [
            Tensor(p + "ffn_gate_exps.weight", (e, f, d), gate_up is False),
            Tensor(p + "ffn_up_exps.weight", (e, f, d), gate_up is False),
        ]
    out.append(Tensor(p + "ffn_down_exps.weight", (e, d, f)))
    if scales:
        out.append(Tensor(p + "ffn_down_exps.scale", (e,), required=False))
    if bias:
        out += [
            Tensor(p + "ffn_gate_inp.bias", (e,)),
            Tensor(p + "ffn_gate_exps.bias", (e, f)),
            Tensor(p + "ffn_up_exps.bias", (e, f)),
            Tensor(p + "ffn_down_exps.bias", (e, d)),
        ]
    return out


def delta_net_tensors(
    hp: HParams, i: int, fused: bool | None = False, ba: bool = False
) -> list[Tensor]:
    """A Gated DeltaNet layer's tensors (qwen35, qwen3next), as llama.cpp's converter writes
    them: q, k and v in one matrix `attn_qkv` and z (the output gate) in `attn_gate`, or all four
    in `ssm_in` per key-head group (older qwen3next files); fused: which (False: the first, None:
    either, as the file has them; model/graph.py refuses a layer with neither); beta and alpha
    per value head in `ssm_beta` / `ssm_alpha`, or per key-head group in `ssm_ba` (ba);
    `ssm_conv1d` [channels, taps]; `ssm_dt.bias` and `ssm_a` (= -exp(A_log)) per value head;
    `ssm_norm` over a value head; `ssm_out`."""
    p, d = f"blk.{i}.", hp.n_embd
    key, value, heads = hp.ssm_n_group * hp.ssm_d_state, hp.ssm_d_inner, hp.ssm_dt_rank
    out = [
        Tensor(p + "attn_qkv.weight", (2 * key + value, d), fused is False),
        Tensor(p + "attn_gate.weight", (value, d), fused is False),
    ]
    if fused is not False:
        out.append(Tensor(p + "ssm_in.weight", (2 * key + 2 * value, d), fused is True))
    if ba:
        out.append(Tensor(p + "ssm_ba.weight", (2 * heads, d)))
    else:
        out += [
            Tensor(p + "ssm_beta.weight", (heads, d)),
            Tensor(p + "ssm_alpha.weight", (heads, d)),
        ]
    return [
        *out,
        Tensor(p + "ssm_conv1d.weight", (hp.conv_channels, hp.ssm_d_conv)),
        Tensor(p + "ssm_dt.bias", (heads,)),
        Tensor(p + "ssm_a", (heads,)),
        norm(p + "ssm_norm", hp.delta_head_v),
        Tensor(p + "ssm_out.weight", (d, value)),
    ]


def rope_factor_tensors(hp: HParams) -> list[Tensor]:
    """LongRoPE's per-frequency divisors, long and short context (phi3's files that have them):
    tensors of the whole model that every layer reads, declared by each (layer_tensors keeps one
    of each)."""
    n = hp.rope_dim // 2
    names = ("rope_factors_long.weight", "rope_factors_short.weight")
    return [Tensor(name, (n,), required=False) for name in names]
