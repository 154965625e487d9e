"""Regions that disagree at run time on what their rounds share (H, the outer step, the wire, the quorum,
the fragments, ...) are refused at their first round, each in one line naming both regions and the setting;
regions that agree go on as before. Regions as threads of one process, an fs mailbox."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from sbatch_gen.train.xr.errors import XRSettingsError
from sbatch_gen.train.xr.protocol import Manifest
from sbatch_gen.xr_options import CrossRegion, FsTransport

from .test_sync import inner_steps, make

REGIONS = ["eu", "us"]


def _region(region, root, rounds, kw, out, errors, saved=None):
    """Align (or resume from ``saved[region]``), catch up and train ``rounds`` rounds (SGD): the round
    records, the finish record, theta_outer and the saved state in ``out``, an error in ``errors``."""
    m, s = make(region, root, **kw)
    try:
        first = 1
        if saved is not None:
            m.load_state_dict(saved[region]["model"])
            s.load_state_dict(saved[region]["outer"])
            first = saved[region]["step"] + 1
        s.align(0)
        s.catch_up(first - 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        h = s.xr.inner_steps
        recs = []
        for step in range(first, first + rounds * h):
            inner_steps(m, opt, region, [step])
            rec = s.after_optimizer_step(step, 32)
            if rec is not None and "xr_round" in rec:
                recs.append(rec)
        fin = s.finish(step)
        state = {
            "model": {k: v.clone() for k, v in m.state_dict().items()},
            "outer": {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.state_dict().items()},
            "step": step,
        }
        out[region] = (recs, fin, s.theta_outer.clone(), state)
    except Exception as e:  # noqa: BLE001 - the test reads it
        errors[region] = e
    finally:
        s.close()


def _both(root, kw, rounds=2, join_s=60, saved=None):
    """Both regions at once, each with ``kw[region]``: ({region: result}, {region: error}, seconds)."""
    out, errors = {}, {}
    t0 = time.monotonic()
    ts = [
        threading.Thread(
            target=_region, args=(r, root, rounds, kw[r], out, errors, saved), name=f"region-{r}"
        )
        for r in REGIONS
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(join_s)
    assert not any(t.is_alive() for t in ts), "a region still runs"
    return out, errors, time.monotonic() - t0


BASE = dict(timeout_s=60, payload_dtype="fp32")


@pytest.mark.parametrize(
    ("setting", "eu", "us"),
    [
        ("inner_steps", {"inner_steps": 4}, {"inner_steps": 8}),
        ("outer_lr", {"outer_lr": 1.0}, {"outer_lr": 0.7}),
        (  # elastic: eu's wait reads us's presence with its heartbeat, as for any region it judges
            "inner_steps",
            {"min_regions": 1, "grace_s": 30, "heartbeat_s": 0.5},
            {"min_regions": 1, "grace_s": 30, "heartbeat_s": 0.5, "inner_steps": 8},
        ),
        ("outer_momentum", {}, {"outer_momentum": 0.5}),
        ("payload_dtype", {}, {"payload_dtype": "bf16"}),
        (  # sparse payloads: the wire's chunks and entries (sparse_beta, a region's own, may differ)
            "sparse_density",
            {"payload_dtype": "sparse", "sparse_chunk": 64, "sparse_density": 0.1, "sparse_beta": 0.9},
            {"payload_dtype": "sparse", "sparse_chunk": 64, "sparse_density": 0.2},
        ),
        (
            "sparse_chunk",
            {"payload_dtype": "sparse", "sparse_chunk": 64},
            {"payload_dtype": "sparse", "sparse_chunk": 128},
        ),
        ("min_regions", {}, {"min_regions": 1, "grace_s": 30}),
        ("fragments", {}, {"overlap": "streaming", "fragments": 2, "fragment_delay_steps": 0}),
        (
            "fragments",
            {"overlap": "streaming", "fragments": 2, "fragment_delay_steps": 0},
            {"overlap": "streaming", "fragments": 4, "fragment_delay_steps": 0},
        ),
    ],
)
def test_regions_that_disagree_are_both_refused_at_their_first_round_in_one_line(tmp_path, setting, eu, us):
    """eu and us differ in one setting their rounds share: neither finishes a round; each fails with one
    line that names both regions and the setting, long before the round's timeout."""
    out, errors, took = _both(tmp_path, {"eu": {**BASE, **eu}, "us": {**BASE, **us}})
    assert not out and set(errors) == set(REGIONS), (out, errors)
    for region, e in errors.items():
        msg = str(e)
        assert isinstance(e, XRSettingsError), (region, repr(e))
        assert "\n" not in msg
        assert f"disagree on {setting}:" in msg and "'eu'" in msg and "'us'" in msg, msg
    # us adopts eu's theta0 (which says what eu shares): it refuses there, before its first round, and
    # says so in its presence record; eu, waiting in its first round, reads that and stops too
    assert str(errors["us"]).startswith("round init: regions 'us' and 'eu' disagree on"), errors["us"]
    assert str(errors["eu"]).startswith("round r000001: region 'us' refused to take part: round init:")
    assert took < 40  # the rounds' timeout is 60 s: nobody waited it out


