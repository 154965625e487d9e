"""A fault-injecting HTTP proxy for tests: 127.0.0.1 only, in front of a real (test) S3 server.

    with FaultProxy(s3.endpoint_url, plan=cycle_plan()) as proxy:
        ... S3 clients use proxy.url as their endpoint ...
        proxy.injected        # {"503": n, "reset": n, "truncate": n, "slow": n, "corrupt": n}

Per request, ``plan(method, path, n)`` (``n`` counts requests from 0) picks a fault or None:

* ``"503"``: answer ``503 SlowDown`` (S3's throttling error) without forwarding;
* ``"reset"``: a GET is forwarded, then the response is cut off mid-body by a TCP reset; a request
  with a body (PUT/POST) is reset before it is forwarded (the server never sees it, as when a
  connection breaks while the client sends);
* ``"truncate"``: a GET's response announces its full Content-Length, sends half the body and closes;
* ``"slow"``: the response body is sent in small pieces with pauses;
* ``"corrupt"``: a GET's response arrives whole and well-formed, with the right length, but with bytes
  of its body changed (damage in transit that neither HTTP nor the length check can see). Other
  requests are forwarded untouched.

Torch-free; standard library only.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

Plan = Callable[[str, str, int], "str | None"]
_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
}
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


_FAILS = ("503", "reset", "truncate", "corrupt")  # the faults that make a request fail ("slow" only delays)


def cycle_plan(
    every: int = 4,
    faults: tuple[str, ...] = ("503", "reset", "truncate", "slow"),
    burst: int = 2,
    max_in_a_row: int = 3,
) -> Plan:
    """Every ``every``-th request gets the next fault of ``faults`` in turn; a ``503`` comes as a burst of
    ``burst`` consecutive requests. Body faults (reset, truncate) only hit GETs of objects and PUTs;
    ``corrupt`` (not in the default ``faults``) only GETs of objects.

    One request (the same method and path) fails at most ``max_in_a_row`` times in a row; its next try
    passes. Concurrent clients shift which request lands on a fault slot, and a retry that kept landing on
    one would exhaust any retry budget by chance: a client whose budget is above ``max_in_a_row`` always
    gets through, so a test of recovery never depends on the interleaving."""
    state = {"k": 0, "burst": 0}
    in_a_row: Counter = Counter()
    lock = threading.Lock()

    def pick(method: str, path: str, n: int) -> str | None:
        if state["burst"] > 0:
            state["burst"] -= 1
            return "503"
        if n % every != every - 1:
            return None
        fault = faults[state["k"] % len(faults)]
        state["k"] += 1
        if fault in ("reset", "truncate", "corrupt") and (
            method not in ("GET", "PUT") or "?" in path or (method == "PUT" and fault != "reset")
        ):
            return None  # listings, deletes: only throttled
        if fault == "503":
            state["burst"] = burst - 1
        return fault

    def plan(method: str, path: str, n: int) -> str | None:
        key = f"{method} {path}"
        with lock:
            if in_a_row[key] >= max_in_a_row:
                del in_a_row[key]
                return None
            fault = pick(method, path, n)
            if fault in _FAILS:
                in_a_row[key] += 1
            else:
                in_a_row.pop(key, None)
            return fault

    return plan


def _corrupted(data: bytes) -> bytes:
    """``data`` with one byte in every 4 KiB (and the last one) inverted: same length, different bytes."""
    out = bytearray(data)
    for i in {*range(0, len(out), 4096), len(out) - 1}:
        out[i] ^= 0xFF
    return bytes(out)


class FaultProxy:
    def __init__(
        self, upstream: str, plan: Plan | None = None, slow_chunk: int = 512, slow_pause_s: float = 0.002
    ) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.plan = plan or (lambda m, p, n: None)
        self.slow_chunk, self.slow_pause_s = slow_chunk, slow_pause_s
        self.injected: Counter = Counter()
        self.requests = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _next(self, method: str, path: str) -> str | None:
        with self._lock:
            n = self.requests
            self.requests += 1
        fault = self.plan(method, path, n)
        if fault:
            with self._lock:
                self.injected[fault] += 1
        return fault

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def _reset(self) -> None:
                self.close_connection = True
                try:
                    self.wfile.flush()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()  # linger 0: the peer sees a reset, not a clean end
                except OSError:
                    pass

            def _any(self) -> None:
                method = self.command
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._next(method, self.path)
                if fault == "503":
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(_SLOWDOWN)
                    return
                if fault == "reset" and body:
                    self._reset()
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.putrequest(method, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in _HOP:
                            conn.putheader(k, v)
                    conn.endheaders(body if body else None)
                    resp = conn.getresponse()
                    data = resp.read()
                    headers = [
                        (k, v) for k, v in resp.getheaders() if k.lower() not in _HOP | {"content-length"}
                    ]
                    status, reason = resp.status, resp.reason
                finally:
                    conn.close()
                self.send_response(status, reason)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                if fault == "truncate" and len(data) > 1:
                    self.send_header("Connection", "close")
                self.end_headers()
                if method == "HEAD":
                    return
                if fault == "corrupt" and method == "GET" and 200 <= status < 300 and data:
                    data = _corrupted(data)
                if fault in ("reset", "truncate") and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    if fault == "reset":
                        self._reset()
                    else:
                        self.close_connection = True
                    return
                if fault == "slow":
                    for i in range(0, len(data), proxy.slow_chunk):
                        self.wfile.write(data[i : i + proxy.slow_chunk])
                        self.wfile.flush()
                        time.sleep(proxy.slow_pause_s)
                    return
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass  # resets are the point

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
