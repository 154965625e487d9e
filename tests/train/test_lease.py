"""The run-directory lease: unit tests of the stale/takeover logic, and two real trainers on one run dir."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from sbatch_gen.testing.faults import ENV_LEASE_PERIOD, ENV_STEP_SLEEP
from sbatch_gen.testing.faults import MODULE as FAULTS
from sbatch_gen.train.lease import LEASE_FILE, STALE_PERIODS, Lease, LeaseHeld, stale_reason

from .conftest import REPO, torchrun_cmd, train_env, wait_for, write_config

pytestmark = pytest.mark.slow  # trainer subprocesses

HOST = "node-a"


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_live_lease_refuses_a_second_holder_naming_the_first(tmp_path):
    clock = Clock()
    a = Lease(tmp_path, period_s=30, job_id="1001", host=HOST, clock=clock)
    assert a.acquire() is None
    rec = json.loads((tmp_path / LEASE_FILE).read_text())
    assert rec["job_id"] == "1001" and rec["host"] == HOST and rec["heartbeat"] == clock.t
    clock.t += 42
    b = Lease(tmp_path, period_s=30, job_id="1002", host=HOST, clock=clock)
    with pytest.raises(LeaseHeld) as e:
        b.acquire()
    msg = str(e.value)
    assert "\n" not in msg
    assert "job 1001 on host node-a" in msg and "heartbeat 42 s ago" in msg, msg
    assert json.loads((tmp_path / LEASE_FILE).read_text())["job_id"] == "1001"


def test_stale_reasons():
    me = dict(job_id="2", host=HOST, now=1000.0, period_s=30.0)
    live = {"job_id": "1", "host": "other", "pid": 1, "heartbeat": 1000.0 - 30, "period_s": 30.0}
    assert stale_reason(live, **me) is None
    old = dict(live, heartbeat=1000.0 - STALE_PERIODS * 30 - 1)
    assert "heartbeat is 121 s old" in stale_reason(old, **me)
    assert "same job 2" in stale_reason(dict(live, job_id="2"), **me)
    assert "pid" in stale_reason(dict(live, host=HOST, pid=_dead_pid()), **me)
    import os

    assert stale_reason(dict(live, host=HOST, pid=os.getpid()), **me) is None  # alive on this host
    assert stale_reason(dict(live, pid=_dead_pid()), **me) is None  # another host: pid says nothing
    # the holder's own (longer) period counts
    assert stale_reason(dict(live, heartbeat=1000.0 - 200, period_s=60.0), **me) is None
    # a job of the same run (a continuation job: its predecessor has ended), not of another run
    same_run = stale_reason(dict(live, run_job="7"), **me, run_job="7")
    assert same_run == "held by job 1 of the same run 7, which has ended", same_run
    assert stale_reason(dict(live, run_job="8"), **me, run_job="7") is None
    assert stale_reason(live, **me, run_job="7") is None  # a holder of no run
    assert stale_reason(dict(live, run_job=None), **me, run_job=None) is None


@pytest.mark.parametrize("how", ["heartbeat", "same-job", "same-run", "dead-pid"])
def test_a_stale_lease_is_taken_over(tmp_path, how):
    clock = Clock()
    a = Lease(
        tmp_path,
        period_s=10,
        job_id="1001",
        host=HOST,
        pid=_dead_pid() if how == "dead-pid" else None,
        run_job="1000",
        clock=clock,
    )
    a.acquire()
    if how == "heartbeat":
        clock.t += STALE_PERIODS * 10 + 1
    b = Lease(
        tmp_path,
        period_s=10,
        job_id="1001" if how == "same-job" else "1002",
        host="node-b" if how == "same-run" else HOST,
        run_job="1000" if how == "same-run" else "1002",
        clock=clock,
    )
    took = b.acquire()
    assert took is not None and "took over the lease of job 1001" in took
    assert json.loads((tmp_path / LEASE_FILE).read_text())["token"] == b.token
    # the old holder notices on its next heartbeat, and its release leaves the new lease alone
    assert a.refresh() is False and "taken over" in a.lost
    a.release()
    assert json.loads((tmp_path / LEASE_FILE).read_text())["token"] == b.token
    b.release()
    assert not (tmp_path / LEASE_FILE).exists()


@pytest.mark.parametrize("stale_first", [False, True])
def test_racing_starters_exactly_one_wins(tmp_path, stale_first):
    clock = Clock()
    if stale_first:
        Lease(tmp_path, period_s=1, job_id="old", host="gone-host", clock=Clock(clock.t - 100)).acquire()
    n = 12
    start = threading.Barrier(n)
    won, refused = [], []

    def go(i):
        lease = Lease(tmp_path, period_s=1, job_id=f"job{i}", host=HOST, clock=clock)
        start.wait()
        try:
            lease.acquire()
            won.append(lease)
        except LeaseHeld:
            refused.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == n - 1
    assert json.loads((tmp_path / LEASE_FILE).read_text())["token"] == won[0].token


def test_heartbeat_thread_refreshes(tmp_path):
    a = Lease(tmp_path, period_s=0.05, job_id="1", host=HOST)
    a.acquire()
    first = json.loads((tmp_path / LEASE_FILE).read_text())["heartbeat"]
    a.start()
    try:
        wait_for(
            lambda: json.loads((tmp_path / LEASE_FILE).read_text())["heartbeat"] > first, 5, "a heartbeat"
        )
    finally:
        a.release()
    assert not (tmp_path / LEASE_FILE).exists()


def test_a_holder_whose_lease_was_taken_over_is_told_at_once(tmp_path):
    """The heartbeat thread calls on_lost (the trainer exits: an attempt Slurm replaced after losing its
    node must stop writing into the run dir)."""
    told = []
    a = Lease(tmp_path, period_s=0.05, job_id="1", host=HOST, on_lost=told.append)
    a.acquire()
    a.start()
    try:
        Lease(tmp_path, period_s=0.05, job_id="1", host="node-b").acquire()  # the requeued attempt
        wait_for(lambda: told, 5, "on_lost")
    finally:
        a.release()
    assert len(told) == 1 and "taken over by job 1 on host node-b" in told[0], told


# ---------------------------------------------------------------------------------------------------
# Two real trainers


def test_a_second_trainer_on_the_same_run_dir_refuses_to_start(tmp_path, data_dir, launches):
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 400}, checkpoint={"every": 1000})
    run_dir = tmp_path / "run"
    env = {ENV_STEP_SLEEP: "0.05", ENV_LEASE_PERIOD: "0.5"}
    first = launches(
        torchrun_cmd(cfg, run_dir, data_dir, nproc=2, module=FAULTS), tmp_path / "first.log", env
    )
    wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 120, "the first trainer's first step", first)
    holder = json.loads((run_dir / LEASE_FILE).read_text())
    assert holder["pid"] in first.workers().values()

    # a second trainer (plain process) on the same run dir: one line, exit 2, nothing written
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "sbatch_gen.train",
            "--config",
            str(cfg),
            "--run-dir",
            str(run_dir),
            "--data-path",
            str(data_dir),
            "--stop-file",
            str(tmp_path / "stop-second"),
        ],
        cwd=REPO,
        env=train_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 2, second.stderr
    lines = [ln for ln in second.stderr.splitlines() if "in use by" in ln]
    assert len(lines) == 1, second.stderr
    # the same line for the batch shell, which then does not requeue (the next attempt would be refused too)
    fatal = (tmp_path / "stop-second.fatal").read_text()
    assert fatal.endswith("\n") and fatal.count("\n") == 1 and fatal.strip() in lines[0], (fatal, lines)
    assert f"job {holder['job_id']} on host {holder['host']} (pid {holder['pid']})" in lines[0]
    assert "heartbeat" in lines[0] and "s ago" in lines[0]
    assert "Traceback" not in second.stderr
    assert first.proc.poll() is None  # the first one trains on
    beat = holder["heartbeat"]
    wait_for(
        lambda: json.loads((run_dir / LEASE_FILE).read_text())["heartbeat"] > beat, 10, "a heartbeat", first
    )

    # the holder dies without releasing: a new trainer on this host takes the lease over (pid gone)
    first.kill()
    assert (run_dir / LEASE_FILE).exists()
    third = subprocess.run(
        [
            sys.executable,
            "-m",
            "sbatch_gen.train",
            "--config",
            str(cfg),
            "--run-dir",
            str(run_dir),
            "--data-path",
            str(data_dir),
            "--max-steps",
            "2",
            "--resume",
            "none",
        ],
        cwd=REPO,
        env=train_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert third.returncode == 0, third.stderr
    assert f"took over the lease of job {holder['job_id']}" in third.stderr
    assert not (run_dir / LEASE_FILE).exists()  # released on exit


def test_a_trainer_whose_lease_is_taken_over_stops_at_once(tmp_path, data_dir, launches):
    """The attempt left running on a node Slurm lost (NODE_FAIL) while the requeued attempt took the run dir
    over: it exits within a heartbeat, in one line, before it writes again."""
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 400}, checkpoint={"every": 1000})
    run_dir = tmp_path / "run"
    env = {ENV_STEP_SLEEP: "0.05", ENV_LEASE_PERIOD: "0.5", "SLURM_JOB_ID": "31"}
    first = launches(
        torchrun_cmd(cfg, run_dir, data_dir, nproc=2, module=FAULTS), tmp_path / "first.log", env
    )
    wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 120, "the first trainer's first step", first)
    Lease(run_dir, period_s=0.5, job_id="31", host="node-b").acquire()  # the same job, requeued elsewhere
    wait_for(lambda: first.proc.poll() is not None, 30, "the first trainer to stop", first)
    out = first.output()
    assert first.proc.returncode != 0, out[-3000:]
    assert (
        "stopping: another attempt trains in this run directory now (the lease was taken over by job 31 "
        "on host node-b" in out
    ), out[-3000:]
