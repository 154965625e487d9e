"""Small file-system helpers shared by the generator, the trainer and the benchmarks. Torch-free.

:func:`write_atomic` / :func:`atomic_path`: replace a file so that a reader (or a crash) sees either the
old contents or the complete new ones, never a part: the data goes to a temp file beside the target
(``.<name>.<random>.tmp``, so listings that skip dot-files skip it), which is then renamed over it. A
failure removes the temp file and leaves the old file as it was. Create-if-absent writes (``link()``,
``O_EXCL``) and directory renames are not this pattern and do not use it.

:func:`display_path`: a path as messages and rendered headers show it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

_TEMP_TRIES = 100


def _open_temp(path: Path) -> tuple[int, Path]:
    """Create a new, empty temp file beside ``path``; return (a descriptor open for writing, its path).
    Created like ``open(..., "w")`` would create a new file: mode 0o666 less the umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_TEMP_TRIES):
        tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: no free temp file name for {path.name} after {_TEMP_TRIES} tries")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish(tmp: Path, path: Path, fsync_dir: bool) -> None:
    os.replace(tmp, path)
    if fsync_dir:
        _fsync_dir(path.parent)


def write_atomic(
    path: str | os.PathLike[str],
    data: str | bytes | bytearray | memoryview,
    *,
    mode: int | None = None,
    fsync: bool = True,
    fsync_dir: bool = False,
) -> None:
    """Replace ``path`` with ``data`` (``str``: written as UTF-8) atomically.

    ``mode``: the new file's permission bits (None: those a newly created file gets, 0o666 less the umask;
    the old file's mode is not kept). ``fsync``: flush the data to disk before the rename, so a crash
    cannot leave the new name holding a partial file. ``fsync_dir``: also flush the directory after the
    rename, so the new name itself survives a crash (for a file whose presence means "done"). The parent
    directory must exist."""
    path = Path(path)
    fd, tmp = _open_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        _finish(tmp, path, fsync_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike[str],
    *,
    mode: int | None = None,
    fsync: bool = True,
    fsync_dir: bool = False,
) -> Iterator[Path]:
    """Like :func:`write_atomic`, for a writer that wants a file name (``savefig``, ``save_file``): yields
    the temp file's path (an empty file that the writer may overwrite), renamed over ``path`` when the
    block ends without an exception, removed when it raises. The writer must name its output format
    itself: the temp file's name ends in ``.tmp``."""
    path = Path(path)
    fd, tmp = _open_temp(path)
    os.close(fd)
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _finish(tmp, path, fsync_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def display_path(p: str | os.PathLike[str]) -> str:
    """A path as shown to people: relative to the current directory when below it (so messages and
    rendered headers do not depend on where the checkout lives)."""
    p, cwd = Path(p), Path.cwd()
    # as written (a symlink keeps its own name), else with links resolved
    for path, base in ((Path(os.path.abspath(p)), Path(os.path.abspath(cwd))), (p.resolve(), cwd.resolve())):
        try:
            return path.relative_to(base).as_posix()
        except ValueError:
            pass
    return p.as_posix()
