"""The outer sync a run asks for (``xr.sync``, ``xr.overlap``): :func:`create` builds DiLoCo (blocking or
eager), streaming DiLoCo, or per-step gradient averaging. Apart from :mod:`.sync`, which the three build on,
so that no algorithm's module imports its base's module back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from sbatch_gen.xr_options import CrossRegion

from .sync import OuterSync


def create(
    xr: CrossRegion,
    model: nn.Module,
    device: torch.device,
    dist,
    run_dir: Path | None = None,
    log: Callable[[dict], None] | None = None,
    **kw,
) -> OuterSync:
    """The outer sync of ``xr.sync`` (collective: every rank of the region calls it)."""
    if xr.sync == "diloco" and xr.overlap == "streaming":
        from .streaming import StreamingDiLoCo

        return StreamingDiLoCo(xr, model, device, dist, run_dir, log, **kw)
    if xr.sync == "diloco":
        from .diloco import DiLoCo

        return DiLoCo(xr, model, device, dist, run_dir, log, **kw)
    if xr.sync == "grad":
        from .grad import GradSync

        return GradSync(xr, model, device, dist, run_dir, log, **kw)
    raise ValueError(f"unknown sync mode {xr.sync!r}")
