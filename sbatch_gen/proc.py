"""Processes on this host, read from /proc. Torch-free.

The run-dir lease (train/lease.py) asks whether its holder still runs; the test and demo helpers
(testing/regions.py) wait for workers to be gone. Both must count a zombie (exited, not yet reaped by its
parent or init) as gone. The metric sinks' process (train/sinkproc.py) and the helpers walk a process's
tree (:func:`descendants`). The node program (node_program.py) keeps its own copy of the walk: it imports
nothing of the package."""

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


def children(pid: int) -> list[int]:
    """The children of process ``pid``: /proc/PID/task/*/children, else (a kernel without
    CONFIG_PROC_CHILDREN) every process whose /proc/N/stat names PID as its parent."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    try:
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(x) for x in f.read().split()]
        return kids
    except FileNotFoundError:  # no children files on this kernel (or the process is gone)
        pass
    except OSError:
        return kids
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:  # the field after the command, which may hold ") "
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 1 and fields[1] == str(pid):
            kids.append(int(name))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...), parents before their children."""
    out, todo = [], [pid]
    while todo:
        found = children(todo.pop())
        out += found
        todo += found
    return out
