"""Outer snapshots and the background housekeeping of elastic DiLoCo: every ``snapshot_every`` rounds the
round's first member publishes ``theta_outer`` and momentum (from a host copy, in a thread of the leaders,
a few streams at a time), and rank 0 cleans the mailbox up behind each round; a returning region loads the
newest snapshot. :class:`SnapshotSync` is the layer of :class:`~.sync.OuterSync` that holds this;
:class:`~.diloco.DiLoCo` builds on it."""

from __future__ import annotations

import mmap
import threading
import time
from typing import NamedTuple

import torch

from .errors import StoreError, XRBehind, XRError
from .exchange import Exchange
from .overlap import CANCEL_WAIT_S, InFlight
from .protocol import round_tag
from .region import held
from .sync import OuterSync


class _Kept(NamedTuple):
    """What a housekeeping job hands back: the snapshot it uploaded (round, step, seconds, error) and the
    cleanup behind round ``cleaned`` (rank 0; its error)."""

    snapshot: tuple | None
    cleaned: int
    cleanup_error: str | None


def host_copy(numel: int) -> torch.Tensor:
    """``numel`` fp32 elements of host memory for one snapshot's copy of the outer state: an anonymous mapping
    of the kernel's, unmapped once the tensor is dropped, never a block of the C allocator. glibc's free() of
    a mapped block of up to 32 MiB raises the process's mmap and trim thresholds for the rest of its life
    (its dynamic threshold), and with them how often the training steps after it fault fresh pages in: on
    ``bench overlap``'s CPU regions (7.2M parameters, two 28.8 MB copies) the region that uploads the
    snapshots spent a quarter less CPU per step than the other once its first snapshot's copies were freed,
    and in strict rounds it then waited for the other at most rounds (docs/benchmarks.md). A snapshot leaves
    the process's allocator as it found it."""
    if numel <= 0:
        return torch.empty(0, dtype=torch.float32)
    return torch.frombuffer(mmap.mmap(-1, numel * 4), dtype=torch.float32)


# A snapshot (8 B/param, 4x a bf16 round) uploads this many shards at a time, in the background (the
# housekeeping): the rounds that cross the WAN meanwhile keep the rest of the link.
SNAPSHOT_STREAMS = 2


