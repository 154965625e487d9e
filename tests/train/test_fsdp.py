"""FSDP2 in the trainer (``parallelism.kind: fsdp``): real torchrun with 2 CPU processes (gloo), and one
plain process: stop and resume bitwise, the CPU offload, a checkpoint resharded to another world size."""

import json
import shutil
import subprocess
import sys

import pytest

from sbatch_gen.testing.faults import ENV_STEP_SLEEP
from sbatch_gen.testing.faults import MODULE as FAULTS
from sbatch_gen.train.checkpoint import check_complete, step_dir

from .conftest import (
    REPO,
    losses,
    read_metrics,
    same_weights,
    torchrun_cmd,
    train_env,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow

STEPS = 12
SLOW = {ENV_STEP_SLEEP: "0.12"}  # room for the test to act mid-run (run as FAULTS: the trainer reads none)
# grad accumulation, activation checkpointing, dropout (tiny's 0.1) and async saves: still bitwise
SECTIONS = {
    "train": {"steps": STEPS, "log_every": 1, "grad_accum": 2},
    "model": {"activation_checkpointing": True},
    "checkpoint": {"every": 4, "keep_last": 5, "async_save": True},
}


def _config(path, **parallelism):
    return write_config(path, **SECTIONS, parallelism={"kind": "fsdp", **parallelism})


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return _config(tmp_path_factory.mktemp("cfg") / "fsdp.yaml")


def _torchrun(cfg, run_dir, data_dir, *extra) -> subprocess.CompletedProcess:
    r = subprocess.run(
        torchrun_cmd(cfg, run_dir, data_dir, *extra),
        capture_output=True,
        text=True,
        timeout=240,
        env=train_env(),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _plain(cfg, run_dir, data_dir) -> subprocess.CompletedProcess:
    """One process, no launcher (FSDP makes itself a one-rank process group)."""
    cmd = [sys.executable, "-m", "sbatch_gen.train", "--config", str(cfg), "--run-dir", str(run_dir)]
    r = subprocess.run(
        [*cmd, "--data-path", str(data_dir)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def reference(cfg, tmp_path_factory, data_dir):
    """One uninterrupted 2-rank FSDP run: what every other run must reproduce."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    return run_dir, _torchrun(cfg, run_dir, data_dir).stderr


def test_two_ranks_each_hold_half_and_record_what_ddp_records(reference):
    run_dir, log = reference
    assert log.count("FSDP: 2 ranks, 2 blocks and the root sharded; compute in float32") == 2, log[-3000:]
    assert log.count("this rank holds 0.06M of 0.12M parameters on cpu (cpu offload off)") == 2
    assert "DDP: " not in log
    recs = read_metrics(run_dir)
    assert sorted(recs) == list(range(1, STEPS + 1))
    rec = recs[STEPS]
    assert rec["world_size"] == 2 and rec["loss"] == sum(rec["rank_losses"]) / 2
    assert rec["tokens"] == STEPS * 4 * 64 * 2 * 2 and rec["mem_kind"] == "max_rss" and rec["mem_bytes"] > 0
    assert rec["grad_norm"] > 0 and rec["mfu"] is None  # CPU: no peak
    assert rec["ddp_allreduce_s"] is None and rec["ddp_wait_s"] is None  # no DDP
    # FSDP's own collectives, timed in every step: on gloo they block the host, so comm_time_s holds them
    # (and the wait for the step's agreement) and compute_time_s leaves them out
    for r in recs.values():
        ag, rs = r["fsdp_all_gather_s"], r["fsdp_reduce_scatter_s"]
        assert ag > 0 and rs > 0, r
        assert r["comm_time_s"] >= ag + rs and r["compute_time_s"] + ag + rs <= r["step_time_s"], r
        # where the time went: FSDP's collectives (they block the host on gloo) are comm, not forward+backward
        shares = [r[f"time_share_{k}"] for k in ("fwd_bwd", "optimizer", "data", "comm", "xr")]
        assert all(0.0 <= v <= 1.0 for v in shares) and sum(shares) <= 1.02, r
        assert r["time_share_comm"] * r["step_time_s"] >= (ag + rs) * (1 - 1e-9), r
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["exit"] == "completed" and s["checkpoint_save_s"]["count"] == STEPS // 4
    marker = json.loads((step_dir(run_dir, 4) / "COMPLETE.json").read_text())
    assert marker["parallelism"] == "fsdp" and marker["world_size"] == 2


def test_stop_file_then_resume_equals_uninterrupted(cfg, reference, tmp_path, data_dir, launches):
    ref_dir, _ = reference
    run_dir, stop, ack_file = tmp_path / "run", tmp_path / "stop", tmp_path / "stop.ack"
    la = launches(
        torchrun_cmd(cfg, run_dir, data_dir, "--stop-file", str(stop), module=FAULTS),
        tmp_path / "a.log",
        env=SLOW,
    )
    wait_for(lambda: 2 in read_metrics(run_dir), 120, "step 2's record", la)
    stop.write_text("")
    assert la.wait(120) == 0, la.output()[-3000:]
    ack = json.loads(ack_file.read_text())
    n = ack["step"]
    assert 2 < n < STEPS and check_complete(ack["checkpoint"]) is None, ack
    assert la.output().count(f"exiting 0: checkpointed at step {n}") == 2
    stop.unlink()
    ack_file.unlink()
    lb = launches(torchrun_cmd(cfg, run_dir, data_dir, "--stop-file", str(stop)), tmp_path / "b.log")
    assert lb.wait(180) == 0, lb.output()[-3000:]
    assert f"resumed from {step_dir(run_dir, n)} at step {n}" in lb.output()
    assert losses(run_dir) == losses(ref_dir)
    assert same_weights(run_dir / "model.safetensors", ref_dir / "model.safetensors")


def test_cpu_offload_and_no_reshard_after_forward_change_nothing_on_the_cpu(reference, tmp_path, data_dir):
    """Where the shards live and when blocks are regathered: the same arithmetic, so the same bits."""
    ref_dir, _ = reference
    cfg = _config(tmp_path / "c.yaml", cpu_offload=True, reshard_after_forward=False)
    log = _torchrun(cfg, tmp_path / "run", data_dir).stderr
    assert log.count("(cpu offload on); reshard after forward off") == 2, log[-3000:]
    assert losses(tmp_path / "run") == losses(ref_dir)
    assert same_weights(tmp_path / "run" / "model.safetensors", ref_dir / "model.safetensors")


def test_a_two_rank_checkpoint_resumes_in_one_process(cfg, reference, tmp_path, data_dir):
    """DCP reshards the 2-rank checkpoint of step 4 for one rank: FSDP there continues exactly as a plain
    model (DDP's world size 1, no wrapper) loaded from the same checkpoint, and records the same fields."""
    ref_dir, _ = reference
    runs = {}
    for kind in ("fsdp", "ddp"):
        run_dir = tmp_path / kind
        shutil.copytree(step_dir(ref_dir, 4), step_dir(run_dir, 4))
        config = cfg if kind == "fsdp" else write_config(tmp_path / "ddp.yaml", **SECTIONS)
        log = _plain(config, run_dir, data_dir).stderr
        assert f"resumed from {step_dir(run_dir, 4)} at step 4" in log, log[-3000:]
        assert ("FSDP: 1 ranks" in log) == (kind == "fsdp") and ("DDP: off" in log) == (kind == "ddp")
        runs[kind] = run_dir
    assert sorted(losses(runs["fsdp"])) == list(range(5, STEPS + 1))
    assert losses(runs["fsdp"]) == losses(runs["ddp"])
    assert same_weights(runs["fsdp"] / "model.safetensors", runs["ddp"] / "model.safetensors")
    fields = [set(read_metrics(d)[STEPS]) for d in (ref_dir, runs["fsdp"], runs["ddp"])]
    assert fields[0] == fields[1] == fields[2]  # 2-rank FSDP, 1-rank FSDP, no wrapper
    one = read_metrics(runs["fsdp"])[STEPS]
    assert one["fsdp_all_gather_s"] == one["fsdp_reduce_scatter_s"] == 0.0  # one rank: no collective
