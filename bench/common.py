"""Shared helpers: result files (Markdown + JSON + PNG), machine description, timing statistics."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sbatch_gen.fsutil import atomic_path, write_atomic

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PY = sys.executable


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} x {cpu}, {mem:.0f} GiB RAM, Linux {platform.release()}, Python {platform.python_version()}"


def mem_available() -> int:
    """Bytes of memory available (MemAvailable), for sizing runs to the machine."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if x != x:  # nan
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def md_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(c).replace("|", "\\|") for c in r) + " |")
    return "\n".join(out)


@dataclass
class Table:
    caption: str
    headers: list[str]
    rows: list[list]
    key: str = ""  # name in the JSON file


@dataclass
class Result:
    """One benchmark's output: tables, plots, notes, and headline numbers (for the summary)."""

    name: str
    title: str
    quick: bool
    setup: list[str] = field(default_factory=list)  # how it was measured (bullets)
    tables: list[Table] = field(default_factory=list)
    plots: list[tuple[str, str]] = field(default_factory=list)  # (file name, caption)
    notes: list[str] = field(default_factory=list)
    headline: dict = field(default_factory=dict)  # {label: value}, shown in the summary
    goals: list[tuple[str, str, bool | None]] = field(default_factory=list)  # (goal, measured, met)
    started: float = field(default_factory=time.time)
    # computed from stated inputs, nothing measured: the files carry no date, machine or duration, so a
    # fresh computation reproduces them byte for byte
    analytic: bool = False
    data: dict = field(default_factory=dict)  # raw measurements, written to the JSON file only
    subset: str | None = None  # the subset of the full runs measured (--subset), in the reproduce line

    def table(self, caption: str, headers: list[str], rows: list[list], key: str = "") -> None:
        self.tables.append(Table(caption, headers, rows, key))

    def goal(self, text: str, measured: str, met: bool | None) -> None:
        self.goals.append((text, measured, met))

    def markdown(self) -> str:
        flags = (" --quick" if self.quick else "") + (f" --subset {self.subset}" if self.subset else "")
        again = f"Reproduce: `python -m bench {self.name}{flags}`."
        if self.analytic:
            about = f"Analytic figures: computed from the inputs stated below, nothing measured. {again}"
        else:
            about = (
                f"Measured {now_utc()} on {machine()}; "
                f"{'--quick (tiny sizes, for tests)' if self.quick else 'full run'}; "
                f"took {time.time() - self.started:.0f} s. {again}"
            )
        lines = [f"# {self.title}", "", about, ""]
        if self.setup:
            lines += ["## Setup", ""] + [f"- {s}" for s in self.setup] + [""]
        if self.goals:
            lines += [
                "## Goals",
                "",
                md_table(
                    ["goal", "measured", "met"],
                    [[g, m, "-" if ok is None else ("yes" if ok else "NO")] for g, m, ok in self.goals],
                ),
                "",
            ]
        for t in self.tables:
            lines += [f"## {t.caption}", "", md_table(t.headers, t.rows), ""]
        for fname, cap in self.plots:
            lines += [f"![{cap}]({fname})", "", f"*{cap}*", ""]
        if self.notes:
            lines += ["## Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        return "\n".join(lines)

    def to_json(self) -> dict:
        when = (
            {"analytic": True}
            if self.analytic
            else {"date": now_utc(), "machine": machine(), "seconds": round(time.time() - self.started, 1)}
        )
        return {
            "name": self.name,
            "title": self.title,
            "quick": self.quick,
            **when,
            "headline": self.headline,
            "goals": [{"goal": g, "measured": m, "met": ok} for g, m, ok in self.goals],
            "tables": {t.key or t.caption: {"headers": t.headers, "rows": t.rows} for t in self.tables},
            **({"data": self.data} if self.data else {}),
        }

    def json_text(self) -> str:
        return json.dumps(self.to_json(), indent=1, default=str) + "\n"

    def write(self, out_dir: Path) -> Path:
        md = out_dir / f"{self.name}.md"
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(out_dir / f"{self.name}.json", self.json_text(), fsync=False)
        write_atomic(md, self.markdown(), fsync=False)
        return md


def plt():
    """matplotlib.pyplot with the non-interactive backend (imported only when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as p

    return p


def save_fig(fig, path: Path) -> None:
    with atomic_path(path, fsync=False) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as p

    p.close(fig)


def run(
    cmd: list[str],
    *,
    env: dict | None = None,
    timeout: float = 600,
    cwd: Path | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, timeout=timeout, cwd=cwd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(
            f"command failed ({p.returncode}): {' '.join(map(str, cmd))}\n"
            f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
        )
    return p


def bench_env(extra: dict | None = None) -> dict:
    """Environment for child processes: the repo on sys.path, no launcher variables leaking in."""
    from sbatch_gen.testing.regions import clean_env

    env = clean_env(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
