"""The S3 mailbox behind a fault proxy (sbatch_gen/testing/faultproxy.py, 127.0.0.1 only) in front of the
real test server: 503 SlowDown bursts, connections reset mid-body, truncated responses, slow streams.
Retries happen, are bounded, and are counted in the round records (``xr_retries``)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from sbatch_gen.testing.faultproxy import FaultProxy, cycle_plan
from sbatch_gen.train.xr.errors import StoreError, XRChecksumError
from sbatch_gen.train.xr.protocol import Mailbox, Manifest, ObjectInfo, ShardInfo
from sbatch_gen.train.xr.reading import read_objects
from sbatch_gen.train.xr.store import FsStore, S3Store
from sbatch_gen.xr_options import FsTransport, S3Credentials, S3Transport

from .conftest import KEY_ENV, SECRET_ENV
from .test_sync import flat, in_threads, train

pytestmark = pytest.mark.slow  # a real S3 server behind the fault proxy


def _store(proxy: FaultProxy, bucket: str, **kw) -> S3Store:
    return S3Store(
        bucket,
        "p",
        endpoint_url=proxy.url,
        addressing_style="path",
        region_name="us-east-1",
        access_key_id_env=KEY_ENV,
        secret_access_key_env=SECRET_ENV,
        threads=4,
        **kw,
    )


def _first_get_of_each_key(fault: str, suffix: str = "", otherwise=None):
    """``fault`` on the first GET of every object (whose key ends in ``suffix``), then healthy, or
    what the plan ``otherwise`` says."""
    seen: set[str] = set()
    lock = threading.Lock()

    def plan(method, path, n):
        if method != "GET" or "?" in path or not path.endswith(suffix):
            return otherwise(method, path, n) if otherwise else None
        with lock:
            if path in seen:
                return None
            seen.add(path)
        return fault

    return plan


@pytest.mark.parametrize("fault", ["truncate", "reset"])
def test_a_body_that_breaks_off_is_read_again_and_counted(s3server, bucket, fault):
    payload = bytes(range(256)) * 64
    with FaultProxy(s3server.endpoint_url, plan=_first_get_of_each_key(fault)) as proxy:
        s = _store(proxy, bucket)
        s.put("a/x.bin", payload)
        s.put("a/y.json", b'{"k": 1}' * 10)
        out = bytearray(len(payload))
        s.get_into("a/x.bin", memoryview(out))
        assert bytes(out) == payload
        assert s.get("a/y.json") == b'{"k": 1}' * 10
        assert proxy.injected[fault] == 2
        assert s.retries >= 2
        s.close()


def test_a_body_that_always_breaks_off_fails_after_bounded_attempts(s3server, bucket):
    with FaultProxy(
        s3server.endpoint_url, plan=lambda m, p, n: "truncate" if m == "GET" and "?" not in p else None
    ) as proxy:
        s = _store(proxy, bucket, retries=3)
        s.put("a/x.bin", b"x" * 4096)
        with pytest.raises(StoreError, match=r"after 3 attempts"):
            s.get_into("a/x.bin", memoryview(bytearray(4096)))
        assert proxy.injected["truncate"] == 3
        s.close()


def test_slowdown_bursts_are_retried_and_counted(s3server, bucket):
    # requests: 0-2 put k/0 (a burst of two 503s), 3-4 puts, 5-7 gets, 8-9 create (one 503), 10 create
    with FaultProxy(
        s3server.endpoint_url, plan=lambda m, p, n: "503" if n in (0, 1, 5, 8) else None
    ) as proxy:
        s = _store(proxy, bucket)
        for i in range(3):
            s.put(f"k/{i}", b"v%d" % i)
        assert [s.get(f"k/{i}") for i in range(3)] == [b"v0", b"v1", b"v2"]
        assert s.create("k/c", b"c") is True and s.create("k/c", b"d") is False
        assert proxy.injected["503"] == 4
        assert s.retries == 4
        s.close()


def _fault_free_and_through_proxy(s3server, bucket, tmp_path, rounds: int, plan):
    """The two-region run of ``rounds`` over the fs store (the reference), then over the S3 server behind a
    fault proxy with ``plan``: (reference, faulty run, the faults the proxy injected)."""
    ref = in_threads(
        lambda r: train(r, tmp_path / "fs", rounds, transport=FsTransport(root=str(tmp_path / "fs")))
    )
    with FaultProxy(s3server.endpoint_url, plan=plan) as proxy:
        transport = S3Transport(
            bucket=bucket,
            prefix="team/xr",
            endpoint_url=proxy.url,
            addressing_style="path",
            region_name="us-east-1",
            credentials=S3Credentials(access_key_id_env=KEY_ENV, secret_access_key_env=SECRET_ENV),
        )
        got = in_threads(lambda r: train(r, tmp_path / "s3", rounds, transport=transport))
        injected = dict(proxy.injected)
    for r in ("eu", "us"):
        got[r]["sync"].close()
        ref[r]["sync"].close()
    return ref, got, injected


def test_two_regions_through_a_faulty_proxy_end_identical_and_count_retries(s3server, bucket, tmp_path):
    rounds = 3
    ref, got, injected = _fault_free_and_through_proxy(
        s3server, bucket, tmp_path, rounds, cycle_plan(every=3, burst=2)
    )
    assert all(injected.get(k, 0) > 0 for k in ("503", "reset", "truncate", "slow")), injected
    # identical parameters: across the regions, and bit for bit those of the fault-free run
    assert torch.equal(flat(got["eu"]["model"]), flat(got["us"]["model"]))
    assert torch.equal(flat(got["eu"]["model"]), flat(ref["eu"]["model"]))
    retries = [rd["timings"]["xr_retries"] for r in ("eu", "us") for rd in got[r]["rounds"]]
    assert len(retries) == 2 * rounds and sum(retries) > 0, retries
    assert all(rd["timings"]["xr_retries"] == 0 for r in ("eu", "us") for rd in ref[r]["rounds"])


def _shards(mb: Mailbox, tag: str, payloads: list[bytes]) -> list[ShardInfo]:
    """Upload ``payloads`` as shards 0.. of this region; their manifest entries."""
    up = mb.upload_shards(tag, dict(enumerate(payloads)))
    return [ShardInfo(i, 0, n, n, d) for i, (n, d) in sorted(up.items())]


def test_a_shard_corrupted_in_transit_is_read_again_and_counted(s3server, bucket):
    """A GET that arrives whole, with the right length, but with changed bytes: the checksum catches it
    and the mailbox reads the shard again; each re-read is a retry of the store (the round records)."""
    payloads = [bytes(range(256)) * 40, b"\x5a" * 9000, bytes(reversed(range(256))) * 17]
    with FaultProxy(s3server.endpoint_url, plan=_first_get_of_each_key("corrupt", ".bin")) as proxy:
        mb = Mailbox(_store(proxy, bucket), "run1", "eu", ["eu", "us"], threads=3)
        infos = _shards(mb, "r000001", payloads)
        got = mb.download("r000001", [("eu", i) for i in infos])
        assert {k: bytes(v) for k, v in got.items()} == {("eu", i): p for i, p in enumerate(payloads)}
        assert proxy.injected["corrupt"] == 3
        assert mb.store.retries == 3
        mb.close()
        mb.store.close()


def test_a_shard_corrupted_on_every_read_fails_after_bounded_reads(s3server, bucket):
    with FaultProxy(
        s3server.endpoint_url, plan=lambda m, p, n: "corrupt" if m == "GET" and p.endswith(".bin") else None
    ) as proxy:
        mb = Mailbox(_store(proxy, bucket), "run1", "eu", ["eu", "us"], threads=2, read_attempts=4)
        (info,) = _shards(mb, "r000002", [b"payload" * 1000])
        with pytest.raises(
            XRChecksumError,
            match=r"shard 0 of region 'eu' is corrupted: xxh3_128 differs from "
            r"its manifest in 4 reads \(s3://.*/r000002/eu/s00000\.bin\)",
        ):
            mb.download("r000002", [("eu", info)])
        assert proxy.injected["corrupt"] == 4
        assert mb.store.retries == 3
        mb.close()
        mb.store.close()


@pytest.mark.parametrize("fault", ["truncate", "reset", "503", "corrupt"])
def test_a_ranged_read_that_fails_on_the_way_is_read_again(s3server, bucket, fault):
    """An FSDP rank reads part of a packed object: the first Range GET of each run of chunks is cut off,
    reset, refused or damaged in transit. The store (a body that broke off, a 503) or the chunk checksums
    (damaged bytes) read it again, each re-read counted, and exactly the chunks that hold the bytes asked
    for come back whole."""
    payload = os.urandom(4096)
    with FaultProxy(s3server.endpoint_url, plan=_first_get_of_each_key(fault, ".bin")) as proxy:
        mb = Mailbox(_store(proxy, bucket), "run1", "eu", ["eu", "us"], threads=2, chunk_bytes=512)
        m = _packed_manifest(mb, "r000004", payload)
        # elements 300..500 of shard 1 (fp32, from byte 2048 of the object): bytes 3248..4048, chunks 6-7
        got = read_objects(mb, "r000004", [("eu", m, 0, [(2048 + 4 * 300, 2048 + 4 * 500)])])[("eu", 0)]
        assert got.nbytes == 1024 and bytes(got.view(3072, 4096)) == payload[3072:]
        assert proxy.injected[fault] == 1 and mb.store.retries >= 1
        mb.close()
        mb.store.close()


def test_a_chunk_corrupted_on_every_ranged_read_fails_after_bounded_reads(s3server, bucket):
    with FaultProxy(
        s3server.endpoint_url, plan=lambda m, p, n: "corrupt" if m == "GET" and p.endswith(".bin") else None
    ) as proxy:
        mb = Mailbox(
            _store(proxy, bucket), "run1", "eu", ["eu", "us"], threads=2, read_attempts=3, chunk_bytes=512
        )
        m = _packed_manifest(mb, "r000005", os.urandom(4096))
        with pytest.raises(
            XRChecksumError,
            match=r"^round r000005: object 0 \(bytes 512\.\.1023\) of region 'eu' is corrupted: xxh3_128 "
            r"differs from its manifest in 3 reads \(s3://.*/r000005/eu/s00000\.bin\)$",
        ):
            read_objects(mb, "r000005", [("eu", m, 0, [(600, 700)])])
        assert proxy.injected["corrupt"] == 3 and mb.store.retries == 2
        mb.close()
        mb.store.close()


def _packed_manifest(mb: Mailbox, tag: str, payload: bytes) -> Manifest:
    """``payload`` (fp32) uploaded as ONE object holding two shards of 512 elements each, and its manifest."""
    (st,) = mb.upload_objects(tag, [(0, payload, [(0, 2048), (2048, 4096)])]).values()
    shards = [ShardInfo(i, 512 * i, 512, 2048, st.digests[i], 0, 2048 * i) for i in range(2)]
    objects = [ObjectInfo(0, 4096, st.chunks)]
    return Manifest(
        "run1", "eu", tag, "delta", 1, "fp32", 1024, "L", "raw", 1, shards, objects=objects, chunk=512
    )


class _TornFirstView(FsStore):
    """A directory whose first zero-copy read of each object sees damaged bytes (a torn read of a
    shared filesystem): the file itself is intact."""

    def __init__(self, root):
        super().__init__(root)
        self.seen: set[str] = set()

    def get_view(self, key, nbytes):
        view = super().get_view(key, nbytes)
        if key in self.seen:
            return view
        self.seen.add(key)
        bad = bytearray(view)
        bad[0] ^= 0xFF
        return memoryview(bad)


def test_a_torn_read_of_an_fs_shard_is_read_again_and_counted(tmp_path):
    store = _TornFirstView(tmp_path / "mailbox")
    mb = Mailbox(store, "run1", "eu", ["eu", "us"], threads=2)
    payloads = [b"a" * 5000, b"b" * 7000]
    infos = _shards(mb, "r000003", payloads)
    got = mb.download("r000003", [("eu", i) for i in infos])
    assert [bytes(got[("eu", i)]) for i in range(2)] == payloads
    assert store.retries == 2 and FsStore.retries == 0  # counted on this store only
    mb.close()


def test_two_regions_end_identical_through_shards_corrupted_in_transit(s3server, bucket, tmp_path):
    """The first read of every shard object of every round is corrupted in transit (and the other
    requests see the usual faults): the regions end bit for bit where the fault-free run ends, and every
    round's record counts the re-reads."""
    rounds = 2
    plan = _first_get_of_each_key("corrupt", ".bin", otherwise=cycle_plan(every=5, burst=1))
    ref, got, injected = _fault_free_and_through_proxy(s3server, bucket, tmp_path, rounds, plan)
    assert injected.get("corrupt", 0) >= 2 * rounds, injected
    assert torch.equal(flat(got["eu"]["model"]), flat(got["us"]["model"]))
    assert torch.equal(flat(got["eu"]["model"]), flat(ref["eu"]["model"]))
    retries = [rd["timings"]["xr_retries"] for r in ("eu", "us") for rd in got[r]["rounds"]]
    assert len(retries) == 2 * rounds and all(n >= 1 for n in retries), retries
