"""Streaming DiLoCo (``overlap: streaming``; Douillard et al. 2025, arXiv 2501.18512), elastic.

The parameters are split into F fragments (:mod:`.fragments`); the flat buffers hold them one after the
other. Fragment p is synced once every H steps, at its own offset: round k starts at
:func:`~.fragments.round_step` ``(k)`` and syncs fragment ``p = (k-1) mod F``. With tau =
``fragment_delay_steps``, over the fragment's elements only:

1. at step s = round_step(k): ``delta_p = theta_outer_p - x_p`` (x: the live parameters), published;
   its exchange runs in a thread of the leaders during the next tau inner steps (tau = 0: training waits);
2. at step s + tau: the committed average ``g_p`` of the members' deltas (as decoded from the wire, the
   same bits in every region) takes the outer Nesterov step ``m_p = mu*m_p + g_p;
   theta_outer_p -= lr*(g_p + mu*m_p)``; then the merge ``x_p = theta_outer_p + alpha*(x_p -
   theta_outer_p)``: the local parameters, which trained on for tau steps, keep weight alpha
   (``fragment_alpha``; 0 is DiLoCo's replace).

The shared outer state thus advances by committed averages only and stays bit-identical across regions;
a region's model differs from it by its own local training since each fragment's last round (the
part alpha kept of it). Everything else is DiLoCo's: rounds are elastic one by one (membership, late and
absent regions, leave and rejoin), a snapshot holds every fragment's outer state, a returning region
replays each committed round on its fragment. At most one round is in flight (tau is below H/F). After
the last step, :meth:`StreamingDiLoCo.finish` joins the round in flight and gives the model
``theta_outer`` for every fragment, so every region ends on the same parameters (the local steps each
fragment took since its last round are dropped there).

Sparse payloads (``payload_dtype: sparse``) take DiLoCo's error feedback fragment by fragment: round k
publishes the fragment's ``p = delta_p + beta * e_p`` (its shards cut into chunks as for every payload), and
``e_p`` becomes ``p - q`` (q: the wire values) when the round is merged with this region's payload in the
commit, ``p`` when it was late, and stays as it was when the round fails. While the round is in flight
``e_p`` holds ``p`` and ``own`` the wire values, as with overlap eager, so a region resumed with the round
in flight publishes the same bytes again; the other fragments' ranges of ``e`` wait for their own rounds.
"""

from __future__ import annotations

import torch

from .diloco import DiLoCo
from .errors import XRBehind, XRError, XRNoQuorum
from .exchange import Exchange
from .fragments import fragment_of, round_at, round_step
from .protocol import round_tag
from .region import held
from .rounds import RoundResult, run_round
from .sync import _as_int


