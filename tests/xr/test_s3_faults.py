"""The S3 mailbox behind a fault proxy (sbatch_gen/testing/faultproxy.py, 127.0.0.1 only) in front of the
real test server: 503 SlowDown bursts, connections reset mid-body, truncated responses, slow streams.
Retries happen, are bounded, and are counted in the round records (``xr_retries``)."""

from __future__ import annotations

import threading

import pytest
import torch

from sbatch_gen.testing.faultproxy import FaultProxy, cycle_plan
from sbatch_gen.train.xr.errors import StoreError
from sbatch_gen.train.xr.store import S3Store
from sbatch_gen.xr_options import FsTransport, S3Credentials, S3Transport

from .conftest import KEY_ENV, SECRET_ENV
from .test_sync import flat, in_threads, train


def _store(proxy: FaultProxy, bucket: str, **kw) -> S3Store:
    return S3Store(bucket, "p", endpoint_url=proxy.url, addressing_style="path", region_name="us-east-1",
                   access_key_id_env=KEY_ENV, secret_access_key_env=SECRET_ENV, threads=4, **kw)


def _first_get_of_each_key(fault: str):
    """``fault`` on the first GET of every object, then healthy."""
    seen: set[str] = set()
    lock = threading.Lock()

    def plan(method, path, n):
        if method != "GET" or "?" in path:
            return None
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
    with FaultProxy(s3server.endpoint_url,
                    plan=lambda m, p, n: "truncate" if m == "GET" and "?" not in p else None) as proxy:
        s = _store(proxy, bucket, retries=3)
        s.put("a/x.bin", b"x" * 4096)
        with pytest.raises(StoreError, match=r"after 3 attempts"):
            s.get_into("a/x.bin", memoryview(bytearray(4096)))
        assert proxy.injected["truncate"] == 3
        s.close()


def test_slowdown_bursts_are_retried_and_counted(s3server, bucket):
    # requests: 0-2 put k/0 (a burst of two 503s), 3-4 puts, 5-7 gets, 8-9 create (one 503), 10 create
    with FaultProxy(s3server.endpoint_url, plan=lambda m, p, n: "503" if n in (0, 1, 5, 8) else None) as proxy:
        s = _store(proxy, bucket)
        for i in range(3):
            s.put(f"k/{i}", b"v%d" % i)
        assert [s.get(f"k/{i}") for i in range(3)] == [b"v0", b"v1", b"v2"]
        assert s.create("k/c", b"c") is True and s.create("k/c", b"d") is False
        assert proxy.injected["503"] == 4
        assert s.retries == 4
        s.close()


def test_two_regions_through_a_faulty_proxy_end_identical_and_count_retries(s3server, bucket, tmp_path):
    rounds = 3
    ref = in_threads(lambda r: train(r, tmp_path / "fs", rounds,
                                     transport=FsTransport(root=str(tmp_path / "fs"))))
    with FaultProxy(s3server.endpoint_url, plan=cycle_plan(every=3, burst=2)) as proxy:
        transport = S3Transport(
            bucket=bucket, prefix="team/xr", endpoint_url=proxy.url, addressing_style="path",
            region_name="us-east-1",
            credentials=S3Credentials(access_key_id_env=KEY_ENV, secret_access_key_env=SECRET_ENV))
        got = in_threads(lambda r: train(r, tmp_path / "s3", rounds, transport=transport))
        injected = dict(proxy.injected)
    for r in ("eu", "us"):
        got[r]["sync"].close()
        ref[r]["sync"].close()
    assert all(injected.get(k, 0) > 0 for k in ("503", "reset", "truncate", "slow")), injected
    # identical parameters: across the regions, and bit for bit those of the fault-free run
    assert torch.equal(flat(got["eu"]["model"]), flat(got["us"]["model"]))
    assert torch.equal(flat(got["eu"]["model"]), flat(ref["eu"]["model"]))
    retries = [rd["timings"]["xr_retries"] for r in ("eu", "us") for rd in got[r]["rounds"]]
    assert len(retries) == 2 * rounds and sum(retries) > 0, retries
    assert all(rd["timings"]["xr_retries"] == 0 for r in ("eu", "us") for rd in ref[r]["rounds"])
