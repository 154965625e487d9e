"""Round membership on both stores: conditional create, the closing rule, commit races, planned leaves,
crashed regions found by their stale heartbeat, cleanup that keeps what a returning region needs.
In-process, torch-free (regions as threads; a crashed region is a real process killed with SIGKILL)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from bench import scripted
from sbatch_gen.train.xr.commit import Commit, decide
from sbatch_gen.train.xr.errors import XRBehind, XRNoQuorum
from sbatch_gen.train.xr.heartbeat import STALE_BEATS, Heartbeat, HeartbeatWriter
from sbatch_gen.train.xr.membership import Membership
from sbatch_gen.train.xr.protocol import Expect, Mailbox, ShardPlan, round_tag
from sbatch_gen.train.xr.rounds import _own_claim, round_wait, wait_commit
from sbatch_gen.train.xr.store import FsStore, make_store, probe_create

from .concurrent import in_threads

pytestmark = pytest.mark.slow  # a real S3 server and region threads that wait out grace periods

REGIONS = ["eu", "us"]
N = 1000  # fp32 elements per payload
EXPECT = Expect("delta", "fp32", N, "L1", "raw", ShardPlan.make(N, 4, 0.002))


def members(
    transport, regions=REGIONS, quorum=None, grace_s=0.3, timeout_s=20.0, run_id="run1", heartbeat_s=None
):
    out = {}
    for r in regions:
        mb = Mailbox(
            make_store(transport, threads=2),
            run_id,
            r,
            regions,
            timeout_s=timeout_s,
            threads=2,
            poll_min_s=0.005,
            poll_max_s=0.05,
        )
        out[r] = Membership(mb, quorum or len(regions), grace_s, heartbeat_s=heartbeat_s)
    return out


def pub(ms: Membership, r: int, tokens=100, payload=None):
    """``ms``'s region publishes round ``r`` as a region does: its shards, then its claim (the manifest)."""
    m, _ = scripted.publish(
        ms.mb,
        round_tag(r),
        payload or os.urandom(4 * N),
        kind="delta",
        dtype="fp32",
        layout="L1",
        step=r * 4,
        tokens=tokens,
        shard_mb=0.002,
        write=False,
    )
    ms.claim(m)


def test_decide_is_the_closing_rule():
    R = ["eu", "us", "ap"]
    assert decide(R, R, [], 2, 5.0, 0.0, None) == ("all", None)
    assert decide(R, ["eu"], [], 2, 5.0, 0.0, None) == (None, None)  # no quorum: no grace clock
    assert decide(R, ["eu", "us"], [], 2, 5.0, 10.0, None) == (None, 10.0)  # quorum formed now
    assert decide(R, ["eu", "us"], [], 2, 5.0, 14.9, 10.0) == (None, 10.0)
    assert decide(R, ["eu", "us"], [], 2, 5.0, 15.0, 10.0) == ("grace", 10.0)
    assert decide(R, ["eu", "us"], ["ap"], 2, 5.0, 10.0, None) == ("leave", 10.0)  # the missing one left
    assert decide(R, ["eu"], ["us", "ap"], 2, 5.0, 10.0, None) == (
        None,
        None,
    )  # a leave never beats the quorum
    assert decide(R, ["eu", "us"], [], 2, 0.0, 10.0, None) == ("grace", 10.0)
    # crashed (stale heartbeat): not waited for, like a leave, but never before the quorum
    assert decide(R, ["eu", "us"], [], 2, 5.0, 10.0, None, stale=["ap"]) == ("stale", 10.0)
    assert decide(R, ["eu"], ["us"], 2, 5.0, 10.0, None, stale=["ap"]) == (None, None)
    assert decide(R, ["eu"], ["us"], 1, 5.0, 10.0, None, stale=["ap"]) == (
        "stale",
        10.0,
    )  # one left, one crashed
    assert decide(R, ["eu"], [], 1, 5.0, 10.0, None, stale=["ap"]) == (None, 10.0)  # us may still come


def test_create_if_absent_has_one_winner_under_races(transport):
    stores = [make_store(transport, threads=2) for _ in range(2)]
    assert probe_create(stores[0], "probe")
    wins = []
    for i in range(40):
        barrier = threading.Barrier(2)

        def go(j, i=i, barrier=barrier):
            barrier.wait()
            return stores[j].create(f"race/{i}", str(j).encode())

        res = in_threads(lambda j: go(j), [0, 1])
        assert sorted(res.values()) == [False, True], res
        winner = [j for j, ok in res.items() if ok][0]
        assert stores[1].get(f"race/{i}") == str(winner).encode()  # the loser did not overwrite it
        wins.append(winner)


