"""Waiting for the next frame on a data connection without letting the core fall asleep.

A stage waits between tokens while the other stages compute (a few ms per token). If its thread
blocks, the core goes idle and waking it costs: on this project's 2-vCPU VM a stage computed
7–12 % slower right after a 5 ms pause than back to back, and two single-core stages that only
signal each other over a pipe reached 0.84–0.93× of one process's SmolLM2 decode blocking and
0.97–1.02× polling (bench_ceiling.py, bench/RESULTS.md). So a node
polls its data connections for a while before it blocks, as llama.cpp's threads poll for work
(its --poll). The polling is native code with the GIL released (kernels/native.spin_readable):
one thread per process at a time, never while a stage of this process computes, and it yields the
core to any other thread or process that wants it.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable

from potluck.transport.dataplane import Wait

DEFAULT_SPIN_S = 0.02  # how long a node polls a data connection for the next frame (seconds)
REHEARSE_EVERY_S = 250e-6  # while polling, how often the node rehearses its receive path


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
    from potluck.kernels.native import TIMED_OUT, poll_readable, spin_readable

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
