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
import signal
import time
from pathlib import Path

import pytest

from .conftest import REPO
from .example_regions import TIMEOUT, Region, assert_same_weights

pytestmark = pytest.mark.slow  # two torchrun regions running the example script

SCRIPT = REPO / "examples" / "train_plain.py"
STEPS, H, SAVE_EVERY = 20, 5, 5  # 4 outer rounds; a checkpoint at the end of each


def region(root: Path, name: str, data: Path) -> Region:
    return Region(root, name, data, SCRIPT, STEPS, H, SAVE_EVERY)


@pytest.fixture
def regions(tmp_path, example_data):
    made: list[Region] = []

    def make(root: Path) -> dict[str, Region]:
        root.mkdir(parents=True, exist_ok=True)
        rs = {name: region(root, name, example_data) for name in ("a", "b")}
        made.extend(rs.values())
        return rs

    yield make
    for r in made:
        r.kill()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, example_data) -> dict[str, Region]:
    """Both regions from start to end, no stop."""
    root = tmp_path_factory.mktemp("plain-uninterrupted")
    rs = {name: region(root, name, example_data) for name in ("a", "b")}
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
