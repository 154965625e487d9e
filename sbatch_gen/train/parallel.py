"""In-region data parallelism as the loop sees it, whichever kind runs (train config ``parallelism.kind``):
DDP (:mod:`.ddp`) or FSDP2 (:mod:`.fsdp`). Each builds one :class:`Parallel`; the loop, the checkpoints
and the export use only that."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class CommTimer:
    """Host timestamps of one step's gradient reduction, where the host can see it (DDP's comm hook on
    gloo): when the first bucket's reduction was launched, when the last one was, and when the last one
    completed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.first: float | None = None
        self.launched: float | None = None
        self.last: float | None = None

    def launch(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.launched = now

    def done(self) -> None:
        self.last = time.perf_counter()

    def span(self) -> float:
        """First launch to last completion (overlaps the backward)."""
        if self.first is None or self.last is None:
            return 0.0
        return max(0.0, self.last - self.first)

    def exposed(self) -> float:
        """Last launch to last completion: the last bucket is ready when this rank's backward is done, so
        this is how long the rank then waited for the reduction, i.e. for the slowest rank to get there."""
        if self.launched is None or self.last is None:
            return 0.0
        return max(0.0, self.last - self.launched)


@dataclass
class Parallel:
    """What the loop, the checkpoints and the export use of the region's data parallelism.

    ``module`` is what a step calls: DDP(model), the model itself (one rank without DDP), or under FSDP the
    model, sharded in place (its parameters are DTensors: the same object the optimizer, the checkpoint's
    ``get_state_dict`` and the cross-region sync receive). ``no_sync()`` wraps the forward and backward of
    a micro-batch before the last one: it skips the gradient reduction there (a null context when nothing
    is skipped). ``amp_dtype`` is the forward's autocast dtype (None under FSDP, whose mixed-precision
    policy casts instead). ``comm`` times the reduction when the host can see it (DDP on gloo), else None.
    ``param_device`` is where the parameters (this rank's shards) and so the optimizer state live: the
    device, or the CPU under FSDP's CPU offload. ``full_state_dict()`` is collective: every rank calls it,
    rank 0 gets every parameter whole, on the CPU or the device (the export's input). ``collectives`` times
    FSDP's all-gathers and reduce-scatters (:class:`~.fsdp.CollectiveTimer`; None under DDP)."""

    kind: str  # "ddp", "fsdp", or "none": one rank, no wrapper
    module: Any
    no_sync: Callable[[], contextlib.AbstractContextManager]
    amp_dtype: Any  # torch.dtype | None
    comm: CommTimer | None
    param_device: Any  # torch.device
    full_state_dict: Callable[[], dict]
    collectives: Any = None  # fsdp.CollectiveTimer | None


def autocast(device, amp_dtype):
    """The forward's autocast context: ``amp_dtype`` (bf16) when set, else none."""
    import torch

    if amp_dtype is not None:
        return torch.autocast(device_type=device.type, dtype=amp_dtype)
    return contextlib.nullcontext()
