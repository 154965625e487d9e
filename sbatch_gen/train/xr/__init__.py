"""Cross-region synchronisation: DDP inside a region, DiLoCo or per-step gradient averaging across regions
through an object-store mailbox (a directory or an S3 bucket). No WAN NCCL, no shared process group.

Layers, each usable on its own:

* :mod:`.store`    - ``FsStore`` / ``S3Store``: put/get/list/delete of opaque objects (torch-free);
* :mod:`.protocol` - ``Mailbox``: round tags, shard objects, manifests written last, polling with
  timeout, checksum (XXH3-128) checks, cleanup, and ``exchange(tag, payload) -> {region: payload}`` (torch-free);
* :mod:`.sync`     - ``OuterSync``: the algorithms on flat fp32 buffers, node-leader sharding, timings.

The trainer's side (fixed)::

    sync = build_outer_sync(xr, model, device, dist, run_dir, log)
    sync.load_state_dict(state)             # on resume (the dict saved under "outer")
    sync.align(step)                        # before the first step; no-op when resumed aligned
    ... backward ...
    sync.before_optimizer_step(step, tokens)   # grad mode: averages .grad across regions
    ... clip, optimizer.step() ...
    metrics.update(sync.after_optimizer_step(step, tokens) or {})   # diloco: a round every H steps
    state["outer"] = sync.state_dict()

``step`` is the 1-based number of the optimizer step being taken (the same on every rank);
``tokens`` is the number of tokens the REGION consumed in that step (all its ranks together, the same
value on every rank). Each region's contribution is weighted by its share of all regions' tokens.

Importing this package does not import torch; :func:`build_outer_sync` does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import StoreError, XRChecksumError, XRError, XRLayoutError, XRMissingRound, XRTimeout

if TYPE_CHECKING:
    import torch
    from torch import nn

    from sbatch_gen.xr_options import CrossRegion

    from .sync import OuterSync

__all__ = [
    "build_outer_sync",
    "StoreError",
    "XRChecksumError",
    "XRError",
    "XRLayoutError",
    "XRMissingRound",
    "XRTimeout",
]


def build_outer_sync(
    xr: CrossRegion,
    model: nn.Module,
    device: torch.device,
    dist,
    run_dir: Path,
    log: Callable[[dict], None],
) -> OuterSync:
    """The cross-region sync for this process. Collective: every rank of the region must call it.

    ``dist`` is the trainer's ``DistInfo`` (rank, world_size, local_rank, local_world_size, node_rank,
    num_nodes, is_distributed); ``model`` may be wrapped in DDP; ``log`` receives event dicts.
    """
    from .sync import OuterSync

    return OuterSync(xr, model, device, dist, run_dir, log)
