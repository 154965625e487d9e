"""The mailbox protocol on both backends: rounds, manifests, checksums, timeouts, layouts, cleanup."""

from __future__ import annotations

import json
import os
import time

import pytest

from bench import scripted
from sbatch_gen.train.xr.errors import XRChecksumError, XRLayoutError, XRMissingRound, XRTimeout
from sbatch_gen.train.xr.protocol import Mailbox, Manifest, ShardPlan, parse_tag, round_tag
from sbatch_gen.train.xr.store import make_store

from .concurrent import in_threads

pytestmark = pytest.mark.slow  # a real S3 server

REGIONS = ["eu", "us"]


def boxes(transport, run_id="run1", timeout_s=20.0, keep_rounds=4, regions=REGIONS):
    return {
        r: Mailbox(
            make_store(transport, threads=4),
            run_id,
            r,
            regions,
            timeout_s=timeout_s,
            keep_rounds=keep_rounds,
            threads=4,
            poll_min_s=0.01,
            poll_max_s=0.05,
        )
        for r in regions
    }


def both(fn):
    """Run fn(region) for every region concurrently; re-raise the first error."""
    return in_threads(fn, REGIONS, join_s=60)


def _args(kw):
    args = dict(kind="delta", dtype="fp32", layout="L1", step=1, tokens=100, shard_mb=0.01)
    args.update(kw)
    return args


def xchg(box, tag, payload, **kw):
    return scripted.exchange(box, tag, payload, **_args(kw))


def publish(box, tag, payload, **kw):
    return scripted.publish(box, tag, payload, **_args(kw))


def test_tags_and_plan():
    assert round_tag(42) == "r000042" and parse_tag("r000042") == 42 and parse_tag("init") is None
    assert round_tag(1234567) == "r1234567" and parse_tag("r1234567") == 1234567
    plan = ShardPlan.make(10_000, 2, 0.005)  # 5242 bytes -> 2621 bf16 elements per shard
    assert len(plan) == 4 and plan.bounds[0] == (0, 2621) and plan.bounds[-1][1] == 10_000
    assert all(a[1] == b[0] for a, b in zip(plan.bounds, plan.bounds[1:], strict=False))
    assert plan.owned(0, 2) == [0, 2] and plan.owned(1, 2) == [1, 3]
    assert ShardPlan.make(10_000, 2, 0).bounds == ((0, 10_000),)


def test_exchange_two_regions(transport):
    mb = boxes(transport)
    payloads = {r: os.urandom(4 * 7000) for r in REGIONS}  # 7000 fp32 elements, 3 shards of <= 10 KiB
    res = both(lambda r: xchg(mb[r], "r000001", payloads[r], tokens=100 if r == "eu" else 300))
    for r in REGIONS:
        assert {k: v[1] for k, v in res[r].items()} == payloads
        assert res[r]["us"][0].tokens == 300 and len(res[r]["eu"][0].shards) == 3
    m = Manifest.from_json(mb["eu"].store.get("run1/r000001/eu.done"), "x")
    assert (m.run_id, m.region, m.tag, m.kind, m.dtype, m.numel) == (
        "run1",
        "eu",
        "r000001",
        "delta",
        "fp32",
        7000,
    )
    assert sum(s.nbytes for s in m.shards) == 4 * 7000


def test_corrupted_shard_is_a_checksum_error(transport):
    mb = boxes(transport, timeout_s=5)
    payload = os.urandom(4 * 3000)
    publish(mb["us"], "r000001", payload)  # us publishes first
    key = mb["us"].shard_key("r000001", "us", 0)
    bad = bytearray(mb["us"].store.get(key))
    bad[17] ^= 0xFF  # same size, one flipped byte
    mb["us"].store.put(key, bad)
    with pytest.raises(XRChecksumError, match=r"shard 0 of region 'us' is corrupted"):
        xchg(mb["eu"], "r000001", payload)


