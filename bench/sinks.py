"""Benchmark: what the metric sinks cost a training step (issue 29's goal: under 1% of a tiny CPU step with
every sink on), and the CPU each sink takes per record.

The real trainer, one process on the CPU, a tiny model (the step is about 2 ms, so a sink's cost shows), a
metrics record every step, hence a record to the sinks every step (the trainer's default ``log_every`` is
10). Its rank 0 hands the records to its sinks' process (sbatch_gen/train/sinkproc.py): TensorBoard, W&B
offline and the Prometheus textfile every 10 steps. Two placements: ``shared`` (the kernel places every
process) and ``pinned`` (the trainer on one CPU, every process it starts on another, :class:`_Pinner`).

1. Toggled runs, the goal's judge. Within one run the benchmark stops and continues the sinks' processes
   in turns of a second (:class:`_Toggler`), and compares each running turn's median step with its two
   stopped neighbours' (:func:`_turns`): turns a second apart in one process, so what moves a whole run
   (its memory layout, the machine's state) cancels. A running turn catches up the stopped one's records,
   so it carries twice the sinks' steady load. The control: the same turns in a run without sinks.
2. Between runs: pairs of runs without and with the sinks, alternately. Per run the median ``step_time_s``
   of the steady state, from the sinks' start line (the last step of metrics.jsonl then) plus ``SETTLE``
   to the end, and of the start-up before it; per pair all / none.
3. Each sink alone in the sinks' process (``python -m sbatch_gen.train.sinkproc``, its trainer already
   gone: it writes the file's records and exits), on ``records`` real records of a run (3000) and on none: its
   CPU per record is the difference over their number, the process and the ones it waited for (W&B's
   service) together.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import yaml

from sbatch_gen.metrics_options import MetricsOptions
from sbatch_gen.proc import descendants
from sbatch_gen.train.data import prepare
from sbatch_gen.train.sinks import last_logged_step

from .common import PY, REPO, Result, bench_env, median
from .trainruns import read_metrics, write_config

SKIP = 20  # steps left out of each run: imports, the first allocations
# the trainer and its sinks' processes on any CPU / on a CPU each (where this process may use both)
MODES = ("shared", "pinned") if {0, 1} <= os.sched_getaffinity(0) else ("shared",)
SETTLE = 500  # steps after the sinks' start line before the steady state (about 1 s: two reads)
FULL = {"steps": 6000, "pairs": 2, "records": 3000, "reps": 2, "toggle_steps": 40000, "toggle_runs": 2}
QUICK = {"steps": 40, "pairs": 1, "records": 20, "reps": 1, "toggle_steps": 400, "toggle_runs": 1}
SINKS = {"sinks": ["tensorboard", "wandb", "prometheus"], "prometheus_every": 10}
TRAINER_CPU, SINKS_CPU = 0, 1  # the pinned variants: the trainer on one CPU, its sinks' processes on another
PIN_EVERY_S = 0.02
# the toggled runs: the sinks stopped and continued in turns of window_s within one run, from a step well
# after their start (S + SETTLE is about 1300) to a little before the run's end
TOGGLE = {"window_s": 1.0, "from_step": 2500, "until_before_end": 1000}
TOGGLE_QUICK = {"window_s": 0.1, "from_step": 50, "until_before_end": 50}
TURN_GUARD = 2
CONTROL = "control (no sinks)"
STARTED = re.compile(r"metrics sinks (.+) started in ([\d.]+) s, metrics.jsonl at step (\d+|None)")
ENV = {"WANDB_MODE": "offline", "WANDB_API_KEY": "", "OMP_NUM_THREADS": "1"}


def _config(work: Path, data: Path, steps: int, sinks: bool, name: str = "") -> Path:
    cfg = write_config(
        work / f"{name or ('all' if sinks else 'none')}.yaml",
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


class _Pinner(threading.Thread):
    """Keeps every thread of every process below ``pid`` on ``cpus`` (new ones within ``PIN_EVERY_S``) until
    :meth:`done`; it runs on ``cpus`` itself (its starter's affinity, set before it starts)."""

    def __init__(self, pid: int, cpus: set[int]) -> None:
        super().__init__(daemon=True)
        self.pid, self.cpus, self._done = pid, cpus, threading.Event()

    def run(self) -> None:
        while not self._done.wait(PIN_EVERY_S):
            for child in descendants(self.pid):
                for task in Path(f"/proc/{child}/task").glob("*"):
                    try:
                        tid = int(task.name)
                        if os.sched_getaffinity(tid) != self.cpus:
                            os.sched_setaffinity(tid, self.cpus)
                    except (OSError, ValueError):
                        pass  # a thread that ended meanwhile

    def done(self) -> None:
        self._done.set()
        self.join()


def _queue_wait(pid: int) -> float:
    """Seconds every thread of ``pid`` has waited on a run queue for a CPU so far
    (/proc/<pid>/task/*/schedstat, its second field: the scheduler's own clock)."""
    wait = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            wait += int(stat.read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return wait / 1e9


class _Toggler(threading.Thread):
    """Stops (SIGSTOP) and continues (SIGCONT) every process below ``pid`` (the sinks' process, W&B's
    service) in turns of ``turns['window_s']`` (:data:`TOGGLE`): from when metrics.jsonl reaches
    ``turns['from_step']`` until it is within ``turns['until_before_end']`` steps of ``steps``. At each turn it notes whether the sinks
    run from there and the last step of metrics.jsonl (:attr:`marks`). Every process is continued at the
    end, whatever happened. A stopped sinks' process catches up when continued: its work of both turns falls
    in the turn it runs, so a running turn carries twice the sinks' steady load."""

    def __init__(self, pid: int, metrics: Path, steps: int, turns: dict) -> None:
        super().__init__(daemon=True)
        self.pid, self.metrics, self.steps, self.turns = pid, metrics, steps, turns
        self.marks: list[tuple[bool, int, float]] = []  # (running from here, last step, run-queue wait s)
        self._done = threading.Event()

    def _signal(self, sig: int) -> None:
        for child in descendants(self.pid):
            try:
                os.kill(child, sig)
            except OSError:
                pass  # gone meanwhile

    def _step(self) -> int:
        return last_logged_step(self.metrics) or 0

    def _mark(self, running: bool) -> None:
        self.marks.append((running, self._step(), _queue_wait(self.pid)))

    def run(self) -> None:
        try:
            while self._step() < self.turns["from_step"]:
                if self._done.wait(0.05):
                    return
            running = True
            while True:
                running = not running  # the first turn: stopped
                self._signal(signal.SIGCONT if running else signal.SIGSTOP)
                self._mark(running)
                if self._done.wait(self.turns["window_s"]):
                    return
                if self._step() >= self.steps - self.turns["until_before_end"]:
                    self._mark(not running)  # the end of the last turn
                    return
        finally:
            self._signal(signal.SIGCONT)

    def done(self) -> None:
        self._done.set()
        self.join()


def _train(
    cfg: Path, run_dir: Path, pinned: bool = False, toggle: dict | None = None, steps: int = 0
) -> tuple[list[float], int | None, float, list[tuple[bool, int, float]]]:
    """The run's step times (steps 1, 2, ...), the step metrics.jsonl was at when its sinks started (None:
    no sinks), its CPU seconds (the trainer and the processes it waited for), and the toggler's marks
    (``toggle``: its sinks stopped and continued in these turns, :class:`_Toggler`; ``steps``: the run's).
    ``pinned``: the trainer (every thread) on CPU 0, every process it starts on CPU 1, as is this process
    while it runs."""
    cpu = _cpu_children()
    argv = [PY, "-m", "sbatch_gen.train", "--config", str(cfg), "--run-dir", str(run_dir)]
    mine = os.sched_getaffinity(0)
    watchers: list = []
    if pinned:
        os.sched_setaffinity(0, {SINKS_CPU})  # this thread, and the watchers it starts
    try:
        proc = subprocess.Popen(
            argv,
            env=bench_env(ENV),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, {TRAINER_CPU})) if pinned else None,
        )
        if pinned:
            watchers.append(_Pinner(proc.pid, {SINKS_CPU}))
        if toggle is not None:
            watchers.append(_Toggler(proc.pid, run_dir / "metrics.jsonl", steps, toggle))
        for w in watchers:
            w.start()
        try:
            out, err = proc.communicate(timeout=600)
        finally:
            for w in watchers:
                w.done()
    finally:
        os.sched_setaffinity(0, mine)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer failed ({proc.returncode}): {' '.join(argv)}\n{err[-4000:]}")
    cpu = _cpu_children() - cpu
    m = STARTED.search(err)
    started = int(m.group(3)) if m and m.group(3) != "None" else (0 if m else None)
    marks = watchers[-1].marks if toggle is not None else []
    return [r["step_time_s"] for r in read_metrics(run_dir)], started, cpu, marks


