"""Real-size pools: a model that no machine of the pool can hold.

The 14B-shape model that bench/make_model.py builds (Qwen2.5-14B's shape: 48 layers, 5120 wide,
Q4_K_M, 8.4 GiB of weights; the real header of DeepSeek-R1-Distill-Qwen's family, random weights
of each tensor's own type) runs on two `potluck worker` processes, each confined to a memory
cgroup of 6 GiB that the kernel enforces, the head holding no layers (--mem 0). What is faked: the
second machine (both workers share this machine's cores, disk and page cache; each worker's
reads of the file are charged to its own group, as the file is dropped from the page cache first).

Slow: building the model (≈ 35 s once, then cached under ~/.cache/potluck/bench, 8.4 GiB of disk),
one uncapped run (≈ 25 s) and the pool's runs (≈ 50 s).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cgroups import MemoryCgroup, Unavailable
from potluck.modelfile.sources import Places
from workers import Spawn, Worker
from workers import spawn_module_worker as spawn_module_worker
from workers import spawn_worker as spawn_worker

pytestmark = pytest.mark.slow

CAP = 6 << 30  # each worker's memory cgroup
CAP_MOE = 12 << 30  # ... for the 30B-A3B
REPO = Path(__file__).resolve().parents[1]
PROMPT = "Hello there"
N = "6"


def _make_model():
    spec = importlib.util.spec_from_file_location("make_model", REPO / "bench" / "make_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_model"] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model14b() -> Path:
    mm = _make_model()
    path = mm.default_path("qwen14b")
    if not mm.is_complete(path):
        cache = Places.of(os.environ, Path.home()).cache
        free = shutil.disk_usage(cache if cache.exists() else Path.home()).free
        if free < 12 << 30:
            pytest.skip(f"the 14B-shape model needs 9 GiB of disk, {free / 2**30:.1f} GiB free")
    return mm.ensure_model("qwen14b")


def _forget_pages(path: Path) -> None:
    """Drop the file from the page cache, so that each worker's reads are charged to its group."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass
class CappedWorker:
    worker: Worker
    group: MemoryCgroup

    @property
    def address(self) -> str:
        return self.worker.address

    def said(self) -> str:
        return self.worker.log

    def peak_rss_bytes(self) -> int:
        """The process's peak resident memory (VmHWM)."""
        status = Path(f"/proc/{self.worker.proc.pid}/status").read_text()
        found = re.search(r"VmHWM:\s+(\d+) kB", status)
        assert found, status
        return int(found.group(1)) * 1024


def _memory_facts() -> str:
    """The machine's and this process's memory, for an error message."""
    keys = ("MemTotal", "MemAvailable", "CommitLimit", "Committed_AS", "SwapTotal")
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    status = Path("/proc/self/status").read_text().splitlines()
    facts = [line for line in meminfo if line.split(":")[0] in keys]
    facts += [line for line in status if line.split(":")[0] in ("VmSize", "VmRSS", "VmData")]
    mode = Path("/proc/sys/vm/overcommit_memory").read_text().strip()
    return f"overcommit_memory {mode}; " + "; ".join(" ".join(f.split()) for f in facts)


def _start(spawn: Spawn, group: MemoryCgroup, model_dir: Path) -> CappedWorker:
    """A worker in `group` (the group's shell execs it), with the model's folder."""
    try:
        worker = spawn(
            "--no-mdns", "--model-dir", str(model_dir), prefix=group.command([]), timeout=90
        )
    except OSError as exc:  # (seen once in CI: ENOMEM) say what the memory looked like
        raise RuntimeError(f"cannot start a worker: {exc}; {_memory_facts()}") from exc
    return CappedWorker(worker, group)


@pytest.fixture(scope="module")
def capped(spawn_module_worker: Spawn, model14b: Path) -> Iterator[list[CappedWorker]]:
    """Two workers, each in its own 6 GiB memory cgroup, that have the model file."""
    groups: list[MemoryCgroup] = []
    try:
        for name in ("a", "b"):
            groups.append(MemoryCgroup.make(name, CAP))
    except Unavailable as exc:
        for g in groups:
            g.remove()
        pytest.skip(str(exc))
    _forget_pages(model14b)
    workers = []
    try:
        for g in groups:
            workers.append(_start(spawn_module_worker, g, model14b.parent))
        yield workers
    finally:
        for w in workers:  # before their groups go
            w.worker.stop(timeout=20)
        for g in groups:
            g.remove()


def _potluck(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "potluck.cli", *args, "--no-mdns"],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _bytes(text: str) -> int:
    number, unit = text.split()
    return int(float(number) * _UNITS[unit])


SIZE = r"(\d+(?:\.\d+)? (?:B|KiB|MiB|GiB))"
HELD = re.compile(
    rf"layers (\d+)–(\d+) → (\S+) \(cpu\) · holds {SIZE} \+ KV {SIZE}, RSS {SIZE} "
    rf"\(planned {SIZE} \+ KV {SIZE} \+ buffers {SIZE}\)"
)


