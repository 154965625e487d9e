"""No partial exit holds the allocation, on the real local Slurm (2 nodes, KillWait 5 s): one node's workers
finish while the other node's hang. The finished node's torchrun waits preemption.exit_wait_s for the other
(its exit barrier, set by the node program: torch's own is 300 s), then srun's --wait gives the hung node as
long again: the training step ends within about twice exit_wait_s of the first node's workers, and the run
goes on (requeued as a failed step, the next attempt completes). No traceback, unfiltered."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from e2e_lib import local_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXIT_WAIT_S = 6


def test_a_node_that_hangs_after_the_other_finished_ends_the_step_within_the_bound(
    cluster, e2e_root, train_config, data_dir
):
    root = e2e_root / "exit-bound"
    probe = root / "run" / "probe"
    job = local_job(
        cluster,
        root,
        "exitbound",
        {
            "paths.code_dir": str(Path(__file__).resolve().parents[1] / "probes"),
            "trainer.module": "sbg_stop_probe",
            # the second node's two ranks hang on the first attempt; the first node's end at once
            "trainer.extra_args": [
                "--probe-mode",
                "end",
                "--probe-hang-nodes",
                "1",
                "--probe-max-s",
                "600",
            ],
            "preemption.exit_wait_s": EXIT_WAIT_S,
        },
        config=train_config,
        data=data_dir,
    )
    job.submit()
    info = cluster.wait_done(job.job_id, timeout=300)
    log = job.batch_log()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    # (the rendezvous, not SLURM_NODEID, orders the ranks: the second node's may be 0 and 1)
    finished = list(probe.glob("done.attempt-0.rank-*"))
    assert len(finished) == 2 and len(list(probe.glob("hung.node-1.local-*"))) == 2, (
        "one node was meant to hang"
    )
    done = max(float(p.read_text()) for p in finished)
    # when the batch shell saw the step end: its log line's time (UTC, to the second)
    (stamp,) = re.findall(
        r"\[sbatch-gen (\S+)\] training step exited with status [1-9]", log.split("attempt 1")[0]
    )
    ended = time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    # twice exit_wait_s, KillWait and the agents' polling; torch's own exit barrier alone is 300 s
    assert ended - done < 2 * EXIT_WAIT_S + 25, (ended - done, log)
    node_logs = {
        p.name: p.read_text(errors="replace") for p in job.log_dir.glob(f"{job.name}-*.attempt-0.*.log")
    }
    n1 = next(text for name, text in node_logs.items() if name.endswith(f".{cluster.nodes[0]}.log"))
    said = [line for line in n1.splitlines() if "(the exit barrier;" in line]
    assert len(said) == 1 and f"did not all within {EXIT_WAIT_S} s" in said[0], n1
    for name, text in {**node_logs, "batch": log}.items():
        assert "Traceback" not in text, f"{name}:\n{text[-4000:]}"
