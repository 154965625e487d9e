"""Round membership, decided once in the mailbox: commits, presence, outer snapshots. Torch-free.

Keys, next to the rounds of :mod:`.protocol` (region names start with a letter or digit, so the
``_``-prefixed names below never collide with a region's objects)::

    <run>/<tag>/_commit.json                the round's commit: WHO takes part (created once, atomically)
    <run>/_presence/<region>.json           joined / leaving, written by that region only
    <run>/_snap/r<round>/theta/s00000.bin   outer snapshot of a round: theta_outer and momentum (fp32)
    <run>/_snap/r<round>/theta.done         ... their manifests (the protocol's format)
    <run>/_snap/r<round>/_complete.json     ... and the marker that makes it usable, written last

**Closing a round.** A round closes when every region's manifest is there, or when at least ``quorum``
regions have arrived and ``grace_s`` has passed since that quorum formed, or at once when every region
still missing has announced a planned leave. Whichever region closes first creates the commit with
:meth:`~.store.Store.create` (create-if-absent); a region that loses the race reads the winner's commit
and obeys it. The commit names each member's manifest digest and tokens, so every region, including one
that arrives after the commit, averages exactly the same deltas: the parameters stay bit-identical.

**Never closing a round twice.** A round's commit is deleted only after a commit ``keep_rounds`` rounds
later exists. So a region that finds no commit for its round but a commit for a later one knows its
round closed long ago without it (:class:`~.errors.XRBehind`: fast-forward), and only a round that was
never committed can be closed.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from .errors import XRBehind, XRLayoutError, XRNoQuorum
from .protocol import Expect, Mailbox, Manifest, digest, parse_tag, round_tag

COMMIT_FORMAT = 1
COMMIT_NAME = "_commit.json"
PRESENCE_DIR = "_presence"
SNAP_DIR = "_snap"
SNAP_PARTS = ("theta", "momentum")
_SNAP_RE = re.compile(r"^r(\d{6,})$")


@dataclass
class Member:
    digest: str  # checksum of the member's manifest bytes
    tokens: int


@dataclass
class Commit:
    run_id: str
    tag: str
    step: int
    members: dict[str, Member]  # region -> its manifest's digest and tokens
    closed_by: str
    reason: str  # "all": every region arrived; "leave": the missing ones announced a leave; "grace"
    waited_s: float  # how long the closing region waited for peers in this round
    absent: list[str] = field(default_factory=list)  # regions not in the commit
    time: float = 0.0
    format: int = COMMIT_FORMAT

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Commit:
        try:
            d = json.loads(raw)
            if d.get("format") != COMMIT_FORMAT:
                raise ValueError(f"format {d.get('format')!r}, this version reads {COMMIT_FORMAT}")
            d["members"] = {r: Member(**m) for r, m in d["members"].items()}
            return cls(**d)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise XRLayoutError(f"unreadable round commit {where}: {e}") from e

    @property
    def round(self) -> int | None:
        return parse_tag(self.tag)


@dataclass
class Presence:
    region: str
    state: str  # "joined" | "leaving"
    round: int
    step: int
    time: float
    job: str = ""

    @classmethod
    def from_json(cls, raw: bytes) -> Presence | None:
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError):
            return None


def manifest_digest(m: Manifest) -> str:
    return digest(m.to_json())


def decide(regions: Iterable[str], arrived: Iterable[str], leaving: Iterable[str], quorum: int, grace_s: float,
           now: float, quorum_since: float | None) -> tuple[str | None, float | None]:
    """The closing rule, as a pure function: ``(reason or None, quorum_since)``. ``reason`` is "all",
    "leave" or "grace" when the round may close now."""
    regions, arrived, leaving = list(regions), set(arrived), set(leaving)
    if arrived >= set(regions):
        return "all", quorum_since
    if len(arrived) < quorum:
        return None, None
    if quorum_since is None:
        quorum_since = now
    if arrived | leaving >= set(regions):
        return "leave", quorum_since
    if now - quorum_since >= grace_s:
        return "grace", quorum_since
    return None, quorum_since


class Membership:
    """Commits, presence and snapshots of one run, seen from one region (its rank 0)."""

    def __init__(self, mailbox: Mailbox, quorum: int, grace_s: float, *, job: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mb = mailbox
        self.store = mailbox.store
        self.run_id, self.region, self.regions = mailbox.run_id, mailbox.region, mailbox.regions
        self.quorum, self.grace_s = quorum, grace_s
        self.job = job
        self._clock = clock
        self.test_hook: Callable[[str, str], None] | None = None  # (event, tag): tests force races

    # -- keys ----------------------------------------------------------------------------------------
    def commit_key(self, tag: str) -> str:
        return f"{self.run_id}/{tag}/{COMMIT_NAME}"

    def presence_key(self, region: str) -> str:
        return f"{self.run_id}/{PRESENCE_DIR}/{region}.json"

    @staticmethod
    def snap_tag(r: int) -> str:
        return f"{SNAP_DIR}/{round_tag(r)}"

    def snap_complete_key(self, r: int) -> str:
        return f"{self.run_id}/{self.snap_tag(r)}/_complete.json"

    # -- commits ---------------------------------------------------------------------------------------
    def read_commit(self, tag: str) -> Commit | None:
        key = self.commit_key(tag)
        raw = self.store.get(key)
        if raw is None:
            return None
        c = Commit.from_json(raw, self.store.describe(key))
        if c.run_id != self.run_id or c.tag != tag:
            raise XRLayoutError(f"round commit {self.store.describe(key)} names run {c.run_id!r} round {c.tag!r}")
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

    def _try_close(self, tag: str, step: int, got: dict[str, Manifest], reason: str, waited: float) -> Commit:
        members = {r: Member(manifest_digest(got[r]), int(got[r].tokens)) for r in self.regions if r in got}
        c = Commit(self.run_id, tag, step, members, self.region, reason, round(waited, 3),
                   [r for r in self.regions if r not in got], time.time())
        if self.test_hook:
            self.test_hook("before_create", tag)
        if self.store.create(self.commit_key(tag), c.to_json()):
            return c
        won = self.read_commit(tag)  # another region closed it first: obey
        if won is None:
            raise XRLayoutError(f"round {tag}: the commit at {self.store.describe(self.commit_key(tag))} exists "
                                "for a create but not for a read: the store is not consistent")
        return won

    def wait_commit(self, tag: str, expect: Expect, *, step: int | None = None, started: float | None = None,
                    slice_s: float | None = None) -> tuple[Commit, dict[str, Manifest]] | None:
        """Poll until round ``tag`` is committed (by this region or another); return the commit and the
        manifests of the regions this region saw (verified). Raises :class:`XRNoQuorum` after
        ``timeout_s`` without a quorum, :class:`XRBehind` if the run committed later rounds and ``tag``'s
        commit is gone. With ``slice_s``, returns ``None`` after that long (the caller keeps its other
        ranks informed)."""
        mb = self.mb
        got: dict[str, Manifest] = {}
        now0 = self._clock()
        t0 = now0 if started is None else started
        delay = mb.poll_min_s
        quorum_since: float | None = None
        leaving: set[str] = set()
        next_presence = now0  # presence records: a listing, not on every poll
        next_behind = now0 + 10.0  # has the run moved past this round? (a listing of the whole run)
        while True:
            c = self.read_commit(tag)
            if c is not None:
                return c, got
            for r in self.regions:
                if r in got:
                    continue
                m = mb.read_manifest(tag, r)
                if m is not None:
                    expect.check(m, self.run_id, tag, r, self.store.describe(mb.manifest_key(tag, r)))
                    got[r] = m
            now = self._clock()
            if now >= next_presence:
                leaving = {r for r, p in self.presences().items() if p.state == "leaving" and r != self.region}
                next_presence = now + min(1.0, max(self.grace_s / 4, 0.05))
            if now >= next_behind:
                self._check_not_behind(tag)
                next_behind = now + 10.0
            reason, quorum_since = decide(self.regions, got, leaving, self.quorum, self.grace_s, now, quorum_since)
            if reason is not None:
                self._check_not_behind(tag)
                return self._try_close(tag, step if step is not None else -1, got, reason, now - t0), got
            if now - t0 >= mb.timeout_s:
                missing = [r for r in self.regions if r not in got]
                at = f" (step {step})" if step is not None else ""
                raise XRNoQuorum(
                    f"round {tag}{at}: no quorum after {mb.timeout_s:g} s: {len(got)} of {len(self.regions)} "
                    f"regions published, {self.quorum} needed (min_regions); missing: {', '.join(missing)}",
                    missing,
                )
            if slice_s is not None and now - now0 >= slice_s:
                return None
            if quorum_since is not None:
                wake = self.grace_s - (now - quorum_since)
            else:
                wake = mb.timeout_s - (now - t0)
            time.sleep(max(0.0, min(delay, wake + 1e-3)))
            delay = min(mb.poll_max_s, delay * 1.5)

    def _check_not_behind(self, tag: str) -> None:
        r = parse_tag(tag)
        if r is None:
            return
        latest = self.latest_commit()
        if latest is not None and latest > r and self.read_commit(tag) is None:
            raise XRBehind(f"round {tag}: the run has committed up to {round_tag(latest)} and {tag} is no longer "
                           "in the mailbox: this region fast-forwards", latest)

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
                raise XRLayoutError(f"round {c.tag}: manifest of region {r!r} at {where} is not the one the "
                                    "round committed (digest differs)")
            out[r] = m
        return out

    # -- presence --------------------------------------------------------------------------------------
    def announce(self, state: str, r: int, step: int) -> None:
        p = Presence(self.region, state, r, step, time.time(), self.job)
        self.store.put(self.presence_key(self.region), json.dumps(asdict(p)).encode())

    def presences(self, keys: list[str] | None = None) -> dict[str, Presence]:
        prefix = f"{self.run_id}/{PRESENCE_DIR}/"
        out = {}
        for key in self.store.list(prefix) if keys is None else [k for k in keys if k.startswith(prefix)]:
            raw = self.store.get(key)
            p = Presence.from_json(raw) if raw is not None else None
            if p is not None and p.region in self.regions:
                out[p.region] = p
        return out

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
        body = {"round": r, "outer_round": outer_round, "digests": {k: manifest_digest(m) for k, m in manifests.items()},
                "by": self.region, "time": time.time()}
        self.store.put(self.snap_complete_key(r), json.dumps(body, sort_keys=True).encode())

    def read_snapshot(self, r: int, expect: Expect) -> dict[str, Manifest]:
        key = self.snap_complete_key(r)
        raw = self.store.get(key)
        if raw is None:
            raise XRBehind(f"outer snapshot {self.store.describe(key)} is gone", None)
        done = json.loads(raw)
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
    def cleanup(self, current: int, keep_rounds: int, shard_count: int, *, need_snapshot: bool = True) -> None:
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
