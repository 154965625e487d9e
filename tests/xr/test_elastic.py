"""Elastic DiLoCo in one process (regions as threads, no process group): absent regions, token weighting
over the present ones, fast-forward from the rounds or from a snapshot, bit-identical after the first
round back."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from sbatch_gen.train.xr.errors import XRMissingRound

from .concurrent import in_threads
from .test_sync import flat, inner_steps, make

H = 4
_open: list = []  # the syncs a test made: closed after it (their heartbeat threads stop)


@pytest.fixture(autouse=True)
def _close_syncs():
    yield
    while _open:
        _open.pop().close()


def _sync(region, root, regions, **kw):
    base = dict(regions=regions, min_regions=1, grace_s=0.2, payload_dtype="fp32", keep_rounds=2)
    base.update(kw)
    m, s = make(region, root, **base)
    _open.append(s)
    return m, s


def _rounds(m, s, opt, region, rounds, tokens=32):
    """Train H steps and run the outer round, for each of ``rounds``; returns the round records."""
    out = []
    for r in rounds:
        inner_steps(m, opt, region, range((r - 1) * H + 1, r * H + 1))
        out.append(s.after_optimizer_step(r * H, tokens))
    return out


def _round_one_then_us_goes(tmp_path, regions, kw, us_goes):
    """Both regions take part in round 1; then us saves its model and outer state and goes (``us_goes(sync)``:
    a leave, or a crash). Returns ({region: (model, sync, optimizer)}, us's saved state)."""
    syncs, saved = {}, {}

    def first_round(r):
        m, s = _sync(r, tmp_path, regions, **kw)
        s.align(0)
        s.catch_up(0)  # as a trainer starts (api.start): an elastic region beats from here on
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        _rounds(m, s, opt, r, [1])
        syncs[r] = (m, s, opt)
        if r == "us":
            saved["model"] = {k: v.clone() for k, v in m.state_dict().items()}
            saved["outer"] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.state_dict().items()}
            us_goes(s)
        return s.round

    assert in_threads(first_round, regions) == {"eu": 1, "us": 1}
    return syncs, saved


def _us_back(tmp_path, regions, kw, saved, **extra):
    """us started again from its saved state (a fresh process: another seed) and caught up with the run:
    (model, sync, the step it adopted)."""
    m_us, s_us = _sync("us", tmp_path, regions, seed=99, **kw, **extra)
    m_us.load_state_dict(saved["model"])
    s_us.load_state_dict(saved["outer"])
    return m_us, s_us, s_us.catch_up(H)


def test_three_regions_one_absent_weights_the_present_ones_by_tokens(tmp_path):
    """ap never shows up: eu and us close every round after grace_s, and the outer gradient is the token-
    weighted average of their two deltas only (reference in float64, computed here)."""
    regions = ["eu", "us", "ap"]
    tokens = {"eu": 30, "us": 90}
    seen = {}

    def region(r):
        m, s = _sync(r, tmp_path, regions, min_regions=2, grace_s=0.3, outer_lr=0.5, outer_momentum=0.0)
        s.align(0)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        theta0 = s.theta_outer.clone()
        inner_steps(m, opt, r, range(1, H + 1))
        seen[r] = flat(m)
        rec = s.after_optimizer_step(H, tokens[r])
        return rec, theta0, s.theta_outer.clone()

    out = in_threads(region, ["eu", "us"])
    (rec, theta0, after), (_, _, after_us) = out["eu"], out["us"]
    assert (
        rec["xr_members"] == ["eu", "us"] and rec["xr_absent"] == ["ap"] and rec["xr_close_reason"] == "grace"
    )
    assert rec["xr_tokens"] == 120
    d = {r: theta0.double() - seen[r].double() for r in ("eu", "us")}
    g = (30 * d["eu"] + 90 * d["us"]) / 120
    ref = theta0.double() - 0.5 * g
    torch.testing.assert_close(after.double(), ref, rtol=0, atol=1e-6)
    assert torch.equal(after, after_us)


