"""The Slurm half of the soak, run by `make soak` (not by `make test`: it takes minutes): SOAK_RUNS
(default 20) multi-node jobs of the `local` site in a row on the local Slurm cluster, every other one stopped
on purpose, and not one Traceback in any of their logs, read unfiltered.

Even runs train to the end (2 nodes x 2 processes; torchrun's exit barrier, the c10d store's host leaving
last); odd runs get `scancel --signal=USR1 --batch` once training is under way: the planned stop, its
checkpoint, the requeue and the resumed attempt to the end. After each job every file of its log dir and its
run dir's logs is read whole; a run with "Traceback" in any of them fails the soak, with the file and the
lines around it. The table at the end says, per run, its job, kind and seconds."""

from __future__ import annotations

import os
import time

import pytest
from e2e_lib import MEASUREMENTS, Cluster, local_job

from sbatch_gen.testing.logscan import tracebacks

pytestmark = pytest.mark.e2e

RUNS = int(os.environ.get("SOAK_RUNS", "20"))
STEPS = 12


@pytest.mark.timeout(240 * RUNS)
def test_multi_node_jobs_end_without_a_traceback(cluster: Cluster, e2e_root, train_config, data_dir):
    import yaml

    cfg = yaml.safe_load(train_config.read_text())
    cfg["train"]["steps"] = STEPS
    cfg["checkpoint"]["every"] = 4
    config = e2e_root / "soak.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rows, failed = [], []
    for i in range(RUNS):
        stop = i % 2 == 1
        t0 = time.monotonic()
        job = local_job(cluster, e2e_root / f"soak-{i}", f"soak{i}", config=config, data=data_dir)
        job.submit()
        if stop:
            job.wait_step(3)
            cluster.run("scancel", "--signal=USR1", "--batch", str(job.job_id))
        info = cluster.wait_done(job.job_id, timeout=300)
        assert info["JobState"] == "COMPLETED", job.describe()
        assert job.last_step() == STEPS, job.describe()
        if stop:
            assert info["Restarts"] == "1" and "trainer checkpointed" in job.batch_log(), job.describe()
        found = tracebacks(job.root / "logs", job.run_dir / "logs")
        kind = "planned stop, requeued" if stop else "to the end"
        rows.append(
            f"run {i + 1:2d}  job {job.job_id}  {kind:22s} {time.monotonic() - t0:5.0f} s  tracebacks {len(found)}"
        )
        failed += found
    MEASUREMENTS.append(f"soak: {RUNS} multi-node jobs, {len(failed)} tracebacks\n  " + "\n  ".join(rows))
    assert not failed, "\n\n".join(failed)
