"""Benchmark: what the metric sinks cost a training step (issue 29's goal: under 1% of a tiny CPU step with
every sink on), in the steady state, and the CPU each sink takes per record.

1. The real trainer, one process on the CPU, a tiny model (the step is about 2 ms, so a sink's cost shows),
   a metrics record every step, hence a record to the sinks every step. Two variants, run alternately in
   the same session: no sinks, and all three (TensorBoard, W&B offline, the Prometheus textfile every 10
   steps), which the trainer's rank 0 hands to its sinks' process (sbatch_gen/train/sinkproc.py). That
   process logs one line once its sinks started, with the last step of metrics.jsonl then: the steady
   state is every step from there plus ``SETTLE`` (its first batch, the records logged while it started,
   and one more read) to the end, the same steps in both runs of a pair. Per run the median
   ``step_time_s`` of those steps; per pair the ratio all / none; the headline is the median of the pairs,
   with their spread. The steps before (after the first ``SKIP``) are the start-up, shown beside it.
2. Each sink alone in the sinks' process (``python -m sbatch_gen.train.sinkproc``, its trainer already
   gone: it writes the file's records and exits), on ``RECORDS`` real records of a run and on none: its
   CPU per record is the difference over ``RECORDS``, the process and the ones it waited for (W&B's
   service) together.
"""

from __future__ import annotations

import os
import re
import resource
import statistics
import subprocess
import tempfile
from pathlib import Path

import yaml

from sbatch_gen.metrics_options import MetricsOptions
from sbatch_gen.train.data import prepare

from .common import PY, REPO, Result, bench_env, median
from .common import run as run_cmd
from .trainruns import read_metrics, write_config

SKIP = 20  # steps left out of each run: imports, the first allocations
SETTLE = 500  # steps after the sinks' start line before the steady state (about 1 s: two reads)
FULL = {"steps": 6000, "pairs": 8, "records": 3000, "reps": 2}
QUICK = {"steps": 40, "pairs": 1, "records": 20, "reps": 1}
SINKS = {"sinks": ["tensorboard", "wandb", "prometheus"], "prometheus_every": 10}
STARTED = re.compile(r"metrics sinks (.+) started in ([\d.]+) s, metrics.jsonl at step (\d+|None)")
ENV = {"WANDB_MODE": "offline", "WANDB_API_KEY": "", "OMP_NUM_THREADS": "1"}


def _config(work: Path, data: Path, steps: int, sinks: bool) -> Path:
    cfg = write_config(
        work / f"{'all' if sinks else 'none'}.yaml",
        steps=steps,
        data_dir=data,
        d_model=32,
        n_layers=1,
        seq_len=32,
        batch_size=2,
        log_every=1,
    )
    if sinks:
        c = yaml.safe_load(cfg.read_text())
        c["metrics"] = SINKS
        cfg.write_text(yaml.safe_dump(c, sort_keys=False))
    return cfg


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _train(cfg: Path, run_dir: Path) -> tuple[list[float], int | None, float]:
    """The run's step times (steps 1, 2, ...), the step metrics.jsonl was at when its sinks started (None:
    no sinks), and its CPU seconds (the trainer and the processes it waited for)."""
    cpu = _cpu_children()
    p = run_cmd(
        [PY, "-m", "sbatch_gen.train", "--config", str(cfg), "--run-dir", str(run_dir)],
        env=bench_env(ENV),
        cwd=REPO,
    )
    cpu = _cpu_children() - cpu
    m = STARTED.search(p.stderr)
    started = int(m.group(3)) if m and m.group(3) != "None" else (0 if m else None)
    return [r["step_time_s"] for r in read_metrics(run_dir)], started, cpu


def _sinks_wrote(run_dir: Path, steps: int) -> bool:
    tb = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    wb = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    prom = list(run_dir.glob("sbatch_gen_*.prom"))
    ok = bool(tb and wb and prom) and all(p.stat().st_size > 0 for p in tb + wb)
    text = prom[0].read_text() if prom else ""
    return ok and any(
        line.startswith("sbatch_gen_step{") and line.endswith(f"}} {steps}.0") for line in text.splitlines()
    )


def _window(times: list[float], first: int, last: int) -> float:
    """The median of steps ``first``..``last`` (1-based, inclusive); nan when there are none."""
    xs = times[first - 1 : last]
    return median(xs) if xs else float("nan")


