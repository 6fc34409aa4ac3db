"""The planner on synthetic numbers, no model file: the plans it makes (memory fit, slow nodes left
out, GPU/CPU split, verdict, --tensor-split, errors, exactness of the search). Its memory model
against real loaded stages is tests/test_planner.py."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import combinations, permutations

import pytest
from gguf import GGMLQuantizationType as T

from potluck.errors import PotluckError
from potluck.planner import (
    DEFAULT_LINK,
    PLAN_COLUMNS,
    Link,
    ModelFootprint,
    NodeInfo,
    NotEnoughMemoryError,
    PlanError,
    cost,
    format_plan,
    format_summary,
    plan_pool,
)
from potluck.planner import footprint as fpmod
from potluck.planner.cost import CPU_LAYER_NS, DECODE, GPU_LAYER_NS, PROMPT, CostModel
from potluck.planner.search import Route, route_cost, search

KiB, MiB, GiB = 2**10, 2**20, 2**30
GB = 1e9


def test_held_bytes_are_the_files_bytes() -> None:
    assert fpmod.held_bytes(T.Q4_1, (576, 576)) == 576 * 576 // 32 * 20
    assert fpmod.held_bytes(T.Q6_K, (256, 256)) == 256 * 256 // 256 * 210
    assert fpmod.held_bytes(T.F32, (4, 32)) == 4 * 32 * 4
    assert fpmod.held_bytes(T.F16, (576,)) == 576 * 2  # vectors as the file stores them


# -- plans on synthetic numbers -----------------------------------------------------------------


def synth(
    n_layer: int = 10,
    layer: int = 100 * MiB,
    kv: int = 10 * MiB,
    embd: int = 50 * MiB,
    head: int = 80 * MiB,
    buffer: int = 20 * MiB,
    n_ctx: int = 4096,
    layers: tuple[int, ...] | None = None,
) -> ModelFootprint:
    sizes = layers or (layer,) * n_layer
    return ModelFootprint(
        n_layer=len(sizes),
        n_embd=2048,
        n_vocab=32000,
        n_ctx=n_ctx,
        n_batch=512,
        layer_weight_bytes=sizes,
        layer_kv_bytes=(kv,) * len(sizes),
        layer_read_bytes=sizes,
        embd_bytes=embd,
        embd_read_bytes=embd // 32000,
        head_bytes=head,
        head_read_bytes=head,
        buffer_bytes=buffer,
        wire_bytes=2048 * 2 + 128,
        token_wire_bytes=132,
    )


def cpu(name: str, mem: int, speed: float = 10 * GB) -> NodeInfo:
    return NodeInfo(name, "cpu", mem, 4, speed)


def gpu(name: str, mem: int, vram: int, speed: float = 10 * GB, gspeed: float = 200 * GB):
    return NodeInfo(name, "cuda", mem, 8, speed, vram, gspeed)


LAN = Link(latency_s=0.2e-3, bytes_per_s=1e9 / 8)  # wired gigabit


def lan(*names: str) -> dict[tuple[str, str], Link]:
    return {(a, b): LAN for a, b in combinations(names, 2)}


def covers(plan, n_layer: int) -> None:
    assert plan.stages[0].start == 0 and plan.stages[-1].stop == n_layer
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        assert a.stop == b.start and a.start < a.stop


def test_memory_fit_splits_where_one_node_is_too_small() -> None:
    fp = synth()  # 1000 MiB layers + 100 MiB KV + 50 embd + 80 head + 20 buffers = 1250 MiB
    nodes = [cpu("a", 700 * MiB), cpu("b", 900 * MiB)]
    plan = plan_pool(fp, nodes, lan("a", "b"))
    covers(plan, 10)
    assert [s.node for s in plan.stages] in (["a", "b"], ["b", "a"])
    for st in plan.stages:
        assert st.ram_bytes <= st.memory_bytes
        assert st.ram_bytes == st.weight_bytes + st.kv_bytes + st.buffer_bytes
    assert plan.best_single is None and plan.worth_it
    assert plan.verdict.startswith("pooling is needed: no single machine can hold the model")
    # equal speeds: one stream's time is the same for any split; the tie goes to even stages
    assert max(s.compute_ms for s in plan.stages) <= min(s.compute_ms for s in plan.stages) + 11


def test_fixed_layer_cost_balances_stages_by_time_not_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small layers and a big output head (30 layers of 0.2 MB, a 3 MB head): each layer also
    costs CPU_LAYER_NS beyond its bytes (here more than its bytes take), so the last stage (with
    the head) gets more layers than a balance of bytes alone would give it (22 | 8). (The fixed
    cost of a worker's stage, REMOTE_STAGE_NS, is set aside: it would move the cut the other way.)"""
    monkeypatch.setattr(cost, "REMOTE_STAGE_NS", 0)
    layer, head = 200_000, 3_000_000
    fp = synth(n_layer=30, layer=layer, head=head, embd=head)
    nodes = [cpu("a", 4 * GiB, speed=29 * GB), cpu("b", 4 * GiB, speed=29 * GB)]
    plan = plan_pool(fp, nodes, lan("a", "b"), tensor_split=None)
    if len(plan.stages) == 1:  # one machine alone is faster by the hop: split by hand instead
        costs = CostModel(fp, nodes, lan("a", "b"))
        cut = min(
            range(1, 30),
            key=lambda c: max(costs.stage(0, 0, c).compute_ns, costs.stage(1, c, 30).compute_ns),
        )
    else:
        cut = plan.stages[0].stop
    by_bytes = next(c for c in range(30) if (c + 1) * layer > (30 * layer + head) / 2)
    assert by_bytes == 22 and cut < by_bytes - 2, (cut, by_bytes)
    costs = CostModel(fp, nodes, lan("a", "b"))
    first, last = costs.stage(0, 0, cut), costs.stage(1, cut, 30)
    per_layer = layer / (29 * GB) * 1e9 + CPU_LAYER_NS
    assert abs(first.compute_ns - last.compute_ns) <= per_layer


