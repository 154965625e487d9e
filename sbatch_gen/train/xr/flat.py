"""The model's trainable parameters as one flat vector: views, gathers and scatters.

The outer sync works on flat fp32 buffers (``theta_outer``, momentum, the average), held by the region's
leaders only; :class:`FlatParams` moves data between them and the parameters (or their ``.grad``) by
offset, without a per-step allocation, and names the tensors the other ranks receive by broadcast. A model
sharded with FSDP2: the buffers hold this rank's local shards one after the other (``offsets``), and
``ranges`` says where each lies in the canonical flat layout (the payload's, the same as a DDP region's).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .fragments import assign


def _strip(name: str) -> str:
    for pre in ("module.", "_orig_mod."):
        while name.startswith(pre):
            name = name[len(pre) :]
    return name.replace("._orig_mod.", ".").replace(".module.", ".")


def layout_fingerprint(model: nn.Module) -> str:
    items = [(_strip(n), list(p.shape), str(p.dtype)) for n, p in model.named_parameters() if p.requires_grad]
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def _sharded(p: torch.Tensor) -> str | None:
    """Why the sync cannot take ``p`` (a DTensor other than FSDP2's Shard(0) over a 1-D mesh of the whole
    region, FSDP1's flat parameter), or None."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(p, DTensor):
        mesh = p.device_mesh
        if mesh.ndim != 1 or list(p.placements) != [Shard(0)]:
            return (
                f"a DTensor placed as {list(p.placements)} on a {mesh.ndim}-D mesh: only FSDP2's Shard(0) on "
                "a 1-D mesh over the whole region is supported (no tensor or pipeline parallelism)"
            )
        if p.ndim == 0:
            return "a 0-dim DTensor"
        return None
    if type(p).__name__ == "FlatParameter":
        return "an FSDP flat parameter: the sync takes FSDP2 (fully_shard), not FSDP1"
    return None


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of dim 0 that Shard(0) over ``world`` ranks gives ``rank`` (torch.chunk's
    split: chunks of ceil(rows / world), the last ranks possibly empty)."""
    chunk = -(-rows // world)
    lo = min(rank * chunk, rows)
    return lo, min(lo + chunk, rows)


class FlatParams:
    """``fragments`` > 1 (Streaming DiLoCo): the flat order holds the fragments one after the other
    (:mod:`.fragments`), fragment p at ``fragment_bounds[p]:fragment_bounds[p+1]`` of the canonical layout
    (and at :meth:`fragment` of the buffers: a sharded region's hold its shards of each fragment in turn),
    and the layout fingerprint names the split."""

    def __init__(self, model: nn.Module, fragments: int = 1) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for name, p in named:
            why = _sharded(p)
            if why is not None:
                raise ValueError(f"parameter {_strip(name)} is {why}")
        from torch.distributed.tensor import DTensor

        kinds = {isinstance(p, DTensor) for _, p in named}
        if len(kinds) > 1:
            plain = next(n for n, p in named if not isinstance(p, DTensor))
            raise ValueError(
                f"parameter {_strip(plain)} is a plain tensor beside sharded (DTensor) ones: shard every "
                "parameter (fully_shard the root module too) or none"
            )
        # FSDP2: this rank holds a Shard(0) slice of each parameter: one contiguous range of it
        self.sharded = kinds == {True}
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.layout = layout_fingerprint(model)
        frag = [0] * len(named)  # each parameter's fragment, in the flat order
        if fragments > 1:
            which = assign([_strip(n) for n, _ in named], [p.numel() for _, p in named], fragments)
            named = [named[i] for i in sorted(range(len(named)), key=lambda i: (which[i], i))]
            frag = sorted(which)
            split = json.dumps([self.layout, fragments, which])
            self.layout = hashlib.sha256(split.encode()).hexdigest()[:16]
        self.names = [_strip(n) for n, _ in named]
        self._dparams: list[Any] = [p for _, p in named]  # (sharded: DTensors)
        self.world, self.rank = 1, 0
        self.canonical = [0]  # each parameter's start in the canonical flat layout (the payload's)
        for p in self._dparams:
            self.canonical.append(self.canonical[-1] + p.numel())
        self.numel = self.canonical[-1]  # the payload's elements (the whole model)
        # the buffers' coordinates: the whole model, or (sharded) this rank's shards one after the other
        self.offsets = [0]
        self.ranges: list[tuple[int, int]] = []  # (sharded) this rank's canonical range of each parameter
        if self.sharded:
            mesh = self._dparams[0].device_mesh
            self.world, self.rank = mesh.size(), mesh.get_local_rank()
            for name, p, start in zip(self.names, self._dparams, self.canonical, strict=False):
                lo, hi = shard_rows(p.shape[0], self.world, self.rank)
                local = p.to_local()
                if tuple(local.shape) != (hi - lo, *p.shape[1:]) or not local.is_contiguous():
                    raise ValueError(
                        f"parameter {name}: local shard {tuple(local.shape)} is not rows {lo}:{hi} of "
                        f"{tuple(p.shape)} split over {self.world} ranks (uneven Shard(0) placement)"
                    )
                row = math.prod(p.shape[1:])
                self.ranges.append((start + lo * row, start + hi * row))
        for t in self.params:
            self.offsets.append(self.offsets[-1] + t.numel())
        self.local_numel = self.offsets[-1]
        # each fragment's first parameter, then where the fragments start in the canonical layout and in
        # the buffers (the same but for a sharded region, whose buffers hold its shards of each fragment)
        firsts = [bisect.bisect_left(frag, k) for k in range(max(fragments, 1) + 1)]
        self.fragment_bounds = [self.canonical[i] for i in firsts]
        self._local_bounds = [self.offsets[i] for i in firsts]

    @property
    def params(self) -> list[torch.Tensor]:
        """The tensors this rank holds: the parameters, or (sharded) their local shards."""
        if not self.sharded:
            return self._dparams
        return [p.to_local().detach() for p in self._dparams]

    def held(self, plan_world: int | None = None) -> list[tuple[int, int, int]]:
        """(sharded) Every rank's canonical ranges ``(start, end, rank)``, in canonical order (they tile the
        layout): each parameter's Shard(0) rows of each rank; empty ranges left out."""
        out = []
        for p, start in zip(self._dparams, self.canonical, strict=False):
            row = math.prod(p.shape[1:])
            for k in range(self.world):
                lo, hi = shard_rows(p.shape[0], self.world, k)
                if hi > lo:
                    out.append((start + lo * row, start + hi * row, k))
        return out

    def as_dtensors(self, buf: torch.Tensor) -> dict[str, Any]:
        """(sharded) A buffer of this rank's shards as one DTensor per parameter, placed like it (views of
        ``buf``): what a checkpoint saves, and what DCP loads in place, resharded when the region comes
        back with another world size."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name, p, t, a in zip(self.names, self._dparams, self.params, self.offsets, strict=False):
            view = buf[a : a + t.numel()].view(t.shape)
            out[name] = DTensor.from_local(
                view, p.device_mesh, list(p.placements), run_check=False, shape=p.shape, stride=p.stride()
            )
        return out

    def local_at(self, lo: int, hi: int) -> tuple[int, int]:
        """The buffers' slice of the canonical range ``[lo, hi)`` (inside one of this rank's ranges)."""
        if not self.sharded:
            return lo, hi
        i = bisect.bisect_right(self.canonical, lo) - 1
        a, b = self.ranges[i]
        if not (a <= lo and hi <= b):
            raise ValueError(f"internal: canonical range {lo}:{hi} is not held by rank {self.rank}")
        return self.offsets[i] + lo - a, self.offsets[i] + hi - a

    def fragment(self, p: int) -> tuple[int, int]:
        """The buffers' range ``(lo, hi)`` of fragment ``p`` (a sharded region: this rank's shards of it)."""
        return self._local_bounds[p], self._local_bounds[p + 1]

    def fragment_payload(
        self, p: int
    ) -> tuple[int, list[tuple[int, int, int]] | None, Callable[[int, int], tuple[int, int]] | None, int]:
        """Fragment ``p``'s payload, counted from its start: its elements; (sharded) every rank's ranges of
        it (:meth:`held`) and the slice of the fragment's buffers (:meth:`fragment`) that holds a range of
        it, else None; this rank's elements of it. What :meth:`.exchange.Exchange.for_fragment` takes."""
        clo, chi = self.fragment_bounds[p], self.fragment_bounds[p + 1]
        lo, hi = self.fragment(p)
        if not self.sharded:
            return chi - clo, None, None, hi - lo
        pieces = [(a - clo, b - clo, k) for a, b, k in self.held() if clo <= a < chi]

        def at(a: int, b: int) -> tuple[int, int]:
            x, y = self.local_at(a + clo, b + clo)
            return x - lo, y - lo

        return chi - clo, pieces, at, hi - lo

    def views(self, flat: torch.Tensor):
        for p, lo, hi in zip(self.params, self.offsets[:-1], self.offsets[1:], strict=True):
            yield p, flat[lo:hi].view(p.shape)

    @torch.no_grad()
    def gather(self, out: torch.Tensor) -> torch.Tensor:
        for p, v in self.views(out):
            v.copy_(p.detach())
        return out

    @torch.no_grad()
    def scatter(self, flat: torch.Tensor) -> None:
        for p, v in self.views(flat):
            p.copy_(v)

    def _part(self, lo: int, hi: int) -> list[tuple[torch.Tensor, int, int]]:
        """The parameters that make up the flat range ``lo:hi`` (which starts and ends at parameter
        boundaries: a fragment), with their flat ranges."""
        i, j = bisect.bisect_left(self.offsets, lo), bisect.bisect_left(self.offsets, hi)
        if self.offsets[i] != lo or self.offsets[j] != hi:
            raise ValueError(f"flat range {lo}:{hi} does not start and end at parameter boundaries")
        return [(self.params[k], self.offsets[k], self.offsets[k + 1]) for k in range(i, j)]

    @torch.no_grad()
    def scatter_part(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        """``flat[lo:hi]`` into the parameters of that range (any device)."""
        for p, a, b in self._part(lo, hi):
            p.copy_(flat[a:b].view(p.shape))

    @torch.no_grad()
    def delta_part_into(self, theta_outer: torch.Tensor, out: torch.Tensor, lo: int, hi: int) -> None:
        """``out[lo:hi] = theta_outer[lo:hi] - theta_local[lo:hi]`` (:meth:`delta_into` of one range)."""
        for p, a, b in self._part(lo, hi):
            local = p.detach().reshape(-1)
            if local.device != out.device:
                local = out[a:b].copy_(local)
            torch.sub(theta_outer[a:b], local, out=out[a:b])

    @torch.no_grad()
    def gather_part(self, out: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The parameters of the range ``lo:hi`` into ``out[lo:hi]``; returns that slice."""
        for p, a, b in self._part(lo, hi):
            out[a:b].copy_(p.detach().reshape(-1))
        return out[lo:hi]

    def tensors_part(self, lo: int, hi: int) -> list[torch.Tensor]:
        """:meth:`tensors` of the parameters in the range ``lo:hi``."""
        return [p.detach() for p, _, _ in self._part(lo, hi)]

    def direct(self, device: torch.device) -> bool:
        """Can slices of flat buffers on ``device`` be copied straight into the parameters' storage?"""
        return all(p.device == device and p.is_contiguous() for p in self.params)

    @torch.no_grad()
    def scatter_range(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        """``flat[lo:hi]`` into the parameters that hold those elements (contiguous, same device)."""
        i = bisect.bisect_right(self.offsets, lo) - 1
        while i < len(self.params) and self.offsets[i] < hi:
            off = self.offsets[i]
            a, b = max(lo, off), min(hi, self.offsets[i + 1])
            self.params[i].detach().view(-1)[a - off : b - off].copy_(flat[a:b])
            i += 1

    @torch.no_grad()
    def delta_into(self, theta_outer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = theta_outer - theta_local`` (the outer "gradient"; note the sign), in one pass when the
        parameters live on the buffers' device."""
        if not self.direct(out.device):
            return torch.sub(theta_outer, self.gather(out), out=out)
        for p, lo, hi in zip(self.params, self.offsets[:-1], self.offsets[1:], strict=True):
            torch.sub(theta_outer[lo:hi], p.detach().view(-1), out=out[lo:hi])
        return out

    def _grads(self, create: bool) -> list[torch.Tensor | None]:
        """Each parameter's gradient as this rank holds it (sharded: the local shard of its DTensor
        gradient, sharing its storage), None where there is none; ``create``: zeros there first."""
        out: list[torch.Tensor | None] = []
        for p in self._dparams:
            if p.grad is None and create:
                p.grad = torch.zeros_like(p)
            g = p.grad
            out.append(None if g is None else (g.to_local() if self.sharded else g).detach())
        return out

    @torch.no_grad()
    def gather_grads(self, out: torch.Tensor) -> torch.Tensor:
        for g, (_, v) in zip(self._grads(False), self.views(out), strict=True):
            if g is None:
                v.zero_()
            else:
                v.copy_(g)
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The parameters' data (detached, sharing storage): what a broadcast writes into."""
        return [p.detach() for p in self.params]

    def grads(self) -> list[torch.Tensor]:
        """The parameters' ``.grad`` (zeros where there is none yet): what a broadcast writes into."""
        return [g for g in self._grads(True) if g is not None]

    @torch.no_grad()
    def scatter_grads(self, flat: torch.Tensor) -> None:
        for g, (_, v) in zip(self.grads(), self.views(flat), strict=True):
            g.copy_(v)
