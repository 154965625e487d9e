"""One rank of a test region: the outer sync driven by a small DDP loop (no trainer), under torchrun with gloo.

``tests/xr/test_multiproc.py`` starts one torchrun per region. The region's ranks are split into ``--nodes``
pretend nodes (node_rank = rank // per_node, local_rank = rank % per_node), so a 4-process region over 2
nodes has the node leaders 0 and 2 and two ranks that hold no outer state. ``--save-at STEP`` writes a DCP
checkpoint (model + the outer sync's state_dict, as the trainer does) after that step; ``--resume DIR``
loads one and continues. Each rank writes ``<out>/<region>-rank<R>.pt``: its flat parameters after every
round (and theta_outer where it holds one), the size of each outer buffer it holds (None: absent), and the
sync's event records.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sbatch_gen.train.xr.modes import create
from sbatch_gen.xr_options import CrossRegion

from .workers import exit_now, init_region, parser, resume, transport

BUFFERS = ("work", "avg", "theta_outer", "momentum", "own")
W_TRUE = torch.tensor([[1.0], [-2.0], [0.5], [3.0], [-1.0], [0.25]])


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def main() -> None:
    ap = parser()
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--sync", default="diloco")
    ap.add_argument("--inner-steps", type=int, default=2)
    ap.add_argument("--max-gib", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overlap", default="none")
    a = ap.parse_args()

    info = init_region(a.nodes)
    rank, world = info.rank, info.world_size
    regions = a.regions.split(",")
    torch.manual_seed(a.seed)  # the same on every rank of a region (DDP would broadcast rank 0's anyway)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    model = DDP(net)
    kw = dict(
        enabled=True,
        run_id="w",
        region=a.region,
        regions=regions,
        sync=a.sync,
        inner_steps=a.inner_steps,
        transport=transport(a),
        timeout_s=120,
        shard_mb=0.0005,
        threads=2,
        keep_rounds=8,
        payload_dtype="fp32" if a.sync == "grad" else "bf16",
        overlap=a.overlap,
    )
    if a.max_gib is not None:
        kw["outer_device_max_gib"] = a.max_gib
    events: list[dict] = []
    sync = create(
        CrossRegion(**kw),
        model,
        torch.device("cpu"),
        info,
        None,
        events.append,
        poll_min_s=0.005,
        poll_max_s=0.05,
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.05)

    start = resume(a.resume, net, sync)
    sync.align(start)

    after: dict[int, torch.Tensor] = {}
    theta: dict[int, torch.Tensor] = {}  # theta_outer where this rank holds it
    early: dict[int, tuple[torch.Tensor, float]] = {}  # overlap eager, leaders: (own, early)
    buffers_seen: dict[int, dict] = {}
    for step in range(start + 1, a.steps + 1):
        g = torch.Generator().manual_seed(10_000 * regions.index(a.region) + 100 * rank + step)
        x = torch.randn(16, 6, generator=g)
        opt.zero_grad()
        ((model(x) - x @ W_TRUE) ** 2).mean().backward()
        sync.before_optimizer_step(step, 16 * world)
        opt.step()
        rec = sync.after_optimizer_step(step, 16 * world)
        if a.sync == "grad" or rec:
            after[step] = flat(net)
            if getattr(sync, "theta_outer", None) is not None:
                theta[step] = sync.theta_outer.clone()
            if getattr(sync, "own", None) is not None:
                early[step] = (sync.own.clone(), sync.early)
            buffers_seen[step] = {
                n: (t.numel() if (t := getattr(sync, n, None)) is not None else None) for n in BUFFERS
            }
        if step == a.save_at:
            dcp.save(
                {"model": net.state_dict(), "outer": sync.state_dict(), "step": step},
                checkpoint_id=str(Path(a.out) / "ckpt"),
            )
    final = sync.finish(a.steps)  # overlap eager: the round in flight; None otherwise
    torch.save(
        {
            "rank": rank,
            "final": (final is not None, flat(net)),
            "early": early,
            "after": after,
            "theta": theta,
            "buffers": buffers_seen,
            "events": events,
            "numel": sync.numel,
        },
        Path(a.out) / f"{a.region}-rank{rank}.pt",
    )
    sync.close()
    dist.barrier()
    exit_now()


if __name__ == "__main__":
    main()
