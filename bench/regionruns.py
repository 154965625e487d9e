"""The real trainer as regions, for the benchmarks: one region = one trainer process.

The train config every multi-region benchmark writes (:func:`train_config`), one region's process
(:func:`launch_region`), both regions of a 2-region run (:func:`launch_pair`), and waiting for them
(:func:`finish`). Used by ``elastic``, ``payload``, ``overlap``, ``quality`` and ``peer``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Protocol

import yaml

from sbatch_gen.testing.faults import trainer_module
from sbatch_gen.testing.regions import RegionRun, clean_env
from sbatch_gen.xr_options import CrossRegion, FsTransport, to_argv

from .common import PY, REPO

REGIONS = ["a", "b"]
HELDOUT = "heldout"
# Plain averaging: every region adopts the token-weighted mean of the regions' models each round. The
# defaults (0.7 / Nesterov 0.9) are tuned for long runs; from scratch over a few hundred steps they
# train worse here (bench/diloco.py: H=10 under momentum 0.9 ended at 2.75 against 2.27-2.38).
OUTER_LR, OUTER_MOMENTUM = 1.0, 0.0
DATA_BYTES = 4_000_000  # stdlib source, cut into 3 shards: a, b, heldout (~1.3 MB each)
TIMEOUT = 900  # seconds any one region process may take


def train_config(
    path: Path,
    *,
    steps: int,
    model: dict,
    batch: int,
    data_dir: Path,
    ckpt_every: int,
    warmup: int,
    lr: float = 2e-3,
    seed: int = 1234,
) -> Path:
    cfg = {
        "model": {**model, "dropout": 0.0},
        "data": {"path": str(data_dir), "source": "python-stdlib", "max_bytes": DATA_BYTES},
        "train": {"steps": steps, "batch_size": batch, "log_every": 1, "seed": seed},
        "optim": {"lr": lr, "min_lr": lr / 10, "warmup_steps": min(warmup, steps - 1)},
        "checkpoint": {"every": ckpt_every, "keep_last": 2, "export_safetensors": True},
        "run_dir": str(path.parent / "run"),
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class QualitySizes(Protocol):
    """What a quality run's config takes from a benchmark's sizes (bench payload's, bench elastic's)."""

    q_steps: int
    q_model: dict
    q_batch: int


def quality_config(work: Path, data: Path, sz: QualitySizes, seed: int) -> Path:
    """The train config of a quality run of ``seed`` (bench payload, elastic): checkpoints only at the end,
    20 warmup steps; written to ``work``/quality-SEED.yaml."""
    return train_config(
        work / f"quality-{seed}.yaml",
        steps=sz.q_steps,
        model=sz.q_model,
        batch=sz.q_batch,
        data_dir=data,
        ckpt_every=10 * sz.q_steps,
        warmup=20,
        seed=seed,
    )


def launch_pair(
    root: Path,
    name: str,
    *,
    config: Path,
    data: Path,
    env: dict | None = None,
    prefix: list[str] | None = None,
    **xr: object,
) -> list[RegionRun]:
    """Both regions of a fresh 2-region run ``name`` under ``root`` (run dirs ``root/a``, ``root/b``): the
    ``CrossRegion`` fields ``xr`` over strict DiLoCo through the fs mailbox ``root/mailbox`` with a 600 s
    timeout. ``env``, ``prefix``: as :func:`launch_region`."""
    fields: dict = {
        "enabled": True,
        "run_id": name,
        "regions": REGIONS,
        "sync": "diloco",
        "transport": FsTransport(root=str(root / "mailbox")),
        "timeout_s": 600,
        **xr,
    }
    return [
        launch_region(
            CrossRegion(region=region, **fields),
            config=config,
            run_dir=root / region,
            data=data,
            resume="none",
            log_dir=root / "logs",
            env=env,
            prefix=prefix,
        )
        for region in REGIONS
    ]


def launch_region(
    xr: CrossRegion,
    *,
    config: Path,
    run_dir: Path,
    data: Path,
    resume: str,
    log_dir: Path,
    max_steps: int | None = None,
    env: dict | None = None,
    extra: list[str] | None = None,
    prefix: list[str] | None = None,
    module: str | None = None,
) -> RegionRun:
    """One region = one trainer process (``python -m sbatch_gen.train``, not under torchrun: a 1-process region
    needs no agent, and leaving it out halves every start-up on 2 cores). Killed by PID (RegionRun.kill).
    ``prefix``: a command that execs the trainer (``ip netns exec NS``: bench/payload.py's WAN regions).
    ``module``: what runs the trainer (default: :func:`~sbatch_gen.testing.faults.trainer_module` of ``env``,
    ``sbatch_gen.testing.faults`` when it names a fault or a per-step sleep)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        *(prefix or []),
        PY,
        "-m",
        module or trainer_module(env),
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
        "--resume",
        resume,
        "--data-path",
        str(data),
        *(["--max-steps", str(max_steps)] if max_steps is not None else []),
        *to_argv(xr),
        *(extra or []),
    ]
    log = log_dir / f"{xr.region}.log"
    e = clean_env(env)
    e["PYTHONPATH"] = str(REPO)
    with open(log, "ab") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=e, cwd=REPO, start_new_session=True)
    return RegionRun(xr.region, run_dir, [p], [log], cmd)


def finish(runs: list[RegionRun], what: str) -> None:
    """Wait for every run to exit 0; on a timeout or a failure kill the others and raise."""
    for r in runs:
        try:
            rcs = r.wait(TIMEOUT)
        except TimeoutError:
            for o in runs:
                o.kill()
            raise
        if any(rcs):
            for o in runs:
                if o is not r:
                    o.kill()
            raise RuntimeError(f"{what}: region {r.region} exited {rcs}\n{r.tail()}")
