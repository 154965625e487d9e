"""Cross-region synchronisation: DDP inside a region, DiLoCo or per-step gradient averaging across regions
through an object-store mailbox (a directory or an S3 bucket). No WAN NCCL, no shared process group.

Layers, each usable on its own:

* :mod:`.store`      - ``FsStore`` / ``S3Store``: put/get/create/list/delete of opaque objects (torch-free);
* :mod:`.protocol`   - ``Mailbox``: round tags, shard objects, manifests written last, polling, checksum
  (XXH3-128) checks (torch-free);
* :mod:`.membership` - round commits (who takes part, decided once), presence, outer snapshots, cleanup
  (torch-free);
* :mod:`.region`     - collectives inside the region: any rank's failure raises on every rank;
* :mod:`.exchange`   - one round: publish, close, download and average, broadcast;
* :mod:`.kernels`    - the elementwise average and Nesterov step, same bits on every device;
* :mod:`.flat`       - the model's parameters as one flat vector;
* :mod:`.sync`       - ``OuterSync``: what both algorithms share (theta0 alignment, state, records);
* :mod:`.diloco`     - elastic DiLoCo: late regions, fast-forward from rounds or snapshots;
* :mod:`.grad`       - per-step gradient averaging (strict).

The trainer's side (fixed)::

    sync = build_outer_sync(xr, model, device, dist, run_dir, log)
    sync.load_state_dict(state)             # on resume (the dict saved under "outer")
    sync.align(step)                        # before the first step; no-op when resumed aligned
    step = sync.catch_up(step) or step      # a region that was away fast-forwards to the run
    ... backward ...
    sync.before_optimizer_step(step, tokens)   # grad mode: averages .grad across regions
    ... clip, optimizer.step() ...
    metrics.update(sync.after_optimizer_step(step, tokens) or {})   # diloco: a round every H steps
    (a record with "xr_adopted_step": the region was behind and fast-forwarded; continue from there)
    sync.leave(step, reason)                # a planned stop: the others stop waiting for this region
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

if TYPE_CHECKING:
    import torch
    from torch import nn

    from sbatch_gen.xr_options import CrossRegion

    from .sync import OuterSync

__all__ = [
    "build_outer_sync",
    "StoreError",
    "XRBehind",
    "XRChecksumError",
    "XRError",
    "XRLayoutError",
    "XRMissingRound",
    "XRNoQuorum",
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
    from .sync import create

    return create(xr, model, device, dist, run_dir, log)