def _turns(times: list[float], marks: list[tuple], after: int) -> list[float]:
    """Per running turn that began after step ``after``: its median step time over the mean of the medians
    of the stopped turns either side of it (a drift of the machine cancels); the first ``TURN_GUARD`` steps
    of each turn left out (a record is written a step late). ``marks``: the toggler's, (running from here,
    the last step logged then, ...)."""
    spans = [
        (m[0], _window(times, m[1] + TURN_GUARD + 1, n[1]))
        for m, n in zip(marks, marks[1:], strict=False)
        if m[1] > after and n[1] > m[1] + TURN_GUARD
    ]
    return [
        med / ((before + after_) / 2)
        for (r0, before), (r1, med), (r2, after_) in zip(spans, spans[1:], spans[2:], strict=False)
        if r1 and not r0 and not r2
    ]


def _queue_waits(marks: list[tuple], after: int) -> tuple[float, float]:
    """The trainer's wait on a run queue per step (microseconds), in its running turns and in its stopped
    ones after step ``after``, from the toggler's schedstat readings: the CPU time the sinks took from it."""
    sums = {True: [0.0, 0], False: [0.0, 0]}
    for m, n in zip(marks, marks[1:], strict=False):
        if m[1] > after and n[1] > m[1]:
            sums[m[0]][0] += n[2] - m[2]
            sums[m[0]][1] += n[1] - m[1]
    return tuple(w / k * 1e6 if k else float("nan") for w, k in (sums[True], sums[False]))


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
    toggled: list[list] = []
    wrote = []
    with tempfile.TemporaryDirectory(prefix="sbgen-sinks-") as tmp:
        work = Path(tmp)
        data = work / "data"
        prepare(data, ["local"], "python-stdlib", 2_000_000)
        cfgs = {v: _config(work, data, sz["steps"], v == "all") for v in ("none", "all")}
        for i in range(sz["pairs"]):
            for mode in MODES:  # interleaved: a drift of the machine moves both alike
                got = {}
                for v in ("none", "all") if i % 2 == 0 else ("all", "none"):  # alternate who goes first
                    run_dir = work / f"{v}-{mode}-{i}"
                    got[v] = _train(cfgs[v], run_dir, pinned=mode == "pinned")
                    if v == "all":
                        wrote.append(_sinks_wrote(run_dir, sz["steps"]))
                (none, _, cpu_none, _), (all_, started, cpu_all, _) = got["none"], got["all"]
                cut = (started if started is not None else sz["steps"]) + SETTLE + 1
                steady = [_window(t, cut, sz["steps"]) for t in (none, all_)]
                start_up = [_window(t, SKIP + 1, cut - 1) for t in (none, all_)]
                rows.append([mode, i + 1, started, cut, *steady, steady[1] / steady[0], *start_up])
                rows[-1] += [start_up[1] / start_up[0], cpu_none, cpu_all]
                print(  # progress: a run cut short by a timeout still says how far it got
                    f"sinks: pair {i + 1}/{sz['pairs']} {mode}: steady median step {steady[0] * 1e3:.3f} ms "
                    f"none, {steady[1] * 1e3:.3f} ms all, all / none {steady[1] / steady[0]:.4f}",
                    file=sys.stderr,
                    flush=True,
                )
        toggle = TOGGLE_QUICK if quick else TOGGLE
        on = _config(work, data, sz["toggle_steps"], True, name="toggled")
        off = _config(work, data, sz["toggle_steps"], False, name="toggled-control")
        # the control: the same turns in a run without sinks (nothing to stop): what the comparison reads
        # when there is nothing to find, on this machine, at this time
        variants = [(mode, on, mode == "pinned") for mode in MODES] + [(CONTROL, off, False)]
        for i in range(sz["toggle_runs"]):
            for name, cfg, pinned in variants:
                run_dir = work / f"toggled-{name.split()[0]}-{i}"
                times, started, _, marks = _train(cfg, run_dir, pinned, toggle, sz["toggle_steps"])
                if cfg is on:
                    wrote.append(_sinks_wrote(run_dir, sz["toggle_steps"]))
                after = (started or 0) + SETTLE
                ratios = _turns(times, marks, after)
                toggled.append(
                    [name, i + 1, started, after + 1, len(marks) - 1, ratios, *_queue_waits(marks, after)]
                )
                print(
                    f"sinks: toggled run {i + 1}/{sz['toggle_runs']} {name}: {len(ratios)} running turns, "
                    f"median running / stopped {_med(ratios):.4f}",
                    file=sys.stderr,
                    flush=True,
                )
        metrics = (work / "none-shared-0" / "metrics.jsonl").read_text().splitlines(keepends=True)
        records = [line for line in metrics if '"step"' in line][: sz["records"]]
        per_record = _per_record(work, records, sz["reps"])
    stats = {mode: _pair_stats([r for r in rows if r[0] == mode]) for mode in MODES}
    step_ms = median([r[4] for r in rows if r[4] == r[4]] or [r[7] for r in rows]) * 1e3
    res.setup += [
        f"The trainer (`python -m sbatch_gen.train`), one CPU process, `OMP_NUM_THREADS=1`: a GPT of 1 layer, "
        f"d_model 32, seq_len 32, batch 2; {sz['steps']} steps, a metrics record every step, so every record "
        "goes to the sinks.",
        f"Variants: no sinks; all three (`{SINKS}`; W&B offline). {sz['pairs']} pair(s) of each placement, "
        "run alternately (the first of a pair alternates), the placements interleaved.",
        "Placements: `shared`, every process wherever the kernel puts it (the machine's "
        f"{os.cpu_count()} CPUs); `pinned`, the trainer (every thread) on CPU {TRAINER_CPU} and every process "
        f"it starts (the sinks' process, W&B's service, each thread) on CPU {SINKS_CPU}, moved there within "
        f"{PIN_EVERY_S * 1e3:.0f} ms of appearing by a thread of the benchmark that itself runs on CPU "
        f"{SINKS_CPU} (in both variants): a node where rank 0 has a core to spare, as a GPU node's rank has.",
        "The sinks' process logs one line when its sinks started, with the last step of metrics.jsonl then "
        f"(S). Steady state: steps S + {SETTLE + 1} to the end (its first batch, the records of its start-up, "
        f"and one more read are before it); start-up: steps {SKIP + 1} to S + {SETTLE}. The same steps in both "
        "runs of a pair; per run the median `step_time_s`, per pair all / none.",
        f"Toggled runs (the goal's judge): {sz['toggle_steps']} steps with all three sinks; from step "
        f"{toggle['from_step']} the benchmark stops (SIGSTOP) and continues (SIGCONT) the trainer's sinks' "
        f"processes in turns of {toggle['window_s']} s, noting the last step of metrics.jsonl at each turn, "
        f"until {toggle['until_before_end']} steps before the end. A stopped process catches up when it "
        "runs again, so a running turn carries twice the sinks' steady load. Each running turn that began "
        f"after S + {SETTLE}: its median step (its first {TURN_GUARD} steps left out) over the mean of its two "
        f"stopped neighbours'. {sz['toggle_runs']} run(s) per placement, and as many of the control: the "
        "same turns in a run without sinks, what the comparison reads when there is nothing to find.",
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
            "placement",
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
            [r[0], r[1], r[2] if r[2] is not None else "-", r[3], *(x * 1e3 for x in r[4:6]), r[6]]
            + [*(x * 1e3 for x in r[7:9]), r[9], r[10], r[11]]
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
    for mode, st in stats.items():
        res.headline[f"steady state, {mode}: step time, all sinks / none (median of pairs)"] = (
            f"{st['ratio']:.4f}"
        )
        res.headline[f"start-up, {mode}: step time, all sinks / none (median of pairs)"] = (
            f"{st['start']:.4f}"
        )
    res.headline["CPU per record, all three sinks (ms)"] = f"{total:.3f}"
    where = {
        "pinned": f"the sinks' processes on a CPU of their own (the trainer on CPU {TRAINER_CPU}, they on CPU "
        f"{SINKS_CPU})",
        "shared": f"every process on any of the machine's {os.cpu_count()} CPUs",
    }
    res.table(
        "Toggled runs: the sinks stopped and continued in turns within one run; per run the running turns' "
        "median step over their stopped neighbours'",
        [
            "placement",
            "run",
            "sinks started at step",
            "turns from step",
            "turns",
            "running turns compared",
            "running / stopped (median)",
            "trainer's run-queue wait per step (us), running turns",
            "the same, stopped turns",
            "each running turn / stopped",
        ],
        [
            [r[0], r[1], r[2] if r[2] is not None else "-", r[3], r[4], len(r[5]), _med(r[5]), r[6], r[7]]
            + [" ".join(f"{x:.3f}" for x in r[5]) or "-"]
            for r in toggled
        ],
        key="toggled",
    )
    turns = {m: _spread([x for r in toggled if r[0] == m for x in r[5]]) for m in (*MODES, CONTROL)}
    for mode, st in turns.items():
        res.headline[f"within a run, {mode}: step time, running / stopped turns (median)"] = (
            f"{st['ratio']:.4f}"
        )
    control = turns[CONTROL]
    res.goal(
        "the control reads no cost: the same turns in runs without sinks (met when the median's rough 95% "
        "interval holds 1.00, i.e. the comparison finds nothing where there is nothing)",
        control["measured_short"],
        None if quick else abs(control["ratio"] - 1) <= control["bound"] - control["ratio"],
    )
    for mode in sorted(MODES, reverse=True):  # pinned first
        st = turns[mode]
        res.goal(
            f"all sinks cost < 1% of a tiny CPU step, {where[mode]} (within one run: the running turns of "
            "the toggled runs against their stopped neighbours, each running turn carrying twice the sinks' "
            "steady load; met when the median's rough 95% upper bound is under 1.01)",
            f"{st['measured_short']}; the control: {control['measured_short']}",
            None if quick else st["bound"] < 1.01,
        )
    for mode in sorted(MODES, reverse=True):
        res.notes.append(
            f"Between runs ({mode}): all sinks / none, the median of {sz['pairs']} pairs of runs: "
            f"{stats[mode]['measured']}. Not the goal's judge: a run's median step moves by a few percent "
            "from run to run whatever the sinks (the 'no sinks' column), more than the goal; the toggled "
            "runs compare turns a second apart in one process, where that cancels."
        )
    res.goal("every 'all' run's sinks wrote", f"{sum(wrote)} of {len(wrote)}", all(wrote))
    extra_cpu = median([r[11] - r[10] for r in rows])
    res.notes += [
        "The sinks are written by their own process (sbatch_gen/train/sinkproc.py), at `nice` +10 in Linux's `SCHED_IDLE` class (a waking trainer thread takes its CPU at once), which "
        "imports no torch: it follows metrics.jsonl every 0.5 s and hands what was appended to the sinks as "
        "one batch. The training process pays for its metrics.jsonl line only and shares no GIL with the "
        "sinks' Python work.",
        f"What the sinks cost the machine: {extra_cpu:.2f} CPU seconds more per run with all three (median "
        f"over the pairs of all - none; {sz['steps']} records), the sinks' process's start (importing "
        f"tensorboard and wandb, W&B's service) and its {total:.3f} ms of CPU per record (the table above), "
        f"against a median step of {step_ms:.2f} ms: a process that needs about "
        f"{total / step_ms * 100:.0f}% of a core while the trainer runs. Where every core is busy, every CPU "
        "second it takes is one the others, the trainer among them, may wait for: `nice` lowers its share, "
        "not to zero. With a spare core (`pinned`) it costs the step only what the two share beyond the CPU "
        "(caches, memory, the file system); with a step of 100 ms or more (a GPU step of a real model) the "
        "same CPU per record is a small fraction of a core.",
        f"Load average {load_before:.1f} before the run and {os.getloadavg()[0]:.1f} after it, on "
        f"{os.cpu_count()} CPUs. A single run's median can move either way (the table), in both variants: "
        "the headline is the median of the pairs' ratios, and the spread says how far one pair is to be "
        "trusted.",
    ]
    return res


def _med(xs: list[float]) -> float:
    return median(xs) if xs else float("nan")


def _spread(ratios: list[float]) -> dict:
    """The median of ``ratios``, its spread, its rough 95% upper bound (the median's standard error is about
    1.25 pstdev / sqrt(n)), and the line that says them."""
    ratio = _med(ratios)
    spread = statistics.pstdev(ratios) if len(ratios) > 1 else 0.0
    bound = ratio + 2 * 1.25 * spread / max(1, len(ratios)) ** 0.5
    head = f"{(ratio - 1) * 100:+.2f}%, upper bound {(bound - 1) * 100:+.2f}%"
    tail = f"spread {spread:.4f} (pstdev), {min(ratios):.4f}-{max(ratios):.4f}" if ratios else ""
    each = ", ".join(f"{r:.4f}" for r in ratios)
    none = "none measured (--quick: too few steps)"
    return {
        "ratio": ratio,
        "bound": bound,
        "n": len(ratios),
        "measured": f"{head} (pairs: {each}; {tail})" if ratios else none,
        "measured_short": f"{head} ({len(ratios)} turns; {tail})" if ratios else none,
    }


def _pair_stats(rows: list[list]) -> dict:
    """:func:`_spread` of one placement's pairs (steady all / none), and the start-up's median."""
    st = _spread([r[6] for r in rows if r[6] == r[6]])  # nan: no steady steps (--quick)
    st["start"] = _med([r[9] for r in rows])
    return st


def run(out: Path, quick: bool = False) -> Result:
    return run_bench(out, quick)
