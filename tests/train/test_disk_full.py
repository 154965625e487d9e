"""Disk full during training: the previous complete checkpoint stays loadable; the trainer says so in
one line ("no space left on device"), no traceback, exit 1.

The run dir lives on a small tmpfs this test mounts (root only; skipped otherwise) and fills once the
first checkpoint is complete."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sbatch_gen.testing.faults import ENV_LEASE_PERIOD, ENV_STEP_SLEEP, ENV_STEP_SLEEP_RANKS
from sbatch_gen.testing.faults import MODULE as FAULTS
from sbatch_gen.train.checkpoint import check_complete, list_step_dirs, step_dir

from .conftest import REPO, Launch, torchrun_cmd, train_env, wait_for, write_config

pytestmark = pytest.mark.slow  # trainer subprocesses on a small tmpfs


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Write zeros into ``path`` until the filesystem is full."""
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with open(path, "ab", buffering=0) as f:  # the last partial chunk
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC


def _free(path: Path, nbytes: int) -> None:
    """Give ``nbytes`` back: room for a few metrics lines, none for a checkpoint (~1.5 MB here)."""
    os.truncate(path, max(0, path.stat().st_size - nbytes))


def test_disk_full_keeps_the_last_checkpoint_and_says_so_in_one_line(small_fs, tmp_path, data_dir):
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 400}, checkpoint={"every": 5, "keep_last": 2})
    run_dir = small_fs / "run"
    cmd = [
        sys.executable,
        "-m",
        FAULTS,  # the trainer with the per-step sleep installed
        "--config",
        str(cfg),
        "--run-dir",
        str(run_dir),
        "--data-path",
        str(data_dir),
    ]
    la = Launch(cmd, tmp_path / "train.log", {ENV_STEP_SLEEP: "0.1", ENV_LEASE_PERIOD: "600"})
    try:
        wait_for(lambda: check_complete(step_dir(run_dir, 5)) is None, 120, "the step-5 checkpoint", la)
        _fill(small_fs / "filler")
        _free(small_fs / "filler", 256 << 10)
        rc = la.wait(timeout=120)
    finally:
        la.kill()
    out = la.output()
    assert rc == 1, out
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if "no space left on device" in ln.lower()]
    assert len(lines) == 1, out
    assert "last complete checkpoint" in lines[0]
    # the previous complete checkpoint is intact and loads
    (small_fs / "filler").unlink()
    complete = [p for _s, p in list_step_dirs(run_dir) if check_complete(p) is None]
    assert step_dir(run_dir, 5) in complete
    r = subprocess.run(
        cmd[:-4]
        + [
            "--run-dir",
            str(run_dir),
            "--data-path",
            str(data_dir),
            "--max-steps",
            str(int(complete[-1].name.split("-")[1]) + 1),
        ],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"resumed from {complete[-1]}" in r.stderr


def _resume_from_last_complete(run_dir: Path, cfg: Path, data_dir: Path) -> None:
    """With space again: the newest complete checkpoint loads and training goes on from it."""
    complete = [p for _s, p in list_step_dirs(run_dir) if check_complete(p) is None]
    assert complete, "no complete checkpoint left"
    last = int(complete[-1].name.split("-")[1])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sbatch_gen.train",
            "--config",
            str(cfg),
            "--run-dir",
            str(run_dir),
            "--data-path",
            str(data_dir),
            "--max-steps",
            str(last + 1),
        ],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"resumed from {complete[-1]}" in r.stderr


def test_disk_full_during_an_async_save_keeps_the_last_checkpoint_and_says_so_in_one_line(
    small_fs, tmp_path, data_dir, launches
):
    """checkpoint.async_save (2 ranks under torchrun: it needs a process group). The background save that
    hits the full disk fails when the trainer collects it: every rank stops there, at the same step (had
    one rank gone on, it would die in the next step's all-reduce with a traceback); rank 0 says so in one
    line, no traceback, exit 1; the previous complete checkpoint stays loadable."""
    cfg = write_config(
        tmp_path / "c.yaml", train={"steps": 400}, checkpoint={"every": 5, "keep_last": 2, "async_save": True}
    )
    run_dir = small_fs / "run"
    logs = tmp_path / "worker-logs"
    cmd = torchrun_cmd(cfg, run_dir, data_dir, module=FAULTS)
    cmd[1:1] = ["--log-dir", str(logs), "--redirects", "3"]  # each worker's output in a file of its own
    # rank 0 is a straggler (it sleeps 0.2 s before it reads each step's agreement): the ranks look at
    # the save at moments far enough apart that one can see it failed while the other does not yet
    la = launches(
        cmd,
        tmp_path / "torchrun.log",
        {
            ENV_STEP_SLEEP: "0.2",
            ENV_STEP_SLEEP_RANKS: "0",
            ENV_LEASE_PERIOD: "600",
        },
    )
    wait_for(lambda: check_complete(step_dir(run_dir, 5)) is None, 180, "the step-5 checkpoint", la)
    assert "async_save needs a process group" not in la.output()
    _fill(small_fs / "filler")
    _free(small_fs / "filler", 256 << 10)
    rc = la.wait(timeout=180)
    workers = {
        int(p.parent.name): p.read_text(errors="replace") for p in logs.glob("*/attempt_0/*/stderr.log")
    }
    everything = la.output() + "".join(f"\n--- local rank {r} ---\n{t}" for r, t in sorted(workers.items()))
    assert rc == 1, everything
    assert sorted(workers) == [0, 1], everything
    assert all("Traceback" not in t for t in workers.values()), everything
    lines = [ln for t in workers.values() for ln in t.splitlines() if "no space left on device" in ln.lower()]
    assert len(lines) == 1, everything
    assert (
        "[rank 0/2]" in lines[0] and "last complete checkpoint (" in lines[0] and "(none yet)" not in lines[0]
    )
    # the first worker to end exits 1 (torchrun then SIGTERMs the other, which may still be shutting down)
    assert "exitcode  : 1" in la.output().split("Root Cause")[-1], la.output()
    assert "checkpoint step 5 saved" in workers[0]  # the async save before the disk filled up completed
    # the previous complete checkpoint is intact and loads
    (small_fs / "filler").unlink()
    assert check_complete(step_dir(run_dir, 5)) is None or any(
        check_complete(p) is None for s, p in list_step_dirs(run_dir) if s > 5
    )
    _resume_from_last_complete(run_dir, cfg, data_dir)
