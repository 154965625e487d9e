"""overlap: streaming (Streaming DiLoCo) in one process per region (regions as threads): F fragments, each
synced once every H steps at its own offset, its exchange running for tau inner steps before the merge.
Against references computed here in float64: the shared outer state advances fragment by fragment by the
committed averages only and is the same bits in every region; the merge gives a fragment
``theta + alpha * (x - theta)`` and leaves the other fragments alone; every region ends on theta_outer."""

from __future__ import annotations

import threading

import pytest
import torch

from sbatch_gen.train.xr import scaled
from sbatch_gen.train.xr.errors import XRLayoutError
from sbatch_gen.train.xr.fragments import fragment_of, round_step
from sbatch_gen.train.xr.sync import ROUND_PARTS
from sbatch_gen.xr_options import S3Credentials, S3Transport

from .conftest import KEY_ENV, SECRET_ENV
from .region_loop import run_region, while_away
from .test_overlap import nesterov64
from .test_sync import REGIONS, in_threads, make

pytestmark = pytest.mark.slow  # real mailbox, background threads

H = 12  # with F = 4: a round every 3 steps, tau up to 2


def run(region, root, cycles, **kw):
    """Train ``cycles`` x H steps with overlap streaming; see :func:`.region_loop.run_region`."""
    kw.setdefault("overlap", "streaming")
    kw.setdefault("inner_steps", H)
    return run_region(region, root, cycles * kw["inner_steps"], **kw)


def on_the_wire(vec: torch.Tensor, plan, dtype: str) -> torch.Tensor:
    """``vec`` as every region decodes it (float64): scaled dtypes quantised shard by shard."""
    if dtype == "fp32":
        return vec.double()
    if dtype == "bf16":
        return vec.to(torch.bfloat16).double()
    out = torch.empty(vec.numel(), dtype=torch.float64)
    for lo, hi in plan.bounds:
        out[lo:hi] = scaled.decode(scaled.encode(vec[lo:hi], dtype), hi - lo, dtype).double()
    return out


CASES = [  # (fragments, tau, alpha, payload)
    (2, 1, 0.5, "fp32"),
    (4, 0, 0.5, "fp32"),
    (4, 2, 0.5, "fp32"),
    (4, 2, 0.0, "fp32"),
    (2, 3, 0.5, "int8"),
    (4, 1, 0.5, "int4"),
    (2, 2, 0.5, "fp8"),
]


@pytest.mark.parametrize(("frags", "tau", "alpha", "dtype"), CASES)
def test_the_update_rule_fragment_by_fragment_against_float64(tmp_path, frags, tau, alpha, dtype):
    check_update_rule(tmp_path, frags, tau, alpha, dtype)


@pytest.mark.parametrize("frags", [2, 4])
def test_the_update_rule_over_s3(tmp_path, s3server, bucket, frags):
    """The same rounds through the S3 mailbox (the local test server): the same references hold."""
    transport = S3Transport(
        bucket=bucket,
        prefix="streaming",
        endpoint_url=s3server.endpoint_url,
        addressing_style="path",
        region_name="us-east-1",
        credentials=S3Credentials(access_key_id_env=KEY_ENV, secret_access_key_env=SECRET_ENV),
    )
    check_update_rule(tmp_path, frags, 1, 0.5, "bf16", transport=transport)


