"""examples/train_plain.py, the plain-PyTorch example on the public library, as users run it: two regions,
each its own ``torchrun --standalone --nproc-per-node 2`` (CPU, gloo), meeting only in an fs mailbox.

- Both train with DiLoCo (an outer round every H steps) and end with bitwise identical final.pt.
- One region is stopped mid-run through its stop file ($SBATCH_GEN_STOP_FILE, as the rendered job sets it):
  it checkpoints, writes the .ack naming that checkpoint and its workers exit 42; started again on the same (acked)
  stop file it exits 42 at once without training (a torchrun restart); started as the next attempt it
  resumes from the checkpoint and finishes. Both regions still end identical, and bitwise equal to the
  uninterrupted run: the resume continued exactly.
- A region alone finds no quorum at its first round: it checkpoints, acks and exits 42 all the same."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sbatch_gen.contract import ENV_STOP_FILE
from sbatch_gen.testing.regions import clean_env
from sbatch_gen.xr_options import CrossRegion, FsTransport, to_argv

from .conftest import REPO

pytestmark = pytest.mark.slow  # two torchrun regions running the example script

SCRIPT = REPO / "examples" / "train_plain.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS, H, SAVE_EVERY = 20, 5, 5  # 4 outer rounds; a checkpoint at the end of each
TIMEOUT = 240  # per region run: the 2 cores are shared


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A directory of text files (the script reads every file under it): a copy, so that an edit to the
    docs while the tests run changes nothing."""
    d = tmp_path_factory.mktemp("plain-data")
    for p in sorted((REPO / "docs").glob("*.md"))[:3]:
        shutil.copy(p, d / p.name)
    return d


class Region:
    """One region: a torchrun of 2 workers running the example, its output appended to ``<root>/<name>.log``."""

    def __init__(self, root: Path, name: str, data: Path) -> None:
        self.root, self.name, self.data = root, name, data
        self.run_dir = root / name
        self.log = root / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, stop_file: Path | None = None, timeout_s: float = 120) -> None:
        xr = CrossRegion(
            enabled=True,
            run_id="plain",
            region=self.name,
            regions=["a", "b"],
            inner_steps=H,
            timeout_s=timeout_s,
            transport=FsTransport(root=str(self.root / "mailbox")),
        )
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
        cmd += ["--run-dir", str(self.run_dir), "--data", str(self.data), "--steps", str(STEPS)]
        cmd += ["--save-every", str(SAVE_EVERY), *to_argv(xr)]
        env = clean_env({ENV_STOP_FILE: str(stop_file)} if stop_file else None)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.root, start_new_session=True
            )

    def wait(self, timeout: float = TIMEOUT) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"region {self.name} still runs after {timeout} s:\n{self.tail()}") from None

    def workers(self) -> list[int]:
        """The worker processes torchrun started (in sessions of their own)."""
        assert self.proc is not None
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                pids += [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
        return pids

    def signal_workers(self, sig: signal.Signals) -> None:
        for pid in self.workers():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal_workers(signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(timeout=30)

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return f"--- {self.log} ---\n" + "\n".join(lines[-n:])

    def final(self) -> bytes:
        return (self.run_dir / "final.pt").read_bytes()


@pytest.fixture
def regions(tmp_path, data):
    made: list[Region] = []

    def make(root: Path) -> dict[str, Region]:
        root.mkdir(parents=True, exist_ok=True)
        rs = {name: Region(root, name, data) for name in ("a", "b")}
        made.extend(rs.values())
        return rs

    yield make
    for r in made:
        r.kill()


def assert_same_weights(a: Path, b: Path) -> None:
    import torch

    sa, sb = (torch.load(p, weights_only=True) for p in (a, b))
    assert sa.keys() == sb.keys()
    differ = [k for k in sa if not torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8))]
    assert not differ, f"{a} and {b} differ in {differ}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data) -> dict[str, Region]:
    """Both regions from start to end, no stop."""
    root = tmp_path_factory.mktemp("plain-uninterrupted")
    rs = {name: Region(root, name, data) for name in ("a", "b")}
    try:
        for r in rs.values():
            r.start()
        for r in rs.values():
            assert r.wait() == 0, r.tail()
    finally:
        for r in rs.values():
            r.kill()
    return rs


def test_two_regions_train_with_diloco_and_end_with_identical_weights(uninterrupted):
    a, b = uninterrupted["a"], uninterrupted["b"]
    for r in (a, b):
        log = r.log.read_text()
        assert f"region {r.name}, 2 processes, steps 1..{STEPS}" in log, r.tail()
        assert f"done at step {STEPS} after {STEPS // H} outer rounds" in log, r.tail()
        assert "Traceback" not in log, r.tail()
        assert (r.run_dir / "ckpt" / "latest").read_text() == f"step-{STEPS}.pt"
    assert a.final() == b.final(), "final.pt differs between the regions"
    assert_same_weights(a.run_dir / "final.pt", b.run_dir / "final.pt")
    commits = list((a.root / "mailbox").rglob("*_commit*"))
    assert commits, "no round was committed in the mailbox"
    # each region trained on its own batches in between: the logged losses differ
    losses = [[ln for ln in r.log.read_text().splitlines() if " loss " in ln] for r in (a, b)]
    assert losses[0] != losses[1]


