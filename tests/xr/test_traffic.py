"""An outer snapshot's uploads give way to the rounds' transfers (sbatch_gen.train.xr.traffic): a snapshot object
starts only once no round upload or read of the same process is in flight, at most GIVE_WAY_MAX_S later; a
round never waits for a snapshot."""

from __future__ import annotations

import threading
import time

from sbatch_gen.train.xr import reading
from sbatch_gen.train.xr.protocol import Mailbox
from sbatch_gen.train.xr.reading import read_objects
from sbatch_gen.train.xr.store import FsStore
from sbatch_gen.train.xr.traffic import Traffic


class HeldStore(FsStore):
    """An FsStore whose puts and gets of keys starting with ``hold`` wait for ``release``; every put and get logged
    (key, when it started, when it ended)."""

    def __init__(self, root, hold: str) -> None:
        super().__init__(root)
        self.hold, self.release, self.held = hold, threading.Event(), threading.Event()
        self.log: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()

    def _note(self, what: str, key: str) -> None:
        with self._lock:
            self.log.append((what, key, time.monotonic()))

    def _wait(self, key: str) -> None:
        if key.startswith(self.hold):
            self.held.set()
            assert self.release.wait(30)

    def put(self, key, data):
        self._note("put", key)
        self._wait(key)
        super().put(key, data)
        self._note("put done", key)

    def get_into(self, key, out):
        self._note("get", key)
        self._wait(key)
        n = super().get_into(key, out)
        self._note("get done", key)
        return n


def _first(log, what, prefix):
    return min(t for w, k, t in log if w == what and k.startswith(prefix))


def test_give_way_waits_for_the_foreground_and_no_longer_than_its_bound():
    t = Traffic()
    assert t.give_way(5.0) == 0.0 and t.gave_way == 0  # nothing in flight: at once
    with t.foreground():
        t0 = time.monotonic()
        assert 0.15 <= t.give_way(0.2) < 2.0  # a round that never ends: the bound
        assert time.monotonic() - t0 < 2.0
    waited: list[float] = []
    entered, leave = threading.Event(), threading.Event()

    def round_() -> None:
        with t.foreground(), t.foreground():  # nested: counted until the last one ends
            entered.set()
            leave.wait(5)

    th = threading.Thread(target=round_)
    th.start()
    assert entered.wait(5)
    bg = threading.Thread(target=lambda: waited.append(t.give_way(10.0)))
    bg.start()
    time.sleep(0.3)
    assert bg.is_alive()  # still giving way
    leave.set()
    bg.join(5)
    th.join(5)
    assert not t.busy and len(waited) == 1 and 0.25 < waited[0] < 5.0 and t.gave_way == 2


def test_a_snapshot_object_starts_after_the_round_upload_in_flight(tmp_path):
    store = HeldStore(tmp_path, hold="run1/r000003/")
    mb = Mailbox(store, "run1", "eu", ["eu", "us"], threads=4)
    snap = mb.with_threads(2, "xr-snapshot-io", background=True)
    assert snap.traffic is mb.traffic and snap.background and not mb.background
    try:
        up = threading.Thread(target=lambda: mb.upload_shards("r000003", {0: b"x" * 100, 1: b"y" * 100}))
        up.start()
        assert store.held.wait(10)  # the round's objects are on the way
        done: list[dict] = []
        sn = threading.Thread(target=lambda: done.append(snap.upload_shards("_snap/r000003", {0: b"s" * 64})))
        sn.start()
        time.sleep(0.5)
        assert not any(w == "put" and "_snap" in k for w, k, _ in store.log)  # it gives way
        store.release.set()
        up.join(10)
        sn.join(10)
        assert done and not up.is_alive()
        round_done = max(t for w, k, t in store.log if w == "put done" and k.startswith("run1/r000003/"))
        assert _first(store.log, "put", "run1/_snap/") >= round_done
        assert mb.traffic.gave_way == 1 and not mb.traffic.busy
    finally:
        snap.close()
        mb.close()


class _Manifest:
    """What read_objects asks of a manifest for one object read whole (format 3: no chunk checksums)."""

    objects = None
    chunk = 0

    @staticmethod
    def object_nbytes(k):
        return 64


def test_a_snapshot_object_waits_for_a_round_read_but_a_round_never_waits_for_a_snapshot(
    tmp_path, monkeypatch
):
    store = HeldStore(tmp_path, hold="run1/_snap/")
    mb = Mailbox(store, "run1", "eu", ["eu", "us"], threads=4)
    snap = mb.with_threads(2, "xr-snapshot-io", background=True)
    try:
        # a snapshot upload held in flight: a round's upload beside it is not held back
        sn = threading.Thread(target=lambda: snap.upload_shards("_snap/r000002", {0: b"s" * 64}))
        sn.start()
        assert store.held.wait(10)
        t0 = time.monotonic()
        mb.upload_shards("r000002", {0: b"a" * 64})
        assert time.monotonic() - t0 < 5.0 and mb.traffic.gave_way == 0
        store.release.set()
        sn.join(10)

        # a round's read held in flight: a snapshot object waits for it
        store.hold, store.held, store.release = "run1/r000004/", threading.Event(), threading.Event()
        FsStore.put(store, "run1/r000004/us/s00000.bin", b"p" * 64)

        def read_run(mb_, tag, region, m, k, lo, hi, reuse):  # the object's bytes, unchecked
            buf = bytearray(hi - lo)
            mb_.store.get_into(mb_.shard_key(tag, region, k), memoryview(buf))
            return bytes(buf)

        monkeypatch.setattr(reading, "_read_run", read_run)
        rd = threading.Thread(target=lambda: read_objects(mb, "r000004", [("us", _Manifest, 0, [(0, 64)])]))
        rd.start()
        assert store.held.wait(10)
        sn2 = threading.Thread(target=lambda: snap.upload_shards("_snap/r000004", {0: b"t" * 64}))
        sn2.start()
        time.sleep(0.5)
        assert not any(w == "put" and "_snap/r000004" in k for w, k, _ in store.log)
        store.release.set()
        rd.join(10)
        sn2.join(10)
        read_done = max(t for w, k, t in store.log if w == "get done" and k.startswith("run1/r000004/"))
        assert _first(store.log, "put", "run1/_snap/r000004/") >= read_done
        assert mb.traffic.gave_way == 1 and not mb.traffic.busy
    finally:
        snap.close()
        mb.close()
