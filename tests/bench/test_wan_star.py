"""The star WAN (bench.wan.Star) and the delay proxy's transparent mode and byte counts.

Timing assertions are lower bounds the emulation guarantees (a delayed request/response costs at least
the set-up RTT plus one round trip) and upper bounds far above them, so a loaded machine cannot fail them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.delayproxy import Stats, main
from bench.wan import Star, available_star

REPO = Path(__file__).resolve().parents[2]
RTT_S = 0.2
MSG = b"x" * 1000 + b"\n"

# one connection at a time: read a line, send it back, close; prints "ready" once it listens
ECHO = """
import socket, sys
l = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    c, _ = l.accept()
    with c, c.makefile("rb") as f:
        c.sendall(f.readline())
"""

# connect, send a line, read the echo; prints the seconds it all took
PING = """
import socket, sys, time
t = time.monotonic()
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20) as c, c.makefile("rb") as f:
    c.sendall(b"x" * 1000 + b"\\n")
    assert f.readline() == b"x" * 1000 + b"\\n"
print(time.monotonic() - t)
"""


def _netns(prefix: str) -> list[str]:
    """The network namespaces whose names start with ``prefix``, sorted."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return sorted(n.split()[0] for n in names.splitlines() if n.startswith(prefix))


def _echo(prefix: list[str], host: str, port: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [*prefix, sys.executable, "-c", ECHO, host, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _ping(star: Star, region: str, host: str, port: int) -> float:
    out = subprocess.run(
        [*star.exec_prefix(region), sys.executable, "-c", PING, host, str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout)


def _stats_until(star: Star, ok, timeout_s: float = 5) -> dict[str, dict[str, int]]:
    """The proxies write their counts at most every 0.2 s: poll until ``ok`` (or give the last ones)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = star.stats()
        if ok(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


@pytest.fixture(scope="module")
def star() -> Iterator[Star]:
    why = available_star()
    assert why is None, f"the star WAN cannot run here ({why}): make system-deps, as root"
    with Star(rtt_ms=RTT_S * 1000, rate_mbit=100, prefix=f"sbgt{os.getpid() % 100000}") as s:
        servers = [
            _echo(s.exec_prefix("hub"), s.hub_ip, 5000),
            _echo(s.exec_prefix("b"), s.region_ip("b"), 5001),
            _echo(s.exec_prefix("a"), "0.0.0.0", 5002),
        ]
        try:
            yield s
        finally:
            for p in servers:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_star_delays_connections_to_the_hub_and_other_regions_once(star: Star) -> None:
    before = star.stats()
    for host, port in ((star.hub_ip, 5000), (star.region_ip("b"), 5001)):
        took = _ping(star, "a", host, port)
        # set-up RTT + one round trip; generous above
        assert 1.75 * RTT_S <= took < 2.0, (host, took)

    def counted(s: dict) -> bool:
        return s["a"]["in"] - before["a"]["in"] >= 2 * len(MSG)

    after = _stats_until(star, counted)
    a = {k: after["a"][k] - before["a"][k] for k in after["a"]}
    assert a["connections"] == 2
    assert a["out"] >= 2 * len(MSG) and a["in"] >= 2 * len(MSG), a
    assert after["b"] == before["b"]  # delayed once: by the initiator's proxy, not the acceptor's too


@pytest.mark.slow
def test_star_traffic_inside_a_region_is_not_delayed(star: Star) -> None:
    before = star.stats()
    for host in (star.region_ip("a"), "127.0.0.1"):
        took = _ping(star, "a", host, 5002)
        assert took < 1.5 * RTT_S, (host, took)  # a delayed one costs at least 2 RTT
    time.sleep(0.3)  # past the proxy's write interval: nothing was counted either
    assert star.stats() == before


@pytest.mark.slow
def test_star_down_removes_its_namespaces_and_keeps_final_stats() -> None:
    why = available_star()
    assert why is None, f"the star WAN cannot run here ({why}): make system-deps, as root"
    prefix = f"sbgu{os.getpid() % 100000}"

    def ours() -> list[str]:
        return _netns(f"{prefix}-")

    def links() -> list[str]:
        out = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
        return [n for n in out.splitlines() if n.startswith(prefix)]

    s = Star(regions=("x", "y", "z"), rtt_ms=20, prefix=prefix)
    with s:
        assert ours() == [f"{prefix}-h", f"{prefix}-x", f"{prefix}-y", f"{prefix}-z"]
        assert "3 regions" in s.describe() and "hub" in s.describe()
        srv = _echo(s.exec_prefix("z"), s.region_ip("z"), 5003)
        try:
            _ping(s, "y", s.region_ip("z"), 5003)  # region to region through the hub
        finally:
            srv.kill()
            srv.wait()
    assert ours() == [] and links() == []
    final = s.stats()  # the proxies wrote their last counts on SIGTERM
    assert final["y"]["connections"] == 1 and final["y"]["out"] >= len(MSG), final
    assert final["x"] == {"out": 0, "in": 0, "connections": 0}


@pytest.mark.slow
def test_star_up_failing_removes_only_what_it_created() -> None:
    why = available_star()
    assert why is None, f"the star WAN cannot run here ({why}): make system-deps, as root"
    prefix = f"sbgw{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", f"{prefix}-b"], check=True)  # in the way of region b
    try:
        with pytest.raises(RuntimeError, match=f"{prefix}-b"):
            Star(prefix=prefix).up()
        assert _netns(prefix) == [f"{prefix}-b"]
    finally:
        subprocess.run(["ip", "netns", "del", f"{prefix}-b"], check=True)


def test_star_rejects_names_that_cannot_be_namespaces() -> None:
    for regions in (("a", "a"), ("a", "h"), ("a b",), ()):
        with pytest.raises(ValueError):
            Star(regions=regions)
    with pytest.raises(ValueError):
        Star(prefix="a-prefix-too-long")
    s = Star(regions=("a", "b", "c"), prefix="sbgv")
    assert [s.region_ip(r) for r in s.regions] == ["10.201.8.6", "10.201.8.10", "10.201.8.14"]
    assert s.exec_prefix("hub") == ["ip", "netns", "exec", "sbgv-h"]
    assert s.exec_prefix("c") == ["ip", "netns", "exec", "sbgv-c"]
    assert s.stats()["a"] == {"out": 0, "in": 0, "connections": 0}  # not up: nothing counted


def test_stats_file_is_rewritten_at_most_every_interval(tmp_path: Path) -> None:
    path = tmp_path / "s.json"

    async def go() -> list[dict]:
        st = Stats(path)
        st.flush()
        seen = [json.loads(path.read_text())]
        for _ in range(100):
            st.add("out", 10)
        st.add("connections", 1)
        seen.append(json.loads(path.read_text()))  # not yet: the write waits for the interval
        await asyncio.sleep(0.3)
        seen.append(json.loads(path.read_text()))
        st.add("in", 5)
        st.flush()
        seen.append(json.loads(path.read_text()))
        return seen

    seen = asyncio.run(go())
    assert seen[0] == seen[1] == {"out": 0, "in": 0, "connections": 0}
    assert seen[2] == {"out": 1000, "in": 0, "connections": 1}
    assert seen[3] == {"out": 1000, "in": 5, "connections": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary file left behind
    Stats(None).flush()  # no file: counting only


def test_proxy_needs_exactly_one_destination_mode() -> None:
    for argv in (
        ["--listen", "127.0.0.1:1"],
        ["--listen", "127.0.0.1:1", "--target", "h:1", "--transparent"],
    ):
        with pytest.raises(SystemExit):
            main(argv)


@pytest.mark.slow
def test_target_mode_counts_bytes_and_writes_them_on_sigterm(tmp_path: Path) -> None:
    """The plain (``--target``) proxy on this machine's loopback: no namespace, no root needed."""
    srv = socket.create_server(("127.0.0.1", 0))
    got = []

    def serve() -> None:
        c, _ = srv.accept()
        with c, c.makefile("rb") as f:
            line = f.readline()
            got.append(line)
            c.sendall(line[:10])

    threading.Thread(target=serve, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stats = tmp_path / "proxy.json"
    cmd = [sys.executable, "-m", "bench.delayproxy", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--target", f"127.0.0.1:{srv.getsockname()[1]}", "--rtt-ms", "1", "--stats", str(stats)]
    p = subprocess.Popen(cmd, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not stats.exists():  # written (zeros) once it listens
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        assert json.loads(stats.read_text()) == {"out": 0, "in": 0, "connections": 0}
        with socket.create_connection(("127.0.0.1", port)) as c, c.makefile("rb") as f:
            c.sendall(MSG)
            assert f.read() == MSG[:10]
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
        srv.close()
    assert got == [MSG]
    assert json.loads(stats.read_text()) == {"out": len(MSG), "in": 10, "connections": 1}
