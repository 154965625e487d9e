"""``sbatch-gen report RUN_DIR [RUN_DIR...]``: a Markdown run report with PNG plots, from what the trainer
writes (``<run-dir>/metrics.jsonl``, ``<run-dir>/summary.json``), for one region or several.

Sections: the runs; an SLO table a cluster team can keep as its baseline (also written as ``slo.json``
for diffing); loss per region over steps; the step-time distribution with p50/p99; and, for
cross-region runs, the sync time of every round split into its phases (upload / wait / download /
average / outer step / broadcast / cleanup), stacked, and the participation timeline of elastic rounds
(per region and round: took part / late / absent, rejoins and planned leaves; waits while a region was
missing).

Torch-free. matplotlib (the ``report`` extra) is imported only when the plots are drawn.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from sbatch_gen.fsutil import atomic_path, write_atomic
from sbatch_gen.jsonl import complete_lines

PHASES = [  # (metrics key, label) in the order a round runs them
    ("xr_upload_s", "upload"),
    ("xr_wait_s", "wait for peers"),
    ("xr_download_s", "download"),
    ("xr_reduce_s", "average"),
    ("xr_outer_step_s", "outer step"),
    ("xr_broadcast_s", "broadcast"),
    ("xr_cleanup_s", "cleanup"),
]


TIME_SHARES = [  # (metrics key, label): a step's time by where it went (docs/trainer.md#where-the-time-goes)
    ("time_share_fwd_bwd", "forward + backward"),
    ("time_share_optimizer", "optimizer step"),
    ("time_share_data", "data (host batch preparation)"),
    ("time_share_comm", "in-region communication (waited for)"),
    ("time_share_xr", "cross-region sync (waited for)"),
]


class ReportError(Exception):
    """Unusable input: the message names the file (and line)."""


@dataclass
class Run:
    path: Path
    label: str
    steps: list[dict] = field(default_factory=list)  # step records, in file order (restarts repeat steps)
    events: list[dict] = field(default_factory=list)
    summary: dict | None = None
    region: str = ""  # the region's name (``label`` may add the directory to tell two runs apart)

    @property
    def rounds(self) -> list[dict]:
        """Records of the sync rounds this process ran (not the fast-forward records of a region that
        caught up with the run: those carry ``xr_adopted_step`` and no timings)."""
        return [r for r in self.steps if "xr_round" in r and "xr_adopted_step" not in r] + self.final_rounds

    @property
    def final_rounds(self) -> list[dict]:
        """overlap eager: the round joined after the last step (an ``xr_final_round`` event, no step record)."""
        return [e for e in self.events if e.get("event") == "xr_final_round"]


def _display(p: Path) -> str:
    try:
        return p.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return p.as_posix()


def load_run(path: Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{_display(path)}: run directory not found")
    mpath = path / "metrics.jsonl"
    if not mpath.is_file():
        raise ReportError(
            f"{_display(mpath)}: not found (is {_display(path)} a run directory of "
            "python -m sbatch_gen.train?)"
        )
    run = Run(path=path, label=path.name)
    lines, _ = complete_lines(mpath)  # a last line cut short by a crash is left out, nothing else
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportError(f"{_display(mpath)}:{lineno}: not valid JSON: {e.msg}") from None
        if not isinstance(rec, dict):
            raise ReportError(f"{_display(mpath)}:{lineno}: expected a JSON object")
        if "event" in rec:
            run.events.append(rec)
        elif "step" in rec:
            for k in ("loss", "step_time_s"):
                if not isinstance(rec.get(k), int | float):
                    raise ReportError(f"{_display(mpath)}:{lineno}: step record without a numeric {k!r}")
            run.steps.append(rec)
    if not run.steps:
        raise ReportError(f"{_display(mpath)}: no step records (did the run train at least one step?)")
    spath = path / "summary.json"
    if spath.is_file():
        try:
            run.summary = json.loads(spath.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ReportError(f"{_display(spath)}:{e.lineno}: not valid JSON: {e.msg}") from None
    region = (run.summary or {}).get("region") or next(
        (e["region"] for e in run.events if e.get("region")), None
    )
    if region:
        run.label = str(region)
    run.region = run.label
    return run


# ---------------------------------------------------------------------------------------------------
# numbers


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (the trainer's summary uses the same definition)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def segments(run: Run) -> list[list[dict]]:
    """Step records split where the step number does not increase (a new process resumed)."""
    out: list[list[dict]] = []
    for r in run.steps:
        if not out or r["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(r)
    return out


def step_times(run: Run) -> list[float]:
    """Logged step times, each process's first step (warm-up) left out when it has others."""
    xs = []
    for seg in segments(run):
        recs = seg[1:] if len(seg) > 1 else seg
        xs += [float(r["step_time_s"]) for r in recs]
    return xs


