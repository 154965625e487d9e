"""A global gradient norm whose bits do not depend on how a region shards its model (``sync: grad``).

In grad mode every region applies the same averaged gradient, then clips it by its global norm. torch's
norm (``get_total_norm``) sums in an order set by the tensors' shapes and the device's reduction kernels:
an FSDP region (each rank a Shard(0) slice of every parameter) and a DDP region (whole parameters) get
norms a last bit apart, clip by different factors and drift apart. Here the sum has one fixed order:

- each row of dim 0 (Shard(0) never cuts one) is summed by a fixed halving tree over its columns, zero
  padded to a power of two: elementwise adds only, so no kernel or row count changes the bits;
- every rank writes its rows' sums at their canonical places of one vector of all the model's rows
  (parameters in order), zeros elsewhere, and a sharded region adds the ranks' vectors (``all_reduce``):
  exact, as each place has one non-zero contributor;
- the same tree sums that vector.

The result is the same float32 on every rank of every region, whatever the sharding or world size, and
within rounding of torch's norm.
"""

from __future__ import annotations

import torch


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sums along the last dim of ``x`` by a fixed halving tree (zero padded to a power of two)."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _rows(p: torch.Tensor) -> tuple[int, int, int, torch.Tensor | None]:
    """(rows of the whole parameter, this rank's first row, last row + 1, its local gradient or None)."""
    from torch.distributed.tensor import DTensor

    from .xr.flat import shard_rows

    rows = p.shape[0] if p.dim() else 1
    g = p.grad
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        lo, hi = shard_rows(rows, mesh.size(), mesh.get_local_rank())
        return rows, lo, hi, g.to_local() if isinstance(g, DTensor) else g
    return rows, 0, rows, g


def canonical_grad_norm(params, device: torch.device) -> torch.Tensor:
    """The L2 norm of the gradients of ``params`` (in model order), on ``device``, as float32, in the
    fixed order above. Collective in a sharded region (every rank calls it); a parameter without a
    gradient counts as zeros."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = list(params)
    parts = [_rows(p) for p in params]
    vec = torch.zeros(sum(r for r, *_ in parts), dtype=torch.float32, device=device)
    at = 0
    for rows, lo, hi, g in parts:
        if g is not None and hi > lo:
            sq = g.detach().float().reshape(hi - lo, -1).square()
            vec[at + lo : at + hi] = tree_sum(sq).to(device)
        at += rows
    sharded = next((p for p in params if isinstance(p, DTensor)), None)
    if sharded is not None:
        dist.all_reduce(vec, group=sharded.device_mesh.get_group())
    return tree_sum(vec).sqrt()


def clip_grads(params, max_norm: float, device, canonical: bool = False) -> torch.Tensor:
    """Clip the gradients of ``params`` to a global L2 norm of ``max_norm``; returns the norm before
    clipping, on ``device``. Under FSDP the gradients are DTensor shards (on the CPU with offload): the norm
    of the local shards is reduced over the ranks before it scales them. ``canonical`` (grad mode, where
    every region clips the same averaged gradient): the norm of :func:`canonical_grad_norm`, the same bits
    whatever the region's sharding; else torch's."""
    if canonical:
        norm = canonical_grad_norm(params, device)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
        if hasattr(norm, "full_tensor"):  # a DTensor: each rank's partial norm
            norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm.to(device, non_blocking=True)
