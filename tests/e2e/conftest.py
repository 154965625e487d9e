"""End-to-end fixtures: a real two-node Slurm cluster on this machine (scripts/local-slurm.sh).

The session fixture ``slurm`` starts the cluster once and stops it at the end of the session (unless it
was already running before, e.g. started by hand: then it is left running). Stopping is checked: no
daemon, namespace, bridge or /etc/hosts line may be left behind.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "local-slurm.sh"

# Slurm job states after which nothing of the job runs any more
TERMINAL = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "PREEMPTED",
}


def _run(cmd: list[str], env: dict | None = None, timeout: float = 120, check: bool = True, **kw):
    p = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True, **kw)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{shlex.join(map(str, cmd))} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
        )
    return p


@dataclass
class Cluster:
    """A handle on the running local cluster plus the few client calls the tests need."""

    env: dict[str, str]  # an environment for Slurm clients and for what jobs inherit (--export=ALL)
    info: dict[str, str] = field(default_factory=dict)  # `local-slurm.sh env`

    @property
    def nodes(self) -> list[str]:
        return self.info["SBATCH_GEN_SLURM_NODES"].split(",")

    @property
    def partition(self) -> str:
        return self.info["SBATCH_GEN_SLURM_PARTITION"]

    @property
    def host_addr(self) -> str:
        """The address under which the nodes reach this machine (for servers a test starts)."""
        return self.info["SBATCH_GEN_SLURM_HOST_ADDR"]

    @property
    def layout(self) -> str:
        return self.info["SBATCH_GEN_SLURM_LAYOUT"]

    @property
    def state(self) -> Path:
        return Path(self.info["SBATCH_GEN_SLURM_STATE"])

    def run(self, *cmd: str, timeout: float = 60, check: bool = True, cwd: Path | None = None):
        return _run(list(cmd), env=self.env, timeout=timeout, check=check, cwd=cwd)

    def sbatch(self, script: Path, *args: str, cwd: Path | None = None, env: dict | None = None) -> int:
        """Submit with plain sbatch (from ``cwd``, so $SLURM_SUBMIT_DIR is cwd); return the job id."""
        e = dict(self.env)
        if env:
            e.update(env)
        p = _run(["sbatch", "--parsable", *args, str(script)], env=e, cwd=cwd or script.parent)
        return int(p.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol -o show job` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout.strip()
        info: dict[str, str] = {}
        for tok in re.findall(r"(\w+)=(\S*)", out):
            info.setdefault(tok[0], tok[1])
        return info

    def wait_state(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        """Poll until the job's state is one of ``states`` (or terminal); return its info."""
        deadline = time.monotonic() + timeout
        info = self.job(job_id)
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states or info.get("JobState") in TERMINAL:
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not in {sorted(states)} after {timeout}s: {info}")

    def wait_done(self, job_id: int, timeout: float = 240) -> dict[str, str]:
        return self.wait_state(job_id, TERMINAL, timeout)

    def jobs(self) -> list[tuple[int, str]]:
        out = self.run("squeue", "-h", "-o", "%i|%T").stdout.split()
        return [(int(line.split("|")[0]), line.split("|")[1]) for line in out if line]

    def cancel_all(self, timeout: float = 60) -> None:
        ids = [str(j) for j, _ in self.jobs()]
        if not ids:
            return
        self.run("scancel", *ids, check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.jobs():
            time.sleep(0.5)

    def node_pids(self, node: str) -> list[int]:
        """Processes running "on" a node: in its network namespace (netns layout only)."""
        if self.layout != "netns":
            return []
        p = _run(["ip", "netns", "pids", f"sbgen-{node}"], check=False)
        return [int(x) for x in p.stdout.split()]

    def job_processes(self, node: str) -> list[str]:
        """Command lines of the job processes on ``node`` (everything in its namespace but slurmd)."""
        cmds = []
        for pid in self.node_pids(node):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if cmd and not cmd.startswith("/usr/sbin/slurmd"):
                cmds.append(f"{pid} {cmd}")
        return cmds

    def wait_no_job_processes(self, timeout: float = 30) -> None:
        """Assert that no job process is left on any node (slurmstepd exits a moment after the job)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = {n: self.job_processes(n) for n in self.nodes}
            if not any(left.values()):
                return
            time.sleep(0.5)
        raise AssertionError(f"processes left on the nodes: {left}")


def _script(action: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return _run(["bash", str(SCRIPT), action], timeout=timeout, check=False)


def _leftovers() -> list[str]:
    """Everything local-slurm.sh may create, if it is still there."""
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if comm in ("slurmctld", "slurmd", "slurmstepd") and stat.rsplit(")", 1)[1].split()[0] not in "ZX":
            left.append(f"process {pid} {comm}")
    ns = _run(["ip", "netns", "list"], check=False).stdout
    left += [f"netns {line.split()[0]}" for line in ns.splitlines() if line.startswith("sbgen-")]
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    left += [f"link {m}" for m in re.findall(r"^\d+: (br-sbgen|sbgen-v\d+)", links, re.M)]
    left += [f"/etc/hosts: {line}" for line in Path("/etc/hosts").read_text().splitlines() if "sbatch-gen local-slurm" in line]
    return left


@pytest.fixture(scope="session")
def slurm() -> Cluster:
    assert os.geteuid() == 0, "the end-to-end tests start Slurm daemons and need root"
    was_running = _script("status").returncode == 0
    p = _script("start")
    assert p.returncode == 0, f"local-slurm.sh start failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    info = dict(
        line.split("=", 1) for line in _script("env").stdout.splitlines() if "=" in line
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "TORCHELASTIC_", "PYTEST_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["SLURM_CONF"] = info["SLURM_CONF"]
    env["PYTHONUNBUFFERED"] = "1"
    cluster = Cluster(env=env, info=info)
    yield cluster
    if was_running:
        cluster.cancel_all()
        return
    p = _script("stop")
    assert p.returncode == 0, f"local-slurm.sh stop failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    # stopping twice is harmless, and nothing is left behind (zombies are reaped within a few seconds)
    p = _script("stop")
    assert p.returncode == 0, f"second local-slurm.sh stop failed:\n{p.stderr}"
    deadline = time.monotonic() + 10
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _leftovers(), f"left behind after stop: {_leftovers()}"
    assert _script("status").returncode == 3


@pytest.fixture
def cluster(slurm: Cluster):
    """The session cluster, with no job left over from a previous test and none left after this one."""
    slurm.cancel_all()
    yield slurm
    left = slurm.jobs()
    details = [slurm.run("scontrol", "-o", "show", "job", str(j), check=False).stdout for j, _ in left]
    slurm.cancel_all()
    assert not left, f"the test left jobs behind: {left}\n" + "\n".join(details)
    slurm.wait_no_job_processes()



