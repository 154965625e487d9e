"""DiLoCo across regions, elastic: an outer Nesterov round every H inner steps; regions come and go.

Every H steps each region publishes ``delta = theta_outer - theta_local``; the round's commit names the
regions that take part; everybody averages exactly those deltas (token-weighted) and takes the outer
step ``m = mu*m + g; theta_outer -= lr*(g + mu*m)``; the model takes ``theta_outer``. A region whose
delta missed the commit (late) applies the same update and goes on, so all regions stay bit-identical.

A region that was away (preempted, queued, crashed) **fast-forwards** when it returns: it replays the
committed rounds still in the mailbox, or loads the newest outer snapshot first (``theta_outer`` and
momentum, published every ``snapshot_every`` rounds by the round's first member) and replays the rounds
after it. It then continues at the run's round and step; its own data position goes on from where it
left off. The rounds between the newest snapshot and now are never cleaned up, and a snapshot is
deleted only once a newer one is complete. A snapshot crosses the WAN in the background (a thread of the
leaders, from a host copy of the outer state, a few streams at a time) while training and the next rounds
go on.

Here: the live round, overlap eager, the fast-forward, the outer state in checkpoints. Built on
:class:`.snapshots.SnapshotSync` (the snapshots and the background housekeeping); the catch-up plan is
:mod:`.rejoin`'s.
"""

from __future__ import annotations

import threading
import time

import torch

from .errors import XRBehind, XRError, XRLayoutError, XRMissingRound, XRNoQuorum
from .exchange import Exchange
from .kernels import blocks, nesterov_block_
from .overlap import InFlight
from .protocol import round_tag
from .region import held
from .rejoin import plan_catch_up, steps_into_round
from .rounds import RoundResult, run_round
from .snapshots import SnapshotSync
from .sync import ROUND_PARTS, OuterSync, _as_int

FF_ATTEMPTS = 5  # objects can vanish under a fast-forward (a newer snapshot lands): plan again this often


