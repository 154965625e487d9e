"""The flat transfers a round is built of, seen from one region (the round itself, phase by phase:
:func:`.rounds.run_round`):

- *upload* (:meth:`Exchange.upload`): the flat payload is cut into shards; shard ``s`` belongs to node
  ``s mod num_nodes``, whose local rank 0 encodes it to the wire dtype (bf16, fp32, or int8/fp8/int4 with
  per-block scales: :mod:`.scaled`) and uploads it (thread pool); the manifest indexes them.
- *download and average* (:meth:`Exchange.download_and_average`): each node leader fetches its shards
  from every member, all at once, and averages them, weighted by tokens, in the order of ``regions``, from
  the bytes as they are on the wire (its own part from the bytes it encoded). Every region therefore
  computes bit-identical averages.
- *broadcast* (:meth:`Exchange.broadcast_slices`): with several node leaders, each averaged shard goes from
  its owner to the other leaders (they hold the outer state; the other ranks hold none and get the
  parameters from the outer sync).

theta0, the outer snapshots and a fast-forward's replay of committed rounds use the same transfers.
A sharded (FSDP2) region has every rank as an owner: its shards are its own parameter slices, packed into
one object per rank (more only past ``shard_mb``), held in buffers of its slices only (:meth:`Exchange.at`),
and nothing is broadcast. Since regions cut their payloads differently, a reader takes each member's
values of its shard from whichever of that member's shards overlap it, reading only the chunks of their
objects that hold them (:mod:`.reading`: ranged reads, each chunk verified by its checksum).

Every failure reaches every rank before anything changes (:class:`.region.Region`).
"""

from __future__ import annotations

import copy
import io
import time
from collections.abc import Callable, Sequence

import torch

from sbatch_gen.xr_options import CrossRegion

from . import scaled, sparse
from .commit import Commit
from .errors import StoreError, XRError, XRLayoutError
from .kernels import CPU_BLOCK, GPU_BLOCK, weighted_average_
from .membership import Membership
from .protocol import (
    ITEMSIZE,
    SCALED,
    Buffer,
    Expect,
    Mailbox,
    Manifest,
    ObjectInfo,
    ShardInfo,
    ShardPlan,
    Stored,
    digest_of_digests,
    itemsize,
    overlapping,
    sparse_params,
    wire_nbytes,
)
from .reading import ObjectBytes, Want, read_objects, shard_bytes
from .region import Region, capture, held

