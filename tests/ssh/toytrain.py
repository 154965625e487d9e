"""A tiny torchrun-able trainer with the trainer's command line, for launcher fault tests.

It speaks the same contract as ``python -m sbatch_gen.train`` where the launcher can see it: the
same flags (``--config --resume --run-dir`` plus the ``--xr-*`` flags), a gloo process group under
torchrun, one all-reduce per step, a checkpoint every ``ckpt_every`` steps written atomically by rank 0
under ``<run-dir>/checkpoints/step-<N>/`` with a completion marker, ``--resume auto`` picking the
newest complete one, ``<run-dir>/metrics.jsonl`` and ``<run-dir>/summary.json``. Steps are slow on
purpose (``step_s``) so a test can kill a worker mid-run.

Config: JSON ``{"steps": N, "step_s": S, "ckpt_every": K}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from sbatch_gen import xr_options


def _latest(run_dir: Path) -> int:
    best = 0
    for d in (run_dir / "checkpoints").glob("step-*"):
        if (d / "COMPLETE").exists():
            best = max(best, int(d.name.split("-", 1)[1]))
    return best


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--resume", default="auto")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--data-path")
    p.add_argument("--stop-file")
    p.add_argument("--max-steps", type=int)
    xr_options.add_arguments(p)
    args = p.parse_args()
    xr = xr_options.from_namespace(args)
    cfg = json.loads(Path(args.config).read_text())

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(args.run_dir)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    start = _latest(run_dir) if args.resume == "auto" else 0
    attempt = os.environ.get("SBATCH_GEN_ATTEMPT", "")
    if rank == 0:
        with open(run_dir / "starts.jsonl", "a") as f:
            f.write(json.dumps({"start_step": start, "resume": args.resume, "attempt": attempt,
                                "world": world, "xr_enabled": xr.enabled}) + "\n")
    for step in range(start + 1, cfg["steps"] + 1):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert int(t.item()) == world
        time.sleep(cfg["step_s"])
        if rank == 0:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "world": world, "attempt": attempt}) + "\n")
            if step % cfg["ckpt_every"] == 0:
                d = run_dir / "checkpoints" / f"step-{step}"
                d.mkdir(exist_ok=True)
                _atomic_write(d / "state.json", json.dumps({"step": step}))
                _atomic_write(d / "COMPLETE", "")
    dist.barrier()
    if rank == 0:
        _atomic_write(run_dir / "summary.json", json.dumps({"steps": cfg["steps"], "world": world}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
