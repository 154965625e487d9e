"""Outer synchronisation across regions: DiLoCo (``diloco``) and per-step gradient averaging (``grad``).

Inside a region every rank holds the same parameters (DDP). Across regions nothing is shared but the
mailbox (:mod:`.protocol`). One round, seen from one region:

1. *publish*: the flat payload (DiLoCo: ``delta = theta_outer - theta_local``; grad: the flat gradient)
   is cut into shards; shard ``s`` belongs to node ``s mod num_nodes`` and that node's local rank 0
   encodes it to the wire dtype and uploads it (thread pool). Rank 0 gathers the checksums and writes
   the region's manifest last.
2. *wait*: rank 0 polls for every other region's manifest (keeping the other ranks informed).
3. *download*: each node leader fetches its shards from every region and verifies them; then it
   averages them, weighted by each region's tokens, in the fixed order of ``regions``. Every region
   averages the same wire bytes in the same order with single-rounding elementwise ops, so every
   region gets bit-identical results, CPU or GPU.
4. *broadcast*: the averaged shards go from their owners to every rank of the region.
5. *outer step* (DiLoCo): Nesterov SGD on ``theta_outer`` (fp32), then the model takes ``theta_outer``.
   Grad mode writes the average into ``.grad`` instead.

All-or-nothing: every rank learns about any rank's failure (timeouts, checksums, layouts) before
anything is changed, raises the same error, and the parameters and outer state stay as they were.

A region that re-enters a round it already published (requeued after a crash, resumed from an older
checkpoint) does not publish again: it uses its published payload, exactly as the other regions did,
so it computes the same update they computed.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as tdist
from torch import nn

from sbatch_gen.xr_options import CrossRegion

from .errors import StoreError, XRChecksumError, XRError, XRLayoutError, XRMissingRound, XRTimeout
from .protocol import (
    ITEMSIZE,
    TAG_INIT,
    Expect,
    Mailbox,
    Manifest,
    ShardInfo,
    ShardPlan,
    digest,
    digest_of_digests,
    round_tag,
)
from .store import Store, make_store

_WIRE = {"bf16": torch.bfloat16, "fp32": torch.float32}
_ERRORS = {c.__name__: c for c in (XRError, XRTimeout, XRChecksumError, XRLayoutError, XRMissingRound, StoreError)}
_WAIT_SLICE_S = 30.0  # rank 0 reports to the other ranks at least this often while it waits for peers


def _strip(name: str) -> str:
    for pre in ("module.", "_orig_mod."):
        while name.startswith(pre):
            name = name[len(pre) :]
    return name.replace("._orig_mod.", ".").replace(".module.", ".")


def layout_fingerprint(model: nn.Module) -> str:
    items = [(_strip(n), list(p.shape), str(p.dtype)) for n, p in model.named_parameters() if p.requires_grad]
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def _err(e: BaseException) -> tuple[str, str]:
    name = type(e).__name__
    return (name if name in _ERRORS else "XRError", str(e) if name in _ERRORS else f"{name}: {e}")


def _raise(err: tuple[str, str]) -> None:
    raise _ERRORS[err[0]](err[1])


class _Region:
    """Collectives inside this region (the trainer's default process group); no-ops for one process."""

    def __init__(self, dist, comm_device: torch.device) -> None:
        self.on = bool(getattr(dist, "is_distributed", False)) and tdist.is_available() and tdist.is_initialized()
        self.rank = tdist.get_rank() if self.on else 0
        self.world = tdist.get_world_size() if self.on else 1
        self.comm_device = comm_device

    def all_gather(self, obj) -> list:
        if not self.on:
            return [obj]
        out = [None] * self.world
        tdist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj, src: int = 0):
        if not self.on:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=src)
        return box[0]

    def broadcast_tensor(self, t: torch.Tensor, src: int) -> None:
        if self.on:
            tdist.broadcast(t, src=src)

    def agree(self, err: tuple[str, str] | None) -> None:
        """Every rank raises the first error any rank saw (so nobody is left waiting in a collective)."""
        for e in self.all_gather(err):
            if e is not None:
                _raise(e)