def test_claim_race_both_regions_close_the_same_round_at_the_same_instant(transport):
    """eu and us publish, ap never does: both close each round without ap at the same instant (a barrier
    right before each one's create of ap's tombstone), 20 rounds in a row: one tombstone wins ap's key, and
    both regions build the same commit from the same claims, byte for byte; the stored record is that one."""
    regions = ["eu", "us", "ap"]
    ms = members(transport, regions, quorum=2, grace_s=0.0)
    barrier = threading.Barrier(2)
    for reg in ("eu", "us"):
        store = ms[reg].store
        create = store.create

        def racing(key, data, create=create):
            if key.endswith("/ap.done"):
                barrier.wait(10)
            return create(key, data)

        store.create = racing  # type: ignore[method-assign]
    for r in range(1, 21):
        in_threads(lambda reg, r=r: pub(ms[reg], r), ["eu", "us"])
        got = in_threads(
            lambda reg, r=r: wait_commit(ms[reg], round_tag(r), EXPECT, step=r * 4), ["eu", "us"]
        )
        ce, cu = got["eu"][0], got["us"][0]
        assert ce.to_json() == cu.to_json(), (ce, cu)
        assert list(ce.members) == ["eu", "us"] and ce.absent == ["ap"] and ce.reason == "grace"
        assert ce.closed_by in ("eu", "us")
        assert ms["eu"].read_commit(round_tag(r)).to_json() == ce.to_json()
        assert ms["ap"].read_claim(round_tag(r), "ap").closed_by == ce.closed_by  # the tombstone that won


def test_both_regions_publish_at_once_and_agree_on_every_member(transport):
    """Strict rounds: eu and us publish at the same instant, 20 rounds in a row; each finds both claims,
    and both name the same members with the same tokens (whoever each saw arrive last)."""
    ms = members(transport)
    for r in range(1, 21):
        in_threads(lambda reg, r=r: pub(ms[reg], r, tokens=100 + r), REGIONS)
        got = in_threads(lambda reg, r=r: wait_commit(ms[reg], round_tag(r), EXPECT, step=r * 4), REGIONS)
        ce, cu = got["eu"][0], got["us"][0]
        assert ce.members == cu.members and list(ce.members) == REGIONS and ce.reason == cu.reason == "all"
        assert ms["eu"].read_commit(round_tag(r)).members == ce.members


def test_quorum_closes_after_grace_and_a_late_region_obeys(transport):
    ms = members(transport, quorum=1, grace_s=0.4)
    pub(ms["eu"], 1)
    t0 = time.monotonic()
    c, seen = wait_commit(ms["eu"], "r000001", EXPECT, step=4)
    waited = time.monotonic() - t0
    assert 0.4 <= waited < 0.4 + 3.0, (
        waited
    )  # after grace_s, long before timeout_s (20 s): not a timing check
    assert list(c.members) == ["eu"] and c.absent == ["us"] and c.reason == "grace"
    # us arrives after the commit: it reads and obeys it, its payload is not part of the round
    pub(ms["us"], 1)
    c2, _ = wait_commit(ms["us"], "r000001", EXPECT, step=4)
    assert c2.to_json() == c.to_json()


def test_planned_leave_closes_the_next_round_without_the_grace_wait(transport):
    ms = members(transport, quorum=1, grace_s=30.0)
    ms["us"].announce("leaving", 3, 12)
    pub(ms["eu"], 4)
    t0 = time.monotonic()
    c, _ = wait_commit(ms["eu"], "r000004", EXPECT, step=16)
    assert time.monotonic() - t0 < 3.0
    assert c.reason == "leave" and list(c.members) == ["eu"]
    ms["us"].announce("joined", 4, 16)  # back: the next round waits for it again
    pub(ms["eu"], 5)
    got = {}
    th = threading.Thread(
        target=lambda: got.setdefault("c", wait_commit(ms["eu"], "r000005", EXPECT, step=20))
    )
    th.start()
    time.sleep(0.5)
    assert "c" not in got  # still waiting for us (grace 30 s)
    pub(ms["us"], 5)
    th.join(10)
    assert got["c"][0].reason == "all"


def test_no_quorum_within_timeout_names_the_missing_regions(transport):
    ms = members(transport, regions=["eu", "us", "ap"], quorum=2, grace_s=0.1, timeout_s=0.6)
    pub(ms["eu"], 1)
    t0 = time.monotonic()
    with pytest.raises(
        XRNoQuorum,
        match=r"round r000001 \(step 4\): no quorum after 0.6 s: 1 of 3 regions "
        r"published, 2 needed \(min_regions\); missing: us, ap",
    ) as ei:
        wait_commit(ms["eu"], "r000001", EXPECT, step=4)
    assert time.monotonic() - t0 < 2.0 and ei.value.missing == ["us", "ap"]


