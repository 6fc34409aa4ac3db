"""The plan as table rows for `potluck plan`; plain strings, the CLI draws them."""

from __future__ import annotations

from potluck.planner.errors import fmt_bytes, fmt_seconds
from potluck.planner.nodes import THIS_MACHINE
from potluck.planner.plan import Plan, PlannedStage, layers_label

PLAN_COLUMNS = (
    "node",
    "device",
    "layers",
    "on GPU",
    "weights + KV + buffers / free",
    "compute ms",
    "net ms",
)


def _memory(st: PlannedStage) -> str:
    used = f"{fmt_bytes(st.weight_bytes)} + {fmt_bytes(st.kv_bytes)} + {fmt_bytes(st.buffer_bytes)}"
    free = fmt_bytes(st.memory_bytes + st.gpu_memory_bytes)
    if st.gpu_memory_bytes:
        return f"{used} / {free} (GPU {fmt_bytes(st.gpu_bytes)} / {fmt_bytes(st.gpu_memory_bytes)})"
    return f"{used} / {free}"


def format_plan(plan: Plan) -> list[tuple[str, ...]]:
    """One row per stage, in PLAN_COLUMNS order."""
    rows: list[tuple[str, ...]] = []
    for st in plan.stages:
        if st.n_gpu_layers:
            gpu = layers_label(st.gpu_start, st.stop) + (" + head" if st.head_on_gpu else "")
            if st.ram_experts:  # (--n-cpu-moe)
                ram = layers_label(st.gpu_start, st.gpu_start + st.ram_experts)
                gpu += f", experts of {ram} in RAM"
        else:
            gpu = "–"
        rows.append(
            (
                st.node,
                st.device,
                layers_label(st.start, st.stop),
                gpu,
                _memory(st),
                f"{st.compute_ms:.2f}",
                f"{st.net_ms:.2f}",
            )
        )
    return rows


def format_summary(plan: Plan) -> list[str]:
    """The lines under the table: predicted speeds and the verdict."""
    lines = [
        f"plan {plan.plan_id}: {plan.tokens_per_s:.1f} tok/s for one stream "
        f"({plan.ms_per_token:.2f} ms/token), {plan.tokens_per_s_streams:.1f} tok/s with many"
    ]
    if plan.best_single is not None:
        b = plan.best_single
        lines.append(f"best single machine: {b.node} ({b.device}), {b.tokens_per_s:.1f} tok/s")
    else:
        lines.append("best single machine: none can hold the model")
    if plan.left_out:
        why = dict(plan.why_left_out)
        lines.append(
            "left out: " + ", ".join(f"{n} ({why[n]})" if n in why else n for n in plan.left_out)
        )
    lines += _sources(plan)
    lines.append(plan.verdict)
    return lines


def _sources(plan: Plan) -> list[str]:
    """Where each node other than this machine gets its weights: its own copy of the file, or
    whom it receives them from and how long that takes at most."""
    lines = []
    for st in plan.stages:
        if st.node == THIS_MACHINE:
            continue
        if not st.weights_from:
            lines.append(f"weights: {st.node} maps its own copy of the file")
        else:
            lines.append(
                f"weights: {st.node} receives {fmt_bytes(st.weight_bytes)} from "
                f"{st.weights_from}, ≤ {fmt_seconds(st.fetch_s)} (less with tensors it kept from "
                "an earlier plan)"
            )
    return lines


def format_held(
    weight_bytes: int, kv_bytes: int, rss_bytes: int, planned: PlannedStage | None = None
) -> str:
    """What a loaded node says it holds (its weights; the KV of the plan's sequences at once, each
    at the full context; its process's RSS), beside what the plan counted for it."""
    held = f"holds {fmt_bytes(weight_bytes)} + KV {fmt_bytes(kv_bytes)}, RSS {fmt_bytes(rss_bytes)}"
    if planned is None:
        return held
    return (
        f"{held} (planned {fmt_bytes(planned.weight_bytes)} + KV {fmt_bytes(planned.kv_bytes)} "
        f"+ buffers {fmt_bytes(planned.buffer_bytes)})"
    )
