"""What every doctor check shares: the row it yields, the one way it runs a command, and the parsers of
Slurm's ``Key=Value`` output. Torch-free.

Every command goes through a :class:`Runner` (subprocess with a timeout), so the unit tests hand the checks
a fake one with canned outputs. A command that is not installed raises :class:`CommandMissing`; each kind
decides whether that ends the doctor (sbatch, scontrol: the wrong machine) or is one failed row.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

from sbatch_gen import errors
from sbatch_gen.profiles.types import slurm_time_seconds

Verdict = Literal["ok", "warn", "error", "skip"]
VERDICTS: tuple[Verdict, ...] = ("ok", "warn", "error", "skip")


@dataclass(frozen=True)
class Check:
    """One row: what was checked, what the profile expects, what the cluster has, the verdict, and for warn
    and error one line on what to do."""

    check: str
    expected: str
    found: str
    verdict: Verdict
    hint: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return asdict(self)


def ok(check: str, expected: str, found: str) -> Check:
    return Check(check, expected, found, "ok")


def skip(check: str, expected: str, found: str) -> Check:
    return Check(check, expected, found, "skip")


def warn(check: str, expected: str, found: str, hint: str) -> Check:
    return Check(check, expected, found, "warn", hint)


def error(check: str, expected: str, found: str, hint: str) -> Check:
    return Check(check, expected, found, "error", hint)


# ---------------------------------------------------------------------------------------------------
# Running commands


@dataclass(frozen=True)
class Result:
    """What a command did: exit status (124: timed out), stdout and stderr."""

    rc: int
    out: str = ""
    err: str = ""

    def message(self) -> str:
        """The command's own words on what went wrong, on one line (stderr, else stdout)."""
        text = self.err.strip() or self.out.strip() or f"exit status {self.rc}"
        return "; ".join(line.strip() for line in text.splitlines() if line.strip())


class CommandMissing(Exception):
    """The program is not installed here (not on PATH)."""

    def __init__(self, name: str):
        super().__init__(f"{name} not found")
        self.name = name


class Runner(Protocol):
    def __call__(
        self, argv: Sequence[str], *, cwd: Path | None = None, timeout_s: float | None = None
    ) -> Result: ...


class SubprocessRunner:
    """Runs a command with its output captured, no stdin, and a timeout (the doctor never waits forever on a
    hung controller or an ssh that does not answer)."""

    def __init__(self, timeout_s: float = 60):
        self.timeout_s = timeout_s

    def __call__(
        self, argv: Sequence[str], *, cwd: Path | None = None, timeout_s: float | None = None
    ) -> Result:
        limit = timeout_s if timeout_s is not None else self.timeout_s
        try:
            p = subprocess.run(
                list(argv),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=limit,
            )
        except FileNotFoundError:
            raise CommandMissing(argv[0]) from None
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return Result(124, out, f"{argv[0]} did not answer within {limit:g} s")
        except OSError as e:
            return Result(126, "", f"{argv[0]}: {e.strerror or e}")
        return Result(p.returncode, p.stdout, p.stderr)


# ---------------------------------------------------------------------------------------------------
# Parsing what Slurm prints

# A key of `scontrol -o show ...` output: a space, then a name, then '='. Values may hold spaces
# (OS=Linux 6.1 #1 SMP) and '=' (TRES=cpu=16,mem=32G), so split only before the next key.
_KEY_START = re.compile(r"\s+(?=[A-Za-z][A-Za-z0-9_/:.]*=)")


def parse_oneliner(line: str) -> dict[str, str]:
    """One record of ``scontrol -o show partition|node``: ``{"PartitionName": "debug", "State": "UP", ...}``
    (the first occurrence of a key wins)."""
    out: dict[str, str] = {}
    for part in _KEY_START.split(line.strip()):
        key, sep, value = part.partition("=")
        if sep:
            out.setdefault(key, value.strip())
    return out


_CONFIG_LINE = re.compile(r"^([A-Za-z][A-Za-z0-9_/:.()]*)\s*=\s?(.*)$")


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config``: ``Key   = value`` lines (section titles and status lines are left out)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _CONFIG_LINE.match(line.strip())
        if m:
            out.setdefault(m.group(1), m.group(2).strip())
    return out


def leading_int(value: str | None) -> int | None:
    """``"5 sec"`` -> 5, ``"120"`` -> 120, anything else -> None."""
    m = re.match(r"\s*(\d+)", value or "")
    return int(m.group(1)) if m else None


UNLIMITED_WORDS = {"UNLIMITED", "INFINITE", "NONE"}


def limit_seconds(value: str) -> float | None:
    """A Slurm time limit as printed (``UNLIMITED``, ``INFINITE``, ``2-00:00:00``, ``04:00:00``, ``30``
    minutes): seconds, ``inf`` for no limit, None when it cannot be read."""
    v = value.strip()
    if v.upper() in UNLIMITED_WORDS:
        return float("inf")
    try:
        return float(slurm_time_seconds(v))
    except ValueError:
        return None


def grace_seconds(value: str | None) -> int | None:
    """A grace time: plain seconds (``scontrol show partition``: GraceTime=120) or a duration
    (``sacctmgr show qos``: 00:02:00); empty is 0."""
    v = (value or "").strip()
    if not v:
        return 0
    if v.isdigit():
        return int(v)
    if ":" in v or "-" in v:
        try:
            return slurm_time_seconds(v)
        except ValueError:
            return 0 if set(v) <= set("0:-") else None
    return None


def split_list(value: str | None) -> list[str]:
    """``a,b,c`` -> [a, b, c]; ``(null)`` and empty -> []."""
    v = (value or "").strip()
    if v in ("", "(null)", "N/A"):
        return []
    return [x.strip() for x in v.split(",") if x.strip()]


def cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, the ellipsis included (a table cell)."""
    return text if len(text) <= limit else errors.cut(text, limit - 1)
