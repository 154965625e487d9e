"""What a steady-state round costs in store requests, counted at the store (fs and a real S3 server), and
in sequential round trips, timed with a delay on every request: each region publishes once (its objects,
then its claim), learns the members with one look (two regions: a GET of the peer's claim), polls with one
request, and fetches the payloads while it records the commit. Regions as threads of this process."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import pytest
import torch

from sbatch_gen.train.dist import DistInfo
from sbatch_gen.train.xr.modes import create
from sbatch_gen.train.xr.store import Store, make_store

from .concurrent import in_threads
from .test_sync import inner_steps, model, xr_for

pytestmark = pytest.mark.slow  # a real S3 server, regions that wait for each other

H = 4
_KEY = re.compile(r"/r\d{6}/(?:(?P<claim>[a-z]+)\.done|(?P<commit>_commit\.json)|(?P<obj>[a-z]+)/s\d+\.bin)$")


_open: list = []  # the syncs a test made: closed after it


@pytest.fixture(autouse=True)
def _close_syncs():
    yield
    while _open:
        _open.pop().close()


class Counting(Store):
    """A store that records every request (method, key) and delays each by ``delay_s``: an emulated round
    trip, so that a round's time counts its sequential requests."""

    def __init__(self, inner: Store, delay_s: float = 0.0) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.maps_objects = inner.maps_objects
        self.log: list[tuple[str, str]] = []
        self.missed: set[int] = set()  # the GETs in the log that found nothing
        self._lock = threading.Lock()

    def _req(self, method: str, key: str) -> int:
        with self._lock:
            self.log.append((method, key))
            at = len(self.log) - 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return at

    @property  # type: ignore[override]
    def retries(self) -> int:
        return self.inner.retries

    def put(self, key, data):
        self._req("put", key)
        return self.inner.put(key, data)

    def create(self, key, data):
        self._req("create", key)
        return self.inner.create(key, data)

    def get(self, key):
        at = self._req("get", key)
        got = self.inner.get(key)
        if got is None:
            with self._lock:
                self.missed.add(at)
        return got

    def get_into(self, key, out):
        self._req("get", key)
        return self.inner.get_into(key, out)

    def get_range(self, key, offset, out, total):
        self._req("get", key)
        return self.inner.get_range(key, offset, out, total)

    def get_view(self, key, nbytes):
        self._req("get", key)
        return self.inner.get_view(key, nbytes)

    def modified(self, key):
        self._req("head", key)
        return self.inner.modified(key)

    def get_aged(self, key):
        self._req("get", key)
        return self.inner.get_aged(key)

    def list(self, prefix):
        self._req("list", prefix)
        return self.inner.list(prefix)

    def children(self, prefix):
        self._req("list", prefix)
        return self.inner.children(prefix)

    def delete(self, keys):
        self._req("delete", ",".join(keys))
        return self.inner.delete(keys)

    def describe(self, key=""):
        return self.inner.describe(key)

    def clone(self) -> Store:
        return self.inner.clone()  # (heartbeats: not a round's requests)

    def close(self) -> None:
        self.inner.close()


def _what(method: str, key: str, region: str) -> str:
    """A request in words: ``put shard``, ``create claim``, ``get peer claim``, ``create commit``, ..."""
    m = _KEY.search(key)
    if m is None:
        return f"{method} other"
    if m["claim"]:
        return f"{method} {'own' if m['claim'] == region else 'peer'} claim"
    if m["commit"]:
        return f"{method} commit"
    return f"{method} {'own' if m['obj'] == region else 'peer'} object"


def _regions(transport, regions, delay_s=0.0, **kw):
    """{region: (model, sync, optimizer, its counting store)}, aligned (theta0 adopted)."""
    out = {}

    def make(r):
        store = Counting(make_store(transport, 16), delay_s)
        xr = xr_for(r, "unused", regions=regions, transport=transport, threads=16, **kw)
        m = model(1 if r == regions[0] else 2)
        s = create(xr, m, torch.device("cpu"), DistInfo(), store=store, poll_min_s=0.005, poll_max_s=0.05)
        _open.append(s)
        s.align(0)
        out[r] = (m, s, torch.optim.SGD(m.parameters(), lr=0.05), store)

    in_threads(make, regions)
    return out


def _round(syncs, region, r, before_s=0.0):
    """``region``'s round ``r`` (after its H inner steps; ``before_s`` later than the others): (its requests,
    seconds)."""
    m, s, opt, store = syncs[region]
    inner_steps(m, opt, region, range((r - 1) * H + 1, r * H + 1))
    time.sleep(before_s)
    n0 = len(store.log)
    t0 = time.perf_counter()
    s.after_optimizer_step(r * H, 32)
    took = time.perf_counter() - t0
    return [_what(mth, k, region) for mth, k in store.log[n0:]], took


# keep_rounds and snapshot_every beyond the test's rounds: no housekeeping request during a round
QUIET = dict(keep_rounds=50, snapshot_every=50, shard_mb=0.0001, payload_dtype="fp32")


