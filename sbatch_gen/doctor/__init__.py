"""``sbatch-gen doctor --site NAME``: check the live cluster (or the SSH hosts) against a site profile and its
render, before the job waits in the queue. Torch-free.

One row per check: check, expected (the profile), found (the cluster), verdict (ok / warn / error / skip), and
for warn and error a one-line hint. The kinds have their own module (:mod:`.slurm`, :mod:`.ssh`); both run
every command through one :class:`~sbatch_gen.doctor.common.Runner`, so tests give them canned outputs.
Nothing here submits a job that runs (Slurm gets ``sbatch --test-only``) or touches a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sbatch_gen.doctor.common import (
    VERDICTS,
    Check,
    CommandMissing,
    Result,
    Runner,
    SubprocessRunner,
    cut,
)
from sbatch_gen.errors import UserError
from sbatch_gen.loader import LoadedSite

__all__ = [
    "Check",
    "CommandMissing",
    "Report",
    "Result",
    "Runner",
    "SubprocessRunner",
    "format_report",
    "run_doctor",
]


@dataclass(frozen=True)
class Report:
    site: str
    kind: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        """No row is an error (warnings do not fail the doctor)."""
        return all(c.verdict != "error" for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {v: sum(c.verdict == v for c in self.checks) for v in VERDICTS}

    def to_dict(self) -> dict[str, object]:
        return {
            "site": self.site,
            "kind": self.kind,
            "checks": [c.to_dict() for c in self.checks],
            "ok": self.ok,
        }


def run_doctor(
    site: LoadedSite, runner: Runner, templates_dir: Path | None = None, cwd: Path | None = None
) -> Report:
    """Every check of the site's kind. ``cwd``: where a user submits or launches from (default: here)."""
    cwd = cwd or Path.cwd()
    kind = site.profile.kind
    if kind == "slurm":
        from sbatch_gen.doctor import slurm
        from sbatch_gen.render import render_site

        rows = slurm.run_checks(site, render_site(site, templates_dir), runner, cwd)
    elif kind == "ssh":
        from sbatch_gen.doctor import ssh

        rows = ssh.run_checks(site, runner, cwd)
    else:
        raise UserError(f"{site.display}: kind: sbatch-gen doctor has no checks for kind {kind!r}")
    return Report(site.name, kind, rows)


CELL_CHARS = 70  # a table cell is cut to this many characters; the hints below the table and --json are not


def format_report(report: Report) -> list[str]:
    """The table (check | expected | found | verdict), then the hints of the warn and error rows, then a
    one-line summary."""
    header = ["check", "expected", "found", "verdict"]
    rows = [
        [c.check, cut(c.expected, CELL_CHARS), cut(c.found, CELL_CHARS), c.verdict] for c in report.checks
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"doctor: site {report.site} (kind {report.kind})", ""]
    for r in [header, ["-" * w for w in widths], *rows]:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    hinted = [c for c in report.checks if c.verdict in ("warn", "error") and c.hint]
    if hinted:
        lines += ["", "what to do:"]
        lines += [f"  {c.verdict} {c.check}: {c.hint}" for c in hinted]
    n = report.counts()
    lines += [
        "",
        f"{n['error']} error(s), {n['warn']} warning(s), {n['ok']} ok, {n['skip']} skipped"
        + ("" if report.ok else ": fix the errors first"),
    ]
    return lines
