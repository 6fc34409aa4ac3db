"""A stage's weights move into one mapping backed by 2 MiB pages (Stage.huge_pages,
kernels/native.huge_page_arena): every kernel then reads them there and computes the same logits,
in this process and on a worker.

Linux only, and only where transparent huge pages are not switched off: elsewhere these tests
skip and say why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from potluck.engine.generate import load_model
from potluck.engine.pipeline import Assignment
from potluck.kernels import native
from potluck.model.stage import SeqChunk, Stage
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.hparams import hparams_from_metadata
from test_pool import _stop, start_worker


def _skip_without_huge_pages() -> None:
    if native.huge_page_arena(4 << 20) is None:
        pytest.skip("no transparent huge pages here (not Linux, or switched off)")


def _huge_kib(pid: int | str = "self", at: int | None = None) -> int:
    """AnonHugePages (KiB) of a process, or of its mapping that holds address `at`."""
    total, inside = 0, at is None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = at is None or lo <= at < hi
        elif head == "AnonHugePages:" and inside:
            total += int(line.split()[1])
    return total


def _weights(stage: Stage) -> list[torch.Tensor]:
    return [
        t
        for m in stage.modules()
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if t.numel() * t.element_size() >= 16 << 10
    ]


def test_stage_weights_move_to_huge_pages_and_compute_the_same(smollm2_path: Path) -> None:
    _skip_without_huge_pages()
    f = GGUFFile(smollm2_path)
    hp = hparams_from_metadata(f.metadata)
    plain = Stage(hp, f, 0, hp.n_layer, 64, huge_pages=False)
    moved = Stage(hp, f, 0, hp.n_layer, 64, huge_pages=False)
    assert plain.arena is None
    size = sum(t.numel() * t.element_size() for t in _weights(moved))
    assert moved.huge_pages() >= size  # all of them (each 64-byte aligned)
    assert moved.huge_pages() == moved.arena.numel()  # once: a second call moves nothing
    lo = moved.arena.data_ptr()
    for t in _weights(moved):
        assert lo <= t.data_ptr() < lo + moved.arena.numel(), "a weight stayed outside the arena"
    for m in moved.modules():  # the native matvecs point into the arena too (rebound)
        gemv = getattr(m, "_gemv", None)
        if gemv is not None:
            assert lo <= gemv.tensors[0].data_ptr() < lo + moved.arena.numel()
    # the OS backs the arena with huge pages (all but a partial last one)
    assert _huge_kib(at=lo) * 1024 >= moved.arena.numel() - (2 << 20)
    # the kernels read the moved weights (the native matvecs hold pointers: rebound)
    ids = torch.tensor([1, 510, 7, 42])
    want = plain(ids, [SeqChunk(0, 4)])
    got = moved(ids, [SeqChunk(0, 4)])
    assert torch.equal(got, want)
    for step in (13, 99):  # decode steps: the batch-1 kernels
        t = torch.tensor([step])
        assert torch.equal(moved(t, [SeqChunk(0, 1)]), plain(t, [SeqChunk(0, 1)]))


def test_worker_stage_is_in_huge_pages(smollm2_path: Path) -> None:
    _skip_without_huge_pages()
    f = GGUFFile(smollm2_path)
    hp = hparams_from_metadata(f.metadata)
    size = sum(
        t.numel() * t.element_size()
        for t in _weights(Stage(hp, f, 0, hp.n_layer, 64, huge_pages=False))
    )
    proc, addr = start_worker()
    try:
        idle = _huge_kib(proc.pid)
        pool = load_model(smollm2_path, n_ctx=64, assignments=[Assignment(addr, 0, hp.n_layer)])
        grown = (_huge_kib(proc.pid) - idle) * 1024
        assert grown >= 0.9 * size, f"{grown >> 20} of {size >> 20} MiB in huge pages"
        pool.close()
    finally:
        _stop(proc)


def test_large_weights_go_into_huge_pages_where_they_lie(gemma3_path: Path) -> None:
    """Gemma-3's 262144 x 640 head (≈ 170 MB): collapsed in place where the kernel can (6.1+),
    else moved like the rest; in huge pages either way, and the logits do not change."""
    _skip_without_huge_pages()
    f = GGUFFile(gemma3_path)
    hp = hparams_from_metadata(f.metadata)
    plain = Stage(hp, f, hp.n_layer - 1, hp.n_layer, 64, huge_pages=False)
    moved = Stage(hp, f, hp.n_layer - 1, hp.n_layer, 64, huge_pages=False)
    head = moved.output.packed
    before = head.data_ptr()
    size = head.numel() * head.element_size()
    assert size >= 32 << 20
    moved.huge_pages()
    head = moved.output.packed
    assert (head.data_ptr() == before) == (
        moved.arena is None
        or not (
            moved.arena.data_ptr() <= head.data_ptr() < moved.arena.data_ptr() + moved.arena.numel()
        )
    )
    inside = -(-head.data_ptr() // (2 << 20)) * (2 << 20)  # its first whole 2 MiB page
    assert _huge_kib(at=inside) * 1024 >= size - (4 << 20)
    x = torch.randn(2, hp.n_embd)
    assert torch.equal(moved(x, [SeqChunk(0, 2)]), plain(x, [SeqChunk(0, 2)]))