@pytest.mark.parametrize("elastic", [False, True], ids=["strict", "elastic"])
def test_a_steady_round_costs_each_region_one_publish_one_look_and_its_fetches(transport, elastic):
    """Two regions; us reaches each round's boundary 0.3 s after eu. Rounds 2-4 (round 1 lists the run
    once: has this region claimed rounds before?): us, the last to arrive, writes its 4 objects and its
    claim (create-only where elastic, a plain write where strict), reads eu's claim once, records the
    commit (the same) and reads eu's 4 objects: nothing else. eu makes the same requests, polling eu's claim with one
    GET each time, and never lists, never reads its own claim or the commit."""
    kw = dict(min_regions=1, grace_s=20.0, heartbeat_s=None) if elastic else {}
    syncs = _regions(transport, ["eu", "us"], **QUIET, **kw)
    claim = "create own claim" if elastic else "put own claim"
    for r in range(1, 5):
        got = in_threads(lambda reg, r=r: _round(syncs, reg, r, 0.3 if reg == "us" else 0.0), ["eu", "us"])
        if r == 1:
            continue
        us, eu = Counter(got["us"][0]), Counter(got["eu"][0])
        commit = "create commit" if elastic else "put commit"
        want = {"put own object": 4, claim: 1, "get peer claim": 1, commit: 1, "get peer object": 4}
        assert us == want, (r, us)
        polls = eu.pop("get peer claim")
        if elastic:  # (while it waits: the missing region's presence, whether it announced a leave)
            assert eu.pop("get other") <= 2, (r, eu)
        assert eu == {k: v for k, v in want.items() if k != "get peer claim"}, (r, eu)
        assert 1 <= polls <= 40, (r, polls)


def test_polls_cost_one_request_whatever_the_number_of_regions(transport):
    """Four regions; eu arrives first, the others 0.4 s later. eu's polls are one listing of the round's
    own prefix while several regions are missing (its objects only: the claims and the commit, not the
    regions' shards), one GET while one is; it reads each claim once. The last of the others reads the
    claims of all three peers at once (3 requests, one round trip) and lists nothing."""
    regions = ["eu", "us", "ap", "sa"]
    syncs = _regions(transport, regions, **QUIET)
    for r in (1, 2):
        got = in_threads(lambda reg, r=r: _round(syncs, reg, r, 0.0 if reg == "eu" else 0.4), regions)
    eu = Counter(got["eu"][0])
    _, s, _, store = syncs["eu"]
    n0 = len(store.log) - len(got["eu"][0])  # round 2's requests
    claims = [
        (k.rsplit("/", 1)[1], i not in store.missed)
        for i, (mth, k) in enumerate(store.log[n0:], n0)
        if mth == "get" and k.endswith(".done") and not k.endswith("/eu.done")
    ]
    first, later = claims[:3], claims[3:]
    assert sorted(k for k, _ in first) == ["ap.done", "sa.done", "us.done"], claims  # the first look
    # later: a listing per poll while several are missing; a missed GET only of the one key still missing
    assert len({k for k, hit in later if not hit}) <= 1, claims
    assert sorted(k for k, hit in claims if hit) == ["ap.done", "sa.done", "us.done"], claims  # each once
    listed = [k for mth, k in store.log[n0:] if mth == "list"]
    assert listed and len(listed) == eu["list other"] and all(k == "t/r000002/" for k in listed), listed
    for reg in ("us", "ap", "sa"):
        c = Counter(got[reg][0])
        assert c["get peer claim"] >= 3 and c["get peer object"] == 3 * 4 and c["get own claim"] == 0, c


def test_the_last_region_to_arrive_waits_about_three_round_trips(tmp_path):
    """Every request takes 0.2 s (an emulated WAN round trip; a tiny payload, so transfers cost nothing
    more): the region that arrives last finishes its round in about 3 round trips (its objects; its claim
    and the look at the others' claims, at once; the others' objects and the commit's record, at once).
    The protocol before this one took about 10 here (the commit and its own manifest read first, the
    manifest written after the objects, the manifests polled one by one, a listing of the whole run
    before the commit, the members' manifests read one by one)."""
    from sbatch_gen.xr_options import FsTransport

    rtt = 0.2
    syncs = _regions(FsTransport(root=str(tmp_path / "mb")), ["eu", "us", "ap"], rtt, **QUIET)
    times = []
    for r in (1, 2, 3):
        got = in_threads(
            lambda reg, r=r: _round(syncs, reg, r, 6 * rtt if reg == "ap" else 0.0), ["eu", "us", "ap"]
        )
        if r > 1:
            times.append(got["ap"][1])
    assert all(2.9 * rtt <= t < 4.0 * rtt for t in times), times


def test_strict_rounds_run_on_a_store_without_conditional_writes(tmp_path, monkeypatch):
    """nanio ignores If-None-Match: strict rounds (min_regions all) make no conditional write at all, so
    they run there, bit-identical."""
    from bench.servers import NanioServer, s3_client
    from sbatch_gen.train.xr.store import probe_create
    from sbatch_gen.xr_options import S3Credentials, S3Transport

    from .test_sync import flat

    with NanioServer() as server:
        s3_client(server.endpoint_url).create_bucket(Bucket="nocond")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        t = S3Transport(
            bucket="nocond",
            endpoint_url=server.endpoint_url,
            addressing_style="path",
            region_name="us-east-1",
            credentials=S3Credentials(
                access_key_id_env="AWS_ACCESS_KEY_ID", secret_access_key_env="AWS_SECRET_ACCESS_KEY"
            ),
        )
        assert probe_create(make_store(t, threads=1), "p") is False
        syncs = _regions(t, ["eu", "us"], **QUIET)
        for r in (1, 2, 3):
            got = in_threads(
                lambda reg, r=r: _round(syncs, reg, r, 0.1 if reg == "us" else 0.0), ["eu", "us"]
            )
            assert all(w.split()[0] != "create" for reg in got for w in got[reg][0]), got
        assert torch.equal(flat(syncs["eu"][0]), flat(syncs["us"][0]))
        assert torch.equal(syncs["eu"][1].theta_outer, syncs["us"][1].theta_outer)
        while _open:  # (before the server goes)
            _open.pop().close()
