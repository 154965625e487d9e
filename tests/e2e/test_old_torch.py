"""A torch release without torchrun's stop flags, on the real local Slurm: torch 2.4.1 (the torch of NGC's
24.05 image; its torchrun has neither --signals-to-handle nor --shutdown-timeout) in a venv of its own
(python_env.path), the default stop protocol. The render gives torchrun both flags; the node program's
run-trainer drops them and runs torchrun through its compat shim, whose agent never takes SIGTERM, and says so
in one line per node. A preemption with GraceTime (Slurm's SIGTERM to the job steps) reaches run-trainer, not
torchrun's agent (torch 2.4's would pass it on and die of it), which writes the stop file and hands the SIGTERM
to the workers (a trainer of one's own that saves on SIGTERM and exits 0: the stop probe, tests/probes); the
job is requeued once as a preemption and completes. No traceback.

torch 2.4.1 is a CUDA build (PyPI has no CPU build of it for x86_64): about 5 GB in the venv, installed from
PyPI once per machine into ~/.cache/sbatch-gen/venv-torch2.4 (about 2 minutes) by `make old-torch`, which
`make test` runs first: set-up, not the test, downloads it."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from e2e_lib import local_job, preempt

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OLD_TORCH = "2.4.1"
# outside the checkout (worktrees and clones share it): the Makefile's OLD_TORCH_VENV
OLD_VENV = Path(os.environ.get("OLD_TORCH_VENV") or Path.home() / ".cache" / "sbatch-gen" / "venv-torch2.4")


@pytest.fixture(scope="session")
def old_torch_venv() -> Path:
    """The venv with torch 2.4.1 that `make old-torch` makes once per machine (`make test` does it first)."""
    python = OLD_VENV / "bin" / "python"
    probe = [str(python), "-c", "import torch; print(torch.__version__)"]
    got = subprocess.run(probe, capture_output=True, text=True).stdout if python.exists() else ""
    assert got.startswith(OLD_TORCH), (
        f"no torch {OLD_TORCH} in {OLD_VENV} ({got.strip() or 'no venv'}): run `make old-torch`"
    )
    return OLD_VENV


def test_a_torch_without_the_stop_flags_stops_gracefully_and_continues(
    cluster, e2e_root, train_config, data_dir, old_torch_venv
):
    root = e2e_root / "old-torch"
    probe = root / "run" / "probe"
    job = local_job(
        cluster,
        root,
        "oldtorch",
        {
            "python_env.path": str(old_torch_venv),
            "paths.code_dir": str(Path(__file__).resolve().parents[1] / "probes"),
            "trainer.module": "sbg_stop_probe",
            "trainer.extra_args": ["--probe-mode", "signal", "--probe-save-s", "2", "--probe-max-s", "200"],
        },
        config=train_config,
        data=data_dir,
    )
    assert (
        "--signals-to-handle=" in job.script.read_text() and "--shutdown-timeout=" in job.script.read_text()
    )
    job.submit()
    starts = [probe / f"start.attempt-0.rank-{r}.json" for r in range(4)]
    deadline = time.monotonic() + 240
    while not all(p.exists() for p in starts):
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.2)
    preempt(cluster)
    info = cluster.wait_done(job.job_id, timeout=240)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    for r in range(4):
        assert json.loads((probe / f"saved.rank-{r}").read_text())["attempt"] == 0
        assert "0 SIGTERM" in (probe / f"signals.rank-{r}").read_text()
    log = job.batch_log()
    assert f"torch {OLD_TORCH}" in log, log  # the environment pinned for the run names it
    first = log[: log.index(f"job {job.job_id}, attempt 1")]
    assert "a preemption, not the end of training" in first and "requeueing job" in first, first
    assert "training finished" in log[len(first) :], log
    shim = "this torch's torchrun has no --signals-to-handle, --shutdown-timeout: it runs through the node program's compat shim"
    for node in cluster.nodes:
        text = job.train_log(0, node).read_text()
        assert text.count(shim) == 1, text
        assert "Traceback" not in text + job.train_log(1, node).read_text(), text
    assert "Traceback" not in log
