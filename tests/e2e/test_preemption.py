"""Preemption the way shared and SUNK clusters do it, on the real local Slurm (scripts/local-slurm.sh: a job in
partition "high" preempts the jobs of "debug", GraceTime 120 s, and of "sunk", no GraceTime; KillWait 5 s).

Every stop checkpoint here takes longer than KillWait (5 s): the trainer holds it SBATCH_GEN_TEST_STOP_SAVE_HOLD_S
seconds before marking it complete, as a large checkpoint would.

- partition priority with a GraceTime: Slurm sends SIGTERM to the job steps only (torchrun's agent and
  run-trainer), never to the batch shell. torchrun ignores it (run-trainer); the stop file carries it to the
  workers, they checkpoint in their budget, every node says so in one line, and the batch script requeues
  (Slurm would not: the script has exited before the grace ended).
- the same with SlurmctldParameters=preempt_send_user_signal: the profile's USR1 to the batch shell.
- QOS preemption (PreemptType=preempt/qos, the fixture qos_preemption): a job of QOS urgent preempts one of
  QOS normal in the same partition; normal's GraceTime (120 s) applies, with the same signals. Also while
  a stop checkpoint that USR1 (the time-limit warning) began is being written: it completes.
- a preemption (partition, QOS) while the preflight runs: Slurm signals the job steps only; the killed
  preflight is a stop, not a failed node.
- `scontrol requeue` by an administrator: TERM to everything, SIGKILL KillWait later; Slurm requeues.
- SUNK-style, no GraceTime: the stop checkpoint cannot complete within KillWait. The newest periodic
  checkpoint survives, the job resumes from it and the log names the steps that are redone.

Each ends COMPLETED after exactly one requeue, with no traceback in any log.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from e2e_lib import (
    REPO,
    SHORT_STEPS,
    STOP_HOLD_S,
    WITH_FAULTS,
    LocalJob,
    cluster_set,
    local_job,
    preempt,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HOLD_S = STOP_HOLD_S


def _job(cluster, root: Path, name: str, train_config, data_dir, sets: dict | None = None) -> LocalJob:
    """The local site with a stop budget that covers HOLD_S (checkpoint_s 40 + margin_s 20 = 60 s): the
    cluster's GraceTime (120 s) leaves room for it; the trainer with the faults the test submits (WITH_FAULTS)."""
    base = {
        "preemption.checkpoint_s": 40,
        "preemption.margin_s": 20,
        "preemption.lead_time_s": 60,
        **WITH_FAULTS,
    }
    return local_job(cluster, root, name, {**base, **(sets or {})}, config=train_config, data=data_dir)


def _logs(job: LocalJob) -> dict[str, str]:
    logs = {"batch": job.batch_log()}
    for p in sorted(job.log_dir.glob(f"{job.name}-{job.job_id}.attempt-*.log")):
        logs[p.name] = p.read_text(errors="replace")
    return logs


def _assert_no_traceback(job: LocalJob) -> None:
    for name, text in _logs(job).items():
        assert "Traceback" not in text, f"{name}:\n{text[-4000:]}"
        assert "forcefully exiting via 9" not in text, f"{name}: torchrun SIGKILLed a worker\n{text[-4000:]}"


def _attempt(log: str, job: LocalJob, n: int) -> str:
    """The batch log's lines of attempt ``n``."""
    start = log.index(f"job {job.job_id}, attempt {n}")
    nxt = log.find(f"job {job.job_id}, attempt {n + 1}")
    return log[start : nxt if nxt >= 0 else len(log)]


def _steps(job: LocalJob) -> Counter:
    return Counter(r["step"] for r in job.metrics() if "loss" in r and "step" in r)


def _stop_save_s(job: LocalJob, step: int) -> float:
    """How long the trainer took for the stop checkpoint of ``step`` (its log line)."""
    text = "".join(job.train_log(0, node).read_text(errors="replace") for node in job.cluster.nodes)
    m = re.search(rf"checkpoint step {step} saved to \S+ in ([0-9.]+)s", text)
    assert m, text[-3000:]
    return float(m.group(1))