def test_prompt_balance_evens_layers_and_keeps_decode_time() -> None:
    """Two equal nodes that must share the model: balanced for decode, the stage with the head
    gets fewer layers; balanced for prompts (micro-batches overlap; the head runs once), the
    layers split evenly. One stream's predicted time is the same either way, and the plans differ
    in their id."""
    fp = synth(n_layer=30, layer=2_200_000, head=30_000_000, embd=30_000_000, kv=0)
    nodes = [cpu("a", 100 * MiB, speed=29 * GB), cpu("b", 100 * MiB, speed=29 * GB)]
    decode = plan_pool(fp, nodes, lan("a", "b"))
    prompt = plan_pool(fp, nodes, lan("a", "b"), balance=PROMPT)
    first, last = (s.stop - s.start for s in decode.stages)
    assert first > last + 2, (first, last)  # the head's stage takes fewer layers
    assert [s.stop - s.start for s in prompt.stages] == [15, 15]
    assert decode.ms_per_token == pytest.approx(prompt.ms_per_token)
    assert decode.plan_id != prompt.plan_id
    with pytest.raises(ValueError, match="balance must be"):
        plan_pool(fp, nodes, balance="both")


def test_slow_node_is_left_out() -> None:
    fp = synth()
    nodes = [cpu("a", 800 * MiB), cpu("b", 800 * MiB), cpu("slow", 64 * GiB, speed=1 * GB)]
    plan = plan_pool(fp, nodes, lan("a", "b", "slow"))
    assert {s.node for s in plan.stages} == {"a", "b"}
    assert plan.left_out == ("slow",)
    assert plan.best_single is not None and plan.best_single.node == "slow"
    assert plan.worth_it and "pooling is worth it" in plan.verdict


def test_weak_node_alone_verdict() -> None:
    fp = synth()
    plan = plan_pool(fp, [cpu("fast", 4 * GiB), cpu("weak", 4 * GiB, 2 * GB)], lan("fast", "weak"))
    assert [s.node for s in plan.stages] == ["fast"] and plan.left_out == ("weak",)
    assert not plan.worth_it
    assert plan.verdict.startswith("use fast alone (")
    assert "weak is too weak" in plan.verdict


def test_equal_nodes_verdict_blames_the_pipeline_not_a_node() -> None:
    # two machines of about the same speed: one stream gains nothing from a split, and neither
    # machine is "too weak" (it used to call the faster one weak: per-layer time against whole-model)
    fp = synth()
    for speed_b in (10 * GB, 10.5 * GB, 9.5 * GB):
        nodes = [cpu("a", 4 * GiB, 10 * GB), cpu("b", 4 * GiB, speed_b)]
        plan = plan_pool(fp, nodes, lan("a", "b"))
        assert len(plan.stages) == 1 and not plan.worth_it
        assert "too weak" not in plan.verdict, plan.verdict
        assert "one token goes through every stage in turn" in plan.verdict


