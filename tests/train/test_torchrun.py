"""Real torchrun, 2 CPU processes, gloo: training, preemption hand-off, crash recovery, determinism."""

import json
import os
import re
import signal

import pytest

from sbatch_gen.testing.faults import ENV_STEP_SLEEP, ENV_STEP_SLEEP_RANKS
from sbatch_gen.testing.faults import MODULE as FAULTS
from sbatch_gen.train.checkpoint import check_complete, step_dir

from .conftest import losses, read_metrics, same_weights, torchrun_cmd, wait_for, write_config

pytestmark = pytest.mark.slow

STEPS = 20
SLOW = {ENV_STEP_SLEEP: "0.12"}  # room for the test to act mid-run (run as FAULTS: the trainer reads none)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return write_config(
        tmp_path_factory.mktemp("cfg") / "c.yaml",
        train={"steps": STEPS, "log_every": 1},
        checkpoint={"every": 4, "keep_last": 3},
    )


@pytest.fixture(scope="module")
def cfg_async(tmp_path_factory):
    return write_config(
        tmp_path_factory.mktemp("cfg") / "c.yaml",
        train={"steps": STEPS, "log_every": 1},
        checkpoint={"every": 4, "keep_last": 3, "async_save": True},
    )


@pytest.fixture(scope="module")
def reference(cfg, tmp_path_factory, data_dir):
    """One uninterrupted 2-process run: the losses every other run must reproduce bitwise."""
    import subprocess

    from .conftest import train_env

    d = tmp_path_factory.mktemp("ref")
    r = subprocess.run(
        torchrun_cmd(cfg, d / "run", data_dir), capture_output=True, text=True, timeout=240, env=train_env()
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return d / "run", r.stderr


def _ack(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _max_step(run_dir) -> int:
    return max(read_metrics(run_dir), default=0)


def test_loss_decreases_and_metrics(reference):
    run_dir, log = reference
    ls = losses(run_dir)
    assert sorted(ls) == list(range(1, STEPS + 1))
    first, last = sum(ls[s] for s in range(1, 5)) / 4, sum(ls[s] for s in range(STEPS - 3, STEPS + 1)) / 4
    assert last < first - 0.5, (first, last)
    rec = read_metrics(run_dir)[STEPS]
    assert rec["world_size"] == 2 and len(rec["rank_step_time_s"]) == 2 and len(rec["rank_losses"]) == 2
    assert rec["loss"] == sum(rec["rank_losses"]) / 2
    assert rec["ddp_allreduce_s"] > 0 and rec["comm_time_s"] >= rec["ddp_allreduce_s"]
    assert rec["tokens"] == STEPS * 4 * 64 * 2 and rec["mem_kind"] == "max_rss" and rec["mem_bytes"] > 0
    for r in read_metrics(run_dir).values():  # where the time went: disjoint parts of the host's step
        shares = [r[f"time_share_{k}"] for k in ("fwd_bwd", "optimizer", "data", "comm", "xr")]
        assert all(0.0 <= v <= 1.0 for v in shares) and sum(shares) <= 1.02, r
        assert r["time_share_comm"] * r["step_time_s"] >= r["ddp_wait_s"], r  # DDP's wait is comm
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["exit"] == "completed" and s["last_step"] == STEPS and s["world_size"] == 2
    assert (
        s["step_time_s"]["p50"] <= s["step_time_s"]["p99"] and s["checkpoint_save_s"]["count"] == STEPS // 4
    )
    assert s["restarts_seen"] == {"TORCHELASTIC_RESTART_COUNT": 0}
    assert (run_dir / "model.safetensors").stat().st_size > 0
    # What matters for a hang is in the log, before the first collective.
    assert re.search(
        r"rank 1/2 local_rank 1/2 node 0/1 device cpu backend gloo master 127\.0\.0\.1:\d+", log
    ) or re.search(r"rank 1/2 local_rank 1/2 node 0/1 device cpu backend gloo master [\w.-]+:\d+", log)
    assert "init_process_group(gloo) waiting for 2 ranks" in log and "env TORCHELASTIC_RESTART_COUNT=0" in log


def test_stop_file_then_sigusr1_then_resume_equals_uninterrupted(
    cfg, reference, tmp_path, data_dir, launches
):
    """Attempt 1 stops on the stop file (the workers exit 0 after their ack: torchrun, allowed a restart,
    restarts nothing and reports no failure); attempt 2 stops on SIGUSR1 sent to rank 1 only; attempt 3
    finishes. Same losses as one run."""
    ref_dir, _ = reference
    run_dir, stop, ack_file = tmp_path / "run", tmp_path / "stop", tmp_path / "stop.ack"

    la = launches(
        torchrun_cmd(cfg, run_dir, data_dir, "--stop-file", str(stop), max_restarts=1, module=FAULTS),
        tmp_path / "a.log",
        env=SLOW,
    )
    wait_for(lambda: check_complete(step_dir(run_dir, 4)) is None, 120, "checkpoint step-4", la)
    # a checkpoint step reads its agreement before saving: its record is there before the checkpoint is
    assert 4 in read_metrics(run_dir)
    stop.write_text("")
    rc = la.wait(120)
    out = la.output()
    ack = _ack(ack_file)
    assert ack is not None, out[-3000:]
    n1 = ack["step"]
    assert 4 <= n1 < STEPS - 4 and ack["checkpoint"] == str(step_dir(run_dir, n1)), (ack, out[-3000:])
    assert "stop file" in ack["reason"] and check_complete(ack["checkpoint"]) is None
    # Both ranks stopped after the same step and exited 0 (a stop file is set: the ack says the rest)
    assert out.count(f"all ranks stop after step {n1}") == 2, out[-3000:]
    assert out.count(f"exiting 0: checkpointed at step {n1}") == 2, out[-3000:]
    assert out.count("training steps") == 2, out[-3000:]  # no worker was restarted
    assert rc == 0 and "exitcode" not in out and "Traceback" not in out, out[-3000:]

    # The launcher clears the hand-off for the next attempt. A save that never finished, newer than
    # the stop checkpoint, must be ignored.
    stop.unlink()
    ack_file.unlink()
    half = step_dir(run_dir, n1 + 1)
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"\0" * 10)
    lb = launches(
        torchrun_cmd(cfg, run_dir, data_dir, "--stop-file", str(stop), module=FAULTS),
        tmp_path / "b.log",
        env=SLOW,
    )
    wait_for(lambda: _max_step(run_dir) >= n1 + 2, 120, f"step {n1 + 2}", lb)
    workers = wait_for(lambda: (w := lb.workers()) and len(w) == 2 and w, 30, "two workers", lb)
    os.kill(workers[1], signal.SIGUSR1)
    rc = lb.wait(120)
    out = lb.output()
    ack = _ack(ack_file)
    assert ack is not None, out[-3000:]
    n2 = ack["step"]
    assert rc == 0 and "exitcode" not in out and n1 + 2 <= n2 < STEPS
    assert (
        f"step-{n1 + 1} ignored: no COMPLETE.json" in out and f"resumed from {step_dir(run_dir, n1)}" in out
    )
    assert ack["reason"] == "another rank"  # rank 0 learnt it from the collective
    assert out.count(f"all ranks stop after step {n2}") == 2 and "stop requested (SIGUSR1)" in out
    assert stop.exists()  # created with the ack: workers torchrun restarts in this attempt exit at once

    stop.unlink()  # the next attempt (the launcher gives each attempt its own stop file)
    ack_file.unlink()
    lc = launches(torchrun_cmd(cfg, run_dir, data_dir, "--stop-file", str(stop)), tmp_path / "c.log")
    assert lc.wait(180) == 0, lc.output()[-3000:]
    got, ref = losses(run_dir), losses(ref_dir)
    assert [got[s] for s in range(n1 + 1, STEPS + 1)] == [ref[s] for s in range(n1 + 1, STEPS + 1)]
    assert same_weights(run_dir / "model.safetensors", ref_dir / "model.safetensors")


def test_sigkill_one_worker_restarts_from_last_checkpoint(cfg_async, reference, tmp_path, data_dir, launches):
    """With background (async) checkpoint saves: a torn save would break the bitwise comparison."""
    ref_dir, _ = reference
    run_dir = tmp_path / "run"
    # Only rank 1 sleeps: an injected straggler that the per-rank step times must show.
    la = launches(
        torchrun_cmd(cfg_async, run_dir, data_dir, max_restarts=1, module=FAULTS),
        tmp_path / "a.log",
        env={**SLOW, ENV_STEP_SLEEP_RANKS: "1"},
    )
    wait_for(lambda: check_complete(step_dir(run_dir, 8)) is None, 120, "checkpoint step-8", la)
    workers = wait_for(lambda: (w := la.workers()) and len(w) == 2 and w, 30, "two workers", la)
    os.kill(workers[1], signal.SIGKILL)
    assert la.wait(240) == 0, la.output()[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["restarts_seen"] == {"TORCHELASTIC_RESTART_COUNT": 1} and s["last_step"] == STEPS
    assert s["resumed_from_step"] is not None and s["resumed_from_step"] >= 8
    assert s["resume_time_s"] > 0
    recs = list(read_metrics(run_dir).values())
    assert sum(r["slowest_rank"] == 1 for r in recs) > len(recs) // 2
    assert all(r["rank_step_time_s"][1] >= 0.12 for r in recs)
    # Steps re-run after the crash reproduce the uninterrupted run bitwise (last record per step).
    assert losses(run_dir) == losses(ref_dir)
    assert same_weights(run_dir / "model.safetensors", ref_dir / "model.safetensors")


def test_world_size_1_trains_without_ddp_and_resumes_identically(tmp_path, data_dir, launches):
    """torchrun with one process (a one-GPU site such as the GH200): a process group but no DDP wrapper;
    interrupted and resumed, it reproduces a plain single process (no torchrun, no process group) bitwise."""
    import subprocess
    import sys

    from .conftest import REPO, train_env

    cfg = write_config(
        tmp_path / "c.yaml",
        train={"steps": 8, "log_every": 1, "grad_accum": 2},
        checkpoint={"every": 4, "async_save": True},
    )
    ref = tmp_path / "ref"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sbatch_gen.train",
            "--config",
            str(cfg),
            "--run-dir",
            str(ref),
            "--data-path",
            str(data_dir),
        ],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DDP: off (world size 1)" in r.stderr and "init_process_group" not in r.stderr
    run_dir = tmp_path / "run"
    la = launches(torchrun_cmd(cfg, run_dir, data_dir, "--max-steps", "5", nproc=1), tmp_path / "a.log")
    assert la.wait(180) == 0, la.output()[-3000:]
    out = la.output()
    assert "init_process_group(gloo) waiting for 1 ranks" in out and "DDP: off (world size 1)" in out, out[
        -3000:
    ]
    assert check_complete(step_dir(run_dir, 5)) is None
    lb = launches(torchrun_cmd(cfg, run_dir, data_dir, nproc=1), tmp_path / "b.log")
    assert lb.wait(180) == 0, lb.output()[-3000:]
    assert f"resumed from {step_dir(run_dir, 5)} at step 5" in lb.output()
    assert losses(run_dir) == losses(ref) and sorted(losses(ref)) == list(range(1, 9))
    assert same_weights(run_dir / "model.safetensors", ref / "model.safetensors")
    rec = read_metrics(run_dir)[8]
    assert rec["world_size"] == 1 and rec["ddp_allreduce_s"] is None and rec["ddp_wait_s"] is None
    assert rec["fsdp_all_gather_s"] is None and rec["fsdp_reduce_scatter_s"] is None  # not FSDP
