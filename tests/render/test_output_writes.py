"""`render` is all-or-nothing: every file is rendered and every destination checked before anything is
written; files are written atomically (temp file + rename); on any failure nothing new is left behind and
the command says why in one line: exit 2 for a bad --out (not a directory, under a file, not writable, an
output path that is a directory), exit 1 for an I/O error while writing. `check` reads out/ without
tracebacks either."""

from __future__ import annotations

import os

import pytest

from .conftest import sg, sg_proc

pytestmark = pytest.mark.slow  # the CLI in subprocesses


def _snapshot(root) -> dict[str, bytes | None]:
    """Every path under root -> its bytes (None for a directory)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_render_writes_every_file_of_every_site(work):
    r = sg("render", "--all", "--out", "o")
    assert r.code == 0, r.err
    names = sorted(os.listdir(work / "o"))
    assert "eu.sbatch" in names and "lab.sh" in names
    assert not [n for n in names if n.startswith(".")], names  # no temp files left
    assert all(os.stat(work / "o" / n).st_mode & 0o777 == 0o755 for n in names)


def test_out_is_a_file(work):
    (work / "o").write_text("not a directory\n")
    before = _snapshot(work)
    r = sg_proc("render", "--all", "--out", "o", cwd=work)
    assert r.code == 2, r.err
    assert "--out o: is a file, not a directory" in _one_line(r.err)
    assert _snapshot(work) == before


def test_out_under_a_file(work):
    (work / "f").write_text("a file\n")
    before = _snapshot(work)
    r = sg_proc("render", "--site", "eu", "--out", "f/sub/out", cwd=work)
    assert r.code == 2, r.err
    line = _one_line(r.err)
    assert "--out f/sub/out:" in line and "f is a file, not a directory" in line
    assert _snapshot(work) == before


def test_output_path_that_is_a_directory_writes_nothing(work):
    # The second file of the render is a directory: before, the first one was already written.
    (work / "o" / "eu.setup.sbatch").mkdir(parents=True)
    before = _snapshot(work)
    r = sg_proc("render", "--site", "eu", "--out", "o", cwd=work)
    assert r.code == 2, r.err
    assert "o/eu.setup.sbatch: is a directory" in _one_line(r.err)
    assert _snapshot(work) == before


def test_output_path_that_is_a_directory_in_a_new_out_creates_no_directories(work):
    r = sg("render", "--all", "--out", "new/o")
    assert r.code == 0
    os.remove(work / "new" / "o" / "us.sbatch")
    (work / "new" / "o" / "us.sbatch").mkdir()
    before = _snapshot(work)
    r = sg("render", "--all", "--out", "new/o")
    assert r.code == 2 and "us.sbatch: is a directory" in _one_line(r.err)
    assert _snapshot(work) == before


def test_read_only_out(work):
    """A really read-only --out: a read-only tmpfs (root ignores directory modes, not a read-only mount)."""
    import subprocess

    (work / "o").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(work / "o")], check=True)
    try:
        r = sg_proc("render", "--site", "eu", "--out", "o", cwd=work)
        assert r.code == 2, r.err
        assert "--out o: directory is not writable" in _one_line(r.err)
        assert os.listdir(work / "o") == []
    finally:
        subprocess.run(["umount", str(work / "o")], check=True)


def test_not_writable_out_as_seen_by_access(work, monkeypatch):
    # The in-process path of the same check: access(W_OK) says no (as on a read-only filesystem).
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **kw: False if os.fspath(p) == "o" else real(p, m, **kw))
    (work / "o").mkdir()
    r = sg("render", "--site", "eu", "--out", "o")
    assert r.code == 2
    assert "--out o: directory is not writable" in _one_line(r.err)
    assert os.listdir(work / "o") == []


def test_io_error_while_writing_rolls_back(work, monkeypatch):
    """Disk full on the third file: the files renamed into place before are restored, the new ones are
    removed, no temp file is left: exit 1."""
    assert sg("render", "--all", "--out", "o").code == 0
    (work / "o" / "eu.sbatch").write_text("old eu\n")
    os.chmod(work / "o" / "eu.sbatch", 0o644)
    os.remove(work / "o" / "lab.sh")
    before = _snapshot(work)
    real = os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    r = sg("render", "--all", "--out", "o")
    assert r.code == 1, r.err
    line = _one_line(r.err)
    assert "cannot write" in line and "No space left on device" in line and "nothing was changed" in line
    monkeypatch.setattr(os, "replace", real)
    assert _snapshot(work) == before
    assert os.stat(work / "o" / "eu.sbatch").st_mode & 0o777 == 0o644


def test_io_error_while_writing_temp_files(work, monkeypatch):
    import tempfile

    def mkstemp(*a, **kw):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    r = sg("render", "--site", "eu", "--out", "new/o")
    assert r.code == 1
    assert "Input/output error" in _one_line(r.err)
    assert not (work / "new").exists()  # the directories it created are removed again


def test_check_with_an_undecodable_or_directory_output(work):
    assert sg("render", "--all").code == 0
    (work / "out" / "eu.sbatch").write_bytes(b"\xff\xfe not utf-8\n")
    r = sg_proc("check", cwd=work)
    assert r.code == 1 and "Traceback" not in r.err
    assert "out/eu.sbatch" in r.out


def test_check_with_out_a_file(work):
    (work / "o").write_text("x\n")
    r = sg_proc("check", "--out", "o", cwd=work)
    assert r.code == 2, r.err
    assert "--out o: is a file, not a directory" in _one_line(r.err)