def check_update_rule(tmp_path, frags, tau, alpha, dtype, **extra):
    tokens = {"eu": 30, "us": 90}
    lr, mu = 0.6, 0.5
    kw = dict(
        fragments=frags, fragment_delay_steps=tau, fragment_alpha=alpha, payload_dtype=dtype, outer_lr=lr
    )
    kw.update(extra)
    res = in_threads(lambda r: run(r, tmp_path, 3, tokens=tokens, outer_momentum=mu, **kw))
    eu, us = res["eu"], res["us"]
    s = eu["sync"]
    w = {"eu": 30 / 120, "us": 90 / 120}
    theta, mom = eu["theta0"].double(), torch.zeros(s.numel, dtype=torch.float64)
    assert torch.equal(eu["theta0"], us["theta0"])
    launches = {round_step(k, H, frags): k for k in range(1, 3 * frags + 1)}
    merges = {step + tau: k for step, k in launches.items()}
    assert sorted(eu["steps"]) == sorted(set(launches) | set(merges) - {3 * H + tau})
    for step in sorted(eu["steps"]):
        E, U = eu["steps"][step], us["steps"][step]
        # the shared state: the same bits in both regions at every step where something ran
        assert torch.equal(E["theta"], U["theta"]) and torch.equal(E["momentum"], U["momentum"]), step
        if step in launches and (tau > 0 or step not in merges):
            k = launches[step]
            lo, hi = s.flat.fragment(fragment_of(k, frags))
            for X in (E, U):  # the delta: where the fragment's shared state is, minus the local parameters
                assert torch.equal(X["own"][lo:hi], X["theta"][lo:hi] - X["local"][lo:hi]), step
                assert X["rec"]["xr_inflight"] == k and X["rec"]["xr_fragment"] == fragment_of(k, frags)
                assert torch.equal(X["model"], X["local"])  # training goes on untouched
        if step in merges:
            k = merges[step]
            p = fragment_of(k, frags)
            lo, hi = s.flat.fragment(p)
            ex = s.frag_ex[p]  # what crosses the wire: the fragment's shards, each quantised on its own
            g = sum(w[r] * on_the_wire(res[r]["steps"][step]["own"][lo:hi], ex.plan, dtype) for r in REGIONS)
            theta[lo:hi], mom[lo:hi] = nesterov64(theta[lo:hi], mom[lo:hi], g, lr, mu)
            assert torch.allclose(E["theta"].double(), theta, rtol=1e-5, atol=1e-6), step
            rec = E["rec"]
            assert rec["xr_round"] == k and rec["xr_fragment"] == p and rec["xr_members"] == REGIONS
            assert rec["xr_total_s"] == pytest.approx(sum(rec[f"xr_{x}"] for x in ROUND_PARTS))
            for X in (E, U):
                # the merge: the fragment becomes theta + alpha * (x - theta), the others are untouched
                t32 = X["theta"][lo:hi]
                want = t32 if alpha == 0 else torch.sub(X["local"][lo:hi], t32).mul_(alpha).add_(t32)
                assert torch.equal(X["model"][lo:hi], want), step
                assert torch.equal(X["model"][:lo], X["local"][:lo]) and torch.equal(
                    X["model"][hi:], X["local"][hi:]
                )
    # the last round (fragment F-1 at step 3H) merges in finish(); both regions end on the shared state
    if tau > 0:
        assert eu["final"]["xr_round"] == 3 * frags and eu["final"]["xr_final"] is True
    else:
        assert eu["final"] is None
    assert torch.equal(eu["params"], us["params"]) and torch.equal(eu["params"], eu["theta_end"])
    assert torch.equal(eu["theta_end"], us["theta_end"])


def test_one_fragment_without_delay_or_merge_is_diloco_without_overlap(tmp_path):
    """F = 1, tau = 0, alpha = 0 is DiLoCo itself: the same bits as overlap none, round for round."""
    from .test_overlap import run as run_diloco

    kw = dict(outer_lr=0.7, outer_momentum=0.5, inner_steps=3)
    none = in_threads(lambda r: run_diloco(r, tmp_path / "none", 4, overlap="none", **kw))
    one = in_threads(
        lambda r: run(r, tmp_path / "one", 4, fragments=1, fragment_delay_steps=0, fragment_alpha=0.0, **kw)
    )
    for r in REGIONS:
        assert torch.equal(none[r]["params"], one[r]["params"])
        for step, x in none[r]["rounds"].items():
            assert torch.equal(one[r]["steps"][step]["theta"], x["theta"]), (r, step)


