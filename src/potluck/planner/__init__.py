"""The planner: a pure function from a model's footprint, the nodes and the links between them to
a plan (which nodes, which contiguous layers each, GPU/CPU split per node), its predicted speed and
whether pooling beats the best single machine. No I/O, no torch, no network.

    fp = footprint_from_gguf(GGUFFile(path).tensors, hp, n_ctx=4096)
    plan = plan_pool(fp, [NodeInfo(...), ...], {("a", "b"): Link(0.3e-3, 117e6)})
"""

from potluck.planner.cost import DECODE, PROMPT
from potluck.planner.errors import NotEnoughMemoryError, PlanError
from potluck.planner.footprint import ModelFootprint, footprint_from_gguf, held_bytes
from potluck.planner.nodes import (
    DEFAULT_LINK,
    DEVICE_KINDS,
    THIS_MACHINE,
    Link,
    NodeInfo,
    weight_sources,
)
from potluck.planner.plan import Plan, PlannedStage, SingleMachine, layers_label, plan_pool
from potluck.planner.table import PLAN_COLUMNS, format_held, format_plan, format_summary

__all__ = [
    "DECODE",
    "DEFAULT_LINK",
    "DEVICE_KINDS",
    "PLAN_COLUMNS",
    "PROMPT",
    "Link",
    "ModelFootprint",
    "NodeInfo",
    "NotEnoughMemoryError",
    "Plan",
    "PlanError",
    "PlannedStage",
    "SingleMachine",
    "THIS_MACHINE",
    "footprint_from_gguf",
    "format_held",
    "format_plan",
    "format_summary",
    "held_bytes",
    "layers_label",
    "plan_pool",
    "weight_sources",
]