def test_network_verdict() -> None:
    # two GPUs that each hold half the model: a split would keep everything on a GPU, but the link
    # is slow (35 ms one way: under the 80 ms round trip that leaves a node out), so the best is
    # one machine with half its layers on the CPU
    fp = synth()
    nodes = [gpu("g1", 8 * GiB, 700 * MiB), gpu("g2", 8 * GiB, 700 * MiB)]
    slow = {("g1", "g2"): Link(latency_s=0.035, bytes_per_s=1e9 / 8)}
    plan = plan_pool(fp, nodes, slow)
    assert len(plan.stages) == 1 and not plan.worth_it
    assert "the network: its 2 hops add" in plan.verdict
    # on a wired LAN the same pool is worth it
    fast = plan_pool(fp, nodes, lan("g1", "g2"))
    assert len(fast.stages) == 2 and fast.worth_it, fast.verdict
    assert fast.tokens_per_s >= 1.2 * fast.best_single.tokens_per_s
    assert all(s.n_gpu_layers == s.stop - s.start for s in fast.stages)


def test_small_gain_verdict_names_the_bottleneck() -> None:
    # "big" holds everything on its CPU; "little" has a GPU for one layer: worth a bit, not 20 %
    fp = synth()
    nodes = [cpu("big", 8 * GiB), gpu("little", 100 * MiB, 130 * MiB)]
    plan = plan_pool(fp, nodes, lan("big", "little"))
    assert len(plan.stages) == 2, format_summary(plan)
    assert not plan.worth_it
    assert plan.verdict.startswith("use big alone (")
    assert "needs +20%" in plan.verdict and "the slowest stage (big, layers 0–" in plan.verdict


