"""What a node says it can hold: usable memory under a memory cgroup.

The v1 path runs against the real kernel in tests/test_real_size.py (workers in 6 GiB groups).
The files below stand in for the kernel's where this machine cannot have them: a cgroup v2 tree
(this machine mounts v1) and limits set on an ancestor.
"""

from __future__ import annotations

from pathlib import Path

from potluck.node.probe import cgroup_room_bytes


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_v2_room_is_the_tightest_ancestor(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/outer/inner\n")
    root = tmp_path / "fs"
    _tree(
        root,
        {
            "outer/memory.max": str(3 << 30),
            "outer/memory.current": str(2 << 30),
            "outer/memory.stat": f"anon 1\nfile {1 << 29}\ninactive_file {1 << 28}\n",
            "outer/inner/memory.max": "max",
            "outer/inner/memory.current": str(1 << 30),
            "outer/inner/memory.stat": "file 0\n",
        },
    )
    # outer: 3 GiB - (2 GiB - 0.5 GiB of file cache) = 1.5 GiB; inner has no limit
    assert cgroup_room_bytes(proc, root) == (3 << 30) - (2 << 30) + (1 << 29)


def test_v1_room_uses_the_hierarchical_limit(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu:/\n4:memory:/pool/w1\n0::/\n")
    root = tmp_path / "fs"
    _tree(
        root,
        {
            "memory/pool/w1/memory.limit_in_bytes": "9223372036854771712",
            "memory/pool/w1/memory.usage_in_bytes": str(1 << 30),
            "memory/pool/w1/memory.stat": (
                f"cache 5\nhierarchical_memory_limit {4 << 30}\ntotal_inactive_file {1 << 28}\n"
                f"total_active_file {1 << 27}\n"
            ),
        },
    )
    assert cgroup_room_bytes(proc, root) == (4 << 30) - (1 << 30) + (1 << 28) + (1 << 27)


def test_no_limit_is_none(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/\n")
    root = tmp_path / "fs"
    _tree(
        root,
        {
            "memory/memory.limit_in_bytes": "9223372036854771712",
            "memory/memory.usage_in_bytes": "100",
            "memory/memory.stat": "hierarchical_memory_limit 9223372036854771712\n",
        },
    )
    assert cgroup_room_bytes(proc, root) is None
    assert cgroup_room_bytes(tmp_path / "missing", root) is None
