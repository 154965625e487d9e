"""``bench peer``: where a run's processes live (this host's loopback or the emulated WAN) and the two
coordinators, torchft's lighthouse and our object store."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from sbatch_gen.testing.procs import terminate
from sbatch_gen.testing.s3server import free_port
from sbatch_gen.xr_options import S3Transport

from .common import PY, bench_env
from .regionruns import REGIONS
from .wan import Star


class Net:
    """Where a run's processes live: this host's loopback (``star`` None) or the emulated WAN, and the two
    coordinators: torchft's lighthouse and our object store, both in the hub."""

    def __init__(self, star: Star | None, work: Path) -> None:
        self.star, self.work = star, work
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_url = ""
        self._lighthouse_args: list[str] = []
        self.stores: dict = {}  # kind -> S3 server

    def prefix(self, where: str) -> list[str]:
        if self.star is None:
            return []
        return self.star.exec_prefix("hub") if where == "hub" else self.star.host_prefix(where)

    def addr(self, where: str) -> str:
        if self.star is None:
            return "127.0.0.1"
        return self.star.hub_ip if where == "hub" else self.star.region_ip(where)

    def bytes(self) -> dict[str, int]:
        """Bytes each replica's link carried so far, both ways (zeros on loopback)."""
        if self.star is None:
            return {r: 0 for r in REGIONS}
        st = self.star.stats()
        return {r: st[r]["out"] + st[r]["in"] for r in REGIONS}

    def start_lighthouse(self, min_replicas: int | None = None) -> None:
        """torchft's lighthouse in the hub; again on the same address when ``min_replicas`` is None.
        ``min_replicas`` 2: both replicas in every quorum (strict rounds, as ours without faults); 1: a
        replica goes on alone (elastic, as ours with ``min_regions: 1``)."""
        if min_replicas is not None:
            port = free_port()
            exe = str(Path(PY).parent / "torchft_lighthouse")
            bind = f"{self.addr('hub')}:{port}"
            # join_timeout: a quorum waits this long for a replica that heartbeats but has not joined yet
            self._lighthouse_args = [exe, "--min_replicas", str(min_replicas), "--bind", bind]
            self._lighthouse_args += ["--join_timeout_ms", "10000"]
            self.lighthouse_url = f"http://{bind}"
        log = open(self.work / "lighthouse.log", "ab")
        self.lighthouse = subprocess.Popen(
            [*self.prefix("hub"), *self._lighthouse_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def stop_lighthouse(self, kill: bool = False) -> None:
        p, self.lighthouse = self.lighthouse, None
        if p is not None and kill and p.poll() is None:
            p.kill()
            p.wait()
        terminate(p)

    def start_s3(self, kind: str) -> None:
        """An S3 store of ``kind`` (:func:`bench.servers.make_server`) in the hub with the bucket ``bench``:
        nanio for the strict runs (files on disk, fast); moto for the elastic ones (ours' ``min_regions``
        below all needs conditional writes, which nanio ignores)."""
        from .servers import make_server

        hub = self.star.hub_ns if self.star else None
        data = self.work / kind
        shutil.rmtree(data, ignore_errors=True)  # a fresh store for every link
        srv = make_server(kind, host=self.addr("hub"), netns=hub, data_dir=str(data))
        srv.start()
        endpoint = srv.endpoint_url
        self.stores[kind] = srv
        subprocess.run(
            [*self.prefix(REGIONS[0]), PY, "-m", "bench.mailbox_worker", "mkbucket", "--endpoint", endpoint]
            + ["--bucket", "bench", "--out", "-"],
            env=bench_env(srv.env()),
            check=True,
            capture_output=True,
        )

    def s3(self, kind: str) -> tuple[S3Transport, dict[str, str]]:
        """The regions' transport to the store ``kind`` and the environment its clients need."""
        srv = self.stores[kind]
        t = S3Transport(
            bucket="bench",
            prefix="peer",
            endpoint_url=srv.endpoint_url,
            addressing_style="path",
            region_name="us-east-1",
        )
        return t, srv.env()

    def cut_s3(self, kind: str, cut: bool) -> None:
        """Make the store ``kind`` unreachable (its packets dropped in the hub: connections hang, as when a
        link or a region's endpoint fails) or reachable again. The store keeps running, with its data."""
        if self.star is None:
            raise RuntimeError("an unreachable store needs the emulated WAN")
        rule = ["INPUT", "-p", "tcp", "--dport", str(self.stores[kind].port), "-j", "DROP"]
        subprocess.run([*self.prefix("hub"), "iptables", "-A" if cut else "-D", *rule], check=True)

    def stop(self) -> None:
        self.stop_lighthouse()
        for srv in self.stores.values():
            srv.stop()
        self.stores.clear()