@pytest.mark.parametrize("case", ["in-flight", "committed-while-away", "manifest-lost"])
def test_a_stop_mid_cycle_resumes_to_the_uninterrupted_bits(tmp_path, case):
    """eu stops one step after round 4 started (fragment 3, tau 2: in flight) and resumes from the state it
    saved; both regions end on exactly the bits of an uninterrupted run (see test_overlap's twin for the
    three cases)."""
    kw = dict(fragments=4, fragment_delay_steps=2)
    ref = in_threads(lambda r: run(r, tmp_path / "ref", 2, **kw))
    root = tmp_path / "mbx"
    go_on = threading.Event()  # us starts round 4 only then
    k_stop = 4
    at = round_step(k_stop, H, 4)

    def gate(region, step):
        if region == "us" and step == at:
            assert go_on.wait(60)
        if region == "eu" and step == at + 2:  # the resumed eu's first step
            go_on.set()

    def eu_then_resume():
        first = run("eu", root, 2, stop_at=at + 1, **kw)
        assert first["state"]["outer"]["inflight"] == k_stop
        while_away(root, k_stop, case, go_on)
        return run("eu", root, 2, state=first["state"], gate=gate, **kw)

    res = in_threads(lambda r: eu_then_resume() if r == "eu" else run(r, root, 2, gate=gate, **kw))
    for r in REGIONS:
        assert torch.equal(res[r]["params"], ref[r]["params"]), r
        for step, x in ref[r]["steps"].items():  # and every step's model on the way (after the resume)
            if step > at + 1:
                assert torch.equal(res[r]["steps"][step]["model"], x["model"]), (r, step)


def test_a_checkpoint_of_another_split_is_refused(tmp_path):
    res = in_threads(
        lambda r: run(r, tmp_path, 1, stop_at=4, fragments=4, fragment_delay_steps=2), regions=["eu"]
    )
    state = res["eu"]["state"]["outer"]
    assert state["inflight"] == 1 and state["fragments"] == 4
    for kw, said in (
        (dict(overlap="none"), "fragments 4, this run has without overlap: streaming"),
        (dict(overlap="eager"), "fragments 4, this run has without overlap: streaming"),
        (
            dict(overlap="streaming", fragments=2, fragment_delay_steps=2),
            "fragments 4, this run has overlap: streaming, fragments 2",
        ),
    ):
        _, s = make("eu", tmp_path / "other", regions=["eu"], inner_steps=H, **kw)
        with pytest.raises(XRLayoutError, match=said):
            s.load_state_dict(state)
        s.close()


def test_elastic_a_region_that_crashes_mid_cycle_rejoins_and_every_round_closes_in_bounds(tmp_path):
    """min_regions 1: us dies one step after round 6 started (no leave: its heartbeat goes stale), eu trains
    on alone; us comes back from its last periodic checkpoint (step 12) once eu is 2 cycles further,
    fast-forwards, and from then on both hold the same shared state at every merge; both end identical."""
    root = tmp_path / "mbx"
    kw = dict(
        fragments=4,
        fragment_delay_steps=1,
        min_regions=1,
        grace_s=1.5,
        heartbeat_s=0.2,
        snapshot_every=4,
        keep_rounds=2,
    )
    eu_far, us_back = threading.Event(), threading.Event()
    crash_at, far = round_step(6, H, 4) + 1, 4 * H

    def gate(region, step):
        if region == "eu" and step == far:
            eu_far.set()
        if region == "eu" and step == far + 1:  # eu goes on once us is back (the rest is in lock-step)
            assert us_back.wait(60)

    events: list[dict] = []

    def us():
        first = run("us", root, 6, save_at=H, crash_at=crash_at, **kw)
        assert eu_far.wait(60)
        us_back.set()
        return run("us", root, 6, state=first["state"], log=events.append, **kw)

    res = in_threads(lambda r: us() if r == "us" else run(r, root, 6, gate=gate, **kw))
    eu, usr = res["eu"], res["us"]
    merges = {s: x["rec"] for s, x in eu["steps"].items() if "xr_round" in x["rec"]}
    assert sorted(r["xr_round"] for r in merges.values()) == list(range(1, 6 * 4))  # the last: finish()
    for step, rec in merges.items():  # no round held eu up beyond the elastic bounds
        assert rec["xr_exposed_s"] < kw["grace_s"] + 1.0, (step, rec)
    away = [r["xr_round"] for r in merges.values() if r["xr_members"] == ["eu"]]
    assert 6 in away or 7 in away, away  # the round us died in, or the next, closed without it
    assert usr["adopted"] is not None and usr["adopted"] >= far - H // 4  # fast-forwarded to the run
    (rejoin,) = [e for e in events if e["event"] == "xr_rejoin"]
    # its rounds since the checkpoint were cleaned up behind a snapshot (keep_rounds 2): every fragment's
    # outer state came from the snapshot, the rounds after it were replayed each on its fragment
    assert rejoin["from_round"] == 3 and any(v.startswith("snapshot") for v in rejoin["via"]), rejoin
    back = sorted(s for s, x in usr["steps"].items() if "xr_round" in x["rec"])
    assert back
    for s in back:
        assert torch.equal(usr["steps"][s]["theta"], eu["steps"][s]["theta"]), s
        assert torch.equal(usr["steps"][s]["momentum"], eu["steps"][s]["momentum"]), s
    assert usr["steps"][back[-1]]["rec"]["xr_members"] == REGIONS
    assert torch.equal(eu["params"], usr["params"])


