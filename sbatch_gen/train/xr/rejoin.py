"""How a returning region reaches the run (elastic DiLoCo): the plan, read from the mailbox (the committed
rounds to replay, after the newest outer snapshot when the rounds before it are gone), and how far the run
already is into its current round. rank 0 computes both; :class:`~.diloco.DiLoCo` carries them out."""

from __future__ import annotations

from sbatch_gen.xr_options import CrossRegion

from .errors import XRMissingRound
from .membership import Membership
from .protocol import round_tag


def plan_catch_up(
    ms: Membership, xr: CrossRegion, at: int, joined: int
) -> tuple[int, int | None, list[int]] | None:
    """From round ``at`` to the run's newest committed round: (that round, the snapshot to load first or
    None, the rounds to replay), or None when the newest commit is not past ``joined`` (``at``, or with
    overlap eager the round in flight, which is joined as usual, not replayed)."""
    keys = ms.run_keys()
    committed = ms.committed_rounds(keys)
    if not committed or committed[-1] <= joined:
        return None
    latest, have = committed[-1], set(committed)
    need = list(range(at + 1, latest + 1))
    if all(r in have for r in need):
        return latest, None, need
    snaps = [
        s
        for s in ms.snapshot_rounds(keys)
        if at < s <= latest and all(r in have for r in range(s + 1, latest + 1))
    ]
    if not snaps:
        gone = [r for r in need if r not in have]
        raise XRMissingRound(
            f"region {xr.region!r} at round {at} cannot rejoin the run at round {latest}: "
            f"round(s) {round_tag(gone[0])}..{round_tag(gone[-1])} are gone from "
            f"{ms.store.describe(xr.run_id)} and no outer snapshot covers them"
        )
    s = max(snaps)
    return latest, s, list(range(s + 1, latest + 1))


def steps_into_round(ms: Membership, at: int, h: int) -> int:
    """How far the run is into the round after round ``at`` (the newest commit), in inner steps, estimated
    from when the last few rounds' commits were written (the last rounds' wall time). A returning region
    continues at the run's current step, so its first round back ends about when the others' does: else
    they would wait up to grace_s for it, or it would be late. 0 without an estimate, or when no round has
    closed for two rounds' time (every region was away: the run stands at the commit); at most ``h`` (the
    steps between two rounds: H, with streaming H/F) - 1.

    Every time here is the STORE's: when it wrote each commit (:meth:`~.store.Store.modified`) and when it
    writes an object now (:meth:`~.membership.Membership.store_now`), so the round's length and the time
    since the newest commit are differences of one clock's readings. Not the commits' own ``time``: each is
    the clock of the region that closed that round, and this host's ``time.time()`` another one; a skew
    between them (minutes, hours on a host without NTP) would move the estimate by as much, to 0 or h - 1.
    The store's clock may be off too; its offset cancels out in the differences. (S3 gives it to the
    second: the estimate is that coarse, against rounds of minutes.)"""
    closed = []  # (round, when the store wrote its commit) of the last few rounds up to this one
    for r in [r for r in ms.committed_rounds() if r <= at][-4:]:
        t = ms.store.modified(ms.commit_key(round_tag(r)))
        if t is not None:
            closed.append((r, t))
    if len(closed) < 2 or closed[-1][0] != at:
        return 0
    now = ms.store_now()
    if now is None:
        return 0
    per_round = (closed[-1][1] - closed[0][1]) / (closed[-1][0] - closed[0][0])
    since = now - closed[-1][1]
    if per_round <= 0 or since <= 0 or since > 2 * per_round:
        return 0  # no round closed for two rounds' time: nobody is training ahead (all stopped), start at 0
    return max(0, min(h - 1, int(h * since / per_round)))
