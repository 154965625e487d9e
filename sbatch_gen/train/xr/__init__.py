"""Cross-region synchronisation: DDP inside a region, DiLoCo or per-step gradient averaging across regions
through an object-store mailbox (a directory or an S3 bucket). No WAN NCCL, no shared process group.

Layers, each usable on its own:

* :mod:`.store`      - ``FsStore`` / ``S3Store``: put/get/create/list/delete of opaque objects (torch-free);
* :mod:`.protocol`   - ``Mailbox``: round tags, shard objects, manifests written last, polling, checksum
  (XXH3-128) checks (torch-free);
* :mod:`.membership` - round commits (who takes part, decided once), presence, outer snapshots, cleanup
  (torch-free); the records and the closing rule in :mod:`.commit`, the heartbeat in :mod:`.heartbeat`;
* :mod:`.region`     - collectives inside the region: any rank's failure raises on every rank;
* :mod:`.exchange`   - one round: publish, close, download and average, broadcast;
* :mod:`.kernels`    - the elementwise average and Nesterov step, same bits on every device;
* :mod:`.flat`       - the model's parameters as one flat vector;
* :mod:`.sync`       - ``OuterSync``: what both algorithms share (theta0 alignment, state, records);
* :mod:`.diloco`     - elastic DiLoCo: late regions, fast-forward from rounds or snapshots;
* :mod:`.snapshots`  - DiLoCo's outer snapshots and background housekeeping (uploads, mailbox cleanup);
* :mod:`.rejoin`     - a returning region's plan: the rounds to replay, the snapshot to load first;
* :mod:`.leave`      - a crashed region's leave, announced for it by the node program's run-trainer
  (torch-free);
* :mod:`.grad`       - per-step gradient averaging (strict);
* :mod:`.modes`      - ``create``: the outer sync of ``xr.sync`` and ``xr.overlap``.

A trainer reaches all of this through one public class, :class:`sbatch_gen.train.api.DiLoCo` (the
companion trainer too); its docstrings say when to call what. The layers listed above are internal.

Importing this package does not import torch.
"""

from __future__ import annotations

from .errors import (
    StoreError,
    XRBehind,
    XRCancelled,
    XRChecksumError,
    XRError,
    XRLayoutError,
    XRMissingRound,
    XRNoQuorum,
    XRTimeout,
)

__all__ = [
    "StoreError",
    "XRBehind",
    "XRCancelled",
    "XRChecksumError",
    "XRError",
    "XRLayoutError",
    "XRMissingRound",
    "XRNoQuorum",
    "XRTimeout",
]