def recoveries(run: Run) -> list[dict]:
    """Each restart: where the old process got to, where the new one resumed, and the downtime when the
    records carry wall-clock times."""
    segs = segments(run)
    out = []
    for prev, nxt in zip(segs, segs[1:], strict=False):
        last, first = prev[-1], nxt[0]
        rec = {
            "last_step_before": last["step"],
            "first_step_after": first["step"],
            "steps_redone": max(0, last["step"] - first["step"] + 1),
        }
        if isinstance(last.get("time"), int | float) and isinstance(first.get("time"), int | float):
            rec["downtime_s"] = float(first["time"]) - float(last["time"])
        out.append(rec)
    return out


TOOK_PART, LATE, ABSENT = "took part", "late", "absent"
STATUSES = (TOOK_PART, LATE, ABSENT)


@dataclass
class Participation:
    """Who took part in which round, from the round records of every run given (one per region)."""

    regions: list[str]  # the runs' regions first (in the order given), then others named by the commits
    first: int  # first and last round shown
    last: int
    status: dict[str, dict[int, str]]  # region -> round -> TOOK_PART / LATE / ABSENT (missing: no record)
    rejoins: dict[str, list[dict]]  # region -> its xr_rejoin events
    leaves: dict[str, list[dict]]  # region -> its xr_leave events
    waits_absent: dict[str, list[float]]  # region -> xr_wait_s of its rounds while another region was missing
    waits_full: dict[str, list[float]]  # ... and of its rounds with every region in the commit
    fragments: dict[int, int] = field(
        default_factory=dict
    )  # overlap streaming: round -> the fragment it synced

    def count(self, region: str, status: str) -> int:
        return sum(1 for v in self.status.get(region, {}).values() if v == status)


def _round_records(run: Run) -> dict[int, dict]:
    """Each round's record with its commit (``xr_members``), the last one where a restart ran a round
    again; a round finished at start-up after a requeue is logged as an ``xr_pending_round`` event."""
    out: dict[int, dict] = {}
    pending = [e for e in run.events if e.get("event") == "xr_pending_round"]
    for rec in [*pending, *run.rounds]:
        if isinstance(rec.get("xr_round"), int) and isinstance(rec.get("xr_members"), list):
            out[rec["xr_round"]] = rec
    return out


