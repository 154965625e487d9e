"""The leave announcer (``python -m sbatch_gen.train.xr.leave``) that run-trainer runs on a region's node 0
after torchrun crashed: the record a planned stop writes, from the trainer's own arguments; a leave or a
refusal already there kept; nothing written while another attempt holds the run dir's lease; one line, never
a traceback. The whole path, a crash seen by the other region at once, is tests/xr/test_leave_multiproc.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from sbatch_gen.testing.s3server import free_port
from sbatch_gen.train.xr import leave
from sbatch_gen.train.xr.commit import Presence
from sbatch_gen.train.xr.membership import Membership
from sbatch_gen.train.xr.protocol import Mailbox, Manifest, round_tag
from sbatch_gen.train.xr.store import FsStore
from sbatch_gen.xr_options import CrossRegion, to_argv


def _xr(tmp_path, **kw) -> CrossRegion:
    data = {"enabled": True, "run_id": "run1", "region": "b", "regions": ["a", "b"], "min_regions": 1}
    data["transport"] = {"kind": "fs", "root": str(tmp_path / "mb")}
    return CrossRegion.model_validate({**data, **kw})


def _args(tmp_path, xr: CrossRegion) -> list[str]:
    return ["--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "runs" / "b"), *to_argv(xr)]


def _membership(tmp_path, region: str = "b") -> Membership:
    return Membership(Mailbox(FsStore(tmp_path / "mb"), "run1", region, ["a", "b"]), 1, 60.0)


def _claim(ms: Membership, r: int, step: int) -> None:
    """Region b's manifest at its claim key of round r (an empty payload: only its step is read)."""
    tag = round_tag(r)
    m = Manifest("run1", "b", tag, "delta", step, "bf16", 0, "layout", "raw", 0, [])
    ms.store.put(ms.claim_key(tag, "b"), m.to_json())


def test_a_crash_is_announced_as_a_planned_stop_is(tmp_path):
    xr = _xr(tmp_path)
    ms = _membership(tmp_path)
    ms.announce("joined", 2, 40)
    _claim(ms, 3, 60)
    _claim(ms, 4, 80)
    rc, line = leave.announce(1, _args(tmp_path, xr))
    assert rc == 0
    where = f"fs:{tmp_path / 'mb' / 'run1'}"
    assert line == (
        f"announced the leave of region b in the mailbox {where} after torchrun exited with status 1 "
        "(round 4, step 80)"
    )
    got = _membership(tmp_path, "a").read_presence("b")
    assert (got.state, got.round, got.step, got.why) == ("leaving", 4, 80, "torchrun exited with status 1")


def test_without_a_published_round_the_previous_presence_says_where(tmp_path):
    ms = _membership(tmp_path)
    ms.announce("joined", 7, 140)
    assert leave.announce(137, _args(tmp_path, _xr(tmp_path)))[0] == 0
    got = ms.read_presence("b")
    assert (got.state, got.round, got.step, got.why) == ("leaving", 7, 140, "torchrun exited with status 137")


@pytest.mark.parametrize("state", ["leaving", "refused"])
def test_a_leave_or_a_refusal_already_there_is_kept(tmp_path, state):
    """The trainer announced its stop (or its end) before it failed, or refused the run's settings: the others
    must read that record, not one written over it."""
    ms = _membership(tmp_path)
    ms.announce(state, 5, 100, "round r000005: regions 'a' and 'b' disagree" if state == "refused" else "")
    raw = ms.store.get(ms.presence_key("b"))
    rc, line = leave.announce(1, _args(tmp_path, _xr(tmp_path)))
    assert rc == 0
    assert line.startswith("no leave to announce for region b: its presence record in fs:")
    assert line.endswith(f" already says {state} (round 5, step 100)")
    assert ms.store.get(ms.presence_key("b")) == raw


def _lease(tmp_path, pid: int, age_s: float = 0.0) -> None:
    run_dir = tmp_path / "runs" / "b"
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = {"job_id": "77", "host": socket.gethostname(), "pid": pid, "heartbeat": time.time() - age_s}
    (run_dir / "lease.json").write_text(json.dumps({**holder, "period_s": 30.0, "token": "t"}))


def test_no_leave_while_another_attempt_holds_the_run_dir(tmp_path):
    """A live lease holder: the attempt that replaced this one (this one was fenced), so the region is not gone."""
    _lease(tmp_path, os.getpid())
    ms = _membership(tmp_path)
    ms.announce("joined", 2, 40)
    rc, line = leave.announce(1, _args(tmp_path, _xr(tmp_path)))
    assert rc == 1
    assert line.startswith(
        f"WARNING: did not announce the leave of region b: the run dir {tmp_path / 'runs' / 'b'} is leased by a "
        f"live trainer (job 77 on host {socket.gethostname()} (pid {os.getpid()}), heartbeat"
    ), line
    assert line.endswith(
        "another attempt may train, so the other regions judge it by its heartbeat or grace_s"
    )
    assert ms.read_presence("b").state == "joined"


@pytest.mark.parametrize("how", ["its pid is gone", "its heartbeat is stale"])
def test_the_lease_of_the_crashed_trainer_itself_does_not_stop_it(tmp_path, how):
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    _lease(tmp_path, gone.pid) if how == "its pid is gone" else _lease(tmp_path, os.getpid(), age_s=600)
    assert leave.announce(1, _args(tmp_path, _xr(tmp_path)))[0] == 0
    assert _membership(tmp_path).read_presence("b").state == "leaving"


def _main(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sbatch_gen.train.xr.leave", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_a_store_that_does_not_answer_is_one_warning_line(tmp_path):
    port = free_port()  # nothing listens there
    xr = _xr(
        tmp_path,
        transport={
            "kind": "s3",
            "bucket": "no-store-here",
            "endpoint_url": f"http://127.0.0.1:{port}",
            "addressing_style": "path",
            "region_name": "us-east-1",
        },
    )
    r = _main(
        ["--torchrun-status", "1", "--", *_args(tmp_path, xr)],
        AWS_ACCESS_KEY_ID="k",
        AWS_SECRET_ACCESS_KEY="s",
    )
    assert r.returncode == 1
    (line,) = r.stdout.splitlines()
    assert line.startswith("WARNING: cannot announce the leave: "), line
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--torchrun-status", "1", "--", "--config"], "argument --config: expected one argument"),
        (
            ["--torchrun-status", "1", "--", "--config", "c.yaml", "--xr-enabled", "--xr-regoin", "b"],
            "unrecognized arguments: --xr-regoin b",
        ),
    ],
)
def test_arguments_the_trainer_refuses_are_one_warning_line(argv, said):
    r = _main(argv)
    assert r.returncode == 1
    assert r.stdout == f"WARNING: cannot announce a leave: the trainer's arguments: {said}\n"
    assert r.stderr == ""


def test_usage():
    r = _main(["--config", "c.yaml"])
    assert r.returncode == 2 and r.stderr.startswith(
        "usage: python -m sbatch_gen.train.xr.leave --torchrun-status N"
    )


def test_what_a_peer_reads_closes_its_round_on_leave(tmp_path):
    """The record is the planned stop's: a waiting region counts it among the leaving ones."""
    leave.announce(1, _args(tmp_path, _xr(tmp_path)))
    got = _membership(tmp_path, "a").presences()
    assert isinstance(got["b"], Presence) and got["b"].state == "leaving"
