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
    XRChecksumError,
    XRError,
    XRLayoutError,
    XRMissingRound,
    XRNoQuorum,
    XRTimeout,
)

T = TypeVar("T")
_ERRORS = {c.__name__: c for c in (XRError, XRTimeout, XRChecksumError, XRLayoutError, XRMissingRound, StoreError,
                                   XRNoQuorum, XRBehind)}
Err = tuple[str, str]


def capture(e: BaseException) -> Err:
    """An exception as a picklable (class name, message) pair; unknown classes travel as XRError."""
    name = type(e).__name__
    return (name if name in _ERRORS else "XRError", str(e) if name in _ERRORS else f"{name}: {e}")


def reraise(err: Err) -> None:
    raise _ERRORS[err[0]](err[1])


class Region:
    """Collectives of this region; no-ops for one process."""

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
        for e, _ in gathered:
            if e is not None:
                reraise(e)
        return [r for _, r in gathered]
