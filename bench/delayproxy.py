"""A small userspace TCP proxy that adds latency and a per-connection window, like a long-haul link.

``netem`` is not available on this kernel, so latency comes from here: every chunk read on one side is
written to the other side ``rtt/2`` later, and each connection direction may have at most ``window``
bytes "in flight"; a chunk's credit comes back one full RTT after it was read (as a TCP ACK would).
So one stream moves at most ``window / rtt`` bytes per second, a request/response costs one RTT, and
only many concurrent streams fill a fat link -- the regime sharding and concurrency are built for.
The link's rate limit itself is ``tc tbf`` on the veth pair (see :mod:`bench.wan`).

    python -m bench.delayproxy --listen 127.0.0.1:9100 --target 10.201.7.2:9000 --rtt-ms 80 --window-kb 1024

``--transparent`` (instead of ``--target``) serves connections that an iptables ``REDIRECT`` sent here:
each goes to its original destination (``SO_ORIGINAL_DST``), from a socket marked ``MARK`` so the rule
(``-m mark ! --mark 0x5b``) lets it through instead of redirecting it again (see :class:`bench.wan.Star`).
The destination is known only once the client is connected, so a refused destination shows up to the
client as a connection reset right after its connect succeeded.

``--stats FILE`` keeps ``{"out": bytes, "in": bytes, "connections": n}`` in FILE (out: client to remote,
as forwarded), rewritten atomically at most every 0.2 s while bytes move and once on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import socket
import struct
from collections.abc import Callable
from pathlib import Path

CHUNK = 64 * 1024
MARK = 0x5B
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h; not exported by the socket module
STATS_EVERY_S = 0.2


class Stats:
    """Bytes forwarded per direction and connections, flushed to a JSON file (if any) by the event loop:
    at most every ``STATS_EVERY_S`` while they change, so a reader polling the file costs the proxy
    nothing and a busy stream is not slowed by a write per chunk."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.counts = {"out": 0, "in": 0, "connections": 0}
        self._pending: asyncio.TimerHandle | None = None
        self._last = float("-inf")

    def add(self, key: str, n: int) -> None:
        self.counts[key] += n
        if self.path is None or self._pending is not None:
            return
        loop = asyncio.get_running_loop()
        self._pending = loop.call_at(max(loop.time(), self._last + STATS_EVERY_S), self.flush)

    def flush(self) -> None:
        """Write the file now (tmp + rename: a reader never sees half of it)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self.path is None:
            return
        self._last = asyncio.get_running_loop().time()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.counts))
        os.replace(tmp, self.path)


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    half: float,
    window: int,
    sent: Callable[[int], None] = lambda n: None,
) -> None:
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
            sent(len(data))
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


def original_dst(sock: socket.socket) -> tuple[str, int]:
    """Where the client meant to connect before iptables ``REDIRECT`` sent it here."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack("!2xH4s8x", raw)
    return socket.inet_ntoa(addr), port


async def _connect_marked(dst: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to ``dst`` from a socket carrying ``MARK``, which the REDIRECT rule leaves alone."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, dst)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=4 * CHUNK)


async def _serve(
    listen: tuple[str, int], target: tuple[str, int] | None, rtt_s: float, window: int, stats: Stats
) -> None:
    """Forward to ``target``, or with ``target=None`` transparently to each connection's original
    destination."""
    half = rtt_s / 2

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            if target is not None:
                sr, sw = await asyncio.open_connection(*target)
            else:
                dst = original_dst(cw.get_extra_info("socket"))
                if dst == cw.get_extra_info("sockname")[:2]:
                    raise ConnectionRefusedError("connected to the proxy itself, not redirected")
                sr, sw = await _connect_marked(dst)
        except OSError:
            if target is None:  # reset, not a clean EOF: the nearest thing to the refusal it stands for
                cw.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            cw.close()
            return
        stats.add("connections", 1)
        # connection set-up costs one RTT, as on the real link
        await asyncio.sleep(rtt_s)
        await asyncio.gather(
            _pipe(cr, sw, half, window, lambda n: stats.add("out", n)),
            _pipe(sr, cw, half, window, lambda n: stats.add("in", n)),
            return_exceptions=True,
        )
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
    stats.flush()  # the file exists (zeros) once the proxy listens
    async with server:
        await stop.wait()
        stats.flush()  # final counts before anything else can hold up the exit


def _hostport(s: str) -> tuple[str, int]:
    host, port = s.rsplit(":", 1)
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.delayproxy", description=__doc__.split("\n")[0])
    ap.add_argument("--listen", required=True, type=_hostport)
    dst = ap.add_mutually_exclusive_group(required=True)
    dst.add_argument("--target", type=_hostport)
    dst.add_argument(
        "--transparent",
        action="store_true",
        help="forward each connection to its original destination (arrived through iptables REDIRECT)",
    )
    ap.add_argument("--rtt-ms", type=float, default=80.0)
    ap.add_argument("--window-kb", type=int, default=1024)
    ap.add_argument(
        "--stats", type=Path, default=None, help="keep the forwarded byte counts in this JSON file"
    )
    a = ap.parse_args(argv)
    asyncio.run(_serve(a.listen, a.target, a.rtt_ms / 1000, a.window_kb * 1024, Stats(a.stats)))


if __name__ == "__main__":
    main()
