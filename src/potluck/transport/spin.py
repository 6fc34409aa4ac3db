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

from potluck.transport.dataplane import Wait

DEFAULT_SPIN_S = 0.02  # how long a node polls a data connection for the next frame (seconds)


def spin_wait(budget_s: float) -> Wait | None:
    """The wait a node runs before each read on its data connections: poll for up to budget_s,
    then block as usual. None when budget_s is 0 (block at once)."""
    if budget_s <= 0:
        return None
    from potluck.kernels.native import spin_readable

    def wait(sock: socket.socket) -> None:
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return  # a decrypted record is waiting: the read will not block
        spin_readable(sock.fileno(), budget_s)

    return wait
