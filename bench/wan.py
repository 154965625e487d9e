"""An emulated WAN link on this machine: two network namespaces joined by a veth pair.

* ``<prefix>-s`` (the "remote" side) runs the object store on ``10.201.7.2``;
* ``<prefix>-c`` (the "local" side) runs the regions' clients and :mod:`bench.delayproxy`
  on its own ``127.0.0.1``, which forwards to the store with ``rtt`` latency and a per-stream window;
* ``tc qdisc ... tbf`` on both veth ends limits the link rate (``netem`` does not exist here).

Only namespaces created here are touched; nothing in the root namespace changes. Needs root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sbatch_gen.testing.procs import terminate
from sbatch_gen.testing.s3server import free_port
from sbatch_gen.xr_options import S3Transport

from .servers import wait_port

SUBNET = ("10.201.7.1", "10.201.7.2")


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    p = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {p.stderr.strip()}")


def available() -> str | None:
    """None when a WAN can be emulated here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install iproute2)"
    return None


@dataclass
class Wan:
    rate_mbit: int = 400
    rtt_ms: float = 80.0
    window_kb: int = 1024
    prefix: str = f"sbgb{os.getpid() % 100000}"

    def __post_init__(self) -> None:
        self.client_ns = f"{self.prefix}-c"
        self.server_ns = f"{self.prefix}-s"
        self.proxy: subprocess.Popen | None = None
        self.proxy_port: int | None = None

    def describe(self) -> str:
        return (
            f"{self.rate_mbit} Mbit/s link (tc tbf), {self.rtt_ms:g} ms RTT and a {self.window_kb} KiB "
            f"window per stream (userspace delay proxy): one stream tops out at "
            f"{self.window_kb * 1024 / (self.rtt_ms / 1000) / 1e6:.1f} MB/s, the link at {self.rate_mbit / 8:g} MB/s"
        )

    def up(self) -> Wan:
        c, s = self.client_ns, self.server_ns
        ca, sa = f"{self.prefix}c0", f"{self.prefix}s0"
        try:
            _ip("netns", "add", c)
            _ip("netns", "add", s)
            _ip("link", "add", ca, "type", "veth", "peer", "name", sa)
            _ip("link", "set", ca, "netns", c)
            _ip("link", "set", sa, "netns", s)
            for ns, dev, addr in ((c, ca, SUBNET[0]), (s, sa, SUBNET[1])):
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                # burst: enough for the rate at a 1 ms timer; latency bounds the queue
                burst = max(32 * 1024, self.rate_mbit * 1_000_000 // 8 // 250)
                _tc(
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{self.rate_mbit}mbit",
                    "burst",
                    str(burst),
                    "latency",
                    "50ms",
                )
        except Exception:
            self.down()
            raise
        return self

    def start_proxy(self, target_port: int) -> str:
        """Start the delay proxy in the client namespace; returns the endpoint URL clients use."""
        self.proxy_port = free_port()
        cmd = [
            "ip",
            "netns",
            "exec",
            self.client_ns,
            sys.executable,
            "-m",
            "bench.delayproxy",
            "--listen",
            f"127.0.0.1:{self.proxy_port}",
            "--target",
            f"{SUBNET[1]}:{target_port}",
            "--rtt-ms",
            str(self.rtt_ms),
            "--window-kb",
            str(self.window_kb),
        ]
        from .common import bench_env

        self.proxy = subprocess.Popen(
            cmd, env=bench_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        wait_port("127.0.0.1", self.proxy_port, 30, self.proxy, self.client_ns)
        return f"http://127.0.0.1:{self.proxy_port}"

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.client_ns]

    def down(self) -> None:
        p, self.proxy = self.proxy, None
        terminate(p)
        for ns in (self.client_ns, self.server_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # also removes the veth pair

    def __enter__(self) -> Wan:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


@contextmanager
def s3_behind(w: Wan, work: Path, prefix: str) -> Iterator[tuple[S3Transport, dict[str, str]]]:
    """An S3 store (nanio) in ``w``'s server namespace, reached through its delay proxy, with the bucket
    ``bench``: yields the regions' transport (keys under ``prefix``) and the server's environment (its
    credentials); the server stops on exit. ``w`` must be entered."""
    from .common import PY, bench_env
    from .servers import make_server

    srv = make_server("nanio", host="10.201.7.2", netns=w.server_ns, data_dir=str(work / "nanio"))
    srv.start()
    try:
        endpoint = w.start_proxy(srv.port)
        subprocess.run(
            [*w.exec_prefix(), PY, "-m", "bench.mailbox_worker", "mkbucket", "--endpoint", endpoint]
            + ["--bucket", "bench", "--out", "-"],
            env=bench_env(srv.env()),
            check=True,
        )
        yield (
            S3Transport(
                bucket="bench",
                prefix=prefix,
                endpoint_url=endpoint,
                addressing_style="path",
                region_name="us-east-1",
            ),
            srv.env(),
        )
    finally:
        srv.stop()