def _sink_cpu(work: Path, sinks: list[str], records: list[str]) -> float:
    """CPU seconds of the sinks' process with ``sinks``, fed ``records`` (JSONL lines), its trainer already
    gone (stdin at EOF): it writes them, closes the sinks and exits."""
    run_dir = work / f"cpu-{len(records)}-{os.urandom(4).hex()}"
    run_dir.mkdir()
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(records))
    opts = MetricsOptions.model_validate({**SINKS, "sinks": sinks})
    argv = [
        PY,
        "-m",
        "sbatch_gen.train.sinkproc",
        "--metrics",
        str(path),
        "--options",
        opts.model_dump_json(),
    ]
    argv += ["--run-id", "bench", "--region", "local", "--first-step", "1", "--start", "0"]
    cpu = _cpu_children()
    p = subprocess.run(
        argv,
        env=bench_env(ENV),
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    cpu = _cpu_children() - cpu
    if p.returncode != 0 or not STARTED.search(p.stderr) or "failed" in p.stderr:
        raise RuntimeError(f"sinks' process with {sinks}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return cpu


def _per_record(work: Path, records: list[str], reps: int) -> dict[str, float]:
    """The CPU per record (ms) of each sink alone and of all three together (the process's own work per
    record, reading and parsing the line, is in each): the best of ``reps`` with the records, less the best
    of ``reps`` without."""
    names = list(SINKS["sinks"])
    out = {}
    for label, sinks in [*((n, [n]) for n in names), ("all three", names)]:
        with_ = min(_sink_cpu(work, sinks, records) for _ in range(reps))
        without = min(_sink_cpu(work, sinks, []) for _ in range(reps))
        out[label] = (with_ - without) / len(records) * 1e3
    return out


def run_bench(out: Path, quick: bool) -> Result:
    sz = QUICK if quick else FULL
    res = Result("sinks", "Metric sinks: what they cost a tiny CPU training step", quick)
    load_before = os.getloadavg()[0]
    rows = []
    wrote = []
    with tempfile.TemporaryDirectory(prefix="sbgen-sinks-") as tmp:
        work = Path(tmp)
        data = work / "data"
        prepare(data, ["local"], "python-stdlib", 2_000_000)
        cfgs = {v: _config(work, data, sz["steps"], v == "all") for v in ("none", "all")}
        for i in range(sz["pairs"]):
            got = {}
            for v in ("none", "all") if i % 2 == 0 else ("all", "none"):  # alternate who goes first
                got[v] = _train(cfgs[v], work / f"{v}-{i}")
                if v == "all":
                    wrote.append(_sinks_wrote(work / f"{v}-{i}", sz["steps"]))
            (none, _, cpu_none), (all_, started, cpu_all) = got["none"], got["all"]
            cut = (started if started is not None else sz["steps"]) + SETTLE + 1
            steady = [_window(t, cut, sz["steps"]) for t in (none, all_)]
            start_up = [_window(t, SKIP + 1, cut - 1) for t in (none, all_)]
            rows.append([i + 1, started, cut, *steady, steady[1] / steady[0], *start_up])
            rows[-1] += [start_up[1] / start_up[0], cpu_none, cpu_all]
        metrics = (work / "none-0" / "metrics.jsonl").read_text().splitlines(keepends=True)
        records = [line for line in metrics if '"step"' in line][: sz["records"]]
        per_record = _per_record(work, records, sz["reps"])
    ratios = [r[5] for r in rows if r[5] == r[5]]  # nan: no steady steps (--quick)
    ratio = median(ratios)
    spread = statistics.pstdev(ratios) if len(ratios) > 1 else 0.0
    start_ratio = median([r[8] for r in rows])
    step_ms = median([r[3] for r in rows if r[3] == r[3]] or [r[6] for r in rows]) * 1e3
    res.setup += [
        f"The trainer (`python -m sbatch_gen.train`), one CPU process, `OMP_NUM_THREADS=1`: a GPT of 1 layer, "
        f"d_model 32, seq_len 32, batch 2; {sz['steps']} steps, a metrics record every step, so every record "
        "goes to the sinks.",
        f"Variants: no sinks; all three (`{SINKS}`; W&B offline). {sz['pairs']} pair(s), run alternately "
        "(the first of a pair alternates).",
        "The sinks' process logs one line when its sinks started, with the last step of metrics.jsonl then "
        f"(S). Steady state: steps S + {SETTLE + 1} to the end (its first batch, the records of its start-up, "
        f"and one more read are before it); start-up: steps {SKIP + 1} to S + {SETTLE}. The same steps in both "
        "runs of a pair; per run the median `step_time_s`, per pair all / none.",
        "Every 'all' run's sinks are checked to have written: TensorBoard events, W&B's transaction log, "
        "the Prometheus file at the last step.",
        "CPU seconds per run: the benchmark's children's user + system time across the run (the trainer and "
        "the processes it waited for: its sinks' process, and W&B's service, which that process waits for).",
        f"CPU per record: the sinks' process with one sink alone, then all three, its trainer already gone, "
        f"on {len(records)} records of a run and on none; the best of {sz['reps']} each; (CPU with - CPU "
        "without) / records, the process and W&B's service (which it waits for at its exit) together.",
        f"Reproduce: `python -m bench sinks`{' --quick' if quick else ''}.",
    ]
    res.table(
        "Per pair: when the sinks started, median step time (ms) in the steady state and the start-up, CPU s",
        [
            "pair",
            "sinks started at step",
            "steady from step",
            "steady: no sinks",
            "steady: all sinks",
            "steady: all / none",
            "start-up: no sinks",
            "start-up: all sinks",
            "start-up: all / none",
            "CPU s, no sinks",
            "CPU s, all sinks",
        ],
        [
            [r[0], r[1] if r[1] is not None else "-", r[2], *(x * 1e3 for x in r[3:5]), r[5]]
            + [*(x * 1e3 for x in r[6:8]), r[8], r[9], r[10]]
            for r in rows
        ],
        key="pairs",
    )
    total = per_record["all three"]
    res.table(
        "CPU per record of each sink alone and of all three together (ms), and against the median step",
        ["sinks", "CPU per record (ms)", "per record / median step time"],
        [[k, v, v / step_ms] for k, v in per_record.items()],
        key="per_record",
    )
    pairs = ", ".join(f"{r:.4f}" for r in ratios)
    res.headline["steady state: step time, all sinks / none (median of pairs)"] = f"{ratio:.4f}"
    res.headline["start-up: step time, all sinks / none (median of pairs)"] = f"{start_ratio:.4f}"
    res.headline["CPU per record, all three sinks (ms)"] = f"{total:.3f}"
    # met only when the median of the pairs is under 1.01 by more than its own noise: its rough 95% upper
    # bound (the median's standard error is about 1.25 pstdev / sqrt(pairs))
    bound = ratio + 2 * 1.25 * spread / max(1, len(ratios)) ** 0.5
    res.goal(
        "all sinks cost < 1% of a tiny CPU step (steady state, a record to the sinks every step; met when "
        "the median's rough 95% upper bound is under 1.01)",
        f"{(ratio - 1) * 100:+.2f}%, upper bound {(bound - 1) * 100:+.2f}% (pairs: {pairs}; spread "
        f"{spread:.4f} (pstdev), {min(ratios, default=float('nan')):.4f}-{max(ratios, default=float('nan')):.4f})"
        if ratios
        else "no steady steps (--quick: the run ends before the sinks started)",
        None if quick else bound < 1.01,
    )
    res.goal("every 'all' run's sinks wrote", f"{sum(wrote)} of {len(wrote)}", all(wrote))
    extra_cpu = median([r[10] - r[9] for r in rows])
    res.notes += [
        "The sinks are written by their own process (sbatch_gen/train/sinkproc.py), at `nice` +10, which "
        "imports no torch: it follows metrics.jsonl every 0.5 s and hands what was appended to the sinks as "
        "one batch. The training process pays for its metrics.jsonl line only and shares no GIL with the "
        "sinks' Python work.",
        f"What the sinks cost the machine: {extra_cpu:.2f} CPU seconds more per run with all three (median "
        f"over the pairs of all - none; {sz['steps']} records), the sinks' process's start (importing "
        f"tensorboard and wandb, W&B's service) and its {total:.3f} ms of CPU per record (the table above), "
        f"against a median step of {step_ms:.2f} ms: a process that needs about "
        f"{total / step_ms * 100:.0f}% of a core while the trainer runs. On 2 cores shared with other work "
        "every CPU second it takes is one the others, the trainer among them, may wait for: `nice` lowers "
        "its share, not to zero. With a spare core it would cost the step nothing; with a step of 100 ms "
        "or more (a GPU step of a real model) the same CPU per record is a small fraction of a core.",
        f"The machine is shared with other developers' work: load average {load_before:.1f} before the run "
        f"and {os.getloadavg()[0]:.1f} after it, on 2 cores. A single run's median can move either way (the "
        "table), in both variants: the headline is the median of the pairs' ratios, and the spread says how "
        "far one pair is to be trusted.",
    ]
    return res


def run(out: Path, quick: bool = False) -> Result:
    return run_bench(out, quick)
