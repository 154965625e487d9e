"""Collectives inside one region (the trainer's default process group), as the outer sync needs them.

The one rule they serve: a failure on any rank reaches every rank before anything changes, and every
rank raises the same error, so no rank is left waiting in a collective. :meth:`Region.on_rank` and
:meth:`Region.on_each` wrap a piece of work in exactly that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as tdist

from .errors import (
    StoreError,
    XRBehind,
    XRCancelled,
    XRChecksumError,
    XRError,
    XRLayoutError,
    XRMissingRound,
    XRNoQuorum,
    XRSettingsError,
    XRTimeout,
)

T = TypeVar("T")
_ERRORS = {
    c.__name__: c
    for c in (
        XRError,
        XRTimeout,
        XRChecksumError,
        XRLayoutError,
        XRMissingRound,
        StoreError,
        XRNoQuorum,
        XRBehind,
        XRCancelled,
        XRSettingsError,
    )
}
Err = tuple[str, str]


def capture(e: BaseException) -> Err:
    """An exception as a picklable (class name, message) pair; unknown classes travel as XRError."""
    name = type(e).__name__
    return (name if name in _ERRORS else "XRError", str(e) if name in _ERRORS else f"{name}: {e}")


def reraise(err: Err) -> None:
    raise _ERRORS[err[0]](err[1])


def held(t: torch.Tensor | None, what: str) -> torch.Tensor:
    """``t`` on a rank that holds it: the flat buffers live on the region's leaders only, the other ranks
    pass None and never reach the code that uses them."""
    if t is None:
        raise XRError(f"internal: {what} is used on a rank that holds none (only the region's leaders do)")
    return t


# A host tensor broadcast over a device backend (NCCL) goes through device buffers of at most this many
# bytes, so the outer state held in host memory never needs a device copy of its whole size.
STAGE_BYTES = 64 << 20


class Region:
    """Collectives of this region; no-ops for one process.

    The region's *leaders* (:meth:`set_leaders`: the node leaders that own shards) hold the outer state;
    :meth:`leaders_broadcast` runs among them only, :meth:`broadcast_tensors` over the whole region."""

    def __init__(self, dist, comm_device: torch.device) -> None:
        self.on = (
            bool(getattr(dist, "is_distributed", False)) and tdist.is_available() and tdist.is_initialized()
        )
        self.rank = tdist.get_rank() if self.on else 0
        self.world = tdist.get_world_size() if self.on else 1
        self.comm_device = comm_device
        self.pg = None  # the process group of every collective here (None: the default group)
        self.leaders = [0]
        self._leaders_pg = None  # a process group of the leaders when they are some, not all, ranks

    def background(self) -> Region | None:
        """Collective (every rank, after :meth:`set_leaders`): the leaders as a region of their own, on a
        separate gloo process group, for the thread that runs a round in the background while training
        goes on (``overlap: eager``): its collectives never interleave with the trainer's on the default
        group. Ranks and ``src`` stay global ranks. None on the other ranks."""
        bg = Region.__new__(Region)
        bg.on = self.on and len(self.leaders) > 1
        bg.pg = tdist.new_group(self.leaders, backend="gloo") if bg.on else None
        bg.rank, bg.world = self.rank, len(self.leaders)
        bg.comm_device = torch.device("cpu")
        bg.leaders, bg._leaders_pg = list(self.leaders), bg.pg
        return bg if self.is_leader else None

    def set_leaders(self, ranks: list[int]) -> None:
        """Collective (every rank, same ``ranks``): the leaders' process group, created once."""
        self.leaders = sorted(ranks)
        if self.on and 1 < len(self.leaders) < self.world:
            self._leaders_pg = tdist.new_group(self.leaders)

    @property
    def is_leader(self) -> bool:
        return self.rank in self.leaders

    def leaders_broadcast(self, t: torch.Tensor, src: int) -> None:
        """``t`` (contiguous) from leader ``src`` to every leader; only leaders call it. A tensor off the
        communication device travels in pieces of at most :data:`STAGE_BYTES`."""
        if not self.on or len(self.leaders) == 1:
            return
        if t.device == self.comm_device:
            tdist.broadcast(t, src=src, group=self._leaders_pg)
            return
        flat = t.view(-1)
        step = max(1, STAGE_BYTES // t.element_size())
        stage = torch.empty(min(step, flat.numel()), dtype=t.dtype, device=self.comm_device)
        for lo in range(0, flat.numel(), step):
            hi = min(lo + step, flat.numel())
            piece = stage[: hi - lo]
            if self.rank == src:
                piece.copy_(flat[lo:hi])
            tdist.broadcast(piece, src=src, group=self._leaders_pg)
            if self.rank != src:
                flat[lo:hi].copy_(piece)

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Each tensor, in place, from ``src`` to every rank of the region, one broadcast after the other
        (NCCL queues them on its stream without blocking the host)."""
        if not self.on:
            return
        for t in tensors:
            c = t if t.is_contiguous() else t.contiguous()
            tdist.broadcast(c, src=src, group=self.pg)
            if c is not t:
                t.copy_(c)

    def all_gather(self, obj) -> list:
        if not self.on:
            return [obj]
        out = [None] * self.world
        tdist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj, src: int = 0):
        if not self.on:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]

    def broadcast_tensor(self, t: torch.Tensor, src: int) -> None:
        if self.on:
            tdist.broadcast(t, src=src, group=self.pg)

    def agree(self, err: Err | None) -> None:
        """Every rank raises the first error any rank saw."""
        for e in self.all_gather(err):
            if e is not None:
                reraise(e)

    def on_rank(self, fn: Callable[[], T], rank: int = 0) -> T:
        """``fn()`` on ``rank`` only; every rank gets its result, or raises its error."""
        err, res = None, None
        if self.rank == rank:
            try:
                res = fn()
            except Exception as e:  # noqa: BLE001 - every rank must hear about it
                err = capture(e)
        err, res = self.broadcast((err, res), src=rank)
        if err is not None:
            reraise(err)
        return res

    def on_each(self, fn: Callable[[], T], active: bool = True) -> list[T | None]:
        """``fn()`` on every rank where ``active``; every rank gets the list of results (None where
        inactive), or raises the first error of any rank."""
        err, res = None, None
        if active:
            try:
                res = fn()
            except Exception as e:  # noqa: BLE001
                err = capture(e)
        gathered = self.all_gather((err, res))
        for failure, _ in gathered:
            if failure is not None:
                reraise(failure)
        return [r for _, r in gathered]