@pytest.mark.parametrize("via", ["rounds", "snapshot"])
def test_a_returning_region_fast_forwards_and_is_bitwise_equal_after_its_first_round_back(tmp_path, via):
    """us takes part in round 1, then is away for rounds 2-5 (eu closes them alone after grace_s). It
    comes back from its round-1 state, fast-forwards (replaying rounds 2-5, or, once they are cleaned up,
    from the round-4 snapshot plus round 5), holds exactly eu's theta_outer, and after round 6, which both
    take part in, the two regions are bit-identical."""
    regions = ["eu", "us"]
    kw = (
        dict(keep_rounds=1, snapshot_every=2)
        if via == "snapshot"
        else dict(keep_rounds=10, snapshot_every=100)
    )
    syncs, saved = _round_one_then_us_goes(tmp_path, regions, kw, lambda s: s.leave(H, "test"))
    m_eu, s_eu, opt_eu = syncs["eu"]
    recs = _rounds(m_eu, s_eu, opt_eu, "eu", [2, 3, 4])
    s_eu.wait_snapshot()  # snapshot 4 uploads in the background: complete before round 5's cleanup
    recs += _rounds(m_eu, s_eu, opt_eu, "eu", [5])
    assert [x["xr_members"] for x in recs] == [["eu"]] * 4
    assert all(x["xr_close_reason"] == "leave" for x in recs)  # us announced its leave: no grace wait
    mailbox = tmp_path / "t"
    if via == "snapshot":
        assert (
            not (mailbox / "r000002").exists() and (mailbox / "_snap" / "r000004" / "_complete.json").exists()
        )
    events = []
    m_us, s_us, adopted = _us_back(tmp_path, regions, kw, saved, log=events.append)
    assert 5 * H <= adopted < 6 * H  # round 5's step, plus the steps the run is estimated into round 6
    assert torch.equal(s_us.theta_outer, s_eu.theta_outer) and torch.equal(s_us.momentum, s_eu.momentum)
    assert torch.equal(flat(m_us), s_eu.theta_outer)
    ev = [e for e in events if e.get("event") == "xr_rejoin"][0]
    assert ev["from_round"] == 1 and ev["to_round"] == 5
    assert ev["via"] == (["snapshot r000004"] if via == "snapshot" else ["rounds"])
    assert ev["replayed"] == (1 if via == "snapshot" else 4)
    assert ev["adopted_step"] == adopted == 5 * H + ev["steps_into_round"]

    opt_us = torch.optim.SGD(m_us.parameters(), lr=0.05)
    both = {"eu": (m_eu, s_eu, opt_eu), "us": (m_us, s_us, opt_us)}
    first = {"eu": 5 * H + 1, "us": adopted + 1}  # us trains only the rest of round 6

    def round6(r):
        m, s, opt = both[r]
        inner_steps(m, opt, r, range(first[r], 6 * H + 1))
        return s.after_optimizer_step(6 * H, 32)

    out = in_threads(round6, regions)
    assert out["eu"]["xr_members"] == ["eu", "us"] == out["us"]["xr_members"]
    assert torch.equal(flat(m_eu), flat(m_us)) and torch.equal(s_eu.theta_outer, s_us.theta_outer)


def test_fast_forward_with_neither_rounds_nor_snapshot_is_a_clear_error(tmp_path):
    regions = ["eu", "us"]
    _, s_eu = _sync("eu", tmp_path, regions, keep_rounds=1, snapshot_every=2)
    s_eu.align(0)
    ms = s_eu.membership
    for r in (3, 4):  # the run is at round 4; rounds 1-2 are gone and no snapshot covers them
        ms.store.create(ms.commit_key(f"r{r:06d}"), b"{}")
    _, s_us = _sync("us", tmp_path, regions)
    s_us.align(0)
    with pytest.raises(
        XRMissingRound,
        match=r"region 'us' at round 0 cannot rejoin the run at round 4: round\(s\) "
        r"r000001..r000002 are gone .* and no outer snapshot covers them",
    ):
        s_us.catch_up(0)