def test_regions_that_agree_go_on_and_their_claims_say_what_they_share(tmp_path):
    """The same settings (streaming's delay and alpha, timeouts, grace, heartbeats and the regions' own
    shapes may differ): both run their rounds, bit-identical, and each claim carries the settings."""
    kw = {
        "eu": {**BASE, "fragment_alpha": 0.5, "grace_s": 5, "threads": 2},
        "us": {**BASE, "fragment_alpha": 0.25, "grace_s": 8, "timeout_s": 50, "shard_mb": 0.0005},
    }
    out, errors, _ = _both(tmp_path, kw)
    assert not errors, errors
    (recs_eu, _, theta_eu, _), (recs_us, _, theta_us, _) = out["eu"], out["us"]
    assert [r["xr_members"] for r in recs_eu] == [REGIONS, REGIONS] == [r["xr_members"] for r in recs_us]
    assert torch.equal(theta_eu, theta_us)
    claim = tmp_path / "t" / "r000001" / "us.done"
    m = Manifest.from_json(claim.read_bytes(), str(claim))
    assert (
        m.extra["settings"]
        == CrossRegion(
            enabled=True, region="us", regions=REGIONS, transport=FsTransport(root="x"), inner_steps=4, **BASE
        ).round_settings()
    )
    assert json.loads(claim.read_bytes())["extra"]["settings"]["inner_steps"] == 4


@pytest.mark.parametrize("elastic", [False, True])
def test_a_region_resumed_with_another_setting_is_refused_at_its_first_round_back(tmp_path, elastic):
    """Both take part in round 1 with the same settings and stop; both resume (aligned: no theta0 is read),
    us with another outer_lr. Round 2 is the first both publish: each reads the other's claim and refuses it
    in one line naming round 2, both regions and the setting; no round is completed."""
    kw = {**BASE, **({"min_regions": 1, "grace_s": 30} if elastic else {})}
    out, errors, _ = _both(tmp_path, {"eu": kw, "us": kw}, rounds=1)
    assert not errors, errors
    saved = {r: out[r][3] for r in REGIONS}
    out, errors, took = _both(tmp_path, {"eu": kw, "us": {**kw, "outer_lr": 0.5}}, rounds=1, saved=saved)
    assert not out and set(errors) == set(REGIONS), (out, errors)
    assert str(errors["eu"]) == (
        "round r000002: regions 'eu' and 'us' disagree on outer_lr: 1.0 in 'eu', 0.5 in 'us'; every region of "
        "a run must share it (sbatch-gen validate compares the sites' cross_region)"
    )
    assert str(errors["us"]).startswith(
        "round r000002: regions 'us' and 'eu' disagree on outer_lr: 0.5 in 'us', 1.0 in 'eu'; "
    )
    assert all(isinstance(e, XRSettingsError) for e in errors.values())
    assert took < 40


def test_a_claim_without_settings_or_with_a_setting_unknown_here_is_not_refused(tmp_path):
    """An older writer states no settings, a newer one may state more: neither is refused for it."""
    from sbatch_gen.train.xr.membership import Membership
    from sbatch_gen.train.xr.protocol import Mailbox
    from sbatch_gen.train.xr.store import FsStore

    xr = CrossRegion(enabled=True, region="eu", regions=REGIONS, transport=FsTransport(root=str(tmp_path)))
    mb = Mailbox(FsStore(str(tmp_path)), "t", "eu", REGIONS)
    try:
        ms = Membership(mb, 2, 1.0, settings=xr.round_settings())
        m = Manifest("t", "us", "r000001", "delta", 4, "bf16", 1, "x", "raw", 1, [])
        ms.check_settings(m, "r000001", "us")  # no settings at all
        m.extra = {"settings": {**xr.round_settings(), "something_new": 3}}
        ms.check_settings(m, "r000001", "us")
        m.extra = {"settings": {**xr.round_settings(), "outer_lr": 0.5}}
        with pytest.raises(XRSettingsError, match=r"disagree on outer_lr: 1.0 in 'eu', 0.5 in 'us'"):
            ms.check_settings(m, "r000001", "us")
    finally:
        mb.close()
