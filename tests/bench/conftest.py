"""Fixtures for the bench/report tests: tiny real training runs (plain processes, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` is a top-level package of the checkout, not installed
    sys.path.insert(0, str(REPO))


def _env() -> dict:
    from sbatch_gen.testing.regions import clean_env

    return clean_env({"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})


def tiny_config(path: Path, data: Path, steps: int = 6, every: int = 100) -> Path:
    cfg = {
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 32},
        "data": {"path": str(data), "source": "python-stdlib", "max_bytes": 300_000},
        "train": {"steps": steps, "batch_size": 2, "log_every": 1},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "checkpoint": {"every": every, "keep_last": 1, "export_safetensors": False},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(cfg: Path, run_dir: Path, *extra: str, wait: bool = True):
    cmd = [sys.executable, "-m", "sbatch_gen.train", "--config", str(cfg), "--run-dir", str(run_dir), *extra]
    p = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
    )
    if not wait:
        return p
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out[-3000:]
    return p


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    """One region, one process, 6 steps, no cross-region sync."""
    d = tmp_path_factory.mktemp("single")
    cfg = tiny_config(d / "tiny.yaml", d / "data")
    train(cfg, d / "run")
    return d / "run"


@pytest.fixture(scope="module")
def xr_runs(tmp_path_factory) -> list[Path]:
    """Two regions (a plain process each) with DiLoCo every 3 steps over an fs mailbox: 2 rounds."""
    d = tmp_path_factory.mktemp("xr")
    cfg = tiny_config(d / "tiny.yaml", d / "data")
    procs = []
    for region in ("a", "b"):
        procs.append(
            train(
                cfg,
                d / region,
                "--xr-enabled",
                "--xr-run-id",
                "t",
                "--xr-region",
                region,
                "--xr-regions",
                "a,b",
                "--xr-inner-steps",
                "3",
                "--xr-transport",
                "fs",
                "--xr-root",
                str(d / "mailbox"),
                "--xr-timeout-s",
                "300",
                wait=False,
            )
        )
    for p in procs:
        out = p.communicate(timeout=600)[0]
        assert p.returncode == 0, out[-3000:]
    return [d / "a", d / "b"]