class OuterSync:
    """See the module docstring. Built by :func:`sbatch_gen.train.xr.build_outer_sync`."""

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
        if xr.sync not in ("diloco", "grad"):
            raise ValueError(f"unknown sync mode {xr.sync!r}")
        self.xr = xr
        self.mode = xr.sync
        self.device = torch.device(device)
        self.outer_device = self.device if xr.outer_device == "auto" else torch.device("cpu")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._log = log or (lambda d: None)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.layout = layout_fingerprint(model)

        # Who moves which shard. Comm tensors live on the training device (NCCL wants CUDA, gloo CPU).
        self.group = _Region(dist, self.device)
        rank, local_rank = self.group.rank, int(getattr(dist, "local_rank", 0))
        node = int(getattr(dist, "node_rank", 0))
        nodes = self.group.all_gather((node, local_rank, rank))
        if xr.node_leaders:
            leaders = sorted({n: r for n, lr, r in nodes if lr == 0}.items())
            if [n for n, _ in leaders] != list(range(len(leaders))):
                raise ValueError(f"node ranks of the local-rank-0 processes are not 0..N-1: {leaders}")
            self.owner_ranks = [r for _, r in leaders]
        else:
            self.owner_ranks = [0]
        self.my_owner = self.owner_ranks.index(rank) if rank in self.owner_ranks else None
        if 0 not in self.owner_ranks:
            raise ValueError("rank 0 must be a node leader (local rank 0 of node 0)")

        self.wire = xr.payload_dtype
        self.plan = ShardPlan.make(self.numel, ITEMSIZE[self.wire], xr.shard_mb)
        self.init_plan = ShardPlan.make(self.numel, ITEMSIZE["fp32"], xr.shard_mb)
        self.mailbox: Mailbox | None = None
        err = None
        if self.my_owner is not None:
            try:  # e.g. S3 credentials missing on one node: every rank must hear about it
                self.mailbox = Mailbox(
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
            except Exception as e:  # noqa: BLE001
                err = _err(e)
        self.group.agree(err)

        f32 = dict(dtype=torch.float32, device=self.outer_device)
        self.work = torch.zeros(self.numel, **f32)  # flat params / payload source
        self.avg = torch.zeros(self.numel, **f32)  # the regions' weighted average (every rank)
        if self.mode == "diloco":
            self.theta_outer = torch.zeros(self.numel, **f32)
            self.momentum = torch.zeros(self.numel, **f32)
        self._stage: dict[str, torch.Tensor] = {}  # wire dtype -> host staging buffer
        self._tmp: torch.Tensor | None = None  # fp32 scratch of one block
        self._block = CPU_BLOCK if self.outer_device.type == "cpu" else self.numel
        self._rx: dict = {}  # (region, shard) -> reused receive buffer
        self.round = 0
        self.aligned = False
        self.tokens = 0  # the region's tokens since the last round (the trainer passes region-wide counts)
        self._pending: dict | None = None  # grad mode: timings of this step, returned after the step

    # ---------------------------------------------------------------------------------------------
    # flat buffers <-> model
    def _views(self, flat: torch.Tensor):
        for p, lo, hi in zip(self.params, self.offsets[:-1], self.offsets[1:], strict=True):
            yield p, flat[lo:hi].view(p.shape)

    @torch.no_grad()
    def _gather_params(self, out: torch.Tensor) -> torch.Tensor:
        for p, v in self._views(out):
            v.copy_(p.detach())
        return out

    @torch.no_grad()
    def _scatter_params(self, flat: torch.Tensor) -> None:
        for p, v in self._views(flat):
            p.copy_(v)

    def _params_direct(self) -> bool:
        """Can slices of the flat buffers be copied straight into the parameters' storage?"""
        return all(p.device == self.outer_device and p.is_contiguous() for p in self.params)

    @torch.no_grad()
    def _scatter_range(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        """``flat[lo:hi]`` into the parameters that hold those elements (contiguous, same device)."""
        i = bisect.bisect_right(self.offsets, lo) - 1
        while i < len(self.params) and self.offsets[i] < hi:
            off = self.offsets[i]
            a, b = max(lo, off), min(hi, self.offsets[i + 1])
            self.params[i].detach().view(-1)[a - off : b - off].copy_(flat[a:b])
            i += 1

    @torch.no_grad()
    def _delta_into(self, out: torch.Tensor) -> torch.Tensor:
        """``out = theta_outer - theta_local`` (the outer "gradient"; note the sign), in one pass when the
        parameters live on the outer device."""
        if not self._params_direct():
            return torch.sub(self.theta_outer, self._gather_params(out), out=out)
        for p, lo, hi in zip(self.params, self.offsets[:-1], self.offsets[1:], strict=True):
            torch.sub(self.theta_outer[lo:hi], p.detach().view(-1), out=out[lo:hi])
        return out

    @torch.no_grad()
    def _gather_grads(self, out: torch.Tensor) -> torch.Tensor:
        for p, v in self._views(out):
            if p.grad is None:
                v.zero_()
            else:
                v.copy_(p.grad.detach())
        return out

    @torch.no_grad()
    def _scatter_grads(self, flat: torch.Tensor) -> None:
        for p, v in self._views(flat):
            if p.grad is None:
                p.grad = v.to(device=p.device, dtype=p.dtype, copy=True)
            else:
                p.grad.copy_(v)

    # ---------------------------------------------------------------------------------------------
    # encoding: raw contiguous bytes of exactly the slice (never a slice's whole storage)
    # Buffers are allocated once and reused every round: fresh large allocations cost page faults that
    # are slower than the conversions themselves.
    def _staging(self, wire: str) -> torch.Tensor:
        """Host buffer in the wire dtype holding this rank's encoded shards (pinned next to a GPU)."""
        st = self._stage.get(wire)
        if st is None:
            st = torch.empty(self.numel, dtype=_WIRE[wire], pin_memory=self.outer_device.type == "cuda")
            self._stage[wire] = st
        return st

    def _scratch(self, n: int) -> torch.Tensor:
        if self._tmp is None or self._tmp.numel() < n:
            self._tmp = torch.empty(n, dtype=torch.float32, device=self.outer_device)
        return self._tmp[:n]

    def _encode(self, vec: torch.Tensor, lo: int, hi: int, wire: str, ser: str) -> bytes | memoryview:
        if ser == "torch_save":
            buf = io.BytesIO()
            # clone: torch.save of a view would write its whole backing storage
            torch.save(vec[lo:hi].to(_WIRE[wire]).cpu().clone(), buf)
            return buf.getvalue()
        st = self._staging(wire)[lo:hi]
        st.copy_(vec[lo:hi])  # dtype conversion (and device-to-host copy) into the reused buffer
        return memoryview(st.view(torch.uint8).numpy())  # raw bytes of exactly this slice

    def _decode(self, buf, info: ShardInfo, wire: str, ser: str) -> torch.Tensor:
        """The wire-dtype tensor of a shard, on the outer device (not yet converted to fp32)."""
        if ser == "torch_save":
            t = torch.load(io.BytesIO(bytes(buf)), weights_only=True)
            if t.dtype != _WIRE[wire] or t.numel() != info.numel:
                raise XRLayoutError(f"shard {info.index}: torch.save payload is {t.dtype} x {t.numel()}")
        else:
            t = torch.frombuffer(buf, dtype=_WIRE[wire])
        return t.to(self.outer_device, non_blocking=False)

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.outer_device.type == "cuda" and self.outer_device != self.device:
            torch.cuda.synchronize(self.outer_device)

    def _now(self) -> float:
        self._sync_device()
        return time.perf_counter()

    # ---------------------------------------------------------------------------------------------
    # one exchange round (shared by init, diloco and grad)
    def _expect(self, kind: str) -> Expect:
        wire = "fp32" if kind == "init" else self.wire
        ser = "raw" if kind == "init" else self.xr.serialization
        return Expect(kind, wire, self.numel, self.layout, ser, self.init_plan if kind == "init" else self.plan)

    def _publish(
        self, tag: str, kind: str, step: int, src: torch.Tensor | None, tokens: int, t: dict
    ) -> tuple[Manifest | None, dict, tuple[str, str] | None]:
        """Phase 1. Returns (this region's manifest if it had published ``tag`` before, this rank's encoded
        shards, rank 0's error writing the manifest, to be raised everywhere after the next collective)."""
        expect = self._expect(kind)
        mb = self.mailbox
        # Did this region publish this round already (requeued job re-entering it)?
        err, own = None, None
        if self.group.rank == 0:
            try:
                own = mb.read_manifest(tag, self.xr.region)
                if own is not None:
                    expect.check(own, self.xr.run_id, tag, self.xr.region, mb.store.describe(mb.manifest_key(tag, self.xr.region)))
            except Exception as e:  # noqa: BLE001 - every rank must hear about it
                err = _err(e)
        err, own = self.group.broadcast((err, own))
        if err is not None:
            _raise(err)

        encoded: dict[int, bytes | memoryview] = {}
        sums: dict[int, tuple[int, str]] = {}
        err = None
        if own is None and self.my_owner is not None:
            try:
                plan = expect.plan

                def encode_each():  # encode shard after shard; the pool uploads behind
                    for s in plan.owned(self.my_owner, len(self.owner_ranks)):
                        lo, hi = plan.bounds[s]
                        encoded[s] = self._encode(src, lo, hi, expect.dtype, expect.serialization)
                        yield s, encoded[s]

                sums = mb.upload_shards(tag, encode_each())
            except Exception as e:  # noqa: BLE001
                err = _err(e)
        gathered = self.group.all_gather((err, sums, tokens))
        for e, _, _ in gathered:
            if e is not None:
                _raise(e)
        if own is None and self.group.rank == 0:
            all_sums: dict[int, tuple[int, str]] = {}
            for _, s, _ in gathered:
                all_sums.update(s)
            region_tokens = int(gathered[0][2])  # region-wide count, the same on every rank: rank 0's
            plan = expect.plan
            shards = [ShardInfo(i, lo, hi - lo, *all_sums[i]) for i, (lo, hi) in enumerate(plan.bounds)]
            extra = {"theta0": digest_of_digests(s.digest for s in shards)} if kind == "init" else {}
            err = None
            try:
                mb.publish_manifest(Manifest(self.xr.run_id, self.xr.region, tag, kind, step, expect.dtype,
                                             self.numel, self.layout, expect.serialization, region_tokens, shards, extra))
            except Exception as e:  # noqa: BLE001
                err = _err(e)
            t["bytes_up"] = sum(s.nbytes for s in shards)
        else:
            err = None
            t["bytes_up"] = 0
        # The publish error (if any) travels with the wait result.
        return own, encoded, err

    def _wait(self, tag: str, kind: str, step: int, regions: list[str], publish_err) -> dict[str, Manifest]:
        expect = self._expect(kind)
        started = time.monotonic()
        while True:
            res, err = None, publish_err
            if self.group.rank == 0 and err is None:
                try:
                    res = self.mailbox.wait(tag, regions, expect, step=step, started=started, slice_s=_WAIT_SLICE_S)
                except Exception as e:  # noqa: BLE001
                    err = _err(e)
            err, res = self.group.broadcast((err, res))
            if err is not None:
                _raise(err)
            if res is not None:
                return res

    def _download_and_average(
        self, tag: str, kind: str, manifests: dict[str, Manifest], own: Manifest | None, encoded: dict, out: torch.Tensor
    ) -> tuple[int, float]:
        """Phase 3: owners fetch their shards from every region (their own region's from local bytes,
        unless it re-entered a published round), verify, and average into ``out`` (owned slices only).
        Returns (bytes downloaded by the region, seconds of the download part on this rank)."""
        expect = self._expect(kind)
        regions = [r for r in self.xr.regions if r in manifests]
        err, nbytes, t_dl = None, 0, 0.0
        if self.my_owner is not None:
            try:
                t0 = time.perf_counter()
                mine = expect.plan.owned(self.my_owner, len(self.owner_ranks))
                wants = [(r, manifests[r].shards[s]) for r in regions for s in mine
                         if not (r == self.xr.region and own is None)]
                bufs = self.mailbox.download(tag, wants, reuse=self._rx)
                t_dl = time.perf_counter() - t0
                nbytes = sum(len(b) for (r, _), b in bufs.items() if r != self.xr.region)
                total = sum(manifests[r].tokens for r in regions)
                weights = [manifests[r].tokens / total if total > 0 else 1.0 / len(regions) for r in regions]
                for s in mine:
                    lo, hi = expect.plan.bounds[s]
                    xs = []
                    for r in regions:
                        info = manifests[r].shards[s]
                        # this region's own part: the bytes it sent, decoded like everybody decodes them
                        buf = encoded[s] if (r == self.xr.region and own is None) else bufs[(r, s)]
                        xs.append(self._decode(buf, info, expect.dtype, expect.serialization))
                    # out = sum_r w_r * x_r in the order of `regions`; exact bf16->fp32 conversion, then
                    # separate multiply and add (no fused ops): identical bits on every device
                    weighted_average_(out[lo:hi], xs, weights, self._scratch(min(hi - lo, self._block)), self._block)
            except Exception as e:  # noqa: BLE001
                err = _err(e)
        gathered = self.group.all_gather((err, nbytes))
        for e, _ in gathered:
            if e is not None:
                _raise(e)
        return sum(n for _, n in gathered), t_dl

    def _broadcast_slices(self, plan: ShardPlan, buf: torch.Tensor) -> None:
        """Phase 4: every rank gets every shard of ``buf`` from its owner."""
        if not self.group.on:
            return
        comm = buf if buf.device == self.device else buf.to(self.device)
        if len(self.owner_ranks) == 1:
            self.group.broadcast_tensor(comm, src=self.owner_ranks[0])
        else:
            for s, (lo, hi) in enumerate(plan.bounds):
                self.group.broadcast_tensor(comm[lo:hi], src=self.owner_ranks[s % len(self.owner_ranks)])
        if comm is not buf:
            buf.copy_(comm)

    def _round(self, tag: str, kind: str, step: int, src: torch.Tensor | None, out: torch.Tensor, t: dict) -> dict[str, Manifest]:
        """Phases 1-4 for a delta/grad round. ``out`` receives the weighted average on every rank."""
        t0 = self._now()
        own, encoded, perr = self._publish(tag, kind, step, src, self.tokens, t)
        t1 = self._now()
        manifests = self._wait(tag, kind, step, list(self.xr.regions), perr)
        t2 = self._now()
        down, t_dl = self._download_and_average(tag, kind, manifests, own, encoded, out)
        t3 = self._now()
        self._broadcast_slices(self.plan, out)
        t4 = self._now()
        # download vs averaging on this rank; the phase's wall time is split in that proportion
        dl = min(t_dl, t3 - t2)
        t.update(
            upload_s=t1 - t0, wait_s=t2 - t1, download_s=dl, reduce_s=(t3 - t2) - dl, broadcast_s=t4 - t3,
            bytes_down=down, reused=own is not None, t_start=t0, t_end=t4,
            tokens=sum(m.tokens for m in manifests.values()),
        )
        if own is not None:
            t["bytes_up"] = 0
        return manifests

    # ---------------------------------------------------------------------------------------------
    # public interface
    def align(self, step: int = 0) -> None:
        """Make every region start from the same parameters: the first region of ``regions`` publishes
        theta0 (fp32); the others adopt it. Verified by hash after it is written into the model. No-op
        once aligned (e.g. resumed from a checkpoint). If theta0 is already in the mailbox (the first
        region restarted from scratch), every region adopts that one."""
        if self.aligned:
            return
        t0 = time.perf_counter()
        first = self.xr.regions[0]
        exists = None
        err = None
        if self.group.rank == 0:
            try:
                exists = self.mailbox.read_manifest(TAG_INIT, first) is not None
            except Exception as e:  # noqa: BLE001
                err = _err(e)
        err, exists = self.group.broadcast((err, exists))
        if err is not None:
            _raise(err)
        publisher = self.xr.region == first and not exists
        flat = self._gather_params(self.work)
        if publisher:
            _, _, perr = self._publish(TAG_INIT, "init", step, flat, 0, {})
            self.group.agree(perr)
            action = "published"
        else:
            manifests = self._wait(TAG_INIT, "init", step, [first], None)
            self._fetch_init(manifests[first], flat)
            self._broadcast_slices(self.init_plan, flat)
            self._scatter_params(flat)
            action = "adopted"
        manifest = self._verify_init(flat)
        if self.mode == "diloco":
            self.theta_outer.copy_(self._gather_params(self.work))
        self.aligned = True
        if self.wire != "fp32":
            self._stage.pop("fp32", None)  # theta0's staging is not needed any more
        self._log({"event": "xr_align", "step": step, "region": self.xr.region, "action": action,
                   "from_region": first, "digest": manifest, "seconds": round(time.perf_counter() - t0, 3)})

    def _fetch_init(self, m: Manifest, out: torch.Tensor) -> None:
        err = None
        if self.my_owner is not None:
            try:
                mine = self.init_plan.owned(self.my_owner, len(self.owner_ranks))
                bufs = self.mailbox.download(TAG_INIT, [(m.region, m.shards[s]) for s in mine])
                for s in mine:
                    lo, hi = self.init_plan.bounds[s]
                    out[lo:hi].copy_(torch.frombuffer(bufs[(m.region, s)], dtype=torch.float32))
            except Exception as e:  # noqa: BLE001
                err = _err(e)
        self.group.agree(err)

    def _verify_init(self, scratch: torch.Tensor) -> str:
        """Hash what the MODEL now holds (not a copy) and compare with the published theta0."""
        flat = self._gather_params(scratch)
        err, want = None, None
        if self.group.rank == 0:
            try:
                m = self.mailbox.read_manifest(TAG_INIT, self.xr.regions[0])
                if m is None:
                    raise XRError(f"theta0 manifest vanished from {self.mailbox.store.describe()}")
                want = m.extra.get("theta0")
            except Exception as e:  # noqa: BLE001
                err = _err(e)
        err, want = self.group.broadcast((err, want))
        if err is not None:
            _raise(err)
        err, mine = None, []
        if self.my_owner is not None:
            for s in self.init_plan.owned(self.my_owner, len(self.owner_ranks)):
                lo, hi = self.init_plan.bounds[s]
                mine.append((s, digest(memoryview(flat[lo:hi].cpu().contiguous().numpy()))))
        parts = dict(x for lst in self.group.all_gather(mine) for x in lst)
        got = digest_of_digests(parts[i] for i in range(len(self.init_plan)))
        if got != want:
            raise XRLayoutError(
                f"region {self.xr.region!r}: parameters after alignment hash to {got[:16]}, theta0 published by "
                f"{self.xr.regions[0]!r} hashes to {str(want)[:16]}: alignment was not written into the model"
            )
        return got

    def before_optimizer_step(self, step: int, tokens: int) -> None:
        """grad mode: replace ``.grad`` with the token-weighted average over regions. diloco: no-op."""
        if self.mode != "grad":
            return
        if not self.aligned:
            raise XRError("OuterSync.align() must run before the first exchange")
        self.tokens += int(tokens)
        t: dict = {}
        src = self._gather_grads(self.work) if self.my_owner is not None else None
        avg = self.avg
        self._round(round_tag(step), "grad", step, src, avg, t)
        t5 = t["t_end"]
        self._scatter_grads(avg)
        t6 = self._now()
        self.round = step
        self.tokens = 0
        self._cleanup(step)
        t7 = self._now()
        t.update(outer_step_s=t6 - t5, cleanup_s=t7 - t6, t_end=t7)
        self._pending = self._timings(step, t)

    def after_optimizer_step(self, step: int, tokens: int) -> dict | None:
        """diloco: count tokens; every ``inner_steps`` steps run an outer round and return its timings.
        grad: return the timings of the exchange done before this step."""
        if self.mode == "grad":
            out, self._pending = self._pending, None
            return out
        self.tokens += int(tokens)
        if step % self.xr.inner_steps != 0:
            return None
        if not self.aligned:
            raise XRError("OuterSync.align() must run before the first outer round")
        r = step // self.xr.inner_steps
        t: dict = {}
        delta = None
        if self.my_owner is not None:
            # delta = theta_outer - theta_local (the outer "gradient"; note the sign)
            delta = self._delta_into(self.work)
        avg = self.avg
        self._round(round_tag(r), "delta", step, delta, avg, t)
        t5 = t["t_end"]
        # Outer Nesterov SGD. Everything that can fail (the exchange) is behind us and only wrote into
        # `avg`, so the step runs in place without temporaries; `work` is free scratch by now.
        self._outer_step(avg)
        self.round = r
        self.tokens = 0
        t6 = self._now()
        self._cleanup(r)
        t7 = self._now()
        t.update(outer_step_s=t6 - t5, cleanup_s=t7 - t6, t_end=t7)
        return self._timings(step, t)

    def _outer_step(self, g: torch.Tensor) -> None:
        """Nesterov on ``theta_outer`` and theta into the model, block by block: on the CPU each block is
        written into the parameters while it is still in cache."""
        direct = self._params_direct()
        tmp = self._scratch(min(self.numel, self._block))
        for lo, hi in blocks(self.numel, self.outer_device, self._block):
            nesterov_block_(self.theta_outer[lo:hi], self.momentum[lo:hi], g[lo:hi], self.xr.outer_lr,
                            self.xr.outer_momentum, tmp[: hi - lo])
            if direct:
                self._scatter_range(self.theta_outer, lo, hi)
        if not direct:
            self._scatter_params(self.theta_outer)

    def _cleanup(self, r: int) -> None:
        if self.group.rank != 0:
            return
        try:
            self.mailbox.cleanup(r, len(self.plan))
        except Exception as e:  # noqa: BLE001 - old rounds left behind do not hurt training
            self._log({"event": "xr_cleanup_failed", "round": r, "error": str(e)})

    def _timings(self, step: int, t: dict) -> dict:
        parts = ("upload_s", "wait_s", "download_s", "reduce_s", "broadcast_s", "outer_step_s", "cleanup_s")
        total = t["t_end"] - t["t_start"]
        out = {"xr_round": self.round, "xr_step": step}
        for k in parts:
            out[f"xr_{k}"] = t[k]
        out["xr_total_s"] = total
        out["xr_download_MBps"] = t["bytes_down"] / t["download_s"] / 1e6 if t["download_s"] > 0 else 0.0
        out["xr_bytes_up"] = t["bytes_up"]
        out["xr_bytes_down"] = t["bytes_down"]
        out["xr_tokens"] = t["tokens"]
        out["xr_reused"] = t["reused"]
        return out

    def state_dict(self) -> dict:
        sd = {"round": int(self.round), "aligned": int(self.aligned), "tokens": int(self.tokens)}
        if self.mode == "diloco":
            sd["theta_outer"] = self.theta_outer
            sd["momentum"] = self.momentum
        return sd

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        def as_int(v) -> int:
            return int(v.item()) if isinstance(v, torch.Tensor) else int(v)

        if self.mode == "diloco":
            for k in ("theta_outer", "momentum"):
                if k not in state:
                    raise XRLayoutError(f"checkpoint has no outer state {k!r} (saved without --xr-sync diloco?)")
                v = state[k]
                if v.numel() != self.numel:
                    raise XRLayoutError(f"checkpoint outer state {k!r} has {v.numel()} elements, the model {self.numel}")
                dst = getattr(self, k)
                if v is not dst:
                    dst.copy_(v.reshape(-1))
        self.round = as_int(state.get("round", 0))
        self.aligned = bool(as_int(state.get("aligned", 0)))
        self.tokens = as_int(state.get("tokens", 0))

    def close(self) -> None:
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox.store.close()


# Elementwise work on the CPU runs over blocks of this many elements (2 MiB of fp32): all the passes of
# one block (decode, multiply, add; the Nesterov ops; the copy into the model) then hit the caches, and
# main memory sees each buffer once, as from a fused kernel. Blocking does not change any element's
# sequence of operations, so the bits are those of the whole-buffer ops. GPUs take whole buffers.
CPU_BLOCK = 1 << 19


def blocks(n: int, device: torch.device | str, block: int | None = None):
    """``(lo, hi)`` ranges covering ``0..n``: cache-sized on the CPU, one range elsewhere."""
    step = block or (CPU_BLOCK if torch.device(device).type == "cpu" else max(n, 1))
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)


@torch.no_grad()
def accumulate_(acc: torch.Tensor, x: torch.Tensor, w: float, scratch: torch.Tensor, *, first: bool) -> None:
    """``acc (=|+=) w * float(x)``: exact conversion of ``x`` (bf16/fp32) into ``scratch``, then a separate
    multiply and add (no fused multiply-add), so every device produces the same bits."""
    if first:
        acc.copy_(x).mul_(w)
    else:
        acc.add_(scratch.copy_(x).mul_(w))


@torch.no_grad()
def weighted_average_(acc: torch.Tensor, xs: list[torch.Tensor], ws: list[float], scratch: torch.Tensor,
                      block: int | None = None) -> None:
    """``acc = sum_i ws[i] * float(xs[i])`` in the order given, block by block (see :data:`CPU_BLOCK`);
    ``scratch`` needs one block's elements."""
    for lo, hi in blocks(acc.numel(), acc.device, block):
        tmp = scratch[: hi - lo]
        for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
            accumulate_(acc[lo:hi], x[lo:hi], w, tmp, first=i == 0)


@torch.no_grad()
def nesterov_block_(theta: torch.Tensor, m: torch.Tensor, g: torch.Tensor, lr: float, mu: float,
                    scratch: torch.Tensor) -> None:
    """:func:`outer_nesterov_` on one range, as whole-tensor ops (``scratch`` as large as ``theta``)."""
    m.mul_(mu).add_(g)
    if mu > 0:
        torch.mul(m, mu, out=scratch).add_(g)  # the Nesterov look-ahead g + mu*m
    else:
        scratch.copy_(g)
    theta.sub_(scratch.mul_(lr))


@torch.no_grad()
def outer_nesterov_(theta: torch.Tensor, m: torch.Tensor, g: torch.Tensor, lr: float, mu: float,
                    scratch: torch.Tensor, block: int | None = None) -> None:
    """In place: ``m = mu*m + g; theta -= lr * (g + mu*m)`` (SGD with Nesterov momentum, as
    ``torch.optim.SGD(nesterov=True)``; ``g`` is the outer gradient theta_outer - mean(theta_local)).
    One rounding per elementwise op, no temporaries, the same bits on CPU and GPU; block by block on the
    CPU (``scratch`` needs one block's elements)."""
    for lo, hi in blocks(theta.numel(), theta.device, block):
        nesterov_block_(theta[lo:hi], m[lo:hi], g[lo:hi], lr, mu, scratch[: hi - lo])