class SnapshotSync(OuterSync):
    """An outer sync with an outer state to snapshot (``theta_outer``, momentum: leaders only) and the
    housekeeping job that uploads it and cleans the mailbox up."""

    theta_outer: torch.Tensor | None
    momentum: torch.Tensor | None

    def _init_housekeeping(self) -> None:
        """Collective (every rank builds the housekeeping's own process group)."""
        # the housekeeping job in flight (leaders: a snapshot upload, then rank 0's mailbox cleanup) and the
        # round of its snapshot (0: none), the seconds of the last snapshot reaped, and whether the run is
        # over (finish(): close() then waits for the job, else calls it off)
        self._hk: InFlight[_Kept] | None = None
        self._hk_snap, self._snap_s = 0, None
        self._copied: threading.Event | None = None  # set once the job copied the outer state (see _mutable)
        self._finished = False
        sg = self.group.background()  # collective: the housekeeping's own process group
        self.snap_ex = self.ex.for_snapshots(sg, SNAPSHOT_STREAMS) if sg is not None else None

    # -- snapshots -----------------------------------------------------------------------------------------
    def _snapshot_due(self, r: int, members: list[str]) -> bool:
        """Every ``snapshot_every`` rounds the round's first member publishes the outer state."""
        return r % self.xr.snapshot_every == 0 and bool(members) and members[0] == self.xr.region

    def _copy_outer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Leaders: ``theta_outer`` and momentum copied to host memory for a snapshot upload (:func:`host_copy`);
        only the shards this leader uploads are written (the rest of each buffer stays untouched)."""
        theta, mom = held(self.theta_outer, "theta_outer"), held(self.momentum, "momentum")
        n = self.local_numel
        out = (host_copy(n), host_copy(n))
        plan = self.ex.fp32_plan
        for sh in self.ex.owned(plan):
            lo, hi = self.ex.at(plan, sh)
            out[0][lo:hi].copy_(theta[lo:hi])
            out[1][lo:hi].copy_(mom[lo:hi])
        return out

    def _publish_snapshot(
        self, ex: Exchange, r: int, step: int, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[float | None, str | None]:
        """Collective over ``ex``'s group: ``state`` (the outer state of round ``r``) as snapshot ``r``.
        Returns (seconds, None), or (None, the error) when it failed: the previous snapshot stays, rounds
        after it are kept."""
        t0 = time.perf_counter()
        ms = self.membership
        tag = ms.snap_tag(r) if ms is not None else ""
        try:
            mt, _, _ = ex.upload(tag, "theta", "snapshot", step, state[0], 0)
            mm, _, _ = ex.upload(tag, "momentum", "snapshot", step, state[1], 0)

            def publish() -> None:  # rank 0: it holds the mailbox and the manifests upload() returned
                if ms is None or mt is None or mm is None:
                    raise XRError(f"internal: rank 0 holds no mailbox or no manifest of snapshot {tag}")
                ms.complete_snapshot(r, {"theta": mt, "momentum": mm}, r)
                ms.delete_snapshots_before(r)

            ex.group.on_rank(publish)
        except Exception as e:  # noqa: BLE001 - a failed snapshot costs nothing but the rounds kept longer
            return None, str(e)
        return time.perf_counter() - t0, None

    # -- housekeeping: snapshot uploads and the mailbox cleanup, in the background ------------------------------
    def _housekeeping(self, r: int, members: list[str], step: int) -> float | None:
        """After round ``r`` (of ``members``, at ``step``) was applied: the housekeeping job started, with
        snapshot ``r`` when it is due. Returns the seconds of a snapshot upload reaped since the last
        record (for this round's record), if any."""
        self._start_housekeeping(r, (r, step) if self._snapshot_due(r, members) else None)
        return self._take_snapshot_s()

    def _start_housekeeping(self, r: int, snap: tuple[int, int] | None) -> None:
        """After round ``r`` was applied: reap the housekeeping job if it has ended, then start the next one
        in a thread of the leaders: when snapshot ``snap`` (round, step) is due, copy the outer state to
        host memory and upload the copy (the previous job waited for first: one at a time); then on rank 0
        the mailbox cleanup behind round ``r``. A cleanup alone is skipped while the previous job still
        runs: the next one deletes what it would have. Whatever changes the outer state next waits for the
        copy first (:meth:`_mutable`), a few milliseconds after the start."""
        self._reap()
        if snap is None and (self._hk is not None or self.group.rank != 0):
            return
        if snap is not None:
            self._reap(wait=True)
        if not self.leader:
            return
        ex = self.snap_ex
        if ex is None:
            raise XRError("internal: a leader without its housekeeping exchange")
        copied = threading.Event()

        def job(cancel: threading.Event) -> _Kept:
            shot = None
            if snap is not None:
                try:
                    state = self._copy_outer()
                finally:
                    copied.set()
                shot = (*snap, *self._publish_snapshot(ex, snap[0], snap[1], state))
            return _Kept(shot, r, self._cleanup_now(ex, r, need_snapshot=True))

        if snap is None:
            copied.set()
        self._copied = copied
        self._hk, self._hk_snap = (
            InFlight(job, f"xr-housekeeping-{r}", self.outer_device),
            snap[0] if snap else 0,
        )

    def _mutable(self) -> None:
        """Before the outer state changes: wait until the housekeeping has copied it for its snapshot."""
        if self._copied is not None:
            self._copied.wait()
            self._copied = None

    def _reap(self, wait: bool = False, timeout_s: float | None = None, **extra: float) -> bool:
        """The housekeeping job, once it has ended (``wait``: wait for it, up to ``timeout_s``): its snapshot
        logged (with ``extra``) and its seconds kept for the next record, a cleanup error logged. Whether no
        job is left in flight."""
        job = self._hk
        if job is None:
            return True
        if not (job.wait(timeout_s) if wait else job.done()):
            return False
        self._hk = None
        kept = job.result()
        if kept.snapshot is not None:
            r, step, seconds, error = kept.snapshot
            self._log_snapshot(r, step, seconds, error, **extra)
            self._snap_s = seconds if seconds is not None else self._snap_s
        self._log_cleanup(kept.cleaned, kept.cleanup_error)
        return True

    def _take_snapshot_s(self) -> float | None:
        seconds, self._snap_s = self._snap_s, None
        return seconds

    def wait_snapshot(self) -> None:
        """Wait for the housekeeping in flight, if any: a snapshot upload (logged as ``xr_snapshot``), the
        mailbox cleanup."""
        self._reap(wait=True)

    def _log_snapshot(
        self, r: int, step: int, seconds: float | None, error: str | None, **extra: float
    ) -> None:
        if error is not None:
            self._log({"event": "xr_snapshot_failed", "round": r, "error": error, **extra})
        elif seconds is not None:
            self._log(
                {"event": "xr_snapshot", "round": r, "step": step, "seconds": round(seconds, 3), **extra}
            )

    def _load_snapshot(self, s: int) -> None:
        """theta_outer and momentum of snapshot ``s`` (all-or-nothing: fetched into scratch first)."""
        ms = self.membership
        expect = self.ex.expect("snapshot")
        mans = self.group.on_rank(lambda: self.ex.ms().read_snapshot(s, expect))
        tag = ms.snap_tag(s) if ms is not None else ""
        try:
            self.ex.fetch(tag, mans["theta"], self.work, self.ex.fp32_plan)
            self.ex.fetch(tag, mans["momentum"], self.avg, self.ex.fp32_plan)
        except StoreError as e:  # (every rank: on_each) a newer snapshot pruned this one while it was read
            raise XRBehind(f"outer snapshot {round_tag(s)}: {e} while fast-forwarding", None) from e
        if self.leader:
            self._mutable()
            held(self.theta_outer, "theta_outer").copy_(held(self.work, "work"))
            held(self.momentum, "momentum").copy_(held(self.avg, "avg"))
        self.round = s

    def _close_housekeeping(self) -> None:
        """A run that finished waits up to ``timeout_s`` for its last housekeeping (snapshot, cleanup). A
        region that stops (or fails) calls it off: the shards not yet sent are dropped, the ones on the way
        get ``CANCEL_WAIT_S``. Half-written, a snapshot is in no manifest, and the rounds after the previous
        one are still kept."""
        job, mb = self._hk, self.snap_ex.mailbox if self.snap_ex is not None else None
        if job is not None:
            if not self._finished and mb is not None:
                mb.close(wait=False)
            t0 = time.perf_counter()
            ended = job.wait(self.xr.timeout_s if self._finished else CANCEL_WAIT_S)
            shot = job.result().snapshot if ended else None
            if ended and (self._finished or shot is None or shot[3] is None):
                # logged: done (with the seconds the end waited for it), or failed
                self._reap(end_wait_s=round(time.perf_counter() - t0, 3))
            else:
                self._hk = None
                if self._hk_snap:
                    why = (
                        f"not done after timeout_s ({self.xr.timeout_s:g} s)"
                        if self._finished
                        else "the region stops"
                    )
                    self._log({"event": "xr_snapshot_abandoned", "round": self._hk_snap, "reason": why})
        if mb is not None:
            mb.close(wait=False)
