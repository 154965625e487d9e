"""Faults on the real cluster: a node's training processes killed mid-run, a broken profile or entry point
caught by the preflight, and a job that keeps failing running out of its requeue budget."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from e2e_lib import assert_resumed_losses_match, local_job, report, trainer_workers

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_node_failure_recovers_from_last_checkpoint(cluster, reference_run, e2e_root, train_config, data_dir):
    """(4) SIGKILL the training processes on one node mid-run: the step fails, nothing is left running on
    either node, the batch script requeues within the budget, the job resumes from the last complete
    checkpoint and finishes with the uninterrupted run's losses. Prints the downtime."""
    ref = reference_run.losses()
    job = local_job(cluster, e2e_root / "nodefail", "nodefail", config=train_config, data=data_dir)
    job.submit()
    job.wait_step(7)  # past the checkpoint at step 5
    victims = trainer_workers(cluster, cluster.nodes[1])
    assert len(victims) == 2, f"expected 2 workers on n2, found {victims}\n{job.describe()}"
    step_at_kill = job.last_step()
    t_kill = time.monotonic()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)

    # detected: the attempt ends; before the job runs again nothing of it is left on any node. Slurm marks the
    # job PENDING as it requeues it, a moment before each node's slurmstepd of the killed step has exited:
    # what counts is that everything is gone within the wait before the next attempt (BeginTime, ~6 s here).
    detected = None
    checked_idle = False
    left: dict = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        info = cluster.job(job.job_id)
        if detected is None and info["JobState"] != "RUNNING":
            detected = time.monotonic() - t_kill
        if info["JobState"] == "PENDING" and info["Restarts"] == "1":
            left = {n: cluster.job_processes(n) for n in cluster.nodes}
            if cluster.job(job.job_id)["JobState"] == "PENDING" and not any(left.values()):
                checked_idle = True  # between attempts, and nothing of the job runs anywhere
                break
        if info["Restarts"] == "1" and info["JobState"] == "RUNNING" and detected is not None:
            break  # requeued and restarted: the wait is over
        time.sleep(0.1)
    assert detected is not None, f"the kill was not detected within 120 s\n{job.describe()}"

    # recovered: the requeued attempt resumes and the first new step appears
    n_before = len(job.metrics())
    while time.monotonic() < deadline + 180 and len(job.metrics()) <= n_before:
        if cluster.job(job.job_id)["JobState"] in ("FAILED", "CANCELLED", "COMPLETED"):
            break
        time.sleep(0.1)
    downtime = time.monotonic() - t_kill
    info = cluster.wait_done(job.job_id, timeout=300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    summary = job.summary()
    resumed = summary["resumed_from_step"]
    assert resumed is not None and resumed % 5 == 0 and 5 <= resumed <= step_at_kill, summary
    log = job.batch_log()
    assert re.search(r"training step exited with status [1-9]", log), log
    assert "requeueing job" in log and "training step failed" in log, log
    assert_resumed_losses_match(job.losses(), ref, resumed, 40)
    lost = step_at_kill - resumed
    assert checked_idle, (
        f"attempt 0 left processes running until attempt 1 started (or no wait was seen): {left}"
    )
    report(
        f"node failure, requeue (torchrun.max_restarts=0): killed {len(victims)} workers on n2 at step "
        f"{step_at_kill}; detected after {detected:.1f} s; first new step {downtime:.1f} s after the kill "
        f"(requeue, preflight, restart, resume from step {resumed}; {lost} steps redone)"
    )


def test_node_failure_torchrun_restart_recovers(cluster, reference_run, e2e_root, train_config, data_dir):
    """(4, in-job variant) With torchrun.max_restarts=1 the same kill is handled inside the job: both nodes'
    agents stop every worker of the failed generation, re-rendezvous and start new workers, which resume
    from the last complete checkpoint; no requeue. Prints the downtime."""
    ref = reference_run.losses()
    job = local_job(
        cluster,
        e2e_root / "restart",
        "restart",
        {"torchrun.max_restarts": 1},
        config=train_config,
        data=data_dir,
    )
    job.submit()
    job.wait_step(7)
    old = {n: trainer_workers(cluster, n) for n in cluster.nodes}
    assert all(len(p) == 2 for p in old.values()), f"workers: {old}\n{job.describe()}"
    step_at_kill = job.last_step()
    t_kill = time.monotonic()
    for pid in old[cluster.nodes[1]]:
        os.kill(pid, signal.SIGKILL)

    # a new generation of workers on both nodes, and nothing of the old one left on either
    deadline = time.monotonic() + 180
    new: dict[str, list[int]] = {}
    while time.monotonic() < deadline:
        new = {n: [p for p in trainer_workers(cluster, n) if p not in old[n]] for n in old}
        if all(len(p) == 2 for p in new.values()):
            break
        assert cluster.job(job.job_id)["JobState"] == "RUNNING", job.describe()
        time.sleep(0.1)
    assert all(len(p) == 2 for p in new.values()), f"no new workers: {new}\n{job.describe()}"
    restarted = time.monotonic() - t_kill
    survivors = [p for ps in old.values() for p in ps if os.path.exists(f"/proc/{p}")]
    assert not survivors, f"workers of the failed generation still running: {survivors}"
    n_before = len(job.metrics())  # the old generation is gone: every record from here on is a new one
    while time.monotonic() < deadline and len(job.metrics()) <= n_before:
        time.sleep(0.1)
    downtime = time.monotonic() - t_kill

    info = cluster.wait_done(job.job_id, timeout=300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", job.describe()
    # the last generation of workers (started by torchrun inside attempt 0) resumed from the checkpoint
    summary = job.summary()
    resumed = summary["resumed_from_step"]
    assert resumed is not None and resumed % 5 == 0 and 5 <= resumed <= step_at_kill, summary
    assert summary["first_step"] == resumed + 1, summary
    log = job.batch_log()
    assert "training finished" in log and "requeueing" not in log, log
    assert re.findall(rf"job {job.job_id}, attempt (\d)", log) == ["0"], log
    assert_resumed_losses_match(job.losses(), ref, resumed, 40)
    report(
        f"node failure, torchrun restart (torchrun.max_restarts=1): killed 2 workers on n2 at step "
        f"{step_at_kill}; new workers on both nodes after {restarted:.1f} s; first new step {downtime:.1f} s "
        f"after the kill (resume from step {resumed}; {step_at_kill - resumed} steps redone)"
    )


@pytest.mark.parametrize(
    "case,sets,message",
    [
        (
            "missing-entry-point",
            {"trainer.module": "sbatch_gen.no_such_trainer"},
            r"trainer module sbatch_gen\.no_such_trainer not importable",
        ),
        (
            "missing-interface",
            {"network.socket_ifname": "ib0"},
            r"network interface ib0 does not exist \(network\.socket_ifname\); have: .*eth0",
        ),
        (
            "missing-train-config",
            {"trainer.config": "configs/no-such-config.yaml"},
            r"train config configs/no-such-config\.yaml not readable",
        ),
    ],
)
def test_preflight_fails_fast_with_clear_message(
    cluster, e2e_root, train_config, data_dir, case, sets, message
):
    """(5) A broken profile or entry point fails in the preflight with a message naming the node and the
    profile field, before torchrun starts (no rendezvous hang), and is not requeued."""
    job = local_job(
        cluster, e2e_root / f"preflight-{case}", f"pf-{case}", sets, config=train_config, data=data_dir
    )
    job.submit()
    info = cluster.wait_done(job.job_id, timeout=120)
    log = job.batch_log()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", job.describe()
    # each node that got to report names itself and the cause (--kill-on-bad-exit ends the other node's
    # preflight as soon as one fails, so that one may not get to say it)
    failed = re.findall(r"^preflight FAILED on (\S+): (.*)$", log, re.M)
    assert failed and all(n in cluster.nodes and re.match(message, m) for n, m in failed), log
    assert "preflight failed" in log and "not requeueing" in log
    assert "training; per-node logs" not in log  # torchrun never started
    start, end = (time.mktime(time.strptime(info[k], "%Y-%m-%dT%H:%M:%S")) for k in ("StartTime", "EndTime"))
    report(f"preflight ({case}): the job failed {end - start:.0f} s after it started")
    assert end - start < 60  # the rendezvous would have waited 120 s (torchrun.rdzv_timeout_s)


# A trainer with a bug: it crashes on every start. It writes no "<stop file>.fatal" (a bad config does, and
# is not requeued: tests/e2e/test_run_dir_guards.py, tests/render/test_requeue.py), so every failure counts
# against the requeue budget.
CRASHING_TRAINER = """import sys
print("crashing trainer: started with", sys.argv[1:], flush=True)
raise RuntimeError("a bug in the trainer")
"""


def test_requeue_budget_stops_a_job_that_keeps_failing(cluster, e2e_root, train_config, data_dir):
    """(6) A job that fails on every attempt (no progress) is requeued preemption.max_requeues_without_progress
    times, then no more, in one line."""
    script = e2e_root / "crashing_trainer.py"
    script.write_text(CRASHING_TRAINER)
    job = local_job(
        cluster,
        e2e_root / "budget",
        "budget",
        {
            "preemption.max_requeues_without_progress": 2,
            "trainer.module": None,
            "trainer.script": str(script),
        },
        config=train_config,
        data=data_dir,
    )
    job.submit()
    info = cluster.wait_done(job.job_id, timeout=240)
    log = job.batch_log()
    assert info["JobState"] == "FAILED", job.describe()
    assert info["Restarts"] == "2", job.describe()
    attempts = re.findall(rf"job {job.job_id}, attempt (\d)", log)
    assert attempts == ["0", "1", "2"], log
    assert len(re.findall(r"requeueing job", log)) == 2
    assert (
        "not requeueing: 3 attempt(s) in a row saved no newer checkpoint, more than preemption.max_requeues_without_progress (2)"
        in log
    )
    # the cause is in the per-node log
    assert "RuntimeError: a bug in the trainer" in job.train_log(0, cluster.nodes[0]).read_text()
    assert "cannot run" not in log, log
