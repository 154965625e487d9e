"""JSON-lines files that one process appends to while others read them (metrics.jsonl). Torch-free.

A line counts once its newline is there: one without it is still being written, or was cut by a kill
(the next attempt's writer drops it, :func:`sbatch_gen.train.metrics.drop_cut_record`). Every reader of
metrics.jsonl (`sbatch-gen report`, the metric sinks' process, the GPU check) takes its lines from here.
"""

from __future__ import annotations

from pathlib import Path


def complete_lines(path: Path, start: int = 0, end: int | None = None) -> tuple[list[bytes], int]:
    """The lines of ``path`` from byte ``start`` on (to byte ``end``; default: its end) that their newline
    ended (without it), and the byte after the last of them: where the next read starts, a line being
    written included. No file: ``([], start)``."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return [], start
    with f:
        f.seek(start)
        data = f.read() if end is None else f.read(max(0, end - start))
    done = data.rfind(b"\n") + 1  # the bytes of complete lines
    return data[: done - 1].split(b"\n") if done else [], start + done
