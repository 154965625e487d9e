"""The object stores behind the mailbox, against a real directory and a real S3 server on 127.0.0.1."""

from __future__ import annotations

import os

import pytest

from sbatch_gen.train.xr.errors import StoreError, XRChecksumError
from sbatch_gen.train.xr.store import FsStore, S3Store, make_store


@pytest.fixture
def store(transport):
    s = make_store(transport, threads=4)
    yield s
    s.close()


def test_put_get_list_delete(store):
    payload = os.urandom(100_000)
    store.put("run/r000001/eu/s00000.bin", payload)
    store.put("run/r000001/eu.done", memoryview(b'{"x": 1}'))
    store.put("run/r000002/eu.done", b"{}")
    assert store.get("run/r000001/eu/s00000.bin") == payload
    assert store.get("run/r000001/us.done") is None
    out = bytearray(len(payload))
    store.get_into("run/r000001/eu/s00000.bin", memoryview(out))
    assert bytes(out) == payload
    assert sorted(store.list("run/r000001/")) == ["run/r000001/eu.done", "run/r000001/eu/s00000.bin"]
    assert len(store.list("run/")) == 3
    # the objects directly under a prefix, one request (a round's claims, not its regions' shards)
    assert store.children("run/r000001/") == ["run/r000001/eu.done"]
    assert store.children("run/") == [] and store.children("nothing/") == []
    store.delete(["run/r000001/eu.done", "run/r000001/eu/s00000.bin", "run/r000001/never-existed"])
    assert store.list("run/r000001/") == []
    assert store.list("run/") == ["run/r000002/eu.done"]


def test_overwrite_is_whole_object(store):
    store.put("k/a", b"1" * 1000)
    store.put("k/a", b"2" * 10)
    assert store.get("k/a") == b"2" * 10


def test_modified_is_the_time_of_the_last_write_by_the_stores_clock(store, monkeypatch):
    """(S3: the server's Last-Modified, to the second; fs: the file's mtime.) Never this process's
    time.time(): here a day off, which the answer must not follow (the server runs on this host)."""
    import time

    assert store.modified("k/none") is None
    real = time.time()
    monkeypatch.setattr(time, "time", lambda: real + 86400.0)
    store.put("k/a", b"1")
    first = store.modified("k/a")
    assert first is not None and real - 2.0 <= first <= real + 60.0
    store.put("k/a", b"2")
    assert first <= store.modified("k/a") <= real + 60.0


def test_get_aged_is_an_objects_age_on_the_stores_clock(store, monkeypatch):
    """The age of an object from the store's clock alone (S3: Date less Last-Modified of one response, at
    the low end of their second's resolution; fs: a new file's mtime less the object's), whatever this
    host's time.time() says (here 5 h ahead)."""
    import time

    real = time.time()
    monkeypatch.setattr(time, "time", lambda: real + 5 * 3600.0)
    assert store.get_aged("k/none") is None
    store.put("k/a", b"abc")
    data, age = store.get_aged("k/a")
    assert data == b"abc" and age is not None and 0.0 <= age < 2.0
    if isinstance(store, FsStore):  # a heartbeat written an hour ago (this host is the file server)
        os.utime(store.root / "k/a", (real - 3600.0, real - 3600.0))
        assert 3600.0 - 1.0 <= store.get_aged("k/a")[1] <= 3600.0 + 60.0
        assert not [n for n in os.listdir(store.root) if n.startswith(".")]  # the clock probe is gone
    else:  # S3: wait until the server says the object is over a second old
        deadline = time.monotonic() + 20.0
        while (age := store.get_aged("k/a")[1]) < 1.0:
            assert time.monotonic() < deadline, age
            time.sleep(0.2)
        assert age < 10.0


def test_clone_has_its_own_client(store):
    """A clone reads and writes the same objects; on S3 through another client (and connection pool)."""
    other = store.clone()
    try:
        other.put("k/c", b"1")
        assert store.get("k/c") == b"1"
        if isinstance(store, S3Store):
            assert isinstance(other, S3Store) and other.client is not store.client
            assert other.client._endpoint.http_session is not store.client._endpoint.http_session
            assert other.describe("k/c") == store.describe("k/c")
        else:
            assert other is store
    finally:
        if other is not store:
            other.close()


def test_get_into_size_mismatch_and_missing(store):
    store.put("k/obj", b"abcdef")
    with pytest.raises(XRChecksumError, match="6 bytes, the manifest says 4"):
        store.get_into("k/obj", memoryview(bytearray(4)))
    with pytest.raises(StoreError, match="object missing"):
        store.get_into("k/none", memoryview(bytearray(4)))


def test_get_range_reads_bytes_of_an_object_of_the_size_expected(store):
    payload = os.urandom(5000)
    store.put("k/obj", payload)
    out = bytearray(700)
    store.get_range("k/obj", 1234, memoryview(out), 5000)  # fs: a seek and a read; S3: a Range GET
    assert bytes(out) == payload[1234:1934]
    store.get_range("k/obj", 4999, memoryview(out)[:1], 5000)  # the last byte
    assert out[0] == payload[-1]
    store.get_range("k/obj", 10, memoryview(bytearray()), 5000)  # nothing asked, nothing read
    with pytest.raises(
        XRChecksumError, match=r"5000 bytes, the manifest says 6000|of 6000, got bytes 0-699/5000"
    ):
        store.get_range("k/obj", 0, memoryview(out), 6000)  # another object than the manifest's
    with pytest.raises(ValueError, match=r"bytes 4500\.\.5200 are not in an object of 5000"):
        store.get_range("k/obj", 4500, memoryview(out), 5000)
    with pytest.raises(StoreError, match="object missing"):
        store.get_range("k/none", 0, memoryview(out), 5000)


