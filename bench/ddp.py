"""Benchmark 3: DDP inside a region (gloo, CPU): compute vs all-reduce, and the cost of a straggler.

The real trainer under torchrun. (a) 1, 2 and 4 ranks, the same per-rank batch: step time, and the
span of DDP's bucket all-reduces (from the trainer's comm hook; it overlaps the backward pass) as a
share of the step. (b) 2 ranks, rank 1 sleeping ``d`` seconds at the end of every step (the trainer's
``SBATCH_GEN_TEST_STEP_SLEEP_S`` hook, set for that rank only by :mod:`bench.straggler`): rank 0's step time
vs ``d``. Every rank waits for the slowest at the next collective, so the slope should be 1.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .common import Result, median
from .trainruns import read_metrics, torchrun, write_config

SKIP = 3  # warm-up steps left out


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else float("nan")
    return slope, my - slope * mx


def run(out_dir: Path, quick: bool = False) -> Result:
    res = Result("ddp", "DDP (gloo, CPU): compute vs all-reduce, and straggler cost", quick)
    steps = 5 if quick else 28
    worlds = [] if quick else [1, 4]  # 2 ranks: the straggler run without delay
    delays = [0.0, 0.1] if quick else [0.0, 0.05, 0.1, 0.2]
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-ddp-"))
    try:
        cfg = write_config(work / "ddp.yaml", steps=steps, data_dir=work / "data")

        def one(nproc: int, name: str, env: dict | None = None) -> list[dict]:
            rd = work / name
            torchrun(
                "bench.straggler",
                nproc,
                ["--config", str(cfg), "--run-dir", str(rd), "--resume", "none"],
                env_extra=env,
                log=work / f"{name}.log",
            )
            recs = read_metrics(rd)
            return recs[SKIP:] if len(recs) > SKIP + 1 else recs

        def scaling_row(w: int, recs: list[dict]) -> list:
            step = median([r["step_time_s"] for r in recs])
            ar = median([r.get("ddp_allreduce_s") or 0.0 for r in recs])
            return [w, step, ar, f"{ar / step:.0%}", median([r["data_time_s"] for r in recs]), len(recs)]

        scaling, strag = [], []
        for d in delays:
            print(f"  ddp: 2 ranks, straggler delay {d}s on rank 1", flush=True)
            recs = one(2, f"s{d}", {"BENCH_STRAGGLER_RANK": "1", "BENCH_STRAGGLER_S": str(d)})
            if d == 0:
                scaling.append(scaling_row(2, recs))  # the undisturbed 2-rank run
            r0 = median([r["step_time_s"] for r in recs])
            slow = median([r["slowest_rank"] for r in recs]) if d > 0 else None
            strag.append([d, r0, median([r["rank_step_time_s"][1] for r in recs]), slow])
        for w in worlds:
            print(f"  ddp: {w} rank(s)", flush=True)
            scaling.append(scaling_row(w, one(w, f"w{w}")))
        scaling.sort(key=lambda r: r[0])
        res.table(
            "Compute vs all-reduce (same per-rank batch; median over steps)",
            ["ranks", "step s", "all-reduce span s", "all-reduce share", "data s", "steps measured"],
            scaling,
            "scaling",
        )
        slope, icpt = _fit([s[0] for s in strag], [s[1] for s in strag])
        res.table(
            "Step time vs an injected straggler delay on rank 1 (2 ranks)",
            [
                "delay s (rank 1)",
                "step time s (rank 0)",
                "rank 1's own time to the collective s",
                "slowest rank reported",
            ],
            strag,
            "straggler",
        )
        res.table("Fit: step time = slope x delay + base", ["slope", "base s"], [[slope, icpt]], "fit")
        res.goal(
            "straggler slope ~ 1 (every rank waits for the slowest)",
            f"{slope:.2f}",
            None if quick else 0.8 <= slope <= 1.2,
        )
        res.headline["straggler slope (step time per second of delay)"] = f"{slope:.2f}"
        two = [r for r in scaling if r[0] == 2]
        res.headline["all-reduce share of a step at 2 ranks"] = two[0][3]
        res.setup += [
            f"The trainer (`python -m sbatch_gen.train` via `bench.straggler`) under torchrun, gloo, "
            f"OMP_NUM_THREADS=1; a {2}-layer, width-128 GPT, batch 8 x 128 tokens per rank; {steps} steps, "
            f"the first {SKIP} left out.",
            "All-reduce span: from the first bucket's all-reduce launch to the last one's completion (the "
            "trainer's DDP comm hook); it overlaps the backward pass, so it bounds the comm cost from above.",
            "This machine has 2 cores: 4 ranks oversubscribe it, so their compute slows too (weak-scaling "
            "numbers at 4 ranks measure the oversubscription as much as the all-reduce).",
        ]
        _plot(res, out_dir, scaling, strag, slope, icpt)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


def _plot(res, out_dir: Path, scaling, strag, slope, icpt) -> None:
    from .common import plt, save_fig

    p = plt()
    fig, (a, b) = p.subplots(1, 2, figsize=(10, 4))
    ws = [str(s[0]) for s in scaling]
    comp = [s[1] - s[2] for s in scaling]
    a.bar(ws, comp, label="rest of the step")
    a.bar(ws, [s[2] for s in scaling], bottom=comp, label="all-reduce span")
    a.set_xlabel("ranks (gloo)")
    a.set_ylabel("step time (s)")
    a.set_title("compute vs all-reduce")
    a.legend()
    xs = [s[0] for s in strag]
    b.plot(xs, [s[1] for s in strag], "o", label="measured (rank 0)")
    b.plot(xs, [slope * x + icpt for x in xs], "-", label=f"fit, slope {slope:.2f}")
    b.plot(xs, [x + strag[0][1] for x in xs], "k:", label="slope 1")
    b.set_xlabel("injected delay on rank 1 (s)")
    b.set_ylabel("step time (s)")
    b.set_title("straggler")
    b.legend()
    save_fig(fig, out_dir / "ddp.png")
    res.plots.append(("ddp.png", "Left: step split at 1/2/4 ranks. Right: step time vs straggler delay"))
