"""What ``sbatch-gen status`` reads from a cross-region run's mailbox. Torch-free.

One pass over the mailbox (a few listings and small reads; no shard is downloaded): the newest committed
round and who closed it, the newest complete outer snapshot, and per region its newest published round,
its presence record (joined / leaving, or none), its last liveness heartbeat and how far it is behind the
newest commit. The CLI only formats the :class:`MailboxStatus` this returns.

A heartbeat's age is this machine's wall clock minus the WRITER's (the only time a single reading has):
information for people, off by the clock skew between the two machines. The regions themselves never
compare clocks: they watch whether the heartbeat's counter changes, on their own clock.

Needs ``boto3`` (the ``s3`` extra) for an S3 mailbox; nothing beyond the base install for ``fs``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sbatch_gen.train.xr.store import Store
    from sbatch_gen.xr_options import CrossRegion, FsTransport, S3Transport


@dataclass
class CommitInfo:
    round: int
    step: int
    closed_by: str
    reason: str  # "all" | "leave" | "stale" | "grace"
    members: list[str]  # in the order of the run's regions
    absent: list[str]
    waited_s: float
    time: float  # wall clock, seconds since the epoch (0: unknown)
    stale: list[str] = field(default_factory=list)  # absent regions whose heartbeat the closer found stale
    fragment: int | None = None  # overlap streaming: the fragment the round synced (None: the whole model)
    interval_s: float | None = (
        None  # since the previous round's commit (None: that one is not in the mailbox)
    )


@dataclass
class RegionStatus:
    region: str
    last_published: int | None  # newest round with this region's manifest in the mailbox
    presence: str  # "joined" | "leaving" | "absent" (no presence record)
    presence_round: int | None
    presence_step: int | None
    presence_time: float | None
    presence_age_s: float | None
    job: str
    # why the region wrote its presence record ("" when it gave none): for a leave, a planned stop's reason
    # ("stop file: ...", "finished", "no quorum") or a crash's ("torchrun exited with status 1", announced
    # for it by the node program); for "refused", which setting differs from a peer's
    presence_why: str
    behind: int | None  # rounds behind the newest commit (0: up to date; None: no commit yet)
    in_newest_commit: bool | None  # None: no commit yet
    heartbeat: int | None = None  # the counter of its last heartbeat (None: no heartbeat in the mailbox)
    heartbeat_interval_s: float | None = None
    heartbeat_time: float | None = None  # the WRITER's wall clock when it wrote it
    heartbeat_age_s: float | None = None  # this reader's wall clock minus the writer's: includes their skew
    # --watch only (:class:`HeartbeatWatch`), on this machine's monotonic clock: for how long the heartbeat has
    # not changed (None: not watched, or no heartbeat), and whether that makes the region gone (killed or
    # crashed: quiet for STALE_BEATS intervals without a leave), the rule the regions themselves apply
    silent_s: float | None = None
    gone: bool = False


@dataclass
class PayloadInfo:
    """payload_dtype sparse: what the regions' newest manifests say they sent (no object is read)."""

    dtype: str  # the wire dtype the run's options give (sparse-c<chunk>-k<k>)
    density: float  # k / chunk: the share of each chunk sent
    bytes: dict[str, int]  # per region, the bytes of its newest round's objects (its manifest's shards)
    bf16_bytes: int  # the newest of those rounds' payload in bf16 (2 B per element), for comparison
    # per region, its newest round's payload in bf16: with overlap streaming a round carries one fragment,
    # and regions whose newest rounds differ may have sent different fragments
    bf16: dict[str, int] = field(default_factory=dict)