def participation(runs: list[Run]) -> Participation | None:
    """None when no run has membership records (a single-region run, or one from before elastic rounds)."""
    own: dict[str, dict[int, dict]] = {}
    for run in runs:
        own.setdefault(run.region, {}).update(_round_records(run))
    commits: dict[int, dict] = {}
    for recs in own.values():
        for r, rec in recs.items():
            commits.setdefault(r, rec)
    rejoins: dict[str, list[dict]] = {}
    leaves: dict[str, list[dict]] = {}
    for run in runs:
        for e in run.events:
            if e.get("event") == "xr_rejoin" and isinstance(e.get("to_round"), int):
                rejoins.setdefault(run.region, []).append(e)
            elif e.get("event") == "xr_leave" and isinstance(e.get("round"), int):
                leaves.setdefault(run.region, []).append(e)
    if not commits and not rejoins and not leaves:
        return None
    regions = list(dict.fromkeys(run.region for run in runs))
    for rec in commits.values():
        for reg in [*rec["xr_members"], *(rec.get("xr_absent") or [])]:
            if reg not in regions:
                regions.append(reg)
    status: dict[str, dict[int, str]] = {reg: {} for reg in regions}
    for r, c in commits.items():
        for reg in regions:
            mine = own.get(reg, {}).get(r)
            if mine is not None:  # the region's own record knows whether its delta made it
                status[reg][r] = LATE if mine.get("xr_late") else TOOK_PART
            elif reg in c["xr_members"]:
                status[reg][r] = TOOK_PART
            elif reg in (c.get("xr_absent") or []):
                status[reg][r] = ABSENT
    waits_absent: dict[str, list[float]] = {}
    waits_full: dict[str, list[float]] = {}
    for reg, recs in own.items():
        for r in sorted(recs):
            rec = recs[r]
            w = rec.get("xr_wait_s")
            if rec.get("xr_late") or not isinstance(w, int | float):
                continue
            (waits_absent if rec.get("xr_absent") else waits_full).setdefault(reg, []).append(float(w))
    marks = [e["to_round"] for es in rejoins.values() for e in es] + [
        e["round"] for es in leaves.values() for e in es
    ]
    rounds = list(commits) + marks
    fragments = {
        r: int(c["xr_fragment"]) for r, c in commits.items() if isinstance(c.get("xr_fragment"), int)
    }
    return Participation(
        regions, min(rounds), max(rounds), status, rejoins, leaves, waits_absent, waits_full, fragments
    )


def _exposed(rec: dict) -> float:
    """Seconds a record's sync round held training up: ``xr_exposed_s`` (the whole round without overlap;
    with overlap eager the wait for the round in flight and the boundary's own work), else (records from
    before overlap) ``xr_total_s``; 0 without a round."""
    v = rec.get("xr_exposed_s", rec.get("xr_total_s"))
    return float(v) if isinstance(v, int | float) else 0.0


def time_shares(run: Run) -> dict[str, float | None] | None:
    """The mean of each ``time_share_*`` over the run's logged steps (each process's first step, its
    warm-up, left out when it has others), and ``other`` (1 minus their sum; None when a share is n/a).
    A share no record carries (NCCL's in-region comm) is None. None for records from before the shares."""
    recs = [r for seg in segments(run) for r in (seg[1:] if len(seg) > 1 else seg)]
    if not any("time_share_fwd_bwd" in r for r in recs):
        return None
    out: dict[str, float | None] = {}
    for key, _ in TIME_SHARES:
        xs = [float(r[key]) for r in recs if isinstance(r.get(key), int | float)]
        out[key] = _mean(xs) if xs else None
    vals = list(out.values())
    out["other"] = None if any(v is None for v in vals) else 1.0 - sum(v for v in vals if v is not None)
    return out


def fsdp(run: Run) -> bool:
    """Whether the run's region sharded its model (the trainer's ``parallelism.kind: fsdp``)."""
    return str((run.summary or {}).get("parallelism", "")).startswith("fsdp")


def fsdp_untimed(run: Run) -> bool:
    """Whether the run sharded its model with a trainer that did not time FSDP's collectives (no
    ``fsdp_all_gather_s`` in its records): its ``comm_time_s`` is then the per-step agreement wait alone."""
    return fsdp(run) and not any(r.get("fsdp_all_gather_s") is not None for r in run.steps)


