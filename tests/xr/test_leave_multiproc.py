"""A crashed region's leave, announced by the node program's run-trainer: two regions as torchrun processes
under run-trainer (as the launchers run them) on an fs mailbox, heartbeats off and grace_s 60 s, so that
without the announcement the survivor would wait a minute in every round it closes without the crashed one.

us's trainer dies (its worker SIGKILLed: torchrun exits non-zero, no stop); run-trainer announces us's leave;
eu's next rounds close on "leave" within seconds; us, restarted with --resume auto, rejoins as after a planned
stop, and both regions end on the same bits."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from sbatch_gen.proc import descendants
from sbatch_gen.testing.regions import launch_region
from sbatch_gen.xr_options import FsTransport

from .test_multiproc import TIMEOUT, assert_same_params, metrics, write_config, xr

pytestmark = pytest.mark.slow  # torchrun regions: the multi-process tier

GRACE_S = 60.0


def _wait_for(path, runs, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        for r in runs:
            assert r.poll()[0] is None, f"{r.region} exited while waiting for {what}:\n{r.tail()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _trainers(run) -> list[int]:
    """The region's trainer processes: torchrun's workers, below run-trainer and the agent."""
    out = []
    for pid in (d for p in run.procs for d in descendants(p.pid)):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        trainer = b"sbatch_gen.train" in cmdline or b"sbatch_gen.testing.faults" in cmdline
        if trainer and b"torch.distributed.run" not in cmdline:
            out.append(pid)
    return out


def _closed_without(mailbox, region: str) -> bool:
    for commit in mailbox.glob("r*/_commit.json"):
        try:
            members = json.loads(commit.read_text())["members"]
        except (OSError, ValueError):
            continue  # (being written)
        if region not in members:
            return True
    return False


def test_a_crash_is_announced_and_the_survivor_closes_its_rounds_on_the_leave(tmp_path, repo, data_dir):
    cfg = write_config(tmp_path, repo, checkpoint={"every": 8, "keep_last": 2}, train={"steps": 48})
    transport = FsTransport(root=str(tmp_path / "mailbox"))
    opts = dict(
        min_regions=1, grace_s=GRACE_S, heartbeat_s=None, keep_rounds=20, snapshot_every=12, timeout_s=600
    )
    env = {"SBATCH_GEN_TEST_STEP_SLEEP_S": "0.15"}

    def launch(region: str, attempt: int):
        return launch_region(
            xr(region, transport, **opts),
            config=cfg,
            run_dir=tmp_path / region,
            data_path=data_dir,
            nproc=1,
            env=env,
            stop_file=tmp_path / "stop" / f"{region}.attempt-{attempt}",
        )

    (tmp_path / "stop").mkdir()
    eu, us = launch("eu", 0), launch("us", 0)
    _wait_for(
        tmp_path / "us" / "checkpoints" / "step-8" / "COMPLETE.json", [eu, us], "us's step-8 checkpoint"
    )
    _wait_for(tmp_path / "mailbox" / "mp" / "r000002" / "_commit.json", [eu, us], "round 2")
    (trainer,) = _trainers(us)
    os.kill(trainer, signal.SIGKILL)  # a crash: nothing of the trainer announces anything
    assert us.wait(60) == [1], us.tail()  # torchrun's status, through run-trainer
    presence = json.loads((tmp_path / "mailbox" / "mp" / "_presence" / "us.json").read_text())
    assert (presence["state"], presence["why"]) == ("leaving", "torchrun exited with status 1")
    assert presence["round"] >= 2 and presence["step"] >= 8  # where us was: its newest published round
    said = [ln for ln in us.tail(400).splitlines() if "announced the leave" in ln]
    assert len(said) == 1 and said[0].endswith(
        f"] announced the leave of region us in the mailbox fs:{tmp_path / 'mailbox' / 'mp'} after torchrun "
        f"exited with status 1 (round {presence['round']}, step {presence['step']})"
    ), us.tail()

    # eu closes a round without us within seconds of the crash (waiting out grace_s, it would take 60)
    deadline = time.monotonic() + 30
    while not _closed_without(tmp_path / "mailbox" / "mp", "us"):
        assert eu.poll()[0] is None, eu.tail()
        assert time.monotonic() < deadline, f"no round closed without us in 30 s:\n{eu.tail()}"
        time.sleep(0.05)

    us2 = launch("us", 1)  # the requeue: --resume auto from its step-8 checkpoint
    assert eu.wait(TIMEOUT) == [0], eu.tail()
    assert us2.wait(TIMEOUT) == [0], us2.tail()

    rounds = [x for x in metrics(tmp_path / "eu") if "xr_round" in x]
    missed = [x for x in rounds if "us" in x["xr_absent"]]
    assert missed, "us was never absent"
    # closed on us's leave, not after grace_s (60 s: heartbeats are off, so nothing else could tell)
    assert all(x["xr_close_reason"] == "leave" for x in missed), [
        (x["xr_round"], x["xr_close_reason"]) for x in missed
    ]
    assert max(x["xr_wait_s"] for x in missed) < 15, [(x["xr_round"], x["xr_wait_s"]) for x in missed]
    rejoin = [x for x in metrics(tmp_path / "us") if x.get("event") == "xr_rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["from_round"] >= 2, rejoin
    assert_same_params(tmp_path / "eu", tmp_path / "us")
    # the restart wrote joined over the crash's record, then its own leave at the end
    final = json.loads((tmp_path / "mailbox" / "mp" / "_presence" / "us.json").read_text())
    assert final["state"] == "leaving" and final["why"] == ""