def _assert_complete_stop(job: LocalJob, why: str, steps: int = 40) -> int:
    """Attempt 0 stopped with a complete checkpoint held HOLD_S s, every node said so in one line (in its own
    log and the batch log), attempt 1 resumed from it, every step was trained exactly once. Returns the stop
    step."""
    info = job.cluster.job(job.job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    ack = json.loads((job.run_dir / "stop" / f"{job.job_id}.attempt-0.ack").read_text())
    step = ack["step"]
    assert why in ack["reason"], ack
    assert ack["checkpoint"].rstrip("/").endswith(f"checkpoints/step-{step}"), ack
    assert _stop_save_s(job, step) >= HOLD_S, "the stop checkpoint was not held"
    log = job.batch_log()
    first = _attempt(log, job, 0)
    for node in job.cluster.nodes:
        said = f"node {node}: stopped after step {step} ("
        assert first.count(said) == 1, first
        assert said in job.train_log(0, node).read_text(errors="replace")
    assert job.summary()["resumed_from_step"] == step
    counts = _steps(job)
    assert sorted(counts) == list(range(1, steps + 1)) and set(counts.values()) == {1}, counts
    assert "training finished" in _attempt(log, job, 1), log
    _assert_no_traceback(job)
    return step


def _preempted_with_a_slow_stop(cluster, root: Path, name: str, train_config, data_dir) -> LocalJob:
    """A job whose stop checkpoint takes HOLD_S, preempted by a job of partition high mid-run, to its end."""
    job = _job(cluster, root, name, train_config, data_dir)
    job.submit({"SBATCH_GEN_TEST_STOP_SAVE_HOLD_S": str(HOLD_S)})
    job.wait_step(6)
    preempt(cluster)
    cluster.wait_done(job.job_id, timeout=400)
    return job


def test_partition_preemption_with_grace_time_checkpoints_and_requeues_once(
    cluster, e2e_root, train_config, data_dir
):
    job = _preempted_with_a_slow_stop(cluster, e2e_root / "preempt-grace", "pgrace", train_config, data_dir)
    _assert_complete_stop(job, "SIGTERM to the training step on")
    first = _attempt(job.batch_log(), job, 0)
    assert "received" not in first, "the batch shell got a signal: not the preemption this test is about"
    assert "trainer checkpointed and asked for a requeue" in first and "requeueing job" in first, first


def test_partition_preemption_with_preempt_send_user_signal(cluster, e2e_root, train_config, data_dir):
    with cluster_set(cluster, "preempt-signal", "on", back="off"):
        job = _preempted_with_a_slow_stop(cluster, e2e_root / "preempt-usr1", "pusr1", train_config, data_dir)
    _assert_complete_stop(job, "SIGUSR1 to the batch shell")
    first = _attempt(job.batch_log(), job, 0)
    assert "SIGUSR1 received" in first and "requeueing job" in first, first


def _preempted_during_the_preflight(cluster, root: Path, name: str, train_config, data_dir, sets: dict, qos):
    """A job preempted (by partition priority, or with ``qos`` by QOS) while its preflight runs (made slow by
    its health check until the preemption): Slurm signals the job steps only; the killed preflight is a stop,
    not a failed node: requeued once, every step trained once."""
    slow = root / "preflight-slow.marker"
    root.mkdir(parents=True)
    slow.touch()
    job = local_job(
        cluster,
        root,
        name,
        {"preflight.health_check": f"test ! -e {slow} || sleep 60", "trainer.max_steps": SHORT_STEPS, **sets},
        config=train_config,
        data=data_dir,
    )
    job.submit()
    deadline = time.monotonic() + 120
    while "preflight on 2 nodes" not in job.batch_log():
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.2)
    time.sleep(1)  # the health check sleeps on both nodes
    preempt(cluster, qos=qos)
    slow.unlink()  # the next attempt's preflight is quick
    info = cluster.wait_done(job.job_id, timeout=300)
    log = job.batch_log()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    first = _attempt(log, job, 0)
    assert "stopped during the preflight" in first and "requeueing job" in first, first
    assert "preflight failed" not in log, log
    # the code it ran: the checkout as submitted (paths.code_dir, pinned), in summary.json
    head = cluster.run("git", "-C", str(REPO), "rev-parse", "HEAD").stdout.strip()
    assert job.summary()["code"] in (f"{head} clean", f"{head} dirty"), job.summary()
    counts = _steps(job)
    assert sorted(counts) == list(range(1, SHORT_STEPS + 1)) and set(counts.values()) == {1}, counts
    _assert_no_traceback(job)


