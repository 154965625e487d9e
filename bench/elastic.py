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
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sbatch_gen.testing.regions import RegionRun
from sbatch_gen.train.data import prepare
from sbatch_gen.train.signals import ack_path
from sbatch_gen.train.xr.protocol import round_tag
from sbatch_gen.xr_options import CrossRegion, FsTransport

from .common import Result, fmt
from .finalmodel import heldout_loss, same_params
from .regionruns import (
    DATA_BYTES,
    HELDOUT,
    OUTER_LR,
    OUTER_MOMENTUM,
    REGIONS,
    TIMEOUT,
    finish,
    launch_region,
    train_config,
)
from .rundir import Watch, read_records, read_summary, step_records

POLL_S = 1.0  # OuterSync's poll_max_s: the longest sleep between two polls of the mailbox ("one poll")


@dataclass(frozen=True)
class Sizes:
    # part 3: quality
    q_steps: int
    q_h: int
    q_first: int  # rounds both regions train before b leaves
    q_absent: tuple[int, ...]  # rounds b misses, one variant each (0 = always present)
    q_alone: bool  # also a 1-region run (b absent from every round)
    q_end: int  # also b leaving for good this many rounds before the end (0: skip)
    q_withhold: int  # control: b stays but publishes nothing in this many rounds from q_first+1 (0: skip)
    q_seeds: tuple[
        int, ...
    ]  # always present, ~25% away and the control run once per seed (the rest: the first)
    q_model: dict
    q_batch: int
    q_eval_windows: int
    # parts 1 and 2: idle and goodput
    g_steps: int
    g_h: int
    g_sleep_s: float  # per-step pacing (stands in for compute)
    g_leave_round: int  # b goes once this round is committed
    g_away_s: float  # ... and is started again this long after
    g_grace_s: float
    g_heartbeat_s: float  # the elastic variants' heartbeat_s (crash detection)
    g_no_heartbeat: bool  # also the crash with heartbeats off
    g_stop: bool  # also the planned-stop run
    g_baseline: bool  # also a run in which b never leaves
    g_strict_timeout_s: float
    g_ckpt_every: int
    g_snapshot_every: int
    g_keep_rounds: int
    g_model: dict
    g_batch: int