def test_a_late_region_applies_the_committed_update_and_warns_after_three_rounds(tmp_path, caplog):
    """us publishes every round only after eu has closed it: its deltas are dropped (not counted), it
    applies eu's committed update, stays bit-identical, and after 3 late rounds in a row it warns and
    names grace_s."""
    regions = ["eu", "us"]
    commit = tmp_path / "t"

    def region(r):
        m, s = _sync(r, tmp_path, regions, grace_s=0.05)
        s.align(0)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        recs = []
        for rr in range(1, 4):
            if r == "us":
                deadline = time.monotonic() + 30
                while not (commit / f"r{rr:06d}" / "_commit.json").exists():
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            recs += _rounds(m, s, opt, r, [rr])
        return recs, s.theta_outer.clone(), flat(m)

    with caplog.at_level(logging.WARNING, logger="sbatch_gen.train"):
        out = in_threads(region, regions)
    eu, us = out["eu"], out["us"]
    assert [x["xr_late"] for x in us[0]] == [True] * 3 and [x["xr_late"] for x in eu[0]] == [False] * 3
    assert all(x["xr_members"] == ["eu"] and x["xr_tokens"] == 32 for x in us[0])
    assert torch.equal(eu[1], us[1]) and torch.equal(eu[2], us[2])
    warned = [r.getMessage() for r in caplog.records if "missed the last 3 rounds" in r.getMessage()]
    assert warned and "grace_s=0.05s" in warned[0] and "region us" in warned[0]


def test_withheld_rounds_publish_nothing_and_the_region_applies_the_commit(tmp_path, monkeypatch):
    """Fault injection from outside the sync (sbatch_gen.testing.faults, as bench/elastic.py's control runs
    it): us publishes nothing in round 2, so eu closes it alone after grace_s; us applies the committed
    update and both take part again in round 3, bit-identical."""
    from sbatch_gen.testing import faults
    from sbatch_gen.train.xr.exchange import Exchange

    assert faults.parse_withheld(" us: 2, 7 ") == ("us", {2, 7})
    monkeypatch.setattr(Exchange, "upload", faults.withholding(Exchange.upload, "us", {2}))
    regions = ["eu", "us"]

    def region(r):
        m, s = _sync(r, tmp_path, regions, grace_s=0.3)
        s.align(0)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        return _rounds(m, s, opt, r, [1, 2, 3]), flat(m)

    out = in_threads(region, regions)
    (eu, eu_p), (us, us_p) = out["eu"], out["us"]
    assert [x["xr_members"] for x in eu] == [regions, ["eu"], regions]
    assert [x["xr_late"] for x in us] == [False, True, False] and us[1]["xr_bytes_up"] == 0
    assert torch.equal(eu_p, us_p)


def test_a_region_behind_in_a_background_round_fast_forwards_within_the_behind_check(tmp_path):
    """ap (overlap eager) waits for its round 1 in the background, in slices of 0.5 s (BACKGROUND_SLICE_S),
    but the run (eu and us, min_regions 2) closed round 1 without ap and went on to round 5, cleaning round 1
    up behind the round-4 snapshot: no quorum can form, only the wait's behind check (every
    behind_check_s of the whole wait, 1.5 s here: longer than a slice) tells. ap fast-forwards at its next
    boundary, not after timeout_s (which would raise XRNoQuorum)."""
    regions = ["eu", "us", "ap"]
    kw = dict(min_regions=2, grace_s=0.2, keep_rounds=1, snapshot_every=2, timeout_s=20)
    syncs = {}
    for r in regions:  # eu publishes theta0, the others adopt it
        m, s = _sync(r, tmp_path, regions, **kw, **({"overlap": "eager"} if r == "ap" else {}))
        s.align(0)
        syncs[r] = (m, s, torch.optim.SGD(m.parameters(), lr=0.05))
    m_ap, s_ap, opt_ap = syncs["ap"]
    s_ap.membership.behind_check_s = 1.5

    def run(region):  # rounds 1-5 without ap; then rounds 1-4 are cleaned up behind snapshot 4
        m, s, opt = syncs[region]
        recs = _rounds(m, s, opt, region, [1, 2, 3, 4])
        s.wait_snapshot()
        recs += _rounds(m, s, opt, region, [5])
        s.wait_snapshot()
        return [x["xr_members"] for x in recs]

    assert in_threads(run, ["eu", "us"]) == {r: [["eu", "us"]] * 5 for r in ("eu", "us")}
    ms = s_ap.membership
    assert ms.latest_commit() == 5 and ms.read_commit("r000001") is None

    first = _rounds(m_ap, s_ap, opt_ap, "ap", [1])[0]  # round 1 starts in the background
    assert first["xr_inflight"] == 1
    t0 = time.monotonic()
    rec = _rounds(m_ap, s_ap, opt_ap, "ap", [2])[0]  # joins round 1: behind, fast-forward
    assert rec["xr_round"] == 5 and rec["xr_adopted_step"] >= 5 * H and rec["xr_rejoin_from"] == 0, rec
    assert time.monotonic() - t0 < kw["timeout_s"] / 2
    assert torch.equal(s_ap.theta_outer, syncs["eu"][1].theta_outer)


