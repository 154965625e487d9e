"""overlap: eager in one process per region (regions as threads): the exchange of round t runs during the
inner steps of round t+1. The two invariants, against references computed here: the shared outer state
(theta_outer, momentum) advances by the committed averages only and is the same bits in every region; a
region's working model is that state minus its own fresh delta (outer_lr x (1 + momentum) x its weight)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sbatch_gen.train.xr.errors import XRLayoutError
from sbatch_gen.train.xr.protocol import round_tag
from sbatch_gen.train.xr.sync import ROUND_PARTS

from .region_loop import run_region, while_away
from .test_sync import REGIONS, in_threads, make

pytestmark = pytest.mark.slow  # real mailbox, background threads

H = 3


def run(region, root, rounds, **kw):
    """Train ``rounds`` x H steps with overlap eager (or from ``state``: a resumed region); ``out["rounds"]``:
    what each boundary left behind; the final parameters. See :func:`.region_loop.run_region`."""
    kw.setdefault("overlap", "eager")
    kw.setdefault("inner_steps", H)
    out = run_region(region, root, rounds * kw["inner_steps"], **kw)
    out["rounds"] = out["steps"]
    return out


def nesterov64(theta, mom, g, lr, mu):
    mom = mu * mom + g
    return theta - lr * (g + mu * mom), mom


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_shared_state_is_identical_and_the_model_is_it_minus_the_own_fresh_delta(tmp_path, dtype):
    tokens = {"eu": 30, "us": 90}
    lr, mu = 0.6, 0.5
    res = in_threads(
        lambda r: run(r, tmp_path, 4, tokens=tokens, payload_dtype=dtype, outer_lr=lr, outer_momentum=mu)
    )
    eu, us = res["eu"], res["us"]
    boundaries = sorted(eu["rounds"])
    assert boundaries == [3, 6, 9, 12]
    theta = eu["rounds"][3]["theta"].double()  # theta0 (nothing committed at the first boundary)
    mom = torch.zeros_like(theta)
    w = {"eu": 30 / 120, "us": 90 / 120}
    for i, b in enumerate(boundaries):
        E, U = eu["rounds"][b], us["rounds"][b]
        # 1. the shared state: the same bits in both regions
        assert torch.equal(E["theta"], U["theta"]) and torch.equal(E["momentum"], U["momentum"]), b
        # ... advanced by the committed average of the previous round: the regions' own deltas, weighted
        if i > 0:
            prev = boundaries[i - 1]
            g = sum(w[r] * res[r]["rounds"][prev]["own"].double() for r in REGIONS)
            theta, mom = nesterov64(theta, mom, g, lr, mu)
            assert torch.allclose(E["theta"].double(), theta, rtol=1e-5, atol=1e-6), b
            assert E["rec"]["xr_round"] == i and E["rec"]["xr_members"] == REGIONS
            # the round's phases, hidden or not, add up to its total; training waited for the join only
            rec = E["rec"]
            assert rec["xr_total_s"] == pytest.approx(sum(rec[f"xr_{k}"] for k in ROUND_PARTS))
            assert rec["xr_join_s"] <= rec["xr_exposed_s"]
        else:
            assert "xr_round" not in E["rec"]  # nothing was in flight yet
        for r in REGIONS:
            X = res[r]["rounds"][b]
            assert X["rec"]["xr_inflight"] == i + 1
            # 2. the working model is the shared state minus the own fresh delta, exactly
            assert torch.equal(X["model"], X["theta"] - X["own"] * X["early"]), (r, b)
            # the own delta is this phase's progress (from where the phase started), as the wire carries it
            start = res[r]["rounds"][prev]["model"] if i > 0 else X["theta"]
            fresh = start - X["local"]
            if dtype == "fp32":
                assert torch.equal(X["own"], fresh)
            else:
                assert torch.allclose(X["own"], fresh, atol=fresh.abs().max().item() * 0.01)
            # its weight: this region's tokens over its own and the others' in the last commit
            # (the first boundary assumes every region brings as many as this one)
            est = w[r] if i > 0 else 0.5
            assert X["early"] == pytest.approx(lr * (1 + mu) * est), (r, b)
    # finish(): the round in flight is applied, and both regions end on the same bits: the shared state
    g = sum(w[r] * res[r]["rounds"][12]["own"].double() for r in REGIONS)
    theta, mom = nesterov64(theta, mom, g, lr, mu)
    assert torch.equal(eu["params"], us["params"]) and torch.equal(eu["params"], eu["theta_end"])
    assert torch.allclose(eu["params"].double(), theta, rtol=1e-5, atol=1e-6)
    assert eu["final"]["xr_round"] == 4 and eu["final"]["xr_final"] is True


def test_training_goes_on_while_the_other_region_has_not_published(tmp_path):
    """us holds back its first boundary until eu has passed its own and trained into the next phase: with
    overlap none eu would wait at that boundary for us (a deadlock here); eager joins a round later."""
    eu_ahead = threading.Event()

    def gate(region, step):
        if region == "eu" and step == H + 1:
            eu_ahead.set()
        if region == "us" and step == H:
            assert eu_ahead.wait(30), "eu waited at its first boundary for us"

    res = in_threads(lambda r: run(r, tmp_path, 3, gate=gate))
    assert torch.equal(res["eu"]["params"], res["us"]["params"])
    # the second boundary joined round 1, which us published late: eu waited there, not at the first
    assert res["eu"]["rounds"][2 * H]["rec"]["xr_round"] == 1


@pytest.mark.parametrize("case", ["in-flight", "committed-while-away", "manifest-lost"])
def test_a_stop_with_a_round_in_flight_resumes_to_the_uninterrupted_bits(tmp_path, case):
    """eu stops mid-phase with round 2 in flight and resumes from the state it saved; both regions end on
    exactly the bits of an uninterrupted run. in-flight: round 2 is still open when eu is back, which runs
    its exchange again (re-entering it); committed-while-away: us closed round 2 (eu's delta was published)
    before eu came back, which joins that commit instead of fast-forwarding past its own progress;
    manifest-lost: the stop came before the upload finished, eu publishes the saved delta again."""
    ref = in_threads(lambda r: run(r, tmp_path / "ref", 4))
    root = tmp_path / "mbx"
    go_on = threading.Event()  # us publishes round 2 only then

    def gate(region, step):
        if region == "us" and step == 2 * H:
            assert go_on.wait(60)
        if region == "eu" and step == 2 * H + 2:  # the resumed eu's first step: it has caught up
            go_on.set()

    def eu_then_resume():
        first = run("eu", root, 4, stop_at=2 * H + 1)
        while_away(root, 2, case, go_on)
        return run("eu", root, 4, state=first["state"], gate=gate)

    res = in_threads(lambda r: eu_then_resume() if r == "eu" else run(r, root, 4, gate=gate))

    def rounds(out):
        keys = ("xr_round", "xr_members", "xr_late", "xr_reused", "xr_early_weight", "xr_tokens")
        return {b: {k: x["rec"].get(k) for k in keys} for b, x in out["rounds"].items()}

    for r in REGIONS:
        assert torch.equal(res[r]["params"], ref[r]["params"]), (r, rounds(res[r]), rounds(ref[r]))
    assert torch.equal(res["eu"]["params"], res["us"]["params"])


def test_a_checkpoint_with_a_round_in_flight_is_refused_without_overlap(tmp_path):
    res = in_threads(lambda r: run(r, tmp_path, 2, stop_at=H + 1), regions=["eu"])
    state = res["eu"]["state"]["outer"]
    assert state["inflight"] == 1
    _, s = make("eu", tmp_path / "other", regions=["eu"])
    with pytest.raises(XRLayoutError, match="round 1 in flight .*overlap: eager"):
        s.load_state_dict(state)
    s.close()


def test_elastic_a_region_away_costs_no_stall_and_rejoins_on_the_shared_state(tmp_path):
    """min_regions 1: us stops mid-phase with round 1 in flight (a planned leave), eu trains on alone;
    us comes back from its saved state 3 rounds later, fast-forwards (dropping its round in flight) and from
    its first boundary back holds eu's shared state bit for bit; both end on the same parameters."""
    root, kw = tmp_path / "mbx", dict(min_regions=1, grace_s=1.0, heartbeat_s=0.2, snapshot_every=2)
    eu_far, us_back = threading.Event(), threading.Event()

    def gate(region, step):  # us comes back once eu is past round 4; eu then waits for it to be back
        if region == "eu" and step == 4 * H + 1:
            eu_far.set()
        if region == "eu" and step == 4 * H + 2:
            assert us_back.wait(60)
        if region == "us" and eu_far.is_set():
            us_back.set()

    def us_away_then_back():
        first = run("us", root, 6, stop_at=H + 1, **kw)
        assert first["state"]["outer"]["inflight"] == 1
        assert eu_far.wait(60)
        # eu's round 4 closes in the background while eu trains on (eager): us comes back after its commit,
        # else (a loaded machine) it would find round 3 the newest and adopt a step of round 4's phase
        commit4, deadline = root / "t" / round_tag(4) / "_commit.json", time.monotonic() + 60
        while not commit4.exists():
            assert time.monotonic() < deadline, "eu's round 4 never closed"
            time.sleep(0.01)
        return run("us", root, 6, state=first["state"], gate=gate, **kw)

    res = in_threads(lambda r: us_away_then_back() if r == "us" else run(r, root, 6, gate=gate, **kw))
    eu, us = res["eu"], res["us"]
    assert us["adopted"] is not None and us["adopted"] >= 4 * H  # fast-forwarded to the run
    for b, rec in eu["rounds"].items():  # eu never waited for the absent region beyond its grace
        assert rec["rec"]["xr_join_s"] < kw["grace_s"] + 1.0, b
    absent = [b for b, r in eu["rounds"].items() if r["rec"].get("xr_members") == ["eu"]]
    assert absent, "no round closed without us"
    back = min(us["rounds"])
    assert torch.equal(us["rounds"][back]["theta"], eu["rounds"][back]["theta"])
    assert torch.equal(us["rounds"][back]["momentum"], eu["rounds"][back]["momentum"])
    assert torch.equal(eu["params"], us["params"])


def test_no_quorum_for_the_last_round_then_a_restart_at_the_end_finishes_it(tmp_path):
    """eu's finish() finds no quorum for the last round (us is late): eu checkpoints with the round in flight,
    as the trainer does before exiting for a requeue. Restarted at the end step (no step left to train),
    start() runs that round again and finish() joins it: eu ends on us's parameters, the run's last state."""
    root = tmp_path / "mbx"
    eu_gave_up = threading.Event()

    def gate(region, step):
        if region == "us" and step == 3 * H:
            assert eu_gave_up.wait(60)

    def eu():
        first = run("eu", root, 3, timeout_s=3.0)  # us keeps up until its gate, then is away
        assert "final" not in first and first["state"]["outer"]["inflight"] == 3
        eu_gave_up.set()
        return run("eu", root, 3, state=first["state"])

    res = in_threads(lambda r: eu() if r == "eu" else run(r, root, 3, gate=gate))
    assert res["eu"]["rounds"] == {}  # nothing left to train after the restart
    assert res["eu"]["final"]["xr_round"] == 3 and res["eu"]["final"]["xr_members"] == REGIONS
    assert torch.equal(res["eu"]["params"], res["us"]["params"])