def test_missing_region_times_out_naming_it(transport):
    mb = boxes(transport, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(XRTimeout) as ei:
        xchg(mb["eu"], "r000003", os.urandom(400), step=30)
    assert time.monotonic() - t0 < 10
    msg = str(ei.value)
    assert (
        "'us'" in msg and "r000003" in msg and "step 30" in msg and "us.done" in msg and "arrived: eu" in msg
    )


def test_peer_under_another_run_id_is_named(transport):
    eu = boxes(transport, run_id="run-a", timeout_s=0.5)["eu"]
    us = boxes(transport, run_id="run-b", timeout_s=0.5)["us"]
    us.upload_shards("r000001", {})
    us.publish_manifest(Manifest("run-b", "us", "r000001", "delta", 1, "fp32", 100, "L1", "raw", 1, []))
    with pytest.raises(XRTimeout, match=r"under run id\(s\) 'run-b': the regions disagree on the run id"):
        xchg(eu, "r000001", os.urandom(400))


def test_mismatched_layout_and_run_id_are_clear_errors(transport):
    mb = boxes(transport, timeout_s=5)
    publish(mb["us"], "r000001", os.urandom(400), layout="OTHER")
    with pytest.raises(
        XRLayoutError, match=r"region 'us' published a mismatched payload.*layout is 'OTHER', expected 'L1'"
    ):
        xchg(mb["eu"], "r000001", os.urandom(400))
    # a manifest claiming another run id under this run's key
    key = mb["us"].manifest_key("r000002", "us")
    d = json.loads(mb["us"].store.get(mb["us"].manifest_key("r000001", "us")))
    d.update(tag="r000002", run_id="someone-else", layout="L1")
    mb["us"].store.put(key, json.dumps(d).encode())
    with pytest.raises(XRLayoutError, match=r"run_id is 'someone-else', expected 'run1'"):
        xchg(mb["eu"], "r000002", os.urandom(400))
    # other element count / dtype
    publish(mb["us"], "r000003", os.urandom(800))
    with pytest.raises(XRLayoutError, match=r"numel is 200, expected 100"):
        xchg(mb["eu"], "r000003", os.urandom(400))
    # a peer on another protocol version: older format, or shards checksummed another way
    d = json.loads(mb["us"].store.get(mb["us"].manifest_key("r000001", "us")))
    assert (
        d["format"] == 4 and d["checksum"] == "xxh3_128" and all(len(s["digest"]) == 32 for s in d["shards"])
    )
    d.update(tag="r000004", layout="L1", format=2)  # format 2: shards cut only by the shard_mb plan
    mb["us"].store.put(mb["us"].manifest_key("r000004", "us"), json.dumps(d).encode())
    with pytest.raises(
        XRLayoutError,
        match=r"unreadable manifest .*us\.done: format 2, this version reads formats 3 and 4: every region "
        "of a run must run the same sbatch-gen version",
    ):
        xchg(mb["eu"], "r000004", os.urandom(400))
    d.update(tag="r000005", format=4, checksum="sha256")
    mb["us"].store.put(mb["us"].manifest_key("r000005", "us"), json.dumps(d).encode())
    with pytest.raises(XRLayoutError, match=r"checksum is 'sha256', expected 'xxh3_128'"):
        xchg(mb["eu"], "r000005", os.urandom(400))


def test_republish_same_round_is_idempotent(transport):
    mb = boxes(transport)
    first, again = os.urandom(4000), os.urandom(4000)
    publish(mb["eu"], "r000005", first)
    res_us = xchg(mb["us"], "r000005", os.urandom(4000))
    # eu's job was requeued and re-enters round 5 with a different (re-computed) payload:
    res_eu = xchg(mb["eu"], "r000005", again)
    assert res_eu["eu"][1] == first == res_us["eu"][1]  # the published payload stands
    assert res_eu["us"][1] == res_us["us"][1]


def test_waiting_for_a_deleted_round_fails_fast(transport):
    mb = boxes(transport, timeout_s=30, keep_rounds=2)
    us = mb["us"]
    us.store.put(us.manifest_key("r000009", "us"), b"{}")  # us is far ahead; r000002 was deleted
    t0 = time.monotonic()
    with pytest.raises(
        XRMissingRound, match=r"region\(s\) 'us' already published round r000009 and deleted r000002"
    ):
        xchg(mb["eu"], "r000002", os.urandom(400))
    assert time.monotonic() - t0 < 10