def test_a_returning_region_continues_at_the_runs_current_step(tmp_path, monkeypatch):
    """The run's position inside the next round is estimated from when the store wrote the last rounds'
    commits (here their files' mtimes) and a write made now: a region that fast-forwards 12 s into a 19 s
    round after the newest commit continues 6 of 10 steps into it (so its first round back ends about when
    the others' does), never past H - 1 steps, and at 0 without an estimate or when the whole run stood
    still. No other clock takes part: not this host's time.time() (5 hours ahead here), nor the time each
    closer wrote into its commit (its own clock, a day behind here)."""
    import json
    import os

    h = 10
    _, s = _sync("eu", tmp_path, ["eu", "us"], inner_steps=h)
    ms = s.membership
    now = time.time()
    for r in (3, 4, 5):
        body = {
            "run_id": "t",
            "tag": f"r{r:06d}",
            "step": r * h,
            "members": {},
            "closed_by": "eu",
            "reason": "all",
            "waited_s": 0.0,
            "absent": [],
            "time": now - 86400.0,
            "version": 1,
        }
        ms.store.create(ms.commit_key(f"r{r:06d}"), json.dumps(body).encode())

    def closed_ago(ages):  # when the store wrote each commit: its mtime
        for r, age in zip((3, 4, 5), ages, strict=True):
            os.utime(ms.store.root / ms.commit_key(f"r{r:06d}"), (now - age, now - age))

    monkeypatch.setattr(time, "time", lambda: now + 5 * 3600.0)
    closed_ago((50.0, 30.0, 12.0))  # rounds take 20 s; round 5 closed 12 s ago
    s.round = 5
    assert s._steps_into_round() == 6  # (50 - 12) / 2 = 19 s per round; 12 s into it: int(10 * 12 / 19)
    s.round = 3  # one closed round to go by: no estimate
    assert s._steps_into_round() == 0
    s.round = 5
    closed_ago((70.0, 50.0, 30.0))  # round 6 is 10 s overdue (a region waits out grace_s): at most H - 1
    assert s._steps_into_round() == h - 1
    closed_ago((100.0, 80.0, 60.0))  # nothing closed for 3 rounds' time: every region was away, start at 0
    assert s._steps_into_round() == 0


