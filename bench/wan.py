"""An emulated WAN link on this machine: two network namespaces joined by a veth pair.

* ``<prefix>-s`` (the "remote" side) runs the object store on ``10.201.7.2``;
* ``<prefix>-c`` (the "local" side) runs the regions' clients and :mod:`bench.delayproxy`
  on its own ``127.0.0.1``, which forwards to the store with ``rtt`` latency and a per-stream window;
* ``tc qdisc ... tbf`` on both veth ends limits the link rate (``netem`` does not exist here).

:class:`Star` is the many-party variant (torchft replicas, their lighthouse and the mailbox store): each
region its own namespace and link to a hub, and a transparent delay proxy per region.

Only namespaces created here are touched; nothing in the root namespace changes. Needs root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sbatch_gen.testing.procs import terminate
from sbatch_gen.testing.s3server import free_port
from sbatch_gen.xr_options import S3Transport

from .delayproxy import MARK
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


def available_star() -> str | None:
    """None when a :class:`Star` can be emulated here, else why not (it needs iptables as well)."""
    why = available()
    if why is None and shutil.which("iptables") is None:
        why = "`iptables` not found (apt-get install iptables)"
    return why


def _run(*cmd: str) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")


def _tbf(ns: str, dev: str, rate_mbit: int) -> None:
    # burst: enough for the rate at a 1 ms timer; latency bounds the queue
    burst = max(32 * 1024, rate_mbit * 1_000_000 // 8 // 250)
    _tc(ns, *f"qdisc add dev {dev} root tbf rate {rate_mbit}mbit burst {burst} latency 50ms".split())


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
                _tbf(ns, dev, self.rate_mbit)
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


@dataclass
class Star:
    """Regions that each reach a hub over their own emulated long-haul link, and each other through it.

    * ``<prefix>-h`` (the hub) has :attr:`hub_ip` (``10.201.8.1``, on its loopback) for services every
      region reaches (the mailbox store, the torchft lighthouse) and forwards between regions;
    * ``<prefix>-<region>`` has :meth:`region_ip` (region ``i``: ``10.201.8.{4i+6}`` on the /30
      ``10.201.8.{4i+4}``, whose hub end is ``.{4i+5}``) and a default route via the hub, so it reaches
      the hub and every other region (torchft replicas talk gloo to each other on arbitrary ports);
    * ``tc tbf`` at ``rate_mbit`` on both ends of each region's veth: each region has its own link of
      that rate each way, and region to region traffic crosses two of them;
    * in each region an iptables ``REDIRECT`` sends every TCP connection it opens to the star subnet,
      other than to its own address, to that region's :mod:`bench.delayproxy` ``--transparent``: one
      RTT per connection (set-up, request/response, window) whatever the destination, applied once, by
      the initiator's proxy, which counts the bytes (:meth:`stats`). Traffic inside a namespace (its own
      address, ``127.0.0.1``) is not delayed, and neither are connections the hub opens (only rated):
      run in the hub only what regions connect to.

    Region names become namespace names: letters, digits, ``_``, and not ``h``.
    """

    regions: tuple[str, ...] = ("a", "b")
    rate_mbit: int = 400
    rtt_ms: float = 80.0
    window_kb: int = 1024
    prefix: str = f"sbgs{os.getpid() % 100000}"
    stats_dir: Path | None = None  # default: a temporary folder, removed by down()
    subnet_base: str = "10.201.8"
    proxies: dict[str, subprocess.Popen] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.prefix) > 12:  # interface names are <prefix>r<i>, at most 15 characters
            raise ValueError(f"prefix {self.prefix!r}: at most 12 characters")
        if len(set(self.regions)) != len(self.regions) or not 1 <= len(self.regions) <= 62:
            raise ValueError(f"regions must be 1 to 62 distinct names: {self.regions}")
        for r in self.regions:
            if not re.fullmatch(r"[A-Za-z0-9_]+", r) or r == "h":
                raise ValueError(f"region name {r!r}: letters, digits or _, and not 'h'")
        self.hub_ns = f"{self.prefix}-h"
        self.hub_ip = f"{self.subnet_base}.1"
        self.subnet = f"{self.subnet_base}.0/24"
        self.proxy_port: int | None = None
        self._tmp: Path | None = None
        self._namespaces: list[str] = []  # what up() created, and only that, goes in down()
        self._root_links: list[str] = []  # a veth end not yet moved out of the root namespace
        self._final: dict[str, dict[str, int]] | None = None

    def _index(self, region: str) -> int:
        try:
            return self.regions.index(region)
        except ValueError:
            raise KeyError(f"no region {region!r} in {self.regions}") from None

    def region_ns(self, region: str) -> str:
        return f"{self.prefix}-{self.regions[self._index(region)]}"

    def region_ip(self, region: str) -> str:
        return f"{self.subnet_base}.{4 * self._index(region) + 6}"

    def host_prefix(self, region: str) -> list[str]:
        """:meth:`exec_prefix` as a host of its own: a UTS namespace whose hostname is the region's address,
        so software that advertises ``gethostname()`` to its peers (torchft's checkpoint server, gloo's
        default device) is reachable from the other regions (all namespaces share /etc/hosts)."""
        return [
            *self.exec_prefix(region),
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.region_ip(region),
        ]

    def _hub_side_ip(self, region: str) -> str:
        return f"{self.subnet_base}.{4 * self._index(region) + 5}"

    def exec_prefix(self, where: str) -> list[str]:
        """The command prefix that runs in ``where``: a region, or ``"hub"``."""
        return ["ip", "netns", "exec", self.hub_ns if where == "hub" else self.region_ns(where)]

    def describe(self) -> str:
        return (
            f"star: {len(self.regions)} regions ({', '.join(self.regions)}), each its own "
            f"{self.rate_mbit} Mbit/s link (tc tbf) to a hub; region to region goes through the hub, over "
            f"both regions' links. Every connection a region opens costs one {self.rtt_ms:g} ms RTT "
            f"(transparent userspace delay proxy) with a {self.window_kb} KiB window per stream: one stream "
            f"tops out at {self.window_kb * 1024 / (self.rtt_ms / 1000) / 1e6:.1f} MB/s, a region's link at "
            f"{self.rate_mbit / 8:g} MB/s each way"
        )

    def _stats_path(self, region: str) -> Path | None:
        base = self.stats_dir if self.stats_dir is not None else self._tmp
        return None if base is None else base / f"{region}.json"

    def up(self) -> Star:
        from .common import bench_env

        self._final = None
        if self.stats_dir is None:
            self._tmp = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-stats-"))
        else:
            self.stats_dir.mkdir(parents=True, exist_ok=True)
        try:
            h = self.hub_ns
            self._add_ns(h)
            _ip("-n", h, "link", "set", "lo", "up")
            _ip("-n", h, "addr", "add", f"{self.hub_ip}/32", "dev", "lo")
            _run("ip", "netns", "exec", h, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self.proxy_port = free_port()  # any free port will do: each region's loopback is its own
            for i, r in enumerate(self.regions):
                ns, ra, ha = self.region_ns(r), f"{self.prefix}r{i}", f"{self.prefix}h{i}"
                self._add_ns(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "add", ra, "type", "veth", "peer", "name", ha)
                self._root_links = [ra]  # deleting one end deletes the pair
                _ip("link", "set", ra, "netns", ns)
                self._root_links = [ha]
                _ip("link", "set", ha, "netns", h)
                self._root_links = []
                for n, dev, addr in ((ns, ra, self.region_ip(r)), (h, ha, self._hub_side_ip(r))):
                    _ip("-n", n, "addr", "add", f"{addr}/30", "dev", dev)
                    _ip("-n", n, "link", "set", dev, "up")
                    _tbf(n, dev, self.rate_mbit)
                _ip("-n", ns, "route", "add", "default", "via", self._hub_side_ip(r))
                # one -d per rule: the region's own address first, untouched
                nat = [*self.exec_prefix(r), "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp"]
                _run(*nat, "-d", self.region_ip(r), "-j", "RETURN")
                unmarked = ["-m", "mark", "!", "--mark", hex(MARK)]  # not the proxy's own connections
                _run(*nat, "-d", self.subnet, *unmarked, "-j", "REDIRECT", "--to-ports", str(self.proxy_port))
            for r in self.regions:
                self.proxies[r] = subprocess.Popen(
                    [*self.exec_prefix(r), sys.executable, "-m", "bench.delayproxy", "--transparent"]
                    + [f"--listen=127.0.0.1:{self.proxy_port}", f"--rtt-ms={self.rtt_ms}"]
                    + [f"--window-kb={self.window_kb}", f"--stats={self._stats_path(r)}"],
                    env=bench_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            for r, p in self.proxies.items():
                wait_port("127.0.0.1", self.proxy_port, 30, p, self.region_ns(r))
        except Exception:
            self.down()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per region, what its proxy forwarded so far: ``out`` (to the hub or other regions), ``in``
        (back) in bytes, and ``connections``; cumulative, so difference two calls for one phase. Up to
        0.2 s behind while bytes move; final after :meth:`down`."""
        if self._final is not None:
            return {r: dict(c) for r, c in self._final.items()}
        out = {}
        for r in self.regions:
            c = {"out": 0, "in": 0, "connections": 0}
            path = self._stats_path(r)
            try:
                if path is not None:
                    c.update(json.loads(path.read_text()))
            except (OSError, ValueError):  # not written yet
                pass
            out[r] = c
        return out

    def down(self) -> None:
        procs, self.proxies = self.proxies, {}
        for p in procs.values():  # all at once: each writes its final stats on SIGTERM
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            terminate(p)
        if self._tmp is not None or self.stats_dir is not None:
            self._final = self.stats()
        links, self._root_links = self._root_links, []
        for dev in links:
            subprocess.run(["ip", "link", "del", dev], capture_output=True)
        namespaces, self._namespaces = self._namespaces, []
        for ns in reversed(namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # its veths and rules go too
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    def __enter__(self) -> Star:
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