def test_a_region_whose_round_was_cleaned_up_is_behind_and_never_closes_it(transport):
    ms = members(transport, quorum=1, grace_s=0.0)
    eu, us = ms["eu"], ms["us"]
    for r in (1, 2, 3):
        pub(eu, r)
        wait_commit(eu, round_tag(r), EXPECT, step=4 * r)
    # eu's cleanup once r000003 is committed: its claim and objects, then the commit
    eu.store.delete(
        [eu.claim_key("r000001", "eu"), eu.mb.shard_key("r000001", "eu", 0), eu.commit_key("r000001")]
    )
    pub(us, 1)  # its create finds eu's tombstone: us is late, and the round's other claims are gone
    t0 = time.monotonic()
    with pytest.raises(XRBehind, match="committed up to r000003"):
        wait_commit(us, "r000001", EXPECT, step=4)
    assert time.monotonic() - t0 < 2.0  # at once, not after behind_check_s
    assert eu.read_commit("r000001") is None and us.read_claim("r000001", "eu") is None  # not closed again


def test_tombstones_are_not_a_regions_publications(transport):
    """us takes part in round 1, then eu closes rounds 2 and 3 without it (tombstones at us's claim keys):
    us's newest publication (`sbatch-gen status`) is still round 1, and us's own create of round 3, late,
    finds the tombstone: it is late, and it obeys the same commit."""
    ms = members(transport, quorum=1, grace_s=0.0)
    in_threads(lambda reg: pub(ms[reg], 1), REGIONS)
    in_threads(lambda reg: wait_commit(ms[reg], "r000001", EXPECT, step=4), REGIONS)
    for r in (2, 3):
        pub(ms["eu"], r)
        c, _ = wait_commit(ms["eu"], round_tag(r), EXPECT, step=4 * r)
        assert (list(c.members), c.absent, c.reason, c.closed_by) == (["eu"], ["us"], "grace", "eu")
    assert ms["us"].published_rounds() == {"eu": 3, "us": 1}
    assert ms["us"].read_claim("r000003", "us").closed_by == "eu"
    pub(ms["us"], 3)
    c3, _ = wait_commit(ms["us"], "r000003", EXPECT, step=12)
    assert c3.to_json() == c.to_json() and ms["us"].read_claim("r000003", "us").closed_by == "eu"


def test_a_round_decided_by_its_commit_alone_decides_for_a_region_that_re_enters_it(transport):
    """The version before claims closed rounds by their commit alone and wrote no tombstones: a region that
    re-enters such a round (its first round after a restart, say with the round in flight) finds its own
    claim key free, but the commit decides for it: late, nothing to publish. Later rounds of the process,
    beyond any claim of the region, cost no read at all."""
    ms = members(transport, quorum=1, grace_s=0.0)
    pub(ms["eu"], 1)
    c, _ = wait_commit(ms["eu"], "r000001", EXPECT, step=4)  # without us: a tombstone, then the commit
    ms["eu"].store.delete([ms["eu"].claim_key("r000001", "us")])  # (as the version before: no tombstone)
    own, decided = _own_claim(ms["us"], "r000001", EXPECT)
    assert own is None and decided is not None, (own, decided)
    assert decided[0].to_json() == c.to_json() and list(decided[1]) == ["eu"]
    assert _own_claim(ms["us"], "r000002", EXPECT) == (None, None)


def _put_snapshot(ms: Membership, r: int) -> None:
    for part in ("theta", "momentum"):
        ms.store.put(ms.mb.shard_key(ms.snap_tag(r), part, 0), b"x")
        ms.store.put(ms.mb.manifest_key(ms.snap_tag(r), part), b"{}")
    ms.store.put(ms.snap_complete_key(r), b"{}")


def test_cleanup_keeps_every_round_after_the_newest_snapshot(tmp_path):
    store = FsStore(tmp_path)
    mb = Mailbox(store, "run1", "eu", REGIONS, threads=1)
    ms = Membership(mb, 1, 0.0)
    for r in range(1, 9):
        for reg in REGIONS:
            store.put(mb.shard_key(round_tag(r), reg, 0), b"x")
            store.put(mb.manifest_key(round_tag(r), reg), b"{}")
        store.create(ms.commit_key(round_tag(r)), b"{}")
    ms.cleanup(8, keep_rounds=2, shard_count=1)  # no snapshot yet: nothing may go
    assert len([k for k in store.list("run1/") if k.endswith("/_commit.json")]) == 8
    _put_snapshot(ms, 4)
    ms.cleanup(8, keep_rounds=2, shard_count=1)  # rounds <= 4 (the snapshot) and <= 6 (keep_rounds)
    left = sorted(store.list("run1/"))
    gone = [
        f"run1/{round_tag(r)}/{x}" for r in range(1, 5) for x in ("eu.done", "eu/s00000.bin", "_commit.json")
    ]
    assert not set(gone) & set(left)
    assert "run1/r000004/us.done" in left  # us's own objects are us's to delete
    assert "run1/r000005/_commit.json" in left and "run1/r000005/eu.done" in left
    ms.cleanup(8, keep_rounds=2, need_snapshot=False, shard_count=1)  # grad mode: keep_rounds alone
    assert "run1/r000007/eu.done" in store.list("run1/") and "run1/r000006/eu.done" not in store.list("run1/")


