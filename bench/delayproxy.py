"""A small userspace TCP proxy that adds latency and a per-connection window, like a long-haul link.

``netem`` is not available on this kernel, so latency comes from here: every chunk read on one side is
written to the other side ``rtt/2`` later, and each connection direction may have at most ``window``
bytes "in flight"; a chunk's credit comes back one full RTT after it was read (as a TCP ACK would).
So one stream moves at most ``window / rtt`` bytes per second, a request/response costs one RTT, and
only many concurrent streams fill a fat link -- the regime sharding and concurrency are built for.
The link's rate limit itself is ``tc tbf`` on the veth pair (see :mod:`bench.wan`).

    python -m bench.delayproxy --listen 127.0.0.1:9100 --target 10.201.7.2:9000 --rtt-ms 80 --window-kb 1024
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal

CHUNK = 64 * 1024


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, half: float, window: int) -> None:
    loop = asyncio.get_running_loop()
    queue: collections.deque = collections.deque()
    have_data = asyncio.Event()
    credit = asyncio.Event()
    credit.set()
    inflight = 0

    def give_back(n: int) -> None:
        nonlocal inflight
        inflight -= n
        if inflight < window:
            credit.set()

    async def sender() -> None:
        while True:
            while not queue:
                have_data.clear()
                await have_data.wait()
            due, data = queue.popleft()
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if data is None:
                try:
                    if writer.can_write_eof():
                        writer.write_eof()
                except OSError:
                    pass
                return
            writer.write(data)
            await writer.drain()

    task = asyncio.create_task(sender())
    try:
        while True:
            await credit.wait()
            data = await reader.read(CHUNK)
            t = loop.time()
            queue.append((t + half, data if data else None))
            have_data.set()
            if not data:
                break
            inflight += len(data)
            if inflight >= window:
                credit.clear()
            loop.call_at(t + 2 * half, give_back, len(data))
        await task
    except (ConnectionError, OSError):
        task.cancel()


async def _serve(listen: tuple[str, int], target: tuple[str, int], rtt_s: float, window: int) -> None:
    half = rtt_s / 2

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(*target)
        except OSError:
            cw.close()
            return
        # connection set-up costs one RTT, as on the real link
        await asyncio.sleep(rtt_s)
        await asyncio.gather(_pipe(cr, sw, half, window), _pipe(sr, cw, half, window), return_exceptions=True)
        for w in (cw, sw):
            try:
                w.close()
            except OSError:
                pass

    server = await asyncio.start_server(handle, *listen, limit=4 * CHUNK)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _hostport(s: str) -> tuple[str, int]:
    host, port = s.rsplit(":", 1)
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.delayproxy", description=__doc__.split("\n")[0])
    ap.add_argument("--listen", required=True, type=_hostport)
    ap.add_argument("--target", required=True, type=_hostport)
    ap.add_argument("--rtt-ms", type=float, default=80.0)
    ap.add_argument("--window-kb", type=int, default=1024)
    a = ap.parse_args(argv)
    asyncio.run(_serve(a.listen, a.target, a.rtt_ms / 1000, a.window_kb * 1024))


if __name__ == "__main__":
    main()