class DiLoCo(SnapshotSync):
    # the outer state (leaders only, see OuterSync): 16 B/param with the delta and the average
    BUFFERS = {**OuterSync.BUFFERS, "theta_outer": (True, True), "momentum": (False, True)}
    # overlap eager adds this region's delta in flight, as every region decodes it (4 B/param more)
    EAGER_BUFFERS = {"own": (True, True)}
    own: torch.Tensor | None = None
    # payload_dtype sparse adds the error-feedback buffer: what this region has not sent yet (4 B/param)
    SPARSE_BUFFERS = {"error": (False, True)}
    error: torch.Tensor | None = None

    def buffers(self) -> dict[str, tuple[bool, bool]]:
        out = {**self.BUFFERS, **self.EAGER_BUFFERS} if self.xr.overlap == "eager" else dict(self.BUFFERS)
        if self.xr.payload_dtype == "sparse":
            out.update(self.SPARSE_BUFFERS)
        return out

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.pending = 0  # a round that found no quorum before a requeue: run again at start-up
        # overlap eager (see _eager_round): the round whose exchange runs in the background (0: none), its
        # tokens, the factor of `own` in the working model (theta_outer - early * own), the other members'
        # tokens in the last commit (-1: none seen yet; estimates this region's weight in the next)
        self.eager = self.xr.overlap == "eager"
        self.inflight, self.inflight_tokens, self.early, self.others = 0, 0, 0.0, -1
        self._job: InFlight[RoundResult] | None = None
        # payload_dtype sparse: the error feedback (see _sparse_payload); whether a checkpoint restored it
        self.sparse = self.xr.payload_dtype == "sparse"
        self.error_restored = False
        bg = self.group.background() if self.eager else None  # collective: a process group of its own
        self.bg_ex = self.ex.in_background(bg) if bg is not None else None
        self._init_housekeeping()  # collective

    def _aligned(self) -> None:
        if self.leader:
            self._mutable()
            held(self.theta_outer, "theta_outer").copy_(self.flat.gather(held(self.work, "work")))

    # -- the live round ----------------------------------------------------------------------------------
    def after_optimizer_step(self, step: int, tokens: int) -> dict | None:
        """Count tokens; every ``inner_steps`` steps run an outer round and return its record. A record
        with ``xr_adopted_step`` means the region was behind and fast-forwarded: continue from that step."""
        self.tokens += int(tokens)
        if step % self.xr.inner_steps != 0:
            return None
        if not self.aligned:
            raise XRError("OuterSync.align() must run before the first outer round")
        return self._round(step // self.xr.inner_steps, step)

    def _round(self, r: int, step: int) -> dict:
        if self.eager:
            return self._eager_round(r, step)
        # delta = theta_outer - theta_local (the outer "gradient"; note the sign)
        delta = (
            self.flat.delta_into(held(self.theta_outer, "theta_outer"), held(self.work, "work"))
            if self.leader
            else None
        )
        pre = self._sparse_payload(delta) if self.sparse else None
        try:
            res = run_round(self.ex, round_tag(r), "delta", step, delta, self.avg, self.tokens, pre=pre)
        except XRBehind:
            return self._fast_forward(step, "behind") or {}
        except XRNoQuorum:
            self.pending = r
            raise
        t = res.times
        if pre is not None:
            self._keep_residual(pre, delta, sent=not res.late)
        t5 = t["t_end"]
        # Everything that can fail (the exchange) is behind us and only wrote into `avg`.
        self._outer_step(self.avg)
        t6 = self._now()
        share_s = self._share_params()
        self.round, self.tokens, self.pending = r, 0, 0
        snap_s = self._housekeeping(r, res.members, step)
        t8 = self._now()
        bcast = t["broadcast_s"] + share_s
        t.update(outer_step_s=t6 - t5, broadcast_s=bcast, cleanup_s=t8 - t6 - share_s, t_end=t8)
        rec = self._record(step, res, t, snap_s)
        rec["xr_exposed_s"] = rec["xr_total_s"]  # training waited for all of it
        return rec

    def _record(self, step: int, res: RoundResult, t: dict, snap_s: float | None = None) -> dict:
        rec = super()._record(step, res, t)
        rec["xr_stale"] = res.commit.stale  # absent regions the closer found crashed (heartbeat stale)
        if self.sparse:  # the share of each chunk this region's payload carries
            rec["xr_sparse_density"] = self.xr.sparse_kept / self.xr.sparse_chunk
        if snap_s is not None:
            rec["xr_snapshot_s"] = snap_s
        return rec

    # -- payload_dtype sparse: error feedback ----------------------------------------------------------
    # Per region, on its leaders: p = beta * e + delta is the payload; the round sends its chunk-wise top-k,
    # 2-bit (.sparse); e = p - (what was sent, as every region decodes it) once the round committed this
    # region's payload, else (late: its payload not in the commit) e = p: nothing of it was applied. A failed
    # round (no quorum, behind) leaves e as it was: the round runs again from the same e, or the region
    # fast-forwards past it. Each helper takes a flat range (lo, hi) of the buffers, None for all of them:
    # overlap streaming passes a fragment's, whose rounds run on that fragment's exchange.
    def _error_part(self, part: tuple[int, int] | None) -> torch.Tensor:
        """Leaders: the error-feedback buffer's range ``part`` (all of it for None)."""
        e = held(self.error, "error")
        return e if part is None else e[part[0] : part[1]]

    def _add_error(self, payload: torch.Tensor | None, part: tuple[int, int] | None = None) -> None:
        """Leaders: ``payload`` (the buffers' range ``part``, as a slice) ``+= beta * e`` over that range,
        elementwise with a separate multiply and add, block by block."""
        if not self.leader:
            return
        d, e = held(payload, "payload"), self._error_part(part)
        tmp = self.ex.scratch(min(d.numel(), self.ex.block))
        for lo, hi in blocks(d.numel(), self.outer_device, self.ex.block):
            t = torch.mul(e[lo:hi], self.xr.sparse_beta, out=tmp[: hi - lo])
            d[lo:hi].add_(t)

    def _sparse_payload(
        self, delta: torch.Tensor | None, ex: Exchange | None = None, part: tuple[int, int] | None = None
    ) -> dict:
        """Collective: ``delta`` (the work buffer; a fragment's range ``part`` of ``own``, with its exchange
        ``ex``) becomes ``beta * e + delta`` on the leaders; returns this rank's encoded shards of it
        (:meth:`.exchange.Exchange.encode`)."""
        self._add_error(delta, part)
        return (ex or self.ex).encode("delta", delta)

    def _keep_residual(
        self,
        pre: dict,
        payload: torch.Tensor | None,
        sent: bool,
        ex: Exchange | None = None,
        part: tuple[int, int] | None = None,
    ) -> None:
        """Collective, after a round that returned: ``e`` = what of ``payload`` the others did not apply
        (``part``, ``ex``: as for :meth:`_sparse_payload`)."""
        if sent:
            (ex or self.ex).residual_into("delta", pre, payload)
        if self.leader:
            self._error_part(part).copy_(held(payload, "payload"))

    # overlap eager: at a boundary p = own + beta * e is published from own; e holds p (not yet resolved) while
    # the round is in flight, so a region resumed with the round in flight publishes the same bytes again;
    # at the join e = p - own (own: the round's wire values) if the commit has this region's payload.
    # overlap streaming does the same per fragment round, over the fragment's range of own and e.
    def _inflight_payload(self, part: tuple[int, int] | None = None) -> None:
        """Leaders: ``own`` (the fresh delta; ``part``: a fragment's range of it) becomes ``p = own + beta *
        e``, and ``e`` holds p."""
        if self.leader:
            own = held(self.own, "own")
            d = own if part is None else own[part[0] : part[1]]
            self._add_error(d, part)
            self._error_part(part).copy_(d)

    def _resolve_error(self, late: bool, part: tuple[int, int] | None = None) -> None:
        """Leaders, at the join of the round in flight: ``e = p - own`` (over ``part``) unless this region
        was late."""
        if self.leader and not late:
            own = held(self.own, "own")
            self._error_part(part).sub_(own if part is None else own[part[0] : part[1]])

    def _error_reset(self, why: str) -> None:
        """Log, once, that this region's error-feedback buffer starts at zero in a run under way."""
        if self.sparse and not self.error_restored:
            self.error_restored = True  # (logged: not again)
            self._log({"event": "xr_error_feedback_reset", "round": self.round, "why": why})

    # -- overlap eager ---------------------------------------------------------------------------------------
    # At boundary b (step b*H): join round b-1's exchange (it ran during these H steps), take this phase's
    # fresh delta (start - x), advance the shared outer state by the committed average of round b-1 only,
    # load the working model theta_outer - early * own (own: the fresh delta as every region will decode
    # it; early = outer_lr * (1 + momentum) * the expected token weight: the immediate effect of the
    # region's own part on the Nesterov step), and start round b's exchange in the background. So the
    # shared state is the same bits everywhere, and a region's model differs from it only by its own fresh
    # delta, which the shared state takes in (weighted as committed, or not at all if late) a round later.
    def _working(self, out: torch.Tensor) -> torch.Tensor:
        """Leaders: the working model's flat parameters, ``theta_outer - early * own`` (``theta_outer``
        itself when nothing is applied early), always with the same ops: the bits the model was given."""
        theta, own = held(self.theta_outer, "theta_outer"), held(self.own, "own")
        if self.early == 0.0:
            return theta
        torch.mul(own, self.early, out=out)
        return torch.sub(theta, out, out=out)

    @staticmethod
    def _with_boundary(res: RoundResult, **fg: float) -> dict:
        """The background round's phase times with the boundary's own (outer step, broadcast); the total
        stays the sum of the phases, hidden or not (``xr_exposed_s`` says what training waited for)."""
        t = {**res.times, **fg}
        t["t_end"] = t["t_start"] + sum(t[k] for k in ROUND_PARTS)
        return t

    def _launch(self, b: int, step: int, tokens: int, pre: dict | None) -> None:
        """Start round ``b``'s exchange in a thread of each leader (``pre``: this leader's encoded shards;
        None: encode ``own`` there, a resumed region publishing the round it had in flight again): nothing
        of it crosses the WAN while training waits."""
        self.inflight, self.inflight_tokens = b, tokens
        if self.leader:
            ex, own, avg = self._in_background(b)
            if ex is None:
                raise XRError("internal: a leader without its background exchange")

            def job(cancel: threading.Event) -> RoundResult:
                return run_round(ex, round_tag(b), "delta", step, own, avg, tokens, pre=pre, cancel=cancel)

            self._job = InFlight(job, f"xr-round-{b}", self.outer_device)

    def _in_background(self, b: int) -> tuple[Exchange | None, torch.Tensor | None, torch.Tensor | None]:
        """Round ``b``'s background exchange, the buffer it publishes and the one it averages into (sparse:
        the payload p, which ``error`` holds while the round is in flight; ``own`` holds its wire values)."""
        return self.bg_ex, self.error if self.sparse else self.own, self.avg

    def _in_foreground(self, b: int) -> tuple[Exchange, torch.Tensor | None]:
        """Round ``b``'s exchange on the trainer's group, and the buffer its average lands in."""
        return self.ex, self.avg

    def _round_step(self, r: int) -> int:
        """The step at which round ``r`` starts."""
        return r * self.xr.inner_steps

    def _round_gap(self) -> int:
        """The fewest steps between the starts of two rounds."""
        return self.xr.inner_steps

    def _relaunch(self) -> None:
        """A region resumed with a round in flight: that round's exchange runs again (it re-enters the
        round, or publishes its saved delta again when its manifest never made it)."""
        if self.inflight and self._job is None:
            b = self.inflight
            self._launch(b, self._round_step(b), self.inflight_tokens, None)

    def _join(self) -> RoundResult:
        """Collective: wait for the round in flight; every rank gets its result or raises its error (the
        round stays in flight then, e.g. for the retry after a requeue). Leaders then hold the average."""
        self._relaunch()
        job, self._job = self._job, None

        def wait() -> RoundResult:
            if job is None:
                raise XRError("internal: a leader has no round in flight to join")
            return job.result()

        done = self.group.on_each(wait, active=self.leader)[0]
        if done is None:
            raise XRError("internal: rank 0 returned no result for the round in flight")
        ex, avg = self._in_foreground(self.inflight)
        ex.broadcast_slices(ex.expect("delta").plan, avg)
        return done

    def _drop_inflight(self) -> None:
        """The round in flight no longer matters (a fast-forward passed it): call it off."""
        if self._job is not None:
            self._job.cancel()
            self._job = None
        self.inflight, self.inflight_tokens, self.early = 0, 0, 0.0

    def _eager_round(self, b: int, step: int) -> dict:
        t0 = self._now()
        res = None
        if self.inflight:
            try:
                res = self._join()
            except XRBehind:  # the run went on without this region: catch up, this phase's steps are dropped
                self._drop_inflight()
                return self._fast_forward(step, "behind") or {}
            except XRNoQuorum:
                self.pending = b
                raise
        t1 = self._now()
        tokens, work = self.tokens, self.work
        if res is not None and self.sparse:  # (own still holds the joined round's wire values)
            self._resolve_error(res.late)
        if self.leader:  # this phase's fresh delta: where it started minus where it is (fp32)
            self.flat.delta_into(self._working(held(work, "work")), held(self.own, "own"))
        tc, snap_s = t1, None
        if res is not None:
            self._outer_step(self.avg, scatter=False)  # the shared state takes the committed average only
            tc = self._now()
            self.round = self.inflight
            self.others = sum(c.tokens for r, c in res.commit.members.items() if r != self.xr.region)
            snap_s = self._housekeeping(self.round, res.members, step)
        t2 = self._now()
        if self.sparse:
            self._inflight_payload()
        pre = self.ex.encode("delta", self.own)
        self.ex.decode_into("delta", pre, self.own)  # own = the wire values every region will average
        others = self.others if self.others >= 0 else tokens * (len(self.xr.regions) - 1)
        weight = tokens / (tokens + others) if tokens + others > 0 else 1.0
        self.early = self.xr.outer_lr * (1.0 + self.xr.outer_momentum) * weight
        if self.leader:
            self.flat.scatter(self._working(held(work, "work")))
        self._share_params()
        self.tokens, self.pending = 0, 0
        self._launch(b, step, tokens, pre)
        t3 = self._now()
        out: dict = {"xr_step": step, "xr_inflight": b, "xr_early_weight": weight}
        if res is not None:
            bcast = res.times["broadcast_s"] + (t3 - t2)
            t = self._with_boundary(res, outer_step_s=tc - t1, cleanup_s=t2 - tc, broadcast_s=bcast)
            out.update(self._record(step, res, t, snap_s))
        out.update(xr_join_s=t1 - t0, xr_exposed_s=t3 - t0)
        return out

    def finish(self, step: int) -> dict | None:
        """Collective, after the last step: wait for the round in flight and give the model the shared
        outer state (plus the steps since the last boundary, when the run does not end on one), so every
        region ends on the same parameters. None when nothing is in flight (always with overlap none).
        Once it returns, the run is finished: :meth:`close` waits for a snapshot still uploading."""
        rec = self._finish(step)
        self._finished = True
        return rec

    def _finish(self, step: int) -> dict | None:
        if not self.eager or not self.inflight:
            return None
        t0 = self._now()
        try:
            res = self._join()
        except XRBehind:
            self._drop_inflight()
            return self._fast_forward(step, "behind") or {}
        t1 = self._now()
        if self.sparse:
            self._resolve_error(res.late)
        partial = self.tokens > 0
        if self.leader and partial:  # the steps since the last boundary, kept on top of the shared state
            self.flat.delta_into(self._working(held(self.work, "work")), held(self.own, "own"))
        self._outer_step(self.avg, scatter=False)
        tc = self._now()
        self.round, self.inflight, self.early = self.inflight, 0, 0.0
        if self.leader:
            theta = held(self.theta_outer, "theta_outer")
            self.flat.scatter(
                torch.sub(theta, held(self.own, "own"), out=held(self.work, "work")) if partial else theta
            )
        self._share_params()
        snap_s = self._housekeeping(self.round, res.members, step)
        t2 = self._now()
        t = self._with_boundary(res, outer_step_s=tc - t1, cleanup_s=t2 - tc)
        rec = self._record(step, res, t, snap_s)
        rec.update(xr_join_s=t1 - t0, xr_exposed_s=t2 - t0, xr_final=True)
        return rec

    def _outer_step(
        self, avg: torch.Tensor | None, scatter: bool = True, part: tuple[int, int] | None = None
    ) -> None:
        """Leaders: Nesterov on ``theta_outer`` and (``scatter``) theta into the model, block by block: on
        the CPU each block is written into the parameters while it is still in cache. ``part``: only the
        flat range ``(lo, hi)`` (a fragment; ``avg`` holds its average at those offsets). The other ranks
        hold no outer state: :meth:`_share_params` follows."""
        if not self.leader:
            return
        self._mutable()
        theta, mom, g = (
            held(self.theta_outer, "theta_outer"),
            held(self.momentum, "momentum"),
            held(avg, "avg"),
        )
        start, end = part or (0, self.local_numel)
        direct = scatter and self.flat.direct(self.outer_device)
        tmp = self.ex.scratch(min(end - start, self.ex.block))
        for lo, hi in blocks(end - start, self.outer_device, self.ex.block):
            lo, hi = lo + start, hi + start
            nesterov_block_(
                theta[lo:hi],
                mom[lo:hi],
                g[lo:hi],
                self.xr.outer_lr,
                self.xr.outer_momentum,
                tmp[: hi - lo],
            )
            if direct:
                self.flat.scatter_range(theta, lo, hi)
        if scatter and not direct:
            self.flat.scatter_part(theta, start, end)

    # -- returning regions ---------------------------------------------------------------------------------
    def _plan(self):
        """rank 0: how to reach the run's newest committed round, or None when already there."""
        # (eager) a round in flight that the run has committed since is joined as usual, not replayed
        return plan_catch_up(self.ex.ms(), self.xr, self.round, max(self.round, self.inflight))

    def _fast_forward(self, step: int, why: str) -> dict | None:
        """Replay committed rounds (after the newest snapshot if the rounds are gone) until this region is
        at the run's round. Returns the rejoin record, or None when nothing was behind."""
        t0 = time.perf_counter()
        start = self.round
        via: list[str] = []
        replayed = 0
        last: XRBehind | None = None
        for _ in range(FF_ATTEMPTS):
            plan = self.group.on_rank(self._plan)
            if plan is None:
                break
            _latest, snap, rounds = plan
            try:
                if snap is not None:
                    self._load_snapshot(snap)
                    via.append(f"snapshot {round_tag(snap)}")
                for r in rounds:
                    self._replay(r)
                    self.round = r
                    replayed += 1
            except XRBehind as e:
                last = e  # something we planned on was cleaned up meanwhile: plan again from here
                continue
        else:
            raise XRMissingRound(
                f"region {self.xr.region!r} could not catch up with the run in {FF_ATTEMPTS} "
                f"attempts (rounds kept disappearing; last: {last}): is keep_rounds very small?"
            )
        if self.round == start:
            return None
        self._drop_inflight()  # (eager) replayed: the round in flight, if any, was among those rounds
        if self.leader:
            self.flat.scatter(held(self.theta_outer, "theta_outer"))
        self._share_params()
        self._reset_tokens()
        self.pending = 0
        into = self.group.on_rank(self._steps_into_round)
        adopted = self._round_step(self.round) + into
        rec = {
            "event": "xr_rejoin",
            "step": step,
            "adopted_step": adopted,
            "from_round": start,
            "to_round": self.round,
            "replayed": replayed,
            "via": via or ["rounds"],
            "why": why,
            "steps_into_round": into,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        self._log(rec)
        return {"xr_round": self.round, "xr_step": step, "xr_adopted_step": adopted, "xr_rejoin_from": start}

    def _replay(self, r: int) -> None:
        """A committed round from the mailbox, applied to the outer state and the model."""
        self.ex.replay(round_tag(r), "delta", self.avg)
        self._outer_step(self.avg)

    def _steps_into_round(self) -> int:
        """rank 0: how far the run is into the round after the newest commit, in inner steps
        (:func:`.rejoin.steps_into_round`; at most the steps between two rounds, :meth:`_round_gap`, - 1)."""
        return steps_into_round(self.ex.ms(), self.round, self._round_gap())

    def catch_up(self, step: int) -> int | None:
        """Start-up: fast-forward to the run, start beating (elastic), run a round that found no quorum
        before the requeue, then announce that this region has joined."""
        rec = self._fast_forward(step, "start")
        adopted = rec["xr_adopted_step"] if rec else None
        if rec:  # (sparse) joined a run under way without a checkpoint's error feedback: it starts at zero
            self._error_reset(f"started without a checkpoint, fast-forwarded to round {self.round}")
        if self.group.rank == 0 and self.membership is not None and self.xr.elastic:
            # Liveness for the others' rounds (and theirs judged by it) until leave() or close(), from now
            # on: caught up with the run. A region that crashes while it loads or replays has not beaten
            # yet (or its last incarnation's heartbeat is old): the others do not wait for it.
            self.membership.start_heartbeat(self.xr.heartbeat_s)
        self._relaunch()  # (eager) resumed with a round in flight: it runs again, in the background
        if self.pending and self.round < self.pending:
            r = self.pending
            out = self._run_pending(r)
            self._log({"event": "xr_pending_round", "step": self._round_step(r), **out})
            adopted = out.get("xr_adopted_step", adopted)
        self._joined(adopted if adopted is not None else step)
        return adopted

    def _run_pending(self, r: int) -> dict:
        """Round ``r``, which found no quorum before the requeue, run again at start-up."""
        return self._round(r, self._round_step(r))

    def _reset_tokens(self) -> None:
        """A fast-forward: the tokens counted since the last round no longer belong to any round."""
        self.tokens = 0

    def close(self) -> None:
        if self._job is not None:  # a stop with a round in flight: the checkpoint holds it, it runs again
            self._job.cancel()
            self._job = None
        self._close_housekeeping()
        if self.membership is not None:
            self.membership.stop_heartbeat()
        super().close()

    # -- state ---------------------------------------------------------------------------------------------
    def _fragments_saved(self) -> int:
        """What a checkpoint records as ``fragments``: F with overlap streaming, 0 without (the outer state's
        flat order and the round numbering depend on it)."""
        return 0

    def state_dict(self) -> dict:
        """Leaders add ``theta_outer`` and momentum (the same bits on every leader, so DCP stores one copy,
        under the keys every version used); the other ranks hold no outer state and leave them out."""
        out = {**super().state_dict(), "pending": int(self.pending), "fragments": self._fragments_saved()}
        if self.leader:  # (sharded: each rank its shards, see _saved)
            out.update(theta_outer=self._saved("theta_outer"), momentum=self._saved("momentum"))
            if self.sparse:  # the error feedback: this region's own, what it has not sent yet
                out["error"] = self._saved("error")
        if self.eager:  # the round in flight (its own delta, as published) runs again on resume
            out.update(
                inflight=int(self.inflight),
                inflight_tokens=int(self.inflight_tokens),
                early=float(self.early),
                others=int(self.others),
            )
            if self.leader:
                out["own"] = self._saved("own")
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Collective: leaders take ``theta_outer`` and momentum from ``state`` (the other ranks ignore
        them); a leader's error (missing, wrong size) raises on every rank before anything is loaded."""
        keys: tuple[str, ...] = ("theta_outer", "momentum")
        inflight = _as_int(state.get("inflight", 0))
        saved, mine = _as_int(state.get("fragments", 0)), self._fragments_saved()
        if saved != mine:
            said = {0: "without overlap: streaming"}
            raise XRLayoutError(
                f"checkpoint's outer state was saved {said.get(saved, f'with overlap: streaming, fragments {saved}')}"
                f", this run has {said.get(mine, f'overlap: streaming, fragments {mine}')}: the outer state's "
                "order and the rounds differ; resume with the checkpoint's cross_region.overlap and fragments"
            )
        if inflight and not self.eager and not mine:
            raise XRLayoutError(
                f"checkpoint has round {inflight} in flight (saved with overlap: eager): resume with "
                "cross_region.overlap: eager, which finishes that round first"
            )
        if inflight:
            keys = (*keys, "own")
        if self.sparse and "error" in state:
            keys = (*keys, "error")

        def check() -> None:
            for k in keys:
                if k not in state:
                    raise XRLayoutError(
                        f"checkpoint has no outer state {k!r} (saved without --xr-sync diloco?)"
                    )
                if self.sharded != isinstance(state[k], dict):
                    how = ("per parameter (a sharded region)", "as one flat vector (a DDP region)")
                    raise XRLayoutError(
                        f"checkpoint outer state {k!r} is saved {how[self.sharded]}, this region keeps it "
                        f"{how[not self.sharded]}: resume with the parallelism.kind it was saved with"
                    )
                if self.sharded:
                    if list(state[k]) != self.flat.names:
                        raise XRLayoutError(
                            f"checkpoint outer state {k!r} names other parameters than the model"
                        )
                    continue
                if state[k].numel() != self.numel:
                    raise XRLayoutError(
                        f"checkpoint outer state {k!r} has {state[k].numel()} elements, the model "
                        f"{self.numel}"
                    )

        self.group.on_each(check, active=self.leader)
        if self.leader:
            self._mutable()
            for k in keys:
                v, dst = state[k], getattr(self, k)
                if self.sharded:  # DCP loaded into views of dst unless the caller passed other DTensors
                    for name, d in self.flat.as_dtensors(dst).items():
                        if v[name].to_local().data_ptr() != d.to_local().data_ptr():
                            d.to_local().copy_(v[name].to_local())
                elif v is not dst:
                    dst.copy_(v.reshape(-1))
        super().load_state_dict(state)
        if self.sparse:
            self.error_restored = "error" in state
            if not self.error_restored:
                if self.leader:
                    held(self.error, "error").zero_()
                self._error_reset("the checkpoint holds no error-feedback buffer")
        self.pending = _as_int(state.get("pending", 0))
        if self.eager:  # a checkpoint without overlap: nothing in flight
            self.inflight = _as_int(state.get("inflight", 0))
            self.inflight_tokens = _as_int(state.get("inflight_tokens", 0))
            self.early = float(state.get("early", 0.0)) if self.inflight else 0.0
            self.others = _as_int(state.get("others", -1))