class StreamingDiLoCo(DiLoCo):
    # the fragment in flight: its delta as published, at its own offsets (a resumed region publishes it again)
    STREAMING_BUFFERS = {"own": (True, True)}

    def buffers(self) -> dict[str, tuple[bool, bool]]:
        out = {**self.BUFFERS, **self.STREAMING_BUFFERS}
        if self.xr.payload_dtype == "sparse":
            out.update(self.SPARSE_BUFFERS)
        return out

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        xr = self.xr
        self.nfrag, self.tau, self.alpha = xr.fragments, xr.fragment_delay_steps, xr.fragment_alpha
        self.frag_ex = [self.ex.for_fragment(p, *self.flat.fragment_payload(p)) for p in range(self.nfrag)]
        bg = self.group.background() if self.tau > 0 else None  # collective: the rounds' own group
        self.bg_frag_ex = [ex.in_background(bg) for ex in self.frag_ex] if bg is not None else None
        # tokens each fragment's next round carries: the region's tokens since that fragment's last round
        self.frag_tokens = [0] * self.nfrag
        self.launch_s = 0.0  # what the start of the round in flight held training up for (its record's)

    def _part(self, buf: torch.Tensor | None, p: int) -> torch.Tensor | None:
        """Fragment ``p``'s range of a flat buffer (None on the ranks that hold none)."""
        if buf is None:
            return None
        lo, hi = self.flat.fragment(p)
        return buf[lo:hi]

    # -- the schedule (DiLoCo's hooks) ----------------------------------------------------------------------
    def _round_step(self, r: int) -> int:
        return round_step(r, self.xr.inner_steps, self.nfrag)

    def _round_gap(self) -> int:
        return self.xr.inner_steps // self.nfrag

    def _in_background(self, b: int) -> tuple[Exchange | None, torch.Tensor | None, torch.Tensor | None]:
        """(sparse: the fragment's payload p, which its range of ``error`` holds while the round is in
        flight; ``own`` holds its wire values there)."""
        p = fragment_of(b, self.nfrag)
        ex = self.bg_frag_ex[p] if self.bg_frag_ex is not None else None
        return ex, self._part(self.error if self.sparse else self.own, p), self._part(self.avg, p)

    def _in_foreground(self, b: int) -> tuple[Exchange, torch.Tensor | None]:
        p = fragment_of(b, self.nfrag)
        return self.frag_ex[p], self._part(self.avg, p)

    def _fragments_saved(self) -> int:
        return self.nfrag

    def _reset_tokens(self) -> None:
        self.tokens = 0
        self.frag_tokens = [0] * self.nfrag

    # -- the live rounds ------------------------------------------------------------------------------------
    def after_optimizer_step(self, step: int, tokens: int) -> dict | None:
        """Count tokens; merge the round in flight tau steps after it started; start the round due at this
        step. Returns the record of what ran (None: nothing). ``xr_adopted_step``: fast-forwarded."""
        self.frag_tokens = [n + int(tokens) for n in self.frag_tokens]
        if not self.aligned:
            raise XRError("OuterSync.align() must run before the first outer round")
        k = round_at(step, self.xr.inner_steps, self.nfrag)
        if self.inflight and step >= self._round_step(self.inflight) + self.tau:
            rec = self._merge_inflight(step)
            if k and "xr_adopted_step" not in rec:  # (only when steps were skipped: never later than due)
                started = self._start(k, step)
                rec.update(
                    xr_inflight=started["xr_inflight"],
                    xr_exposed_s=rec["xr_exposed_s"] + started["xr_exposed_s"],
                )
            return rec
        return self._start(k, step) if k else None

    def _start(self, k: int, step: int) -> dict:
        """Round ``k`` at its step: the fragment's delta published; with tau = 0 the round is waited for and
        merged at once, else it runs in the background until :meth:`_merge_inflight`. Sparse payloads: the
        fragment's p = delta + beta * e is published instead; with tau = 0 its e is resolved as without
        overlap, else it holds p while the round is in flight and ``own`` the wire values (as eager's)."""
        p = fragment_of(k, self.nfrag)
        part = self.flat.fragment(p)
        t0 = self._now()
        own = self._part(self.own, p)
        if self.leader:
            self.flat.delta_part_into(held(self.theta_outer, "theta_outer"), held(self.own, "own"), *part)
        tokens = self.frag_tokens[p]
        ex = self.frag_ex[p]
        if self.tau == 0:
            pre = self._sparse_payload(own, ex, part) if self.sparse else None
            try:
                res = run_round(
                    ex, round_tag(k), "delta", step, own, self._part(self.avg, p), tokens, pre=pre
                )
            except XRBehind:
                return self._fast_forward(step, "behind") or {}
            except XRNoQuorum:
                self.pending = k
                raise
            if pre is not None:
                self._keep_residual(pre, own, sent=not res.late, ex=ex, part=part)
            self.frag_tokens[p] = 0
            return self._merge(k, step, res, t0, res.times["t_end"])
        if self.sparse:
            self._inflight_payload(part)
        pre = ex.encode("delta", own)  # nothing crosses the WAN while training waits
        if self.sparse:
            ex.decode_into("delta", pre, own)  # own = the wire values every region will average
        self.frag_tokens[p] = 0
        self._launch(k, step, tokens, pre)
        self.launch_s = self._now() - t0
        return {"xr_step": step, "xr_inflight": k, "xr_fragment": p, "xr_exposed_s": self.launch_s}

    def _merge_inflight(self, step: int) -> dict:
        """tau steps after round ``inflight`` started: join its exchange (training waits here only for what
        it takes beyond those steps) and merge it."""
        k, t0 = self.inflight, self._now()
        try:
            res = self._join()
        except XRBehind:  # the run went on without this region: catch up
            self._drop_inflight()
            return self._fast_forward(step, "behind") or {}
        except XRNoQuorum:
            self.pending = k
            raise
        t1 = self._now()
        if self.sparse:  # (own holds the round's wire values at the fragment's offsets)
            self._resolve_error(res.late, self.flat.fragment(fragment_of(k, self.nfrag)))
        rec = self._merge(k, step, res, t0, t1)
        rec.update(xr_join_s=t1 - t0, xr_launch_s=self.launch_s)
        return rec

    def _merge(self, k: int, step: int, res: RoundResult, t0: float, t1: float) -> dict:
        """Round ``k``'s committed average into its fragment: the outer step on the fragment's outer state,
        then its live parameters merged with the new ``theta_outer`` (``fragment_alpha``). Its record."""
        p = fragment_of(k, self.nfrag)
        lo, hi = self.flat.fragment(p)
        self._outer_step(self.avg, scatter=False, part=(lo, hi))
        tc = self._now()
        if self.leader:
            theta = held(self.theta_outer, "theta_outer")
            merged = theta
            if self.alpha != 0.0:  # theta + alpha * (x - theta) into `work`, one rounding per op
                merged = held(self.work, "work")
                x = self.flat.gather_part(merged, lo, hi)
                torch.sub(x, theta[lo:hi], out=x).mul_(self.alpha).add_(theta[lo:hi])
            self.flat.scatter_part(merged, lo, hi)
        self._share(self.flat.tensors_part(lo, hi))
        self.round, self.inflight, self.inflight_tokens, self.pending = k, 0, 0, 0
        t2 = self._now()
        snap_s = self._housekeeping(k, res.members, step)
        t3 = self._now()
        t = self._with_boundary(
            res, outer_step_s=tc - t1, broadcast_s=res.times["broadcast_s"] + (t2 - tc), cleanup_s=t3 - t2
        )
        rec = self._record(step, res, t, snap_s)
        rec.update(xr_fragment=p, xr_exposed_s=t3 - t0)
        return rec

    # -- returning regions, the end --------------------------------------------------------------------------
    def _replay(self, r: int) -> None:
        p = fragment_of(r, self.nfrag)
        self.frag_ex[p].replay(round_tag(r), "delta", self._part(self.avg, p))
        self._outer_step(self.avg, scatter=False, part=self.flat.fragment(p))

    def _run_pending(self, r: int) -> dict:
        if self.inflight == r:  # resumed with it in flight (relaunched): merge it now
            return self._merge_inflight(self._round_step(r) + self.tau)
        return self._start(r, self._round_step(r))

    def _drop_inflight(self) -> None:
        super()._drop_inflight()
        self.inflight_tokens = 0

    def _finish(self, step: int) -> dict | None:
        """After the last step: the round in flight joined and merged, then the model takes the shared
        outer state for every fragment, so every region ends on the same parameters."""
        rec = None
        if self.inflight:
            rec = self._merge_inflight(step)
            if "xr_adopted_step" in rec:
                return rec
            rec["xr_final"] = True
        if self.leader:
            self.flat.scatter(held(self.theta_outer, "theta_outer"))
        self._share_params()
        return rec

    # -- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """DiLoCo's, plus the round in flight (its number and tokens; leaders: its delta, in ``own``) and
        each fragment's tokens since its last round."""
        out = super().state_dict()
        out.update(
            inflight=int(self.inflight),
            inflight_tokens=int(self.inflight_tokens),
            frag_tokens=torch.tensor(self.frag_tokens, dtype=torch.int64),
        )
        if self.leader:
            out["own"] = self._saved("own")
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.inflight = _as_int(state.get("inflight", 0))
        self.inflight_tokens = _as_int(state.get("inflight_tokens", 0))
        saved = state.get("frag_tokens")
        self.frag_tokens = [int(x) for x in saved.tolist()] if saved is not None else [0] * self.nfrag
        if len(self.frag_tokens) != self.nfrag:
            raise XRError(
                f"checkpoint has tokens of {len(self.frag_tokens)} fragments, this run {self.nfrag}"
            )
