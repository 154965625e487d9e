"""trainer.stop_protocol signal and none on the real cluster: rendered `local` jobs (2 nodes x 2 processes,
torchrun) whose trainer is a probe (tests/probes/sbg_stop_probe.py), preempted with
`scancel --signal=USR1 --batch` as Slurm's warning signal would.

- signal: the batch shell passes USR1 on to srun, srun to torchrun on both nodes, and torchrun
  (--signals-to-handle ... SIGUSR1) to its workers; the agent survives and waits (--shutdown-timeout) while
  each worker saves slowly; then the job requeues and the second attempt finds every rank's save.
- none: the batch shell requeues at once; the training step is killed; the second attempt resumes from
  the probe's own periodic checkpoint."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from e2e_lib import REPO, LocalJob, local_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROBES = REPO / "tests" / "probes"
RANKS = range(4)


def _probe_job(
    cluster, root: Path, name: str, protocol: str, args: list[str], train_config, data_dir
) -> LocalJob:
    return local_job(
        cluster,
        root,
        name,
        {
            "paths.code_dir": str(PROBES),
            "trainer.module": "sbg_stop_probe",
            "trainer.extra_args": args,
            "trainer.stop_protocol": protocol,
        },
        config=train_config,
        data=data_dir,
    )


def _wait_files(job: LocalJob, paths: list[Path], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        state = job.cluster.job(job.job_id).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), job.describe()
        assert time.monotonic() < deadline, f"not there after {timeout}s: {paths}\n{job.describe()}"
        time.sleep(0.2)


def _starts(job: LocalJob, attempt: int) -> dict[int, dict]:
    return {
        r: json.loads((job.run_dir / "probe" / f"start.attempt-{attempt}.rank-{r}.json").read_text())
        for r in RANKS
    }


def test_signal_protocol_torchrun_survives_usr1_while_the_workers_save_then_the_job_requeues(
    cluster, e2e_root, train_config, data_dir
):
    job = _probe_job(
        cluster,
        e2e_root / "stop-signal",
        "stopsig",
        "signal",
        ["--probe-mode", "signal", "--probe-save-s", "4"],
        train_config,
        data_dir,
    )
    job.submit()
    probe = job.run_dir / "probe"
    _wait_files(job, [probe / f"start.attempt-0.rank-{r}.json" for r in RANKS])
    time.sleep(2)  # torchrun installs its signal handlers as it starts the workers
    cluster.run("scancel", "--signal=USR1", "--batch", str(job.job_id))
    info = cluster.wait_done(job.job_id, timeout=300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()

    for r in RANKS:
        saved = json.loads((probe / f"saved.rank-{r}").read_text())
        # every worker got USR1 and had its 4 s to save: torchrun's agent neither died of USR1 nor killed it
        assert saved["attempt"] == 0 and saved["signal"] == "SIGUSR1" and saved["save_s"] >= 4, saved
        assert set((probe / f"signals.rank-{r}").read_text().split()) <= {"0", "SIGUSR1"}
    # the second attempt found the saves: resuming is the trainer's job
    assert all(s["resumed"] is not None for s in _starts(job, 1).values()), _starts(job, 1)

    log = job.batch_log()
    a1 = log.index(f"job {job.job_id}, attempt 1")
    first = log[:a1]
    assert "SIGUSR1 received (trainer.stop_protocol signal)" in first, log
    assert "SIGUSR1 to torchrun on every node (through srun); waiting up to 30 s" in first, log
    assert "WARNING: the training step still runs" not in first, log
    assert first.index("training step exited with status") < first.index("requeueing job"), log
    assert "training finished" in log[a1:], log
    assert not (job.run_dir / "stop" / f"{job.job_id}.attempt-0").exists(), "no stop file with signal"
    for node in cluster.nodes:
        text = job.train_log(0, node).read_text(errors="replace")
        # torchrun's agent handled it (torch logs the number) and sent it on to both workers
        assert re.search(
            rf"Received ({signal.SIGUSR1.value}|\S*SIGUSR1) death signal, shutting down workers", text
        ), text[-3000:]
        assert len(re.findall(r"Sending process \d+ closing signal SIGUSR1", text)) == 2, text[-3000:]
        assert "forcefully exiting via" not in text, text[-3000:]  # no SIGKILL from the agent


def test_none_protocol_requeues_at_once_and_the_trainer_resumes_from_its_own_checkpoint(
    cluster, e2e_root, train_config, data_dir
):
    job = _probe_job(
        cluster,
        e2e_root / "stop-none",
        "stopnone",
        "none",
        ["--probe-mode", "none", "--probe-step-s", "0.2", "--probe-more-steps", "5"],
        train_config,
        data_dir,
    )
    job.submit()
    probe = job.run_dir / "probe"
    ckpts = [probe / f"ckpt.rank-{r}" for r in RANKS]
    _wait_files(job, ckpts)
    deadline = time.monotonic() + 120
    while min(int(p.read_text() or 0) for p in ckpts) < 5:
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.2)
    cluster.run("scancel", "--signal=USR1", "--batch", str(job.job_id))
    info = cluster.wait_done(job.job_id, timeout=300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()

    starts = _starts(job, 1)
    for r in RANKS:
        assert isinstance(starts[r]["resumed"], int) and starts[r]["resumed"] >= 5, starts
        assert int((probe / f"ckpt.rank-{r}").read_text()) == starts[r]["resumed"] + 5
        assert not (probe / f"signals.rank-{r}").exists()
    log = job.batch_log()
    a1 = log.index(f"job {job.job_id}, attempt 1")
    first = log[:a1]
    assert "SIGUSR1 received (trainer.stop_protocol none)" in first, log
    assert "SIGUSR1: no graceful stop (trainer.stop_protocol none)" in first, log
    assert "training step exited" not in first, "requeued without waiting for the step"
    assert "training finished" in log[a1:], log
    assert not (job.run_dir / "stop" / f"{job.job_id}.attempt-0").exists()
