"""Small helpers to run the real trainer for the benchmarks and read its metrics."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from sbatch_gen.testing.s3server import free_port

from .common import PY, REPO, bench_env


def write_config(
    path: Path,
    *,
    steps: int,
    data_dir: Path,
    d_model: int = 128,
    n_layers: int = 2,
    seq_len: int = 128,
    batch_size: int = 8,
    lr: float = 2e-3,
    log_every: int = 1,
    warmup: int = 5,
) -> Path:
    cfg = {
        "model": {"n_layers": n_layers, "d_model": d_model, "n_heads": 4, "seq_len": seq_len, "dropout": 0.0},
        "data": {"path": str(data_dir), "source": "python-stdlib", "max_bytes": 4_000_000},
        "train": {"steps": steps, "batch_size": batch_size, "log_every": log_every, "seed": 1234},
        "optim": {"lr": lr, "min_lr": lr / 10, "warmup_steps": min(warmup, steps - 1)},
        "checkpoint": {"every": 1_000_000, "keep_last": 1, "export_safetensors": False},
        "run_dir": str(path.parent / "run"),
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def torchrun(
    module: str,
    nproc: int,
    args: list[str],
    env_extra: dict | None = None,
    log: Path | None = None,
    timeout: float = 900,
) -> None:
    port = free_port()
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--max-restarts=0",
        "-m",
        module,
        *args,
    ]
    with open(log or "/dev/null", "ab") as f:
        p = subprocess.run(
            cmd, env=bench_env(env_extra), stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout
        )
    if p.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:] if log else ""
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}\n{tail}")


def read_metrics(run_dir: Path) -> list[dict]:
    """Step records (not events) of ``<run_dir>/metrics.jsonl``."""
    recs = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if "event" not in r and "step" in r:
                recs.append(r)
    return recs
