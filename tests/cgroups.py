"""Memory cgroups for tests: a real limit the kernel enforces on a worker process.

`MemoryCgroup.make(name, limit)` creates a group under the memory controller (cgroup v1's
/sys/fs/cgroup/memory, or v2's unified tree), `command` wraps a command so that its process joins
the group before it execs, `oom_kills` and `peak_bytes` read what the kernel recorded. (Not
`preexec_fn`: with it Python forks the whole test process instead of vforking, and the fork of a
test process that has mapped gigabytes fails with ENOMEM where the kernel accounts memory
strictly, as seen in CI.) Needs root and a writable cgroup tree: `MemoryCgroup.make` raises
`Unavailable` with the reason otherwise (tests skip).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class Unavailable(RuntimeError):
    """No memory cgroup can be made here (not root, no memory controller, read-only tree)."""


class MemoryCgroup:
    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2

    @classmethod
    def make(cls, name: str, limit_bytes: int) -> MemoryCgroup:
        if os.geteuid() != 0:
            raise Unavailable("memory cgroups need root")
        v1 = ROOT / "memory"
        if (v1 / "memory.limit_in_bytes").exists():
            group = cls(v1 / f"potluck-test-{name}-{os.getpid()}", v2=False)
            limit_file = "memory.limit_in_bytes"
        elif (ROOT / "cgroup.controllers").exists():
            if "memory" not in (ROOT / "cgroup.controllers").read_text().split():
                raise Unavailable("cgroup v2 without the memory controller")
            with contextlib.suppress(OSError):  # may be on already; a child needs it on
                (ROOT / "cgroup.subtree_control").write_text("+memory")
            group = cls(ROOT / f"potluck-test-{name}-{os.getpid()}", v2=True)
            limit_file = "memory.max"
        else:
            raise Unavailable("no cgroup memory controller mounted at /sys/fs/cgroup")
        try:
            group.path.mkdir(exist_ok=True)
            (group.path / limit_file).write_text(str(limit_bytes))
            if not group.v2:
                with contextlib.suppress(OSError):  # no swap here; where there is, none either
                    (group.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError as exc:
            group.remove()
            raise Unavailable(f"cannot make a memory cgroup at {group.path}: {exc}") from None
        return group

    def command(self, cmd: list[str]) -> list[str]:
        """`cmd` started by a shell that first puts itself (then `cmd`, which it execs) in the group."""
        return [
            "/bin/sh",
            "-c",
            'echo $$ > "$0" && exec "$@"',
            str(self.path / "cgroup.procs"),
            *cmd,
        ]

    def _counter(self, file: str, key: str) -> int:
        try:
            for line in (self.path / file).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
        except OSError:
            pass
        return 0

    def oom_kills(self) -> int:
        """Processes of this group the kernel's OOM killer ended."""
        if self.v2:
            return self._counter("memory.events", "oom_kill")
        return self._counter("memory.oom_control", "oom_kill")

    def peak_bytes(self) -> int | None:
        """The most memory the group held (page cache included), where the kernel says."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        """Remove the group once its processes are gone (waits a little for them to exit)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