def test_fs_atomic_no_temp_files_and_bad_keys(tmp_path):
    s = FsStore(tmp_path / "mb")
    s.put("a/b/c.bin", b"x" * 10)
    names = [p.name for p in (tmp_path / "mb" / "a" / "b").iterdir()]
    assert names == ["c.bin"]
    (tmp_path / "mb" / "a" / "b" / ".c.bin.tmp-1-abc").write_bytes(b"partial")  # a writer in flight
    assert s.list("a/") == ["a/b/c.bin"]
    for bad in ("../escape", "/abs", "a/../../x", ""):
        with pytest.raises(ValueError, match="bad mailbox key"):
            s.put(bad, b"")
    s.delete(["a/b/c.bin", "a/b/.c.bin.tmp-1-abc"])
    assert not (tmp_path / "mb" / "a").exists()  # empty directories go too


def test_s3_credentials_by_env_name_missing(monkeypatch):
    monkeypatch.delenv("XR_NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(StoreError, match="XR_NOT_SET_ANYWHERE is not set"):
        S3Store("bucket", access_key_id_env="XR_NOT_SET_ANYWHERE", secret_access_key_env="XR_ALSO_NOT")


def test_s3_client_is_lean_and_pooled(s3server, bucket):
    s = S3Store(
        bucket,
        "p",
        endpoint_url=s3server.endpoint_url,
        addressing_style="path",
        region_name="us-east-1",
        threads=24,
    )
    cfg = s.client.meta.config
    assert cfg.max_pool_connections >= 24
    assert cfg.s3["addressing_style"] == "path" and cfg.s3["payload_signing_enabled"] is False
    assert cfg.retries["mode"] == "standard"
    s.put("x/y", b"hello")
    # the prefix is applied on the wire and stripped in listings
    raw = s3server.client().list_objects_v2(Bucket=bucket)["Contents"]
    assert [o["Key"] for o in raw] == ["p/x/y"]
    assert s.list("x/") == ["x/y"]
    assert s.describe("x/y") == f"s3://{bucket}/p/x/y"


def test_fs_get_view_maps_without_copying_and_outlives_the_file(tmp_path):
    st = FsStore(tmp_path)
    assert st.maps_objects and not S3Store.maps_objects
    payload = os.urandom(3 * 4096 + 5)
    st.put("r1/a/s0.bin", payload)
    view = st.get_view("r1/a/s0.bin", len(payload))
    assert view.tobytes() == payload
    view[0] ^= 0xFF  # a private mapping: the caller may scribble, the object does not change
    assert st.get("r1/a/s0.bin") == payload
    st.put("r1/a/s0.bin", b"x" * len(payload))  # a new object under the key (rename over it) ...
    st.delete(["r1/a/s0.bin"])  # ... then deleted: the mapping still shows what was read
    assert view[1:].tobytes() == payload[1:]
    st.put("r1/a/empty.bin", b"")
    assert st.get_view("r1/a/empty.bin", 0).nbytes == 0
    with pytest.raises(XRChecksumError, match="7 bytes, the manifest says 8"):
        st.put("k", b"1234567") or st.get_view("k", 8)
    with pytest.raises(StoreError, match="object missing"):
        st.get_view("nope", 1)


def test_fs_writes_survive_another_regions_delete_emptying_their_directory(tmp_path):
    """delete() removes directories it leaves empty; a create/put into the same directory at that moment
    (two regions probing `_probe/` at start-up, cleanup next to a publish) must make it again, not fail."""
    import threading
    import uuid

    store = FsStore(str(tmp_path))
    errors: list[str] = []

    def churn() -> None:
        try:
            for _ in range(400):
                key = f"run/_probe/{uuid.uuid4().hex}"
                assert store.create(key, b"1")
                store.delete([key])
                key = f"run/r/{uuid.uuid4().hex}"
                store.put(key, b"1")
                store.delete([key])
        except Exception as e:  # noqa: BLE001 - collected and reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.list("run") == []


def test_s3_puts_go_without_expect_100_continue(monkeypatch):
    """botocore's default makes every PUT wait one round trip for the server's `100 Continue` before its body
    (bench roundcost: 6.2 RTT a round with it, 3.0 without): the store turns it off. The request is caught
    before it is sent (no server needed)."""
    from sbatch_gen.train.xr.store import S3Store

    monkeypatch.setenv("T_KEY_ID", "a")
    monkeypatch.setenv("T_SECRET", "b")
    store = S3Store(
        "b",
        endpoint_url="http://127.0.0.1:9",
        addressing_style="path",
        region_name="us-east-1",
        access_key_id_env="T_KEY_ID",
        secret_access_key_env="T_SECRET",
    )
    seen: dict = {}

    class Sent(Exception):
        pass

    def before_send(request, **_kw):
        seen.update(request.headers)
        raise Sent

    store.client.meta.events.register("before-send.s3.PutObject", before_send)
    for put in (lambda: store.put("k", b"x" * 100), lambda: store.create("k", b"x" * 100)):
        seen.clear()
        try:
            put()
        except Exception:  # noqa: BLE001 - the request was caught before sending (or the store wrapped it)
            pass
        assert seen and "Expect" not in seen, seen
