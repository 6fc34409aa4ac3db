"""Waiting for the next frame on a data connection without letting the core fall asleep.

A stage waits between tokens while the other stages compute (a few ms per token). If its thread
blocks, the core goes idle and waking it costs: on this project's 2-vCPU VM a stage computed
7–12 % slower right after a 5 ms pause than back to back, and two single-core stages that only
signal each other over a pipe reached 0.84–0.93× of one process's SmolLM2 decode blocking and
0.97–1.02× polling (bench_ceiling.py, bench/RESULTS.md). So a node
polls its data connections for a while before it blocks, as llama.cpp's threads poll for work
(its --poll). One thread per process polls at a time, never while a stage of this process
computes (`computing`), and each round yields the core to any other thread or process that wants
it (`os.sched_yield`; the poll and the yield both release the GIL).

Windows has neither `select.poll` nor `os.sched_yield`: there a node polls with `select.select`
(which takes sockets on every system) and yields with `time.sleep(0)` (Windows' Sleep(0)), chosen
once, at import, by what the system has (`POLL`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

from potluck.transport.dataplane import Wait

DEFAULT_SPIN_S = 0.02  # how long a node polls a data connection for the next frame (seconds)
REHEARSE_EVERY_S = 250e-6  # while polling, how often the node rehearses its receive path
READABLE, TIMED_OUT, NOT_POLLING = 1, 0, -1  # what poll_readable says

# What this system polls and yields with: poll(2) and sched_yield(2) on Linux and macOS; on
# Windows select() and time.sleep(0) (its Sleep(0): the rest of the time slice to another
# thread). tests/test_spin.py runs a pool with the POSIX pair taken away.
POLL = "poll" if hasattr(select, "poll") else "select"
_yield_core: Callable[[], None] = getattr(os, "sched_yield", functools.partial(time.sleep, 0))
_computing = [0]  # threads of this process inside a stage's compute
_spinning = threading.Lock()  # held by the one thread that polls


@contextlib.contextmanager
def computing() -> Iterator[None]:
    """`with computing():` around a stage's compute: no thread of this process polls meanwhile
    (a polling thread would take the core from the compute on a single-core worker)."""
    _computing[0] += 1
    try:
        yield
    finally:
        _computing[0] -= 1


def poll_readable(fd: int, budget_s: float) -> int:
    """Wait for `fd` to be readable by polling it in a loop for at most `budget_s`: READABLE
    (data, its end, or an error), TIMED_OUT, or NOT_POLLING (no budget, another thread of this
    process polls already, or a stage computes here), after which the caller blocks as usual."""
    if budget_s <= 0 or not _spinning.acquire(blocking=False):
        return NOT_POLLING
    try:
        ready = _readable_now(fd)
        end = time.monotonic() + budget_s
        while True:
            if ready(0):
                return READABLE  # data, end of stream or an error
            if _computing[0]:
                return NOT_POLLING
            if time.monotonic() >= end:
                return TIMED_OUT
            _yield_core()  # whatever else wants this core (the head, a reply's reader) first
    finally:
        _spinning.release()


def _readable_now(fd: int) -> Callable[[float], object]:
    """A check, `ready(0)`, true when `fd` is readable (data, end of stream or an error): a
    poll object's `poll` where the system has poll(2), else `select.select` on `fd` alone."""
    if POLL == "poll":
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return poller.poll
    return lambda timeout: select.select([fd], [], [], timeout)[0]


def spin_readable(fd: int, budget_s: float) -> bool:
    """`poll_readable(fd, budget_s) == READABLE`."""
    return poll_readable(fd, budget_s) == READABLE


def spin_wait(budget_s: float, rehearse: Callable[[], None] | None = None) -> Wait | None:
    """The wait a node runs before each read on its data connections: poll for up to budget_s,
    then block as usual. None when budget_s is 0 (block at once).

    rehearse (must not raise) runs every REHEARSE_EVERY_S while the poll waits: a worker checks
    its last request again, computing nothing. Why: its compute streams all of its weights
    through the core's caches, and the Python that follows (read, parse, check the next request)
    then runs from memory, 10-30× slower than from cache (≈ 60 µs instead of 6 for a hidden
    state's decoding alone). Rehearsed, that path is in the cache when the frame comes, and the
    core had nothing else to do."""
    if budget_s <= 0:
        return None

    def wait(sock: socket.socket) -> None:
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return  # a decrypted record is waiting: the read will not block
        if rehearse is None:
            spin_readable(sock.fileno(), budget_s)
            return
        deadline = time.monotonic() + budget_s
        while (left := deadline - time.monotonic()) > 0:
            if poll_readable(sock.fileno(), min(left, REHEARSE_EVERY_S)) != TIMED_OUT:
                return  # readable, or not this thread's turn to poll: read (or block)
            rehearse()

    return wait