def test_elastic_a_late_region_applies_the_round_it_missed_and_a_planned_leave_closes_rounds_at_once(
    tmp_path, monkeypatch
):
    """min_regions 1. us's delta for round 3 arrives after eu closed it (withheld: as if late): us applies
    the committed update like eu, its record says late, and the shared state stays the same bits. Then us
    leaves (a planned stop, announced): eu closes the next rounds without waiting out its grace."""
    root = tmp_path / "mbx"
    kw = dict(fragments=4, fragment_delay_steps=1, min_regions=1, grace_s=1.0, heartbeat_s=0.2)
    stop_at = round_step(6, H, 4) + 1

    from sbatch_gen.testing.faults import withholding
    from sbatch_gen.train.xr.exchange import Exchange

    monkeypatch.setattr(Exchange, "upload", withholding(Exchange.upload, "us", {3}))  # us's round 3 only
    res = in_threads(lambda r: run(r, root, 3, stop_at=stop_at, **kw) if r == "us" else run(r, root, 3, **kw))
    eu, us = res["eu"], res["us"]
    by_round = {x["rec"]["xr_round"]: x for x in eu["steps"].values() if "xr_round" in x["rec"]}
    assert by_round[3]["rec"]["xr_members"] == ["eu"] and by_round[3]["rec"]["xr_close_reason"] == "grace"
    us3 = next(x for x in us["steps"].values() if x["rec"].get("xr_round") == 3)
    assert us3["rec"]["xr_late"] is True
    assert torch.equal(us3["theta"], by_round[3]["theta"]) and torch.equal(
        us3["momentum"], by_round[3]["momentum"]
    )
    # after us left (round 6 in flight): eu's next rounds closed at once, for the leave
    after = [by_round[k]["rec"] for k in sorted(by_round) if k > 6]
    assert after and all(r["xr_close_reason"] == "leave" and r["xr_exposed_s"] < 1.0 for r in after), after


def test_a_round_in_flight_past_its_merge_step_is_merged_not_left_behind(tmp_path):
    """Should a trainer ever skip steps (it never does: the test calls the sync directly), a round in flight
    whose merge step went by is merged at the next step, and a round due at that step still starts."""
    _, s = make(
        "eu",
        tmp_path,
        regions=["eu"],
        overlap="streaming",
        inner_steps=H,
        fragments=4,
        fragment_delay_steps=2,
    )
    s.align(0)
    start = s.after_optimizer_step(3, 32)  # round 1 starts; due to merge at step 5
    assert start["xr_inflight"] == 1 and s.inflight == 1
    rec = s.after_optimizer_step(6, 32)  # step 5 skipped; round 2 is due at 6
    assert rec["xr_round"] == 1 and rec["xr_inflight"] == 2 and s.round == 1 and s.inflight == 2
    s.finish(6)
    assert s.round == 2 and s.inflight == 0
    s.close()
