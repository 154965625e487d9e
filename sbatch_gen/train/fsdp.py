"""FSDP2 inside a region (``parallelism.kind: fsdp``): ``fully_shard`` on every transformer block and on
the root, over a one-dimensional mesh of the region's ranks, with a mixed-precision policy, the optional
CPU offload, gradient accumulation sharded or unsharded, the whole-model state dict for the export, and
the time each step spends in FSDP's all-gathers and reduce-scatters (:class:`CollectiveTimer`).

The model is sharded in place: every parameter becomes a DTensor holding this rank's rows (``Shard(0)``),
so the optimizer, the checkpoint (``get_state_dict``: sharded, resharded by DCP on load at another world
size) and the cross-region sync all receive the same object as under DDP, with sharded parameters.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from .config import ParallelismConfig
from .parallel import Parallel

log = logging.getLogger("sbatch_gen.train")


def shard(model, p: ParallelismConfig, info, device, amp_dtype) -> Parallel:
    """Shard ``model`` (a :class:`~.model.GPT`, on the CPU or ``device``) over the region's ranks; one log
    line saying how. ``amp_dtype`` (bf16 or None) becomes the parameters' compute dtype."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (info.world_size,))
    # bf16: parameters gathered and computed in bf16, gradients reduced in fp32, the sharded parameters
    # and AdamW state kept in fp32. fp32 (the CPU's default): no casts at all, so runs are bitwise
    # reproducible.
    mp = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32 if amp_dtype else None)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if p.cpu_offload else OffloadPolicy()
    for block in model.blocks:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=p.reshard_after_forward,
            mp_policy=mp,
            offload_policy=offload,
        )
    # The root (embeddings, final norm, the head): its parameters are the first the backward needs, so
    # they stay gathered from its forward to its backward.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    local = [q.to_local() for q in model.parameters()]
    param_device = local[0].device
    log.info(
        "FSDP: %d ranks, %d blocks and the root sharded; compute in %s, gradients reduced in float32; this rank "
        "holds %.2fM of %.2fM parameters on %s (cpu offload %s); reshard after forward %s; gradient "
        "accumulation %s",
        info.world_size,
        len(model.blocks),
        str(amp_dtype or torch.float32).removeprefix("torch."),
        sum(t.numel() for t in local) / 1e6,
        sum(q.numel() for q in model.parameters()) / 1e6,
        param_device,
        "on" if p.cpu_offload else "off",
        "on" if p.reshard_after_forward else "off",
        p.grad_accumulation,
    )
    no_sync = (
        (lambda: _unsharded_accumulation(model))
        if p.grad_accumulation == "unsharded"
        else contextlib.nullcontext
    )
    timer = CollectiveTimer.install([*model.blocks, model], device)
    return Parallel(
        "fsdp", model, no_sync, None, None, param_device, lambda: full_state_dict(model), collectives=timer
    )


class CollectiveTimer:
    """The seconds one step spends in FSDP2's collectives on this rank, all-gathers and reduce-scatters apart.

    Each FSDP module's all-gather and reduce-scatter go through a thin wrapper of FSDP's own implementation
    (``set_custom_all_gather`` / ``set_custom_reduce_scatter``: the same calls, the same buffers) that times
    every call:

    - CPU (gloo): the host clock around the call. FSDP issues them synchronously and gloo runs them on the
      calling thread, so this is the whole collective, the wait for the other ranks included, and the host
      does nothing else meanwhile: all of it is exposed.
    - CUDA (NCCL): a pair of timing events on the collective's stream around the call, read once the step's
      work is done (:meth:`Times.seconds`, when the step's record is written, one step later): from when that
      stream reaches the collective to its completion, the wait for the other ranks and for the process
      group's earlier collectives included. FSDP runs these streams beside the compute, so this is not the
      time the step lost to them.

    At world size 1 FSDP issues no collective: both are 0. FSDP issues every collective of the trainer
    synchronously on its stream; an asynchronous one (only an explicit ``unshard(async_op=True)`` makes one)
    would be timed to its launch only."""

    KINDS = ("all_gather", "reduce_scatter")

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.reset()

    @classmethod
    def install(cls, modules, device) -> CollectiveTimer | None:
        """One timer for every module of the list (each a ``fully_shard``-ed module); None, with a log line,
        when this torch has no custom collectives (then the fields are null)."""
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
                DefaultAllGather,
                DefaultReduceScatter,
            )
        except ImportError:
            log.info("FSDP: this torch has no custom collectives; their time is not measured")
            return None
        timer = cls(device.type == "cuda")
        for m in modules:
            m.set_custom_all_gather(_Timed(timer, "all_gather", DefaultAllGather()))
            m.set_custom_reduce_scatter(_Timed(timer, "reduce_scatter", DefaultReduceScatter()))
        return timer

    def reset(self) -> None:
        self._host = dict.fromkeys(self.KINDS, 0.0)
        self._events: list[tuple[str, Any, Any]] = []

    def timed(self, kind: str, call):
        """``call()``, timed as a collective of ``kind``."""
        if self.cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()  # on the current stream: the collective's own (FSDP enters it before the call)
            out = call()
            end.record()
            self._events.append((kind, start, end))
            return out
        t0 = time.perf_counter()
        out = call()
        self._host[kind] += time.perf_counter() - t0
        return out

    def take(self) -> Times:
        """This step's collectives (and a fresh count for the next step)."""
        times = Times(self._host, self._events, self.cuda)
        self.reset()
        return times


class Times:
    """One step's collective times, as :meth:`CollectiveTimer.take` left them."""

    def __init__(self, host: dict[str, float], events: list, cuda: bool) -> None:
        self._host, self._events, self.cuda = host, events, cuda

    def blocking(self) -> float | None:
        """Seconds the host itself spent in the collectives (CPU: all of them); None on CUDA."""
        return None if self.cuda else sum(self._host.values())

    def seconds(self) -> dict[str, float]:
        """``{kind: seconds}``. CUDA: waits for the events, done long before when the step's record is
        written (its agreement was read after the step's work)."""
        out = dict(self._host)
        for kind, start, end in self._events:
            end.synchronize()
            out[kind] += start.elapsed_time(end) / 1000.0
        return out


class _Timed:
    """An FSDP all-gather or reduce-scatter implementation (``inner``: FSDP's default), each call timed."""

    def __init__(self, timer: CollectiveTimer, kind: str, inner) -> None:
        self.timer, self.kind, self.inner = timer, kind, inner

    def allocate(self, *args, **kwargs):
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.timer.timed(self.kind, lambda: self.inner(*args, **kwargs))


@contextlib.contextmanager
def _unsharded_accumulation(model):
    """A micro-batch before the last one: its gradients add to the full (unsharded) gradients each rank
    holds; the last micro-batch's backward reduce-scatters the sum."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_state_dict(model) -> dict:
    """Collective: every parameter gathered whole; rank 0 gets them on the CPU, the other ranks nothing."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
