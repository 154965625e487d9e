"""What the soaks look for in a job's logs, read whole and unfiltered (torch-free)."""

from __future__ import annotations

from pathlib import Path

TEXT_SUFFIXES = (".log", ".out", ".err", ".txt", "")


def tracebacks(*roots: Path) -> list[str]:
    """Every line with "Traceback" in the text files under ``roots`` (a file itself, or a directory searched
    recursively): the file, the line's number and the lines around it, one string each."""
    found = []
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            if p.suffix not in TEXT_SUFFIXES:
                continue
            lines = p.read_text(errors="replace").splitlines()
            for i, line in enumerate(lines):
                if "Traceback" in line:
                    found.append(f"{p}:{i + 1}:\n" + "\n".join(lines[max(0, i - 3) : i + 12]))
    return found
