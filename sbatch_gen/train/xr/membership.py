"""Round membership, decided once in the mailbox: claims, commits, presence, outer snapshots, as the mailbox
holds them (the wait that decides a round: :mod:`.rounds`). Torch-free. The records and the closing rule
(:func:`~.commit.decide`) are :mod:`.commit`'s, the heartbeat writer :mod:`.heartbeat`'s; this module reads
and writes them in the mailbox.

Keys, next to the rounds of :mod:`.protocol` (region names start with a letter or digit, so the
``_``-prefixed names below never collide with a region's objects)::

    <run>/<tag>/<region>.done               the region's CLAIM of the round: its manifest, or a closer's tombstone
    <run>/<tag>/_commit.json                the round's commit: the record of what its claims decided
    <run>/_presence/<region>.json           joined / leaving, written by that region only
    <run>/_alive/<region>.json              its liveness heartbeat: a counter, overwritten every heartbeat_s
    <run>/_snap/r<round>/theta/s00000.bin   outer snapshot of a round: theta_outer and momentum (fp32)
    <run>/_snap/r<round>/theta.done         ... their manifests (the protocol's format)
    <run>/_snap/r<round>/_complete.json     ... and the marker that makes it usable, written last
    <run>/_clock/<region>                   empty: written to read the store's clock (:meth:`Membership.store_now`)

**Deciding a round: claims.** Each region publishes its round once: its objects, then its manifest at its
claim key (create-only where the round is elastic; a plain write where it is strict, which needs no
conditional write). A round closes when every region has claimed it, or when at least ``quorum`` manifests
are there and ``grace_s`` has passed since that quorum formed, or at once (with the quorum) when every
region still missing has announced a planned leave or has crashed (below). A region that closes the round
without some regions writes a :class:`~.commit.Tombstone` at each missing region's claim key, create-only:
of a region's manifest and a tombstone exactly one wins the key, and neither is ever overwritten. Once
every region's key holds one or the other, the round is decided, and every region reading the keys finds
the same members (the manifests; every region averages exactly their payloads, so the parameters stay
bit-identical) and builds the same commit from them (:class:`.rounds.RoundWait`). The commit is then written as a
record for returning regions and people, beside the payload downloads; nothing is decided by it.

**Crashed regions (heartbeats).** A region that crashes (SIGKILL, a lost node) announces nothing. With
``heartbeat_s`` set, a thread of each region's rank 0 overwrites its heartbeat object with an increasing
counter every ``heartbeat_s``, from the end of its catch-up on. A region waiting in a round reads, once
``quorum`` regions have published, the heartbeats of the regions still missing (with their presence records,
all at once, every ``grace_s / 4`` between 0.05 and 1 s), each with
its age on the STORE's clock (:meth:`~.store.Store.get_aged`), and remembers, on its OWN monotonic clock,
since when it has seen each value: a region whose heartbeat is ``STALE_BEATS`` heartbeat intervals old by
the store, or unchanged for as long of watching (no heartbeat at all counts the same), is treated as gone,
like one that announced its leave, and the round closes once ``quorum`` regions have arrived, without
waiting out ``grace_s`` (reason ``stale``; the commit names the regions). A region that crashed long ago is
so seen gone at the first read. No host's clock is compared with another's: the heartbeat's wall-clock
time is for people only. The observations outlive the round, so after the first round that detects a
crash the next ones close at once. A region that is hung but still beating is waited for up to
``grace_s``, as before. From the same moment on, a second thread reads the other regions' heartbeats every
``heartbeat_s / 2`` whether a round waits or not (:class:`~.heartbeat.PeerWatch`, sharing these
observations): a round's first look then already judges the regions it found gone meanwhile.

**Never closing a round twice.** Only a region deletes its own claim keys (:meth:`Membership.cleanup`,
more than ``keep_rounds`` rounds behind, and the round's commit after them), so a round's decision stands
until the regions have moved past it; tombstones are written only with ``quorum`` manifests there and after
a look at the run (:class:`.rounds.RoundWait`): a round whose claims are incomplete while a later round was
committed has been cleaned up behind this region (:class:`~.errors.XRBehind`: fast-forward), and one whose
own commit is still there is decided by it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from . import records
from .commit import Commit, Presence, Tombstone
from .errors import XRBehind, XRError, XRLayoutError, XRNoQuorum, XRSettingsError
from .heartbeat import STALE_BEATS, Heartbeat, HeartbeatWriter, PeerWatch
from .protocol import Expect, Mailbox, Manifest, digest, parse_tag, round_tag
from .store import Store

COMMIT_NAME = "_commit.json"
PRESENCE_DIR = "_presence"
SNAP_DIR = "_snap"
SNAP_PARTS = ("theta", "momentum")
ALIVE_DIR = "_alive"
BEHIND_CHECK_S = 10.0  # how often a round's wait lists the run: has it moved past the round (XRBehind)?
CLOCK_DIR = "_clock"
_SNAP_RE = re.compile(r"^r(\d{6,})$")
log = logging.getLogger("sbatch_gen.train")


Claim = Manifest | Tombstone  # what a round's claim key holds
T = TypeVar("T")


def manifest_digest(m: Manifest) -> str:
    return digest(m.to_json())


def _shown(v: object) -> str:
    """A setting's value in a message: JSON, as the claims carry it."""
    return json.dumps(v)