def test_an_old_snapshot_goes_only_when_a_newer_one_is_complete(tmp_path):
    mb = Mailbox(FsStore(tmp_path), "run1", "eu", REGIONS, threads=1)
    ms = Membership(mb, 1, 0.0)
    _put_snapshot(ms, 4)
    ms.store.put(ms.mb.shard_key(ms.snap_tag(8), "theta", 0), b"x")  # snapshot 8 in progress
    assert ms.snapshot_rounds() == [4]
    _put_snapshot(ms, 8)
    ms.delete_snapshots_before(8)
    assert ms.snapshot_rounds() == [8]
    assert not [k for k in ms.store.list("run1/") if "/r000004/" in k]


def test_commit_json_roundtrip_and_bad_commit_is_a_clear_error(tmp_path):
    mb = Mailbox(FsStore(tmp_path), "run1", "eu", REGIONS, threads=1)
    ms = Membership(mb, 1, 0.0)
    ms.store.put(ms.commit_key("r000001"), b"{not json")
    with pytest.raises(Exception, match=r"unreadable round commit fs:.*r000001/_commit.json"):
        ms.read_commit("r000001")
    c = Commit("run1", "r000002", 8, {}, "eu", "all", 0.1)
    assert Commit.from_json(c.to_json(), "x") == c


def test_elastic_needs_a_store_that_refuses_a_second_create(tmp_path, monkeypatch):
    """nanio ignores If-None-Match: the probe says so, and an elastic sync refuses to start on it with a
    message naming the store; strict (min_regions: all) still runs there."""
    import torch
    from torch import nn

    from bench.servers import NanioServer, s3_client
    from sbatch_gen.train.dist import DistInfo
    from sbatch_gen.train.xr.errors import XRError
    from sbatch_gen.train.xr.modes import create
    from sbatch_gen.xr_options import CrossRegion, S3Credentials, S3Transport

    with NanioServer() as server:
        s3_client(server.endpoint_url).create_bucket(Bucket="nocond")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        t = S3Transport(
            bucket="nocond",
            endpoint_url=server.endpoint_url,
            addressing_style="path",
            region_name="us-east-1",
            credentials=S3Credentials(
                access_key_id_env="AWS_ACCESS_KEY_ID", secret_access_key_env="AWS_SECRET_ACCESS_KEY"
            ),
        )
        assert probe_create(make_store(t, threads=1), "p") is False
        base = dict(enabled=True, run_id="n", region="eu", regions=REGIONS, transport=t, threads=2)
        model = nn.Linear(2, 2)
        with pytest.raises(XRError, match=r"s3://nocond.* does not refuse a second conditional create"):
            create(CrossRegion(**base, min_regions=1, grace_s=1), model, torch.device("cpu"), DistInfo())
        create(CrossRegion(**base), model, torch.device("cpu"), DistInfo()).close()


def test_a_wait_in_slices_keeps_its_grace_clock(transport):
    """The exchange waits in slices (so that the other ranks hear from rank 0): a grace_s longer than a
    slice must still run out. Each slice resumes the round's wait, its quorum's start included."""
    ms = members(transport, quorum=1, grace_s=0.5, timeout_s=4.0)
    pub(ms["eu"], 1)
    started = time.monotonic()
    wait = round_wait(ms["eu"], "r000001", EXPECT, step=4, started=started)
    got, slices = None, 0
    while got is None:
        got = wait.run(slice_s=0.15)
        slices += 1
    assert got[0].reason == "grace" and slices >= 3
    assert 0.5 <= time.monotonic() - started < 0.5 + 0.5


# -- crashed regions: liveness heartbeats -----------------------------------------------------------------

