"""Per-step gradient averaging across regions (``sync: grad``), strict: every round waits for every region.

After backward (already averaged by DDP inside the region) the flat gradient goes through the mailbox
every step (round = step); the token-weighted average of the committed regions' gradients replaces
``.grad`` before clipping and the optimizer step: the leaders (:mod:`.sync`) write it, rank 0 broadcasts
it to the other ranks. With fp32 payloads this is one data-parallel run over every region's data. A
requeued region re-runs its steps and re-enters the committed rounds it had published, applying exactly
what the others applied; that needs ``keep_rounds`` to cover the steps between two checkpoints (there is
no outer state to fast-forward with).
"""

from __future__ import annotations

from .errors import XRBehind, XRError, XRMissingRound
from .protocol import round_tag
from .region import held
from .rounds import run_round
from .sync import OuterSync


class GradSync(OuterSync):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._pending: dict | None = None  # the record of this step's exchange, returned after the step

    def before_optimizer_step(self, step: int, tokens: int) -> None:
        if not self.aligned:
            raise XRError("OuterSync.align() must run before the first exchange")
        self.tokens += int(tokens)
        src = self.flat.gather_grads(held(self.work, "work")) if self.leader else None
        try:
            res = run_round(self.ex, round_tag(step), "grad", step, src, self.avg, self.tokens)
        except XRBehind as e:
            raise XRMissingRound(
                f"{e} (grad mode cannot fast-forward: keep_rounds must cover the steps "
                "between two checkpoints)"
            ) from None
        t = res.times
        t5 = t["t_end"]
        if self.leader:
            self.flat.scatter_grads(held(self.avg, "avg"))
        t6 = self._now()
        share_s = self._share(self.flat.grads())  # a DDP region's other ranks hold no average
        self.round, self.tokens = step, 0
        self._cleanup(step, need_snapshot=False)
        t8 = self._now()
        bcast = t["broadcast_s"] + share_s
        t.update(outer_step_s=t6 - t5, broadcast_s=bcast, cleanup_s=t8 - t6 - share_s, t_end=t8)
        self._pending = self._record(step, res, t)

    def after_optimizer_step(self, step: int, tokens: int) -> dict | None:
        out, self._pending = self._pending, None
        return out
