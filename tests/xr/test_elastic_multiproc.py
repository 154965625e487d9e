"""Elastic regions with real processes: each region a torchrun with 2 processes (gloo) running the real
trainer, meeting only in the mailbox (a directory, or a real S3 server with conditional writes).

A region is killed, stopped through its stop file, or never comes; the other one must keep training
with no stall beyond grace_s per round, and a returning region must rejoin bit-identically."""

from __future__ import annotations

import json
import re
import time

import pytest

from sbatch_gen.testing.regions import launch_region
from sbatch_gen.xr_options import FsTransport

from .conftest import KEY_ENV, SECRET_ENV
from .test_multiproc import (
    TIMEOUT,
    assert_same_params,
    metrics,
    metrics_or_none,
    run_both,
    s3_transport,
    write_config,
    xr,
)

pytestmark = pytest.mark.slow  # torchrun regions: the multi-process tier

# "one poll": the longest poll interval (poll_max_s); the waits measured here overshoot grace_s by 0.1-0.5 s
# (a few store requests and a listing before the close, on 2 cores shared with the other region's start-up
# and, for S3, the server)
POLL_SLACK_S = 1.0


def _wait_for(path, runs, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for r in runs:
            assert r.poll()[0] is None, f"{r.region} exited while waiting for {what}:\n{r.tail()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _stopped_quietly(run, stop) -> bool:
    """With a stop file the workers exit 0 after their ack: torchrun exits 0 and reports no failure."""
    log = run.tail(400)
    return stop.with_name(stop.name + ".ack").exists() and "exitcode" not in log and "Traceback" not in log


def _rounds(run_dir):
    return [x for x in metrics(run_dir) if "xr_round" in x]


def _assert_bounded_waits(run_dir, grace_s: float, absent: str) -> list[dict]:
    """Every round ``absent`` missed: the survivor waited at most grace_s plus one poll."""
    missed = [x for x in _rounds(run_dir) if absent in x["xr_absent"]]
    assert missed, "the other region was never absent"
    worst = max(x["xr_wait_s"] for x in missed)
    assert worst <= grace_s + POLL_SLACK_S, (worst, [(x["xr_round"], x["xr_wait_s"]) for x in missed])
    return missed


def test_survivor_finishes_alone_then_the_lost_region_rejoins_from_the_snapshot(tmp_path, repo, data_dir):
    """us is SIGKILLed after round 2. eu closes every later round alone after grace_s and finishes all
    40 steps alone. Its cleanup (keep_rounds 1, a snapshot every 2 rounds) has deleted the rounds us
    missed, so us, restarted afterwards from its step-8 checkpoint, fast-forwards from the newest outer
    snapshot, finishes at once, and holds exactly eu's final parameters."""
    grace = 1.0
    cfg = write_config(tmp_path, repo, checkpoint={"every": 8, "keep_last": 2}, train={"steps": 40})
    transport = FsTransport(root=str(tmp_path / "mailbox"))
    opts = dict(min_regions=1, grace_s=grace, keep_rounds=1, snapshot_every=2, timeout_s=60)
    env = {"SBATCH_GEN_TEST_STEP_SLEEP_S": "0.1"}

    def launch(r):
        return launch_region(
            xr(r, transport, **opts), config=cfg, run_dir=tmp_path / r, data_path=data_dir, env=env
        )

    eu, us = launch("eu"), launch("us")
    _wait_for(
        tmp_path / "us" / "checkpoints" / "step-8" / "COMPLETE.json", [eu, us], "us's step-8 checkpoint"
    )
    _wait_for(tmp_path / "mailbox" / "mp" / "r000002" / "_commit.json", [eu, us], "round 2")
    us.kill()
    t0 = time.monotonic()
    assert eu.wait(TIMEOUT) == [0], eu.tail()
    eu_wall = time.monotonic() - t0
    missed = _assert_bounded_waits(tmp_path / "eu", grace, "us")
    # "stale" once eu has watched us's heartbeat stand still for 3 x heartbeat_s (5 s by default)
    assert all(x["xr_members"] == ["eu"] and x["xr_close_reason"] in ("grace", "stale") for x in missed)
    assert _rounds(tmp_path / "eu")[-1]["xr_round"] == 10
    # the whole rest of the run took about (rounds x (grace + training)), not a timeout
    assert eu_wall < len(missed) * (grace + POLL_SLACK_S + 4 * 0.1 + 3) + 30, eu_wall
    mailbox = tmp_path / "mailbox" / "mp"
    assert not (mailbox / "r000003").exists() and (mailbox / "_snap" / "r000010" / "_complete.json").exists()

    us2 = launch("us")
    assert us2.wait(TIMEOUT) == [0], us2.tail()
    rejoin = [x for x in metrics(tmp_path / "us") if x.get("event") == "xr_rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["via"] == ["snapshot r000010"], rejoin
    # the run had ended: us continues at its last step (the trainer caps the estimate at train.steps)
    assert rejoin[0]["to_round"] == 10 and 40 <= rejoin[0]["adopted_step"] < 44
    assert _rounds(tmp_path / "us")[-1]["xr_round"] == 2  # no round after the rejoin: nothing left to train
    assert_same_params(tmp_path / "eu", tmp_path / "us")


def test_restarted_region_rejoins_midrun_and_is_bitwise_equal_from_its_first_round_back(
    tmp_path, repo, data_dir, s3server, bucket
):
    """Over a real S3 server (conditional writes): us is SIGKILLed after round 2, eu goes on alone; us is
    restarted with --resume auto once it has missed at least 2 rounds, replays the committed rounds from
    the mailbox, takes part in the next round, and both end with identical parameters."""
    grace = 2.0
    transport = s3_transport(s3server, bucket)
    env = {
        **s3server.env(),
        KEY_ENV: s3server.env()["AWS_ACCESS_KEY_ID"],
        SECRET_ENV: s3server.env()["AWS_SECRET_ACCESS_KEY"],
        "SBATCH_GEN_TEST_STEP_SLEEP_S": "0.1",
    }
    # eu waits at a step boundary (SBATCH_GEN_TEST_STEP_GATE) from round 4 until the restarted us has
    # rejoined, so us is back before eu ends however slow its start (python, torch) is on a loaded machine
    # (without the gate, runs beside other test processes came back after eu had ended, 48 and 80 steps;
    # with it the run's length no longer matters: 48 steps, 12 rounds, leave rounds after the rejoin)
    gate = tmp_path / "eu-waits-for-us"
    cfg = write_config(tmp_path, repo, checkpoint={"every": 8, "keep_last": 2}, train={"steps": 48})
    opts = dict(min_regions=1, grace_s=grace, keep_rounds=20, snapshot_every=100, timeout_s=60)

    def launch(r):
        more = {"SBATCH_GEN_TEST_STEP_GATE": str(gate)} if r == "eu" else {}
        return launch_region(
            xr(r, transport, **opts),
            config=cfg,
            run_dir=tmp_path / r,
            data_path=data_dir,
            env={**env, **more},
        )

    client = s3server.client()

    def committed(r: int) -> bool:
        resp = client.list_objects_v2(Bucket=bucket, Prefix=f"xr/mp/r{r:06d}/_commit.json")
        return resp.get("KeyCount", 0) > 0

    def wait_round(r, runs):
        deadline = time.monotonic() + TIMEOUT
        while not committed(r):
            for x in runs:
                assert x.poll()[0] is None, x.tail()
            assert time.monotonic() < deadline
            time.sleep(0.05)

    eu, us = launch("eu"), launch("us")
    wait_round(2, [eu, us])
    _wait_for(
        tmp_path / "us" / "checkpoints" / "step-8" / "COMPLETE.json", [eu, us], "us's step-8 checkpoint"
    )
    us.kill()
    wait_round(4, [eu])  # us misses at least rounds 3 and 4
    gate.touch()  # eu waits at its next step boundary until us is back
    us2 = launch("us")
    deadline = time.monotonic() + TIMEOUT
    while not any(x.get("event") == "xr_rejoin" for x in metrics_or_none(tmp_path / "us")):
        assert eu.poll()[0] is None and us2.poll()[0] is None, (eu.tail(), us2.tail())
        assert time.monotonic() < deadline, us2.tail()
        time.sleep(0.1)
    gate.unlink()
    run_both([eu, us2])
    assert_same_params(tmp_path / "eu", tmp_path / "us")
    _assert_bounded_waits(tmp_path / "eu", grace, "us")
    m = metrics(tmp_path / "us")
    rejoin = [x for x in m if x.get("event") == "xr_rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["via"] == ["rounds"] and rejoin[0]["from_round"] == 2
    back = rejoin[0]["to_round"]
    assert back >= 4 and rejoin[0]["replayed"] == back - 2
    after = [x for x in _rounds(tmp_path / "us") if x["xr_round"] > back]
    assert after and after[0]["xr_round"] == back + 1, after[:1]
    # us continues at the run's step: it takes part in its first round back, or, when eu was already
    # waiting out grace_s for it in that round (the round overdue: us trains one step and publishes), in
    # the next one, and in every round after that
    joined = [x["xr_round"] for x in after if "us" in x["xr_members"]]
    assert joined and joined[0] <= back + 2 and joined == list(range(joined[0], after[-1]["xr_round"] + 1)), (
        after
    )
    # both regions applied the same rounds: eu's records agree
    eu_by_round = {x["xr_round"]: x for x in _rounds(tmp_path / "eu")}
    for x in after:
        assert eu_by_round[x["xr_round"]]["xr_members"] == x["xr_members"]


def test_planned_leave_through_the_stop_file_closes_the_next_rounds_without_a_grace_wait(
    tmp_path, repo, data_dir
):
    """grace_s is 60 s: had eu waited it, the test would time out. us gets its stop file after round 2,
    checkpoints, announces its leave and exits with the requeue code; eu's next rounds close at once."""
    grace = 60.0
    cfg = write_config(tmp_path, repo, train={"steps": 24})
    transport = FsTransport(root=str(tmp_path / "mailbox"))
    opts = dict(min_regions=1, grace_s=grace, timeout_s=600)
    stop = tmp_path / "us.stop"
    env = {"SBATCH_GEN_TEST_STEP_SLEEP_S": "0.1"}
    eu = launch_region(
        xr("eu", transport, **opts), config=cfg, run_dir=tmp_path / "eu", data_path=data_dir, env=env
    )
    us = launch_region(
        xr("us", transport, **opts),
        config=cfg,
        run_dir=tmp_path / "us",
        data_path=data_dir,
        env=env,
        extra_args=["--stop-file", str(stop)],
    )
    _wait_for(tmp_path / "mailbox" / "mp" / "r000002" / "_commit.json", [eu, us], "round 2")
    stop.touch()
    assert us.wait(TIMEOUT) == [0], us.tail()
    assert _stopped_quietly(us, stop), us.tail()
    presence = json.loads((tmp_path / "mailbox" / "mp" / "_presence" / "us.json").read_text())
    assert presence["state"] == "leaving"
    assert eu.wait(TIMEOUT) == [0], eu.tail()
    missed = [x for x in _rounds(tmp_path / "eu") if "us" in x["xr_absent"]]
    assert missed and all(x["xr_close_reason"] == "leave" for x in missed)
    assert max(x["xr_wait_s"] for x in missed) < 5.0


def test_no_quorum_checkpoints_and_exits_with_the_requeue_code_in_one_line(tmp_path, repo, data_dir):
    """Only eu runs and the run is strict (min_regions: all): round 1 finds no quorum within timeout_s.
    Every rank stops; eu checkpoints step 4, prints one line naming us, exits 0 after its ack (a stop file
    is set), no traceback; the stop file and its .ack make a restart exit at once."""
    timeout = 4.0
    cfg = write_config(tmp_path, repo)
    stop = tmp_path / "stop" / "eu.attempt-0"
    t0 = time.monotonic()
    eu = launch_region(
        xr("eu", FsTransport(root=str(tmp_path / "mailbox")), timeout_s=timeout),
        config=cfg,
        run_dir=tmp_path / "eu",
        data_path=data_dir,
        max_steps=8,
        extra_args=["--stop-file", str(stop)],
    )
    assert eu.wait(TIMEOUT) == [0], eu.tail()
    assert _stopped_quietly(eu, stop), eu.tail()
    log = eu.tail(400)
    assert not re.search(r'File ".*/sbatch_gen/', log), log  # no traceback through the trainer
    lines = [ln for ln in log.splitlines() if "no cross-region quorum" in ln]
    assert len(lines) >= 1 and all("missing: us" in ln and "checkpointed at step 4" in ln for ln in lines), (
        lines
    )
    assert (tmp_path / "eu" / "checkpoints" / "step-4").exists()
    assert stop.exists() and json.loads(stop.with_name(stop.name + ".ack").read_text())["step"] == 4
    # rounds never closed; the pending round is retried at the next start (checkpointed outer state)
    assert not (tmp_path / "mailbox" / "mp" / "r000001" / "_commit.json").exists()
    assert time.monotonic() - t0 < timeout + 90  # start-up on 2 shared cores, then at most timeout_s