HB = (
    0.2  # heartbeat_s of these tests: a heartbeat unchanged for STALE_BEATS x HB = 0.6 s of watching is stale
)
STALE = STALE_BEATS * HB
_BEATER = """
import json, sys, time
from sbatch_gen.train.xr.membership import Membership
from sbatch_gen.train.xr.protocol import Mailbox
from sbatch_gen.train.xr.store import make_store
from sbatch_gen.xr_options import FsTransport, S3Transport

t = json.loads(sys.argv[1])
transport = (FsTransport if t["kind"] == "fs" else S3Transport).model_validate(t)
ms = Membership(Mailbox(make_store(transport, threads=2), "run1", "us", ["eu", "us"], threads=2), 1, 3.0,
                heartbeat_s=float(sys.argv[2]))
ms.start_heartbeat()
print("beating", flush=True)
time.sleep(600)
"""


def _timed_round(ms: Membership, r: int):
    pub(ms, r)
    t0 = time.monotonic()
    c, _ = wait_commit(ms, round_tag(r), EXPECT, step=4 * r)
    return c, time.monotonic() - t0


def _beats(ms: Membership, region: str, n: int, timeout: float = 20.0) -> Heartbeat:
    """Wait until ``region`` has written at least ``n`` heartbeats; return the newest."""
    deadline = time.monotonic() + timeout
    while True:
        hb = ms.read_heartbeat(region)
        if hb is not None and hb.beat >= n:
            return hb
        assert time.monotonic() < deadline, f"{region} wrote no heartbeat #{n}"
        time.sleep(0.02)


def test_a_crashed_region_costs_one_stale_wait_then_nothing(transport, repo):
    """us is a real process whose heartbeat thread beats every 0.2 s; it is SIGKILLed (nothing tells eu).
    eu's first round without it waits until us's heartbeat is 3 beats old (0.6 s, not grace_s = 4 s: on the
    store's clock, or watched on eu's own) and closes it as "stale", naming us; eu keeps what it saw, so the
    next rounds close with no wait at all (bounds with room for a loaded machine: a round's requests take
    time too)."""
    ms = members(transport, quorum=1, grace_s=4.0, heartbeat_s=HB)
    proc = subprocess.Popen(
        [sys.executable, "-c", _BEATER, transport.model_dump_json(), str(HB)],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "beating"
        first = _beats(ms["eu"], "us", 1)
        assert (
            _beats(ms["eu"], "us", first.beat + 2).incarnation == first.incarnation
        )  # alive: the counter moves
        seen = time.monotonic()  # us wrote its last beat at most a poll (20 ms) before this, or after
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    c, waited = _timed_round(ms["eu"], 1)
    assert c.reason == "stale" and c.stale == ["us"] and c.absent == ["us"] and list(c.members) == ["eu"], c
    assert waited < 2.0, waited  # well under grace_s
    assert time.monotonic() - seen >= STALE * 0.75  # never before us's last beat was (about) 3 beats old
    later = [_timed_round(ms["eu"], r) for r in (2, 3, 4)]
    assert all(c.reason == "stale" and c.stale == ["us"] for c, _ in later), later
    assert max(w for _, w in later) < 1.0, later  # no wait: us has been known gone since round 1
    assert ms["eu"].read_commit("r000002").stale == ["us"]  # the commit says why (and who)


def _hanging(store, method: str, release: threading.Event, monkeypatch) -> None:
    """S3: every ``method`` call of ``store``'s own client hangs until ``release`` (a saturated link)."""
    real = getattr(store.client, method)

    def hang(**kw):
        release.wait(60)
        return real(**kw)

    monkeypatch.setattr(store.client, method, hang)


def test_a_crash_is_seen_by_the_peer_watch_within_three_beats_while_no_round_waits(
    transport, repo, monkeypatch
):
    """eu beats and so watches the others (a thread, outside any round). us, a real process beating every
    0.2 s, is SIGKILLed: eu's watch finds it gone about 3 beats after its last (never before: 0.75 x, and
    within 3 beats + 1.5 s of the kill, room for a loaded machine), while eu's own payload client is hung (S3:
    the watch reads through a client of its own). eu's next round then closes without us at its first look."""
    ms = members(transport, quorum=1, grace_s=30.0, heartbeat_s=HB)
    eu = ms["eu"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _BEATER, transport.model_dump_json(), str(HB)],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE,
        text=True,
    )
    release = threading.Event()
    try:
        assert proc.stdout.readline().strip() == "beating"
        eu.start_heartbeat()
        first = _beats(eu, "us", 1)
        _beats(eu, "us", first.beat + 2)
        assert eu._peers is not None and eu._peers.alive and eu.watched_gone() == set()
        if not isinstance(eu.store, FsStore):
            _hanging(eu.store, "get_object", release, monkeypatch)
            _hanging(eu.store, "put_object", release, monkeypatch)
        seen = time.monotonic()  # us's last beat: at most a poll (20 ms) before this, or after
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        killed = time.monotonic()
        while "us" not in eu.watched_gone():
            assert time.monotonic() - killed < STALE + 1.5, "the watch did not see us gone in time"
            time.sleep(0.01)
        assert time.monotonic() - seen >= STALE * 0.75  # not before its last beat was about 3 beats old
        while "us" not in eu._peers.gone_at:  # (and its next look says so: it logs it)
            assert time.monotonic() - killed < STALE + 2.0, "the watch's look never noted us gone"
            time.sleep(0.01)
        release.set()
        c, waited = _timed_round(eu, 1)
        assert c.reason == "stale" and c.stale == ["us"] and waited < 1.0, (c, waited)
    finally:
        release.set()
        proc.kill()
        proc.wait(30)
        eu.stop_heartbeat()
    assert eu._peers is None