@dataclass
class MailboxStatus:
    run_id: str
    site_region: str  # the region of the site whose profile was read
    location: str  # store.describe() of the mailbox
    quorum: int
    regions_total: int
    grace_s: float
    heartbeat_s: float | None  # None: heartbeats off
    fragments: int  # overlap streaming: F (a round syncs fragment (round - 1) mod F); else 1
    exists: bool  # False: an fs mailbox directory that does not exist (yet)
    now: float
    newest_commit: CommitInfo | None = None
    committed_rounds: list[int] = field(
        default_factory=list
    )  # still in the mailbox (older ones are cleaned up)
    newest_snapshot: int | None = None
    regions: list[RegionStatus] = field(default_factory=list)
    payload: PayloadInfo | None = None  # payload_dtype sparse only

    def to_dict(self) -> dict:
        return asdict(self)


def read_status(xr: CrossRegion, store: Store | None = None, *, now: float | None = None) -> MailboxStatus:
    """Read the mailbox of ``xr`` (a site's ``cross_region`` section). ``store``: an already opened store
    (default: :func:`~sbatch_gen.train.xr.store.make_store` of ``xr.transport``; closed again here).
    Raises :class:`~sbatch_gen.train.xr.errors.XRError` (``StoreError`` and friends) when the store fails."""
    from sbatch_gen.train.xr.membership import Membership
    from sbatch_gen.train.xr.protocol import Mailbox, round_tag
    from sbatch_gen.train.xr.store import make_store

    now = time.time() if now is None else now
    status = partial(
        MailboxStatus,
        run_id=xr.run_id,
        site_region=xr.region,
        quorum=xr.quorum,
        regions_total=len(xr.regions),
        grace_s=xr.grace_s,
        heartbeat_s=xr.heartbeat_s if xr.elastic else None,
        fragments=xr.fragment_count,
        now=now,
    )
    t = xr.transport
    if store is None and t.kind == "fs" and not Path(t.root).is_dir():
        # FsStore would create the directory: a status query must not.
        return status(
            location=location(t),
            exists=False,
            regions=[_region(r, None, None, None, None, now) for r in xr.regions],
        )
    own = store is None
    if store is None:
        store = make_store(t, threads=4)
    mb = Mailbox(store, xr.run_id, xr.region, xr.regions, threads=1)
    try:
        ms = Membership(mb, xr.quorum, xr.grace_s)
        keys = ms.run_keys()  # one listing serves every reader below
        latest = ms.published_rounds(keys)
        committed = ms.committed_rounds(keys)
        commit = None
        commit_round = 0
        for r in reversed(committed):  # (a commit can be cleaned up between the listing and the read)
            commit = ms.read_commit(round_tag(r))
            if commit is not None:  # read_commit checked that its tag is round_tag(r)
                commit_round = r
                break
        prev = ms.read_commit(round_tag(commit_round - 1)) if commit_round - 1 in committed else None
        snaps = ms.snapshot_rounds(keys)
        presences = ms.presences(keys)
        beats = ms.heartbeats(keys)
        info = None
        if commit is not None:
            info = CommitInfo(
                round=commit_round,
                step=commit.step,
                closed_by=commit.closed_by,
                reason=commit.reason,
                members=[r for r in xr.regions if r in commit.members],
                absent=list(commit.absent),
                waited_s=commit.waited_s,
                time=commit.time,
                stale=list(commit.stale),
                fragment=(commit_round - 1) % xr.fragment_count if xr.fragment_count > 1 else None,
                interval_s=commit.time - prev.time
                if prev is not None and commit.time and prev.time
                else None,
            )
        return status(
            location=store.describe(),
            exists=True,
            payload=_payload(mb, xr, latest) if xr.payload_dtype == "sparse" else None,
            newest_commit=info,
            committed_rounds=committed,
            newest_snapshot=snaps[-1] if snaps else None,
            regions=[
                _region(r, latest.get(r), presences.get(r), beats.get(r), info, now) for r in xr.regions
            ],
        )
    finally:
        mb.close()
        if own:
            store.close()