def assert_stopped_quietly(rc: int, log: str) -> None:
    """With a stop file the workers exit 0 after their ack (stop.exit_code()): torchrun exits 0 too and
    prints no failure report (no ChildFailedError, no traceback) for the planned stop."""
    assert rc == 0 and "exitcode" not in log and "Traceback" not in log, (rc, log[-3000:])


def _wait_for(path: Path, region: Region, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert region.proc is not None and region.proc.poll() is None, (
            f"exited before {path}:\n{region.tail()}"
        )
        assert time.monotonic() < deadline, f"no {path} after {timeout} s:\n{region.tail()}"
        time.sleep(0.05)


def test_a_stopped_region_checkpoints_acks_exits_and_resumes_exactly(regions, tmp_path, uninterrupted):
    rs = regions(tmp_path / "stop")
    a, b = rs["a"], rs["b"]
    stop0, stop1 = tmp_path / "stop" / "b.attempt-0", tmp_path / "stop" / "b.attempt-1"
    a.start()
    b.start(stop_file=stop0)
    # Once b has checkpointed step H (after outer round 1), request its stop. a is paused meanwhile: in
    # lock-step b cannot pass a round without a, so the stop lands mid-run whatever the machine's load.
    _wait_for(b.run_dir / "ckpt" / f"step-{H}.pt", b)
    a.signal_workers(signal.SIGSTOP)
    stop0.touch()
    a.signal_workers(signal.SIGCONT)
    assert_stopped_quietly(b.wait(), b.log.read_text())

    ack = json.loads(stop0.with_name(stop0.name + ".ack").read_text())
    stopped = ack["step"]
    assert H <= stopped < STEPS, ack
    ckpt = b.run_dir / "ckpt" / f"step-{stopped}.pt"
    assert ack["checkpoint"] == str(ckpt) and ckpt.is_file(), ack
    assert ack["reason"] == f"stop file {stop0}", ack
    assert (b.run_dir / "ckpt" / "latest").read_text() == ckpt.name
    log = b.log.read_text()
    assert f"checkpointed at step {stopped}, exiting 0" in log, b.tail()
    assert f'File "{SCRIPT}"' not in log, (
        b.tail()
    )  # no traceback through the script (torchrun prints its own)

    # torchrun restarting the workers of the same attempt: the acked stop file makes them exit at once
    size = b.log.stat().st_size
    b.start(stop_file=stop0)
    rc = b.wait(120)
    again = b.log.read_text()[size:]
    assert_stopped_quietly(rc, again)
    assert "already checkpointed" in again and "train_plain.py: region" not in again, again

    # the next attempt resumes from the stop checkpoint and finishes with a
    b.start(stop_file=stop1)
    assert b.wait() == 0, b.tail()
    assert a.wait() == 0, a.tail()
    log = b.log.read_text()
    assert f"resumed from {ckpt}" in log, b.tail()
    assert f"region b, 2 processes, steps {stopped + 1}..{STEPS}" in log, b.tail()
    assert a.final() == b.final(), "final.pt differs between the regions"
    # the same bits as the run without a stop: model, optimizer, DiLoCo state and data position resumed
    assert_same_weights(b.run_dir / "final.pt", uninterrupted["b"].run_dir / "final.pt")


def test_a_region_without_quorum_checkpoints_acks_and_exits(regions, tmp_path):
    a = regions(tmp_path / "alone")["a"]
    stop = tmp_path / "alone" / "a.attempt-0"
    a.start(stop_file=stop, timeout_s=3)  # b never comes: round 1 (step H) has no quorum after 3 s
    rc = a.wait()
    log = a.log.read_text()
    assert_stopped_quietly(rc, log)
    ack = json.loads(stop.with_name(stop.name + ".ack").read_text())
    ckpt = a.run_dir / "ckpt" / f"step-{H}.pt"
    assert (ack["step"], ack["checkpoint"], ack["reason"]) == (H, str(ckpt), "no cross-region quorum"), ack
    # the ack created the stop file nobody else had: workers torchrun restarts exit at once
    assert ckpt.is_file() and stop.exists()
    lines = [ln for ln in log.splitlines() if "no cross-region quorum" in ln]
    assert len(lines) == 1 and lines[0].endswith(f"checkpointed at step {H}, exiting 0"), log
    assert "missing: b" in lines[0], lines
    assert 'train_plain.py", line' not in log, log  # no traceback through the script
