"""``make demo``: two regions on this machine, DiLoCo over the ``fs`` mailbox, then a short summary.

Each region is its own torchrun with 2 processes (gloo, its own rendezvous port and process group)
running ``python -m sbatch_gen.train``; the regions share nothing but the mailbox directory, exactly as
two clusters would share a bucket. Afterwards: loss per region, sync timings per round, and the bytes
the regions exchanged against what per-step gradient averaging across regions would have sent.

    python -m sbatch_gen.demo [--config configs/demo.yaml] [--steps N] [--inner-steps H] [--out runs/demo-xr]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from sbatch_gen.testing.regions import launch_region
from sbatch_gen.xr_options import CrossRegion, FsTransport

REGIONS = ["eu", "us"]
PARTS = ("upload", "wait", "download", "reduce", "broadcast", "outer_step", "cleanup")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _read_metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def _same_params(a: Path, b: Path) -> bool:
    import numpy as np
    from safetensors.numpy import load_file

    pa, pb = load_file(a), load_file(b)
    return pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


def summarize(out: Path, regions: list[str], wall_s: float, steps: int) -> str:
    lines = [f"cross-region demo: {len(regions)} regions x 2 processes, DiLoCo over fs:{out / 'mailbox'}",
             f"wall time {wall_s:.1f} s for {steps} steps", ""]
    up_total = 0
    numel = None
    rounds_all = {}
    for r in regions:
        m = _read_metrics(out / r)
        losses = [(x["step"], x["loss"]) for x in m if "loss" in x]
        rounds = [x for x in m if "xr_round" in x]
        rounds_all[r] = rounds
        up_total += sum(x["xr_bytes_up"] for x in rounds)
        if rounds and numel is None:
            numel = rounds[0]["xr_bytes_up"] // 2  # bf16 payloads
        first, last = losses[0], losses[-1]
        best = min(v for _, v in losses)
        lines.append(f"region {r}: loss {first[1]:.3f} (step {first[0]}) -> {last[1]:.3f} (step {last[0]}), "
                     f"best {best:.3f}; {len(rounds)} outer rounds")
    lines.append("")
    for r in regions:
        rounds = rounds_all[r]
        if not rounds:
            continue
        med = {p: statistics.median(x[f"xr_{p}_s"] for x in rounds) for p in PARTS}
        tot = [x["xr_total_s"] for x in rounds]
        split = " ".join(f"{p} {med[p] * 1e3:.1f}" for p in PARTS)
        lines.append(f"sync {r}: per round median {statistics.median(tot) * 1e3:.1f} ms, max {max(tot) * 1e3:.1f} ms "
                     f"(median ms: {split}); {sum(tot):.2f} s in sync = {100 * sum(tot) / wall_s:.1f}% of wall")
    if numel:
        H = rounds_all[regions[0]][0]["xr_step"]
        down_total = sum(x["xr_bytes_down"] for r in regions for x in rounds_all[r])
        # Per-step gradient averaging across regions, same mailbox, fp32: every region sends its gradient
        # (P*4 bytes) and receives the other regions' (R-1)*P*4, every step. (For 2 regions that is also
        # what a ring all-reduce moves per process.)
        per_step_up = numel * 4 * len(regions)
        per_step_down = numel * 4 * len(regions) * (len(regions) - 1)
        ddp = (per_step_up + per_step_down) * steps
        ours = up_total + down_total
        lines += [
            "",
            f"parameters: {numel:,}; H = {H} inner steps; payloads bf16",
            f"exchanged across regions: {_mib(up_total)} up + {_mib(down_total)} down = {_mib(ours)}",
            f"per-step gradient averaging (fp32) would have sent {_mib(ddp)} over {steps} steps: "
            f"{ddp / ours:,.0f}x more",
        ]
    a, b = out / regions[0] / "model.safetensors", out / regions[1] / "model.safetensors"
    if a.exists() and b.exists():
        lines.append(f"final parameters identical across regions: {'yes' if _same_params(a, b) else 'NO'}")
    lines.append(f"metrics: {', '.join(str(out / r / 'metrics.jsonl') for r in regions)}")
    lines.append(f"report (plots, SLO table): sbatch-gen report {' '.join(str(out / r) for r in regions)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sbatch_gen.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--steps", type=int, default=None, help="steps per region (default: the config's)")
    ap.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per outer round")
    ap.add_argument("--out", default="runs/demo-xr", help="run directory (replaced on every demo run)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before the demo gives up")
    args = ap.parse_args(argv)

    from sbatch_gen.train.config import load_config
    from sbatch_gen.train.data import ensure_shard

    cfg = load_config(args.config)
    steps = args.steps or cfg.train.steps
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)  # the demo's own output: every demo starts fresh
    out.mkdir(parents=True)
    for r in REGIONS:  # prepare the data shards once, before the regions start
        ensure_shard(cfg.data.path, r, REGIONS, cfg.data.source, cfg.data.max_bytes)
    transport = FsTransport(root=str((out / "mailbox").absolute()))
    run_id = f"demo-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    print(f"training {len(REGIONS)} regions ({', '.join(REGIONS)}), each torchrun x 2 processes, {steps} steps, "
          f"DiLoCo H={args.inner_steps}, mailbox {transport.root}; logs in {out}/<region>.log", flush=True)
    t0 = time.monotonic()
    runs = []
    try:
        for r in REGIONS:
            xr = CrossRegion(enabled=True, run_id=run_id, region=r, regions=REGIONS, inner_steps=args.inner_steps,
                             transport=transport, timeout_s=300, shard_mb=1.0, threads=4)
            runs.append(launch_region(xr, config=args.config, run_dir=out / r, max_steps=steps, resume="none",
                                      log_dir=out))
        failed = []
        for run in runs:
            rcs = run.wait(max(1.0, args.timeout - (time.monotonic() - t0)))
            if any(rcs):
                failed.append((run, rcs))
    except BaseException:
        for run in runs:
            run.kill()
        raise
    wall = time.monotonic() - t0
    if failed:
        for run, rcs in failed:
            print(f"region {run.region} failed (exit {rcs}):\n{run.tail(40)}", file=sys.stderr)
        return 1
    print(summarize(out, REGIONS, wall, steps), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
