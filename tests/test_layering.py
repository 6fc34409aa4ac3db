"""The layering that docs/ARCHITECTURE.md promises, checked: what importing a module loads, and
that every pipeline kind implements the whole Pipeline contract (no caller probes for members)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from potluck.engine.contract import Pipeline
from potluck.engine.local import LocalPipeline
from potluck.pool.failover import FailoverPipeline
from potluck.pool.pipeline import RemotePipeline

# what generation must work without: the network stack, the pool's code, HTTP, torch
FORBIDDEN = (
    "grpc",
    "torch",
    "fastapi",
    "zeroconf",
    "potluck.transport",
    "potluck.node",
    "potluck.api",
    "potluck.discovery",
    "potluck.pool",
)


@pytest.mark.parametrize(
    "module",
    [
        "potluck.engine.scheduler",
        "potluck.engine.contract",
        "potluck.engine.local",
        "potluck.planner",
    ],
)
def test_the_engine_core_loads_no_network_code(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"print('\\n'.join(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN[:4]!r} "
        f"or m.startswith({FORBIDDEN[4:]!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [], f"importing {module} loads {out}"


@pytest.mark.parametrize("module", ["potluck.node.service", "potluck.transport.client"])
def test_a_worker_and_the_wire_load_no_head_code(module: str) -> None:
    """Node and transport sit below the engine: a worker runs no scheduler, pool or HTTP code."""
    head = ("potluck.engine", "potluck.pool", "potluck.api", "potluck.cli", "fastapi")
    code = (
        f"import sys, {module}\nprint('\\n'.join(m for m in sys.modules if m.startswith({head!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [], f"importing {module} loads {out}"


def _members(proto: type) -> set[str]:
    return {name for name in vars(proto) if not name.startswith("_") and name not in ("copy_with",)}


@pytest.mark.parametrize("kind", [LocalPipeline, RemotePipeline, FailoverPipeline])
def test_every_pipeline_kind_has_the_whole_contract(kind: type) -> None:
    """Members set in __init__ (RemotePipeline's plain attributes) are read from the source of
    __init__; the rest must be on the class."""
    import inspect

    init = inspect.getsource(kind.__init__)  # type: ignore[misc]
    missing = [
        m for m in sorted(_members(Pipeline)) if not hasattr(kind, m) and f"self.{m} " not in init
        and f"self.{m}:" not in init
    ]  # fmt: skip
    assert not missing, f"{kind.__name__} lacks {missing} of the Pipeline contract"