def _is_tombstone(raw: bytes) -> bool:
    try:
        d = json.loads(raw)
    except ValueError:
        return False  # (unreadable: the manifest reader says so)
    return isinstance(d, dict) and d.get("tombstone") is True


class Membership:
    """Commits, presence and snapshots of one run, seen from one region (its rank 0)."""

    def __init__(
        self,
        mailbox: Mailbox,
        quorum: int,
        grace_s: float,
        *,
        job: str = "",
        clock: Callable[[], float] = time.monotonic,
        heartbeat_s: float | None = None,
        settings: dict | None = None,
    ) -> None:
        self.mb = mailbox
        self.store = mailbox.store
        self.run_id, self.region, self.regions = mailbox.run_id, mailbox.region, mailbox.regions
        self.quorum, self.grace_s = quorum, grace_s
        self.job = job
        # what this region's round claims say it shares with the others (CrossRegion.round_settings); a
        # peer's claim that says otherwise is refused (None: not compared)
        self.settings = settings
        self._clock = clock
        self.heartbeat_s = heartbeat_s  # None: other regions' heartbeats are not read, none is written
        self._writer: HeartbeatWriter | None = None
        self._peers: PeerWatch | None = None  # the other regions' heartbeats, watched from a thread
        self._peer_store: Store = self.store  # ... through a client of its own
        self._watch_lock = threading.Lock()
        # region -> (heartbeat value last seen or None, when it was first seen on self._clock); kept across rounds
        self._watch: dict[str, tuple[tuple[str, int] | None, float]] = {}
        self.behind_check_s = BEHIND_CHECK_S
        self._own_newest: int | None = None  # the newest round with a claim of this region (must_read_own)
        self.late_last = False  # this region was late in its last round
        self.absent_last: set[str] = set()  # the regions its last round closed without
        # the regions whose claim this process has read (and found to share its settings): a round's wait
        # reads the presence of the others it waits for, to hear of one that refused the run's settings
        self.met: set[str] = set()

    # -- keys ----------------------------------------------------------------------------------------
    def commit_key(self, tag: str) -> str:
        return f"{self.run_id}/{tag}/{COMMIT_NAME}"

    def presence_key(self, region: str) -> str:
        return f"{self.run_id}/{PRESENCE_DIR}/{region}.json"

    def alive_key(self, region: str) -> str:
        return f"{self.run_id}/{ALIVE_DIR}/{region}.json"

    @staticmethod
    def snap_tag(r: int) -> str:
        return f"{SNAP_DIR}/{round_tag(r)}"

    def snap_complete_key(self, r: int) -> str:
        return f"{self.run_id}/{self.snap_tag(r)}/_complete.json"

    def store_now(self) -> float | None:
        """Now by the STORE's clock (:meth:`~.store.Store.modified` of a write made now), the clock of
        every object's write time: None if the store does not say."""
        key = f"{self.run_id}/{CLOCK_DIR}/{self.region}"
        self.store.put(key, b"")
        return self.store.modified(key)

    # -- commits ---------------------------------------------------------------------------------------
    def read_commit(self, tag: str) -> Commit | None:
        key = self.commit_key(tag)
        raw = self.store.get(key)
        if raw is None:
            return None
        c = Commit.from_json(raw, self.store.describe(key))
        if c.run_id != self.run_id or c.tag != tag:
            raise XRLayoutError(
                f"round commit {self.store.describe(key)} names run {c.run_id!r} round {c.tag!r}"
            )
        return c

    def run_keys(self) -> list[str]:
        """Every key of the run (one listing): pass it to the readers below to list once for several."""
        return self.store.list(f"{self.run_id}/")

    def committed_rounds(self, keys: list[str] | None = None) -> list[int]:
        """Rounds with a commit in the mailbox, ascending (one listing, or ``keys`` of :meth:`run_keys`)."""
        out = []
        for key in self.run_keys() if keys is None else keys:
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == COMMIT_NAME:
                r = parse_tag(parts[1])
                if r is not None:
                    out.append(r)
        return sorted(out)

    def published_rounds(self, keys: list[str] | None = None) -> dict[str, int]:
        """Each region's newest round whose claim is its own manifest (one listing, or ``keys`` of
        :meth:`run_keys`; then a read of the claims from the newest back, past the tombstones others wrote
        at its keys while it was away)."""
        rounds: dict[str, list[int]] = {}
        for key in self.run_keys() if keys is None else keys:
            parts = key.split("/")
            if len(parts) == 3 and parts[2].endswith(".done") and parts[2][:-5] in self.regions:
                r = parse_tag(parts[1])
                if r is not None:
                    rounds.setdefault(parts[2][:-5], []).append(r)
        out = {}
        for region, rs in rounds.items():
            for r in sorted(rs, reverse=True):
                try:
                    claim = self.read_claim(round_tag(r), region)
                except XRLayoutError:
                    continue
                if isinstance(claim, Manifest):
                    out[region] = r
                    break
        return out

    def latest_commit(self) -> int | None:
        rounds = self.committed_rounds()
        return rounds[-1] if rounds else None

    # -- claims: who takes part in a round --------------------------------------------------------------
    @property
    def strict(self) -> bool:
        """Every round waits for every region: nobody is ever closed out, so no tombstone is ever written."""
        return self.quorum >= len(self.regions)

    def claim_key(self, tag: str, region: str) -> str:
        """Where ``region``'s claim of round ``tag`` lies: its manifest, or a closer's tombstone."""
        return self.mb.manifest_key(tag, region)

    def read_claim(self, tag: str, region: str, expect: Expect | None = None) -> Claim | None:
        """``region``'s claim of round ``tag``: its manifest (checked against ``expect`` when given), a
        tombstone (the round closed without it), or None (neither yet)."""
        raw = self.store.get(self.claim_key(tag, region))
        return None if raw is None else self._claim(raw, tag, region, expect)

    def _claim(self, raw: bytes, tag: str, region: str, expect: Expect | None) -> Claim:
        where = self.store.describe(self.claim_key(tag, region))
        if _is_tombstone(raw):
            t = Tombstone.from_json(raw, where)
            if (t.run_id, t.tag, t.region) != (self.run_id, tag, region):
                raise XRLayoutError(
                    f"round tombstone {where} names run {t.run_id!r} round {t.tag!r} region {t.region!r}"
                )
            return t
        m = Manifest.from_json(raw, where)
        if region != self.region:
            self.check_settings(m, tag, region)
            self.met.add(region)
        if expect is not None:
            expect.check(m, self.run_id, tag, region, where)
        return m

    def check_settings(self, m: Manifest, tag: str, region: str) -> None:
        """Refuse ``region``'s claim ``m`` of round ``tag`` when the settings it carries (``extra.settings``,
        :meth:`~sbatch_gen.xr_options.CrossRegion.round_settings`) differ from this region's, in one line
        naming both regions and the first setting that differs. Both regions refuse: each reads the other's
        claim, in the first round both publish. A setting either side does not state (an older or newer
        writer, or one of another mode, which an earlier setting tells apart) is not compared."""
        theirs = m.extra.get("settings") if isinstance(m.extra, dict) else None
        if self.settings is None or not isinstance(theirs, dict):
            return
        for k, mine in self.settings.items():
            if k in theirs and theirs[k] != mine:
                raise XRSettingsError(
                    f"round {tag}: regions {self.region!r} and {region!r} disagree on {k}: "
                    f"{_shown(mine)} in {self.region!r}, {_shown(theirs[k])} in {region!r}; every region "
                    "of a run must share it (sbatch-gen validate compares the sites' cross_region)"
                )

    def claim(self, m: Manifest) -> Claim:
        """Publish this region's claim of round ``m.tag``, its manifest: create-only where the round is elastic
        (a closer may be writing a tombstone at the same key: one of them wins), a plain write where it is
        strict (no tombstones; any S3 server will do). Returns what the key holds: ``m``, or the tombstone
        that won (this region is late)."""
        key = self.claim_key(m.tag, self.region)
        raw = m.to_json()
        if self.strict:
            self.store.put(key, raw)
            return m
        if self.store.create(key, raw):
            return m
        there = self.store.get(key)
        if there == raw:  # (a create retried after its first attempt landed)
            return m
        got = None if there is None else self._claim(there, m.tag, self.region, None)
        if isinstance(got, Tombstone):
            return got
        raise XRError(
            f"round {m.tag}: {self.store.describe(key)} holds another claim of region {self.region!r} "
            "than the one it just published: are two jobs of this region running?"
        )

    def must_read_own(self, r: int) -> bool:
        """Must this region read its own claim of round ``r`` (and the round's commit) before publishing (a
        requeued job re-entering a round it published, or one closed without it)? For the first round of
        this process, for rounds up to the newest that holds a claim of this region when this process first
        asks (one listing of the run, once), and after a late round (a region late once is likely late
        again: it looks before it uploads). Beyond that only this process writes its manifests, and a
        tombstone that beats the upload is found by the claim's create-only write."""
        if self._own_newest is None:
            self._own_newest = self.mb.latest_rounds().get(self.region, -1)
            return True
        return r <= self._own_newest or self.late_last

    def record_commit(self, c: Commit) -> None:
        """Write round ``c``'s commit, the record of what its claims decided (elastic: create-only, the first
        writer's stays; strict: a plain write, so strict rounds need no conditional write at all, and the
        last writer's stays: every writer names the same members). Returning regions, ``sbatch-gen status``
        and the behind check read it; nothing decides by it."""
        if self.strict:
            self.store.put(self.commit_key(c.tag), c.to_json())
        else:
            self.store.create(self.commit_key(c.tag), c.to_json())

    def _no_quorum(self, tag: str, step: int | None, got: dict[str, Manifest]) -> XRNoQuorum:
        """The error of a wait for round ``tag`` that timed out without a quorum, naming the missing."""
        missing = [r for r in self.regions if r not in got]
        at = f" (step {step})" if step is not None else ""
        return XRNoQuorum(
            f"round {tag}{at}: no quorum after {self.mb.timeout_s:g} s: {len(got)} of {len(self.regions)} "
            f"regions published, {self.quorum} needed (min_regions); missing: {', '.join(missing)}",
            missing,
        )

    def refuse(self, tag: str, step: int | None, why: str) -> None:
        """This region refuses the run (a peer's settings differ from its own, :meth:`check_settings`): its
        presence record says so, with ``why``, so that a peer waiting for it stops too instead of waiting
        out ``timeout_s`` (best effort: the refusal itself is what matters)."""
        r = parse_tag(tag)
        try:
            self.announce("refused", r if r is not None else 0, step if step is not None else -1, why)
        except Exception as e:  # noqa: BLE001
            log.warning("cross-region: could not record the refusal in the mailbox: %s", e)

    def _judge_heartbeat(self, region: str, store: Store | None = None) -> float:
        """Read ``region``'s heartbeat (through ``store``: default this membership's) and judge it: when it
        turns stale on this region's clock, now or earlier if it is stale already."""
        before = self._clock()
        hb, age = self.read_heartbeat_aged(region, store)
        after = self._clock()
        with self._watch_lock:  # (the rounds' reads and the peer watch's share what they saw)
            quiet, limit = self._quiet_for(region, hb, before, after)
        return after + limit - max(quiet, age or 0.0)

    def watched_gone(self) -> set[str]:
        """The regions the peer watch (:class:`~.heartbeat.PeerWatch`) last found stale; empty without one."""
        return self._peers.gone() if self._peers is not None else set()

    def _quiet_for(
        self, region: str, hb: Heartbeat | None, before: float, after: float
    ) -> tuple[float, float]:
        """Record one reading of ``region``'s heartbeat, taken between ``before`` and ``after`` (this region's
        clock). Returns (for how long this region has watched its value not change, how long makes it
        stale). The store's own age of the object (:meth:`read_heartbeat_aged`) says more from the first
        reading on; watching covers a missing heartbeat and a store that tells no age."""
        value = hb.value if hb is not None else None
        seen = self._watch.get(region)
        # the writer's own interval when it is longer (regions disagreeing on heartbeat_s never misjudge)
        limit = STALE_BEATS * max(self.heartbeat_s or 0.0, hb.interval_s if hb is not None else 0.0)
        if seen is None or seen[0] != value:
            self._watch[region] = (value, after)  # unchanged at least from after this read on
            return 0.0, limit
        return max(0.0, before - seen[1]), limit

    # -- heartbeats ------------------------------------------------------------------------------------
    def read_heartbeat(self, region: str) -> Heartbeat | None:
        return self._read_record(Heartbeat, self.alive_key(region), region)

    def read_heartbeat_aged(
        self, region: str, store: Store | None = None
    ) -> tuple[Heartbeat | None, float | None]:
        """``region``'s heartbeat and the seconds since it was written, on the store's clock
        (:meth:`~.store.Store.get_aged`; None: missing, unreadable, or no age told)."""
        key = self.alive_key(region)
        store = store or self.store
        got = store.get_aged(key)
        if got is None:
            return None, None
        hb = Heartbeat.from_json(got[0], store.describe(key))
        return (hb, got[1]) if hb is not None and hb.region == region else (None, None)

    def heartbeats(self, keys: list[str] | None = None) -> dict[str, Heartbeat]:
        """Every region's heartbeat in the mailbox (one listing, or ``keys`` of :meth:`run_keys`)."""
        return self._read_records(Heartbeat, ALIVE_DIR, self.alive_key, keys)

    # -- per-region records (presence, heartbeat): <run>/<dir>/<region>.json, written by that region only --
    def _read_record(self, cls, key: str, region: str, store: Store | None = None):
        store = store or self.store
        raw = store.get(key)
        rec = cls.from_json(raw, store.describe(key)) if raw is not None else None
        return rec if rec is not None and rec.region == region else None

    def _read_records(self, cls, folder: str, key_of: Callable[[str], str], keys: list[str] | None) -> dict:
        """region -> record, for the records under ``<run>/<folder>/`` that sit under their own region's key."""
        prefix = f"{self.run_id}/{folder}/"
        out = {}
        for key in self.store.list(prefix) if keys is None else [k for k in keys if k.startswith(prefix)]:
            raw = self.store.get(key)
            rec = cls.from_json(raw, self.store.describe(key)) if raw is not None else None
            if rec is not None and rec.region in self.regions and key == key_of(rec.region):
                out[rec.region] = rec
        return out

    def start_heartbeat(self, heartbeat_s: float | None = None) -> None:
        """Start beating for this region (its rank 0 only) every ``heartbeat_s`` (default: the one given at
        construction, which is also what other regions' heartbeats are judged by); None: no heartbeats."""
        if heartbeat_s is not None:
            self.heartbeat_s = heartbeat_s
        if self.heartbeat_s is None or self._writer is not None:
            return
        # its own store client: a beat never queues behind this region's payload uploads
        self._writer = HeartbeatWriter(
            self.store.clone(), self.alive_key(self.region), self.region, self.heartbeat_s, self.job
        )
        self._writer.start()
        others = [r for r in self.regions if r != self.region]
        if others:  # and the others' heartbeats, watched from now on (another client of its own)
            store = self._peer_store = self.store.clone()
            self._peers = PeerWatch(
                others,
                lambda r: self._judge_heartbeat(r, store),
                self.heartbeat_s / 2,
                self._clock,
                said=lambda r: self.read_presence(r, store),
            )
            self._peers.start()

    def stop_heartbeat(self) -> None:
        """Stop beating (a planned leave, the end, close); the others then treat this region as gone after
        STALE_BEATS intervals unless its presence says it left."""
        if self._writer is not None:
            self._writer.stop()
            if self._writer.store is not self.store:
                self._writer.store.close()
            self._writer = None
        if self._peers is not None:
            self._peers.stop()
            if self._peer_store is not self.store:
                self._peer_store.close()
            self._peers = None

    @property
    def beating(self) -> bool:
        return self._writer is not None and self._writer.alive

    def member_manifests(self, c: Commit, expect: Expect, known: dict[str, Manifest]) -> dict[str, Manifest]:
        """The committed members' manifests (read where not ``known``), each checked against the digest
        the commit names: every region averages exactly the committed payloads."""
        out = {}
        for r in self.regions:
            if r not in c.members:
                continue
            m = known.get(r) or self.mb.read_manifest(c.tag, r)
            where = self.store.describe(self.mb.manifest_key(c.tag, r))
            if m is None:
                raise XRBehind(f"round {c.tag}: committed manifest of region {r!r} is gone ({where})", None)
            expect.check(m, self.run_id, c.tag, r, where)
            if manifest_digest(m) != c.members[r].digest:
                raise XRLayoutError(
                    f"round {c.tag}: manifest of region {r!r} at {where} is not the one the "
                    "round committed (digest differs)"
                )
            out[r] = m
        return out

    # -- presence --------------------------------------------------------------------------------------
    def announce(self, state: str, r: int, step: int, why: str = "") -> None:
        p = Presence(self.region, state, r, step, time.time(), self.job, why)
        self.store.put(self.presence_key(self.region), p.to_json())
        if state in ("leaving", "refused"):
            # a region that left beats no more: its leave, written first, is what the others read (a watch
            # that finds its heartbeat stale finds the leave too, and takes it for no crash)
            self.stop_heartbeat()

    def read_presence(self, region: str, store: Store | None = None) -> Presence | None:
        return self._read_record(Presence, self.presence_key(region), region, store)

    def presences(self, keys: list[str] | None = None) -> dict[str, Presence]:
        """Every region's presence record (one listing, or ``keys`` of :meth:`run_keys`); a record under
        another region's key is ignored, as for heartbeats (only its own region writes a key)."""
        return self._read_records(Presence, PRESENCE_DIR, self.presence_key, keys)

    # -- snapshots -------------------------------------------------------------------------------------
    def snapshot_rounds(self, keys: list[str] | None = None) -> list[int]:
        """Rounds with a COMPLETE outer snapshot, ascending (one listing, or ``keys`` of :meth:`run_keys`)."""
        out = []
        for key in self.store.list(f"{self.run_id}/{SNAP_DIR}/") if keys is None else keys:
            parts = key.split("/")
            if len(parts) == 4 and parts[1] == SNAP_DIR and parts[3] == "_complete.json":
                m = _SNAP_RE.match(parts[2])
                if m:
                    out.append(int(m.group(1)))
        return sorted(out)

    def complete_snapshot(self, r: int, manifests: dict[str, Manifest], outer_round: int) -> None:
        body = {
            "round": r,
            "outer_round": outer_round,
            "digests": {k: manifest_digest(m) for k, m in manifests.items()},
            "by": self.region,
            "time": time.time(),
        }
        self.store.put(self.snap_complete_key(r), records.dump(body))

    def read_snapshot(self, r: int, expect: Expect) -> dict[str, Manifest]:
        key = self.snap_complete_key(r)
        raw = self.store.get(key)
        if raw is None:
            raise XRBehind(f"outer snapshot {self.store.describe(key)} is gone", None)
        try:
            done = records.load(raw, "outer snapshot marker", self.store.describe(key))
        except ValueError as e:
            raise XRLayoutError(f"unreadable outer snapshot marker {self.store.describe(key)}: {e}") from e
        out = {}
        for part in SNAP_PARTS:
            m = self.mb.read_manifest(self.snap_tag(r), part)
            where = self.store.describe(self.mb.manifest_key(self.snap_tag(r), part))
            if m is None:
                raise XRBehind(f"outer snapshot part {where} is gone", None)
            expect.check(m, self.run_id, self.snap_tag(r), part, where)
            if manifest_digest(m) != done["digests"].get(part):
                raise XRLayoutError(f"outer snapshot {where} does not match its completion marker")
            out[part] = m
        return out

    def delete_snapshots_before(self, r: int) -> None:
        """Older snapshots go once snapshot ``r`` is complete (marker first: nobody starts reading them)."""
        for old in self.snapshot_rounds():
            if old < r:
                self.store.delete([self.snap_complete_key(old)])
                prefix = f"{self.run_id}/{self.snap_tag(old)}/"
                self.store.delete(self.store.list(prefix))

    # -- housekeeping ------------------------------------------------------------------------------------
    def cleanup(
        self, current: int, keep_rounds: int, shard_count: int, *, need_snapshot: bool = True
    ) -> None:
        """Delete this region's rounds (its claims and objects, the tombstones it wrote, then the commits) older
        than ``keep_rounds`` behind ``current`` and, with ``need_snapshot`` (DiLoCo), covered by a complete
        snapshot: a returning region needs every round after the newest snapshot. This region's own claim
        goes first, so a round it took part in can never be found complete again; another region's manifest
        is that region's to delete."""
        bound = current - keep_rounds
        if bound < 1:
            return
        keys = self.run_keys()  # one listing: the snapshots and this region's rounds
        if need_snapshot:
            snaps = self.snapshot_rounds(keys)
            bound = min(bound, snaps[-1] if snaps else -1)
        doomed: set[int] = set()
        claimed: dict[int, list[str]] = {}  # round -> the other regions with a claim in it
        others = {f"{r}.done": r for r in self.regions if r != self.region}
        for key in keys:
            parts = key.split("/")
            r = parse_tag(parts[1]) if len(parts) >= 3 else None
            if r is not None and r <= bound and parts[2] in (f"{self.region}.done", self.region, COMMIT_NAME):
                doomed.add(r)
            if r is not None and len(parts) == 3 and parts[2] in others:
                claimed.setdefault(r, []).append(others[parts[2]])
        for r in sorted(doomed):
            tag = round_tag(r)
            self.store.delete([self.mb.manifest_key(tag, self.region)])
            self.store.delete([self.mb.shard_key(tag, self.region, i) for i in range(shard_count)])
            self.store.delete(
                [self.claim_key(tag, x) for x in claimed.get(r, []) if self._wrote_tombstone(tag, x)]
            )
            self.store.delete([self.commit_key(tag)])

    def _wrote_tombstone(self, tag: str, region: str) -> bool:
        """Is ``region``'s claim of ``tag`` a tombstone this region wrote?"""
        try:
            got = self.read_claim(tag, region)
        except XRLayoutError:
            return False
        return isinstance(got, Tombstone) and got.closed_by == self.region