def slo(run: Run) -> dict:
    """The baseline numbers of one run (NaN/None where the run has no such data)."""
    times = step_times(run)
    s = run.summary or {}
    mem = s.get("memory") or {}
    steps = run.steps
    # Records are sampled (every log_every steps) but every sync round is logged, and a round's step time
    # includes its sync: estimate the whole run as (trained steps x mean step without sync) + all rounds.
    n_steps = sum(seg[-1]["step"] - seg[0]["step"] + 1 for seg in segments(run))
    xr = sum(_exposed(r) for r in [*steps, *run.final_rounds])
    per_step = _mean([float(r["step_time_s"]) - _exposed(r) for r in steps])
    step_sum = per_step * n_steps + xr
    # In-region comm as the trainer measured it (DDP's all-reduce or FSDP's collectives on gloo, and the
    # agreement wait); None where the host cannot see it (NCCL): then n/a, not 0. An FSDP run of a trainer
    # that did not time its collectives: n/a too.
    comm = [float(r["comm_time_s"]) for r in steps if r.get("comm_time_s") is not None]
    ddp = float("nan") if fsdp_untimed(run) else _mean(comm) * n_steps
    ck = [float(r["checkpoint_save_s"]) for r in steps if isinstance(r.get("checkpoint_save_s"), int | float)]
    if not ck and s.get("checkpoint_save_s", {}).get("count"):
        ck = [s["checkpoint_save_s"]["mean"]]
    rec = recoveries(run)
    downs = [r["downtime_s"] for r in rec if "downtime_s" in r]
    return {
        "steps_logged": len(steps),
        "last_step": steps[-1]["step"],
        "step_time_mean_s": _mean(times),
        "step_time_p50_s": percentile(times, 50),
        "step_time_p99_s": percentile(times, 99),
        "comm_fraction": (ddp + xr) / step_sum if step_sum > 0 else float("nan"),
        "in_region_comm_fraction": ddp / step_sum if step_sum > 0 else float("nan"),
        "cross_region_sync_fraction": xr / step_sum if step_sum > 0 else float("nan"),
        "sync_rounds": len(run.rounds),
        "sync_round_mean_s": _mean([float(r["xr_total_s"]) for r in run.rounds]),
        "bytes_across_regions": sum(
            int(r.get("xr_bytes_up", 0)) + int(r.get("xr_bytes_down", 0)) for r in run.rounds
        ),
        "checkpoint_write_mean_s": _mean(ck),
        "checkpoint_write_max_s": max(ck) if ck else float("nan"),
        "checkpoint_writes": len(ck),
        "resume_time_s": s.get("resume_time_s"),
        "checkpoint_load_s": s.get("checkpoint_load_s"),
        "restarts": len(rec),
        "steps_redone": sum(r["steps_redone"] for r in rec),
        "fault_recovery_downtime_s": sum(downs) if downs else (None if rec else 0.0),
        "tokens_per_s": s.get("tokens_per_s"),
        "mfu": s.get("mfu"),
        "hfu": s.get("hfu"),
        "gpu_mem_max_allocated_gib": _gib(mem.get("max_allocated_bytes")),
        "gpu_mem_max_reserved_gib": _gib(mem.get("max_reserved_bytes")),
        "gpu_mem_total_gib": _gib(mem.get("device_total_bytes")),
        "exit": s.get("exit"),
    }


def _gib(v) -> float | None:
    return v / 2**30 if isinstance(v, int | float) else None


# ---------------------------------------------------------------------------------------------------
# output


def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v}{unit}"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if unit == "%":
            return f"{100 * v:.1f}%"
        return f"{v:.4g}{unit}"
    return str(v)


SLO_ROWS = [  # (key, label, unit)
    ("step_time_mean_s", "step time, mean", " s"),
    ("step_time_p50_s", "step time, p50", " s"),
    ("step_time_p99_s", "step time, p99", " s"),
    ("comm_fraction", "comm fraction of step time (in-region + cross-region)", "%"),
    (
        "in_region_comm_fraction",
        "comm fraction: in-region (DDP all-reduce or FSDP collectives, + per-step collective)",
        "%",
    ),
    ("cross_region_sync_fraction", "comm fraction: cross-region sync", "%"),
    ("sync_round_mean_s", "cross-region round, mean", " s"),
    ("checkpoint_write_mean_s", "checkpoint write, mean", " s"),
    ("checkpoint_write_max_s", "checkpoint write, max", " s"),
    ("resume_time_s", "resume time (process start to first new step)", " s"),
    ("fault_recovery_downtime_s", "fault-recovery downtime (sum over restarts)", " s"),
    ("restarts", "restarts seen in metrics", ""),
    ("steps_redone", "steps trained twice after restarts", ""),
    ("tokens_per_s", "tokens/s (last process)", ""),
    ("mfu", "MFU (GPU only)", ""),
    ("hfu", "HFU (GPU only)", ""),
    ("gpu_mem_max_allocated_gib", "GPU memory, max allocated (rank 0)", " GiB"),
    ("gpu_mem_max_reserved_gib", "GPU memory, max reserved (rank 0)", " GiB"),
    ("gpu_mem_total_gib", "GPU memory, device total", " GiB"),
]


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    esc = [[str(c).replace("|", "\\|") for c in r] for r in rows]
    return "\n".join(
        ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        + ["| " + " | ".join(r) + " |" for r in esc]
    )


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError("the report's plots need matplotlib: pip install 'sbatch-gen[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _savefig(plt, fig, path: Path) -> None:
    try:
        with atomic_path(path, fsync=False) as tmp:
            fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)