def test_a_crashed_region_is_found_by_its_heartbeat_and_rejoins_bit_identical(tmp_path):
    """Both regions beat every 0.2 s. us "crashes" after round 1: its heartbeat stops, no leave is written.
    eu's round 2 waits until us's heartbeat has stood still for 3 beats (<= 0.6 s, not grace_s = 5 s) and
    closes it alone as "stale", naming us; rounds 3 and 4 close at once. us comes back from its round-1
    state (a new process: a new heartbeat), fast-forwards, is waited for again in round 5, takes part, and
    both regions hold the same bits."""
    regions = ["eu", "us"]
    kw = dict(grace_s=5.0, heartbeat_s=0.2, keep_rounds=10, snapshot_every=100)

    def crash(s):  # its heartbeat stops and nothing else is written
        assert s.membership.beating
        s.membership.stop_heartbeat()

    syncs, saved = _round_one_then_us_goes(tmp_path, regions, kw, crash)
    m_eu, s_eu, opt_eu = syncs["eu"]
    assert s_eu.membership.beating
    recs = _rounds(m_eu, s_eu, opt_eu, "eu", [2, 3, 4])
    assert [(x["xr_members"], x["xr_close_reason"], x["xr_stale"]) for x in recs] == [
        (["eu"], "stale", ["us"])
    ] * 3
    waits = [x["xr_wait_s"] for x in recs]
    # (round 2 may wait less than 0.6 s: eu may have watched us's heartbeat already while waiting in round 1)
    assert waits[0] < 2.5 and max(waits[1:]) < 0.5, waits

    m_us, s_us, adopted = _us_back(tmp_path, regions, kw, saved)
    assert torch.equal(s_us.theta_outer, s_eu.theta_outer) and 4 * H <= adopted < 5 * H
    opt_us = torch.optim.SGD(m_us.parameters(), lr=0.05)
    both = {"eu": (m_eu, s_eu, opt_eu, 4 * H + 1), "us": (m_us, s_us, opt_us, adopted + 1)}

    def round5(r):
        m, s, opt, first = both[r]
        if r == "us":
            time.sleep(1.0)  # us is slow this round, but it beats: eu waits for it (grace_s 5 s)
        inner_steps(m, opt, r, range(first, 5 * H + 1))
        return s.after_optimizer_step(5 * H, 32)

    out = in_threads(round5, regions)
    assert out["eu"]["xr_members"] == ["eu", "us"] == out["us"]["xr_members"], out["eu"]
    assert out["eu"]["xr_close_reason"] == "all" and out["eu"]["xr_stale"] == []
    assert torch.equal(flat(m_eu), flat(m_us)) and torch.equal(s_eu.theta_outer, s_us.theta_outer)
    s_eu.close()
    assert not s_eu.membership.beating


def test_a_region_wrongly_seen_gone_costs_one_round_without_it_and_stays_bit_identical(tmp_path):
    """us is alive but its heartbeat stops for a while after round 1 (a false "gone": a stalled writer, a
    store outage for its beats): eu's watch counts it gone and eu closes round 2 alone as "stale". us then
    beats again and publishes round 2 after that: it is late, applies the committed round like eu, and round
    3 has both, with the same bits on both sides."""
    regions = ["eu", "us"]
    kw = dict(grace_s=20.0, heartbeat_s=0.5, keep_rounds=10, snapshot_every=100)
    syncs, _ = _round_one_then_us_goes(tmp_path, regions, kw, lambda s: s.membership.stop_heartbeat())
    commit2 = tmp_path / "t" / "r000002" / "_commit.json"
    old = syncs["eu"][1].membership.read_heartbeat("us")

    def region(r):
        m, s, opt = syncs[r]
        if r == "us":
            deadline = time.monotonic() + 30.0
            while not commit2.exists():  # eu closed round 2 without us
                assert time.monotonic() < deadline, "eu never closed round 2"
                time.sleep(0.02)
            s.membership.start_heartbeat()  # beating again (a new incarnation)
            return _rounds(m, s, opt, r, [2, 3])
        out = _rounds(m, s, opt, r, [2])  # closed "stale" with us seen gone (asserted below; the watch may
        # see us beating again by the time this returns: us restarts its heartbeat once round 2 is committed)
        deadline = time.monotonic() + 30.0
        while (hb := s.membership.read_heartbeat("us")) == old or hb is None:  # round 3 starts with us alive
            assert time.monotonic() < deadline, "us never beat again"
            time.sleep(0.02)
        return out + _rounds(m, s, opt, r, [3])

    out = in_threads(region, regions)
    (eu2, eu3), (us2, us3) = out["eu"], out["us"]
    assert (eu2["xr_members"], eu2["xr_close_reason"], eu2["xr_stale"]) == (["eu"], "stale", ["us"])
    assert us2["xr_late"] and us2["xr_members"] == ["eu"]
    assert eu3["xr_members"] == ["eu", "us"] == us3["xr_members"] and eu3["xr_close_reason"] == "all"
    (m_eu, s_eu, _), (m_us, s_us, _) = syncs["eu"], syncs["us"]
    assert torch.equal(s_eu.theta_outer, s_us.theta_outer) and torch.equal(flat(m_eu), flat(m_us))


