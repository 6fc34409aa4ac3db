"""A stage's weights sit in 2 MiB pages (kernels/native.huge_pages): in this process, and on a
worker after the heap trim that follows a load (which splits huge pages that hold freed memory).

Linux only, and only where transparent huge pages are not switched off and the kernel has
MADV_COLLAPSE (6.1+): elsewhere these tests skip and say why.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from potluck.engine.generate import load_model
from potluck.engine.pipeline import Assignment
from potluck.kernels import native
from potluck.model.stage import Stage
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.hparams import hparams_from_metadata
from test_pool import _stop, start_worker

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _skip_without_thp() -> None:
    if platform.system() != "Linux" or not THP.exists():
        pytest.skip("transparent huge pages are a Linux feature")
    if "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are switched off on this machine")
    if native.huge_pages([torch.ones(8 << 20, dtype=torch.uint8)]) == 0:
        pytest.skip("this kernel cannot collapse memory into huge pages (MADV_COLLAPSE: 6.1+)")


def _huge_kib(pid: int | str = "self") -> int:
    """AnonHugePages of a process, KiB."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _weight_bytes(stage: Stage) -> int:
    return sum(
        t.numel() * t.element_size()
        for m in stage.modules()
        for t in [*vars(m).values(), *m.buffers(recurse=False)]
        if isinstance(t, torch.Tensor)
    )


def test_stage_weights_are_in_huge_pages(smollm2_path: Path) -> None:
    _skip_without_thp()
    f = GGUFFile(smollm2_path)
    hp = hparams_from_metadata(f.metadata)
    bare = Stage(hp, f, 0, hp.n_layer, 64, huge_pages=False)
    done = bare.huge_pages()
    weights = _weight_bytes(bare)
    # the weights lie in a few runs on the heap; a run's partial 2 MiB pages at its ends stay small
    print(f"{done >> 20} of {weights >> 20} MiB in huge pages")
    assert done >= 0.8 * weights, f"{done >> 20} of {weights >> 20} MiB in huge pages"
    assert _huge_kib() * 1024 >= done  # what the kernel reports for this process
    assert bare.huge_pages() >= done  # again: the same pages, still huge
    assert native.huge_pages([]) == 0


def test_worker_keeps_huge_pages_after_its_trim(smollm2_path: Path) -> None:
    """A worker trims its heap after loading a plan; the trim splits every huge page holding a
    freed buffer (most of them: the load's scratch lies between the weights), so the worker
    collapses them again after it."""
    _skip_without_thp()
    proc, addr = start_worker()
    try:
        idle = _huge_kib(proc.pid)
        f = GGUFFile(smollm2_path)
        hp = hparams_from_metadata(f.metadata)
        pool = load_model(smollm2_path, n_ctx=64, assignments=[Assignment(addr, 0, hp.n_layer)])
        weights = _weight_bytes(Stage(hp, f, 0, hp.n_layer, 64, huge_pages=False))
        grown = (_huge_kib(proc.pid) - idle) * 1024
        print(f"{grown >> 20} of {weights >> 20} MiB in huge pages")
        assert grown >= 0.7 * weights, f"{grown >> 20} of {weights >> 20} MiB in huge pages"
        pool.close()
    finally:
        _stop(proc)
