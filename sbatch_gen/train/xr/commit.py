"""A round's commit (who took part: the record of the decision its claims made), a tombstone (the claim a
closer makes for a region it closed the round without), the rule that closes a round (:func:`decide`), and
a region's presence record (joined, leaving). How they are written and read: :mod:`.membership`.
Torch-free."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .errors import XRLayoutError
from .protocol import parse_tag
from .records import Record, build


@dataclass
class Member:
    digest: str  # checksum of the member's manifest bytes
    tokens: int


@dataclass
class Commit(Record):
    WHAT = "round commit"

    run_id: str
    tag: str
    step: int
    members: dict[str, Member]  # region -> its manifest's digest and tokens
    closed_by: str
    # "all": every region arrived; "leave": the missing ones announced a leave; "stale": the missing ones
    # left or crashed (a heartbeat unchanged for STALE_BEATS intervals); "grace": grace_s ran out
    reason: str
    waited_s: float  # how long the closing region waited for peers in this round
    absent: list[str] = field(default_factory=list)  # regions not in the commit
    # the closer's wall clock: for people (`sbatch-gen status`), never compared with another clock
    time: float = 0.0
    stale: list[str] = field(default_factory=list)  # absent regions whose heartbeat the closer found stale

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Commit:
        """Raises :class:`XRLayoutError` for an unreadable commit, or one of a version not read here."""
        try:
            c = cls.read(raw, where)
            c.members = {r: build(Member, m) for r, m in c.members.items()}  # type: ignore[arg-type]
            return c
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise XRLayoutError(f"unreadable round commit {where}: {e}") from e

    @property
    def round(self) -> int | None:
        return parse_tag(self.tag)


@dataclass
class Tombstone(Record):
    """The claim of a region a round closed without: written by the closer at that region's claim key
    (``<run>/<tag>/<region>.done``, where the region's manifest would be) with a create-only write, so of a
    region's manifest and a tombstone exactly one is ever there. What closed the round is in it; every
    region reads the same tombstones, so every region builds the same commit from them."""

    WHAT = "round tombstone"

    tombstone: bool  # always True: what tells a tombstone from a manifest at a claim key
    run_id: str
    tag: str
    region: str  # the region the round closed without
    step: int
    closed_by: str
    reason: str  # "leave" | "stale" | "grace" (as Commit.reason)
    waited_s: float
    stale: list[str] = field(default_factory=list)  # the missing regions the closer found crashed
    time: float = 0.0  # the closer's wall clock: for people only

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Tombstone:
        """Raises :class:`XRLayoutError` for an unreadable tombstone, or one of a version not read here."""
        try:
            return cls.read(raw, where)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise XRLayoutError(f"unreadable round tombstone {where}: {e}") from e


@dataclass
class Presence(Record):
    WHAT = "presence record"

    region: str
    # "joined" | "leaving" | "refused" (its settings differ from a peer's: it stopped, `why` says how)
    state: str
    round: int
    step: int
    time: float
    job: str = ""
    why: str = ""

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Presence | None:
        """None for an unreadable record; raises :class:`XRLayoutError` for a version not read here."""
        try:
            return cls.read(raw, where)
        except (ValueError, TypeError):
            return None


def decide(
    regions: Iterable[str],
    arrived: Iterable[str],
    leaving: Iterable[str],
    quorum: int,
    grace_s: float,
    now: float,
    quorum_since: float | None,
    stale: Iterable[str] = (),
) -> tuple[str | None, float | None]:
    """The closing rule, as a pure function: ``(reason or None, quorum_since)``. ``reason`` is "all",
    "leave", "stale" or "grace" when the round may close now. ``stale``: regions whose heartbeat has gone
    stale (crashed); like ``leaving`` they are not waited for, but only once ``quorum`` have arrived."""
    regions, arrived, leaving, stale = list(regions), set(arrived), set(leaving), set(stale)
    if arrived >= set(regions):
        return "all", quorum_since
    if len(arrived) < quorum:
        return None, None
    if quorum_since is None:
        quorum_since = now
    missing = set(regions) - arrived
    if missing <= leaving:
        return "leave", quorum_since
    if missing <= leaving | stale:
        return "stale", quorum_since
    if now - quorum_since >= grace_s:
        return "grace", quorum_since
    return None, quorum_since
