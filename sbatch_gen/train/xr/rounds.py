"""One round of the outer sync, seen from one region, top to bottom: :func:`run_round` (a DiLoCo delta, a
Streaming DiLoCo fragment, a grad-mode gradient). Its phases, each one the fewest sequential requests to the
store it can be:

1. *publish*: the region's node leaders encode and upload its objects, all at once
   (:meth:`.exchange.Exchange.upload`). Skipped when this region published the round before (a requeued
   job re-entering it keeps what it published) or the round closed without it (late); rank 0 reads its own
   claim first only where either may be (:meth:`.membership.Membership.must_read_own`), never in the
   steady state.
2. *decide the members* (rank 0, :class:`RoundWait`): its manifest goes to its claim key
   ``<run>/<tag>/<region>.done`` while the other regions' claim keys are read, at once; then one request
   per poll until every region's key holds its manifest or a closer's tombstone. The members are the
   manifests, the same for every region (:mod:`.membership` says why).
3. *fetch and reduce*: each node leader reads its shards of every member's objects, all at once, while
   rank 0 records the round's commit, and averages them in the order of ``regions``
   (:meth:`.exchange.Exchange.download_and_average`): bit-identical on every region.
4. *broadcast*: with several node leaders, each averaged shard goes from its owner to the others.

Rank 0 decides for the region and waits in slices, so that the other ranks hear of its progress or failure
(and a round in the background can be called off between slices); the wait itself carries over from slice
to slice. Torch-free itself: the tensors stay in the exchange.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from .commit import Commit, Member, Tombstone, decide
from .errors import XRBehind, XRCancelled, XRSettingsError
from .membership import Claim, Membership, manifest_digest
from .protocol import Expect, Mailbox, Manifest, parse_tag, round_tag

if TYPE_CHECKING:
    from .exchange import Exchange

T = TypeVar("T")
WAIT_SLICE_S = 30.0  # rank 0 reports to the other ranks at least this often while it waits for peers
BACKGROUND_SLICE_S = 0.5  # ... and this often in a background round, which a stop may call off


@dataclass
class RoundResult:
    commit: Commit
    members: list[str]  # in the order of `regions`
    late: bool  # this region's payload is not in the commit
    reused: bool  # this region had published the round before (re-entered it)
    bytes_up: int = 0
    bytes_down: int = 0
    tokens: int = 0
    times: dict = field(default_factory=dict)
    retries: int = 0  # object-store requests this region retried during the round (all node leaders)


def run_round(
    ex: Exchange,
    tag: str,
    kind: str,
    step: int,
    src: Any,
    out: Any,
    tokens: int,
    *,
    pre: dict | None = None,
    cancel: threading.Event | None = None,
) -> RoundResult:
    """Round ``tag`` through ``ex``, phases 1-4 (collective: every rank of the region). ``out`` (a tensor)
    receives the members' weighted average on every owner (``src`` and ``out`` are None on the other ranks).
    ``pre``: this rank's shards, encoded already (:meth:`.exchange.Exchange.encode`). In the background
    (:meth:`.exchange.Exchange.in_background`) phase 4 is left to the caller, and ``cancel`` (set on every
    leader) ends the wait with :class:`~.errors.XRCancelled` (after the claim: a publish completes)."""
    region, group = ex.xr.region, ex.group
    expect = ex.expect(kind)
    retries0 = ex.store_retries()
    t0 = ex.now()
    # 1. publish: this region's objects (the claim, its manifest, goes with the wait's first look)
    own, decided = group.on_rank(lambda: _own_claim(ex.ms(), tag, expect))
    encoded: dict = {}
    bytes_up = 0
    mine = None
    if own is None and decided is None:
        said = {"settings": ex.xr.round_settings()}  # what this region shares with the others: they check it
        mine, encoded, bytes_up = ex.upload(
            tag, region, kind, step, src, tokens, pre=pre, write=False, extra_fn=lambda shards: said
        )
    t1 = ex.now()
    # 2. decide the members: every region's claim there, its manifest or a tombstone
    waits: list[RoundWait] = []  # rank 0's, made at its first slice and resumed by the next ones
    slice_s = BACKGROUND_SLICE_S if ex.background else WAIT_SLICE_S
    got = None if decided is None else (*decided, True)
    while got is None:
        got = group.on_rank(
            lambda: _wait_slice(ex.ms(), tag, expect, step, waits, slice_s, cancel, mine, own)
        )
    commit, manifests, adopted = got
    t2 = ex.now()
    members = [r for r in ex.xr.regions if r in commit.members]
    late = region not in commit.members
    if ex.membership is not None:
        ex.membership.late_last = late
    reused = isinstance(own, Manifest)
    local = {} if (reused or late) else encoded  # this region's own bytes, where it has them
    # 3. fetch and reduce, the commit's record written meanwhile (not where a commit decided: it is there)
    record = None if adopted else partial(_record, ex, commit)
    bytes_down, t_dl = ex.download_and_average(tag, expect, manifests, members, local, out, meanwhile=record)
    t3 = ex.now()
    # 4. broadcast among the node leaders
    if not ex.background:
        ex.broadcast_slices(expect.plan, out)
    t4 = ex.now()
    dl = min(t_dl, t3 - t2)
    bcast = 0.0 if ex.sharded else t4 - t3  # (sharded: nothing is broadcast)
    retries = ex.store_retries() - retries0
    if group.on:
        retries = sum(group.all_gather(retries))
    return RoundResult(
        commit,
        members,
        late,
        reused,
        bytes_up,
        bytes_down,
        sum(commit.members[r].tokens for r in members),
        dict(
            upload_s=t1 - t0,
            wait_s=t2 - t1,
            download_s=dl,
            reduce_s=(t4 - t2) - dl - bcast,
            broadcast_s=bcast,
            t_start=t0,
            t_end=t4,
        ),
        retries,
    )


def _own_claim(
    ms: Membership, tag: str, expect: Expect
) -> tuple[Claim | None, tuple[Commit, dict[str, Manifest]] | None]:
    """rank 0: (this region's claim of round ``tag``, the round's outcome) where it may have them already,
    without a request in the steady state (:meth:`.membership.Membership.must_read_own`). The claim: its
    manifest (a requeued job re-entering a round it published), checked against what this round expects, or
    a tombstone (a round closed without it). The outcome, where the round has a commit: the commit and its
    members' manifests. A commit decides a round this region re-enters: a version before claims decided
    rounds by their commit alone and wrote no tombstones, so a region it closed out may find its own key
    free."""
    r = parse_tag(tag)
    if not ms.must_read_own(r if r is not None else -1):
        return None, None
    commit = ms.mb.pool.submit(ms.read_commit, tag)
    own = ms.read_claim(tag, ms.region, expect)
    c = commit.result()
    if c is None:
        return own, None
    return own, (c, ms.member_manifests(c, expect, {ms.region: own} if isinstance(own, Manifest) else {}))


def _wait_slice(
    ms: Membership,
    tag: str,
    expect: Expect,
    step: int,
    waits: list[RoundWait],
    slice_s: float,
    cancel: threading.Event | None,
    mine: Manifest | None,
    own: Claim | None,
) -> tuple[Commit, dict[str, Manifest], bool] | None:
    """rank 0: one slice of the round's wait (``waits``: empty at the first slice, then the wait it
    started): (the commit, the members' manifests, whether the commit was found in the mailbox) once the
    round is decided, else None."""
    if cancel is not None and cancel.is_set() and waits:  # (not before the claim: the publish completes)
        raise XRCancelled(f"round {tag}: called off while waiting for the other regions")
    if not waits:
        waits.append(round_wait(ms, tag, expect, step=step, mine=mine, own=own))
    try:
        got = waits[0].run(slice_s)
    except XRSettingsError as e:
        ms.refuse(tag, step, str(e))
        raise
    return None if got is None else (got[0], got[1], waits[0].adopted)


def _record(ex: Exchange, commit: Commit) -> None:
    ex.ms().record_commit(commit)


def wait_commit(
    ms: Membership,
    tag: str,
    expect: Expect,
    *,
    step: int | None = None,
    started: float | None = None,
    mine: Manifest | None = None,
    own: Claim | None = None,
) -> tuple[Commit, dict[str, Manifest]]:
    """Phase 2 alone, at once (rank 0): claim round ``tag`` with ``mine`` (None: nothing to publish, or
    ``own`` is this region's claim already), wait until every region has a claim, record the commit; return
    it and the members' manifests (verified). Raises :class:`~.errors.XRNoQuorum` after ``timeout_s``
    without a quorum, :class:`~.errors.XRBehind` if the run moved past ``tag`` and cleaned it up. In
    slices: :func:`round_wait`."""
    wait = round_wait(ms, tag, expect, step=step, started=started, mine=mine, own=own)
    try:
        got = wait.run()
    except XRSettingsError as e:
        ms.refuse(tag, step, str(e))
        raise
    assert got is not None  # None only when waiting in slices
    if not wait.adopted:
        ms.record_commit(got[0])
    return got


def round_wait(
    ms: Membership,
    tag: str,
    expect: Expect,
    *,
    step: int | None = None,
    started: float | None = None,
    mine: Manifest | None = None,
    own: Claim | None = None,
) -> RoundWait:
    """The wait of :func:`wait_commit` without the commit's record, to run in slices (``started``: when the
    round's wait began on this region's clock; default now)."""
    return RoundWait(ms, tag, expect, step, started, mine, own)


class RoundWait:
    """One wait of a region's rank 0 for round ``tag`` to be decided (:func:`round_wait`), run in
    as many slices as its caller needs (the exchange reports to its other ranks between slices, and a round
    in the background checks between them whether it was called off).

    A round is decided once every region has a claim at its key ``<run>/<tag>/<region>.done``: its manifest,
    or a tombstone written there by a region that closed the round without it. Manifests and tombstones are
    never overwritten (elastic: create-only writes; strict: no tombstones, each region writes only its own
    key), so the set, once complete, is the same for every region that reads it: the members are the
    regions whose claim is a manifest. The first look writes this region's claim and reads the other
    regions' keys at once (one round trip); each later poll is one request: a GET of the one key still
    missing, else a listing of the round's own prefix (its objects only, not its regions' shards), then
    the new claims read together. Polls start at the round trip's scale and back off x1.5 to ``poll_max_s``.

    What the wait has learnt carries over from one slice to the next, as in one uninterrupted wait: the
    claims seen, the absentees, the poll backoff, the grace clock and the behind timer (with slices shorter
    than ``behind_check_s`` a timer started again each slice would never fire, and a region behind the run
    without a quorum would wait out ``timeout_s`` instead of fast-forwarding)."""

    def __init__(
        self,
        ms: Membership,
        tag: str,
        expect: Expect,
        step: int | None,
        started: float | None,
        mine: Manifest | None,
        own: Claim | None,
    ) -> None:
        self.ms, self.tag, self.expect, self.step = ms, tag, expect, step
        now = ms._clock()
        self.t0 = now if started is None else started
        self.claims: dict[str, Claim] = {} if own is None else {ms.region: own}
        self.mine = mine  # this region's manifest, claimed at the first look
        self.first = True
        self.closer = ""  # whose claim completed the set, as seen here ("all" rounds)
        self.result: tuple[Commit, dict[str, Manifest]] | None = None
        self.adopted = False  # the result is a commit found in the mailbox (recorded already)
        self.delay = ms.mb.poll_min_s
        self.quorum_since: float | None = None
        self.leaving: set[str] = set()
        self.stale: set[str] = set()
        # when the next missing region's heartbeat would have been quiet long enough
        self.stale_due = math.inf
        # presence and heartbeats of the missing regions: a few reads, not every poll
        self.next_check = now
        # has the run moved past this round? (a listing of the run)
        self.next_behind = now + ms.behind_check_s
        # the same check before closing the round without someone (then every tick)
        self.next_guard = now
        # the presence of the regions waited for that this process has not met yet (refused the settings?)
        self.next_unmet = now

    def manifests(self) -> dict[str, Manifest]:
        return {r: c for r, c in self.claims.items() if isinstance(c, Manifest)}

    def run(self, slice_s: float | None = None) -> tuple[Commit, dict[str, Manifest]] | None:
        """Wait on: (the commit, the members' manifests) once the round is decided, or None after ``slice_s``
        (None: until it is). Raises as :func:`wait_commit`."""
        ms, mb = self.ms, self.ms.mb
        tick = min(1.0, max(ms.grace_s / 4, 0.05))
        now0 = ms._clock()
        while self.result is None:
            self._look(tick)
            if self._decided():
                break
            now = ms._clock()
            if now >= self.next_behind:
                self.next_behind = now + ms.behind_check_s
                if self._guarded():
                    break
            got = self.manifests()
            reason, self.quorum_since = decide(
                ms.regions, got, self.leaving, ms.quorum, ms.grace_s, now, self.quorum_since, self.stale
            )
            tombs = [c for c in self.claims.values() if isinstance(c, Tombstone)]
            if reason is None and tombs and len(got) >= ms.quorum:
                reason = tombs[0].reason  # another region is closing it without someone: finish that
            if (reason is not None or tombs) and now >= self.next_guard:
                # about to close it without someone, or someone did (or it was cleaned up behind us)
                self.next_guard = now + tick
                if self._guarded():
                    break
                if reason is not None:
                    self._close(reason, now)
                    if self._decided():
                        break
            if now - self.t0 >= mb.timeout_s:
                raise ms._no_quorum(self.tag, self.step, got)
            if slice_s is not None and now - now0 >= slice_s:
                return None
            if self.quorum_since is not None:  # grace running out, or a missing heartbeat going stale
                wake = min(ms.grace_s - (now - self.quorum_since), self.stale_due - now)
            else:
                wake = mb.timeout_s - (now - self.t0)
            time.sleep(max(0.0, min(self.delay, wake + 1e-3)))
            self.delay = min(mb.poll_max_s, self.delay * 1.5)
        return self.result

    def _look(self, tick: float) -> None:
        """One look at the round: this region's claim written (the first look), the missing claims read, and
        (now and then, once a quorum is there) the missing regions' presence and heartbeats; all at once."""
        ms, tag, region = self.ms, self.tag, self.ms.region
        missing = [r for r in ms.regions if r not in self.claims and not (r == region and self.mine)]
        tasks: list[Callable[[], tuple]] = []
        if self.mine is not None:
            mine = self.mine
            tasks.append(partial(_tagged, "mine", region, ms.claim, mine))
        listing = not self.first and len(missing) > 1
        if listing:
            tasks.append(partial(_tagged, "list", "", ms.store.children, f"{ms.run_id}/{tag}/"))
        else:
            tasks += [partial(_tagged, "claim", r, ms.read_claim, tag, r, self.expect) for r in missing]
        now = ms._clock()
        # the missing regions' presence and heartbeats; at the first look only of those absent from this
        # region's last round (a region away is likely still away; the others may well all be there) and of
        # those the peer watch found gone meanwhile (a crash while this region trained)
        gone = ms.watched_gone() if self.first else set()
        absent = [r for r in missing if r != region and (not self.first or r in ms.absent_last or r in gone)]
        judge = (
            not ms.strict
            and bool(absent)
            and len(self.manifests()) + (self.mine is not None) >= ms.quorum
            and now >= min(self.next_check, self.stale_due)
        )
        if judge:
            self.next_check = now if self.first else now + tick
            tasks += [partial(_tagged, "presence", r, ms.read_presence, r) for r in absent]
            if ms.heartbeat_s is not None:
                tasks += [partial(_tagged, "beat", r, ms._judge_heartbeat, r) for r in absent]
        # a region this process has not met may have refused the run's settings (at its theta0 already):
        # its presence says so, read once a tick until its first claim is read here (with the presence
        # reads above where they run: one read of each)
        unmet = [r for r in missing if r != region and r not in ms.met and not (judge and r in absent)]
        if unmet and not self.first and now >= self.next_unmet:
            self.next_unmet = now + tick
            tasks += [partial(_tagged, "presence", r, ms.read_presence, r) for r in unmet]
        t0 = time.perf_counter()
        results = _all(ms.mb, tasks)
        rtt = time.perf_counter() - t0
        if self.first:  # polls start at the scale of a round trip, not below
            self.delay = max(self.delay, rtt)
        self.first = False
        seen: list[str] = []
        names: list[str] = []
        leaving: set[str] = set()
        dues: dict[str, float] = {}
        for what, r, got in results:
            if what == "mine":
                self.mine = None
                self.claims[r] = got
                seen.append(r)
            elif what == "claim" and got is not None:
                self.claims[r] = got
                seen.append(r)
            elif what == "list":
                names = got
            elif what == "presence" and got is not None and got.state == "leaving":
                leaving.add(r)
            elif what == "presence" and got is not None and got.state == "refused" and r not in ms.met:
                why = got.why or "its settings differ"
                raise XRSettingsError(f"round {tag}: region {r!r} refused to take part: {why}")
            elif what == "beat":
                dues[r] = got
        if listing:
            there = {k.rsplit("/", 1)[-1] for k in names}
            new = [r for r in ms.regions if r not in self.claims and f"{r}.done" in there]
            more = _all(
                ms.mb, [partial(_tagged, "claim", r, ms.read_claim, tag, r, self.expect) for r in new]
            )
            for _, r, got in more:
                if isinstance(got, Manifest | Tombstone):
                    self.claims[r] = got
                    seen.append(r)
        if judge:
            after = ms._clock()
            self.leaving = leaving
            self.stale = {r for r, due in dues.items() if r not in leaving and due <= after}
            self.stale_due = min(
                (due for r, due in dues.items() if r not in leaving and due > after), default=math.inf
            )
        if seen and all(r in self.claims for r in ms.regions):
            # (the last claim to land, as far as this region can tell: its own if its write completed the set)
            self.closer = region if region in seen else [r for r in ms.regions if r in seen][-1]

    def _guarded(self) -> bool:
        """:func:`_guard`: True when it found the round's commit (the result, then)."""
        got = _guard(self.ms, self.tag, self.expect, self.manifests())
        if got is not None:
            self.result, self.adopted = got, True
        return got is not None

    def _close(self, reason: str, now: float) -> None:
        """Close the round without the regions still missing: a tombstone at each one's claim key,
        create-only, all at once. Where a region's own claim won its key meanwhile, it takes part."""
        ms = self.ms
        missing = [r for r in ms.regions if r not in self.claims]
        stale = [r for r in missing if r in self.stale]
        when = time.time()
        step = self.step if self.step is not None else -1

        def tombstone(r: str) -> tuple[str, Claim | None]:
            t = Tombstone(
                True, ms.run_id, self.tag, r, step, ms.region, reason, round(now - self.t0, 3), stale, when
            )
            if ms.store.create(ms.claim_key(self.tag, r), t.to_json()):
                return r, t
            return r, ms.read_claim(self.tag, r, self.expect)  # its manifest, or another closer's tombstone

        for r, got in _all(ms.mb, [partial(tombstone, r) for r in missing]):
            if got is not None:
                self.claims[r] = got
                if isinstance(got, Manifest):  # its claim beat the tombstone (all did: the last completed it)
                    self.closer = r

    def _decided(self) -> bool:
        """Once every region has a claim: the result, the same on every region (from the claims alone)."""
        ms = self.ms
        if any(r not in self.claims for r in ms.regions):
            return False
        got = self.manifests()
        members = {r: Member(manifest_digest(got[r]), int(got[r].tokens)) for r in ms.regions if r in got}
        tombs = [t for r in ms.regions if isinstance(t := self.claims[r], Tombstone)]
        absent = [t.region for t in tombs]
        ms.absent_last = set(absent)
        if tombs:  # what closed it: the first absent region's tombstone; who crashed: any closer's word
            t = tombs[0]
            stale = [r for r in absent if any(r in x.stale for x in tombs)]
            c = Commit(
                ms.run_id, self.tag, t.step, members, t.closed_by, t.reason, t.waited_s, absent, t.time, stale
            )
        else:
            step = self.step if self.step is not None else -1
            waited = round(ms._clock() - self.t0, 3)
            c = Commit(ms.run_id, self.tag, step, members, self.closer, "all", waited, [], time.time())
        self.result = c, got
        return True


def _tagged(what: str, region: str, fn: Callable[..., object], *args) -> tuple[str, str, object]:
    """``(what, region, fn(*args))``: a task of a look, its answer labelled."""
    return what, region, fn(*args)


def _all(mb: Mailbox, tasks: list[Callable[[], T]]) -> list[T]:
    """Run ``tasks`` (small requests) at once on the mailbox's pool: one round trip for all of them."""
    if len(tasks) <= 1:
        return [t() for t in tasks]
    return list(mb.pool.map(lambda t: t(), tasks))


def _guard(
    ms: Membership, tag: str, expect: Expect, known: dict[str, Manifest]
) -> tuple[Commit, dict] | None:
    """Has the run moved past round ``tag``? One listing of the run. A round whose claims are incomplete
    although a later round was committed has been cleaned up behind this region:
    :class:`~.errors.XRBehind` (fast-forward), and it is never closed again. Where the round's own commit
    is there (its claims being cleaned up, or seen here before all of them), it is the round's outcome:
    (the commit, its members' manifests)."""
    r = parse_tag(tag)
    if r is None:
        return None
    committed = ms.committed_rounds()
    c = ms.read_commit(tag) if r in committed or (committed and committed[-1] > r) else None
    if c is not None:
        return c, ms.member_manifests(c, expect, known)
    if committed and committed[-1] > r:
        raise XRBehind(
            f"round {tag}: the run has committed up to {round_tag(committed[-1])} and {tag} is no longer "
            "in the mailbox: this region fast-forwards",
            committed[-1],
        )
    return None
