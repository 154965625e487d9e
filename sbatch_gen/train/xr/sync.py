"""The outer sync's common part: who moves which shard, the mailbox, theta0 alignment, state and timings.

Inside a region every rank holds the same parameters (DDP). Across regions nothing is shared but the
mailbox (:mod:`.protocol`, :mod:`.membership`). The two algorithms are subclasses:
:class:`.diloco.DiLoCo` (an outer Nesterov round every H steps; elastic: rounds close without absent
regions, which fast-forward when they return) and :class:`.grad.GradSync` (gradients averaged every
step, strict). :func:`.modes.create` picks one.

All-or-nothing: every rank learns about any rank's failure (timeouts, checksums, layouts) before
anything is changed, raises the same error, and the parameters and outer state stay as they were.

**Who holds the outer state.** Since every rank of a region holds the same parameters, the outer step
is the same on each: only the region's *leaders* (the shard owners: local rank 0 of each node, or rank
0 alone with ``node_leaders: false``) hold the flat fp32 buffers (DiLoCo: ``theta_outer``, momentum,
the delta and the average, 16 B/param; grad mode: the gradient and the average, 8 B/param), and all of
them take the same step with the same bits. The other ranks hold none: after each round rank 0
broadcasts the new parameters (grad mode: gradients) in place over the region. A leader keeps the
buffers on the training device with ``outer_device: auto`` while they fit in ``outer_device_max_gib``,
else in host memory (pinned beside a GPU; the blocked CPU kernels run the step there). Checkpoints:
leaders put ``theta_outer``/momentum into :meth:`state_dict`, DCP stores one copy, every leader loads it.

**A sharded region (FSDP2).** Each rank holds a Shard(0) slice of every parameter: one contiguous range of
the canonical flat layout each. Every rank is then an owner: it keeps the buffers for its own ranges only
(:attr:`local_numel` elements), uploads and averages the shards cut from them, and writes the outer step
into its local shards; no broadcast follows. Its shards are cut unlike a DDP region's: readers take what
overlaps their own (:mod:`.exchange`), so regions of any shape average the same bits.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sbatch_gen.xr_options import CrossRegion

from .errors import XRError, XRLayoutError, XRSettingsError
from .exchange import Exchange, theta0_extra
from .flat import FlatParams
from .membership import Membership
from .protocol import TAG_INIT, Mailbox, Manifest, digest, digest_of_digests
from .region import Region, held
from .rounds import RoundResult
from .store import Store, make_store, probe_create

log = logging.getLogger("sbatch_gen.train")
# The phases of a round in its record (xr_<phase>); xr_total_s is their sum
ROUND_PARTS = ("upload_s", "wait_s", "download_s", "reduce_s", "broadcast_s", "outer_step_s", "cleanup_s")
LATE_WARN_AFTER = 3  # consecutive rounds without this region's payload before it warns
GIB = 1 << 30


def outer_placement(xr: CrossRegion, device: torch.device, nbytes: int) -> tuple[torch.device, bool, str]:
    """Where a leader keeps ``nbytes`` of outer state: ``(device, pinned host memory?, why)``. The choice
    never changes a bit of the result (the kernels round alike on every device), only memory and speed."""
    cpu, pin = torch.device("cpu"), torch.device(device).type == "cuda"
    if xr.outer_device == "cpu":
        return cpu, pin, "outer_device: cpu"
    if nbytes > xr.outer_device_max_gib * GIB:
        return (
            cpu,
            pin,
            (f"outer state {nbytes / GIB:.3g} GiB is above outer_device_max_gib {xr.outer_device_max_gib:g}"),
        )
    if torch.device(device).type == "cpu":
        return cpu, False, "the training device is the CPU"
    return (
        torch.device(device),
        False,
        (f"outer state {nbytes / GIB:.3g} GiB fits in outer_device_max_gib {xr.outer_device_max_gib:g}"),
    )


class OuterSync:
    """See the module docstring. Collective: every rank of the region constructs it."""

    # The flat fp32 buffers a leader holds: name -> (pinned when in host memory beside a GPU: it crosses
    # PCIe every round; zero-filled at the start). None on the other ranks.
    BUFFERS: dict[str, tuple[bool, bool]] = {"work": (True, False), "avg": (True, False)}
    work: torch.Tensor | None
    avg: torch.Tensor | None

    def __init__(
        self,
        xr: CrossRegion,
        model: nn.Module,
        device: torch.device,
        dist,
        run_dir: Path | None = None,
        log: Callable[[dict], None] | None = None,
        *,
        store: Store | None = None,
        poll_min_s: float = 0.002,
        poll_max_s: float = 1.0,
    ) -> None:
        self.xr = xr
        self.mode = xr.sync
        self.device = torch.device(device)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._log = log or (lambda d: None)
        self.flat = FlatParams(model, xr.fragment_count)
        self.numel = self.flat.numel  # the payload's elements: the whole model
        self.local_numel = self.flat.local_numel  # the buffers' (a sharded region: this rank's shards)
        self.sharded = self.flat.sharded
        self.outer_device, self.pinned, placement = outer_placement(xr, self.device, self.state_bytes())

        # Who moves which shard. Comm tensors live on the training device (NCCL wants CUDA, gloo CPU).
        self.group = Region(dist, self.device)
        owner_ranks = self._owner_ranks(dist) if not self.sharded else self._shard_owners()
        self.group.set_leaders(owner_ranks)
        self.leader = self.group.is_leader  # holds the outer state
        self.mailbox: Mailbox | None = None
        self.group.on_each(
            lambda: self._open_mailbox(store, poll_min_s, poll_max_s), active=self.group.rank in owner_ranks
        )
        self.membership = (
            Membership(
                self.mailbox,
                xr.quorum,
                xr.grace_s,
                job=os.environ.get("SLURM_JOB_ID", ""),
                settings=xr.round_settings(),
            )
            if self.mailbox is not None
            else None
        )
        self.ex = Exchange(
            xr,
            self.group,
            self.mailbox,
            self.membership,
            self.numel,
            self.flat.layout,
            owner_ranks,
            self.outer_device,
            self.device,
            pieces=self.flat.held() if self.sharded else None,
            local_at=self.flat.local_at,
            buf_numel=self.local_numel,
            params=list(zip(self.flat.canonical, self.flat.names, strict=False)),
        )
        self._allocate_buffers()
        self._log_outer_state(placement, owner_ranks)
        self.round = 0
        self.aligned = False
        self.tokens = 0  # the region's tokens since the last round (the trainer passes region-wide counts)
        self.late_streak = 0

    def _owner_ranks(self, dist) -> list[int]:
        """The shard owners (the leaders): local rank 0 of each node, in node order, or rank 0 alone
        without ``node_leaders``. Collective."""
        rank, local_rank = self.group.rank, int(getattr(dist, "local_rank", 0))
        node = int(getattr(dist, "node_rank", 0))
        nodes = self.group.all_gather((node, local_rank, rank))
        if self.xr.node_leaders:
            leaders = sorted({n: r for n, lr, r in nodes if lr == 0}.items())
            if [n for n, _ in leaders] != list(range(len(leaders))):
                raise ValueError(f"node ranks of the local-rank-0 processes are not 0..N-1: {leaders}")
            owner_ranks = [r for _, r in leaders]
        else:
            owner_ranks = [0]
        if 0 not in owner_ranks:
            raise ValueError("rank 0 must be a node leader (local rank 0 of node 0)")
        return owner_ranks

    def _shard_owners(self) -> list[int]:
        """A sharded region: every rank owns the shards of its own parameter slices (the mesh's rank must
        be the region's rank: one 1-D mesh over the whole region)."""
        if (self.flat.world, self.flat.rank) != (self.group.world, self.group.rank):
            raise ValueError(
                f"the parameters are sharded over a mesh of {self.flat.world} ranks (this one {self.flat.rank}), "
                f"the region has {self.group.world} (this one {self.group.rank}): the mesh must span the region"
            )
        return list(range(self.group.world))

    def _open_mailbox(self, store: Store | None, poll_min_s: float, poll_max_s: float) -> None:
        """A leader's mailbox (run through :meth:`Region.on_each`: e.g. S3 credentials missing on one node,
        every rank must hear about it); refused when elastic rounds meet a store without conditional
        creates."""
        xr = self.xr
        mb = Mailbox(
            store if store is not None else make_store(xr.transport, xr.threads),
            xr.run_id,
            xr.region,
            xr.regions,
            timeout_s=xr.timeout_s,
            keep_rounds=xr.keep_rounds,
            threads=xr.threads,
            poll_min_s=poll_min_s,
            poll_max_s=poll_max_s,
        )
        if self.group.rank == 0 and xr.elastic and not probe_create(mb.store, xr.run_id):
            mb.close()
            raise XRError(
                f"the mailbox {mb.store.describe()} does not refuse a second conditional create (S3 "
                f"If-None-Match ignored): rounds could be closed twice, so min_regions "
                f"({xr.min_regions}) below the {len(xr.regions)} regions is refused. Use a store with "
                "conditional writes (AWS S3, MinIO, a shared filesystem) or min_regions: all"
            )
        self.mailbox = mb

    def _log_outer_state(self, placement: str, owner_ranks: list[int]) -> None:
        """The record of where the outer state lives, and how much of it each rank holds (collective)."""
        self._log(
            {
                "event": "xr_outer_state",
                "device": str(self.outer_device),
                "pinned": self.pinned,
                "why": placement,
                "leaders": owner_ranks,
                "numel": self.numel,
                "bytes_per_rank": self.group.all_gather(self.outer_bytes()),
            }
        )

    def _allocate_buffers(self) -> None:
        """work: flat params, the payload source; avg: the regions' weighted average. See BUFFERS."""
        for name, (pin, zero) in self.buffers().items():
            buf = None
            if self.leader:
                new = torch.zeros if zero else torch.empty
                buf = new(
                    self.local_numel,
                    dtype=torch.float32,
                    device=self.outer_device,
                    pin_memory=pin and self.pinned,
                )
            setattr(self, name, buf)

    # -- theta0 ----------------------------------------------------------------------------------------
    def align(self, step: int = 0) -> None:
        """Make every region start from the same parameters: the first region of ``regions`` publishes
        theta0 (fp32); the others adopt it. Verified by hash after it is written into the model. No-op
        once aligned (e.g. resumed from a checkpoint). If theta0 is already in the mailbox (the first
        region restarted from scratch), every region adopts that one."""
        if self.aligned:
            return
        t0 = time.perf_counter()
        first = self.xr.regions[0]
        exists = self.group.on_rank(lambda: self.ex.mb().read_manifest(TAG_INIT, first) is not None)
        flat = self.flat.gather(held(self.work, "work")) if self.leader else None
        if self.xr.region == first and not exists:
            said = {"settings": self.xr.round_settings()}  # the adopters check it (and say if they refuse)
            self.ex.upload(
                TAG_INIT,
                first,
                "init",
                step,
                flat,
                0,
                extra_fn=lambda shards: {**theta0_extra(shards), **said},
            )
            action = "published"
        else:
            expect = self.ex.expect("init")

            def theta0() -> Manifest:
                ms = self.ex.ms()
                try:
                    got = self.ex.mb().wait(
                        TAG_INIT,
                        [first],
                        expect,
                        step=step,
                        check=lambda m, r: ms.check_settings(m, TAG_INIT, r),
                    )
                except XRSettingsError as e:  # the first region's wait for this one's claims ends too
                    ms.refuse(TAG_INIT, step, str(e))
                    raise
                assert got is not None  # None only when waiting in slices (slice_s)
                return got[first]

            self.ex.fetch(TAG_INIT, self.group.on_rank(theta0), flat, self.ex.fp32_plan)
            if self.leader:
                self.flat.scatter(held(flat, "theta0"))
            action = "adopted"
        self._share_params()
        fingerprint = self._verify_init(flat)
        self._aligned()
        self.aligned = True
        if self.xr.payload_dtype != "fp32":
            self.ex.drop_staging("fp32")  # theta0's staging is not needed any more
        self._log(
            {
                "event": "xr_align",
                "step": step,
                "region": self.xr.region,
                "action": action,
                "from_region": first,
                "digest": fingerprint,
                "seconds": round(time.perf_counter() - t0, 3),
            }
        )

    def _aligned(self) -> None:
        """Subclass hook: the model holds theta0."""

    def _verify_init(self, scratch: torch.Tensor | None) -> str:
        """Hash what the MODEL now holds (not a copy; each leader its own shards) and compare with the
        published theta0."""

        def published():
            mb = self.ex.mb()
            m = mb.read_manifest(TAG_INIT, self.xr.regions[0])
            if m is None:
                raise XRError(f"theta0 manifest vanished from {mb.store.describe()}")
            return m.extra.get("theta0"), [[x.start, x.start + x.numel] for x in m.shards]

        want, cut = self.group.on_rank(published)
        plan = self.ex.fp32_plan
        if cut != [list(b) for b in plan.bounds]:  # cut elsewhere: each rank compares the model with the
            return self._verify_copy(scratch, want)  # verified bytes it fetched
        flat = self.flat.gather(held(scratch, "work")) if self.leader else None
        mine = (
            [
                (s, digest(flat[lo:hi].cpu().contiguous().numpy().data))
                for s in self.ex.owned(plan)
                for lo, hi in [self.ex.at(plan, s)]
            ]
            if flat is not None
            else []
        )
        parts = dict(x for lst in self.group.all_gather(mine) for x in lst)
        got = digest_of_digests(parts[i] for i in range(len(plan)))
        if got != want:
            raise XRLayoutError(
                f"region {self.xr.region!r}: parameters after alignment hash to {got[:16]}, theta0 published by "
                f"{self.xr.regions[0]!r} hashes to {str(want)[:16]}: alignment was not written into the model"
            )
        return got

    def _verify_copy(self, fetched: torch.Tensor | None, want: str) -> str:
        """theta0 published in shards cut unlike this region's (another shape): every shard was verified
        by its digest when fetched; each leader checks that the model now holds exactly those values."""

        def same() -> None:
            got = self.flat.gather(held(self.avg, "avg"))
            if not torch.equal(got, held(fetched, "theta0")):
                raise XRLayoutError(
                    f"region {self.xr.region!r}: parameters after alignment differ from theta0 published by "
                    f"{self.xr.regions[0]!r}: alignment was not written into the model"
                )

        self.group.on_each(same, active=self.leader)
        return want

    # -- the trainer's interface ---------------------------------------------------------------------------
    def catch_up(self, step: int) -> int | None:
        """At start-up, after :meth:`align`: bring the region up to the run. Returns the step to continue
        from when that differs from ``step``."""
        return None

    def before_optimizer_step(self, step: int, tokens: int) -> None:
        """grad mode: replace ``.grad`` with the token-weighted average over regions. diloco: no-op."""

    def after_optimizer_step(self, step: int, tokens: int) -> dict | None:
        """The round's record for metrics.jsonl when a round ran in this step."""
        return None

    def finish(self, step: int) -> dict | None:
        """After the last step: the round still in flight, finished (``overlap: eager``); else None."""
        return None

    def leave(self, step: int, reason: str) -> None:
        """A planned stop: tell the other regions not to wait for this one (rank 0 writes; best effort)."""
        if self.group.rank != 0 or self.membership is None:
            return
        try:
            self.membership.announce("leaving", self.round, step)
            self._log({"event": "xr_leave", "step": step, "round": self.round, "reason": reason})
        except Exception as e:  # noqa: BLE001 - the others then wait grace_s: slower, still correct
            self._log({"event": "xr_leave_failed", "step": step, "error": str(e)})

    def _joined(self, step: int) -> None:
        if self.group.rank == 0:
            self.ex.ms().announce("joined", self.round, step)

    # -- shared by the subclasses ----------------------------------------------------------------------
    def _now(self) -> float:
        return self.ex.now()

    def buffers(self) -> dict[str, tuple[bool, bool]]:
        """The flat buffers a leader holds with these options (:attr:`BUFFERS`)."""
        return self.BUFFERS

    def state_bytes(self) -> int:
        """Bytes of the flat buffers a leader holds (:meth:`buffers`); a sharded region's ranks hold them
        for their own shards only."""
        return 4 * self.local_numel * len(self.buffers())

    def outer_bytes(self) -> int:
        """Bytes of flat buffers this rank holds: :meth:`state_bytes` on a leader, 0 on the other ranks."""
        return sum(t.nbytes for t in (getattr(self, n, None) for n in self.buffers()) if t is not None)

    def _share_params(self) -> float:
        """The parameters, as rank 0 holds them, into every rank of the region (in place); the seconds
        it took."""
        return self._share(self.flat.tensors())

    def _share(self, tensors: list[torch.Tensor]) -> float:
        """``tensors`` (parameters or gradients, or some of them), as rank 0 holds them, into every rank of
        the region (in place); the seconds it took. A sharded region: nothing to do (each rank wrote its own
        shards), 0."""
        if self.sharded:
            return 0.0
        t0 = self._now()
        self.group.broadcast_tensors(tensors, src=0)
        return self._now() - t0

    def _saved(self, name: str) -> Any:
        """The flat buffer ``name`` as a checkpoint holds it: itself, or (a sharded region) one DTensor per
        parameter placed like it (views of the buffer: DCP saves this rank's shards and loads into them,
        resharded when the region comes back with another world size)."""
        buf = getattr(self, name)
        return self.flat.as_dtensors(held(buf, name)) if self.sharded else buf

    def _cleanup(self, r: int, need_snapshot: bool) -> None:
        self._log_cleanup(r, self._cleanup_now(self.ex, r, need_snapshot))

    def _cleanup_now(self, ex: Exchange, r: int, need_snapshot: bool) -> str | None:
        """rank 0: delete the rounds ``keep_rounds`` behind ``r`` (through ``ex``'s mailbox); the error or
        None. Old rounds left behind do not hurt training."""
        if self.group.rank != 0:
            return None
        try:
            ex.ms().cleanup(r, self.xr.keep_rounds, len(ex.plan), need_snapshot=need_snapshot)
        except Exception as e:  # noqa: BLE001 - see above
            return str(e)
        return None

    def _log_cleanup(self, r: int, error: str | None) -> None:
        if error is not None:
            self._log({"event": "xr_cleanup_failed", "round": r, "error": error})

    def _record(self, step: int, res: RoundResult, t: dict) -> dict:
        """The round's fields in the step's metrics record."""
        out: dict[str, Any] = {"xr_round": self.round, "xr_step": step}
        for k in ROUND_PARTS:
            out[f"xr_{k}"] = t[k]
        out["xr_total_s"] = t["t_end"] - t["t_start"]
        out["xr_download_MBps"] = res.bytes_down / t["download_s"] / 1e6 if t["download_s"] > 0 else 0.0
        out["xr_bytes_up"] = res.bytes_up
        out["xr_bytes_down"] = res.bytes_down
        out["xr_tokens"] = res.tokens
        out["xr_reused"] = res.reused
        out["xr_retries"] = res.retries  # object-store requests retried in this round (503s, broken bodies)
        # membership: who took part, who was late or away, who closed the round and why
        c = res.commit
        out["xr_members"] = res.members
        out["xr_absent"] = [r for r in self.xr.regions if r not in c.members]
        out["xr_late"] = res.late
        out["xr_closed_by"] = c.closed_by
        out["xr_close_reason"] = c.reason
        self.late_streak = self.late_streak + 1 if res.late else 0
        if res.late:
            self._log(
                {
                    "event": "xr_late",
                    "step": step,
                    "round": self.round,
                    "members": res.members,
                    "streak": self.late_streak,
                }
            )
            if self.late_streak >= LATE_WARN_AFTER:
                log.warning(
                    "region %s missed the last %d rounds (its deltas were dropped): the others closed them "
                    "after grace_s=%gs. If this region is just slower, raise cross_region.grace_s.",
                    self.xr.region,
                    self.late_streak,
                    self.xr.grace_s,
                )
        return out

    def state_dict(self) -> dict:
        return {"round": int(self.round), "aligned": int(self.aligned), "tokens": int(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        self.round = _as_int(state.get("round", 0))
        self.aligned = bool(_as_int(state.get("aligned", 0)))
        self.tokens = _as_int(state.get("tokens", 0))

    def close(self) -> None:
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox.store.close()


def _as_int(v) -> int:
    return int(v.item()) if isinstance(v, torch.Tensor) else int(v)
