"""A TCP proxy whose link breaks: it forwards connections to a target until `cut_after` bytes
have come back from the target, then closes both sides of every connection and refuses new ones
(a cable pulled in the middle of a transfer). Threads, no asyncio: tests start it in-process.

    with CutProxy("127.0.0.1:50052", cut_after=8 << 20) as proxy:
        ...dial proxy.address...
    proxy.cut.is_set()  # whether the link broke
"""

from __future__ import annotations

import contextlib
import socket
import threading


class CutProxy:
    def __init__(self, target: str, cut_after: int) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.cut_after = cut_after
        self.cut = threading.Event()
        self.back = 0  # bytes forwarded from the target
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listen.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> CutProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return  # closed
            if self.cut.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while data := src.recv(65536):
                if counted:
                    with self._lock:
                        room = self.cut_after - self.back
                        self.back += min(len(data), max(room, 0))
                    if room <= len(data):
                        dst.sendall(data[: max(room, 0)])
                        self._break()
                        return
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _break(self) -> None:
        """Cut every connection: both sides see the link end mid-stream."""
        self.cut.set()
        self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._listen.close()
        self._close_all()