def test_a_live_region_whose_uploads_hang_is_never_seen_gone_by_the_watch(transport, monkeypatch):
    """us beats every second (stale after 3 s of silence) but publishes nothing for 5 s, its payload
    client hung on S3 (a saturated upload): eu's watch, looking every 0.5 s, never counts it gone, and
    eu's round waits its whole grace for it. Then us publishes: a round with both. (At 0.5 s a beat, a
    machine loaded by 4 test workers once delayed one of us's beats past the 1.5 s.)"""
    hb = 1.0
    ms = members(transport, quorum=1, grace_s=2.0, heartbeat_s=hb)
    eu, us = ms["eu"], ms["us"]
    release = threading.Event()
    if not isinstance(us.store, FsStore):
        _hanging(us.store, "put_object", release, monkeypatch)
    eu.start_heartbeat()
    us.start_heartbeat()
    try:
        _beats(eu, "us", 1)
        looks = eu._peers.looks
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            assert "us" not in eu.watched_gone() and not eu._peers.gone_at, eu._peers.due
            time.sleep(0.05)
        assert eu._peers.looks >= looks + 4  # it kept looking
        c, waited = _timed_round(eu, 1)
        assert (c.reason, c.stale) == ("grace", []) and 2.0 <= waited < 2.0 + 1.5, (c, waited)
        release.set()
        pub(us, 2)
        c, _ = _timed_round(eu, 2)
        assert c.reason == "all" and list(c.members) == ["eu", "us"], c
    finally:
        release.set()
        eu.stop_heartbeat()
        us.stop_heartbeat()


@pytest.mark.parametrize("how", ["leave", "silence"])
def test_the_watch_warns_of_a_region_gone_silent_never_of_a_planned_leave(transport, caplog, how):
    """us beats, then stops: after a planned leave (its presence record says so) eu's watch logs an info line
    naming the step and round it left at, and no warning; gone silent without a word (a crash, here its
    heartbeat thread stopped) it warns."""
    hb = 0.5  # (not HB: a loaded machine can delay a live region's beats past 3 x 0.2 s)
    ms = members(transport, quorum=1, heartbeat_s=hb)
    eu, us = ms["eu"], ms["us"]
    eu.start_heartbeat()
    us.start_heartbeat()
    try:
        _beats(eu, "us", 2)
        deadline = time.monotonic() + 20.0
        while "us" in eu._peers.gone_at:  # (seen gone while beating, and not yet again)
            assert time.monotonic() < deadline, "us, beating, stays seen gone"
            time.sleep(0.02)
        with caplog.at_level(logging.INFO, logger="sbatch_gen"):
            caplog.clear()
            if how == "leave":
                us.announce("leaving", 3, 30)  # stops its heartbeat
            else:
                us.stop_heartbeat()
            deadline = time.monotonic() + STALE_BEATS * hb + 5.0
            while "us" not in eu._peers.gone_at:
                assert time.monotonic() < deadline, "the watch never noted us gone"
                time.sleep(0.02)
    finally:
        eu.stop_heartbeat()
        us.stop_heartbeat()
    # (on a loaded machine a beat still in flight when us stopped can land after the watch saw it gone: then
    # "beats again" and, once more, gone)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "region us" in r.getMessage()]
    assert said, caplog.text
    if how == "leave":
        assert said[0] == (
            logging.INFO,
            "cross-region: region us beats no more: it left at step 30 (round 3)",
        )
        assert all(level == logging.INFO for level, _ in said), said
    else:
        assert said[0][0] == logging.WARNING and "region us looks gone" in said[0][1], said


def test_a_region_that_never_beat_is_stale_once_watched_long_enough(transport):
    ms = members(transport, quorum=1, grace_s=4.0, heartbeat_s=HB)  # us never starts
    c, waited = _timed_round(ms["eu"], 1)
    assert c.reason == "stale" and c.stale == ["us"] and STALE * 0.95 <= waited < 2.0, (c, waited)
    c, waited = _timed_round(ms["eu"], 2)
    assert c.reason == "stale" and waited < 1.0, (c, waited)