FULL = Sizes(
    q_steps=600,
    q_h=30,
    q_first=5,
    q_absent=(0, 5, 10),
    q_alone=True,
    q_end=5,
    q_withhold=5,
    q_seeds=(1234, 99),
    q_model={"n_layers": 2, "d_model": 128, "n_heads": 4, "seq_len": 64},
    q_batch=8,
    q_eval_windows=1024,
    g_steps=360,
    g_h=20,
    g_sleep_s=0.2,
    g_leave_round=4,
    g_away_s=22.0,
    g_grace_s=2.7,
    g_heartbeat_s=0.45,
    g_no_heartbeat=True,
    g_stop=True,
    g_baseline=True,
    g_strict_timeout_s=20.0,
    g_ckpt_every=60,
    g_snapshot_every=5,
    g_keep_rounds=4,
    g_model={"n_layers": 1, "d_model": 64, "n_heads": 2, "seq_len": 32},
    g_batch=4,
)
QUICK = Sizes(
    q_steps=12,
    q_h=2,
    q_first=1,
    q_absent=(0, 3),
    q_alone=False,
    q_end=0,
    q_withhold=2,
    q_seeds=(1234,),
    q_model={"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16},
    q_batch=2,
    q_eval_windows=32,
    g_steps=40,
    g_h=4,
    g_sleep_s=0.05,
    g_leave_round=2,
    g_away_s=2.0,
    g_grace_s=0.5,
    g_heartbeat_s=0.1,
    g_no_heartbeat=False,
    g_stop=False,
    g_baseline=False,
    g_strict_timeout_s=30.0,
    g_ckpt_every=4,
    g_snapshot_every=2,
    g_keep_rounds=1,
    g_model={"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16},
    g_batch=2,
)


# ---------------------------------------------------------------------------------------------------
# Parts 1 and 2: survivor idle time and goodput under a scripted absence of b


def _goodput_variant(
    work: Path, data: Path, cfg: Path, sz: Sizes, mode: str, grace_s: float, heartbeat_s: float | None
) -> dict:
    """mode: none (b stays), crash | stop (elastic, min_regions 1), or strict (min_regions all, b crashes)."""
    name = f"g-{mode}-{grace_s:g}-{heartbeat_s or 0:g}".replace(".", "_")
    root = work / name
    strict = mode == "strict"
    stop = root / "b.stop"
    presence = root / "mailbox" / name / "_presence" / "b.json"
    env = {"SBATCH_GEN_STEP_SLEEP_S": repr(sz.g_sleep_s)}

    def launch(region: str, resume: str) -> RegionRun:
        xr = CrossRegion(
            enabled=True,
            run_id=name,
            region=region,
            regions=REGIONS,
            sync="diloco",
            inner_steps=sz.g_h,
            outer_lr=OUTER_LR,
            outer_momentum=OUTER_MOMENTUM,
            transport=FsTransport(root=str(root / "mailbox")),
            threads=4,
            min_regions="all" if strict else 1,
            grace_s=grace_s,
            heartbeat_s=heartbeat_s,
            timeout_s=sz.g_strict_timeout_s if strict else 600,
            snapshot_every=sz.g_snapshot_every,
            keep_rounds=sz.g_keep_rounds,
        )
        extra = ["--stop-file", str(stop)] if (region == "b" and mode == "stop") else []
        return launch_region(
            xr,
            config=cfg,
            run_dir=root / region,
            data=data,
            resume=resume,
            env=env,
            log_dir=root / "logs",
            extra=extra,
        )

    a, b = launch("a", "none"), launch("b", "none")
    started = [a, b]
    watch = Watch(root / "a" / "metrics.jsonl")
    commit = root / "mailbox" / name / round_tag(sz.g_leave_round) / "_commit.json"
    deadline = time.monotonic() + TIMEOUT
    attempts = {"a": 1, "b": 1}
    t_gone = t_back = t_joined = float("nan")
    try:
        if mode == "none":
            live = {"a": a, "b": b}
            back = True
        else:
            while not commit.exists():
                for r in (a, b):
                    if r.poll()[0] is not None:
                        raise RuntimeError(
                            f"{name}: {r.region} exited before round {sz.g_leave_round}:\n{r.tail()}"
                        )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: round {sz.g_leave_round} never committed")
                watch.poll()
                time.sleep(0.01)
            t_gone = time.time()
            if mode == "stop":
                stop.touch()
            else:
                b.kill()
            t_back = t_gone + sz.g_away_s
            live = {"a": a}  # region -> its running process
            back = False
        while True:
            watch.poll()
            if not back and time.time() >= t_back:
                if mode == "stop":
                    b.wait(TIMEOUT)
                    if read_summary(root / "b").get("exit") != "stopped":
                        raise RuntimeError(f"{name}: b did not stop through its stop file:\n{b.tail()}")
                    stop.unlink()
                    ack_path(stop).unlink(missing_ok=True)
                live["b"] = launch("b", "auto")
                started.append(live["b"])
                back = True
            if back and t_joined != t_joined:  # b's presence record says it has joined the run again
                try:
                    p = json.loads(presence.read_text())
                    if p.get("state") == "joined" and p["time"] > t_gone:
                        t_joined = p["time"]
                except (OSError, ValueError, KeyError):
                    pass
            for region, r in list(live.items()):
                rc = r.poll()[0]
                if rc is None:
                    continue
                ex = read_summary(root / region).get("exit")
                if strict and ex == "no_quorum" and attempts[region] < 30:
                    live[region] = launch(region, "auto")  # requeued at once (no queue wait)
                    started.append(live[region])
                    attempts[region] += 1
                elif rc == 0 and ex == "completed":
                    del live[region]
                else:
                    raise RuntimeError(f"{name}: {region} exited {rc} ({ex}):\n{r.tail()}")
            if not live:
                if not back:
                    raise RuntimeError(
                        f"{name}: a finished before b was restarted: lengthen the run or shorten away_s"
                    )
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: the regions did not finish in {TIMEOUT} s")
            time.sleep(0.05)
    finally:
        for r in started:
            if r.poll()[0] is None:
                r.kill()
    watch.poll()
    g = _goodput_stats(root, name, read_records(root / "a"), watch)
    b_recs = read_records(root / "b")
    b_rounds = [r for r in step_records(b_recs) if "xr_round" in r]
    rejoin = [r["time"] for r in b_recs if r.get("event") == "xr_rejoin" and r["time"] > t_gone]
    if rejoin:  # b's own record of its fast-forward (its presence says "joined" right after)
        t_joined = rejoin[0]
    g.update(
        mode=mode,
        grace_s=grace_s,
        heartbeat_s=heartbeat_s,
        requeues=(attempts["a"] - 1, attempts["b"] - 1),
        away_s=t_joined - t_gone,
        gone_at=t_gone - g["t0"],
        restart_at=t_back - g["t0"],
        back_at=t_joined - g["t0"],
        b_late=sum(1 for r in b_rounds if r.get("xr_late") and r["xr_round"] > sz.g_leave_round),
    )
    g["away_share"] = g["away_s"] / g["wall_s"]
    return g


def _goodput_stats(root: Path, name: str, recs: list[dict], watch: Watch) -> dict:
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
        "round_s": _round_times(steps),
    }


def _round_times(steps: list[dict]) -> list[float]:
    """Seconds of a's steps per round, the round's own exchange left out (only complete rounds)."""
    out, acc = [], 0.0
    for r in steps:
        acc += r["step_time_s"] - r.get("xr_total_s", 0.0)
        if "xr_round" in r:
            out.append(acc)
            acc = 0.0
    return out


# ---------------------------------------------------------------------------------------------------
# Part 3: quality with b absent from a share of the rounds


Q_GRACE_S = (
    60.0  # quality runs: a returning b that has joined is always waited for (rounds never close on time)
)
Q_WITHHOLD_GRACE_S = 2.0  # the control: a closes the rounds b withholds after this (b is there, just silent)


def _quality_variant(
    work: Path,
    data: Path,
    cfg: Path,
    sz: Sizes,
    absent: int | None,
    at_end: bool = False,
    seed: int = 0,
    withhold: bool = False,
) -> dict:
    """absent: rounds b is to miss from round q_first+1 on, or None for a 1-region run of a; ``at_end``: b
    misses the last ``absent`` rounds instead (it leaves for good, no return); ``withhold``: the control, b
    stays in the run and trains every step but publishes nothing in those rounds
    (``SBATCH_GEN_XR_WITHHOLD_ROUNDS``), so its tokens there are lost as if it were away, without a leave, a
    restart or a rejoin. ``seed``: the config's train.seed (for the name; ``cfg`` carries it).

    One process of a trains the whole run (min_regions 1, grace_s 60: while b is in the run, every round
    waits for it). b ends after round q_first (``--max-steps``: its leave is on record, a's rounds close at
    once without it) and is started again (``--resume auto``) timed so that it joins during round
    q_first+absent: then it fast-forwards to the run's step, finishes that round with a, and takes part
    from the next. Which round it first takes part in depends on its start-up time (+-1 round); the rounds
    it really missed are read from a's metrics."""
    name = (
        "q-alone"
        if absent is None
        else f"q-{'end-' if at_end else ''}{'withhold-' if withhold else ''}{absent}"
    )
    name += f"-s{seed}" if seed else ""
    root = work / name
    h = sz.q_h
    n_rounds = sz.q_steps // h
    regions = ["a"] if absent is None else REGIONS

    def launch(region: str, max_steps: int | None = None, resume: str = "none") -> RegionRun:
        xr = CrossRegion(
            enabled=True,
            run_id=name,
            region=region,
            regions=regions,
            sync="diloco",
            inner_steps=h,
            outer_lr=OUTER_LR,
            outer_momentum=OUTER_MOMENTUM,
            transport=FsTransport(root=str(root / "mailbox")),
            threads=4,
            min_regions=1 if len(regions) > 1 else "all",
            grace_s=Q_WITHHOLD_GRACE_S if withhold else Q_GRACE_S,
            timeout_s=600,
            snapshot_every=5 if n_rounds >= 5 else 1,
            keep_rounds=4,
        )
        env = None
        if withhold and region == "b":
            from sbatch_gen.train.xr.exchange import ENV_WITHHOLD_ROUNDS

            rounds = range(sz.q_first + 1, sz.q_first + absent + 1)
            env = {ENV_WITHHOLD_ROUNDS: ",".join(map(str, rounds))}
        return launch_region(
            xr,
            config=cfg,
            run_dir=root / region,
            data=data,
            max_steps=max_steps,
            resume=resume,
            log_dir=root / "logs",
            env=env,
        )

    if absent is None:
        finish([launch("a")], name)
    elif not absent or withhold:
        finish([launch("a"), launch("b")], name)
    elif at_end:
        finish([launch("a"), launch("b", max_steps=(n_rounds - absent) * h)], name)
    else:
        r1, r2 = sz.q_first, sz.q_first + absent
        a = launch("a")
        try:
            finish([launch("b", max_steps=r1 * h)], name)
            startup = float(read_summary(root / "b").get("startup_to_first_step_s") or 0.0)
            seen: dict[int, float] = {}  # round -> when its commit appeared
            deadline = time.monotonic() + TIMEOUT
            while True:
                if (
                    a.poll()[0] is not None
                ):  # a has finished (tiny --quick runs): b comes back to a finished run
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: a's rounds did not advance")
                for r in range(max(seen, default=r1) + 1, n_rounds + 1):
                    if not (root / "mailbox" / name / round_tag(r) / "_commit.json").exists():
                        break
                    seen[r] = time.monotonic()
                latest = max(seen, default=r1)
                if len(seen) >= 2:  # a's pace alone -> how many rounds b's start-up takes
                    round_s = (seen[latest] - seen[min(seen)]) / (latest - min(seen))
                    if latest >= r2 - int(startup / max(round_s, 1e-3)):
                        break
                elif latest >= r2 - 1:
                    break
                time.sleep(0.01)
            finish([a, launch("b", resume="auto")], name)
        finally:
            if a.poll()[0] is None:
                a.kill()
    rounds = [r for r in step_records(read_records(root / "a")) if "xr_round" in r]
    if [r["xr_round"] for r in rounds] != list(range(1, n_rounds + 1)):
        raise RuntimeError(f"{name}: a's rounds are {[r['xr_round'] for r in rounds]}")
    missed = [r["xr_round"] for r in rounds if "b" not in r["xr_members"]] if absent is not None else []
    b_steps = len(step_records(read_records(root / "b"))) if absent is not None else 0
    withheld = list(range(sz.q_first + 1, sz.q_first + absent + 1)) if withhold else []
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


# ---------------------------------------------------------------------------------------------------


def run(out_dir: Path, quick: bool = False) -> Result:
    sz = QUICK if quick else FULL
    res = Result(
        "elastic",
        "Elastic cross-region rounds: survivor idle time, goodput and quality while a region is away",
        quick,
    )
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-elastic-"))
    try:
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
        q_cfgs = {
            seed: train_config(
                work / f"quality-{seed}.yaml",
                steps=sz.q_steps,
                model=sz.q_model,
                batch=sz.q_batch,
                data_dir=data,
                ckpt_every=10 * sz.q_steps,
                warmup=20,
                seed=seed,
            )
            for seed in sz.q_seeds
        }
        seed0 = sz.q_seeds[0]
        hb = sz.g_heartbeat_s
        plan = [("none", sz.g_grace_s, hb)] if sz.g_baseline else []
        plan += [("crash", sz.g_grace_s, hb)]
        plan += [("crash", sz.g_grace_s, None)] if sz.g_no_heartbeat else []
        plan += [("stop", sz.g_grace_s, hb)] if sz.g_stop else []
        plan += [("strict", sz.g_grace_s, None)]

        def goodput(mode: str, grace: float, heartbeat: float | None) -> dict:
            t0 = time.monotonic()
            out = _goodput_variant(work, data, g_cfg, sz, mode, grace, heartbeat)
            print(f"  elastic: goodput, {_label(out)}: {time.monotonic() - t0:.0f} s", flush=True)
            return out

        def quality(
            absent: int | None, at_end: bool = False, seed: int = seed0, withhold: bool = False
        ) -> dict:
            t0 = time.monotonic()
            v = _quality_variant(work, data, q_cfgs[seed], sz, absent, at_end, seed, withhold)
            v["loss"] = heldout_loss(
                v["model"], {**sz.q_model, "dropout": 0.0}, data / f"{HELDOUT}.bin", sz.q_eval_windows
            )
            print(f"  elastic: quality, {_qlabel(v)}: {time.monotonic() - t0:.0f} s", flush=True)
            return v

        tasks = [lambda m=m, g=g, h=h: goodput(m, g, h) for m, g, h in plan]
        q25 = min((a for a in sz.q_absent if a), key=lambda a: abs(a / (sz.q_steps // sz.q_h) - 0.25))
        for seed in sz.q_seeds:  # always present, ~25% away and its control: once per seed; the rest once
            tasks += [
                lambda a=a, seed=seed: quality(a, seed=seed)
                for a in sz.q_absent
                if seed == seed0 or a in (0, q25)
            ]
            tasks += (
                [lambda seed=seed: quality(sz.q_withhold, seed=seed, withhold=True)] if sz.q_withhold else []
            )
        tasks += [lambda: quality(sz.q_end, True)] if sz.q_end else []
        tasks += [lambda: quality(None)] if sz.q_alone else []
        if quick:  # correctness only: every variant at once (timings of a quick run mean nothing)
            with ThreadPoolExecutor(len(tasks)) as pool:
                results = list(pool.map(lambda f: f(), tasks))
        else:  # one at a time: the goodput runs measure wall time
            results = [f() for f in tasks]
        good, qual = results[: len(plan)], results[len(plan) :]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(res, sz, good, qual)
    _plot(res, out_dir, good, qual, sz)
    return res


def _label(g: dict) -> str:
    if g["mode"] == "none":
        return "elastic, b stays (baseline)"
    if g["mode"] == "strict":
        return "strict (min_regions all), b crashes"
    hb = f"heartbeat {g['heartbeat_s']:g} s" if g["heartbeat_s"] else "heartbeats off"
    return f"elastic, b {'crashes' if g['mode'] == 'crash' else 'stops (stop file)'}, grace_s {g['grace_s']:g}, {hb}"


def _qlabel(q: dict) -> str:
    if q["absent"] is None:
        return "a alone (1-region run)"
    if q.get("withhold"):
        return f"b stays, publishes nothing in rounds {q['withhold'][0]}-{q['withhold'][-1]} (control)"
    if not q["absent"]:
        return "always present"
    if q["at_end"]:
        return f"b leaves for good after round {q['rounds'] - q['absent']}"
    return f"b leaves after round {q['missed'][0] - 1 if q['missed'] else '?'}, then back"


def _max_share(loss: float, grace_s: float, round_s: float) -> float:
    """Largest share f of the rounds b may miss (crash) with a's idle share f*g/(T + f*g) <= loss."""
    return loss * round_s / (grace_s * (1 - loss)) if loss > 0 else 0.0


def _report(res: Result, sz: Sizes, good: list[dict], qual: list[dict]) -> None:
    g_round_s = sz.g_h * sz.g_sleep_s
    n_rounds = sz.g_steps // sz.g_h
    res.setup += [
        "2 regions (a, b), each one process of the real trainer (`python -m sbatch_gen.train`, gloo, CPU; no "
        "torchrun: a 1-process region needs no agent), meeting only in an fs mailbox (local directory). DiLoCo "
        f"with plain averaging (outer lr {OUTER_LR:g}, momentum {OUTER_MOMENTUM:g}) in every variant: over a few "
        "hundred steps from scratch the defaults (0.7, Nesterov 0.9) train worse (bench/diloco.py). Data: the "
        f"stdlib source cut into three shards (a, b, {HELDOUT}; `sbatch_gen.train.data.prepare`, "
        f"{DATA_BYTES / 1e6:g} MB); each region trains on its own, nobody on `{HELDOUT}`.",
        f"Parts 1-2 (idle, goodput): {sz.g_steps} steps, H={sz.g_h} ({n_rounds} rounds), a "
        f"{sz.g_model['n_layers']}-layer width-{sz.g_model['d_model']} GPT paced to >= {sz.g_sleep_s:g} s per "
        f"step (`SBATCH_GEN_STEP_SLEEP_S`, standing in for GPU compute), so a round is ~{g_round_s:g} s of "
        f"steps. grace_s {sz.g_grace_s:g} = {sz.g_grace_s / g_round_s:.0%} of that (the eu/us sites: grace_s 30 "
        f"to ~45 s rounds, 67%, sites/_base/llm-xr-1.yaml); heartbeat_s {sz.g_heartbeat_s:g} = "
        f"{sz.g_heartbeat_s / g_round_s:.0%} of a round (the sites: 5 s, 11%), so a region whose heartbeat "
        f"stands still for 3 beats ({3 * sz.g_heartbeat_s:g} s on a's clock) counts as gone"
        + (
            "; a second crash run has heartbeats off (heartbeat_s null: a waits grace_s in every round b misses)"
            if sz.g_no_heartbeat
            else ""
        )
        + f". snapshot_every {sz.g_snapshot_every}, keep_rounds "
        f"{sz.g_keep_rounds} (the sites' values), checkpoints every {sz.g_ckpt_every} steps.",
        f"Schedule (every goodput variant but the baseline): both start; once round {sz.g_leave_round} is "
        "committed, b is SIGKILLed (crash: nothing tells a) or its stop file is created (planned stop: b "
        f"checkpoints, announces its leave in the mailbox, exits 42); {sz.g_away_s:g} s later b is started again "
        "with `--resume auto` and fast-forwards to the run. Strict: min_regions all, timeout_s "
        f"{sz.g_strict_timeout_s:g}; a region whose round finds no quorum exits 42 and is started again at once "
        "(a requeue without queue time), until b is back. b away: from its kill/stop to its presence record "
        "saying it joined again (fast-forward done).",
        "Goodput of the survivor a = (sum of a's `step_time_s` - sum of a's `xr_wait_s`) / W, where W is a's "
        "wall time from its `xr_align` event (training starts) to its final `xr_leave` (finished): the share of "
        "the window a spent in steps and not waiting for b in rounds. Lost: waits in rounds, and everything "
        "outside steps (checkpoint saves, metrics; for strict the blocked round, exits and restarts). The round's "
        "own exchange (upload, download, average) counts as training, as in every DiLoCo run.",
        f"Part 3 (quality): {sz.q_steps} steps, H={sz.q_h} ({sz.q_steps // sz.q_h} rounds), a "
        f"{sz.q_model['n_layers']}-layer width-{sz.q_model['d_model']} GPT, batch {sz.q_batch} x "
        f"{sz.q_model['seq_len']} tokens, not paced. One process of a trains all of it (min_regions 1, "
        f"grace_s {Q_GRACE_S:g}: while b is in the run every round waits for it, none closes on a timer). b ends "
        f"after round {sz.q_first} (`--max-steps`: its leave is on record, a's rounds then close at once) and is "
        "started again (`--resume auto`), timed from its start-up and a's pace to join during the round that "
        "leaves it away for 25% / 50% of the rounds; it fast-forwards to the run's step and continues from its "
        "own data position and optimizer state. Which round it first takes part in depends on its start-up "
        "(+-1 round): the table gives the rounds it really missed, from a's metrics. a's steps and LR schedule "
        "are the same in every variant; b trains fewer steps."
        + (
            f" Controls: b leaving for good {sz.q_end} rounds before the end (no return; deterministic), and a "
            "alone (b absent from every round)."
            if sz.q_end
            else ""
        ),
        f"Held-out loss: the final `model.safetensors` (a's; b's is checked bit-identical) evaluated in the bench "
        f"process on CPU, mean next-byte cross-entropy over {sz.q_eval_windows} fixed windows of "
        f"{sz.q_model['seq_len']} tokens spread evenly over the `{HELDOUT}` shard.",
    ]
    rows = []
    for g in good:
        away = f"{g['away_s']:.0f} s ({g['away_share']:.0%})" if g["away_s"] == g["away_s"] else "-"
        rows.append(
            [
                _label(g),
                g["rounds"],
                f"{g['missed']} ({g['missed'] / g['rounds']:.0%})",
                g["b_late"] if g["mode"] != "none" else "-",
                away,
                g["wait_max"],
                g["wait_median"],
                g["wait_s"],
                g["missed_wait_s"],
                g["outside_s"],
                g["wall_s"],
                f"{g['goodput']:.1%}",
                "{}, {}".format(*g["requeues"]),
            ]
        )
    res.table(
        "Survivor a: idle time and goodput (parts 1 and 2)",
        [
            "variant",
            "a's rounds",
            "rounds b missed",
            "of which b back but late",
            "b away (share of W)",
            "wait max s (missed rounds)",
            "wait median s (missed)",
            "a's waits in rounds s",
            "... in missed rounds s",
            "outside steps s",
            "W s",
            "goodput",
            "requeues (a, b)",
        ],
        rows,
        "goodput",
    )
    n = max(len(g["round_waits"]) for g in good)
    prow = []
    for i in range(1, n + 1):
        row: list = [i]
        for g in good:
            w = {r: (x, m) for r, x, m in g["round_waits"]}.get(i)
            row.append("-" if w is None else f"{w[0]:.2f}" + ("" if w[1] else " (b out)"))
        prow.append(row)
    res.table(
        "a's wait for b per round, s ('b out': closed without b; '-': no step record, see notes)",
        ["round", *[_label(g) for g in good]],
        prow,
        "rounds",
    )

    bases = {q["seed"]: q for q in qual if q["absent"] == 0 and not q["withhold"]}

    def gap(q: dict) -> float:  # against always present with the same seed
        return q["loss"] / bases[q["seed"]]["loss"] - 1

    qrows = []
    for q in qual:
        share = f"{len(q['missed']) / q['rounds']:.0%}" if q["absent"] is not None else "100%"
        qrows.append(
            [
                _qlabel(q),
                q["seed"],
                share,
                ",".join(map(str, q["missed"])) if q["missed"] else "-",
                q["a_steps"],
                q["b_steps"],
                q["loss"],
                f"{gap(q):+.2%}",
                "-" if q["same"] is None else q["same"],
            ]
        )
    res.table(
        "Quality: final held-out loss, same step budget (part 3)",
        [
            "variant",
            "seed",
            "rounds b missed",
            "which",
            "a's steps",
            "b's steps",
            "held-out loss",
            "vs always present (same seed)",
            "a == b bitwise",
        ],
        qrows,
        "quality",
    )

    # goals
    elastic = [g for g in good if g["mode"] in ("crash", "stop")]
    for g in elastic:
        ok = g["wait_max"] <= g["grace_s"] + POLL_S if g["missed"] else None
        res.goal(
            f"survivor's wait per missed round <= grace_s + one poll ({g['grace_s']:g} + {POLL_S:g} s), "
            f"{_label(g)}",
            f"max {fmt(g['wait_max'])} s, median {fmt(g['wait_median'])} s over {g['missed']} rounds",
            ok,
        )
    for g in elastic:  # (the crash with heartbeats off is the comparison: reported, not a goal)
        compare = g["mode"] == "crash" and not g["heartbeat_s"]
        res.goal(
            f"goodput >= 95%, {_label(g)}" + (" (comparison)" if compare else ""),
            f"{g['goodput']:.1%} (b missed {g['missed']} of {g['rounds']} rounds, away {fmt(g['away_s'])} s "
            f"of W {g['wall_s']:.0f} s)",
            None if compare else g["goodput"] >= 0.95,
        )
    strict = next(g for g in good if g["mode"] == "strict")
    res.goal(
        "goodput, strict (min_regions all, today's behaviour), same schedule",
        f"{strict['goodput']:.1%} (a requeued {strict['requeues'][0]}x, b {strict['requeues'][1]}x; "
        f"W {strict['wall_s']:.0f} s)",
        None,
    )
    mids = [q for q in qual if q["absent"] and not q["at_end"] and not q["withhold"]]
    n25 = min({q["absent"] for q in mids}, key=lambda a: abs(a / (sz.q_steps // sz.q_h) - 0.25), default=None)
    q25s = [q for q in mids if q["absent"] == n25]
    controls = [q for q in qual if q["withhold"]]
    if q25s:
        d = statistics.mean(gap(q) for q in q25s)
        res.goal(
            "held-out loss with b absent from ~25% of the rounds (and back) <= +1% vs always present"
            + (f" (mean over {len(q25s)} seeds)" if len(q25s) > 1 else ""),
            f"{d:+.2%} ("
            + "; ".join(
                f"seed {q['seed']}: {gap(q):+.2%}, b missed {len(q['missed'])} of {q['rounds']} rounds"
                for q in q25s
            )
            + ")",
            d <= 0.01,
        )
    if controls:
        dc = statistics.mean(gap(q) for q in controls)
        res.goal(
            "the same rounds' tokens lost without any leave or rejoin (control: b stays, publishes nothing "
            "there)" + (f", mean over {len(controls)} seeds" if len(controls) > 1 else ""),
            f"{dc:+.2%} ("
            + "; ".join(f"seed {q['seed']}: {gap(q):+.2%}, {len(q['missed'])} rounds" for q in controls)
            + ")",
            None,
        )

    # headline
    for g in good:
        res.headline[f"survivor goodput, {_label(g)}"] = f"{g['goodput']:.1%}" + (
            f" (b missed {g['missed'] / g['rounds']:.0%} of the rounds)" if g["missed"] else ""
        )
    crash = next(g for g in good if g["mode"] == "crash" and g["heartbeat_s"])
    off = next((g for g in good if g["mode"] == "crash" and not g["heartbeat_s"]), None)
    res.headline["survivor wall time for the same steps, strict vs elastic crash"] = (
        f"{strict['wall_s'] / crash['wall_s']:.2f}x"
    )
    for g in (crash, off) if off is not None else (crash,):
        res.headline[f"max wait per missed round, {_label(g)}"] = f"{g['wait_max']:.2f} s"
    for q in qual:
        if q["absent"]:
            seed = f", seed {q['seed']}" if q["seed"] != sz.q_seeds[0] else ""
            res.headline[
                f"held-out loss, {_qlabel(q)} ({len(q['missed']) / q['rounds']:.0%} of rounds{seed})"
            ] = f"{gap(q):+.2%}"

    # notes
    round_s = statistics.median([r for g in good for r in g["round_s"]] or [float("nan")])
    baseline = next((g for g in good if g["mode"] == "none"), None)
    base_loss = 1 - baseline["goodput"] if baseline else 0.0
    budget = 0.05 - base_loss
    closes = crash["missed_closes"]
    by_reason = {why: [w for _, y, w in closes if y == why] for why in dict.fromkeys(y for _, y, _ in closes)}
    res.notes.append(
        (
            f"Crash with heartbeats (every {crash['heartbeat_s']:g} s): a reads b's heartbeat while it waits in a round "
            f"and, on its own clock, treats b as gone once the value has stood still for 3 beats "
            f"({3 * crash['heartbeat_s']:g} s of watching); it remembers what it saw, so only the first round after the "
            "crash waits for that, the next ones close at once. The rounds b missed closed as: "
            + "; ".join(
                f"{why} {len(ws)}x (wait max {max(ws):.2f} s, median {statistics.median(ws):.2f} s)"
                for why, ws in by_reason.items()
            )
            + "."
            + (
                " ('grace': b was beating again, restarted but not yet back in the rounds: a waits up to grace_s for a "
                "live region, as it should.)"
                if "grace" in by_reason
                else ""
            )
        )
        if closes
        else "Crash with heartbeats: b missed no round."
    )
    if off is not None:
        f_max = _max_share(budget, off["grace_s"], round_s)
        g_max = budget * round_s / (0.3 * (1 - budget)) if budget > 0 else 0.0
        if budget <= 0:
            res.notes.append(
                f"The baseline (b present) already loses {base_loss:.1%} of W: no room for a crash."
            )
        else:
            res.notes.append(
                f"Crash with heartbeats off: a cannot tell an absent region from a slow one, so each round b misses "
                f"costs a grace_s (median wait {off['wait_median']:.2f} s at grace_s {off['grace_s']:g}). A round "
                f"here is {round_s:.1f} s of a's steps (median)"
                + (
                    f" and a loses {base_loss:.1%} with b present (baseline: b's start-up lag in round 1, checkpoints)"
                    if baseline
                    else ""
                )
                + f", so >= 95% leaves {budget:.1%} for the crash: idle share f*g/(T + f*g) <= that allows b to miss "
                f"at most {f_max:.0%} of the rounds at grace_s {off['grace_s']:g} (the sites' ratio), or, for b "
                f"missing 30% of the rounds, grace_s <= {g_max:.2f} s ({g_max / round_s:.0%} of a round)."
            )
    stop = next((g for g in good if g["mode"] == "stop"), None)
    if stop is not None:
        back = [
            (r, w, m) for r, w, m in stop["round_waits"] if r > sz.g_leave_round and w > 0.5 * stop["grace_s"]
        ]
        res.notes.append(
            f"Planned stop: b's leave is on record in the mailbox and a's rounds close at once while b is away "
            f"(median wait {stop['wait_median']:.3f} s, max {stop['wait_max']:.3f} s). On its return b continues at "
            "the run's current step (estimated from the last rounds' close times), so its first round back ends "
            "about with a's"
            + (
                ": a's waits above grace_s/2 after b left: "
                + ", ".join(f"round {r} {w:.2f} s{'' if m else ' (b late, dropped)'}" for r, w, m in back)
                if back
                else "; no round after b left made a wait more than grace_s/2"
            )
            + "."
        )
    end = next((q for q in qual if q["at_end"]), None)
    if q25s and controls:
        d, dc = statistics.mean(gap(q) for q in q25s), statistics.mean(gap(q) for q in controls)
        steps_lost = statistics.mean(sz.q_steps - q["b_steps"] for q in q25s)
        in_missed = statistics.mean(len(q["missed"]) * sz.q_h for q in q25s)
        res.notes.append(
            f"What b's absence costs, separated by the control: b away for ~{n25} rounds mid-run and back costs "
            f"{d:+.2%} (mean over seeds; b trains {steps_lost:.0f} fewer steps, {in_missed:.0f} of them in the "
            f"rounds it missed, the rest its start-up: it continues at the run's step). The control loses b's "
            f"tokens in the same rounds with no leave, restart or rejoin (b trains every step, its deltas are "
            f"dropped): {dc:+.2%}. So about {dc / d:.0%} of the cost is the tokens b did not contribute, which no "
            "rejoin can give back; the leave-and-rejoin itself (fewer steps from start-up, optimizer moments from "
            f"before the absence) adds {d - dc:+.2%}."
            + (
                f" The tokens' position matters too: b missing the last {len(end['missed'])} rounds instead (lower "
                f"learning rate, {end['b_steps']} b-steps) costs {gap(end):+.2%}."
                if end is not None
                else ""
            )
        )
    res.notes += [
        "Strict: a's round waits for b until timeout_s, then a checkpoints and exits 42; each requeue pays the "
        "start-up again and re-enters the pending round at start-up (logged as an `xr_pending_round` event, not "
        "a step record: its time is in 'outside steps'). A timeout_s shorter than a start-up makes the two "
        "regions requeue each other in turn (the returning one finds the other restarting; seen with 2 s in "
        "--quick trials), so it is set above a start-up here. W holds the whole time b was away.",
        "Time outside steps (checkpoint saves, metrics writes) is counted as lost in every variant.",
        "Quality runs are deterministic where no timing decides membership (CPU, deterministic algorithms, fixed "
        "seeds): always present, the end control and a alone give bit-identical losses on a rerun. The mid-run "
        "variants depend on the round in which b rejoins and the step it continues at (both from its start-up "
        "time), so they move a little between runs; the table gives what happened.",
    ]


def _plot(res: Result, out_dir: Path, good: list[dict], qual: list[dict], sz: Sizes) -> None:
    from .common import plt, save_fig

    p = plt()
    fig, (ax, bx, cx) = p.subplots(1, 3, figsize=(17, 4.4))
    for g in good:
        tl = g["timeline"]
        ax.plot([t for t, _ in tl], [s for _, s in tl], label=_label(g))
    g0 = next((g for g in good if g["mode"] == "crash"), good[0])
    if g0["gone_at"] == g0["gone_at"]:
        ax.axvspan(
            g0["gone_at"],
            g0["back_at"] if g0["back_at"] == g0["back_at"] else g0["restart_at"],
            color="grey",
            alpha=0.15,
            label=f"b away ({_label(g0)})",
        )
    ax.set_xlabel("wall time since a started training, s")
    ax.set_ylabel("a's step")
    ax.set_title("survivor progress (flat = a idle)")
    ax.legend(fontsize=7)
    for g in good:
        if g["mode"] in ("strict", "none"):
            continue
        bx.plot(
            [r for r, _, _ in g["round_waits"]],
            [w for _, w, _ in g["round_waits"]],
            marker="o",
            label=_label(g),
        )
    for grace in sorted({g["grace_s"] for g in good if g["mode"] in ("crash", "stop")}):
        bx.axhline(grace, color="grey", linestyle="--", linewidth=0.8)
    bx.set_xlabel("a's round")
    bx.set_ylabel("xr_wait_s")
    bx.set_title("a's wait for b per round (dashed: grace_s)")
    bx.legend(fontsize=7)
    labels = [
        _qlabel(q)
        .replace(", then back", "")
        .replace("b leaves for good after", "b gone after")
        .replace(" (1-region run)", "")
        .replace(" (control)", "")
        + (f", seed {q['seed']}" if q["seed"] != sz.q_seeds[0] else "")
        for q in qual
    ]
    cx.bar(range(len(qual)), [q["loss"] for q in qual])
    cx.set_xticks(range(len(qual)), labels, rotation=20, ha="right", fontsize=8)
    cx.set_ylim(min(q["loss"] for q in qual) * 0.98, max(q["loss"] for q in qual) * 1.01)
    cx.set_ylabel("held-out loss")
    cx.set_title(f"final held-out loss, {sz.q_steps} steps")
    save_fig(fig, out_dir / "elastic.png")
    res.plots.append(
        (
            "elastic.png",
            "Left: a's step over wall time. Middle: a's wait per round. Right: final "
            "held-out loss by b's absence.",
        )
    )