def _payload(mb, xr: CrossRegion, latest: dict[str, int]) -> PayloadInfo:
    """The bytes of each region's newest manifest's shards (one small read per region)."""
    from sbatch_gen.train.xr.protocol import round_tag

    got: dict[str, int] = {}
    bf16: dict[str, int] = {}
    for r in xr.regions:
        if latest.get(r) is None:
            continue
        try:
            m = mb.read_manifest(round_tag(latest[r]), r)
        except Exception:  # noqa: BLE001 - cleaned up meanwhile, or unreadable: not shown
            m = None
        if m is not None:
            got[r] = sum(s.nbytes for s in m.shards)
            bf16[r] = 2 * m.numel
    newest = max(bf16, key=lambda r: latest[r], default=None)
    return PayloadInfo(
        xr.wire_dtype, xr.sparse_kept / xr.sparse_chunk, got, bf16[newest] if newest else 0, bf16
    )


class HeartbeatWatch:
    """``status --watch``: each region's heartbeat across reads, timed on this machine's monotonic clock, so
    no region's clock is compared with ours. A region whose heartbeat stays unchanged for ``STALE_BEATS``
    intervals (its own interval when longer) without having announced a leave is ``gone``: the rule the
    regions apply before closing a round without it (:mod:`sbatch_gen.train.xr.membership`). One reading
    alone cannot tell: only a watch marks regions gone."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._seen: dict[str, tuple[tuple[int | None, float | None], float]] = {}  # value, since when

    def mark(self, st: MailboxStatus) -> MailboxStatus:
        from sbatch_gen.train.xr.heartbeat import STALE_BEATS

        now = self.clock()
        for r in st.regions:
            if st.heartbeat_s is None or r.heartbeat is None:
                self._seen.pop(r.region, None)
                continue
            value = (r.heartbeat, r.heartbeat_time)  # the writer's clock changes with every beat
            seen = self._seen.get(r.region)
            if seen is None or seen[0] != value:
                self._seen[r.region] = seen = (value, now)
            r.silent_s = now - seen[1]
            limit = STALE_BEATS * max(st.heartbeat_s, r.heartbeat_interval_s or 0.0)
            r.gone = r.presence != "leaving" and r.silent_s >= limit
        return st


def location(transport: FsTransport | S3Transport) -> str:
    """Where the mailbox of a transport is, as the stores describe it (also when the store cannot be opened)."""
    if transport.kind == "fs":
        return f"fs:{Path(transport.root).absolute()}"
    return f"s3://{transport.bucket}/{transport.prefix.strip('/')}"


def _region(region: str, published: int | None, p, hb, commit: CommitInfo | None, now: float) -> RegionStatus:
    behind = None
    if commit is not None:
        # Where the region is: its newest manifest, or the round its presence record names (a region that
        # fast-forwarded, or left, may have no newer manifest). A region ahead of the commit is at 0.
        at = max([x for x in (published, p.round if p is not None else None) if x is not None], default=0)
        behind = max(0, commit.round - at)
    return RegionStatus(
        region=region,
        last_published=published,
        presence=p.state if p is not None else "absent",
        presence_round=p.round if p is not None else None,
        presence_step=p.step if p is not None else None,
        presence_time=p.time if p is not None else None,
        presence_age_s=max(0.0, now - p.time) if p is not None and p.time else None,
        job=p.job if p is not None else "",
        presence_why=p.why if p is not None else "",
        behind=behind,
        in_newest_commit=(region in commit.members) if commit is not None else None,
        heartbeat=hb.beat if hb is not None else None,
        heartbeat_interval_s=hb.interval_s if hb is not None else None,
        heartbeat_time=hb.time if hb is not None else None,
        heartbeat_age_s=max(0.0, now - hb.time) if hb is not None and hb.time else None,
    )


def age(seconds: float | None) -> str:
    """``42s ago``, ``3m ago``, ``5h ago``, ``2d ago``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s ago"
    if s < 2 * 3600:
        return f"{s // 60}m ago"
    if s < 2 * 86400:
        return f"{s // 3600}h ago"
    return f"{s // 86400}d ago"