LONG_HB = 1.0  # heartbeat_s of the store-clock tests: stale after 3 s, above the S3 age's 1 s resolution
SKEWS = [5 * 3600.0, -5 * 3600.0]  # this host's time.time() hours off: the store's clock decides alone


def _crashed_long_ago(ms: dict[str, Membership], region: str) -> None:
    """``region`` beat once, then crashed: its heartbeat object is older than STALE_BEATS x LONG_HB by the
    STORE's clock before any other region reads it (fs: its mtime an hour back; S3: wait until the server
    says so, a few seconds)."""
    w = ms[region]
    HeartbeatWriter(w.store, w.alive_key(region), region, LONG_HB).beat()
    if isinstance(w.store, FsStore):
        past = time.time() - 3600.0
        os.utime(w.store.root / w.alive_key(region), (past, past))
        return
    deadline = time.monotonic() + 30.0
    while True:
        got = w.store.get_aged(w.alive_key(region))
        if got is not None and (got[1] or 0.0) >= STALE_BEATS * LONG_HB:
            return
        assert time.monotonic() < deadline, f"the S3 server never aged the heartbeat: {got}"
        time.sleep(0.2)


@pytest.mark.parametrize("skew", SKEWS)
def test_a_region_crashed_long_ago_is_gone_at_the_first_check(transport, monkeypatch, skew):
    """us's heartbeat stopped long before eu first reads it: eu's first round closes as "stale" at once, not
    after watching it for 3 beats (3 s here), whatever this host's time.time() says."""
    ms = members(transport, quorum=1, grace_s=30.0, heartbeat_s=LONG_HB)
    _crashed_long_ago(ms, "us")
    real = time.time()
    monkeypatch.setattr(time, "time", lambda: real + skew)
    c, waited = _timed_round(ms["eu"], 1)
    assert c.reason == "stale" and c.stale == ["us"] and list(c.members) == ["eu"], c
    assert waited < STALE_BEATS * LONG_HB / 2, waited  # the first check: watching would take 3 s


@pytest.mark.parametrize("skew", SKEWS)
def test_a_live_region_is_never_gone_beside_a_crashed_one(transport, monkeypatch, skew):
    """ap crashed long ago, us beats (every 1 s) but has not published: eu counts ap gone at the first check
    and waits out grace_s (1.5 s, under ap's 3 s of watching) for us, round after round, with this host's
    time.time() hours off."""
    ms = members(transport, ["eu", "us", "ap"], quorum=1, grace_s=1.5, heartbeat_s=LONG_HB)
    _crashed_long_ago(ms, "ap")
    real = time.time()
    monkeypatch.setattr(time, "time", lambda: real + skew)
    ms["us"].start_heartbeat()
    try:
        _beats(ms["eu"], "us", 1)
        for r in (1, 2):
            c, waited = _timed_round(ms["eu"], r)
            assert (c.reason, c.stale, c.absent) == ("grace", ["ap"], ["us", "ap"]), (c, waited)
            assert 1.5 <= waited < 1.5 + 1.5, waited
    finally:
        ms["us"].stop_heartbeat()


class _SkewedWriter(HeartbeatWriter):
    """A heartbeat writer whose wall clock is a day behind: readers must not care."""

    def beat(self) -> None:
        self.beats += 1
        hb = Heartbeat(
            self.region, self.incarnation, self.beats, self.interval_s, time.time() - 86400, self.job
        )
        self.store.put(self.key, hb.to_json())


def test_a_slow_region_that_still_beats_gets_the_full_grace(transport):
    """us is alive (its heartbeat moves; its writer's clock is a day off, which changes nothing) but has not
    published: eu waits the whole grace_s, round after round, and closes on "grace". (Beats every 0.3 s:
    stale after 0.9 s of silence, well inside grace_s, with room for a write delayed by a loaded machine.)"""
    hb = 0.3
    ms = members(transport, quorum=1, grace_s=2.0, heartbeat_s=hb)
    writer = _SkewedWriter(ms["us"].store, ms["us"].alive_key("us"), "us", hb)
    writer.start()
    try:
        _beats(ms["eu"], "us", 1)
        for r in (1, 2):
            c, waited = _timed_round(ms["eu"], r)
            assert c.reason == "grace" and c.stale == [] and 2.0 <= waited < 2.0 + 1.0, (c, waited)
    finally:
        writer.stop()
    assert not writer.alive