_WIRE = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Exchange:
    def __init__(
        self,
        xr: CrossRegion,
        group: Region,
        mailbox: Mailbox | None,
        membership: Membership | None,
        numel: int,
        layout: str,
        owner_ranks: list[int],
        outer_device: torch.device,
        device: torch.device,
        *,
        pieces: list[tuple[int, int, int]] | None = None,
        local_at: Callable[[int, int], tuple[int, int]] | None = None,
        buf_numel: int | None = None,
        params: Sequence[tuple[int, str]] = (),
    ) -> None:
        """``pieces`` (a sharded region): every rank's canonical ranges ``(start, end, rank)``; each rank
        then owns the shards of its own ranges, packed into objects of about ``shard_mb`` MiB (one when they
        fit), and holds buffers of ``buf_numel`` elements (its ranges one after the other) where
        ``local_at`` maps a canonical range. ``params``: each parameter's (canonical start, name), which a
        refused manifest's message names."""
        self.xr, self.group, self.mailbox, self.membership = xr, group, mailbox, membership
        self.numel, self.layout = numel, layout
        self.owner_ranks = owner_ranks
        self.my_owner = owner_ranks.index(group.rank) if group.rank in owner_ranks else None
        self.outer_device, self.device = outer_device, device
        self.sharded = pieces is not None
        self.buf_numel = buf_numel if buf_numel is not None else numel
        self.local_at = local_at or (lambda lo, hi: (lo, hi))
        self.params = tuple(params)
        self.plan, self.fp32_plan = self._plans(numel, pieces)
        self.block = CPU_BLOCK if outer_device.type == "cpu" else min(numel, GPU_BLOCK)
        self._stage: dict[str, torch.Tensor] = {}  # wire dtype -> host staging buffer
        self._tmp: torch.Tensor | None = None  # fp32 scratch of one block
        self._rx: dict = {}  # (region, shard) -> reused receive buffer
        # int8/fp8/int4 (.scaled): one fp32 block buffer for encoding, this leader's encoded shards (kept until the
        # round is averaged), one decoded shard per member being averaged; allocated once, reused every round
        self._q_scratch: torch.Tensor | None = None
        self._q_out: dict[int, torch.Tensor] = {}  # by the shard's first element
        self._q_dec: dict[int, torch.Tensor] = {}  # by the member's position in the round
        self._asm: dict[int, torch.Tensor] = {}  # a member's values assembled from shards cut elsewhere
        self.background = False  # runs in a thread beside training (see :meth:`in_background`)

    def _plans(self, numel: int, pieces: list[tuple[int, int, int]] | None) -> tuple[ShardPlan, ShardPlan]:
        """The payload's shard plan and theta0's / the snapshots' (fp32): cut where ``pieces`` end, if given."""

        def plan(wire: str) -> ShardPlan:
            if pieces is not None:
                return ShardPlan.pieces(numel, pieces, itemsize(wire), self.xr.shard_mb)
            return ShardPlan.make(numel, itemsize(wire), self.xr.shard_mb)

        return plan(self.xr.wire_dtype), plan("fp32")

    def in_background(self, group: Region) -> Exchange:
        """This exchange for a thread of the leaders that runs rounds while training goes on: collectives on
        ``group`` (:meth:`Region.background`), no device synchronisation for its clocks, waits in short
        slices so a stop can call it off. It shares the buffers: the two never run at the same time (the
        outer sync joins the background round before it uses its own exchange)."""
        ex = copy.copy(self)
        ex.group, ex.background = group, True
        return ex

    def for_snapshots(self, group: Region, streams: int) -> Exchange:
        """This exchange for the thread that uploads outer snapshots while training and rounds go on:
        collectives on ``group`` (another :meth:`Region.background`), a pool of its own of ``streams``
        uploads, each of which first gives way to the rounds' transfers in flight (:mod:`.traffic`), no
        buffer shared with the rounds (it uploads fp32 from host memory, which needs none)."""
        ex = self.in_background(group)
        ex._stage, ex._rx, ex._q_out, ex._q_dec, ex._asm = {}, {}, {}, {}, {}
        ex._tmp = ex._q_scratch = None
        if self.mailbox is not None:
            ex.mailbox = self.mailbox.with_threads(streams, "xr-snapshot-io", background=True)
        return ex

    def for_fragment(
        self,
        index: int,
        numel: int,
        pieces: list[tuple[int, int, int]] | None = None,
        local_at: Callable[[int, int], tuple[int, int]] | None = None,
        buf_numel: int | None = None,
    ) -> Exchange:
        """This exchange for the rounds of one fragment (Streaming DiLoCo): payloads of ``numel`` elements
        (the fragment's flat range, passed as views), their own shard plan and a layout that names the
        fragment, buffers of their own. theta0 and the snapshots stay whole-model (this exchange). A sharded
        region passes the fragment's ``pieces``, ``local_at`` and ``buf_numel`` (as :meth:`__init__` takes
        them, counted from the fragment's start: :meth:`.flat.FlatParams.fragment_payload`)."""
        if self.sharded != (pieces is not None):
            raise XRError("internal: a fragment's pieces are given exactly for a sharded region")
        ex = copy.copy(self)
        ex.numel, ex.layout = numel, f"{self.layout}.f{index}"
        ex.params = ()  # (a fragment's own coordinates)
        ex.buf_numel = buf_numel if buf_numel is not None else numel
        ex.local_at = local_at or (lambda lo, hi: (lo, hi))
        ex.plan, ex.fp32_plan = self._plans(numel, pieces)
        ex.block = CPU_BLOCK if self.outer_device.type == "cpu" else min(numel, GPU_BLOCK)
        ex._stage, ex._rx, ex._q_out, ex._q_dec, ex._asm = {}, {}, {}, {}, {}
        ex._tmp = ex._q_scratch = None
        return ex

    def mb(self) -> Mailbox:
        """The mailbox: open on the shard owners (rank 0 among them) only, the other ranks never use it."""
        if self.mailbox is None:
            raise XRError(f"internal: rank {self.group.rank} holds no mailbox (only the region's leaders do)")
        return self.mailbox

    def ms(self) -> Membership:
        """The membership view of the mailbox: like :meth:`mb`, on the shard owners only."""
        if self.membership is None:
            raise XRError(f"internal: rank {self.group.rank} holds no mailbox (only the region's leaders do)")
        return self.membership

    # -- expectations ----------------------------------------------------------------------------------
    def expect(self, kind: str) -> Expect:
        """What every manifest of a ``kind`` round must agree on. init and snapshot parts are fp32 raw."""
        if kind in ("init", "snapshot"):
            return Expect(kind, "fp32", self.numel, self.layout, "raw", self.fp32_plan, self.params)
        xr = self.xr
        return Expect(kind, xr.wire_dtype, self.numel, self.layout, xr.serialization, self.plan, self.params)

    def owned(self, plan: ShardPlan) -> list[int]:
        return plan.owned(self.my_owner, len(self.owner_ranks)) if self.my_owner is not None else []

    def at(self, plan: ShardPlan, s: int) -> tuple[int, int]:
        """Shard ``s``'s slice of this rank's buffers (its canonical range, but for a sharded region)."""
        return self.local_at(*plan.bounds[s])

    # -- encoding: raw contiguous bytes of exactly the slice (never a slice's whole storage) -----------
    # Buffers are allocated once and reused every round: fresh large allocations cost page faults that
    # are slower than the conversions themselves.
    def _staging(self, wire: str) -> torch.Tensor:
        st = self._stage.get(wire)
        if st is None:
            st = torch.empty(self.buf_numel, dtype=_WIRE[wire], pin_memory=self.outer_device.type == "cuda")
            self._stage[wire] = st
        return st

    def drop_staging(self, wire: str) -> None:
        self._stage.pop(wire, None)

    def scratch(self, n: int) -> torch.Tensor:
        if self._tmp is None or self._tmp.numel() < n:
            self._tmp = torch.empty(n, dtype=torch.float32, device=self.outer_device)
        return self._tmp[:n]

    def _encode(self, vec: torch.Tensor, lo: int, hi: int, wire: str, ser: str) -> bytes | memoryview:
        sp = sparse_params(wire)
        if sp is not None:  # top-k per chunk with 2-bit values (raw only: the options refuse torch_save)
            whole = -(-(hi - lo) // sp[0]) * sp[0]
            if self._q_scratch is None or self._q_scratch.numel() < whole:
                self._q_scratch = torch.empty(whole, dtype=torch.float32, device=vec.device)
            return sparse.encode(vec[lo:hi], *sp, scratch=self._q_scratch)
        if wire in SCALED:  # int8/fp8/int4 with per-block scales (raw only: the options refuse torch_save)
            n = hi - lo
            if self._q_scratch is None or self._q_scratch.numel() < scaled.padded(n):
                self._q_scratch = torch.empty(scaled.padded(n), dtype=torch.float32, device=vec.device)
            out = self._q_out.get(lo)
            if out is None or out.numel() != wire_nbytes(wire, n):
                pin = self.outer_device.type == "cuda"
                out = self._q_out[lo] = torch.empty(wire_nbytes(wire, n), dtype=torch.uint8, pin_memory=pin)
            return scaled.encode(vec[lo:hi], wire, scratch=self._q_scratch, out=out)
        if ser == "torch_save":
            buf = io.BytesIO()
            # clone: torch.save of a view would write its whole backing storage
            torch.save(vec[lo:hi].to(_WIRE[wire]).cpu().clone(), buf)
            return buf.getvalue()
        if wire == "fp32" and vec.device.type == "cpu" and vec.dtype == torch.float32:
            return vec[lo:hi].numpy().data.cast("B")  # already the wire bytes
        st = self._staging(wire)[lo:hi]
        st.copy_(vec[lo:hi])  # dtype conversion (and device-to-host copy) into the reused buffer
        return st.view(torch.uint8).numpy().data

    def _decode(self, buf, numel: int, wire: str, ser: str, slot: int = 0, what: str = "") -> torch.Tensor:
        """The wire-dtype tensor of ``numel`` elements encoded in ``buf`` (a shard, or whole blocks of one:
        each block decodes alone), on the outer device (bf16 not yet converted to fp32; int8/fp8/int4
        decoded to fp32 with their scales, the same bits in every region, into the reused buffer ``slot``;
        sparse: likewise, its chunks' kept values in place, zeros elsewhere)."""
        sp = sparse_params(wire)
        if sp is not None:
            padded = -(-numel // sp[0]) * sp[0]
            dec = self._q_dec.get(slot)
            if dec is None or dec.numel() < padded:
                dec = self._q_dec[slot] = torch.empty(padded, dtype=torch.float32, device=self.outer_device)
            return sparse.decode(buf, numel, *sp, self.outer_device, out=dec, what=what or "a sparse shard")
        if wire in SCALED:
            padded = scaled.padded(numel)
            dec = self._q_dec.get(slot)
            if dec is None or dec.numel() < padded:
                dec = self._q_dec[slot] = torch.empty(padded, dtype=torch.float32, device=self.outer_device)
            return scaled.decode(buf, numel, wire, self.outer_device, out=dec)
        if ser == "torch_save":
            t = torch.load(io.BytesIO(bytes(buf)), weights_only=True)
            if t.dtype != _WIRE[wire] or t.numel() != numel:
                raise XRLayoutError(f"{what}: torch.save payload is {t.dtype} x {t.numel()}")
        else:
            t = torch.frombuffer(buf, dtype=_WIRE[wire])
        return t.to(self.outer_device, non_blocking=False)

    # -- flat transfers ----------------------------------------------------------------------------------
    def encode(self, kind: str, src: torch.Tensor | None) -> dict[int, bytes | memoryview]:
        """Collective: each owner encodes its shards of ``src`` to the wire (into the kept buffers; a raw
        fp32 shard of a host buffer is a view of ``src``). Returns this rank's shards ({} elsewhere)."""
        expect = self.expect(kind)
        out: dict[int, bytes | memoryview] = {}
        err = None
        if self.my_owner is not None:
            try:
                vec = held(src, f"the source of the {kind} payload")
                for s in self.owned(expect.plan):
                    out[s] = self._encode(vec, *self.at(expect.plan, s), expect.dtype, expect.serialization)
            except Exception as e:  # noqa: BLE001 - e.g. a NaN refused by int8: every rank must hear it
                err = capture(e)
        self.group.agree(err)  # the bytes stay here: only the outcome goes round
        return out

    def decode_into(self, kind: str, encoded: dict, out: torch.Tensor | None) -> None:
        """Collective: ``out`` = the wire values of ``encoded`` (this rank's shards from :meth:`encode`) as
        every region decodes them, on every leader. Skips what is already exact (raw fp32 of ``out``)."""
        expect = self.expect(kind)

        def dec() -> None:
            dst = held(out, f"the buffer the {kind} payload is decoded into")
            for s, buf in encoded.items():
                lo, hi = self.at(expect.plan, s)
                if isinstance(buf, memoryview) and expect.dtype == "fp32":
                    continue  # a view of dst's own bytes: the exact values already
                dst[lo:hi].copy_(self._decode(buf, hi - lo, expect.dtype, expect.serialization))

        self.group.on_each(dec, active=self.my_owner is not None)
        self.broadcast_slices(expect.plan, out)

    def residual_into(self, kind: str, encoded: dict, buf: torch.Tensor | None) -> None:
        """Collective: ``buf -= `` the wire values of ``encoded`` (this rank's shards of ``buf``, from
        :meth:`encode`), as every region decodes them, on every leader: what the payload did not carry (a
        sparse payload's error feedback). Each owner subtracts its own shards, then they go round the
        leaders."""
        expect = self.expect(kind)

        def sub() -> None:
            dst = held(buf, f"the buffer the {kind} payload's residual is kept in")
            for s, b in encoded.items():
                lo, hi = self.at(expect.plan, s)
                dst[lo:hi].sub_(self._decode(b, hi - lo, expect.dtype, expect.serialization))

        self.group.on_each(sub, active=self.my_owner is not None)
        self.broadcast_slices(expect.plan, buf)

    def upload(
        self,
        tag: str,
        name: str,
        kind: str,
        step: int,
        src: torch.Tensor | None,
        tokens: int,
        extra_fn=None,
        pre: dict | None = None,
        write: bool = True,
    ) -> tuple[Manifest | None, dict, int]:
        """Owners upload their objects (their shards of ``src`` packed, or the shards ``pre`` they encoded
        already, see :meth:`encode`) as ``name``'s part of ``tag``; rank 0 writes the manifest (not with
        ``write=False``: a round's manifest is its claim, which the round's wait writes). Collective.
        Returns (the manifest, this rank's encoded shards, bytes uploaded)."""
        expect = self.expect(kind)
        encoded: dict[int, bytes | memoryview] = {}

        def up():
            packed: dict[int, list[tuple[int, tuple[int, int]]]] = {}  # object -> (shard, byte span)

            def encode_each():  # encode object after object; the pool checksums and uploads behind
                for k, shards in self.owned_objects(expect.plan):
                    buf, spans = self._pack(expect, shards, src, pre, encoded, f"{name}'s {kind} upload")
                    packed[k] = list(zip(shards, spans, strict=True))
                    yield k, buf, spans

            stored = self.mb().upload_objects(tag, encode_each(), region=name)
            return {k: (st, packed[k]) for k, st in stored.items()}

        objects: dict[int, tuple[Stored, list]] = {}
        for part in self.group.on_each(up, active=self.my_owner is not None):
            objects.update(part or {})

        m = self.group.on_rank(
            lambda: self._write_manifest(tag, name, step, tokens, expect, objects, extra_fn, write)
        )
        return m, encoded, sum(st.nbytes for st, _ in objects.values())

    def _write_manifest(
        self,
        tag: str,
        name: str,
        step: int,
        tokens: int,
        expect: Expect,
        objects: dict,
        extra_fn,
        write: bool,
    ) -> Manifest:
        """rank 0: ``name``'s manifest of ``tag``, indexing the shards of every rank's ``objects``
        ({object: (Stored, [(shard, byte span)])}), written last."""
        mb = self.mb()
        index: dict[int, ShardInfo] = {}
        for k, (st, where) in objects.items():
            for (s, (a, b)), d in zip(where, st.digests, strict=True):
                lo, hi = expect.plan.bounds[s]
                index[s] = ShardInfo(s, lo, hi - lo, b - a, d, k, a)
        if len(index) != len(expect.plan):
            raise XRError(f"internal: {len(expect.plan) - len(index)} shards of {name}'s {tag} not uploaded")
        shards = [index[s] for s in range(len(expect.plan))]
        m = Manifest(
            self.xr.run_id,
            name,
            tag,
            expect.kind,
            step,
            expect.dtype,
            self.numel,
            self.layout,
            expect.serialization,
            tokens,
            shards,
            extra_fn(shards) if extra_fn else {},
            objects=[ObjectInfo(k, st.nbytes, st.chunks) for k, (st, _) in sorted(objects.items())],
            chunk=mb.chunk_bytes,
        )
        if write:
            mb.store.put(mb.manifest_key(tag, name), m.to_json())
        return m

    def owned_objects(self, plan: ShardPlan) -> list[tuple[int, list[int]]]:
        """This rank's objects of ``plan``: (object, its shards in order)."""
        return plan.owned_objects(self.my_owner, len(self.owner_ranks)) if self.my_owner is not None else []

    def _pack(
        self, expect: Expect, shards: list[int], src, pre: dict | None, encoded: dict, what: str
    ) -> tuple[Buffer, list[tuple[int, int]]]:
        """One object: the wire bytes of ``shards`` one after the other (each also kept in ``encoded``), and
        each one's byte span. Raw bf16/fp32 shards, which follow each other in this rank's buffers, are
        encoded as one range (a view, no copy); the others are encoded one by one and joined."""
        plan, wire, ser = expect.plan, expect.dtype, expect.serialization
        buf: Buffer | None = None
        if pre is None and len(shards) > 1 and ser == "raw" and wire in _WIRE:
            a, b = self.at(plan, shards[0])[0], self.at(plan, shards[-1])[1]
            if b - a == sum(hi - lo for lo, hi in (plan.bounds[s] for s in shards)):  # contiguous here
                buf = memoryview(self._encode(held(src, f"the source of {what}"), a, b, wire, ser)).cast("B")
                size = int(ITEMSIZE[wire])
                for s in shards:
                    lo, hi = self.at(plan, s)
                    encoded[s] = buf[(lo - a) * size : (hi - a) * size]
        for s in shards:
            if pre is not None:
                encoded[s] = pre[s]
            elif s not in encoded:
                encoded[s] = self._encode(held(src, f"the source of {what}"), *self.at(plan, s), wire, ser)
        spans, at = [], 0
        for s in shards:
            spans.append((at, at + memoryview(encoded[s]).nbytes))
            at = spans[-1][1]
        if buf is None:
            buf = encoded[shards[0]] if len(shards) == 1 else b"".join(encoded[s] for s in shards)
        return buf, spans

    def fetch(self, tag: str, m: Manifest, out: torch.Tensor | None, plan: ShardPlan) -> int:
        """Owners download their shards of ``m`` (fp32 raw) into ``out``; every owner then has all of
        ``out`` (the other ranks pass None). Collective. Returns bytes downloaded by this region."""

        def down():
            dst = held(out, f"the buffer {tag} is fetched into")
            mine = self.owned(plan)
            got = read_objects(self.mb(), tag, self._wants({m.region: m}, [m.region], mine, plan))
            for s in mine:
                a, b = self.at(plan, s)
                dst[a:b].copy_(self._values(got, m, *plan.bounds[s], "fp32", "raw", 0))
            return sum(o.nbytes for o in got.values())

        n = sum(x or 0 for x in self.group.on_each(down, active=self.my_owner is not None))
        self.broadcast_slices(plan, out)
        return n

    def broadcast_slices(self, plan: ShardPlan, buf: torch.Tensor | None) -> None:
        """Every owner gets every shard of ``buf`` from its owner (the leaders' group); the other ranks
        take no part."""
        if len(self.owner_ranks) == 1 or self.my_owner is None or self.sharded:
            return  # (sharded: each rank needs only its own shards)
        t = held(buf, "the buffer broadcast among the leaders")
        for s, (lo, hi) in enumerate(plan.bounds):
            self.group.leaders_broadcast(t[lo:hi], src=self.owner_ranks[s % len(self.owner_ranks)])

    # -- one round -----------------------------------------------------------------------------------------
    def now(self) -> float:
        if self.background:  # a thread beside training: never wait for the device's queue
            return time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.outer_device.type == "cuda" and self.outer_device != self.device:
            torch.cuda.synchronize(self.outer_device)
        return time.perf_counter()

    def store_retries(self) -> int:
        """Requests this process's store has retried so far (0 on ranks without a mailbox)."""
        return int(getattr(self.mailbox.store, "retries", 0)) if self.mailbox is not None else 0

    def download_and_average(
        self,
        tag: str,
        expect: Expect,
        manifests: dict[str, Manifest],
        members: list[str],
        local: dict,
        out: torch.Tensor | None,
        meanwhile: Callable[[], None] | None = None,
    ) -> tuple[int, float]:
        """Owners fetch their shards from every member (their own region's from ``local`` bytes where
        given), all at once, and average them into ``out`` (owned slices); rank 0 runs ``meanwhile`` (a
        small request) beside the reads. Returns (bytes downloaded by the region, seconds of the download part
        on this rank)."""
        region = self.xr.region
        t_dl = [0.0]

        def work():
            dst = held(out, f"the buffer round {tag} is averaged into")
            t0 = time.perf_counter()
            mine = self.owned(expect.plan)
            remote = [r for r in members if not (r == region and local)]
            wants = self._wants(manifests, remote, mine, expect.plan)
            noted = (
                self.mb().pool.submit(meanwhile) if meanwhile is not None and self.group.rank == 0 else None
            )
            got = read_objects(self.mb(), tag, wants, reuse=self._rx)
            if noted is not None:
                noted.result()
            t_dl[0] = time.perf_counter() - t0
            total = sum(manifests[r].tokens for r in members)
            weights = [manifests[r].tokens / total if total > 0 else 1.0 / len(members) for r in members]
            wire, ser = expect.dtype, expect.serialization
            for s in mine:
                lo, hi = expect.plan.bounds[s]
                xs = []
                for i, r in enumerate(members):
                    if r == region and local:  # this region's own bytes: cut by its own plan
                        xs.append(self._decode(local[s], hi - lo, wire, ser, i, f"shard {s}"))
                    else:
                        xs.append(self._values(got, manifests[r], lo, hi, wire, ser, i))
                # out = sum_r w_r * x_r in the order of `regions`, elementwise; exact bf16->fp32 conversion
                # (scaled: decoded above), then separate multiply and add (no fused ops): identical bits
                # everywhere, however each region cuts its payload into shards
                a, b = self.at(expect.plan, s)
                weighted_average_(dst[a:b], xs, weights, self.scratch(min(hi - lo, self.block)), self.block)
            return sum(o.nbytes for (r, _), o in got.items() if r != region)

        n = sum(x or 0 for x in self.group.on_each(work, active=self.my_owner is not None))
        return n, t_dl[0]

    @staticmethod
    def _wants(
        manifests: dict[str, Manifest], members: list[str], mine: list[int], plan: ShardPlan
    ) -> list[Want]:
        """What to read of the members' objects for this rank's shards ``mine`` of ``plan``: per object, the
        byte spans of the elements it needs (a region cut like this one: whole objects, read whole)."""
        out: list[Want] = []
        for r in members:
            m = manifests[r]
            spans: dict[int, list[tuple[int, int]]] = {}
            for s in mine:
                lo, hi = plan.bounds[s]
                for info in _cover(m, s, lo, hi):
                    a, b = max(lo, info.start), min(hi, info.start + info.numel)
                    spans.setdefault(m.object_of(info), []).extend(shard_bytes(m, info, a, b)[2])
            out += [(r, m, k, sp) for k, sp in spans.items()]
        return out

    def _values(
        self,
        got: dict[tuple[str, int], ObjectBytes],
        m: Manifest,
        lo: int,
        hi: int,
        wire: str,
        ser: str,
        slot: int,
    ) -> torch.Tensor:
        """Region ``m.region``'s decoded values of ``[lo, hi)`` from what was read of its objects ``got``: its
        shard itself when it covers exactly that range, else assembled (into the reused buffer ``slot``)
        from the parts of the shards that overlap it."""
        infos = _cover(m, None, lo, hi)

        def part(info: ShardInfo, a: int, b: int) -> tuple[int, torch.Tensor]:
            a2, b2, spans = shard_bytes(m, info, a, b)
            buf = got[(m.region, m.object_of(info))].span_bytes(spans)
            return a2, self._decode(
                buf, b2 - a2, wire, ser, slot, f"round {m.tag}: shard {info.index} of {m.region!r}"
            )

        if len(infos) == 1 and (infos[0].start, infos[0].numel) == (lo, hi - lo):
            return part(infos[0], lo, hi)[1]
        dt = _WIRE.get(wire, torch.float32)  # (the scaled and sparse dtypes decode to fp32)
        asm = self._asm.get(slot)
        if asm is None or asm.numel() < hi - lo or asm.dtype != dt:
            asm = self._asm[slot] = torch.empty(hi - lo, dtype=dt, device=self.outer_device)
        x = asm[: hi - lo]
        for info in infos:
            a, b = max(lo, info.start), min(hi, info.start + info.numel)
            a2, d = part(info, a, b)
            x[a - lo : b - lo].copy_(d[a - a2 : b - a2])
        return x

    def replay(self, tag: str, kind: str, out: torch.Tensor | None) -> Commit:
        """A committed round, entirely from the mailbox (a region fast-forwarding): ``out`` = the members'
        weighted average, as every member computed it. Collective."""
        expect = self.expect(kind)

        def read():
            ms = self.ms()
            c = ms.read_commit(tag)
            if c is None:
                from .errors import XRBehind

                raise XRBehind(f"round {tag}: commit gone while fast-forwarding", None)
            return c, ms.member_manifests(c, expect, {})

        commit, manifests = self.group.on_rank(read)
        members = [r for r in self.xr.regions if r in commit.members]
        try:
            self.download_and_average(tag, expect, manifests, members, {}, out)
        except StoreError as e:  # (every rank: on_each) a payload cleaned up after its commit was read
            from .errors import XRBehind

            raise XRBehind(f"round {tag}: {e} while fast-forwarding", None) from e
        self.broadcast_slices(expect.plan, out)
        return commit


def _cover(m: Manifest, s: int | None, lo: int, hi: int) -> list[ShardInfo]:
    """``m``'s shards that hold ``[lo, hi)``: its shard ``s`` alone when that is exactly the range (a region
    cut alike), else those that overlap it."""
    if s is not None and s < len(m.shards) and (m.shards[s].start, m.shards[s].numel) == (lo, hi - lo):
        return [m.shards[s]]
    return overlapping(m.shards, lo, hi)


def theta0_extra(shards: list[ShardInfo]) -> dict:
    return {"theta0": digest_of_digests(s.digest for s in shards)}
