"""Round membership, decided once in the mailbox: commits, presence, outer snapshots. Torch-free. The
records and the closing rule (:func:`~.commit.decide`) are :mod:`.commit`'s, the heartbeat writer
:mod:`.heartbeat`'s; this module reads and writes them in the mailbox.

Keys, next to the rounds of :mod:`.protocol` (region names start with a letter or digit, so the
``_``-prefixed names below never collide with a region's objects)::

    <run>/<tag>/_commit.json                the round's commit: WHO takes part (created once, atomically)
    <run>/_presence/<region>.json           joined / leaving, written by that region only
    <run>/_alive/<region>.json              its liveness heartbeat: a counter, overwritten every heartbeat_s
    <run>/_snap/r<round>/theta/s00000.bin   outer snapshot of a round: theta_outer and momentum (fp32)
    <run>/_snap/r<round>/theta.done         ... their manifests (the protocol's format)
    <run>/_snap/r<round>/_complete.json     ... and the marker that makes it usable, written last
    <run>/_clock/<region>                   empty: written to read the store's clock (:meth:`Membership.store_now`)

**Closing a round.** A round closes when every region's manifest is there, or when at least ``quorum``
regions have arrived and ``grace_s`` has passed since that quorum formed, or at once (with the quorum)
when every region still missing has announced a planned leave or has crashed (below). Whichever region closes first creates the commit with
:meth:`~.store.Store.create` (create-if-absent); a region that loses the race reads the winner's commit
and obeys it. The commit names each member's manifest digest and tokens, so every region, including one
that arrives after the commit, averages exactly the same deltas: the parameters stay bit-identical.

**Crashed regions (heartbeats).** A region that crashes (SIGKILL, a lost node) announces nothing. With
``heartbeat_s`` set, a thread of each region's rank 0 overwrites its heartbeat object with an increasing
counter every ``heartbeat_s``, from the end of its catch-up on. A region waiting in a round reads the
heartbeats of the regions still missing (with their presence records, at most once per check), each with
its age on the STORE's clock (:meth:`~.store.Store.get_aged`), and remembers, on its OWN monotonic clock,
since when it has seen each value: a region whose heartbeat is ``STALE_BEATS`` heartbeat intervals old by
the store, or unchanged for as long of watching (no heartbeat at all counts the same), is treated as gone,
like one that announced its leave, and the round closes once ``quorum`` regions have arrived, without
waiting out ``grace_s`` (reason ``stale``; the commit names the regions). A region that crashed long ago is
so seen gone at the first read. No host's clock is compared with another's: the heartbeat's wall-clock
time is for people only. The observations outlive the round, so after the first round that detects a
crash the next ones close at once. A region that is hung but still beating is waited for up to
``grace_s``, as before.

**Never closing a round twice.** A round's commit is deleted only after a commit ``keep_rounds`` rounds
later exists. So a region that finds no commit for its round but a commit for a later one knows its
round closed long ago without it (:class:`~.errors.XRBehind`: fast-forward), and only a round that was
never committed can be closed.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Collection

from . import records
from .commit import Commit, Member, Presence, decide
from .errors import XRBehind, XRLayoutError, XRNoQuorum
from .heartbeat import STALE_BEATS, Heartbeat, HeartbeatWriter
from .protocol import Expect, Mailbox, Manifest, digest, parse_tag, round_tag

COMMIT_NAME = "_commit.json"
PRESENCE_DIR = "_presence"
SNAP_DIR = "_snap"
SNAP_PARTS = ("theta", "momentum")
ALIVE_DIR = "_alive"
BEHIND_CHECK_S = 10.0  # how often a round's wait lists the run: has it moved past the round (XRBehind)?
CLOCK_DIR = "_clock"
_SNAP_RE = re.compile(r"^r(\d{6,})$")
log = logging.getLogger("sbatch_gen.train")


def manifest_digest(m: Manifest) -> str:
    return digest(m.to_json())


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
    ) -> None:
        self.mb = mailbox
        self.store = mailbox.store
        self.run_id, self.region, self.regions = mailbox.run_id, mailbox.region, mailbox.regions
        self.quorum, self.grace_s = quorum, grace_s
        self.job = job
        self._clock = clock
        self.heartbeat_s = heartbeat_s  # None: other regions' heartbeats are not read, none is written
        self._writer: HeartbeatWriter | None = None
        # region -> (heartbeat value last seen or None, when it was first seen on self._clock); kept across rounds
        self._watch: dict[str, tuple[tuple[str, int] | None, float]] = {}
        self.behind_check_s = BEHIND_CHECK_S
        self.test_hook: Callable[[str, str], None] | None = None  # (event, tag): tests force races

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

    def latest_commit(self) -> int | None:
        rounds = self.committed_rounds()
        return rounds[-1] if rounds else None

    def _try_close(
        self,
        tag: str,
        step: int,
        got: dict[str, Manifest],
        reason: str,
        waited: float,
        stale: Collection[str] = frozenset(),
    ) -> Commit:
        members = {r: Member(manifest_digest(got[r]), int(got[r].tokens)) for r in self.regions if r in got}
        absent = [r for r in self.regions if r not in got]
        c = Commit(
            self.run_id,
            tag,
            step,
            members,
            self.region,
            reason,
            round(waited, 3),
            absent,
            time.time(),
            stale=[r for r in absent if r in stale],
        )
        if self.test_hook:
            self.test_hook("before_create", tag)
        if self.store.create(self.commit_key(tag), c.to_json()):
            return c
        won = self.read_commit(tag)  # another region closed it first: obey
        if won is None:
            raise XRLayoutError(
                f"round {tag}: the commit at {self.store.describe(self.commit_key(tag))} exists "
                "for a create but not for a read: the store is not consistent"
            )
        return won

    def wait_commit(
        self, tag: str, expect: Expect, *, step: int | None = None, started: float | None = None
    ) -> tuple[Commit, dict[str, Manifest]]:
        """Poll until round ``tag`` is committed (by this region or another); return the commit and the
        manifests of the regions this region saw (verified). Raises :class:`XRNoQuorum` after
        ``timeout_s`` without a quorum, :class:`XRBehind` if the run committed later rounds and ``tag``'s
        commit is gone. In slices: :meth:`round_wait`."""
        got = self.round_wait(tag, expect, step=step, started=started).run()
        assert got is not None  # None only when waiting in slices
        return got

    def round_wait(
        self, tag: str, expect: Expect, *, step: int | None = None, started: float | None = None
    ) -> RoundWait:
        """The wait of :meth:`wait_commit`, to run in slices (``started``: when the round's wait began on
        this region's clock; default now)."""
        return RoundWait(self, tag, expect, step, started)

    def _read_manifests(self, tag: str, expect: Expect, got: dict[str, Manifest]) -> None:
        """Add to ``got`` the manifests of round ``tag`` published since the last look (verified)."""
        mb = self.mb
        for r in self.regions:
            if r in got:
                continue
            m = mb.read_manifest(tag, r)
            if m is not None:
                expect.check(m, self.run_id, tag, r, self.store.describe(mb.manifest_key(tag, r)))
                got[r] = m

    def _no_quorum(self, tag: str, step: int | None, got: dict[str, Manifest]) -> XRNoQuorum:
        """The error of a wait for round ``tag`` that timed out without a quorum, naming the missing."""
        missing = [r for r in self.regions if r not in got]
        at = f" (step {step})" if step is not None else ""
        return XRNoQuorum(
            f"round {tag}{at}: no quorum after {self.mb.timeout_s:g} s: {len(got)} of {len(self.regions)} "
            f"regions published, {self.quorum} needed (min_regions); missing: {', '.join(missing)}",
            missing,
        )

    def _absentees(self, got: dict[str, Manifest]) -> tuple[set[str], set[str], float]:
        """rank 0, waiting in a round: read the presence record (and, with heartbeats, the heartbeat) of every
        region still missing. Returns (regions that announced a leave, regions whose heartbeat is stale, when
        the next watched one would turn stale on this region's clock: inf if none)."""
        leaving: set[str] = set()
        stale: set[str] = set()
        due = math.inf
        for r in self.regions:
            if r in got or r == self.region:
                continue
            p = self.read_presence(r)
            if p is not None and p.state == "leaving":
                leaving.add(r)
                continue
            if self.heartbeat_s is None:
                continue
            before = self._clock()
            hb, age = self.read_heartbeat_aged(r)
            after = self._clock()
            quiet, limit = self._quiet_for(r, hb, before, after)
            quiet = max(quiet, age or 0.0)
            if quiet >= limit:
                stale.add(r)
            else:
                due = min(due, after + limit - quiet)
        return leaving, stale, due

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

    def read_heartbeat_aged(self, region: str) -> tuple[Heartbeat | None, float | None]:
        """``region``'s heartbeat and the seconds since it was written, on the store's clock
        (:meth:`~.store.Store.get_aged`; None: missing, unreadable, or no age told)."""
        key = self.alive_key(region)
        got = self.store.get_aged(key)
        if got is None:
            return None, None
        hb = Heartbeat.from_json(got[0], self.store.describe(key))
        return (hb, got[1]) if hb is not None and hb.region == region else (None, None)

    def heartbeats(self, keys: list[str] | None = None) -> dict[str, Heartbeat]:
        """Every region's heartbeat in the mailbox (one listing, or ``keys`` of :meth:`run_keys`)."""
        return self._read_records(Heartbeat, ALIVE_DIR, self.alive_key, keys)

    # -- per-region records (presence, heartbeat): <run>/<dir>/<region>.json, written by that region only --
    def _read_record(self, cls, key: str, region: str):
        raw = self.store.get(key)
        rec = cls.from_json(raw, self.store.describe(key)) if raw is not None else None
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

    def stop_heartbeat(self) -> None:
        """Stop beating (a planned leave, the end, close); the others then treat this region as gone after
        STALE_BEATS intervals unless its presence says it left."""
        if self._writer is not None:
            self._writer.stop()
            if self._writer.store is not self.store:
                self._writer.store.close()
            self._writer = None

    @property
    def beating(self) -> bool:
        return self._writer is not None and self._writer.alive

    def _check_not_behind(self, tag: str) -> None:
        r = parse_tag(tag)
        if r is None:
            return
        latest = self.latest_commit()
        if latest is not None and latest > r and self.read_commit(tag) is None:
            raise XRBehind(
                f"round {tag}: the run has committed up to {round_tag(latest)} and {tag} is no longer "
                "in the mailbox: this region fast-forwards",
                latest,
            )

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
    def announce(self, state: str, r: int, step: int) -> None:
        if state == "leaving":
            self.stop_heartbeat()  # a region that left beats no more (its leave is what the others read)
        p = Presence(self.region, state, r, step, time.time(), self.job)
        self.store.put(self.presence_key(self.region), p.to_json())

    def read_presence(self, region: str) -> Presence | None:
        return self._read_record(Presence, self.presence_key(region), region)

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
        """Delete this region's rounds (and their commits) older than ``keep_rounds`` behind ``current`` and,
        with ``need_snapshot`` (DiLoCo), covered by a complete snapshot: a returning region needs every
        round after the newest snapshot."""
        bound = current - keep_rounds
        if bound < 1:
            return
        keys = self.run_keys()  # one listing: the snapshots and this region's rounds
        if need_snapshot:
            snaps = self.snapshot_rounds(keys)
            bound = min(bound, snaps[-1] if snaps else -1)
        doomed: set[int] = set()
        for key in keys:
            parts = key.split("/")
            r = parse_tag(parts[1]) if len(parts) >= 3 else None
            if r is not None and r <= bound and parts[2] in (f"{self.region}.done", self.region, COMMIT_NAME):
                doomed.add(r)
        for r in sorted(doomed):
            tag = round_tag(r)
            self.store.delete([self.mb.manifest_key(tag, self.region)])
            self.store.delete([self.mb.shard_key(tag, self.region, i) for i in range(shard_count)])
            self.store.delete([self.commit_key(tag)])


class RoundWait:
    """One wait of a region's rank 0 for round ``tag``'s commit (:meth:`Membership.round_wait`), run in as
    many slices as its caller needs (the exchange reports to its other ranks between slices, and a round
    in the background checks between them whether it was called off). What the wait has learnt carries
    over from one slice to the next, as in one uninterrupted wait: the manifests seen, the absentees, the
    poll backoff, the grace clock and the behind timer (with slices shorter than ``behind_check_s`` a
    timer started again each slice would never fire, and a region behind the run without a quorum would
    wait out ``timeout_s`` instead of fast-forwarding)."""

    def __init__(
        self, ms: Membership, tag: str, expect: Expect, step: int | None, started: float | None
    ) -> None:
        self.ms, self.tag, self.expect, self.step = ms, tag, expect, step
        now = ms._clock()
        self.t0 = now if started is None else started
        self.got: dict[str, Manifest] = {}
        self.delay = ms.mb.poll_min_s
        self.quorum_since: float | None = None
        self.leaving: set[str] = set()
        self.stale: set[str] = set()
        self.stale_due = (
            math.inf
        )  # when the next missing region's heartbeat would have been quiet long enough
        self.next_check = (
            now  # presence and heartbeats of the missing regions: a few reads, not on every poll
        )
        self.next_behind = (
            now + ms.behind_check_s
        )  # has the run moved past this round? (a listing of the run)

    def run(self, slice_s: float | None = None) -> tuple[Commit, dict[str, Manifest]] | None:
        """Wait on: (the commit, the manifests seen) once the round closed, or None after ``slice_s``
        (None: until it closes). Raises as :meth:`Membership.wait_commit`."""
        ms, mb, tag = self.ms, self.ms.mb, self.tag
        tick = min(1.0, max(ms.grace_s / 4, 0.05))
        now0 = ms._clock()
        while True:
            c = ms.read_commit(tag)
            if c is not None:
                return c, self.got
            ms._read_manifests(tag, self.expect, self.got)
            now = ms._clock()
            if now >= min(self.next_check, self.stale_due):
                self.leaving, self.stale, self.stale_due = ms._absentees(self.got)
                self.next_check = now + tick
            if now >= self.next_behind:
                ms._check_not_behind(tag)
                self.next_behind = now + ms.behind_check_s
            reason, self.quorum_since = decide(
                ms.regions, self.got, self.leaving, ms.quorum, ms.grace_s, now, self.quorum_since, self.stale
            )
            if reason is not None:
                ms._check_not_behind(tag)
                step = self.step if self.step is not None else -1
                return ms._try_close(tag, step, self.got, reason, now - self.t0, self.stale), self.got
            if now - self.t0 >= mb.timeout_s:
                raise ms._no_quorum(tag, self.step, self.got)
            if slice_s is not None and now - now0 >= slice_s:
                return None
            if (
                self.quorum_since is not None
            ):  # grace running out, or a missing region's heartbeat going stale
                wake = min(ms.grace_s - (now - self.quorum_since), self.stale_due - now)
            else:
                wake = mb.timeout_s - (now - self.t0)
            time.sleep(max(0.0, min(self.delay, wake + 1e-3)))
            self.delay = min(mb.poll_max_s, self.delay * 1.5)
