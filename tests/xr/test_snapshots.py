"""Outer snapshots cross the WAN in the background: the rounds go on while one uploads, it holds the outer
state of its own round (a copy, not the live state), a run that finished waits for its last one, and a
region that stops leaves it behind, half-written and in no manifest."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from sbatch_gen.train.xr import snapshots

from .test_sync import inner_steps, make

pytestmark = pytest.mark.slow  # a sync per test, threads

H = 4


class HeldSnapshots:
    """The real store of the snapshot uploads' own mailbox, each put held until ``release`` is set."""

    def __init__(self, store, release: threading.Event) -> None:
        self._store, self.release, self.held = store, release, threading.Event()

    def put(self, key, data) -> None:
        self.held.set()
        assert self.release.wait(30), "the test never released the snapshot upload"
        self._store.put(key, data)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _region(tmp_path, events):
    """eu alone (rounds close at once), a snapshot every 2 rounds, its uploads held until released."""
    m, s = make(
        "eu",
        tmp_path,
        regions=["eu"],
        snapshot_every=2,
        keep_rounds=1,
        outer_lr=0.7,
        outer_momentum=0.5,
        payload_dtype="fp32",
        log=events.append,
    )
    release = threading.Event()
    mb = s.snap_ex.mailbox
    mb.store = held = HeldSnapshots(mb.store, release)
    s.align(0)
    return m, s, torch.optim.SGD(m.parameters(), lr=0.05), held


def _round(m, s, opt, r):
    inner_steps(m, opt, "eu", range((r - 1) * H + 1, r * H + 1))
    return s.after_optimizer_step(r * H, 32)


def _part(snap_dir, name):
    return torch.frombuffer(bytearray((snap_dir / name / "s00000.bin").read_bytes()), dtype=torch.float32)


def test_rounds_go_on_while_a_snapshot_uploads_and_it_holds_its_own_rounds_state(tmp_path):
    events: list[dict] = []
    m, s, opt, held = _region(tmp_path, events)
    snaps = tmp_path / "t" / "_snap"
    state = {}
    for r in (1, 2, 3):  # snapshot 2 starts at round 2 and is held: round 3 does not wait for it
        rec = _round(m, s, opt, r)
        state[r] = (s.theta_outer.clone(), s.momentum.clone())
        assert "xr_snapshot_s" not in rec
    # the upload started in the background (it may start late on a loaded machine) and is still held
    assert held.held.wait(30) and not (snaps / "r000002" / "_complete.json").exists()
    assert (tmp_path / "t" / "r000001").exists()  # no complete snapshot covers round 1 yet: kept
    assert not torch.equal(state[2][0], state[3][0]) and not torch.equal(state[2][1], state[3][1])

    held.release.set()
    s.wait_snapshot()
    assert (snaps / "r000002" / "_complete.json").exists()
    # the outer state of round 2, bit for bit, although round 3 changed the live one meanwhile
    assert torch.equal(_part(snaps / "r000002", "theta"), state[2][0])
    assert torch.equal(_part(snaps / "r000002", "momentum"), state[2][1])
    assert [e["round"] for e in events if e.get("event") == "xr_snapshot"] == [2]

    rec = _round(m, s, opt, 4)  # its record carries snapshot 2's seconds; snapshot 4 starts
    assert rec["xr_snapshot_s"] > 0
    s.finish(4 * H)
    s.leave(4 * H, "finished")  # as the trainer does at the end
    s.close()  # a run that finished waits for its last snapshot
    assert (snaps / "r000004" / "_complete.json").exists() and not (snaps / "r000002").exists()
    assert torch.equal(_part(snaps / "r000004", "theta"), s.theta_outer)
    done = [e for e in events if e.get("event") == "xr_snapshot"]
    assert [e["round"] for e in done] == [2, 4] and "end_wait_s" in done[1] and "end_wait_s" not in done[0]


def test_a_stopping_region_leaves_its_snapshot_upload_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshots, "CANCEL_WAIT_S", 0.5)
    events: list[dict] = []
    m, s, opt, held = _region(tmp_path, events)
    try:
        for r in (1, 2):
            _round(m, s, opt, r)
        assert held.held.wait(10)
        s.leave(2 * H, "test")  # a stop: the run did not finish
        t0 = time.monotonic()
        s.close()  # does not wait for the held upload
        assert time.monotonic() - t0 < 5
    finally:
        held.release.set()
    gone = [e for e in events if e.get("event") == "xr_snapshot_abandoned"]
    assert gone == [{"event": "xr_snapshot_abandoned", "round": 2, "reason": "the region stops"}]
    assert not (tmp_path / "t" / "_snap" / "r000002" / "_complete.json").exists()
    assert not [e for e in events if e.get("event") == "xr_snapshot"]


# In a fresh interpreter: is a block of N bytes mapped (above glibc's mmap threshold) when malloc'd now? Once
# before a snapshot's copy of the outer state (7.2M parameters: 28.8 MB per copy, as bench overlap's), once
# after it was dropped. glibc's free() of a mapped block up to 32 MiB raises the threshold to its size, for
# good (snapshots.host_copy says what that did to a region's steps).
_THRESHOLD_PROBE = r"""
import ctypes, sys
from types import SimpleNamespace
import torch
from sbatch_gen.train.xr.snapshots import SnapshotSync

libc = ctypes.CDLL("libc.so.6")
if not hasattr(libc, "mallinfo2"):
    print("no mallinfo2"); sys.exit(0)

class Info(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mapped(nbytes):
    before = libc.mallinfo2().hblks
    p = libc.malloc(nbytes)
    got = libc.mallinfo2().hblks - before
    libc.free(p)
    return got == 1

n = 7_200_000
theta, mom = torch.randn(n), torch.randn(n)
ex = SimpleNamespace(fp32_plan=None, owned=lambda plan: [0], at=lambda plan, s: (0, n))
fake = SimpleNamespace(theta_outer=theta, momentum=mom, local_numel=n, ex=ex)
first = mapped(20 << 20)
state = SnapshotSync._copy_outer(fake)
same = torch.equal(state[0], theta) and torch.equal(state[1], mom)
del state
print(first, same, mapped(24 << 20))
"""


def test_a_snapshots_host_copy_leaves_the_allocators_thresholds_alone():
    if sys.platform != "linux":
        pytest.skip("glibc's allocator")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for k in [k for k in env if k.startswith("MALLOC_")] + ["GLIBC_TUNABLES"]:
        env.pop(k, None)  # the thresholds dynamic, as by default
    out = subprocess.run(
        [sys.executable, "-c", _THRESHOLD_PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no mallinfo2":
        pytest.skip("not glibc >= 2.33")
    first, same, after = out.stdout.split()
    assert (first, same) == ("True", "True")  # 20 MiB mapped before: the threshold was below it
    assert after == "True", "the snapshot's copy raised glibc's mmap threshold above 24 MiB"
