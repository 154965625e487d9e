"""DDP inside a region (``parallelism.kind: ddp``): the wrapper (only with someone to average with), the
timed all-reduce hook of gloo, and the throw-away step that settles DDP's gradient buckets before the first
real step."""

from __future__ import annotations

import contextlib
import logging

from .parallel import CommTimer, Parallel, autocast
from .state import rng_state, set_rng_state

log = logging.getLogger("sbatch_gen.train")


def _timed_allreduce_hook(state: CommTimer, bucket):
    """DDP's all-reduce with timestamps. Registered on gloo only: its futures complete when the reduction
    has happened. On NCCL they complete at enqueue, so a Python hook would measure nothing and only
    replace DDP's built-in C++ hook."""
    import torch.distributed as dist

    state.launch()
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size())
    fut = dist.all_reduce(tensor, async_op=True).get_future()

    def _done(f):
        state.done()
        return f.value()[0]

    return fut.then(_done)


def replicate(model, info, device, amp_dtype) -> Parallel:
    """``model`` under DDP when there is someone to average with, and one log line saying how."""
    # DDP only with someone to average with: at world size 1 (one GPU, as on a GH200 node) it would
    # only copy gradients into buckets and all-reduce them with itself. Everything else (process
    # group, collectives, async saves) stays the same.
    if not (info.is_distributed and info.world_size > 1):
        log.info("DDP: off (world size 1)")
        return Parallel("none", model, contextlib.nullcontext, amp_dtype, None, device, model.state_dict)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(
        model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
    )
    # The timing comm hook on gloo only (see _timed_allreduce_hook); NCCL keeps DDP's built-in hook.
    comm = CommTimer() if info.backend == "gloo" else None
    if comm is not None:
        ddp.register_comm_hook(comm, _timed_allreduce_hook)
    log.info(
        "DDP: on, %d ranks, %s",
        info.world_size,
        "all-reduce timed by a comm hook" if comm is not None else "built-in all-reduce hook (not timed)",
    )
    return Parallel("ddp", ddp, ddp.no_sync, amp_dtype, comm, device, model.state_dict)


def settle_buckets(t) -> None:
    """Let DDP rebuild its gradient buckets before the first real step, in every process start.

    DDP re-orders its buckets (gradient-ready order) after its first backward. Without this, a resumed
    process reduces its first step in the initial layout while the uninterrupted run had long rebuilt,
    and with more than 2 ranks the all-reduce then sums in another order: not bitwise. One throw-away
    forward/backward on a zero batch (no optimizer step, gradients dropped, RNG restored) makes every
    start reduce in the same layout."""
    if t.par.kind != "ddp":
        return
    import torch

    cfg = t.cfg
    rng = rng_state(t.device)
    x = torch.zeros((cfg.train.batch_size, cfg.model.seq_len), dtype=torch.long, device=t.device)
    with autocast(t.device, t.par.amp_dtype):
        loss = t.par.module(x, x)
    loss.backward()
    t.model.zero_grad(set_to_none=True)
    t.optimizer.zero_grad(set_to_none=True)
    set_rng_state(rng, t.device)
