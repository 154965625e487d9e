"""DDP inside a region: the wrapper (only with someone to average with), the timed all-reduce hook of gloo,
and the throw-away step that settles DDP's gradient buckets before the first real step."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from .state import rng_state, set_rng_state

log = logging.getLogger("sbatch_gen.train")


class CommTimer:
    """DDP comm hook state (gloo only): when the first bucket's all-reduce was launched, when the last one
    was, and when the last one completed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.first: float | None = None
        self.launched: float | None = None
        self.last: float | None = None

    def span(self) -> float:
        """First launch to last completion (overlaps the backward)."""
        if self.first is None or self.last is None:
            return 0.0
        return max(0.0, self.last - self.first)

    def exposed(self) -> float:
        """Last launch to last completion: the last bucket is ready when this rank's backward is done, so
        this is how long the rank then waited for the all-reduce, i.e. for the slowest rank to get there."""
        if self.launched is None or self.last is None:
            return 0.0
        return max(0.0, self.last - self.launched)


def _timed_allreduce_hook(state: CommTimer, bucket):
    """DDP's all-reduce with timestamps. Registered on gloo only: its futures complete when the reduction
    has happened. On NCCL they complete at enqueue, so a Python hook would measure nothing and only
    replace DDP's built-in C++ hook."""
    import torch.distributed as dist

    now = time.perf_counter()
    if state.first is None:
        state.first = now
    state.launched = now
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size())
    fut = dist.all_reduce(tensor, async_op=True).get_future()

    def _done(f):
        state.last = time.perf_counter()
        return f.value()[0]

    return fut.then(_done)


@dataclass
class Replicated:
    """What a step calls: ``module`` (DDP(model), or the model itself at world size 1), and ``no_sync`` (DDP:
    a micro-batch before the last one skips the all-reduce)."""

    module: object
    no_sync: Callable[[], contextlib.AbstractContextManager]
    use_ddp: bool  # DDP on: more than one rank in the region
    time_allreduce: bool  # the all-reduce timed by ``comm`` (gloo only)
    comm: CommTimer


def replicate(model, info, device) -> Replicated:
    """``model`` under DDP when there is someone to average with, and one log line saying how."""
    comm = CommTimer()
    # DDP only with someone to average with: at world size 1 (one GPU, as on a GH200 node) it would
    # only copy gradients into buckets and all-reduce them with itself. Everything else (process
    # group, collectives, async saves) stays the same.
    use_ddp = info.is_distributed and info.world_size > 1
    # The timing comm hook on gloo only (see _timed_allreduce_hook); NCCL keeps DDP's built-in hook.
    time_allreduce = use_ddp and info.backend == "gloo"
    out = Replicated(model, contextlib.nullcontext, use_ddp, time_allreduce, comm)
    if use_ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
        if time_allreduce:
            ddp.register_comm_hook(comm, _timed_allreduce_hook)
        out.module, out.no_sync = ddp, ddp.no_sync
    if not use_ddp:
        log.info("DDP: off (world size 1)")
    else:
        log.info(
            "DDP: on, %d ranks, %s",
            info.world_size,
            "all-reduce timed by a comm hook" if time_allreduce else "built-in all-reduce hook (not timed)",
        )
    return out


def autocast(device, amp_dtype):
    """The forward's autocast context: bf16 when ``amp_dtype`` is set, else none."""
    import torch

    if amp_dtype is not None:
        return torch.autocast(device_type=device.type, dtype=amp_dtype)
    return contextlib.nullcontext()


def settle_buckets(t) -> None:
    """Let DDP rebuild its gradient buckets before the first real step, in every process start.

    DDP re-orders its buckets (gradient-ready order) after its first backward. Without this, a resumed
    process reduces its first step in the initial layout while the uninterrupted run had long rebuilt,
    and with more than 2 ranks the all-reduce then sums in another order: not bitwise. One throw-away
    forward/backward on a zero batch (no optimizer step, gradients dropped, RNG restored) makes every
    start reduce in the same layout."""
    if not t.use_ddp:
        return
    import torch

    cfg = t.cfg
    rng = rng_state(t.device)
    x = torch.zeros((cfg.train.batch_size, cfg.model.seq_len), dtype=torch.long, device=t.device)
    with autocast(t.device, t.amp_dtype):
        loss = t.ddp(x, x)
    loss.backward()
    t.model.zero_grad(set_to_none=True)
    t.optimizer.zero_grad(set_to_none=True)
    set_rng_state(rng, t.device)
