"""The mailbox protocol on both backends: rounds, manifests, checksums, timeouts, layouts, cleanup."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from bench import scripted
from sbatch_gen.train.xr.errors import XRChecksumError, XRLayoutError, XRMissingRound, XRTimeout
from sbatch_gen.train.xr.protocol import (
    QBLOCK,
    Expect,
    Mailbox,
    Manifest,
    ObjectInfo,
    ShardInfo,
    ShardPlan,
    digest,
    parse_tag,
    round_tag,
)
from sbatch_gen.train.xr.reading import read_objects, shard_bytes
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


def test_a_sharded_plan_packs_each_ranks_shards_into_few_objects():
    """Each owner's shards, in order, go into objects of at most shard_mb (one per owner when they fit),
    numbered owner after owner; a plain plan stores each shard in its own object."""
    held = [(0, 6, 0), (6, 10, 1), (10, 13, 0), (13, 14, 1)]  # two parameters, rows split over 2 ranks
    plan = ShardPlan.pieces(14, held, 4, 16 / (1 << 20))  # 4 elements a shard and an object
    assert plan.bounds == ((0, 4), (4, 6), (6, 10), (10, 13), (13, 14))
    assert plan.objects == (0, 1, 3, 2, 4)  # owner 0: [0,4) | [4,6) [10,13) is 5 > 4: apart
    assert plan.owned_objects(0, 2) == [(0, [0]), (1, [1]), (2, [3])]
    assert plan.owned_objects(1, 2) == [(3, [2]), (4, [4])]
    one = ShardPlan.pieces(14, held, 4, 0)  # shard_mb 0: one object per owner
    assert one.bounds == ((0, 6), (6, 10), (10, 13), (13, 14)) and one.objects == (0, 1, 0, 1)
    assert one.owned_objects(1, 2) == [(1, [1, 3])]
    flat = ShardPlan.make(10, 4, 16 / (1 << 20))
    assert flat.objects is None and [flat.object_of(s) for s in range(3)] == [0, 1, 2]


def _packed(mb: Mailbox, tag: str, payload: bytes, chunk: int) -> Manifest:
    """``payload`` (fp32, 1000 elements) as ONE object holding shards [0, 600) and [600, 1000) (a rank's
    rows of two parameters), with its chunk checksums, and the manifest listing them."""
    mb.chunk_bytes = chunk
    (st,) = mb.upload_objects(tag, [(0, payload, [(0, 2400), (2400, 4000)])]).values()
    shards = [
        ShardInfo(0, 0, 600, 2400, st.digests[0], 0, 0),
        ShardInfo(1, 600, 400, 1600, st.digests[1], 0, 2400),
    ]
    m = Manifest("run1", mb.region, tag, "delta", 1, "fp32", 1000, "L1", "raw", 1, shards)
    m.objects, m.chunk = [ObjectInfo(0, 4000, st.chunks)], chunk
    return m


def test_part_of_an_object_is_read_in_whole_checked_chunks(transport):
    """A reader that needs elements 550..650 (bytes 2200..2600) of a 4000-byte object with 512-byte chunks
    reads chunks 4 and 5 with one ranged read and checks both; every chunk wanted: the object is read
    whole. A chunk damaged in the store is read again (counted), then refused naming the object and its
    bytes; the chunks around it still read."""
    mb = boxes(transport)
    payload = os.urandom(4000)
    m = _packed(mb["us"], "r000001", payload, 512)
    assert len(m.objects[0].chunks) == 8 and m.objects[0].chunks[0] == digest(payload[:512])
    Expect("delta", "fp32", 1000, "L1", "raw", ShardPlan.make(1000, 4, 0)).check(
        m, "run1", "r000001", "us", "x"
    )
    got = read_objects(mb["eu"], "r000001", [("us", m, 0, shard_bytes(m, m.shards[0], 550, 600)[2])])
    part = got[("us", 0)]
    assert part.nbytes == 512 and bytes(part.view(2200, 2400)) == payload[2200:2400]
    got = read_objects(mb["eu"], "r000001", [("us", m, 0, [(2200, 2400), (2400, 2600)])])
    assert (
        got[("us", 0)].nbytes == 1024
        and bytes(got[("us", 0)].span_bytes([(2200, 2400), (2400, 2600)])) == (payload[2200:2600])
    )
    with pytest.raises(XRLayoutError, match=r"shard 1 of region 'us' is packed in object 0: read it with"):
        mb["eu"].download("r000001", [("us", m.shards[1])])  # whole-shard reads are for unpacked shards
    whole = read_objects(mb["eu"], "r000001", [("us", m, 0, [(0, 10), (3990, 4000), (10, 3990)])])
    assert whole[("us", 0)].nbytes == 4000 and bytes(whole[("us", 0)].view(0, 4000)) == payload
    bad = bytearray(payload)
    bad[2700] ^= 0xFF  # chunk 5
    mb["us"].store.put(mb["us"].shard_key("r000001", "us", 0), bad)
    retries = mb["eu"].store.retries
    with pytest.raises(
        XRChecksumError,
        match=r"^round r000001: object 0 \(bytes 2048\.\.3071\) of region 'us' is corrupted: ",
    ):
        read_objects(mb["eu"], "r000001", [("us", m, 0, [(2200, 2600)])])
    assert mb["eu"].store.retries - retries >= 2  # 3 reads (S3 may add botocore's own retries)
    assert (
        bytes(read_objects(mb["eu"], "r000001", [("us", m, 0, [(0, 2048)])])[("us", 0)].view(0, 2048))
        == (payload[:2048])
    )


def test_the_bytes_of_part_of_a_scaled_shard_decode_to_the_whole_shards_values():
    """A reader of elements a:b of an int8/fp8/int4 shard reads the scales of their blocks and the
    blocks' values; decoded alone they are exactly the whole shard's decoded values there."""
    import torch

    from sbatch_gen.train.xr import scaled
    from sbatch_gen.train.xr.reading import ObjectBytes

    n = 1000  # 4 blocks, the last one short (and odd: int4's half byte)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 5, n)
    for wire in ("int8", "fp8", "int4"):
        raw = bytearray(scaled.encode(x, wire))
        pad = b"\0" * 7  # the shard at byte 7 of its object
        info = ShardInfo(0, 5000, n, len(raw), "", 0, len(pad))
        m = Manifest("r", "us", "t", "delta", 1, wire, 6000, "L", "raw", 1, [info])
        whole = scaled.decode(raw, n, wire, "cpu")
        obj = ObjectBytes([(0, bytearray(pad + raw))])
        for a, b in ((5000, 6000), (5300, 5400), (5255, 5257), (5999, 6000), (5768, 5990)):
            a2, b2, spans = shard_bytes(m, info, a, b)
            assert (a2 - 5000) % QBLOCK == 0 and a2 <= a < b <= b2
            got = scaled.decode(obj.span_bytes(spans), b2 - a2, wire, "cpu")
            assert torch.equal(got[a - a2 : b - a2], whole[a - 5000 : b - 5000]), (wire, a, b)


def _hostile(shards, objects, chunk=4):
    """A manifest of region us for round r000007 of a 2-parameter model ``w`` (elements 0..6), ``b`` (6..8)."""
    s = [ShardInfo(i, a, n, 4 * n, "", o, off) for i, (a, n, o, off) in enumerate(shards)]
    o = [ObjectInfo(k, nb, [""] * -(-nb // chunk)) for k, nb in enumerate(objects)]
    return Manifest("run1", "us", "r000007", "delta", 1, "fp32", 8, "L1", "raw", 1, s, objects=o, chunk=chunk)


@pytest.mark.parametrize(
    "shards, objects, why",
    [
        (
            [(0, 6, 0, 0), (6, 2, 1, 0)],
            [24],
            r"shard 1 \(parameter b\) is in object 1; the manifest lists objects 0\.\.0",
        ),
        (
            [(0, 6, 0, 0), (6, 2, 0, 28)],
            [32],
            r"shard 1 \(parameter b\) lies at bytes 28\.\.36 of object 0, which holds 32",
        ),
        (
            [(0, 6, 0, 0), (6, 2, 0, 16)],
            [32],
            r"shard 1 \(parameter b\) in object 0 overlaps the shard before it",
        ),
        (
            [(0, 6, 0, 0), (6, 2, 0, 26)],
            [34],
            r"shard 1 \(parameter b\) starts at byte 26 of object 0, not a multiple of 4",
        ),
        (
            [(0, 6, 0, 0), (6, 2, 0, 28)],
            [36],
            r"shard 1 \(parameter b\) in object 0 leaves bytes 24\.\.28 unused",
        ),
        ([(0, 6, 0, 0), (6, 2, 0, 24)], [40], r"object 0 holds 40 bytes, its shards fill 32"),
        (
            [(0, 6, 0, 0), (7, 1, 0, 24)],
            [28],
            r"shard 1 \(parameter b\) covers \[7, 8\), expected shard 1 from element 6",
        ),
        ([(0, 6, 0, 0)], [24], r"the shards cover \[0, 6\), expected \[0, 8\) \(parameter b\)"),
        ([(0, 6, None, 0), (6, 2, 0, 0)], [8], r"shard 0 \(parameter w\) is in object None"),
    ],
    ids=[
        "object-out-of-range",
        "bytes-out-of-range",
        "overlap",
        "misaligned",
        "unused-bytes",
        "object-not-filled",
        "gap",
        "short",
        "no-object",
    ],
)
def test_a_hostile_manifest_is_refused_in_one_line_naming_region_round_and_parameter(shards, objects, why):
    expect = Expect("delta", "fp32", 8, "L1", "raw", ShardPlan.make(8, 4, 0), ((0, "w"), (6, "b")))
    with pytest.raises(XRLayoutError) as e:
        expect.check(_hostile(shards, objects), "run1", "r000007", "us", "fs:/mb/run1/r000007/us.done")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("round r000007: region 'us' published a mismatched payload at ")
    assert re.search(why, msg), msg


def test_chunk_checksums_must_match_the_objects_and_the_chunk_size():
    expect = Expect("delta", "fp32", 8, "L1", "raw", ShardPlan.make(8, 4, 0), ((0, "w"), (6, "b")))
    m = _hostile([(0, 6, 0, 0), (6, 2, 0, 24)], [32])
    m.objects[0].chunks.pop()
    with pytest.raises(XRLayoutError, match=r"object 0 of 32 bytes with 7 chunk checksums is entry 0"):
        expect.check(m, "run1", "r000007", "us", "x")
    m = _hostile([(0, 6, 0, 0), (6, 2, 0, 24)], [32])
    m.chunk = 0
    with pytest.raises(XRLayoutError, match=r"chunk is 0 bytes"):
        expect.check(m, "run1", "r000007", "us", "x")


def test_format_3_manifests_are_still_read_whole(transport):
    """A manifest of the previous format (each shard its own object, no chunk checksums) reads as before:
    whole objects, checked by the shards' checksums."""
    mb = boxes(transport)
    payload = os.urandom(4 * 3000)
    publish(mb["us"], "r000001", payload)
    key = mb["us"].manifest_key("r000001", "us")
    d = json.loads(mb["us"].store.get(key))
    d["format"] = 3
    for s in d["shards"]:
        del s["obj"], s["offset"]
    del d["objects"], d["chunk"]
    mb["us"].store.put(key, json.dumps(d).encode())
    m = mb["eu"].read_manifest("r000001", "us")
    assert m is not None and m.format == 3 and not m.objects
    got = read_objects(mb["eu"], "r000001", [("us", m, 1, [(8, 16)])])  # a ranged want: read whole
    assert got[("us", 1)].nbytes == m.shards[1].nbytes
    res = xchg(mb["eu"], "r000001", os.urandom(4 * 3000))
    assert res["us"][1] == payload


def test_a_manifest_whose_index_is_not_numbers_is_unreadable():
    m = _hostile([(0, 6, 0, 0), (6, 2, 0, 24)], [32])
    good = json.loads(m.to_json())
    assert Manifest.from_json(m.to_json(), "x") == m
    for path, value in (
        (("shards", 1, "obj"), "0"),
        (("shards", 0, "offset"), 1.5),
        (("objects", 0, "chunks"), 7),
    ):
        d = json.loads(json.dumps(good))
        d[path[0]][path[1]][path[2]] = value
        with pytest.raises(
            XRLayoutError,
            match=r"^unreadable manifest fs:/mb/us\.done: (its index|an object's chunks are not a list)",
        ):
            Manifest.from_json(json.dumps(d).encode(), "fs:/mb/us.done")