def test_experts_in_ram_when_the_gpu_cannot_hold_whole_layers() -> None:
    """A mixture of experts: each layer 100 MiB of attention and 900 MiB of experts, of which a
    token reads 1/8. A 6 GiB GPU holds 5 whole layers; with every layer's attention and KV there
    and the experts of the first layers in RAM (llama.cpp's --n-cpu-moe) it decodes faster, and
    the plan says so."""
    n = 10
    fp = replace(
        synth(layers=(1000 * MiB,) * n),
        layer_read_bytes=(100 * MiB + 900 * MiB // 8,) * n,
        layer_expert_bytes=(900 * MiB,) * n,
        layer_expert_read_bytes=(900 * MiB // 8,) * n,
    )
    node = gpu("g", 32 * GiB, 6 * GiB)
    (st,) = plan_pool(fp, [node]).stages
    # every layer on the GPU; experts in RAM for the first k, k the fewest that make it fit:
    # 20 MiB buffers + 10 x 110 MiB (attention + KV) + (10 - k) x 900 MiB <= 6 GiB -> k = 5;
    # the head (80 MiB) fits beside them
    assert (st.gpu_start, st.n_gpu_layers, st.ram_experts, st.head_on_gpu) == (0, 10, 5, True)
    assert st.gpu_bytes == 20 * MiB + 10 * 110 * MiB + 5 * 900 * MiB + 80 * MiB <= 6 * GiB
    assert st.ram_bytes == 50 * MiB + 5 * 900 * MiB + 20 * MiB
    cpu_read = 5 * (900 * MiB // 8) + fp.embd_read_bytes
    gpu_read = 10 * (100 * MiB + 900 * MiB // 8) - 5 * (900 * MiB // 8) + fp.head_bytes
    want = cpu_read / (10 * GB) + gpu_read / (200 * GB) + 10 * GPU_LAYER_NS / 1e9
    assert st.compute_ms == pytest.approx(want * 1e3, rel=1e-6)
    assert format_plan(plan_pool(fp, [node]))[0][3] == "0–9 + head, experts of 0–4 in RAM"
    # the same model planned as if dense (the same bytes, no expert tensors): whole layers, 6 on
    # the GPU and 4 on the CPU, slower
    dense = replace(fp, layer_expert_bytes=(), layer_expert_read_bytes=())
    (whole,) = plan_pool(dense, [node]).stages
    assert (whole.gpu_start, whole.ram_experts) == (4, 0)
    assert whole.compute_ms > 1.5 * st.compute_ms


def test_gpu_cpu_split() -> None:
    fp = synth()
    # VRAM for the buffers and 3 layers of 110 MiB (weights + KV), not 4
    node = gpu("g", 8 * GiB, 20 * MiB + 3 * 110 * MiB + 50 * MiB)
    plan = plan_pool(fp, [node])
    (st,) = plan.stages
    assert (st.start, st.stop, st.gpu_start, st.n_gpu_layers) == (0, 10, 7, 3)
    assert not st.head_on_gpu
    assert st.gpu_bytes == 20 * MiB + 3 * 110 * MiB <= st.gpu_memory_bytes
    assert st.ram_bytes == 50 * MiB + 7 * 110 * MiB + 80 * MiB + 20 * MiB
    cpu_read = 7 * 100 * MiB + fp.embd_read_bytes + fp.head_bytes
    want = cpu_read / (10 * GB) + 3 * 100 * MiB / (200 * GB)
    want += (7 * CPU_LAYER_NS + 3 * GPU_LAYER_NS) / 1e9  # the fixed cost of each layer
    assert st.compute_ms == pytest.approx(want * 1e3, rel=1e-6)
    # enough VRAM for every layer and the head: all of it goes there (llama.cpp's -ngl 99)
    (st,) = plan_pool(fp, [gpu("g", 8 * GiB, 2 * GiB)]).stages
    assert st.n_gpu_layers == 10 and st.head_on_gpu
    assert st.ram_bytes == 50 * MiB + 20 * MiB  # the embedding and buffers stay in RAM
    # an accelerator slower than the CPU is not used
    (st,) = plan_pool(fp, [gpu("igpu", 8 * GiB, 2 * GiB, gspeed=5 * GB)]).stages
    assert st.n_gpu_layers == 0 and st.gpu_bytes == 0
    rows = format_plan(plan)
    assert rows[0][:4] == ("g", "cuda", "0–9", "7–9")
    assert len(rows[0]) == len(PLAN_COLUMNS)


def test_manual_split() -> None:
    fp = synth(n_layer=30, layer=10 * MiB, kv=MiB)
    nodes = [cpu("z", 4 * GiB), cpu("a", 4 * GiB), cpu("m", 4 * GiB)]
    plan = plan_pool(fp, nodes, tensor_split=[6, 4, 0])
    assert [(s.node, s.start, s.stop) for s in plan.stages] == [("z", 0, 18), ("a", 18, 30)]
    assert plan.manual and plan.left_out == ("m",)
    assert [r[2] for r in format_plan(plan)] == ["0–17", "18–29"]
    assert plan_pool(fp, nodes).plan_id != plan.plan_id
    alone = plan_pool(fp, nodes, tensor_split=[0, 1, 0])
    assert [(s.node, s.start, s.stop) for s in alone.stages] == [("a", 0, 30)]
    assert not alone.worth_it and alone.verdict.startswith(
        "--tensor-split gives every layer to a ("
    )
    # one machine by hand, another one faster: the verdict names both, without contradiction
    fast = [cpu("z", 4 * GiB, 20 * GB), cpu("a", 4 * GiB), cpu("m", 4 * GiB)]
    slow_by_hand = plan_pool(fp, fast, tensor_split=[0, 1, 0])
    assert slow_by_hand.verdict.startswith("--tensor-split gives every layer to a (")
    assert slow_by_hand.verdict.endswith(
        f"; z alone would be faster ({slow_by_hand.best_single.tokens_per_s:.1f} tok/s)"
    )
    with pytest.raises(PlanError, match="has 2 shares but there are 3 nodes"):
        plan_pool(fp, nodes, tensor_split=[1, 1])
    with pytest.raises(PlanError, match="a gets no layer of 30"):
        plan_pool(fp, nodes, tensor_split=[100, 1, 0])
    small = [cpu("z", 4 * GiB), cpu("a", 100 * MiB)]
    with pytest.raises(NotEnoughMemoryError, match=r"a gets layers 15–29, which need ") as err:
        plan_pool(fp, small, tensor_split=[1, 1])
    assert err.value.node == "a" and err.value.available_bytes == 100 * MiB
    assert "but it has 100.0 MiB free" in str(err.value) and "smaller share" in str(err.value)


def test_not_enough_memory_error_has_the_numbers() -> None:
    fp = synth()  # 1250 MiB in all
    nodes = [cpu("a", 500 * MiB), cpu("b", 400 * MiB)]
    with pytest.raises(NotEnoughMemoryError) as err:
        plan_pool(fp, nodes)
    msg = str(err.value)
    assert isinstance(err.value, PotluckError) and "\n" not in msg
    assert msg.startswith(
        "the model needs 1.2 GiB: 1000.0 MiB for 10 layers + 100.0 MiB KV at -c 4096"
    )
    assert "the 2 nodes have 900.0 MiB free together (a: 500.0 MiB, b: 400.0 MiB)" in msg
    assert "350.0 MiB short: lower -c, use a smaller quantization, or add a node" in msg
    assert err.value.needed_bytes == 1250 * MiB and err.value.available_bytes == 900 * MiB
    # enough in total, but no node holds a single layer next to its buffers
    crumbs = [cpu(f"n{i}", 100 * MiB) for i in range(8)]
    with pytest.raises(NotEnoughMemoryError, match="no split fits: the 8 nodes have 800.0 MiB"):
        plan_pool(synth(layer=10 * MiB, kv=0, embd=90 * MiB, buffer=20 * MiB), crumbs)


def test_inputs_are_checked() -> None:
    with pytest.raises(PlanError, match="device 'tpu'"):
        NodeInfo("a", "tpu", GiB, 1, GB)
    with pytest.raises(PlanError, match="GPU memory but its device is 'cpu'"):
        NodeInfo("a", "cpu", GiB, 1, GB, GiB, GB)
    with pytest.raises(PlanError, match="unique"):
        plan_pool(synth(), [cpu("a", GiB), cpu("a", GiB)])
    with pytest.raises(PlanError, match="no nodes"):
        plan_pool(synth(), [])


def test_default_link_for_unmeasured_pairs() -> None:
    fp = synth()
    plan = plan_pool(fp, [cpu("a", 700 * MiB), cpu("b", 900 * MiB)])
    hop = plan.stages[0].net_ms
    assert hop == pytest.approx((DEFAULT_LINK.latency_s + fp.wire_bytes / 12.5e6) * 1e3, abs=1e-6)
    assert plan.stages[-1].net_ms == pytest.approx(
        (DEFAULT_LINK.latency_s + fp.token_wire_bytes / 12.5e6) * 1e3, abs=1e-6
    )
    total = sum(s.compute_ms + s.net_ms for s in plan.stages)
    assert plan.ms_per_token == pytest.approx(total)
    assert plan.tokens_per_s_streams == pytest.approx(1e3 / max(s.compute_ms for s in plan.stages))


def test_plan_id_is_stable_and_follows_the_inputs() -> None:
    fp = synth()
    nodes = [cpu("a", 700 * MiB), cpu("b", 900 * MiB), cpu("c", 300 * MiB)]
    links = lan("a", "b", "c")
    ref = plan_pool(fp, nodes, links)
    # the same pool found in another order, with the same head (the first node): the same plan
    again = plan_pool(fp, [nodes[0], nodes[2], nodes[1]], {(b, a): LAN for a, b in links})
    assert again.plan_id == ref.plan_id and again.stages == ref.stages
    assert len(ref.plan_id) == 16
    nodes, links = nodes[:2], lan("a", "b")
    ref = plan_pool(fp, nodes, links)
    changed = [
        plan_pool(fp, list(reversed(nodes)), links),  # another head: workers cost it more
        plan_pool(replace(fp, n_ctx=2048), nodes, links),
        plan_pool(fp, [nodes[0], replace(nodes[1], memory_bytes=901 * MiB)], links),
        plan_pool(fp, nodes, {("a", "b"): Link(0.3e-3, 1e9 / 8)}),
        plan_pool(fp, nodes),  # the default link differs from LAN
        plan_pool(fp, nodes, links, tensor_split=[1, 1]),
    ]
    assert len({p.plan_id for p in changed} | {ref.plan_id}) == len(changed) + 1


# -- the search is exact: it equals brute force on small random pools ---------------------------


def brute_force(costs: CostModel) -> tuple[Route | None, Route | None]:
    n_nodes, n = len(costs.nodes), costs.model.n_layer
    best: Route | None = None
    multi: Route | None = None
    for k in range(1, min(n_nodes, n) + 1):
        for order in permutations(range(n_nodes), k):
            for cuts in combinations(range(1, n), k - 1):
                bounds = (0, *cuts, n)
                stages = tuple((order[j], bounds[j], bounds[j + 1]) for j in range(k))
                r = route_cost(costs, stages)
                if r is None:
                    continue
                if best is None or r.key < best.key:
                    best = r
                if k > 1 and (multi is None or r.key < multi.key):
                    multi = r
    return best, multi


def random_pool(rng: random.Random) -> CostModel:
    n_layer = rng.randint(1, 6)
    fp = synth(
        layers=tuple(rng.choice([10, 20, 20, 35]) * MiB for _ in range(n_layer)),
        kv=rng.choice([0, 2 * MiB]),
        embd=rng.choice([5, 30]) * MiB,
        head=rng.choice([5, 40]) * MiB,
        buffer=rng.choice([1, 8]) * MiB,
    )
    nodes = []
    for i in range(rng.randint(1, 4)):
        mem = rng.choice([40, 60, 100, 400]) * MiB
        speed = rng.choice([5, 10, 10, 20]) * GB  # repeated values make ties
        if rng.random() < 0.3:
            nodes.append(gpu(f"n{i}", mem, rng.choice([30, 60, 200]) * MiB, speed, 100 * GB))
        else:
            nodes.append(cpu(f"n{i}", mem, speed))
    links = {
        (a.name, b.name): Link(rng.choice([1e-5, 1e-4, 2e-3]), rng.choice([1e7, 1e9]))
        for a in nodes
        for b in nodes
        if a is not b and rng.random() < 0.7
    }
    return CostModel(fp, nodes, links, rng.choice([DECODE, PROMPT]))


@pytest.mark.parametrize("seed", range(150))
def test_search_equals_brute_force(seed: int) -> None:
    costs = random_pool(random.Random(seed))
    best, multi = search(costs)
    want_best, want_multi = brute_force(costs)
    assert (best and best.key) == (want_best and want_best.key)
    assert (multi and multi.key) == (want_multi and want_multi.key)
    for r in (best, multi):
        if r is not None:  # the route it returns really has the cost it claims
            assert route_cost(costs, r.stages) == r


def test_large_pool_keeps_the_fastest_nodes() -> None:
    fp = synth(n_layer=40, layer=10 * MiB, kv=MiB)
    nodes = [cpu(f"n{i}", 200 * MiB, (1 + i) * GB) for i in range(10)]
    nodes.append(cpu("roomy", 8 * GiB, 0.5 * GB))  # slowest, but the only one that holds it all
    plan = plan_pool(fp, nodes)
    covers(plan, 40)
    assert {"n0", "n1", "roomy"} <= set(plan.left_out)
    assert plan.best_single is not None and plan.best_single.node == "roomy"
    assert plan.worth_it


def test_a_peer_too_far_away_is_left_out_with_the_reason() -> None:
    """A node whose round trip from the head is over MAX_RTT_S (80 ms) takes no part while the
    model fits without it, and the plan says why; when only it makes the model fit, it stays."""
    from potluck.planner.plan import MAX_RTT_S
    from potluck.planner.table import format_summary

    fp = synth()  # 1250 MiB in all
    far = Link(latency_s=0.060, bytes_per_s=1e9 / 8)  # 120 ms round trip
    assert 2 * far.latency_s > MAX_RTT_S
    links = {**lan("head", "near"), ("head", "far"): far, ("near", "far"): far}
    # fast and big: without the rule, the far node would take a share (more memory, more speed)
    nodes = [cpu("head", 700 * MiB), cpu("near", 900 * MiB), cpu("far", 4 * GiB, speed=40 * GB)]
    plan = plan_pool(fp, nodes, links)
    assert {s.node for s in plan.stages} == {"head", "near"}
    assert plan.left_out == ("far",)
    said = [line for line in format_summary(plan) if line.startswith("left out:")]
    assert said == [
        "left out: far (round trip 120 ms, over the 80 ms a pipeline tolerates per token)"
    ]
    # the same node, when the others cannot hold the model: kept, not a "does not fit" error
    small = [cpu("head", 300 * MiB), cpu("near", 300 * MiB), nodes[2]]
    kept = plan_pool(fp, small, links)
    assert "far" in {s.node for s in kept.stages} and not kept.why_left_out


def test_weight_sources_prefer_a_peer_about_as_fast_as_the_head() -> None:
    """Whom a node without the model file asks for its layers before the head: peers whose link
    to it carries ≥ PEER_SOURCE_FRACTION of the head's bandwidth, fastest first; then peers whose
    link was not measured; never the node itself or the head; a slow peer not at all."""
    from potluck.planner import weight_sources
    from potluck.planner.nodes import PEER_SOURCE_FRACTION

    gbit, fast_eth = 117e6, 11.7e6
    links = {
        ("head", "t"): Link(1e-3, fast_eth),  # the head on Wi-Fi-like speed
        ("wired", "t"): Link(2e-4, gbit),
        ("t", "equal"): Link(2e-4, fast_eth * PEER_SOURCE_FRACTION),  # measured the other way
        ("slow", "t"): Link(2e-4, fast_eth * PEER_SOURCE_FRACTION * 0.9),
    }
    peers = ["t", "slow", "equal", "unknown", "wired", "head", "wired"]
    assert weight_sources("t", peers, links, head="head") == ["wired", "equal", "unknown"]
    # the head on a gigabit link: the Fast-Ethernet peers would be slower, so only the head
    fast_head = {**links, ("head", "t"): Link(2e-4, gbit)}
    assert weight_sources("t", ["equal", "slow"], fast_head, head="head") == []


def test_a_plan_names_weight_sources_for_every_node_but_the_head() -> None:
    """plan_pool gives each remote stage the pool's other nodes to ask (left-out ones too), the
    head's stage none; assignments_of carries them to the pipeline."""
    from potluck.planner import THIS_MACHINE as HEAD
    from potluck.pool.survey import assignments_of

    fp = synth()
    links = lan(HEAD, "a", "b")
    nodes = [cpu(HEAD, 500 * MiB), cpu("a", 700 * MiB), cpu("b", 700 * MiB)]
    plan = plan_pool(fp, nodes, links)
    by_node = {s.node: s.weight_sources for s in plan.stages}
    assert len(by_node) >= 2 and by_node.pop(HEAD, ()) == ()
    for node, sources in by_node.items():
        assert set(sources) == {"a", "b"} - {node}, (node, sources)
    remote = [a for a in assignments_of(plan) if a.node != "local"]
    assert remote and all(a.sources == by_node[a.node] for a in remote)


def test_a_peer_known_to_have_the_file_is_asked_first() -> None:
    """Peers whose Hello names the model file (holders) come before the others that qualify,
    whatever their bandwidth; a holder too slow to beat the head is still not asked."""
    from potluck.planner import weight_sources
    from potluck.planner.nodes import PEER_SOURCE_FRACTION

    gbit, fast_eth = 117e6, 11.7e6
    links = {
        ("head", "t"): Link(1e-3, fast_eth),
        ("wired", "t"): Link(2e-4, gbit),
        ("equal", "t"): Link(2e-4, fast_eth * PEER_SOURCE_FRACTION),
        ("slow", "t"): Link(2e-4, fast_eth * PEER_SOURCE_FRACTION * 0.9),
    }
    peers = ["wired", "equal", "unknown", "slow"]
    assert weight_sources("t", peers, links, "head", holders={"equal"}) == [
        "equal", "wired", "unknown",
    ]  # fmt: skip
    assert weight_sources("t", peers, links, "head", holders={"unknown", "wired"}) == [
        "wired", "unknown", "equal",
    ]  # fmt: skip
    assert "slow" not in weight_sources("t", peers, links, "head", holders={"slow"})


def test_the_plan_says_where_each_node_gets_its_weights() -> None:
    """A node with the file maps it (no transfer); one without receives its stage's bytes from a
    holder it asks, else from the head, in at most bytes / that link's bandwidth + latency;
    `potluck plan` prints one line per node saying so."""
    from potluck.planner import THIS_MACHINE as HEAD
    from potluck.planner.table import format_summary

    fp = synth()  # 1250 MiB
    slow = Link(1e-3, 12.5e6)
    links = {**lan(HEAD, "has", "lacks"), (HEAD, "lacks"): slow}
    has = replace(cpu("has", 500 * MiB), has_model=True)
    nodes = [cpu(HEAD, 500 * MiB), has, cpu("lacks", 500 * MiB)]
    plan = plan_pool(fp, nodes, links, [1, 1, 1])
    by = {s.node: s for s in plan.stages}
    assert by[HEAD].weights_from == "" and by["has"].weights_from == ""
    assert by["has"].fetch_s == 0
    lacks = by["lacks"]
    assert lacks.weights_from == "has" and lacks.weight_sources[0] == "has"
    assert lacks.fetch_s == pytest.approx(LAN.seconds(lacks.weight_bytes))
    lines = [x for x in format_summary(plan) if x.startswith("weights:")]
    assert lines[0] == "weights: has maps its own copy of the file"
    assert lines[1].startswith(
        f"weights: lacks receives {lacks.weight_bytes / MiB:.1f} MiB from has, ≤ "
    )
    # no holder: from the head, over its (slow) link
    nobody = plan_pool(fp, [nodes[0], cpu("has", 500 * MiB), nodes[2]], links, [1, 1, 1])
    lacks = {s.node: s for s in nobody.stages}["lacks"]
    assert lacks.weights_from == HEAD
    assert lacks.fetch_s == pytest.approx(slow.seconds(lacks.weight_bytes))
    assert lacks.fetch_s > 30  # 400+ MiB at 12.5 MB/s


def test_batch_replicas_each_machine_that_holds_the_model_and_one_pipeline() -> None:
    """plan_replicas: a replica per node that holds the whole model alone (fastest first); the
    nodes that cannot, pooled into one pipeline replica; a node offering nothing left out."""
    from potluck.planner.replicas import plan_replicas

    fp = synth()  # 1250 MiB in all
    links = lan("head", "a", "b", "c", "d")
    nodes = [
        cpu("head", 0), cpu("a", 2 * GiB, speed=8 * GB), cpu("b", 2 * GiB, speed=12 * GB),
        cpu("c", 800 * MiB), cpu("d", 800 * MiB),
    ]  # fmt: skip
    reps = plan_replicas(fp, nodes, links)
    assert [r.nodes for r in reps.replicas[:2]] == [("b",), ("a",)]
    pipe = reps.replicas[2]
    assert pipe.plan is not None and set(pipe.nodes) == {"c", "d"}
    assert reps.left_out == (("head", "offers no memory (--mem 0)"),)
    assert reps.tokens_per_s == pytest.approx(sum(r.tokens_per_s for r in reps.replicas))
    # alone, one small node is left out with the reason; nothing that fits at all: the error
    one = plan_replicas(fp, nodes[:2] + nodes[3:4], links)
    assert [r.nodes for r in one.replicas] == [("a",)]
    assert one.left_out[1][0] == "c" and "cannot hold the model alone" in one.left_out[1][1]
    with pytest.raises(NotEnoughMemoryError):
        plan_replicas(fp, [cpu("c", 800 * MiB)], links)
    # potluck plan --batch: a row per replica; the pool's items/hour against the best machine's
    from potluck.planner.replicas import format_replicas

    rows, lines = format_replicas(reps, item_tokens=100)
    assert [r[0] for r in rows] == ["b", "a", pipe.label] and rows[2][1] == "a pipeline"
    per_hour = [float(r[3]) for r in rows]
    assert per_hour[0] == pytest.approx(reps.replicas[0].tokens_per_s * 36, abs=1)
    assert lines[0].startswith(f"the pool: {reps.tokens_per_s * 36:.0f} items/hour of 100 tokens")
    ratio = reps.tokens_per_s / reps.replicas[0].tokens_per_s
    assert lines[1] == (
        f"best single machine: b, {per_hour[0]:.0f} items/hour; the pool {ratio:.2f}× that"
    )
    assert lines[2] == "left out: head (offers no memory (--mem 0))"


def test_a_worker_farther_than_its_token_is_paced_by_the_heads_round_trip() -> None:
    """The head chains one decode step ahead, so a route that starts on a worker takes at least
    (its cycle + the head's round trip to that worker) / 2 per token; a near worker, or the head
    itself, only its cycle. (Measured: SmolLM2 on a worker 5 ms away, RESULTS.md.)"""
    fp = synth()
    for latency_s, paced in ((0.2e-3, False), (20e-3, True)):
        nodes = [cpu("head", 0), cpu("w", 4 * GiB, speed=100 * GB)]
        links = {("head", "w"): Link(latency_s, 1e9 / 8)}
        plan = plan_pool(fp, nodes, links)
        costs = CostModel(fp, nodes, links, head="head")
        cycle = costs.stage(1, 0, fp.n_layer).compute_ns
        rtt = round(2 * latency_s * 1e9)
        assert (rtt > cycle) == paced  # the far worker's round trip is longer than its token
        want = (cycle + rtt) // 2 if paced else cycle
        assert plan.best_single is not None and plan.best_single.node == "w"
        assert plan.best_single.ms_per_token == pytest.approx(want / 1e6)
        assert plan.ms_per_token == pytest.approx(want / 1e6)
    # the head alone is never paced, and a worker's stage costs REMOTE_STAGE_NS more than its own
    nodes = [cpu("head", 4 * GiB), cpu("w", 4 * GiB)]
    costs = CostModel(fp, nodes, {("head", "w"): Link(20e-3, 1e9 / 8)}, head="head")
    head_alone = costs.stage(0, 0, fp.n_layer).compute_ns
    assert costs.paced_ns(0, head_alone) == head_alone
    assert costs.stage(1, 0, fp.n_layer).compute_ns == head_alone + cost.REMOTE_STAGE_NS
