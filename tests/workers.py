"""Real `potluck worker` processes for the tests, started one way.

`start_worker(*args)` starts `python -m potluck.cli worker -p 0 -t 1 *args` on 127.0.0.1 (-p 0:
the worker picks a free port itself, so no other process can take a port chosen here in between)
and returns once it listens, as a `Worker` with its address and data port. A thread reads the
worker's stderr as it comes (a pipe nobody reads fills up and stalls a worker that logs), so a
test can wait for a line (`Worker.wait_for`) instead of polling, and read the whole log after.

The fixtures `spawn_worker` (per test) and `spawn_module_worker` (per module, for module-scoped
fixtures) start workers the same way and stop every one they started at teardown. A test module
uses one by importing it, `from workers import spawn_worker as spawn_worker`: pytest finds
fixtures in the module's namespace, and the redundant alias marks the import as deliberate, so
that ruff does not read the test's parameter of the same name as a redefinition (F811).

Workers on tests/netns.py's namespace hosts start themselves (Host.popen, which also ends them
when the namespaces go): tests/test_discovery.py, tests/test_pool_netns.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from potluck.engine.generate import Model

START_S = 60.0  # a worker that does not listen by then is reported with what it said
STOP_S = 10.0  # SIGTERM, then SIGKILL after this long
_LISTENING = re.compile(r"listening on (\S+):(\d+) ")  # potluck/cli/worker.py: its start line
_DATA_PORT = re.compile(r"data port (\d+)")  # absent with --no-data-port ("no data port")


class _Stderr:
    """A process's stderr, read line by line by a thread of its own; waiters are woken per line."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: list[str] = []
        self._ended = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def text(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def line_with(self, needle: str, timeout: float) -> str | None:
        """The first line that contains `needle`, once said; None if the stream ends or `timeout`
        seconds pass first."""

        def found() -> str | None:
            return next((line for line in self._lines if needle in line), None)

        with self._changed:
            self._changed.wait_for(lambda: found() is not None or self._ended, timeout)
            return found()

    @property
    def ended(self) -> bool:
        """Whether the process has closed its stderr (it exited)."""
        with self._changed:
            return self._ended

    def drain(self, timeout: float) -> None:
        """Wait until the process has closed its stderr (it exited) and every line is read."""
        self._thread.join(timeout)


@dataclass(eq=False)
class Worker:
    """A running `potluck worker` on loopback."""

    proc: subprocess.Popen[str]
    address: str  # "127.0.0.1:PORT" (or -H's address)
    port: int
    data_port: int  # 0: none (--no-data-port)
    _stderr: _Stderr = field(repr=False)

    @property
    def log(self) -> str:
        """Everything the worker has said on stderr so far (all of it once it is stopped)."""
        return self._stderr.text()

    def wait_for(self, text: str, timeout: float) -> bool:
        """Whether the worker says a line containing `text` within `timeout` seconds."""
        return self._stderr.line_with(text, timeout) is not None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        """Resident memory in bytes."""
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def pause(self) -> None:
        """SIGSTOP: hung, not dead (its sockets stay open)."""
        self.proc.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL (no chance to tidy up), and reap it: its port is free on return."""
        self.proc.kill()
        self.proc.wait(timeout=STOP_S)

    def stop(self, timeout: float = STOP_S) -> str:
        """SIGCONT (a paused worker holds SIGTERM until it is continued), SIGTERM, SIGKILL after
        `timeout`; returns everything it said. A worker already ended is only reaped."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_S)
        self._stderr.drain(STOP_S)
        return self.log


def start_worker(
    *args: str,
    env: Mapping[str, str] | None = None,
    threads: int = 1,
    secret: str | None = None,
    port: int = 0,
    prefix: Sequence[str] = (),
    timeout: float = START_S,
) -> Worker:
    """`potluck worker -p PORT -t THREADS *args` on 127.0.0.1 (or -H's address), once it listens.

    env: variables over this process's environment, where mDNS is off (the tests name their
    peers) and POTLUCK_SECRET is unset unless `secret` is given. port: 0 (the worker picks a free
    one) unless a test must start a worker again on the port an earlier one had (or names it).
    prefix: a command that runs the worker (taskset, a cgroup's shell, `ip netns exec`); it must
    exec the worker, so that the signals reach it."""
    environ = {k: v for k, v in os.environ.items() if k != "POTLUCK_SECRET"}
    environ["POTLUCK_MDNS"] = "0"
    environ.update(env or {})
    if secret is not None:
        environ["POTLUCK_SECRET"] = secret
    cmd = [*prefix, sys.executable, "-m", "potluck.cli", "worker", "-p", str(port)]
    proc = subprocess.Popen(
        [*cmd, "-t", str(threads), *args], env=environ, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace",
    )  # fmt: skip
    assert proc.stderr is not None
    stderr = _Stderr(proc.stderr)
    line = stderr.line_with("listening on", timeout)
    if line is None:
        if stderr.ended:
            why = f"exited with code {proc.wait(timeout=STOP_S)}"
        else:
            proc.kill()
            proc.wait(timeout=STOP_S)
            why = f"not listening after {timeout:g} s"
        stderr.drain(STOP_S)
        command = " ".join(["potluck worker", *args])
        raise RuntimeError(f"`{command}` {why}; it said:\n{stderr.text()}")
    bound = _LISTENING.search(line)
    assert bound, line
    data = _DATA_PORT.search(line)
    host, bound_port = bound.group(1), int(bound.group(2))
    return Worker(
        proc, f"{host}:{bound_port}", bound_port, int(data.group(1)) if data else 0, stderr
    )


Spawn = Callable[..., Worker]  # start_worker's signature


def _spawned() -> Iterator[Spawn]:
    started: list[Worker] = []

    def spawn(*args: str, **kw) -> Worker:
        w = start_worker(*args, **kw)
        started.append(w)
        return w

    yield spawn
    for w in started:
        w.stop()


@pytest.fixture
def spawn_worker() -> Iterator[Spawn]:
    """`start_worker`, and every worker it started stopped when the test ends."""
    yield from _spawned()


@pytest.fixture(scope="module")
def spawn_module_worker() -> Iterator[Spawn]:
    """`start_worker` for module-scoped fixtures; its workers are stopped when the module ends."""
    yield from _spawned()


@contextlib.contextmanager
def smollm2_pool(spawn: Spawn, path: Path, n_ctx: int = 512) -> Iterator[Model]:
    """SmolLM2 over two worker processes (layers 0–13 and 14–29), the head holding none."""
    from potluck.engine.contract import Assignment
    from potluck.pool.build import load_model

    workers = [spawn().address for _ in range(2)]
    m = load_model(
        path, n_ctx, assignments=[Assignment(workers[0], 0, 14), Assignment(workers[1], 14, 30)]
    )
    try:
        yield m
    finally:
        m.close()
