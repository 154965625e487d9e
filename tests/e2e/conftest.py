"""End-to-end fixtures: a real two-node Slurm cluster on this machine (scripts/local-slurm.sh).

The session fixture ``slurm`` starts the cluster once and stops it at the end of the session (unless it
was already running before, e.g. started by hand: then it is left running). Stopping is checked: no
daemon, namespace, bridge or /etc/hosts line of that cluster may be left behind. Which cluster: the
local-slurm.sh instance that ``slurm_instance`` names (tests/conftest.py: under `make test`, that of this
process's e2e group, so that two groups run side by side on two clusters).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from e2e_lib import MEASUREMENTS, REPO, Cluster, LocalJob, leftovers, local_job
from e2e_lib import script as _script


@pytest.fixture(scope="session")
def slurm(slurm_instance: str) -> Cluster:
    assert os.geteuid() == 0, "the end-to-end tests start Slurm daemons and need root"

    def script(action: str):
        return _script(action, instance=slurm_instance)

    was_running = script("status").returncode == 0
    p = script("start")
    assert p.returncode == 0, f"local-slurm.sh start failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    info = dict(line.split("=", 1) for line in script("env").stdout.splitlines() if "=" in line)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "TORCHELASTIC_", "PYTEST_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["SLURM_CONF"] = info["SLURM_CONF"]
    env["SBATCH_GEN_SLURM_INSTANCE"] = slurm_instance  # local-slurm.sh run with this environment acts on it
    env["PYTHONUNBUFFERED"] = "1"
    # `start` preempts by partition priority; a cluster that was running may have been left otherwise
    cluster = Cluster(env=env, info=info, preempting_by=None if was_running else "partition")
    try:
        for node in cluster.nodes:  # each node can be looked at in the layout the tests assume (else: raises)
            cluster.node_pids(node)
    except AssertionError:
        if not was_running:
            script("stop")
        raise
    yield cluster
    if was_running:
        cluster.cancel_all()
        cluster.preempt_type("partition")  # as `start` leaves it
        return
    p = script("stop")
    assert p.returncode == 0, f"local-slurm.sh stop failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    # stopping twice is harmless, and nothing is left behind (zombies are reaped within a few seconds)
    p = script("stop")
    assert p.returncode == 0, f"second local-slurm.sh stop failed:\n{p.stderr}"
    deadline = time.monotonic() + 10
    while leftovers(info) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(info), f"left behind after stop: {leftovers(info)}"
    assert script("status").returncode == 3


@pytest.fixture
def cluster(slurm: Cluster, request):
    """The session cluster, with no job left over from a previous test and none left after this one,
    preempting by partition priority unless the test asks for ``qos_preemption``."""
    slurm.cancel_all()
    if "qos_preemption" not in request.fixturenames:
        slurm.preempt_type("partition")
    yield slurm
    left = slurm.jobs()
    details = [slurm.run("scontrol", "-o", "show", "job", str(j), check=False).stdout for j, _ in left]
    slurm.cancel_all()
    assert not left, f"the test left jobs behind: {left}\n" + "\n".join(details)
    slurm.wait_no_job_processes()


@pytest.fixture
def qos_preemption(cluster: Cluster) -> str:
    """PreemptType=preempt/qos for the test (`local-slurm.sh preempt-type qos`): a job of the QOS returned
    (urgent) preempts the jobs of QOS normal, with normal's GraceTime. The next test that does not ask for it
    goes back to partition priority, so QOS tests that follow one another restart slurmctld once."""
    cluster.preempt_type("qos")
    return cluster.info["SBATCH_GEN_SLURM_PREEMPTOR_QOS"]


@pytest.fixture(scope="session")
def e2e_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def train_config(e2e_root) -> Path:
    """The tiny test config with a few more steps, so that a signal lands mid-run: 40 steps, a checkpoint
    every 5."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["train"]["steps"] = 40
    cfg["checkpoint"]["every"] = 5
    cfg["checkpoint"]["keep_last"] = 3
    p = e2e_root / "e2e-tiny.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


@pytest.fixture(scope="session")
def data_dir(e2e_root) -> Path:
    """Token shards for single-region jobs (prepared on demand by the first job)."""
    d = e2e_root / "data"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def reference_run(slurm, e2e_root, train_config, data_dir) -> LocalJob:
    """One uninterrupted 2 nodes x 2 processes run of the e2e config: the losses every interrupted run
    must reproduce."""
    job = local_job(slurm, e2e_root / "reference", "ref", config=train_config, data=data_dir)
    job.submit()
    slurm.wait_done(job.job_id, timeout=300)
    return job


def pytest_terminal_summary(terminalreporter):
    if MEASUREMENTS:
        terminalreporter.section("end-to-end measurements (local Slurm)")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)
