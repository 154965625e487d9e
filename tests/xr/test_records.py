"""The mailbox's JSON records (round commit, tombstone, presence, heartbeat, outer snapshot marker) as a newer or an older
sbatch-gen writes them: an unknown field is ignored, a record without a version (written before records had
one) is read as version 1, another version is refused in one line naming the key. Torch-free, fs store."""

from __future__ import annotations

import json
import os

import pytest

from bench import scripted
from sbatch_gen.train.xr import records
from sbatch_gen.train.xr.errors import XRLayoutError
from sbatch_gen.train.xr.heartbeat import HeartbeatWriter
from sbatch_gen.train.xr.membership import Membership
from sbatch_gen.train.xr.protocol import Mailbox, round_tag
from sbatch_gen.train.xr.rounds import wait_commit
from sbatch_gen.train.xr.store import FsStore

REGIONS = ["eu", "us"]
N = 256  # fp32 elements per payload
TAG = round_tag(1)


def _mailbox(tmp_path, region: str = "eu") -> Membership:
    return Membership(Mailbox(FsStore(tmp_path), "run1", region, REGIONS, threads=1), 1, 0.0, heartbeat_s=1.0)


def _publish(mb: Mailbox, tag: str):
    return scripted.publish(
        mb, tag, os.urandom(4 * N), kind="delta", dtype="fp32", layout="L1", step=4, tokens=7, shard_mb=0
    )


def _written(ms: Membership) -> dict:
    """Each record as this version writes it: {kind: (key, how Membership reads it back)}."""
    m, expect = _publish(ms.mb, TAG)
    c, _ = wait_commit(ms, TAG, expect, step=4)
    ms.announce("joined", 1, 4)
    HeartbeatWriter(ms.store, ms.alive_key("eu"), "eu", 1.0).beat()
    parts = {
        p: _publish(Mailbox(ms.store, "run1", p, [p], threads=1), ms.snap_tag(1))
        for p in ("theta", "momentum")
    }
    ms.complete_snapshot(1, {p: man for p, (man, _) in parts.items()}, 1)
    snap_expect = parts["theta"][1]
    return {
        "commit": (ms.commit_key(TAG), lambda: ms.read_commit(TAG)),
        # eu closed the round without us (quorum 1, no grace): a tombstone at us's claim key
        "tombstone": (ms.claim_key(TAG, "us"), lambda: ms.read_claim(TAG, "us")),
        "presence": (ms.presence_key("eu"), lambda: ms.read_presence("eu")),
        "heartbeat": (ms.alive_key("eu"), lambda: ms.read_heartbeat("eu")),
        "snapshot marker": (ms.snap_complete_key(1), lambda: ms.read_snapshot(1, snap_expect)),
    }


def _rewrite(ms: Membership, key: str, drop: tuple[str, ...] = (), **fields) -> None:
    d = json.loads(ms.store.get(key))
    for k in drop:
        del d[k]
    ms.store.put(key, json.dumps({**d, **fields}).encode())


KINDS = ["commit", "tombstone", "presence", "heartbeat", "snapshot marker"]
WHAT = {  # how an error names each
    "commit": "round commit",
    "tombstone": "round tombstone",
    "presence": "presence record",
    "heartbeat": "heartbeat",
    "snapshot marker": "outer snapshot marker",
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_record_carries_the_version(tmp_path, kind):
    ms = _mailbox(tmp_path)
    key, _ = _written(ms)[kind]
    assert json.loads(ms.store.get(key))["version"] == records.VERSION == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_field_a_newer_writer_added_is_ignored(tmp_path, kind):
    """A newer sbatch-gen's extra field must not make a live region look absent (presence, heartbeat) or a
    round unreadable: the record reads as without it."""
    ms = _mailbox(tmp_path)
    key, read = _written(ms)[kind]
    before = read()
    assert before is not None
    _rewrite(ms, key, added_by_a_newer_writer={"x": 1})
    assert read() == before
    if kind in ("presence", "heartbeat"):  # the listings that `sbatch-gen status` reads, too
        listed = ms.presences() if kind == "presence" else ms.heartbeats()
        assert listed == {"eu": before}


@pytest.mark.parametrize("kind", KINDS)
def test_a_record_without_a_version_is_read_as_version_1(tmp_path, kind):
    """Written before records had a version (a run started with that code continues); the old commit's
    ``format: 1`` is an unknown field now."""
    ms = _mailbox(tmp_path)
    key, read = _written(ms)[kind]
    before = read()
    _rewrite(ms, key, drop=("version",), **({"format": 1} if kind == "commit" else {}))
    assert "version" not in json.loads(ms.store.get(key))
    assert read() == before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("version", [2, "1", None])
def test_a_record_of_another_version_is_refused_in_one_line(tmp_path, kind, version):
    """Not taken for an absent record: one line naming the key, the version found and the one read here."""
    ms = _mailbox(tmp_path)
    key, read = _written(ms)[kind]
    _rewrite(ms, key, version=version)
    with pytest.raises(XRLayoutError) as e:
        read()
    assert str(e.value) == (
        f"{WHAT[kind]} {ms.store.describe(key)} is version {version!r}, this sbatch-gen reads version 1: "
        "every region of a run must run the same sbatch-gen version"
    )
