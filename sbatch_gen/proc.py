"""Processes on this host, read from /proc. Torch-free.

The run-dir lease (train/lease.py) asks whether its holder still runs; the test and demo helpers
(testing/regions.py) wait for workers to be gone. Both must count a zombie (exited, not yet reaped by its
parent or init) as gone."""

from __future__ import annotations

import os


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc/<pid>/stat (R, S, D, Z, ...); "X" when there is no such process
    (or no /proc to read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists (possibly someone else's) and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        pass
    return process_state(pid) != "Z"  # "X": no /proc to read (not Linux), or it went just now
