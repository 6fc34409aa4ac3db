"""The layering that docs/ARCHITECTURE.md promises, checked: what importing a module loads, and
that every pipeline kind implements the whole Pipeline contract (no caller probes for members)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import potluck
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
        "potluck.engine.generate",  # (the composition root hands it a pool: potluck.pool.build)
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


def _wire_constructions(path: Path) -> list[str]:
    """Where a module calls a protobuf message class (`pb.LoadRequest(...)`, under any name the
    module gives potluck_pb2, or a class imported from it): "file:line Name"."""
    tree = ast.parse(path.read_text(), str(path))
    modules, classes = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "potluck.transport":
            modules |= {a.asname or a.name for a in node.names if a.name == "potluck_pb2"}
        elif isinstance(node, ast.ImportFrom) and node.module == "potluck.transport.potluck_pb2":
            classes |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name.endswith("potluck_pb2") and a.asname}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and f.value.id in modules
            and f.attr[:1].isupper()
        ):
            found.append((node.lineno, f.attr))
        elif isinstance(f, ast.Name) and f.id in classes:
            found.append((node.lineno, f.id))
    return [f"{path.name}:{line} {name}" for line, name in sorted(found)]


@pytest.mark.parametrize("package", ["engine", "pool", "train", "discovery", "node", "api", "cli"])
def test_wire_messages_are_built_only_in_transport(package: str) -> None:
    """No package builds a protobuf message itself: transport/codec.py (or NodeClient's typed
    methods) does, from plain values; the rest only reads what comes back (issue 17), the
    node's gRPC servicer (node/service.py) included."""
    src = Path(potluck.__file__).parent
    paths = sorted((src / package).rglob("*.py"))
    found = [hit for path in paths for hit in _wire_constructions(path)]
    assert not found, f"potluck.{package} builds wire messages: {found}"


def test_the_wire_check_sees_a_construction(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from potluck.transport import potluck_pb2 as wire\n"
        "from potluck.transport.potluck_pb2 import DropRequest\n"
        "a = wire.LoadRequest(plan_id='p')\n"
        "b = DropRequest()\n"
        "c = wire.LoadReply.FromString(b'')\n"  # a reply read from bytes: not built here
    )
    assert _wire_constructions(sample) == ["sample.py:3 LoadRequest", "sample.py:4 DropRequest"]


def _environment_reads(path: Path) -> list[str]:
    """Where a module reads the environment: os.environ / os.getenv / os.putenv, by attribute or
    by name imported from os."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            found.append(f"{path.name}:{node.lineno} {node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [
                f"{path.name}:{node.lineno} {a.name}"
                for a in node.names
                if a.name in ("environ", "getenv", "putenv")
            ]
    return found


def test_only_the_cli_reads_the_environment() -> None:
    """STYLE rule 12: settings are made once at the edge (cli/: Compute, Places, the flags) and
    handed down; no other package reads an environment variable."""
    src = Path(potluck.__file__).parent
    paths = [p for p in sorted(src.rglob("*.py")) if "cli" not in p.relative_to(src).parts]
    found = [hit for path in paths for hit in _environment_reads(path)]
    assert not found, f"modules outside potluck/cli read the environment: {found}"


def test_the_environment_check_sees_a_read(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nfrom os import getenv\na = os.environ.get('X')\nb = getenv('Y')\n"
    )
    assert _environment_reads(sample) == ["sample.py:2 getenv", "sample.py:3 environ"]
