"""A TCP proxy that adds a fixed one-way delay to every byte, in both directions: latency for
tests, since netem is not available here. Bandwidth is not limited (use tc tbf for that).

    python tests/delay_proxy.py LISTEN_HOST:PORT TARGET_HOST:PORT DELAY_MS

Prints "ready" once it listens. Each direction of each connection is a queue of (due time, bytes):
a reader stamps what it reads with now + delay, a writer sends it when due, so order is kept and
throughput is not throttled by the delay.
"""

from __future__ import annotations

import asyncio
import sys
import time


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await q.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(65536):
            q.put_nowait((time.monotonic() + delay, data))
    except ConnectionError:
        pass  # the other side went away: end this direction
    q.put_nowait((0.0, b""))
    await sender


async def main() -> None:
    listen, target, delay_ms = sys.argv[1], sys.argv[2], float(sys.argv[3])
    lhost, lport = listen.rsplit(":", 1)
    thost, tport = target.rsplit(":", 1)
    delay = delay_ms / 1e3

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.open_connection(thost, int(tport))
        except OSError:
            cw.close()
            return
        await asyncio.gather(pipe(cr, tw, delay), pipe(tr, cw, delay), return_exceptions=True)

    server = await asyncio.start_server(handle, lhost, int(lport))
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
