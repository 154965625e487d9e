"""``bench elastic``: what a variant measured, from the regions' metrics (survivor a's goodput and waits;
the rounds b missed in a quality run)."""

from __future__ import annotations

import statistics
from pathlib import Path

from .finalmodel import same_params
from .rundir import Watch, read_records, step_records


def goodput_stats(name: str, recs: list[dict], watch: Watch) -> dict:
    """Survivor a's goodput and waits from its metrics.jsonl (see the setup notes for the definitions)."""
    steps = step_records(recs)
    rounds = [r for r in steps if "xr_round" in r]
    align = [r for r in recs if r.get("event") == "xr_align"]
    leaves = [r for r in recs if r.get("event") == "xr_leave"]
    if not align or not leaves or leaves[-1].get("reason") != "finished":
        raise RuntimeError(f"{name}: a's metrics lack xr_align or the final xr_leave")
    t0, t1 = align[0]["time"], leaves[-1]["time"]
    wall = t1 - t0
    step_s = sum(r["step_time_s"] for r in steps)
    wait_s = sum(r["xr_wait_s"] for r in rounds)
    missed = [r for r in rounds if "b" in r["xr_absent"]]
    waits = [r["xr_wait_s"] for r in missed]
    nan = float("nan")
    return {
        "t0": t0,
        "wall_s": wall,
        "step_s": step_s,
        "wait_s": wait_s,
        "train_s": step_s - wait_s,
        "outside_s": wall - step_s,
        "goodput": (step_s - wait_s) / wall,
        "rounds": len(rounds),
        "missed": len(missed),
        "missed_wait_s": sum(waits),
        "wait_max": max(waits) if waits else nan,
        "wait_median": statistics.median(waits) if waits else nan,
        "steps": len(steps),
        "timeline": [(t - t0, r["step"]) for t, r in watch.seen],
        "round_waits": [(r["xr_round"], r["xr_wait_s"], "b" in r["xr_members"]) for r in rounds],
        "missed_closes": [(r["xr_round"], r["xr_close_reason"], r["xr_wait_s"]) for r in missed],
        "round_s": round_times(steps),
    }


def round_times(steps: list[dict]) -> list[float]:
    """Seconds of a's steps per round, the round's own exchange left out (only complete rounds)."""
    out, acc = [], 0.0
    for r in steps:
        acc += r["step_time_s"] - r.get("xr_total_s", 0.0)
        if "xr_round" in r:
            out.append(acc)
            acc = 0.0
    return out


def quality_figures(
    root: Path, name: str, n_rounds: int, absent: int | None, at_end: bool, seed: int, withheld: list[int]
) -> dict:
    """A quality run's rounds from a's metrics: which b missed, both regions' steps, and whether they
    ended on the same model (not for a b that left for good: it keeps its older model)."""
    rounds = [r for r in step_records(read_records(root / "a")) if "xr_round" in r]
    if [r["xr_round"] for r in rounds] != list(range(1, n_rounds + 1)):
        raise RuntimeError(f"{name}: a's rounds are {[r['xr_round'] for r in rounds]}")
    missed = [r["xr_round"] for r in rounds if "b" not in r["xr_members"]] if absent is not None else []
    b_steps = len(step_records(read_records(root / "b"))) if absent is not None else 0
    out = {
        "name": name,
        "absent": absent,
        "at_end": at_end,
        "withhold": withheld,
        "seed": seed,
        "rounds": len(rounds),
        "missed": missed,
        "b_steps": b_steps,
        "a_steps": len(step_records(read_records(root / "a"))),
        "model": root / "a" / "model.safetensors",
    }
    out["same"] = (
        same_params(root / "a" / "model.safetensors", root / "b" / "model.safetensors")
        if absent is not None and not at_end
        else None
    )  # (b that left for good keeps its older model)
    return out
