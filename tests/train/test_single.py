"""The trainer as one plain process (in this test process: no torch import per run)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from sbatch_gen.train.checkpoint import MARKER, check_complete, step_dir
from sbatch_gen.train.cli import parse_args
from sbatch_gen.train.spec import RunSpec
from sbatch_gen.train.trainer import run

from .conftest import losses, read_metrics, same_weights, write_config

pytestmark = pytest.mark.slow  # trainer subprocesses


def _train(cfg, run_dir, data_dir, *extra) -> int:
    args = parse_args(["--config", str(cfg), "--run-dir", str(run_dir), "--data-path", str(data_dir), *extra])
    return run(RunSpec.from_args(args))


_TRAINER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "SBATCH_GEN_STOP_FILE",
    "SBATCH_GEN_TEST_STEP_SLEEP_S",
)


@pytest.fixture(scope="module")
def cfg12(tmp_path_factory):
    # grad accumulation, activation checkpointing and dropout all on: the resume must still be bitwise.
    return write_config(
        tmp_path_factory.mktemp("cfg") / "c12.yaml",
        train={"steps": 12, "grad_accum": 2},
        model={"activation_checkpointing": True},
        checkpoint={"every": 4, "keep_last": 3, "verify": "crc32"},
    )


@pytest.fixture(scope="module")
def reference(cfg12, tmp_path_factory, data_dir):
    saved = {k: os.environ.pop(k) for k in _TRAINER_ENV if k in os.environ}
    try:
        ref = tmp_path_factory.mktemp("ref")
        assert _train(cfg12, ref, data_dir) == 0
    finally:
        os.environ.update(saved)
    return ref


def test_interrupted_and_resumed_equals_uninterrupted(cfg12, reference, tmp_path, data_dir, capfd, clean_env):
    ref = losses(reference)
    assert sorted(ref) == list(range(1, 13))
    part = tmp_path / "part"
    assert _train(cfg12, part, data_dir, "--max-steps", "6") == 0
    assert sorted(losses(part)) == list(range(1, 7))
    assert check_complete(step_dir(part, 6)) is None  # the cap saves where it ends
    assert _train(cfg12, part, data_dir) == 0
    got = losses(part)
    assert [got[s] for s in range(7, 13)] == [ref[s] for s in range(7, 13)]
    assert same_weights(part / "model.safetensors", reference / "model.safetensors")
    summary = json.loads((part / "summary.json").read_text())
    assert summary["resumed_from_step"] == 6 and summary["first_step"] == 7 and summary["last_step"] == 12
    assert summary["resume_time_s"] > 0 and summary["exit"] == "completed"
    rec = read_metrics(part)[12]
    for k in (
        "loss",
        "lr",
        "tokens_per_s",
        "step_time_s",
        "data_time_s",
        "comm_time_s",
        "mem_bytes",
        "rank_step_time_s",
        "grad_norm",
    ):
        assert rec[k] is not None, k
    assert rec["mfu"] is None  # CPU: no peak to compare against
    # keep_last 3: of steps 4, 6 (the cap), 8 and 12, the newest three remain.
    names = sorted(p.name for p in (part / "checkpoints").iterdir())
    assert names == ["step-12", "step-6", "step-8"]


def test_half_written_and_corrupted_checkpoints_are_ignored(
    cfg12, reference, tmp_path, data_dir, capfd, clean_env
):
    run_dir = tmp_path / "r"
    assert _train(cfg12, run_dir, data_dir, "--max-steps", "8") == 0
    # step-8: marker present, one byte flipped (CRC32 catches it); step-12: a save that never finished.
    shard = next(p for p in step_dir(run_dir, 8).iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x55
    shard.write_bytes(bytes(data))
    half = step_dir(run_dir, 12)
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    capfd.readouterr()
    assert _train(cfg12, run_dir, data_dir) == 0
    err = capfd.readouterr().err
    assert "step-12 ignored: no COMPLETE.json" in err and "step-8 ignored: " in err and "CRC32" in err
    assert "resumed from" in err and "step-4 at step 4" in err
    got, ref = losses(run_dir), losses(reference)
    assert [got[s] for s in range(5, 13)] == [ref[s] for s in range(5, 13)]
    assert check_complete(half) is None  # the stale directory was replaced by a complete save


def test_unloadable_checkpoint_falls_back_to_an_older_one(tmp_path, data_dir, capfd, clean_env):
    """Sizes match (no CRC configured) but DCP cannot read it: --resume auto takes the next older one."""
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 8}, checkpoint={"every": 4, "keep_last": 5})
    assert _train(cfg, tmp_path / "r", data_dir) == 0
    meta = step_dir(tmp_path / "r", 8) / ".metadata"
    meta.write_bytes(b"\x00" * meta.stat().st_size)
    capfd.readouterr()
    assert _train(cfg, tmp_path / "r", data_dir, "--max-steps", "8") == 0
    err = capfd.readouterr().err
    assert f"checkpoint {step_dir(tmp_path / 'r', 8)} failed to load" in err and "trying an older one" in err
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["resumed_from_step"] == 4
    assert meta.read_bytes().strip(b"\x00")  # step 8 was saved again, not kept from the old timeline
    # Asked for by path, the same checkpoint is an error, not a silent fallback.
    assert _train(cfg, tmp_path / "r", data_dir, "--resume", str(step_dir(tmp_path / "r", 4))) == 0
    meta = step_dir(tmp_path / "r", 4) / ".metadata"
    meta.write_bytes(b"\x00" * meta.stat().st_size)
    assert _train(cfg, tmp_path / "r", data_dir, "--resume", str(step_dir(tmp_path / "r", 4))) == 2
    assert "step-4 failed to load" in capfd.readouterr().err


def test_resume_none_starts_fresh_and_replaces_old_checkpoints(tmp_path, data_dir, capfd, clean_env):
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 4}, checkpoint={"every": 2})
    assert _train(cfg, tmp_path / "r", data_dir) == 0
    first = json.loads((step_dir(tmp_path / "r", 4) / MARKER).read_text())["time"]
    assert _train(cfg, tmp_path / "r", data_dir, "--resume", "none") == 0
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["resumed_from_step"] is None and s["first_step"] == 1
    assert json.loads((step_dir(tmp_path / "r", 4) / MARKER).read_text())["time"] > first
    # Nothing left to do: resuming at the last step trains no step and still exits 0.
    assert _train(cfg, tmp_path / "r", data_dir) == 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps_this_process"] == 0


def test_model_shape_mismatch_is_a_clear_error(tmp_path, data_dir, capfd, clean_env):
    small = write_config(tmp_path / "s.yaml", train={"steps": 4}, checkpoint={"every": 2})
    wide = write_config(
        tmp_path / "w.yaml", train={"steps": 4}, model={"d_model": 96}, checkpoint={"every": 2}
    )
    assert _train(small, tmp_path / "r", data_dir) == 0
    capfd.readouterr()
    assert _train(wide, tmp_path / "r", data_dir) == 2
    err = capfd.readouterr().err
    assert "step-4 was saved for a different model" in err and "d_model=64->96" in err
    assert _train(small, tmp_path / "r", data_dir, "--resume", str(tmp_path / "r" / "nope")) == 2
    assert "not a complete checkpoint: no COMPLETE.json" in capfd.readouterr().err


def test_stop_file_checkpoints_acks_and_exits_0_then_fast_exit(tmp_path, data_dir, capfd, clean_env):
    """Under a launcher (a stop file) the trainer exits 0 after its ack: torchrun then prints nothing."""
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 50})
    stop = tmp_path / "stop"
    stop.write_text("SIGTERM to the training step on n7\n")
    assert _train(cfg, tmp_path / "r", data_dir, "--stop-file", str(stop)) == 0
    ack = json.loads((tmp_path / "stop.ack").read_text())
    # The request travels with step 1's agreement, which is read (asynchronously) at the end of step 2.
    assert ack["step"] == 2 and ack["checkpoint"] == str(step_dir(tmp_path / "r", 2))
    assert sorted(read_metrics(tmp_path / "r")) == [1, 2]  # the stop step's record is written
    assert ack["reason"] == "stop file: SIGTERM to the training step on n7"
    assert check_complete(ack["checkpoint"]) is None
    # what a save cut short would have cost: nothing complete yet, so steps 1-2 from the start
    said = (tmp_path / "stop.stopping").read_text().strip()
    assert said.startswith(
        "stop checkpoint of step 2 started (stop file: SIGTERM to the training step on n7)"
    )
    assert said.endswith(
        "there is no complete checkpoint: if the job ends before this save completes, the next "
        "attempt resumes from step 0 and redoes steps 1-2 (2 steps)"
    )
    assert said in capfd.readouterr().err
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["exit"] == "stopped"
    # Restarted with the stop file and its ack present: exit 0 at once, torch never imported.
    env = {**os.environ, "SBATCH_GEN_STOP_FILE": str(stop)}
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "sbatch_gen.train", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "already checkpointed" in r.stderr
    imported = [
        line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")
    ]
    assert "torch" not in imported
    # Once the launcher removes both files, the next start resumes from the stop checkpoint.
    stop.unlink()
    (tmp_path / "stop.ack").unlink()
    assert _train(cfg, tmp_path / "r", data_dir, "--stop-file", str(stop), "--max-steps", "3") == 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["resumed_from_step"] == 2


def test_signal_storm_during_training_and_save(tmp_path, data_dir, capfd, clean_env):
    """SIGUSR1/SIGTERM delivered every few ms, through the save: one clean stop, a loadable checkpoint."""
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 10_000})
    stop = tmp_path / "stop"
    done = threading.Event()

    def storm():
        time.sleep(1.0)
        while not done.is_set():
            os.kill(os.getpid(), signal.SIGUSR1 if int(time.time() * 1000) % 2 else signal.SIGTERM)
            time.sleep(0.002)

    # The trainer restores these when it returns: a late signal from the storm must not kill pytest.
    prev = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGUSR1, signal.SIGTERM)}
    t = threading.Thread(target=storm, daemon=True)
    t.start()
    try:
        rc = _train(cfg, tmp_path / "r", data_dir, "--stop-file", str(stop))
    finally:
        done.set()
        t.join()
        for s, h in prev.items():
            signal.signal(s, h)
    assert rc == 0  # a stop file is set: the ack says "checkpointed"
    ack = json.loads((tmp_path / "stop.ack").read_text())
    assert "SIGUSR1" in ack["reason"] or "SIGTERM" in ack["reason"]
    assert check_complete(ack["checkpoint"]) is None
    assert json.loads((step_dir(tmp_path / "r", ack["step"]) / MARKER).read_text())["step"] == ack["step"]
    (tmp_path / "stop.ack").unlink()
    assert _train(cfg, tmp_path / "r", data_dir, "--max-steps", str(ack["step"] + 2)) == 0
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["resumed_from_step"] == ack["step"] and s["last_step"] == ack["step"] + 2


def _also_asking_for_cuda_rng(rng_state):
    """state.rng_state as a GPU process runs it: the CPU generator's state and the CUDA one's."""

    def wrapped(device):
        import torch

        return {**rng_state(device), "cuda": torch.zeros(16, dtype=torch.uint8)}

    return wrapped


def test_a_cpu_checkpoint_resumes_in_a_process_that_also_asks_for_cuda_rng(
    cfg12, reference, tmp_path, data_dir, capfd, clean_env, monkeypatch
):
    """A GPU process asks for rng.rank0.cuda, which a CPU process never wrote: it must resume from the
    checkpoint anyway (CPU RNG restored), not fail on every checkpoint and start fresh."""
    from sbatch_gen.train import state

    part = tmp_path / "part"
    assert _train(cfg12, part, data_dir, "--max-steps", "6") == 0
    monkeypatch.setattr(state, "rng_state", _also_asking_for_cuda_rng(state.rng_state))
    capfd.readouterr()
    assert _train(cfg12, part, data_dir) == 0
    err = capfd.readouterr().err
    assert f"resumed from {step_dir(part, 6)} at step 6" in err, err
    assert "has no CUDA RNG state for rank0" in err and "failed to load" not in err
    got, ref = losses(part), losses(reference)
    assert [got[s] for s in range(7, 13)] == [ref[s] for s in range(7, 13)]  # the CPU RNG (dropout) restored
    assert same_weights(part / "model.safetensors", reference / "model.safetensors")


def test_complete_checkpoints_that_all_fail_to_load_stop_the_run_instead_of_a_fresh_start(
    tmp_path, data_dir, capfd, clean_env
):
    """--resume auto with complete (marker and sizes fine) but unreadable checkpoints: one error line,
    exit 2 like the other fatal start-up errors; nothing trained, nothing overwritten."""
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 8}, checkpoint={"every": 2, "keep_last": 5})
    run_dir = tmp_path / "r"
    assert _train(cfg, run_dir, data_dir, "--max-steps", "4") == 0
    for s in (2, 4):
        meta = step_dir(run_dir, s) / ".metadata"
        meta.write_bytes(b"\x00" * meta.stat().st_size)
        assert check_complete(step_dir(run_dir, s)) is None  # still "complete": only loading tells
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    capfd.readouterr()
    assert _train(cfg, run_dir, data_dir) == 2
    err = capfd.readouterr().err
    assert "starting fresh (--resume" not in err and "training steps" not in err and "Traceback" not in err
    fatal = [ln for ln in err.splitlines() if "not starting fresh" in ln]
    assert len(fatal) == 1 and "none of the 2 complete checkpoint(s)" in fatal[0] and "step-4" in fatal[0], (
        err
    )
    assert "--resume none" in fatal[0]
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2", "step-4"]
    # Asked for explicitly, a fresh start over them is still possible.
    assert _train(cfg, run_dir, data_dir, "--resume", "none", "--max-steps", "2") == 0


def test_summary_mfu_comes_from_the_summary_tokens_per_s(tmp_path, data_dir, clean_env):
    """With a peak (train.peak_tflops; on a GPU it comes from the device name) the summary's MFU/HFU are
    its own tokens/s (warm-up step excluded) times FLOPs per token over the peak, per device."""
    cfg = write_config(
        tmp_path / "c.yaml",
        train={"steps": 5, "peak_tflops": 0.001},
        model={"activation_checkpointing": True},
    )
    assert _train(cfg, tmp_path / "r", data_dir) == 0
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    per_device = s["tokens_per_s"] / s["world_size"]
    assert s["mfu"] == pytest.approx(per_device * s["model_flops_per_token"] / 1e9, rel=1e-12)
    assert s["hfu"] == pytest.approx(per_device * s["hardware_flops_per_token"] / 1e9, rel=1e-12)
    assert s["hfu"] > s["mfu"] > 0  # recomputed forwards count as hardware FLOPs only
    recs = read_metrics(tmp_path / "r")
    assert all(
        r["mfu"] == pytest.approx(r["tokens_per_s"] * s["model_flops_per_token"] / 1e9) for r in recs.values()
    )
    # CPU: the CUDA memory figures are absent (None), max RSS is there.
    assert s["memory"]["max_allocated_bytes"] is None and s["memory"]["max_reserved_bytes"] is None
    assert s["memory"]["device_total_bytes"] is None and s["memory"]["max_rss_bytes"] > 0
    rec = recs[5]
    assert (
        rec["mem_kind"] == "max_rss" and rec["mem_reserved_bytes"] is None and rec["mem_free_bytes"] is None
    )