def test_heartbeats_off_is_the_old_behaviour(transport):
    """heartbeat_s None: nothing is written, nothing is read; a region that is gone costs grace_s in every
    round it misses."""
    ms = members(transport, quorum=1, grace_s=0.8, heartbeat_s=None)
    ms["us"].start_heartbeat()  # no interval: does nothing
    assert not ms["us"].beating
    for r in (1, 2):
        c, waited = _timed_round(ms["eu"], r)
        assert c.reason == "grace" and c.stale == [] and 0.8 <= waited < 0.8 + 1.0, (c, waited)
    assert not [k for k in ms["eu"].run_keys() if "/_alive/" in k]


def test_the_heartbeat_stops_on_leave(transport):
    ms = members(transport, quorum=1, grace_s=30.0, heartbeat_s=HB)
    us = ms["us"]
    us.start_heartbeat()
    assert us.beating
    thread = us._writer._thread
    _beats(ms["eu"], "us", 2)
    us.announce("leaving", 3, 12)
    assert not us.beating and not thread.is_alive()
    last = ms["eu"].read_heartbeat("us")
    time.sleep(3 * HB)
    assert ms["eu"].read_heartbeat("us") == last  # not one beat after the leave
    c, waited = _timed_round(ms["eu"], 4)
    assert c.reason == "leave" and c.stale == [] and waited < 1.0  # the leave is on record: not "stale"


def test_heartbeats_go_through_a_client_of_their_own(transport, monkeypatch):
    """S3: every upload of the payload client hangs (a saturated connection pool): us still beats, through
    a client and pool of its own. fs needs none: the store is the writer's."""
    ms = members(transport, quorum=1, grace_s=30.0, heartbeat_s=HB)
    us = ms["us"]
    if isinstance(us.store, FsStore):
        us.start_heartbeat()
        assert us._writer is not None and us._writer.store is us.store
        us.stop_heartbeat()
        return
    release = threading.Event()
    put_object = us.store.client.put_object

    def saturated(**kw):
        release.wait(60)
        return put_object(**kw)

    monkeypatch.setattr(us.store.client, "put_object", saturated)
    us.start_heartbeat()
    try:
        first = _beats(ms["eu"], "us", 1, timeout=10.0)
        assert _beats(ms["eu"], "us", first.beat + 2, timeout=10.0).incarnation == first.incarnation
        writer = us._writer
        assert writer is not None and writer.store.client is not us.store.client
    finally:
        release.set()
        us.stop_heartbeat()


def test_a_failing_heartbeat_write_is_logged_once_and_retried(tmp_path, caplog):
    root = tmp_path / "mailbox"
    store = FsStore(root)
    w = HeartbeatWriter(store, "run1/_alive/us.json", "us", 5.0, "job-1")
    w.beat()
    (root / "run1" / "_alive" / "us.json").unlink()
    (root / "run1" / "_alive").rmdir()
    (root / "run1" / "_alive").write_text("not a directory")  # every write fails now
    with caplog.at_level("INFO", logger="sbatch_gen.train"):
        w.beat()
        w.beat()
        (root / "run1" / "_alive").unlink()
        w.beat()
    msgs = [r.getMessage() for r in caplog.records]
    assert len([m for m in msgs if "heartbeat: writing" in m and "failed" in m]) == 1, msgs
    assert any("written again after 2 failed writes" in m for m in msgs), msgs
    hb = Heartbeat.from_json(store.get("run1/_alive/us.json"), "x")
    assert (hb.region, hb.beat, hb.interval_s, hb.job) == ("us", 4, 5.0, "job-1")
    assert json.loads(store.get("run1/_alive/us.json"))["incarnation"] == w.incarnation


@pytest.mark.parametrize("value", [0.5, 5, None])
def test_heartbeat_s_travels_from_the_profile_to_the_trainer_flags(value):
    """The renderer spells every field out (null as "none"); the trainer's parser gives back the same value."""
    import argparse

    from sbatch_gen.xr_options import CrossRegion, add_arguments, from_namespace, to_argv

    xr = CrossRegion(enabled=True, region="eu", regions=REGIONS, min_regions=1, heartbeat_s=value)
    argv = to_argv(xr)
    assert argv[argv.index("--xr-heartbeat-s") + 1] == {0.5: "0.5", 5: "5.0", None: "none"}[value]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_namespace(parser.parse_args(argv)).heartbeat_s == value
    assert CrossRegion().heartbeat_s == 5.0  # the default: on


@pytest.mark.parametrize(
    "value, msg", [(0.05, "greater than or equal to 0.1"), (True, "YAML boolean"), ("often", "valid number")]
)
def test_bad_heartbeat_s_is_refused(value, msg):
    from pydantic import ValidationError

    from sbatch_gen.xr_options import CrossRegion

    with pytest.raises(ValidationError, match=msg):
        CrossRegion(heartbeat_s=value)
