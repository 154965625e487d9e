"""Helpers of the end-to-end tests: the local Slurm cluster (scripts/local-slurm.sh) and rendered jobs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sbatch_gen.testing import faults
from sbatch_gen.testing.s3server import S3Server

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "local-slurm.sh"
# The render setting under which a job runs the trainer with the faults its submit environment names
# (sbatch_gen.testing.faults: a per-step sleep, a held stop checkpoint); the trainer itself reads none of them
WITH_FAULTS = {"trainer.module": faults.MODULE}
# How long the tests hold a stop checkpoint (SBATCH_GEN_TEST_STOP_SAVE_HOLD_S), as a large one takes: longer than
# the local cluster's KillWait (5 s), so a stop that Slurm's kill reached would be cut short. (That torchrun's
# agent never gets the stop, and its own 30 s never matter, the render tests check: test_stop_protocol.py.)
STOP_HOLD_S = 12
# trainer.max_steps of the tests whose run only has to go on after what they do (a signal the test sends at
# once, a stop before the first step): half the train config's 40 steps. A preemption, which lands after
# Slurm's next scheduling pass, needs the 40 steps' room.
SHORT_STEPS = 20

# Measurements the tests report (downtimes, ...): printed in the session's terminal summary, so that
# `make test` shows them without -s.
MEASUREMENTS: list[str] = []


def report(line: str) -> None:
    MEASUREMENTS.append(line)
    print(line)


# Slurm job states after which nothing of the job runs any more
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def run(cmd: list[str], env: dict | None = None, timeout: float = 120, check: bool = True, **kw):
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
    # jobs this test session submitted: the only ones it waits for, cancels or looks at (someone may be
    # trying a render on the same cluster by hand)
    submitted: set[int] = field(default_factory=set)
    # the PreemptType that preempt_type last set (None: as the cluster was found)
    preempting_by: str | None = None

    @property
    def nodes(self) -> list[str]:
        return self.info["SBATCH_GEN_SLURM_NODES"].split(",")

    @property
    def instance(self) -> str:
        """The local-slurm.sh instance (SBATCH_GEN_SLURM_INSTANCE; "" for the default cluster)."""
        return self.info["SBATCH_GEN_SLURM_INSTANCE"]

    @property
    def node_prefix(self) -> str:
        """What the instance puts before every node name ("b-" for b-n1, b-g1, ...; "" by default)."""
        return f"{self.instance}-" if self.instance else ""

    def script(self, action: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`local-slurm.sh ACTION ARGS...` on this cluster."""
        return script(action, *args, timeout=timeout, instance=self.instance)

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
        return run(list(cmd), env=self.env, timeout=timeout, check=check, cwd=cwd)

    def sbatch(self, script: Path, *args: str, cwd: Path | None = None, env: dict | None = None) -> int:
        """Submit with plain sbatch (from ``cwd``, so $SLURM_SUBMIT_DIR is cwd); return the job id."""
        e = dict(self.env)
        if env:
            e.update(env)
        p = run(["sbatch", "--parsable", *args, str(script)], env=e, cwd=cwd or script.parent)
        job_id = int(p.stdout.strip().split(";")[0])
        self.submitted.add(job_id)
        return job_id

    def preempt_type(self, kind: str) -> None:
        """Who may preempt whom: `local-slurm.sh preempt-type partition|qos`, which restarts slurmctld (some
        seconds), run only when the cluster is not known to be so already."""
        if self.preempting_by == kind:
            return
        p = run([str(SCRIPT), "preempt-type", kind], env=self.env, check=False)
        assert p.returncode == 0, p.stdout + p.stderr
        self.preempting_by = kind

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
        """This session's jobs that are still queued or running."""
        out = self.run("squeue", "-h", "-o", "%i|%T").stdout.split()
        jobs = [(int(line.split("|")[0]), line.split("|")[1]) for line in out if line]
        return [(j, st) for j, st in jobs if j in self.submitted]

    def cancel_all(self, timeout: float = 60) -> None:
        """Cancel this session's jobs that are still there."""
        ids = [str(j) for j, _ in self.jobs()]
        if not ids:
            return
        self.run("scancel", *ids, check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.jobs():
            time.sleep(0.5)

    def node_pids(self, node: str) -> list[int]:
        """Processes running "on" a node, its slurmd included.

        netns layout: every process in the node's network namespace. loopback layout (every node on this
        host's own network): the node's slurmd (``-N NODE``), the slurmstepd of its jobs (which hold the
        node's slurmd log open; one whose node cannot be told counts for every node), and every process
        whose environment says it runs there (``SLURMD_NODENAME``: Slurm sets it for batch scripts and
        step tasks, their children inherit it). Raises when it cannot look, or does not find the node's
        slurmd: a check that nothing is left on a node must not pass because nothing could be seen."""
        if self.layout == "netns":
            p = run(["ip", "netns", "pids", f"sbgen-{node}"], check=False)
            if p.returncode != 0:
                raise AssertionError(
                    f"cannot list the processes of node {node}: ip netns pids sbgen-{node} "
                    f"exited {p.returncode}: {p.stderr.strip()}{_LAYOUT_HINT}"
                )
            pids = [int(x) for x in p.stdout.split()]
        elif self.layout == "loopback":
            pids = self._loopback_pids(node)
        else:
            raise AssertionError(
                f"unknown local Slurm layout {self.layout!r}: cannot look for processes on {node}"
            )
        if not any(_slurmd_node(_cmdline(pid)) == node for pid in pids):
            raise AssertionError(
                f"no slurmd of node {node} among its processes ({self.layout} layout): "
                f"cannot look for what runs there{_LAYOUT_HINT}"
            )
        return pids

    def _loopback_pids(self, node: str) -> list[int]:
        log = str(self.state / "log" / f"slurmd-{node}.log")
        want = f"SLURMD_NODENAME={node}".encode()
        out = []
        parents = _parents()
        for pid in _all_pids():
            try:
                argv = _cmdline(pid, strict=True)
                if argv[:1] == ["/usr/sbin/slurmd"]:
                    if _slurmd_node(argv) == node:
                        out.append(pid)
                    continue
                if Path(f"/proc/{pid}/comm").read_text().strip() == "slurmstepd":
                    logs = [f for f in _open_files(pid) if f.startswith(str(self.state / "log" / "slurmd-"))]
                    if not logs or log in logs:
                        out.append(pid)
                    continue
                if want in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    out.append(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue  # it ended while we looked
            except PermissionError as e:  # not ours to read (e.g. the container's init): fine unless a job's
                if _descends_from_slurmstepd(pid, parents):
                    raise AssertionError(
                        f"cannot read process {pid} of a job step ({e}): cannot tell its node"
                    ) from e
        return out

    def job_processes(self, node: str) -> list[str]:
        """Command lines of this session's job processes on ``node``: everything :meth:`node_pids` finds
        but slurmd, less what belongs to jobs submitted by someone else."""
        cmds = []
        for pid in self.node_pids(node):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if not cmd or cmd.startswith("/usr/sbin/slurmd"):
                continue
            job = None
            m = re.match(r"slurmstepd: \[(\d+)\.", cmd)
            if m:
                job = int(m.group(1))
            for kv in environ:
                if kv.startswith(b"SLURM_JOB_ID="):
                    job = int(kv.split(b"=", 1)[1] or 0)
            if job is None or job in self.submitted:
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


_LAYOUT_HINT = (
    " (a cluster started by hand in the other layout? run the tests with SBATCH_GEN_SLURM_LAYOUT "
    "set to the layout it runs in)"
)


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _cmdline(pid: int, strict: bool = False) -> list[str]:
    """argv of ``pid``; [] if it is gone (``strict``: raise FileNotFoundError/ProcessLookupError then)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        if strict:
            raise
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc/<pid>/stat, readable for every process)."""
    out = {}
    for pid in _all_pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        out[pid] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _descends_from_slurmstepd(pid: int, parents: dict[int, int]) -> bool:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "slurmstepd":
                return True
        except OSError:
            return False
        pid = parents.get(pid, 0)
    return False


def _slurmd_node(argv: list[str]) -> str | None:
    """The node a slurmd command line serves (``-N NODE``); None for any other command line."""
    if argv[:1] != ["/usr/sbin/slurmd"] or "-N" not in argv[:-1]:
        return None
    return argv[argv.index("-N") + 1]


def _open_files(pid: int) -> list[str]:
    """What the open file descriptors of ``pid`` point to (descriptors closed meanwhile are skipped)."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            out.append(os.readlink(fd))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def script(action: str, *args: str, timeout: float = 300, instance: str = "") -> subprocess.CompletedProcess:
    """`local-slurm.sh ACTION ARGS...` on the cluster ``instance`` (SBATCH_GEN_SLURM_INSTANCE; "": the default
    one)."""
    # The netns layout unless SBATCH_GEN_SLURM_LAYOUT says otherwise (loopback: every node on this host's
    # network; Cluster.node_pids then tells the nodes' processes apart by their environment).
    env = {**os.environ, "SBATCH_GEN_SLURM_INSTANCE": instance}
    env.setdefault("SBATCH_GEN_SLURM_LAYOUT", "netns")
    return run(["bash", str(SCRIPT), action, *args], env=env, timeout=timeout, check=False)


def leftovers(info: dict[str, str]) -> list[str]:
    """Everything local-slurm.sh may have created for the cluster that ``info`` (`local-slurm.sh env`)
    describes, if it is still there; that cluster's only, as another instance may run beside it. Its
    processes are those whose command line, environment or open files name its state directory (the
    daemons' config and pid files, mariadbd's data, munged's socket, a slurmstepd's slurmd log)."""
    state = info["SBATCH_GEN_SLURM_STATE"].rstrip("/") + "/"
    instance = info["SBATCH_GEN_SLURM_INSTANCE"]
    nodes = [
        n
        for key in ("SBATCH_GEN_SLURM_NODES", "SBATCH_GEN_SLURM_GPU_NODES")
        for n in info.get(key, "").split(",")
        if n
    ]
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
            if comm not in ("slurmctld", "slurmd", "slurmstepd", "slurmdbd", "mariadbd", "munged"):
                continue
            if stat.rsplit(")", 1)[1].split()[0] in "ZX":
                continue
            named = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
            files = _open_files(int(pid))
        except OSError:
            continue
        if state.encode() in named or any(f.startswith(state) for f in files):
            left.append(f"process {pid} {comm}")
    ns = run(["ip", "netns", "list"], check=False).stdout.split()
    left += [f"netns sbgen-{n}" for n in nodes if f"sbgen-{n}" in ns]
    links = run(["ip", "-o", "link", "show"], check=False).stdout
    bridge, veth = (f"br-sbgen-{instance}", f"sbgen{instance}-v") if instance else ("br-sbgen", "sbgen-v")
    left += [
        f"link {m}" for m in re.findall(rf"^\d+: ({re.escape(bridge)}|{re.escape(veth)}\d+)[@:]", links, re.M)
    ]
    mark = " # sbatch-gen local-slurm" + (f":{instance}" if instance else "")
    left += [
        f"/etc/hosts: {line}" for line in Path("/etc/hosts").read_text().splitlines() if line.endswith(mark)
    ]
    return left


# ---------------------------------------------------------------------------------------------------
# Rendered jobs of the `local` site


_ports = iter(range(29600, 32600, 7))


def git_checkout(cluster: Cluster, path: Path):
    """Make ``path`` (holding files already) a git checkout; returns commit(MESSAGE) -> the new commit's id,
    which commits everything in it (a `git pull` stands in as a commit)."""
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]

    def commit(msg: str) -> str:
        cluster.run(*git, "add", "-A")
        cluster.run(*git, "commit", "-q", "-m", msg)
        return cluster.run(*git, "rev-parse", "HEAD").stdout.strip()

    cluster.run(*git, "init", "-q")
    return commit


def next_port() -> int:
    """A rendezvous port no other test of this session uses (jobs may overlap on a node)."""
    return next(_ports)


def render(
    out_dir: Path, site: str = "local", sets: dict | None = None, sites_dir: Path | None = None
) -> Path:
    """`sbatch-gen render --site SITE --set k=v ... --out OUT_DIR` from the checkout (``sites_dir``: instead
    of sites/); return the script."""
    cmd = [str(REPO / ".venv" / "bin" / "sbatch-gen"), "render", "--site", site, "--out", str(out_dir)]
    if sites_dir is not None:
        cmd += ["--sites-dir", str(sites_dir)]
    for k, v in (sets or {}).items():
        cmd += ["--set", f"{k}={json.dumps(v)}"]  # VALUE is YAML; JSON is YAML
    run(cmd, cwd=REPO, timeout=60)
    return out_dir / f"{site}.sbatch"


@dataclass
class LocalJob:
    """One rendered `local` job: its directories, and what it wrote."""

    cluster: Cluster
    root: Path
    script: Path
    name: str
    job_id: int = 0

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    def submit(self, env: dict | None = None, *args: str) -> int:
        # Submitted from the checkout, like a user would: relative paths (.venv, configs/) resolve there.
        # The job takes only the variables its #SBATCH --export line names (slurm.export widens it).
        taken = set(export_line(self.script))
        left_out = sorted(n for n in env or {} if n not in taken and not n.startswith("SLURM_"))
        assert not left_out, (
            f"the job would not get {left_out}: its #SBATCH --export leaves them out (slurm.export)"
        )
        named = [k for k in faults.FAULT_ENVS if (env or {}).get(k)]
        if named and faults.MODULE not in self.script.read_text():
            raise AssertionError(f"{self.name}: {', '.join(named)} set, but not rendered with WITH_FAULTS")
        self.job_id = self.cluster.sbatch(self.script, *args, cwd=REPO, env=env)
        return self.job_id

    def batch_log(self) -> str:
        p = self.log_dir / f"{self.name}-{self.job_id}.out"
        return p.read_text(errors="replace") if p.exists() else ""

    def train_log(self, attempt: int, node: str) -> Path:
        return self.log_dir / f"{self.name}-{self.job_id}.attempt-{attempt}.{node}.log"

    def metrics(self) -> list[dict]:
        p = self.run_dir / "metrics.jsonl"
        if not p.exists():
            return []
        out = []
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                pass
        return out

    def losses(self) -> dict[int, float]:
        """Loss per step; a step logged twice (redone after a crash) keeps its last value."""
        return {r["step"]: r["loss"] for r in self.metrics() if "loss" in r and "step" in r}

    def last_step(self) -> int:
        return max(self.losses(), default=0)

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def wait_step(self, step: int, timeout: float = 180) -> int:
        """Wait until the trainer has logged ``step`` (or later) while the job runs; return that step."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            last = self.last_step()
            if last >= step:
                return last
            state = self.cluster.job(self.job_id).get("JobState")
            if state in TERMINAL:
                raise AssertionError(
                    f"job {self.job_id} ended ({state}) before step {step}:\n{self.batch_log()}"
                )
            time.sleep(0.1)
        raise AssertionError(
            f"no step {step} within {timeout}s (last {self.last_step()}):\n{self.batch_log()}"
        )

    def describe(self) -> str:
        """Everything useful when an assertion fails."""
        parts = [f"job {self.job_id}: {self.cluster.job(self.job_id)}", "--- batch log ---", self.batch_log()]
        for p in sorted(self.log_dir.glob(f"{self.name}-{self.job_id}.attempt-*.log")):
            lines = p.read_text(errors="replace").splitlines()
            parts += [f"--- {p.name} (last 25 lines) ---", *lines[-25:]]
        return "\n".join(parts)


@contextmanager
def cluster_set(cluster: Cluster, setting: str, value: str, back: str):
    """`local-slurm.sh SETTING VALUE` on the running cluster for the block, then `SETTING BACK`:
    preempt-signal on|off."""
    p = run([str(SCRIPT), setting, value], env=cluster.env, check=False)
    assert p.returncode == 0, p.stderr
    try:
        yield
    finally:
        p = run([str(SCRIPT), setting, back], env=cluster.env, check=False)
        assert p.returncode == 0, p.stderr


def preempt(cluster: Cluster, qos: str | None = None) -> int:
    """A job that needs both nodes whole, in the high-priority partition (or, with ``qos``, in the default
    partition with that QOS): Slurm preempts what runs there. Returns its id."""
    where = (
        [f"--qos={qos}"] if qos else [f"--partition={cluster.info['SBATCH_GEN_SLURM_PREEMPTOR_PARTITION']}"]
    )
    out = cluster.run(
        "sbatch",
        "--parsable",
        *where,
        "--nodes=2",
        "--exclusive",
        "--job-name=preemptor",
        "--output=/dev/null",
        "--wrap",
        "sleep 1",
    ).stdout
    job_id = int(out.strip().split(";")[0])
    cluster.submitted.add(job_id)
    return job_id


def export_line(script: Path) -> list[str]:
    """The names a rendered job takes from the submitting shell: its #SBATCH --export line."""
    (line,) = [x for x in script.read_text().splitlines() if x.startswith("#SBATCH --export=")]
    return line.removeprefix("#SBATCH --export=").split(",")


# What the tests hand a job at submit time besides the profile's defaults (slurm.export): the faults the
# trainer's test module installs (sbatch_gen.testing.faults, WITH_FAULTS; the lease's test period among them),
# and the S3 tests' settings that are no secret (their keys: secrets_file, below).
E2E_EXPORTS = [
    *faults.FAULT_ENVS,
    "AWS_DEFAULT_REGION",
    "AWS_SHARED_CREDENTIALS_FILE",
    "NO_PROXY",
    "no_proxy",
]


def secrets_file(path: Path, values: dict[str, str]) -> Path:
    """A slurm.secrets_file: NAME=value lines, mode 0600, as a user keeps one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return path


def local_job(
    cluster: Cluster,
    root: Path,
    name: str,
    sets: dict | None = None,
    *,
    config: Path | None,
    data: Path,
    site: str = "local",
    sites_dir: Path | None = None,
) -> LocalJob:
    """Render the `local` site (or ``site`` of ``sites_dir``, with ``sets`` pointing it at this cluster) for a
    job of its own (run dir, logs, rendezvous port) and return it. ``config``: the train config, if any."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)
    base = {
        "slurm.job_name": name,
        "paths.run_dir": str(root / "run"),
        "paths.log_dir": str(root / "logs"),
        "paths.data": str(data),
        "torchrun.rdzv_port": next_port(),
        "slurm.export": E2E_EXPORTS,
    }
    if config is not None:
        base["trainer.config"] = str(config)
    base.update(sets or {})
    script = render(root / "out", site, base, sites_dir)
    return LocalJob(cluster=cluster, root=root, script=script, name=name)


def trainer_workers(
    cluster: Cluster, node: str, module: str | None = None, script: str | None = None
) -> list[int]:
    """PIDs of the training worker processes on ``node`` (not torchrun's agent, not srun/slurmstepd):
    ``python -m MODULE`` (default: the trainer, or the trainer with faults: WITH_FAULTS), or ``python
    SCRIPT`` when ``script`` is given (as the render names it)."""
    modules = (module,) if module is not None else (faults.TRAINER, faults.MODULE)
    pids = []
    for pid in cluster.node_pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        # a script runs from the run's pinned copy of the code directory (paths.pin_code): <copy>/<script>
        entry = (
            any(a == script or a.endswith("/" + script) for a in args)
            if script is not None
            else "-m" in args and any(m in args for m in modules)
        )
        if entry and not any(a.endswith("torchrun") for a in args):
            pids.append(pid)
    return pids


@contextmanager
def moto_server(host: str, log: Path):
    """A real S3-compatible server (moto) on ``host``, the address under which the nodes reach this
    machine (the bridge address with one network namespace per node). Yields the endpoint URL."""
    with S3Server(host=host, log_path=log) as s3:
        yield s3.endpoint_url


# The cross-region tests: two regions, each one job pinned to its own node (region_nodes). The secret key is
# this session's own, so that a search for it finds nothing else.
S3_ACCESS_KEY, S3_SECRET_KEY = "e2e-access", f"e2e-secret-{os.urandom(8).hex()}"


def region_nodes(cluster: Cluster) -> dict[str, str]:
    """Region -> the node its job is pinned to: a on the cluster's first node, b on its second."""
    first, second = cluster.nodes[:2]
    return {"a": first, "b": second}


def region_jobs(
    cluster: Cluster,
    root: Path,
    prefix: str,
    cross_region: dict,
    *,
    config: Path | None,
    data: Path,
    sets: dict | None = None,
    site: str = "local",
    sites_dir: Path | None = None,
    transport_of: dict[str, dict] | None = None,
) -> dict[str, LocalJob]:
    """One `local` job (or ``site`` of ``sites_dir`` with ``sets``) per region of region_nodes
    (``<prefix>-<region>``, one node, pinned to the region's node), with ``cross_region`` (its ``region``
    and ``regions`` filled in; ``transport_of[region]``: that region's own transport fields, e.g. its
    credentials), not yet submitted."""
    jobs = {}
    nodes = region_nodes(cluster)
    for region, node in nodes.items():
        xr = {**cross_region, "enabled": True, "region": region, "regions": sorted(nodes)}
        if transport_of and region in transport_of:
            xr["transport"] = {**xr["transport"], **transport_of[region]}
        job_sets = {
            **(sets or {}),
            "slurm.nodes": 1,
            "slurm.extra_directives": [f"--nodelist={node}"],
            "cross_region": xr,
        }
        jobs[region] = local_job(
            cluster,
            root / region,
            f"{prefix}-{region}",
            job_sets,
            config=config,
            data=data,
            site=site,
            sites_dir=sites_dir,
        )
    return jobs


def assert_regions_completed(
    jobs: dict[str, LocalJob], infos: dict[str, dict[str, str]], restarts: dict[str, int]
) -> None:
    """Every region's job COMPLETED on its own node (region_nodes), requeued ``restarts[region]`` times (by its
    batch script)."""
    for region, job in jobs.items():
        info = infos[region]
        assert info["JobState"] == "COMPLETED", job.describe()
        assert info["NodeList"] == region_nodes(job.cluster)[region], info
        assert info["Restarts"] == str(restarts[region]), job.describe()


def assert_same_final_params(jobs: dict[str, LocalJob]) -> None:
    """Every region's exported model.safetensors holds bitwise the same parameters."""
    import numpy as np
    from safetensors.numpy import load_file

    ref_region, *others = sorted(jobs)
    ref = load_file(str(jobs[ref_region].run_dir / "model.safetensors"))
    for region in others:
        got = load_file(str(jobs[region].run_dir / "model.safetensors"))
        assert sorted(got) == sorted(ref)
        differ = [k for k in ref if not np.array_equal(ref[k], got[k])]
        assert not differ, f"final parameters differ between regions {ref_region} and {region}: {differ[:5]}"
        a, b = (jobs[r].run_dir / "model.safetensors" for r in (ref_region, region))
        assert a.read_bytes() == b.read_bytes(), f"{a} and {b}: the same parameters, other bytes"


@contextmanager
def s3_mailbox(cluster: Cluster, root: Path, bucket: str):
    """A bucket on a real S3-compatible server (moto, with conditional creates) reachable from the nodes.
    Yields (the cross_region transport, the jobs' extra environment, a boto3 client). The keys are no part
    of that environment: a job reads them on the node from a slurm.secrets_file (``s3_secrets``)."""
    import boto3

    with moto_server(cluster.host_addr, root / "moto.log") as url:
        s3 = boto3.client(
            "s3",
            endpoint_url=url,
            aws_access_key_id=S3_ACCESS_KEY,
            aws_secret_access_key=S3_SECRET_KEY,
            region_name="us-east-1",
        )
        s3.create_bucket(Bucket=bucket)
        env = {
            "AWS_DEFAULT_REGION": "us-east-1",
            "NO_PROXY": cluster.host_addr,
            "no_proxy": cluster.host_addr,
        }
        yield (
            {
                "kind": "s3",
                "bucket": bucket,
                "prefix": "e2e",
                "endpoint_url": url,
                "addressing_style": "path",
            },
            env,
            s3,
        )


def s3_secrets(root: Path) -> dict:
    """Render settings for jobs that reach the bucket through boto3's default chain with the keys in their
    environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY named as secrets (slurm.secrets), read on the
    node from a secrets file of the test's own."""
    f = secrets_file(
        root / "s3-keys.env", {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY}
    )
    return {"slurm.secrets": ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"], "slurm.secrets_file": str(f)}


def files_holding(root: Path, values: list[str]) -> list[str]:
    """Every file under ``root`` that holds one of ``values`` (as bytes): 'PATH: value'."""
    found = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath, n)
            try:
                if p.is_symlink() or not p.is_file():
                    continue
                data = p.read_bytes()
            except OSError:  # gone meanwhile (a daemon's temporary file)
                continue
            found += [f"{p}: {v}" for v in values if v.encode() in data]
    return found


def assert_resumed_losses_match(
    losses: dict[int, float], ref: dict[int, float], resumed: int, last: int
) -> None:
    """A run resumed from the checkpoint of step ``resumed`` against the uninterrupted run: every step's
    loss bitwise equal (the checkpoint restored parameters, optimizer, data position and RNG exactly, and
    the trainer settles DDP's bucket layout before the first step of every process start, so the 4 gloo
    ranks reduce in the same order as the uninterrupted run)."""
    assert sorted(losses) == list(range(1, last + 1)), sorted(losses)
    diff = [(s, losses[s], ref[s]) for s in range(1, last + 1) if losses[s] != ref[s]]
    assert not diff, f"resumed from step {resumed}; losses differ from the uninterrupted run: {diff[:5]}"
