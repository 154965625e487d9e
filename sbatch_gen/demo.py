"""``make demo``: two regions on this machine, elastic DiLoCo over the ``fs`` mailbox, then a summary.

Each region is its own torchrun with 2 processes (gloo, its own rendezvous port and process group)
running ``python -m sbatch_gen.train``; the regions share nothing but the mailbox directory, exactly as
two clusters would share a bucket. Midway, region ``us`` is stopped through its stop file (as the batch
script does on preemption: it checkpoints, announces its leave and exits with the requeue code) and
restarted a little later, like a requeued job: it fast-forwards to the run and rejoins. Afterwards: loss
per region, how long ``eu`` waited per round while ``us`` was away, the rejoin, sync timings per round,
the bytes exchanged against per-step gradient averaging, and whether the final weights are identical.

    python -m sbatch_gen.demo [--config configs/demo.yaml] [--steps N] [--inner-steps H] [--out runs/demo-xr]
                              [--away-rounds A] [--no-stop] [--payload-dtype DTYPE] [--overlap OVERLAP]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path

from sbatch_gen.testing.regions import launch_region
from sbatch_gen.xr_options import CrossRegion, FsTransport

REGIONS = ["eu", "us"]
PARTS = ("upload", "wait", "download", "reduce", "broadcast", "outer_step", "cleanup")


def _mib(n: float) -> str:
    if n < 2**20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _read_metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def _same_params(a: Path, b: Path) -> bool:
    import numpy as np
    from safetensors.numpy import load_file

    pa, pb = load_file(a), load_file(b)
    return pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


def _away_lines(out: Path, regions: list[str], grace_s: float) -> list[str]:
    """What the elastic rounds did: who was away, how long the others waited, who rejoined how."""
    lines = []
    for r in regions:
        m = _read_metrics(out / r)
        rounds = [x for x in m if "xr_total_s" in x]
        for other in regions:
            if other == r:
                continue
            missed = [x for x in rounds if other in x.get("xr_absent", [])]
            if not missed:
                continue
            waits = [x["xr_wait_s"] for x in missed]
            why = sorted({x["xr_close_reason"] for x in missed})
            lines.append(
                f"{r}: {len(missed)} round(s) without {other} "
                f"({', '.join(str(x['xr_round']) for x in missed)}), closed by {'/'.join(why)}; {r} waited "
                f"median {statistics.median(waits) * 1e3:.0f} ms, max {max(waits) * 1e3:.0f} ms per round "
                f"(bound: grace_s {grace_s:g} s, or none after a planned leave)"
            )
        for e in m:
            if e.get("event") == "xr_leave":
                lines.append(f"{r}: left after step {e['step']} (round {e['round']}): {e['reason']}")
            if e.get("event") == "xr_rejoin":
                # the run's step: where the adopted round ended, plus how far the run was into the next
                into, at, to = e.get("steps_into_round", 0), e["adopted_step"], e["to_round"]
                where = (
                    f"round {to} ended at step {at - into}; the run was {into} step(s) into the next by the "
                    "store's clock"
                    if into
                    else f"the end of round {to}"
                )
                lines.append(
                    f"{r}: rejoined: fast-forwarded from round {e['from_round']} to {to} "
                    f"({e['replayed']} round(s) replayed, via {', '.join(e['via'])}) in {e['seconds']:.2f} s; "
                    f"continued after the run's step {at} ({where}), its data from where it left off"
                )
                back = [x for x in rounds if x["xr_round"] == e["to_round"] + 1]
                if back:
                    took = r in back[0]["xr_members"]
                    lines.append(
                        f"{r}: first round back ({back[0]['xr_round']}): "
                        + ("took part" if took else "late (its delta was dropped)")
                    )
    return lines


def _numel(model: Path) -> int:
    from safetensors.numpy import load_file

    return sum(int(a.size) for a in load_file(model).values())


def summarize(
    out: Path, regions: list[str], wall_s: float, steps: int, grace_s: float = 0.0, payload: str = "bf16"
) -> str:
    lines = [
        f"cross-region demo: {len(regions)} regions x 2 processes, DiLoCo over fs:{out / 'mailbox'}",
        f"wall time {wall_s:.1f} s for {steps} steps",
        "",
    ]
    up_total = 0
    rounds_all = {}
    for r in regions:
        m = _read_metrics(out / r)
        losses = [(x["step"], x["loss"]) for x in m if "loss" in x]
        rounds = [x for x in m if "xr_total_s" in x]  # the rounds this region ran (not a fast-forward)
        rounds_all[r] = rounds
        up_total += sum(x["xr_bytes_up"] for x in rounds)
        first, last = losses[0], losses[-1]
        best = min(v for _, v in losses)
        lines.append(
            f"region {r}: loss {first[1]:.3f} (step {first[0]}) -> {last[1]:.3f} (step {last[0]}), "
            f"best {best:.3f}; {len(rounds)} outer rounds"
        )
    away = _away_lines(out, regions, grace_s)
    if away:
        lines += ["", *away]
    lines.append("")
    for r in regions:
        rounds = rounds_all[r]
        if not rounds:
            continue
        med = {p: statistics.median(x[f"xr_{p}_s"] for x in rounds) for p in PARTS}
        tot = [x["xr_total_s"] for x in rounds]
        split = " ".join(f"{p} {med[p] * 1e3:.1f}" for p in PARTS)
        lines.append(
            f"sync {r}: per round median {statistics.median(tot) * 1e3:.1f} ms, max {max(tot) * 1e3:.1f} ms "
            f"(median ms: {split}); {sum(tot):.2f} s in sync = {100 * sum(tot) / wall_s:.1f}% of wall"
        )
    a, b = out / regions[0] / "model.safetensors", out / regions[1] / "model.safetensors"
    rounds0 = rounds_all[regions[0]]
    if rounds0 and a.exists():
        steps_at = [x["xr_step"] for x in rounds0]
        gap = statistics.median(b - a for a, b in pairwise(steps_at)) if len(steps_at) > 1 else steps_at[0]
        numel = _numel(a)
        down_total = sum(x["xr_bytes_down"] for r in regions for x in rounds_all[r])
        per_round = statistics.median(x["xr_bytes_up"] for x in rounds0)
        # Per-step gradient averaging across regions, same mailbox, fp32: every region sends its gradient
        # (P*4 bytes) and receives the other regions' ((R-1)*P*4) every step; a DiLoCo round moves its
        # payload (bf16: P*2) once per H steps. (For 2 regions that is also what a ring all-reduce moves per
        # process.)
        lines += [
            "",
            f"parameters: {numel:,}; a round every {gap:g} steps; payloads {payload}",
            f"exchanged across regions: {_mib(up_total)} up + {_mib(down_total)} down = "
            f"{_mib(up_total + down_total)}",
            f"per round a region sends {_mib(per_round)} ({per_round / (numel * 2):.3g} of bf16's) and receives "
            f"as much from each other region; per-step gradient averaging (fp32) would send "
            f"{numel * 4 * gap / per_round:,.0f}x that over the same {gap:g} steps",
        ]
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
    ap.add_argument("--away-rounds", type=int, default=3, help="rounds region us misses midway")
    ap.add_argument("--no-stop", action="store_true", help="do not stop and restart region us midway")
    ap.add_argument(
        "--payload-dtype",
        default="bf16",
        choices=["bf16", "fp32", "int8", "fp8", "int4", "sparse"],
        help="cross_region.payload_dtype (sparse: the defaults' 1%% of each chunk of 4096)",
    )
    ap.add_argument(
        "--overlap", default="none", choices=["none", "eager", "streaming"], help="cross_region.overlap"
    )
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
    # Elastic rounds: either region goes on alone. grace_s covers a returning region's first round (it
    # fast-forwards, then trains H steps while the other region is somewhere in that round already).
    grace_s = 10.0
    xrs = {
        r: CrossRegion(
            enabled=True,
            run_id=run_id,
            region=r,
            regions=REGIONS,
            inner_steps=args.inner_steps,
            transport=transport,
            timeout_s=300,
            shard_mb=1.0,
            threads=4,
            min_regions=1,
            grace_s=grace_s,
            snapshot_every=2,
            keep_rounds=2,
            payload_dtype=args.payload_dtype,
            overlap=args.overlap,
            fragments=2,  # overlap streaming only: 2 fragments, each exchange behind 1 step
            fragment_delay_steps=1,
        )
        for r in REGIONS
    }
    stop = (out / "us.stop").absolute()
    print(
        f"training {len(REGIONS)} regions ({', '.join(REGIONS)}), each torchrun x 2 processes, {steps} steps, "
        f"DiLoCo H={args.inner_steps}, overlap {args.overlap}, payloads {args.payload_dtype}, min_regions 1, "
        f"grace_s {grace_s:g}, mailbox {transport.root}; "
        f"logs in {out}/<region>.log",
        flush=True,
    )

    def launch(r: str):
        extra = ["--stop-file", str(stop)] if r == "us" else []
        return launch_region(
            xrs[r],
            config=args.config,
            run_dir=out / r,
            max_steps=steps,
            resume="auto",
            log_dir=out,
            extra_args=extra,
        )

    t0 = time.monotonic()
    runs: dict = {}
    failed = []
    try:
        runs = {r: launch(r) for r in REGIONS}
        rounds = steps // args.inner_steps
        if not args.no_stop and rounds >= args.away_rounds + 4:
            mbx = Path(transport.root) / run_id
            leave_at = rounds // 2 - args.away_rounds // 2
            _wait_until(mbx / f"r{leave_at:06d}" / "_commit.json", runs, t0, args.timeout)
            print(
                f"[{time.monotonic() - t0:5.1f} s] round {leave_at} closed: stopping us through its stop file "
                f"({stop})",
                flush=True,
            )
            stop.touch()
            runs["us"].wait(max(1.0, args.timeout - (time.monotonic() - t0)))  # exits 42: checkpointed, left
            back_at = leave_at + args.away_rounds
            _wait_until(mbx / f"r{back_at:06d}" / "_commit.json", {"eu": runs["eu"]}, t0, args.timeout)
            print(
                f"[{time.monotonic() - t0:5.1f} s] round {back_at} closed without us: restarting us "
                "(--resume auto), as the requeued job would",
                flush=True,
            )
            stop.unlink()
            stop.with_name(stop.name + ".ack").unlink(missing_ok=True)
            runs["us"] = launch("us")
        for run in runs.values():
            rcs = run.wait(max(1.0, args.timeout - (time.monotonic() - t0)))
            if any(rcs):
                failed.append((run, rcs))
    except BaseException:
        for run in runs.values():
            run.kill()
        raise
    wall = time.monotonic() - t0
    if failed:
        for run, rcs in failed:
            print(f"region {run.region} failed (exit {rcs}):\n{run.tail(40)}", file=sys.stderr)
        return 1
    print(summarize(out, REGIONS, wall, steps, grace_s, args.payload_dtype), flush=True)
    return 0


def _wait_until(path: Path, runs: dict, t0: float, timeout: float) -> None:
    while not path.exists():
        for run in runs.values():
            if run.poll()[0] is not None:
                raise RuntimeError(f"region {run.region} ended early (waiting for {path}):\n{run.tail(40)}")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"demo: no {path} after {timeout:g} s")
        time.sleep(0.05)


if __name__ == "__main__":
    raise SystemExit(main())
