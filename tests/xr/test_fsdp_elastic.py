"""A sharded (FSDP2) region in an elastic run, through the DiLoCo library (tests/xr/fsdp_worker.py, one
torchrun per region, gloo): it leaves or crashes, the other region goes on alone without stalling, and it
comes back from its DCP checkpoint by replaying the rounds it missed or from an outer snapshot written by a
region of another shape; fp8 and int4 payloads; the S3 store. After every round that both regions reached,
their whole theta_outer and momentum (assembled from their ranks) are the same bits."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from .test_multiproc import s3_transport
from .workers import launch, stop, wait

pytestmark = pytest.mark.slow  # torchrun regions: the multi-process tier

REGIONS = ["eu", "us"]
H = 2  # tests/xr/fsdp_worker.py's inner_steps


def _launch(region: str, kind: str, nproc: int, out: Path, mailbox: list[str], *extra: str):
    return launch("fsdp_worker", region, REGIONS, nproc, out, "--kind", kind, *mailbox, *extra)


def _by_round(res: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """A region's outer state after each round it reached (a fast-forward: the round it caught up to)."""
    return {step // H: (theta, mom) for step, theta, mom, *_ in res["rounds"]}


def _assert_same_state(*runs: dict) -> list[int]:
    """Every round that more than one of ``runs`` (region results) reached holds the same bits in each;
    returns those rounds."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    shared = set()
    for res in runs:
        for r, (theta, mom) in _by_round(res).items():
            assert not theta.isnan().any() and not mom.isnan().any(), f"round {r}: a rank left a gap"
            if r in seen:
                shared.add(r)
                assert torch.equal(seen[r][0], theta) and torch.equal(seen[r][1], mom), f"round {r} differs"
            seen.setdefault(r, (theta, mom))
    return sorted(shared)


def _wait_file(path: Path, runs, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for (p, log), name in runs:
            assert p.poll() is None, (
                f"{name} exited {p.returncode} before {what}:\n{Path(log.name).read_text()[-3000:]}"
            )
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def _load(out: Path, region: str) -> dict:
    return torch.load(out / f"{region}.pt", weights_only=False)


@pytest.mark.parametrize("via", ["rounds", "snapshot"])
def test_a_sharded_region_that_was_away_rejoins_and_the_other_never_stalls(via, tmp_path, request):
    """eu (FSDP over 2 ranks, uneven shards) takes part in rounds 1-2, checkpoints (DCP) and goes: with a
    planned leave (rounds: over S3, int8 deltas, every round kept) or a crash (snapshot: over a directory,
    int4 deltas, heartbeats every 2 s, one round kept, a snapshot every 2 rounds). us goes on alone through rounds 3-4 without
    waiting for eu (the leave closes them at once; the crash after 3 heartbeats, far below grace_s), then
    waits before step 9 until eu is back. eu resumes from its checkpoint and fast-forwards: it replays rounds
    3-4, or loads snapshot 4 (written by us, FSDP over 1 rank: another cut) once rounds 1-3 are cleaned up.
    It then holds exactly us's round-4 outer state, and both take part in rounds 5-6 with the same bits."""
    mb = tmp_path / "mailbox"
    if via == "rounds":
        t = s3_transport(request.getfixturevalue("s3server"), request.getfixturevalue("bucket"))
        mailbox, us_kind = ["--transport", t.model_dump_json()], "ddp"
        opts = ["--keep-rounds", "10", "--snapshot-every", "100", "--grace-s", "60", "--payload", "int8"]
        goes = ["--leave-at", "4"]
    else:
        mailbox, us_kind = ["--root", str(mb)], "fsdp"
        opts = ["--keep-rounds", "1", "--snapshot-every", "2", "--grace-s", "60", "--heartbeat-s", "2"]
        opts += ["--payload", "int4"]
        goes = ["--crash-at", "4"]
    common = [*mailbox, "--min-regions", "1", "--steps", "12", *opts]
    first, again, back = tmp_path / "first", tmp_path / "again", tmp_path / "eu-back"
    eu = (_launch("eu", "fsdp", 2, first, common, "--save-at", "4", *goes), "eu")
    us = (_launch("us", us_kind, 1, first, common, "--wait-at", "9", "--wait-for", str(back)), "us")
    try:
        wait([eu], timeout=180)
        _wait_file(back.with_name(back.name + ".asked"), [us], "us at round 4")
        if via == "snapshot":  # us's housekeeping: snapshot 4, then rounds 1-3 cleaned up
            _wait_file(mb / "f" / "_snap" / "r000004" / "_complete.json", [us], "snapshot 4")
            deadline = time.monotonic() + 60
            while (mb / "f" / "r000003" / "_commit.json").exists():
                assert time.monotonic() < deadline, "round 3 was never cleaned up"
                time.sleep(0.1)
        eu2 = (
            _launch("eu", "fsdp", 2, again, common, "--resume", str(first / "ckpt"), "--started", str(back)),
            "eu again",
        )
    except BaseException:
        stop([us])
        raise
    wait([eu2, us])
    res_eu, res_us, res_back = _load(first, "eu"), _load(first, "us"), _load(again, "eu")

    assert sorted(_by_round(res_eu)) == [0, 1, 2] and sorted(_by_round(res_us)) == list(range(7))
    assert _assert_same_state(res_eu, res_us) == [0, 1, 2]
    # us alone in rounds 3-4, never waiting for eu
    alone = [x for x in res_us["records"] if x["xr_round"] in (3, 4)]
    assert [x["xr_members"] for x in alone] == [["us"], ["us"]]
    assert all(x["xr_total_s"] < 30 for x in alone), [x["xr_total_s"] for x in alone]  # grace_s 60
    # closed at once after eu's leave, or once its heartbeat stood still for 3 beats
    assert [x["xr_close_reason"] for x in alone] == (["leave"] * 2 if via == "rounds" else ["stale"] * 2)
    # eu back: fast-forwarded to round 4, the same bits as us there, and through rounds 5-6 with it
    rejoin = [e for e in res_back["events"] if e.get("event") == "xr_rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["from_round"] == 2 and rejoin[0]["to_round"] == 4, rejoin
    assert rejoin[0]["via"] == (["rounds"] if via == "rounds" else ["snapshot r000004"])
    assert rejoin[0]["replayed"] == (2 if via == "rounds" else 0)
    assert sorted(_by_round(res_back)) == [4, 5, 6]
    assert _assert_same_state(res_back, res_us) == [4, 5, 6]
    both = [x for x in res_us["records"] if x["xr_round"] in (5, 6)]
    assert [x["xr_members"] for x in both] == [["eu", "us"]] * 2  # us's commit order: eu first
    assert not torch.equal(_by_round(res_us)[6][0], _by_round(res_us)[4][0])


@pytest.mark.parametrize("payload, store", [("fp8", "fs"), ("int4", "s3")], ids=["fp8-fs", "int4-s3"])
def test_sharded_regions_hold_the_same_outer_state_with_low_bit_payloads(payload, store, tmp_path, request):
    """eu FSDP over 2 ranks, us FSDP over 1 (each cuts its payload where its shards end, scales per 256
    elements of the canonical layout): three rounds of fp8 (e4m3) or int4 deltas, over a directory or the
    S3 server; after every round the same bits in both, and every round moved the outer state."""
    if store == "s3":
        t = s3_transport(request.getfixturevalue("s3server"), request.getfixturevalue("bucket"))
        mailbox = ["--transport", t.model_dump_json()]
    else:
        mailbox = ["--root", str(tmp_path / "mailbox")]
    out = tmp_path / "out"
    wait([(_launch(r, "fsdp", n, out, mailbox, "--payload", payload), r) for r, n in (("eu", 2), ("us", 1))])
    res = {r: _load(out, r) for r in REGIONS}
    assert _assert_same_state(res["eu"], res["us"]) == [0, 1, 2, 3]
    states = _by_round(res["eu"])
    for r in (1, 2, 3):
        assert not torch.equal(states[r][0], states[r - 1][0]), f"round {r} changed nothing"
    assert all(x["xr_members"] == ["eu", "us"] for x in res["eu"]["records"])
