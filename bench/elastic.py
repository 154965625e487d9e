"""Benchmark: elastic cross-region rounds (``min_regions: 1`` of 2 regions) against strict lock-step.

Real 2-region DiLoCo training (each region one process of the real trainer, meeting only in an fs mailbox),
three parts measured in one run:

1. **Survivor idle per round** while region b is away: ``xr_wait_s`` of region a's rounds that b missed,
   against ``grace_s``.
2. **Goodput** of the survivor a under one scripted schedule (b leaves after round k and is restarted
   ``away_s`` later), paced steps: b crashes (SIGKILL, no word to a; a finds out from b's heartbeat), the
   same crash with heartbeats off (a waits grace_s in every round b misses), b stops (its stop file: a
   planned leave), and the same crash with ``min_regions: all`` (strict: a blocks ``timeout_s``, exits 42
   and is requeued at once until b is back); plus a baseline in which b stays.
3. **Quality**: the same step budget with b away for 0%, 25% and 50% of the rounds mid-run (then back), b
   gone for the last 25%, and a alone; the final model's loss on a held-out shard neither region trained on.

This module is the entry (``python -m bench elastic``): the variants to run, in which order, and the page.
The pieces: :mod:`.elastic_sizes` (full and ``--quick`` sizes), :mod:`.elastic_goodput` (parts 1-2: the
scripted absence of b), :mod:`.elastic_quality` (part 3), :mod:`.elastic_figures` (what a variant measured,
from the metrics), :mod:`.elastic_report`, :mod:`.elastic_notes` and :mod:`.elastic_plot` (the page).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sbatch_gen.train.data import prepare

from .common import Result
from .elastic_goodput import goodput_variant
from .elastic_notes import notes
from .elastic_plot import plot
from .elastic_quality import quality_variant
from .elastic_report import label, qlabel, report
from .elastic_sizes import FULL, QUICK, Sizes
from .finalmodel import heldout_loss
from .regionruns import DATA_BYTES, HELDOUT, REGIONS, quality_config, train_config

__all__ = ["FULL", "QUICK", "run"]


def run(out_dir: Path, quick: bool = False) -> Result:
    sz = QUICK if quick else FULL
    res = Result(
        "elastic",
        "Elastic cross-region rounds: survivor idle time, goodput and quality while a region is away",
        quick,
    )
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-elastic-"))
    try:
        good, qual = _measure(work, sz, quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_report(res, out_dir, sz, good, qual)
    return res


def write_report(res: Result, out_dir: Path, sz: Sizes, good: list[dict], qual: list[dict]) -> None:
    """The page: setup, tables, goals, headline numbers, notes, and ``elastic.png`` in ``out_dir``."""
    report(res, sz, good, qual)
    notes(res, sz, good, qual)
    plot(res, out_dir, good, qual, sz)


def _measure(work: Path, sz: Sizes, quick: bool) -> tuple[list[dict], list[dict]]:
    """Every variant: the goodput runs (parts 1 and 2), then the quality runs (part 3)."""
    data = work / "data"
    prepare(data, [*REGIONS, HELDOUT], "python-stdlib", DATA_BYTES)
    g_cfg = train_config(
        work / "goodput.yaml",
        steps=sz.g_steps,
        model=sz.g_model,
        batch=sz.g_batch,
        data_dir=data,
        ckpt_every=sz.g_ckpt_every,
        warmup=10,
    )
    q_cfgs = {seed: quality_config(work, data, sz, seed) for seed in sz.q_seeds}
    plan = _goodput_plan(sz)
    tasks = [lambda m=m, g=g, h=h: _goodput(work, data, g_cfg, sz, m, g, h) for m, g, h in plan]
    tasks += _quality_tasks(work, data, q_cfgs, sz)
    if quick:  # correctness only: every variant at once (timings of a quick run mean nothing)
        with ThreadPoolExecutor(len(tasks)) as pool:
            results = list(pool.map(lambda f: f(), tasks))
    else:  # one at a time: the goodput runs measure wall time
        results = [f() for f in tasks]
    return results[: len(plan)], results[len(plan) :]


def _goodput_plan(sz: Sizes) -> list[tuple[str, float, float | None]]:
    """The goodput variants: (mode, grace_s, heartbeat_s)."""
    hb = sz.g_heartbeat_s
    plan = [("none", sz.g_grace_s, hb)] if sz.g_baseline else []
    plan += [("crash", sz.g_grace_s, hb)]
    plan += [("crash", sz.g_grace_s, None)] if sz.g_no_heartbeat else []
    plan += [("stop", sz.g_grace_s, hb)] if sz.g_stop else []
    plan += [("strict", sz.g_grace_s, None)]
    return plan


def _quality_tasks(work: Path, data: Path, q_cfgs: dict[int, Path], sz: Sizes) -> list[Callable[[], dict]]:
    """The quality variants, in the page's order."""
    seed0 = sz.q_seeds[0]

    def quality(absent: int | None, at_end: bool = False, seed: int = seed0, withhold: bool = False) -> dict:
        return _quality(work, data, q_cfgs[seed], sz, absent, at_end, seed, withhold)

    tasks: list[Callable[[], dict]] = []
    q25 = min((a for a in sz.q_absent if a), key=lambda a: abs(a / (sz.q_steps // sz.q_h) - 0.25))
    for seed in sz.q_seeds:  # always present, ~25% away and its control: once per seed; the rest once
        tasks += [
            lambda a=a, seed=seed: quality(a, seed=seed)
            for a in sz.q_absent
            if seed == seed0 or a in (0, q25)
        ]
        tasks += [lambda seed=seed: quality(sz.q_withhold, seed=seed, withhold=True)] if sz.q_withhold else []
    tasks += [lambda: quality(sz.q_end, True)] if sz.q_end else []
    tasks += [lambda: quality(None)] if sz.q_alone else []
    return tasks


def _goodput(
    work: Path, data: Path, cfg: Path, sz: Sizes, mode: str, grace: float, heartbeat: float | None
) -> dict:
    t0 = time.monotonic()
    out = goodput_variant(work, data, cfg, sz, mode, grace, heartbeat)
    print(f"  elastic: goodput, {label(out)}: {time.monotonic() - t0:.0f} s", flush=True)
    return out


def _quality(
    work: Path, data: Path, cfg: Path, sz: Sizes, absent: int | None, at_end: bool, seed: int, withhold: bool
) -> dict:
    t0 = time.monotonic()
    v = quality_variant(work, data, cfg, sz, absent, at_end, seed, withhold)
    v["loss"] = heldout_loss(
        v["model"], {**sz.q_model, "dropout": 0.0}, data / f"{HELDOUT}.bin", sz.q_eval_windows
    )
    print(f"  elastic: quality, {qlabel(v)}: {time.monotonic() - t0:.0f} s", flush=True)
    return v
