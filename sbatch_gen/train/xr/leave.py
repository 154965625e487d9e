"""A crashed region's leave, announced for it: ``python -m sbatch_gen.train.xr.leave --torchrun-status N --
TRAINER_ARGS...``. Torch-free.

The node program's run-trainer (:mod:`sbatch_gen.node_program`) runs this on a region's node 0 after torchrun
exited non-zero without a completed stop (no ack beside the stop file) and without ``.fatal``, when torchrun
ran the companion trainer with ``--xr-enabled``. TRAINER_ARGS are the trainer's own arguments, parsed
as the trainer parses them (:func:`sbatch_gen.train.cli.parse_args`, then the ``--xr-*`` flags or the
``SBATCH_GEN_XR_*`` environment), so this speaks for the same region of the same run in the same mailbox.

It writes the record a planned stop writes (:meth:`.membership.Membership.announce` ``"leaving"``), so the
other regions treat the crash as they treat a stop: their next round closes on ``leave`` once ``min_regions``
have published, instead of waiting for this region's heartbeat to go stale (or for ``grace_s``). Its
``why`` is the torchrun status; its round and step are first those of the region's previous presence record
(written at once), then, when newer, those of the newest round it published (a listing of the run, written
again: where the region was, for ``sbatch-gen status`` and people). A requeued region rejoins as after a
stop; its ``joined`` replaces the record.

It writes nothing, and says why, when:

- the region's presence record already says ``leaving`` (its trainer announced a stop or its end before it
  failed) or ``refused`` (its settings differ from a peer's: the others must read that, not a leave);
- the run directory's lease is held by a live trainer (another attempt of this region trains now, e.g. the
  one Slurm started in place of an attempt it gave up on, which was then fenced): its region is not gone.
  A lease held on another host counts as live until its heartbeat goes stale, so a region whose rank 0 ran
  on another node than node 0 is left to its heartbeat too.

One line on stdout either way, never a traceback: ``announced the leave of region R in the mailbox WHERE
after torchrun exited with status N (round r, step s)``, or ``WARNING: ...`` naming what stopped it; exit
status 0 when the record was written or nothing had to be, 1 otherwise. run-trainer bounds its time (a store
that does not answer must not hold the job) and logs that line; nothing here changes run-trainer's status.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from ..api import CrossRegionError, cross_region_from_args
from ..cli import build_parser
from ..config import load_config
from ..lease import LEASE_FILE, default_period, describe_holder, stale_reason
from .commit import Presence
from .membership import Membership
from .protocol import Mailbox, Manifest, round_tag
from .store import make_store

FLAG = "--torchrun-status"


class _ArgError(Exception):
    pass


def _trainer_xr(trainer_args: list[str]):
    """(the cross-region options, the run dir or None) from the trainer's arguments, as the trainer reads them."""
    ap = build_parser()

    def refuse(message: str):  # argparse would print its usage and exit 2
        raise _ArgError(message)

    ap.error = refuse  # type: ignore[method-assign]
    args = ap.parse_args(trainer_args)
    try:
        xr, _ = cross_region_from_args(namespace=args)
    except CrossRegionError as e:
        raise _ArgError(" ".join(str(e).split())) from None
    run_dir = args.run_dir
    if run_dir is None:
        try:
            run_dir = load_config(args.config).run_dir
        except Exception:  # noqa: BLE001 - then the lease is not looked at
            run_dir = None
    return xr, run_dir


def live_lease(run_dir: str | os.PathLike | None) -> str | None:
    """Who holds the run directory's lease while it is live (:mod:`sbatch_gen.train.lease`), or None. This
    region's own trainer has exited: a live holder is another attempt."""
    if run_dir is None:
        return None
    try:
        holder = json.loads((Path(run_dir) / LEASE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict):
        return None
    now, period = time.time(), default_period()
    # no job id matches "": a requeue of the same job is not taken for the same trainer
    if stale_reason(holder, job_id="", host=socket.gethostname(), now=now, period_s=period) is not None:
        return None
    return describe_holder(holder, now, period)


def announce(status: int, trainer_args: list[str]) -> tuple[int, str]:
    """Announce this region's leave; returns (exit status, the one line to say)."""
    try:
        xr, run_dir = _trainer_xr(trainer_args)
    except _ArgError as e:
        return 1, f"WARNING: cannot announce a leave: the trainer's arguments: {e}"
    if not xr.enabled:
        return 0, "no leave to announce: the trainer's arguments do not enable the cross-region sync"
    region = xr.region
    held = live_lease(run_dir)
    if held is not None:
        return 1, (
            f"WARNING: did not announce the leave of region {region}: the run dir {run_dir} is leased by a "
            f"live trainer ({held}); another attempt may train, so the other regions judge it by its heartbeat "
            "or grace_s"
        )
    mb = Mailbox(make_store(xr.transport, 2), xr.run_id, region, xr.regions, threads=2)
    try:
        ms = Membership(mb, xr.quorum, xr.grace_s, job=os.environ.get("SLURM_JOB_ID", ""))
        where = mb.store.describe(xr.run_id)
        before: Presence | None = ms.read_presence(region)
        if before is not None and before.state in ("leaving", "refused"):
            return 0, (
                f"no leave to announce for region {region}: its presence record in {where} already says "
                f"{before.state} (round {before.round}, step {before.step})"
            )
        r, step = (before.round, before.step) if before is not None else (0, 0)
        why = f"torchrun exited with status {status}"
        ms.announce("leaving", r, step, why)  # first: the others need the state, not where the region was
        try:  # then where it was: its newest published round (a listing of the run), when newer
            newest = ms.published_rounds().get(region, r)
            claim = ms.read_claim(round_tag(newest), region) if newest > r else None
            if isinstance(claim, Manifest):
                r, step = newest, claim.step
                ms.announce("leaving", r, step, why)
        except Exception:  # noqa: BLE001 - the leave stands; its round is the previous record's
            pass
        return (
            0,
            f"announced the leave of region {region} in the mailbox {where} after {why} (round {r}, step {step})",
        )
    finally:
        mb.close()
        mb.store.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != FLAG or not argv[1].isdecimal() or argv[2] != "--":
        print(f"usage: python -m sbatch_gen.train.xr.leave {FLAG} N -- TRAINER_ARGS...", file=sys.stderr)
        return 2
    try:
        rc, line = announce(int(argv[1]), argv[3:])
    except Exception as e:  # noqa: BLE001 - one line, never a traceback in the node's log
        rc, line = 1, f"WARNING: cannot announce the leave: {type(e).__name__}: {' '.join(str(e).split())}"
    print(line, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