def plot_loss(plt, runs: list[Run], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        for i, seg in enumerate(segments(run)):
            ax.plot(
                [r["step"] for r in seg],
                [r["loss"] for r in seg],
                label=run.label if i == 0 else None,
                color=f"C{runs.index(run)}",
                linestyle="-" if i == 0 else "--",
            )
        for r in run.rounds[:200]:
            ax.axvline(r["step"], color=f"C{runs.index(run)}", alpha=0.08, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss per region (dashed: after a restart; faint lines: sync rounds)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    _savefig(plt, fig, path)


def plot_step_times(plt, runs: list[Run], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run in enumerate(runs):
        xs = step_times(run)
        if not xs:
            continue
        ax.hist(xs, bins=min(50, max(5, len(xs) // 3)), alpha=0.5, color=f"C{i}", label=run.label)
        for q, ls in ((50, "-"), (99, ":")):
            v = percentile(xs, q)
            ax.axvline(v, color=f"C{i}", linestyle=ls, label=f"{run.label} p{q} {v:.3g}s")
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("logged steps")
    ax.set_title("step-time distribution")
    ax.legend(fontsize="small")
    _savefig(plt, fig, path)


def plot_sync(plt, runs: list[Run], path: Path) -> None:
    with_rounds = [r for r in runs if r.rounds]
    fig, axes = plt.subplots(
        len(with_rounds), 1, figsize=(8, 3.4 * len(with_rounds)), squeeze=False, layout="constrained"
    )
    for ax, run in zip(axes[:, 0], with_rounds, strict=True):
        rounds = run.rounds
        xs = list(range(len(rounds)))
        bottom = [0.0] * len(rounds)
        for i, (key, label) in enumerate(PHASES):
            ys = [float(r.get(key) or 0.0) for r in rounds]
            ax.bar(xs, ys, bottom=bottom, label=label, color=f"C{i}", width=0.85)
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        ticks = xs if len(xs) <= 20 else xs[:: max(1, len(xs) // 20)]
        ax.set_xticks(ticks, [str(rounds[i]["xr_round"]) for i in ticks])
        ax.set_xlabel("round")
        ax.set_ylabel("seconds")
        ax.set_title(f"{run.label}: cross-region sync per round")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _savefig(plt, fig, path)


STATUS_COLORS = {TOOK_PART: "#4caf50", LATE: "#ff9800", ABSENT: "#d32f2f", None: "#eeeeee"}


def plot_participation(plt, part: Participation, path: Path) -> None:
    from matplotlib.artist import Artist
    from matplotlib.colors import ListedColormap
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    codes = {None: 0, TOOK_PART: 1, LATE: 2, ABSENT: 3}
    n = part.last - part.first + 1
    grid = [
        [codes[part.status[reg].get(r)] for r in range(part.first, part.last + 1)] for reg in part.regions
    ]
    fig, ax = plt.subplots(
        figsize=(min(16.0, max(6.0, 2.5 + 0.12 * n)), 1.4 + 0.45 * len(part.regions)), layout="constrained"
    )
    cmap = ListedColormap([STATUS_COLORS[k] for k in (None, TOOK_PART, LATE, ABSENT)])
    ax.imshow(
        grid,
        cmap=cmap,
        vmin=-0.5,
        vmax=3.5,
        aspect="auto",
        interpolation="nearest",
        extent=(part.first - 0.5, part.last + 0.5, len(part.regions) - 0.5, -0.5),
    )
    for y, reg in enumerate(part.regions):
        for e in part.rejoins.get(reg, []):  # replayed rounds, then the round it continued from
            ax.plot(
                [e.get("from_round", e["to_round"]) + 0.5, e["to_round"] + 0.5],
                [y, y],
                color="#1565c0",
                linestyle=":",
                linewidth=1.5,
            )
            ax.plot(e["to_round"] + 0.5, y, marker=">", color="#1565c0", markersize=9, linestyle="none")
        for e in part.leaves.get(reg, []):  # after the last round the region took part in
            ax.plot(e["round"] + 0.5, y, marker="X", color="black", markersize=8, linestyle="none")
    ax.set_yticks(range(len(part.regions)), part.regions)
    ax.set_xlabel("round")
    ax.set_title("participation per round")
    if part.fragments:  # Streaming DiLoCo: each round synced one fragment, named above its column
        nfrag = max(part.fragments.values()) + 1
        for r, f in part.fragments.items():
            ax.text(r, -0.5, f"f{f}", ha="center", va="bottom", fontsize=6 if n > 40 else 8, clip_on=False)
        ax.set_title(f"participation per round (fN: the fragment of {nfrag} the round synced)", pad=14)
    handles: list[Artist] = [
        Patch(color=STATUS_COLORS[k], label=lab)
        for k, lab in (
            (TOOK_PART, "took part"),
            (LATE, "late (delta dropped)"),
            (ABSENT, "absent"),
            (None, "no record"),
        )
    ]
    handles += [
        Line2D([], [], color="#1565c0", marker=">", linestyle=":", label="rejoin (fast-forward)"),
        Line2D([], [], color="black", marker="X", linestyle="none", label="planned leave"),
    ]
    ax.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _savefig(plt, fig, path)


def _participation_md(part: Participation) -> list[str]:
    def wait(reg: str, xs: dict[str, list[float]], f) -> str:
        return _fmt(f(xs[reg]), " s") if xs.get(reg) else "n/a"

    regs = part.regions
    rows = [
        ["rounds taken part", *[str(part.count(g, TOOK_PART)) for g in regs]],
        ["rounds late (delta dropped)", *[str(part.count(g, LATE)) for g in regs]],
        ["rounds absent", *[str(part.count(g, ABSENT)) for g in regs]],
        ["rejoins (fast-forwards)", *[str(len(part.rejoins.get(g, []))) for g in regs]],
        ["planned leaves", *[str(len(part.leaves.get(g, []))) for g in regs]],
        [
            "wait per round while a region was missing, median",
            *[wait(g, part.waits_absent, median) for g in regs],
        ],
        ["wait per round while a region was missing, max", *[wait(g, part.waits_absent, max) for g in regs]],
        ["wait per round with every region, median", *[wait(g, part.waits_full, median) for g in regs]],
    ]
    for f in sorted(set(part.fragments.values())):  # Streaming DiLoCo: the rounds of each fragment
        of_f = {r for r, x in part.fragments.items() if x == f}
        rows.append(
            [
                f"rounds taken part, fragment {f}",
                *[
                    str(sum(1 for r, v in part.status.get(g, {}).items() if r in of_f and v == TOOK_PART))
                    for g in regs
                ],
            ]
        )
    return [
        "## Participation",
        "",
        f"Rounds {part.first}..{part.last}; one row per region. A late region published, but after the round "
        "had closed without it; an absent one did not publish. Waits are `xr_wait_s` of the regions that "
        "took part (n/a: no run directory of that region, or no such round).",
        "",
        "![participation per round](participation.png)",
        "",
        _md_table(["per region", *regs], rows),
        "",
    ]


def _time_shares_md(shares: dict[str, dict[str, float | None] | None]) -> list[str]:
    labels = list(shares)

    def cell(label: str, key: str) -> str:
        s = shares[label]
        return "n/a" if s is None else _fmt(s[key], "%")

    rows = [[lab, *[cell(k, key) for k in labels]] for key, lab in TIME_SHARES]
    rows.append(["other (not attributed)", *[cell(k, "other") for k in labels]])
    return [
        "## Where the time goes",
        "",
        "Mean share of a step's time (`step_time_s`) over the logged steps, each process's first step left "
        "out. On the CPU the parts are disjoint spans of the host's step; on CUDA forward + backward and the "
        "optimizer are device time and in-region communication is not visible (n/a), so the shares need not "
        "add up (docs/trainer.md, Where the time goes).",
        "",
        _md_table(["part of the step", *labels], rows),
        "",
    ]


def build(runs: list[Run]) -> tuple[str, dict]:
    """The Markdown text (image links relative to the report) and the SLO numbers."""
    slos = {run.label: slo(run) for run in runs}
    labels = list(slos)
    lines = ["# Run report", ""]
    rows = []
    for run in runs:
        s = run.summary or {}
        segs = segments(run)
        rows.append(
            [
                run.label,
                _display(run.path),
                f"{segs[0][0]['step']}..{run.steps[-1]['step']}",
                str(len(segs)),
                _fmt(s.get("world_size", run.steps[-1].get("world_size"))),
                _fmt(s.get("device")),
                _fmt(s.get("parallelism")),
                _fmt(s.get("compile")),
                _fmt(s.get("optimizer")),
                _fmt(s.get("exit")),
            ]
        )
    head = [
        "region",
        "run dir",
        "steps logged",
        "processes",
        "world size",
        "device",
        "parallelism",
        "compile",
        "optimizer",
        "exit",
    ]
    lines += [
        _md_table(head, rows),
        "",
    ]
    lines += [
        "## SLO baseline",
        "",
        "Keep this table (and `slo.json` beside it) as the baseline of this job; compare later runs to it.",
        "",
    ]
    lines += [
        _md_table(
            ["metric", *labels],
            [[lab, *[_fmt(slos[k][key], unit) for k in labels]] for key, lab, unit in SLO_ROWS],
        ),
        "",
    ]
    shares = {run.label: time_shares(run) for run in runs}
    if any(v is not None for v in shares.values()):
        lines += _time_shares_md(shares)
    lines += ["## Loss", "", "![loss per region](loss.png)", ""]
    lines += ["## Step time", "", "![step-time distribution](step_time.png)", ""]
    if any(run.rounds for run in runs):
        lines += ["## Cross-region sync", "", "![sync time per round](sync.png)", ""]
        prow = []
        for key, label in PHASES:
            prow.append(
                [
                    label,
                    *[
                        _fmt(_mean([float(r.get(key) or 0.0) for r in run.rounds]), " s")
                        if run.rounds
                        else "n/a"
                        for run in runs
                    ],
                ]
            )
        prow.append(["total", *[_fmt(slos[k]["sync_round_mean_s"], " s") for k in labels]])
        prow.append(["rounds", *[str(slos[k]["sync_rounds"]) for k in labels]])
        prow.append(
            ["MB across regions (up + down)", *[_fmt(slos[k]["bytes_across_regions"] / 1e6) for k in labels]]
        )
        if any("xr_sparse_density" in r for run in runs for r in run.rounds):  # payload_dtype sparse
            prow.append(
                [
                    "sparse: share of each chunk sent; kB up per round",
                    *[
                        f"{run.rounds[-1]['xr_sparse_density']:.2%}; "
                        f"{_mean([float(r.get('xr_bytes_up') or 0) for r in run.rounds]) / 1e3:.3g}"
                        if run.rounds and "xr_sparse_density" in run.rounds[-1]
                        else "-"
                        for run in runs
                    ],
                ]
            )
        lines += ["Mean seconds per round, by phase:", "", _md_table(["phase", *labels], prow), ""]
    part = participation(runs)
    if part is not None:
        lines += _participation_md(part)
    notes = []
    for run in runs:
        if fsdp_untimed(run):
            notes.append(
                f"{run.label}: FSDP ({(run.summary or {}).get('parallelism')}): its trainer did not time the "
                "in-region collectives (all-gathers, reduce-scatters; no fsdp_all_gather_s in its records): "
                "its in-region and total comm fractions are n/a; the cross-region one is measured."
            )
        segs = segments(run)
        gaps = [b["step"] - a["step"] for seg in segs for a, b in zip(seg, seg[1:], strict=False)]
        if any(g > 1 for g in gaps):
            notes.append(
                f"{run.label}: metrics.jsonl logs a subset of steps (train.log_every > 1); step-time "
                "percentiles and fractions are over the logged steps, which include every sync round."
            )
        for r in recoveries(run):
            d = (
                f"{r['downtime_s']:.1f} s down"
                if "downtime_s" in r
                else "downtime not measurable (the step records carry no wall-clock time)"
            )
            notes.append(
                f"{run.label}: restart after step {r['last_step_before']}, resumed at step "
                f"{r['first_step_after']} ({r['steps_redone']} steps redone; {d})."
            )
        for e in run.events:
            if e.get("event") == "xr_rejoin":
                via = ", ".join(map(str, e.get("via") or [])) or "rounds"
                notes.append(
                    f"{run.label}: rejoined the run at step {e.get('step')} ({e.get('why', '?')}): round "
                    f"{e.get('from_round')} -> {e.get('to_round')}, {e.get('replayed', '?')} round(s) "
                    f"replayed via {via}, continued from step {e.get('adopted_step')} "
                    f"({_fmt(e.get('seconds'), ' s')})."
                )
            elif e.get("event") == "xr_leave":
                notes.append(
                    f"{run.label}: planned leave after round {e.get('round')} at step {e.get('step')} "
                    f"({e.get('reason', '?')})."
                )
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines), slos


def _tell_apart(runs: list[Run]) -> None:
    """Two runs of the same region get their directory in the label: its name, or as many of its last
    components as it takes (a baseline's ``base/eu`` against a later ``later/eu``: ``eu (base/eu)``)."""
    base = [run.label for run in runs]
    for depth in range(1, 1 + max(len(run.path.resolve().parts) for run in runs)):
        labels = [
            b if base.count(b) == 1 else f"{b} ({'/'.join(run.path.resolve().parts[-depth:])})"
            for b, run in zip(base, runs, strict=True)
        ]
        if len(set(labels)) == len(labels):
            break
    for run, label in zip(runs, labels, strict=True):
        run.label = label


def write_report(run_dirs: list[Path], out_dir: Path | None = None) -> Path:
    """Read the runs, write ``report.md``, the PNGs and ``slo.json`` into ``out_dir``; return report.md's path.

    Default ``out_dir``: ``report/`` inside the one run directory, or inside the run directories' common
    parent when there are several."""
    if not run_dirs:
        raise ReportError("give at least one run directory")
    runs = [load_run(Path(p)) for p in run_dirs]
    _tell_apart(runs)
    if out_dir is None:
        if len(runs) == 1:
            out_dir = runs[0].path / "report"
        else:
            out_dir = Path(os.path.commonpath([str(r.path.resolve()) for r in runs])) / "report"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text, slos = build(runs)
    plt = _pyplot()
    plot_loss(plt, runs, out_dir / "loss.png")
    plot_step_times(plt, runs, out_dir / "step_time.png")
    if any(run.rounds for run in runs):
        plot_sync(plt, runs, out_dir / "sync.png")
    part = participation(runs)
    if part is not None:
        plot_participation(plt, part, out_dir / "participation.png")
    write_atomic(out_dir / "slo.json", json.dumps(slos, indent=2, default=str) + "\n", fsync=False)
    write_atomic(out_dir / "report.md", text, fsync=False)
    return out_dir / "report.md"