def test_a_preemption_during_the_preflight_is_a_stop_and_requeues_once(
    cluster, e2e_root, train_config, data_dir
):
    _preempted_during_the_preflight(
        cluster, e2e_root / "preempt-preflight", "ppre", train_config, data_dir, {}, None
    )


def test_a_qos_preemption_during_the_preflight_is_a_stop_and_requeues_once(
    cluster, qos_preemption, e2e_root, train_config, data_dir
):
    _preempted_during_the_preflight(
        cluster,
        e2e_root / "qos-preflight",
        "pqospre",
        train_config,
        data_dir,
        {"slurm.qos": "normal"},
        qos_preemption,
    )


def test_qos_preemption_with_grace_time_checkpoints_and_requeues_once(
    cluster, qos_preemption, e2e_root, train_config, data_dir
):
    """PreemptType=preempt/qos: QOS urgent preempts QOS normal, whose GraceTime (120 s) gives the stop
    checkpoint its budget. `sbatch-gen doctor` reads that grace from the QOS and says it is enough."""
    job = _job(cluster, e2e_root / "preempt-qos", "pqos", train_config, data_dir, {"slurm.qos": "normal"})
    doc = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "sbatch-gen"),
            "doctor",
            "--site",
            "local",
            "--json",
            "--sites-dir",
            str(REPO / "sites"),
        ]
        + [
            a
            for kv in ("slurm.qos=normal", "preemption.checkpoint_s=40", "preemption.margin_s=20")
            for a in ("--set", kv)
        ],
        env=cluster.env,
        cwd=job.root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert doc.returncode == 0, doc.stdout + doc.stderr
    rows = {c["check"]: c for c in json.loads(doc.stdout)["checks"]}
    pre = rows["preemption"]
    grace = cluster.info["SBATCH_GEN_SLURM_GRACE_S"]
    assert pre["verdict"] == "ok" and f"(QOS normal), GraceTime={grace} s" in pre["found"], pre
    job.submit({"SBATCH_GEN_TEST_STOP_SAVE_HOLD_S": str(HOLD_S)})
    job.wait_step(6)
    preempt(cluster, qos=qos_preemption)
    cluster.wait_done(job.job_id, timeout=400)
    _assert_complete_stop(job, "SIGTERM to the training step on")
    first = _attempt(job.batch_log(), job, 0)
    assert "received" not in first and "requeueing job" in first, first


def test_a_qos_preemption_during_a_usr1_stop_checkpoint_lets_it_complete(
    cluster, qos_preemption, e2e_root, train_config, data_dir
):
    """The time-limit warning (USR1 to the batch shell, sent as `--signal=B:USR1@...` sends it) began a stop
    checkpoint, held HOLD_S s; a QOS preemption (GraceTime) comes while it is written. Slurm's SIGTERM to the
    job steps is a second stop request (every node's run-trainer adds its line to the stop file and hands
    it on to the workers): the save goes on, completes within the grace, and the job is requeued once."""
    job = _job(
        cluster,
        e2e_root / "qos-usr1",
        "pqosusr1",
        train_config,
        data_dir,
        {"slurm.qos": "normal", "trainer.max_steps": SHORT_STEPS},
    )
    job.submit({"SBATCH_GEN_TEST_STOP_SAVE_HOLD_S": str(HOLD_S)})
    job.wait_step(6)
    cluster.run("scancel", "--signal=USR1", "--batch", str(job.job_id))
    stop = job.run_dir / "stop" / f"{job.job_id}.attempt-0"
    deadline = time.monotonic() + 120
    while not Path(f"{stop}.stopping").exists():
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.1)
    preempt(cluster, qos=qos_preemption)
    deadline = time.monotonic() + 60
    while "SIGTERM to the training step" not in stop.read_text():
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.1)
    assert not Path(f"{stop}.ack").exists(), "the preemption came after the stop checkpoint, not during it"
    cluster.wait_done(job.job_id, timeout=400)
    _assert_complete_stop(job, "SIGUSR1 to the batch shell", steps=SHORT_STEPS)
    said = stop.read_text().splitlines()
    assert said[0] == "SIGUSR1 to the batch shell", said
    assert sorted(said[1:]) == [f"SIGTERM to the training step on {n}" for n in cluster.nodes], said
    first = _attempt(job.batch_log(), job, 0)
    assert "SIGUSR1 received" in first and first.count("requeueing job") == 1, first


