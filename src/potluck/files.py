"""Files that several processes write at once: a lock between processes, a private temporary
name for a write that ends in an atomic rename.

Two workers on one machine (one per GPU) share one cache; a head and a worker may share it too.
Each writer writes its own temporary file and renames it into place (`os.replace` is atomic), and
a writer that must see what the others did first (a blob kept from a broken transfer, a
certificate being made) holds the lock of that file while it looks and writes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path


def private_tmp(path: Path) -> Path:
    """A temporary name beside `path` that no other process or thread uses."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing; kept afterwards: removing a
    lock file that another process waits on would let a third one lock a new file beside it).
    Blocks until the lock is free. The system drops the lock when the process ends, killed
    included, so a crashed writer never blocks the next one. Threads of one process must also be
    kept apart by a threading lock: the lock is the open file's, taken per call here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _lock(fd)
        try:
            yield
        finally:
            _unlock(fd)
    finally:
        os.close(fd)


if sys.platform == "win32":
    import msvcrt

    def _lock(fd: int) -> None:
        while True:  # LK_LOCK gives up after 10 tries a second apart: keep waiting
            try:
                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
                return
            except OSError:
                time.sleep(0.05)

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