def test_a_returning_region_beats_only_once_caught_up(tmp_path, monkeypatch):
    """us crashes after round 1 and comes back after eu's round 3: while it loads and replays rounds 2 and 3
    it writes no heartbeat (its old one goes on ageing: a crash in there looks like what it is); it beats,
    as a new incarnation, from the end of its catch-up."""
    regions = ["eu", "us"]
    kw = dict(grace_s=5.0, heartbeat_s=0.2, keep_rounds=10, snapshot_every=100)
    syncs, saved = _round_one_then_us_goes(tmp_path, regions, kw, lambda s: s.membership.stop_heartbeat())
    m_eu, s_eu, opt_eu = syncs["eu"]
    _rounds(m_eu, s_eu, opt_eu, "eu", [2, 3])
    old = s_eu.membership.read_heartbeat("us")
    m_us, s_us = _sync("us", tmp_path, regions, seed=99, **kw)
    m_us.load_state_dict(saved["model"])
    s_us.load_state_dict(saved["outer"])
    beating = []
    replay = s_us._replay

    def watched(r):
        beating.append((r, s_us.membership.beating))
        replay(r)

    monkeypatch.setattr(s_us, "_replay", watched)
    time.sleep(0.5)  # a region that beat from its start would have written by now
    assert not s_us.membership.beating and s_eu.membership.read_heartbeat("us") == old
    s_us.catch_up(H)
    assert beating == [(2, False), (3, False)] and s_us.round == 3
    assert s_us.membership.beating
    deadline = time.monotonic() + 20.0
    while (hb := s_eu.membership.read_heartbeat("us")) == old:
        assert time.monotonic() < deadline, "us never beat after its catch-up"
        time.sleep(0.05)
    assert hb is not None and old is not None and hb.incarnation != old.incarnation


def test_a_payload_cleaned_up_under_a_fast_forward_makes_it_plan_again(tmp_path, monkeypatch):
    """A round's payload can be deleted (the other region's cleanup) between reading its commit and
    downloading it: the returning region plans its catch-up again instead of failing (seen once in an e2e
    run: StoreError "object missing" ended the attempt), and still holds exactly eu's outer state."""
    from sbatch_gen.train.xr import exchange
    from sbatch_gen.train.xr.errors import StoreError

    regions = ["eu", "us"]
    kw = dict(keep_rounds=10, snapshot_every=100)
    syncs, saved = _round_one_then_us_goes(tmp_path, regions, kw, lambda s: s.leave(H, "test"))
    m_eu, s_eu, opt_eu = syncs["eu"]
    _rounds(m_eu, s_eu, opt_eu, "eu", [2, 3])
    download, failed = exchange.read_objects, []

    def vanishing_once(mb, tag, *a, **k):
        if not failed and mb.region == "us":
            failed.append(tag)
            raise StoreError(f"object missing: {tag}/eu/s00000.bin")
        return download(mb, tag, *a, **k)

    monkeypatch.setattr(exchange, "read_objects", vanishing_once)
    events = []
    m_us, s_us, _adopted = _us_back(tmp_path, regions, kw, saved, log=events.append)
    assert failed, "the fast-forward never downloaded a round"
    assert torch.equal(s_us.theta_outer, s_eu.theta_outer) and torch.equal(s_us.momentum, s_eu.momentum)
    ev = [e for e in events if e.get("event") == "xr_rejoin"][0]
    assert ev["from_round"] == 1 and ev["to_round"] == 3
