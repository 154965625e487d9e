"""sbatch_gen.fsutil: the one atomic-write helper (and display_path) that the generator, the trainer and the
benchmarks share."""

import errno
import os
import stat
import threading

import pytest

from sbatch_gen import fsutil
from sbatch_gen.fsutil import atomic_path, display_path, write_atomic


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_writes_str_and_bytes_and_leaves_no_temp_file(tmp_path):
    p = tmp_path / "f.json"
    write_atomic(p, "h\u00e9\n")
    assert p.read_bytes() == "h\u00e9\n".encode()
    write_atomic(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    write_atomic(p, memoryview(bytearray(b"mv")))
    assert p.read_bytes() == b"mv"
    assert os.listdir(tmp_path) == ["f.json"]


def test_mode_is_honoured_else_a_new_files_default(tmp_path, umask_022):
    p = tmp_path / "run.sh"
    write_atomic(p, "#!/bin/sh\n", mode=0o755)
    assert _mode(p) == 0o755
    write_atomic(p, "x", mode=0o600)
    assert _mode(p) == 0o600
    write_atomic(p, "y")  # the old file's mode is not kept: what open(..., "w") gives a new file
    assert _mode(p) == 0o644
    with atomic_path(p, mode=0o750) as tmp:
        tmp.write_text("z")
    assert _mode(p) == 0o750 and p.read_text() == "z"


@pytest.mark.parametrize("fail_at", ["fsync", "replace", "fchmod"])
def test_a_failure_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch, fail_at):
    p = tmp_path / "summary.json"
    p.write_text("old\n")

    def boom(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil.os, fail_at, boom)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(p, "new\n", mode=0o644)
    assert p.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["summary.json"]


def test_atomic_path_removes_the_temp_when_the_writer_fails(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(p) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".model.safetensors.") and tmp.suffix == ".tmp"
        tmp.write_bytes(b"half")
        raise RuntimeError("writer died")
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.safetensors"]
    with atomic_path(p, fsync=False) as tmp:
        tmp.write_bytes(b"new")
    assert p.read_bytes() == b"new" and os.listdir(tmp_path) == ["model.safetensors"]


def test_the_parent_must_exist(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "no" / "f", "x")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "fsync, fsync_dir, files, dirs",
    [(True, False, 1, 0), (False, False, 0, 0), (True, True, 1, 1), (False, True, 0, 1)],
)
def test_fsync_of_the_file_and_of_the_directory_are_parameters(
    tmp_path, monkeypatch, fsync, fsync_dir, files, dirs
):
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(fsutil.os, "fsync", spy)
    write_atomic(tmp_path / "COMPLETE.json", "{}\n", fsync=fsync, fsync_dir=fsync_dir)
    assert (synced.count("file"), synced.count("dir")) == (files, dirs)
    synced.clear()
    with atomic_path(tmp_path / "x.png", fsync=fsync, fsync_dir=fsync_dir) as tmp:
        tmp.write_bytes(b"png")
    assert (synced.count("file"), synced.count("dir")) == (files, dirs)


def test_a_reader_sees_the_old_or_the_new_contents_never_a_part(tmp_path):
    p = tmp_path / "state.bin"
    a, b = b"a" * (1 << 20), b"b" * (3 << 19)
    write_atomic(p, a, fsync=False)
    seen: set[bytes] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            data = p.read_bytes()
            seen.add(data[:1] + str(len(data)).encode())
            assert data in (a, b)

    errors: list[BaseException] = []

    def reader() -> None:
        try:
            read()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(200):
            write_atomic(p, b if i % 2 == 0 else a, fsync=False)
    finally:
        stop.set()
        t.join()
    assert not errors, errors[0]
    assert os.listdir(tmp_path) == ["state.bin"]


def test_display_path(tmp_path, monkeypatch):
    (tmp_path / "sites").mkdir()
    (tmp_path / "sites" / "eu.yaml").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "sites")
    monkeypatch.chdir(tmp_path)
    assert display_path(tmp_path / "sites" / "eu.yaml") == "sites/eu.yaml"
    assert display_path("link/eu.yaml") == "link/eu.yaml"  # a symlink keeps its own name
    assert display_path("/etc/hostname") == "/etc/hostname"  # outside the current directory: as written
