"""FSDP2 inside a region (``parallelism.kind: fsdp``): ``fully_shard`` on every transformer block and on
the root, over a one-dimensional mesh of the region's ranks, with a mixed-precision policy, the optional
CPU offload, gradient accumulation sharded or unsharded, and the whole-model state dict for the export.

The model is sharded in place: every parameter becomes a DTensor holding this rank's rows (``Shard(0)``),
so the optimizer, the checkpoint (``get_state_dict``: sharded, resharded by DCP on load at another world
size) and the cross-region sync all receive the same object as under DDP, with sharded parameters.
"""

from __future__ import annotations

import contextlib
import logging

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
    return Parallel("fsdp", model, no_sync, None, None, param_device, lambda: full_state_dict(model))


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
