"""examples/train_plain.py, the plain-PyTorch example on the public library, on the real local Slurm through
its own rendered jobs: examples/sites/plain.yaml, with --set overrides that point that GPU cluster's profile
at the local 2-node CPU cluster, rendered once per region (one node each, 2 processes, DiLoCo over an fs
mailbox). One job gets `scancel --signal=USR1 --batch` mid-run: the batch shell creates the stop file, the
script checkpoints, acks and exits 0, the job requeues, and its second attempt resumes from that checkpoint.
Both regions end with bitwise identical final.pt."""

from __future__ import annotations

import json
import time

import pytest
from e2e_lib import (
    REPO,
    assert_regions_completed,
    region_jobs,
    region_nodes,
    report,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SITES = REPO / "examples" / "sites"
SCRIPT = "examples/train_plain.py"  # as trainer.script names it, relative to the submit directory
STEPS, H = 40, 10  # 4 outer rounds


def _local(cluster) -> dict:
    """examples/sites/plain.yaml describes a GPU cluster: what differs on the local CPU one."""
    return {
        "slurm.version": "22.05",
        "slurm.partition": cluster.partition,
        "slurm.gpus_per_node": 0,
        "slurm.cpus_per_task": 2,
        "slurm.mem": None,
        "slurm.exclusive": False,
        "slurm.time": "00:30:00",
        "torchrun.procs_per_node": 2,
        "torchrun.rdzv_timeout_s": 120,
        "trainer.max_steps": STEPS,
    }


def test_the_example_trains_two_regions_and_resumes_after_a_preemption(cluster, e2e_root):
    root = e2e_root / "example-plain"
    root.mkdir()
    data = root / "data.txt"
    data.write_text("".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md"))[:3]))
    jobs = region_jobs(
        cluster,
        root,
        "plain",
        {
            "run_id": "e2e-plain",
            "sync": "diloco",
            "inner_steps": H,
            "timeout_s": 240,
            "transport": {"kind": "fs", "root": str(root / "mailbox")},
        },
        config=None,
        data=data,
        sets=_local(cluster),
        site="plain",
        sites_dir=SITES,
    )
    a, b = jobs["a"], jobs["b"]
    # a is held until b has been asked to stop: in lock-step b cannot pass outer round 1 (step H) without
    # a, so the stop lands mid-run, at a step <= H, however fast the steps and however loaded the machine.
    a.submit(None, "--hold")
    b.submit()
    deadline = time.monotonic() + 180
    while "training; per-node logs" not in b.batch_log():  # past the preflight: the stop reaches the trainer
        assert time.monotonic() < deadline, b.describe()
        time.sleep(0.2)
    stop_file = b.run_dir / "stop" / f"{b.job_id}.attempt-0"
    cluster.run("scancel", "--signal=USR1", "--batch", str(b.job_id))
    deadline = time.monotonic() + 60
    while not stop_file.exists():  # the batch shell's trap creates it
        assert time.monotonic() < deadline, b.describe()
        time.sleep(0.1)
    cluster.run("scontrol", "release", str(a.job_id))

    info_b = cluster.wait_done(b.job_id, timeout=300)
    info_a = cluster.wait_done(a.job_id, timeout=300)
    assert_regions_completed(jobs, {"a": info_a, "b": info_b}, restarts={"a": 0, "b": 1})

    # b: checkpointed at a step its ranks agreed on, acked naming the checkpoint, requeued, resumed from it
    ack = json.loads(stop_file.with_name(stop_file.name + ".ack").read_text())
    stopped = ack["step"]
    ckpt = b.run_dir / "ckpt" / f"step-{stopped}.pt"
    assert 1 <= stopped <= H and ack["checkpoint"] == str(ckpt), ack
    assert ack["reason"] == "stop file: SIGUSR1 to the batch shell", ack
    log = b.batch_log()
    attempt1 = log.index(f"job {b.job_id}, attempt 1")
    assert (
        log.index("SIGUSR1 received")
        < log.index("trainer checkpointed")
        < log.index("requeueing job")
        < attempt1
    ), log
    assert "training finished" in log[attempt1:], log
    first = b.train_log(0, region_nodes(cluster)["b"]).read_text(errors="replace")
    assert f"checkpointed at step {stopped}, exiting 0" in first, first[-3000:]
    assert "Traceback" not in first, first[-3000:]  # nor torchrun's: a planned stop is one line per node
    assert (
        f"node {region_nodes(cluster)['b']}: stopped after step {stopped} (stop file: SIGUSR1 to the batch shell)"
        in first
    )
    assert 'train_plain.py", line' not in first, first[-3000:]  # no traceback through the script
    second = b.train_log(1, region_nodes(cluster)["b"]).read_text(errors="replace")
    assert f"resumed from {ckpt}" in second and f"steps {stopped + 1}..{STEPS}" in second, second[-3000:]

    # both regions went through every outer round together and hold the same weights
    for job, attempt in ((a, 0), (b, 1)):
        text = job.train_log(attempt, region_nodes(cluster)["a" if job is a else "b"]).read_text(
            errors="replace"
        )
        assert f"done at step {STEPS} after {STEPS // H} outer rounds" in text, text[-3000:]
    assert (a.run_dir / "final.pt").read_bytes() == (b.run_dir / "final.pt").read_bytes(), (
        "final.pt differs between the regions"
    )
    report(f"example trainer: b stopped at step {stopped} on USR1, requeued, resumed; final.pt identical")
