"""Elementwise kernels of the outer step on flat fp32 buffers: the regions' weighted average and the
Nesterov update, with the same bits on every device.

Every op rounds once (no fused multiply-add), so CPU and GPU produce identical results; on the CPU the
work runs over cache-sized blocks (on a GPU over larger ones, to bound the scratch), which changes no
element's sequence of operations.
"""

from __future__ import annotations

import torch

# Elementwise work on the CPU runs over blocks of this many elements (2 MiB of fp32): all the passes of
# one block (decode, multiply, add; the Nesterov ops; the copy into the model) then hit the caches, and
# main memory sees each buffer once, as from a fused kernel. Blocking does not change any element's
# sequence of operations, so the bits are those of the whole-buffer ops.
CPU_BLOCK = 1 << 19
# On a GPU the ops take blocks of this many elements (64 MiB of fp32): few enough launches to run at HBM
# bandwidth, and the outer step's scratch stays this small instead of a whole fp32 copy of the model.
GPU_BLOCK = 1 << 24


def block_size(device: torch.device | str, n: int) -> int:
    """Elements per block for buffers of ``n`` elements on ``device`` (at least 1)."""
    return max(1, min(n, CPU_BLOCK if torch.device(device).type == "cpu" else GPU_BLOCK))


def blocks(n: int, device: torch.device | str, block: int | None = None):
    """``(lo, hi)`` ranges covering ``0..n``: ``block`` elements each, else :func:`block_size`."""
    step = block or block_size(device, n)
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)


@torch.no_grad()
def accumulate_(acc: torch.Tensor, x: torch.Tensor, w: float, scratch: torch.Tensor, *, first: bool) -> None:
    """``acc (=|+=) w * float(x)``: exact conversion of ``x`` (bf16/fp32) into ``scratch``, then a separate
    multiply and add (no fused multiply-add), so every device produces the same bits."""
    if first:
        acc.copy_(x).mul_(w)
    else:
        acc.add_(scratch.copy_(x).mul_(w))


@torch.no_grad()
def weighted_average_(
    acc: torch.Tensor,
    xs: list[torch.Tensor],
    ws: list[float],
    scratch: torch.Tensor,
    block: int | None = None,
) -> None:
    """``acc = sum_i ws[i] * float(xs[i])`` in the order given, block by block (see :data:`CPU_BLOCK`);
    ``scratch`` needs one block's elements."""
    for lo, hi in blocks(acc.numel(), acc.device, block):
        tmp = scratch[: hi - lo]
        for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
            accumulate_(acc[lo:hi], x[lo:hi], w, tmp, first=i == 0)


@torch.no_grad()
def nesterov_block_(
    theta: torch.Tensor, m: torch.Tensor, g: torch.Tensor, lr: float, mu: float, scratch: torch.Tensor
) -> None:
    """:func:`outer_nesterov_` on one range, as whole-tensor ops (``scratch`` as large as ``theta``)."""
    m.mul_(mu).add_(g)
    if mu > 0:
        torch.mul(m, mu, out=scratch).add_(g)  # the Nesterov look-ahead g + mu*m
    else:
        scratch.copy_(g)
    theta.sub_(scratch.mul_(lr))


@torch.no_grad()
def outer_nesterov_(
    theta: torch.Tensor,
    m: torch.Tensor,
    g: torch.Tensor,
    lr: float,
    mu: float,
    scratch: torch.Tensor,
    block: int | None = None,
) -> None:
    """In place: ``m = mu*m + g; theta -= lr * (g + mu*m)`` (SGD with Nesterov momentum, as
    ``torch.optim.SGD(nesterov=True)``; ``g`` is the outer gradient theta_outer - mean(theta_local)).
    One rounding per elementwise op, no temporaries, the same bits on CPU and GPU; block by block on the
    CPU (``scratch`` needs one block's elements)."""
    for lo, hi in blocks(theta.numel(), theta.device, block):
        nesterov_block_(theta[lo:hi], m[lo:hi], g[lo:hi], lr, mu, scratch[: hi - lo])