def _unpace_once_requeued(cluster, job: LocalJob, pace: Path) -> None:
    """Once Slurm has requeued the job (attempt 0 is over), its next attempt, which only has to finish,
    trains at its own pace: the per-step sleep (SBATCH_GEN_TEST_STEP_SLEEP_WHILE) ends with ``pace``."""
    deadline = time.monotonic() + 120
    while cluster.job(job.job_id)["Restarts"] == "0":
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.3)
    pace.unlink()


def test_an_administrators_requeue_checkpoints_within_kill_wait_and_slurm_requeues(
    cluster, e2e_root, train_config, data_dir
):
    """`scontrol requeue`: Slurm TERMs every process of the job and SIGKILLs it KillWait (5 s) later, then
    requeues it itself. The small stop checkpoint fits in those 5 s; the batch script does not requeue too."""
    job = _job(cluster, e2e_root / "admin-requeue", "adminrq", train_config, data_dir)
    pace = job.root / "pace"
    pace.touch()
    job.submit({"SBATCH_GEN_TEST_STEP_SLEEP_S": "0.3", "SBATCH_GEN_TEST_STEP_SLEEP_WHILE": str(pace)})
    job.wait_step(6)
    cluster.run("scontrol", "requeue", str(job.job_id))
    _unpace_once_requeued(cluster, job, pace)
    cluster.wait_done(job.job_id, timeout=400)
    info = cluster.job(job.job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    ack = json.loads((job.run_dir / "stop" / f"{job.job_id}.attempt-0.ack").read_text())
    assert job.summary()["resumed_from_step"] == ack["step"], (ack, job.summary())
    counts = _steps(job)
    assert sorted(counts) == list(range(1, 41)) and set(counts.values()) == {1}, counts
    first = _attempt(job.batch_log(), job, 0)
    assert "SIGTERM received" in first and "requeueing job" not in first, first
    _assert_no_traceback(job)


def test_sunk_style_preemption_keeps_the_periodic_checkpoint_and_names_the_redone_steps(
    cluster, e2e_root, train_config, data_dir
):
    """No GraceTime: SIGTERM, then SIGKILL after KillWait (5 s), shorter than the stop checkpoint (HOLD_S). The
    cut-short save never becomes a checkpoint; the newest periodic one survives, Slurm requeues the job,
    it resumes from the newest periodic checkpoint and its batch log says which steps are trained again."""
    job = _job(
        cluster,
        e2e_root / "preempt-sunk",
        "psunk",
        train_config,
        data_dir,
        {"slurm.partition": cluster.info["SBATCH_GEN_SLURM_SUNK_PARTITION"]},
    )
    pace = job.root / "pace"
    pace.touch()
    job.submit(
        {
            "SBATCH_GEN_TEST_STOP_SAVE_HOLD_S": str(HOLD_S),
            "SBATCH_GEN_TEST_STEP_SLEEP_S": "0.3",
            "SBATCH_GEN_TEST_STEP_SLEEP_WHILE": str(pace),
        }
    )
    job.wait_step(7)
    preempt(cluster)
    _unpace_once_requeued(cluster, job, pace)
    cluster.wait_done(job.job_id, timeout=400)
    info = cluster.job(job.job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    stop = job.run_dir / "stop" / f"{job.job_id}.attempt-0"
    assert not Path(f"{stop}.ack").exists(), "the stop checkpoint could not have completed within KillWait"
    said = Path(f"{stop}.stopping").read_text().strip()
    m = re.search(
        r"stop checkpoint of step (\d+) started .*the newest complete checkpoint is step (\d+)", said
    )
    assert m, said
    stop_step, newest = int(m.group(1)), int(m.group(2))
    assert newest == (stop_step - 1) // 5 * 5 and newest >= 5, said  # the periodic saves: every 5 steps
    assert f"redoes steps {newest + 1}-{stop_step} ({stop_step - newest} step" in said, said
    second = _attempt(job.batch_log(), job, 1)
    assert f"WARNING: attempt 0 was ended before its stop checkpoint completed: {said}" in second, second
    assert job.summary()["resumed_from_step"] == newest
    counts = _steps(job)
    assert sorted(counts) == list(range(1, 41)), counts
    assert {s for s, n in counts.items() if n > 1} == set(range(newest + 1, stop_step + 1)), counts
    _assert_no_traceback(job)
