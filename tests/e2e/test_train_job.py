"""Rendered `local` jobs on the real cluster: a whole training run, and a preemption with requeue and
resume that reproduces the uninterrupted run's losses."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

import pytest
from e2e_lib import (
    STOP_HOLD_S,
    WITH_FAULTS,
    assert_resumed_losses_match,
    assert_same_final_params,
    git_checkout,
    local_job,
    report,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_rendered_job_trains_two_nodes_to_completion(cluster, reference_run, train_config):
    """(1) sbatch-gen render + plain sbatch: 2 nodes x 2 processes (torchrun c10d, gloo) train to the
    end; the preflight ran on both nodes before training."""
    job = reference_run
    info = cluster.job(job.job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.describe()
    assert info["Restarts"] == "0"
    assert info["NodeList"] == f"{cluster.node_prefix}n[1-2]"
    log = job.batch_log()
    # the preflight step ran on every node, before the training step started
    ok = re.findall(r"^preflight ok on (\S+):", log, re.M)
    assert sorted(ok) == sorted(cluster.nodes), log
    assert log.index("preflight ok on") < log.index("training; per-node logs")
    assert "training finished" in log
    # torchrun's ranks: 4 of them, 2 per node, every step's loss seen from all 4
    metrics = job.metrics()
    assert [r["step"] for r in metrics] == list(range(1, 41))
    assert {r["world_size"] for r in metrics} == {4}
    assert all(len(r["rank_losses"]) == 4 for r in metrics)
    for node in cluster.nodes:
        text = job.train_log(0, node).read_text()
        ranks = sorted(set(re.findall(r"rank (\d)/4 local_rank (\d)/2 node (\d)/2 .* host (\S+)", text)))
        assert len(ranks) == 2 and {r[3] for r in ranks} == {node}, text[:2000]
    summary = job.summary()
    assert summary["exit"] == "completed" and summary["last_step"] == 40 and summary["world_size"] == 4
    assert (job.run_dir / "model.safetensors").stat().st_size > 0
    # the loss went down
    losses = job.losses()
    assert sum(losses[s] for s in range(36, 41)) < sum(losses[s] for s in range(1, 6))


def test_preempt_requeue_resume_matches_uninterrupted(
    cluster, reference_run, e2e_root, train_config, data_dir
):
    """(3) `scancel --signal=USR1 --batch` mid-run: the trainer checkpoints at a step all ranks agree on,
    the batch script requeues, attempt 2 runs with SLURM_RESTART_COUNT=1, resumes from that checkpoint
    and finishes; its losses and final weights match the uninterrupted run's; attempt 1's log is still
    there. The train config lies in the run's code checkout (paths.code_dir, pinned at submission) and is
    changed and committed while attempt 1 trains, as a `git pull` would: attempt 2 runs the pinned one."""
    ref = reference_run.losses()
    assert sorted(ref) == list(range(1, 41)), reference_run.describe()
    code = e2e_root / "preempt-code"
    code.mkdir()
    config = code / "train.yaml"
    config.write_text(train_config.read_text())
    commit = git_checkout(cluster, code)
    first = commit("as submitted")
    # a stop checkpoint of STOP_HOLD_S, longer than torchrun's own shutdown timeout, within the budget of 40 + 20
    job = local_job(
        cluster,
        e2e_root / "preempt",
        "preempt",
        {
            "preemption.checkpoint_s": 40,
            "preemption.margin_s": 20,
            "paths.code_dir": str(code),
            **WITH_FAULTS,
        },
        config=config,
        data=data_dir,
    )
    job.submit({"SBATCH_GEN_TEST_STOP_SAVE_HOLD_S": str(STOP_HOLD_S)})
    job.wait_step(6)  # past the periodic checkpoint at 5: the stop usually lands between two (7..9)
    assert "seed: 1234" in config.read_text()
    config.write_text(config.read_text().replace("seed: 1234", "seed: 7"))  # other weights, if it were run
    pulled = commit("a git pull")
    cluster.run("scancel", "--signal=USR1", "--batch", str(job.job_id))
    info = cluster.wait_done(job.job_id, timeout=300)
    assert info["JobState"] == "COMPLETED", job.describe()
    assert info["Restarts"] == "1", job.describe()

    # the stop was handed over, the trainer checkpointed at the agreed step and acknowledged it
    ack_file = job.run_dir / "stop" / f"{job.job_id}.attempt-0.ack"
    assert ack_file.exists(), job.describe()
    ack = json.loads(ack_file.read_text())
    stop_step = ack["step"]
    assert 6 <= stop_step < 40, ack
    assert ack["checkpoint"].rstrip("/").endswith(f"checkpoints/step-{stop_step}"), ack

    log = job.batch_log()
    # attempt 0 (SLURM_RESTART_COUNT unset) and attempt 1 (=1) both wrote to the one appended log
    a0 = log.index(f"job {job.job_id}, attempt 0")
    req = log.index("requeueing job")
    a1 = log.index(f"job {job.job_id}, attempt 1")
    assert a0 < log.index("SIGUSR1 received") < req < a1, log
    assert "trainer checkpointed" in log[:a1] and "training finished" in log[a1:], log
    for node in cluster.nodes:
        assert job.train_log(0, node).exists() and job.train_log(1, node).exists()
        # one line per node says what the stop left, in its log and in the batch log; no traceback anywhere
        said = f"node {node}: stopped after step {stop_step} (stop file: SIGUSR1 to the batch shell): checkpoint "
        assert said in job.train_log(0, node).read_text() and log[:a1].count(said) == 1, log
        text = job.train_log(0, node).read_text() + job.train_log(1, node).read_text()
        assert "Traceback" not in text, text[-4000:]
    assert "Traceback" not in log

    # attempt 1 resumed from the stop checkpoint and reproduced the uninterrupted run
    summary = job.summary()
    assert summary["resumed_from_step"] == stop_step, summary
    assert summary["last_step"] == 40
    assert_resumed_losses_match(job.losses(), ref, stop_step, 40)
    assert_same_final_params({"reference": reference_run, "resumed": job})
    assert (
        f"running the code pinned when the run was submitted: commit {first} (clean) from "
        f"{job.run_dir}/code/{job.job_id}; the checkout is at {pulled} now" in log
    ), log

    # downtime: from the batch shell receiving USR1 to attempt 2's first training step
    t_sig = datetime.strptime(
        re.search(r"^\[sbatch-gen (\S+)\] SIGUSR1 received", log, re.M).group(1), "%Y-%m-%dT%H:%M:%SZ"
    ).replace(tzinfo=timezone.utc)
    first = re.search(
        r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) .* step \d+ loss",
        job.train_log(1, cluster.nodes[0]).read_text(),
        re.M,
    )
    t_first = datetime.strptime(first.group(1), "%Y-%m-%d %H:%M:%S,%f")  # the trainer logs local time
    report(
        f"preemption: stop agreed at step {stop_step}; first step after the requeue "
        f"{t_first.timestamp() - t_sig.timestamp():.0f} s after USR1 (checkpoint, requeue, restart, resume)"
    )
