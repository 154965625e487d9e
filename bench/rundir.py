"""What a trainer run leaves in its run dir, as the benchmarks read it: the records of ``metrics.jsonl``
(after the run, or as they appear: :class:`Watch`) and ``summary.json``."""

from __future__ import annotations

import json
import time
from pathlib import Path


def read_jsonl(f: Path) -> list[dict]:
    """Every record of the JSON-lines file ``f``; none when it does not exist."""
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []


def read_records(run_dir: Path) -> list[dict]:
    """Every record of ``<run_dir>/metrics.jsonl``, events included."""
    return read_jsonl(run_dir / "metrics.jsonl")


def step_records(recs: list[dict]) -> list[dict]:
    """The step records among ``recs`` (no events)."""
    return [r for r in recs if "event" not in r and "step_time_s" in r]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


class Watch:
    """A region's step records as the bench sees them appear (wall time, step): its progress over time
    (``records``: every record, events included)."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos, self.buf = path, 0, b""
        self.seen: list[tuple[float, dict]] = []
        self.records: list[tuple[float, dict]] = []

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.pos += len(chunk)
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        now = time.time()
        for line in lines:
            if line.strip():
                rec = json.loads(line)
                self.records.append((now, rec))
                if "event" not in rec and "step" in rec:
                    self.seen.append((now, rec))