@pytest.mark.parametrize(("name", "gib"), [("qwen30b-a3b", 18), ("qwen36-35b-a3b", 21)])
def test_moe_on_two_capped_workers_equals_one_uncapped_process(
    spawn_worker: Spawn, name: str, gib: int
) -> None:
    """The mixtures of experts people pool: Qwen3-30B-A3B's shape (48 layers, 128 experts, 8 per
    token; 17.3 GiB at Q4_K_M) and the hybrid Qwen3.6-35B-A3B's (40 layers, 30 of them Gated
    DeltaNet, 256 experts, 8 per token; 19.7 GiB) on two workers of 12 GiB each, which neither
    can hold alone. Its workers and groups end with the test, before the 14B's are made (not
    both at once)."""
    if name == "qwen36-35b-a3b" and not os.environ.get("POTLUCK_HEAVY"):
        # 19.7 GiB in two 12 GiB groups leaves this 24 GiB machine nothing for the suite's other
        # xdist worker: in `.ci/run` a capped worker died (refused connections, 472 s); alone it
        # passes in 90 s (bench/RESULTS.md). By hand: POTLUCK_HEAVY=1 pytest -k qwen36
        pytest.skip("the 35B-A3B pool needs the machine to itself: POTLUCK_HEAVY=1 runs it")
    mm = _make_model()
    path = mm.default_path(name)
    if not mm.is_complete(path):
        cache = Places.of(os.environ, Path.home()).cache
        free = shutil.disk_usage(cache if cache.exists() else Path.home()).free
        if free < (gib + 4) << 30:
            pytest.skip(f"the {name}-shape model needs {gib} GiB of disk, {free / 2**30:.1f} free")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total < 2 * CAP_MOE - (1 << 30):
        pytest.skip(f"two 12 GiB workers need 23 GiB of RAM, this machine has {total / 2**30:.1f}")
    model = mm.ensure_model(name)
    groups: list[MemoryCgroup] = []
    workers: list[CappedWorker] = []
    try:
        for name in ("moe-a", "moe-b"):
            groups.append(MemoryCgroup.make(name, CAP_MOE))
        _forget_pages(model)
        workers = [_start(spawn_worker, g, model.parent) for g in groups]
        _pool_equals_one_process(model, workers)
    except Unavailable as exc:
        pytest.skip(str(exc))
    finally:
        for w in workers:
            w.worker.stop(timeout=20)
        for g in groups:
            g.remove()


def test_workers_report_their_cgroups_room(capped: list[CappedWorker]) -> None:
    """A worker in a 6 GiB group offers what the group has left, not the machine's free RAM."""
    from potluck.pool.survey import survey

    nodes, _ = survey([w.address for w in capped], pings=1)
    for node in nodes[1:]:
        assert 4 << 30 < node.memory_bytes <= CAP - (256 << 20), node


def test_14b_on_two_capped_workers_equals_one_uncapped_process(
    model14b: Path, capped: list[CappedWorker]
) -> None:
    _pool_equals_one_process(model14b, capped)


def _pool_equals_one_process(model: Path, capped: list[CappedWorker]) -> None:
    """`plan` and `run` over the capped workers, the head holding no layers: no single machine
    holds the model, nobody is OOM-killed, each holds what the plan counted, and the text is one
    uncapped process's."""
    peers = [a for w in capped for a in ("--peer", w.address)]
    plan = _potluck("plan", "-m", str(model), "--mem", "0", *peers)
    assert plan.returncode == 0, plan.stderr
    assert "no single machine can hold the model" in plan.stdout, plan.stdout
    assert "left out: this machine" in plan.stdout, plan.stdout

    pool = _potluck("run", "-m", str(model), "--mem", "0", *peers, "--temp", "0", "-n", N, PROMPT)
    assert pool.returncode == 0, pool.stderr
    for w in capped:
        assert w.worker.alive(), f"worker {w.address} died: {w.said()}"
        assert w.group.oom_kills() == 0, f"the OOM killer ended a process of {w.address}'s group"
    # what each worker holds, beside what the plan counted: the same within 5 %
    held = [HELD.search(line) for line in pool.stderr.splitlines()]
    held = [m for m in held if m]
    assert sorted(m.group(3) for m in held) == sorted(w.address for w in capped), pool.stderr
    assert sorted((int(m.group(1)), int(m.group(2))) for m in held)[0][0] == 0
    for m in held:
        weights, kv, _rss, p_weights, p_kv, p_buffers = (_bytes(m.group(i)) for i in range(4, 10))
        assert abs((weights + kv) - (p_weights + p_kv)) <= 0.05 * (p_weights + p_kv), m.group(0)
        # the worker's peak resident memory over load and decode: within what the plan counted
        worker = next(w for w in capped if w.address == m.group(3))
        assert worker.peak_rss_bytes() <= p_weights + p_kv + p_buffers + (100 << 20), (
            worker.address, worker.peak_rss_bytes(), m.group(0)
        )  # fmt: skip

    alone = _potluck("run", "-m", str(model), "--temp", "0", "-n", N, PROMPT)
    assert alone.returncode == 0, alone.stderr
    assert pool.stdout == alone.stdout and alone.stdout.strip()


def test_14b_on_one_capped_worker_is_refused_before_loading(
    model14b: Path, capped: list[CappedWorker]
) -> None:
    """One 6 GiB worker and a head with no room: `plan` and `run` say what is short, in one
    line with the numbers, and nothing is loaded."""
    one = capped[0]
    before = one.said()
    for command in (["plan"], ["run", "--temp", "0", "-n", "4", PROMPT]):
        done = _potluck(*command, "-m", str(model14b), "--mem", "0", "--peer", one.address)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        said = done.stderr.strip().splitlines()[-1]
        assert said.startswith("error: the model needs "), done.stderr
        assert "short" in said and one.address in said and "this machine: 0 B" in said, said
        assert "Traceback" not in done.stderr
        # the planner refused it: no Load reached the worker (a Load logs what it loads, or
        # that it has no copy of the model)
        new = one.said()[len(before) :]
        assert "loaded plan" not in new and "no local copy" not in new, new
