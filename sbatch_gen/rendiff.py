"""Diffs of many rendered files, a shared change shown once.

A template change is the same hunk in every render that uses the changed lines (8 files in out/, 6 in
examples/out/). `grouped_diff` finds the hunks that several files carry (the same removed and added lines,
wherever they are) and prints each once, with the files that carry it; then, per file, a unified diff of
only its own hunks. A change of one site's profile is a hunk of that site's file alone: it is printed as
`git diff` would. Nothing here renders or reads files; torch-free like the rest of the CLI side.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

_HUNK_HEAD = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@")
# The header line every render changes whenever an input does (sbatch_gen/render.py, _common.j2 header)
_INPUTS_SHA = "#   inputs sha256: "


@dataclass(frozen=True)
class FileChange:
    """One file's old and new text (None: the file does not exist on that side), named as printed."""

    name: str
    old: str | None
    new: str | None
    note: str = ""  # a line printed before the file's diff (e.g. why it is to be deleted)


@dataclass
class Hunk:
    head: str  # the "@@ -a,b +c,d @@" line
    lines: list[str]  # the body: " context", "-removed", "+added", each ending in a newline

    @property
    def key(self) -> tuple[str, ...]:
        """What the hunk changes, without its place: its removed and added lines, in order."""
        return tuple(x for x in self.lines if x[:1] in "-+")

    @property
    def inputs_sha_only(self) -> bool:
        """The hunk changes the header's inputs sha256 and nothing else."""
        return all(x[1:].startswith(_INPUTS_SHA) for x in self.key)


@dataclass
class _FileHunks:
    change: FileChange
    header: list[str]  # the "--- a/..." and "+++ b/..." lines
    hunks: list[Hunk] = field(default_factory=list)


def _lines(text: str | None) -> list[str]:
    return [] if text is None else text.splitlines(keepends=True)


def _newline(x: str) -> str:
    return x if x.endswith("\n") else x + "\n\\ No newline at end of file\n"


def _hunks(change: FileChange) -> _FileHunks:
    raw = [
        _newline(x)
        for x in difflib.unified_diff(
            _lines(change.old),
            _lines(change.new),
            fromfile=f"a/{change.name}" if change.old is not None else "/dev/null",
            tofile=f"b/{change.name}" if change.new is not None else "/dev/null",
        )
    ]
    out = _FileHunks(change, raw[:2])
    for x in raw[2:]:
        if x.startswith("@@"):
            out.hunks.append(Hunk(x, []))
        else:
            out.hunks[-1].lines.append(x)
    return out


def file_diff(change: FileChange) -> str:
    """The plain unified diff of one file ("" when old and new are the same)."""
    fh = _hunks(change)
    if not fh.hunks:
        return ""
    note = f"# {change.name}: {change.note}\n" if change.note else ""
    return note + "".join(fh.header) + "".join(h.head + "".join(h.lines) for h in fh.hunks)


def grouped_diff(changes: list[FileChange]) -> str:
    """The diff of every file in `changes`, each hunk that two or more files carry printed once.

    Shared hunks come first, numbered, each with the files that carry it (and where, in each) and its body
    as the first of them has it (context lines may differ between files; the changed lines do not). A
    header's new inputs sha256, which every render whose inputs changed has, is then one line naming
    those files. Then each file's own hunks, as a unified diff with its ---/+++ lines; a file whose every
    hunk is shared gets one line naming the shared changes it carries. A file created or deleted is never
    grouped. Without shared hunks the result is the files' plain unified diffs, one after the other."""
    files = [_hunks(c) for c in changes]
    files = [f for f in files if f.hunks]
    carriers: dict[tuple[str, ...], list[tuple[_FileHunks, Hunk]]] = {}
    for f in files:
        if f.change.old is None or f.change.new is None:
            continue
        for h in f.hunks:
            carriers.setdefault(h.key, []).append((f, h))
    shared = {k: v for k, v in carriers.items() if len({id(f) for f, _ in v}) > 1}
    number = {k: i for i, k in enumerate(shared, 1)}
    out: list[str] = []
    for k, where in shared.items():
        names = list(dict.fromkeys(f.change.name for f, _ in where))
        out.append(f"# shared change {number[k]} of {len(shared)}: the same lines in {len(names)} files\n")
        for f, h in where:
            m = _HUNK_HEAD.match(h.head)
            at = f" (line {m.group(1)} -> {m.group(2)})" if m else ""
            out.append(f"#   {f.change.name}{at}\n")
        out.append(f"--- a/{names[0]} (and the files above)\n+++ b/{names[0]} (and the files above)\n")
        first = where[0][1]
        out.append(first.head + "".join(first.lines))
    header_only = []
    if shared:
        header_only = [f.change.name for f in files if any(h.inputs_sha_only for h in f.hunks)]
        if header_only:
            out.append(f"# the header's inputs sha256 changed in: {', '.join(header_only)}\n")
    for f in files:
        own = [h for h in f.hunks if h.key not in number and not (header_only and h.inputs_sha_only)]
        carried = sorted({number[h.key] for h in f.hunks if h.key in number})
        also = ""
        if carried:
            also = f"# {f.change.name}: also shared change{'s' if len(carried) > 1 else ''} "
            also += ", ".join(map(str, carried)) + " (above)\n"
        if not own:
            out.append(also)
            continue
        if shared:
            out.append(also or f"# {f.change.name}: its own changes\n")
        if f.change.note:
            out.append(f"# {f.change.name}: {f.change.note}\n")
        out.append("".join(f.header) + "".join(h.head + "".join(h.lines) for h in own))
    return "".join(out)
