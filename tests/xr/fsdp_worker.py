"""One rank of a test region whose model is FSDP2 (``--kind fsdp``) or DDP (``--kind ddp``), driven by a small
loop (no trainer; ``--save-at STEP`` writes a DCP checkpoint of the model and the outer state, ``--resume DIR``
loads one), under torchrun with gloo; ``tests/xr/test_fsdp.py`` starts one torchrun per region.

The model's dims are chosen to shard unevenly: over 2 ranks the first layer's 5 rows split 3 + 2 and the
last layer's single row leaves rank 1 with none. Before each round every rank records the region's whole
flat parameters (what its delta is taken from); after it, the region's whole ``theta_outer`` and momentum,
assembled from every rank's part (FSDP: each rank holds its shards' only; DDP: the leader holds all). Rank 0
writes ``<out>/<region>.pt`` (the rounds, the sync's round records and events).

Elastic runs (``--min-regions N``) start as the trainer does, fast-forwarding a region that was away; the
region can leave (``--leave-at``: announced) or crash (``--crash-at``: nothing announced, its heartbeat
stops) after a step, and the tests order the regions through files: ``--wait-at STEP --wait-for F`` waits
before that step until F exists (creating ``F.asked`` first), ``--started F`` creates F once the region has
joined the run.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from sbatch_gen.train.xr.modes import create
from sbatch_gen.xr_options import CrossRegion

from .workers import exit_now, init_region, parser, transport


def whole_params(net: nn.Module) -> torch.Tensor:
    """The region's parameters as one canonical flat vector (FSDP: gathered; collective)."""
    from torch.distributed.tensor import DTensor

    parts = [p.full_tensor() if isinstance(p, DTensor) else p for p in net.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in parts]).clone()


def whole_state(sync) -> tuple[torch.Tensor, torch.Tensor]:
    """theta_outer and momentum over the whole canonical layout, from every rank's part (collective)."""
    flat = sync.flat
    mine = None
    if sync.theta_outer is not None:
        ranges = flat.ranges if flat.sharded else [(0, flat.numel)]
        mine = (ranges, list(flat.offsets), sync.theta_outer.clone(), sync.momentum.clone())
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    theta, mom = torch.full((flat.numel,), float("nan")), torch.full((flat.numel,), float("nan"))
    for part in got:
        if part is None:
            continue
        ranges, offs, t, m = part
        for (lo, hi), a in zip(ranges, offs, strict=False):
            theta[lo:hi] = t[a : a + hi - lo]
            mom[lo:hi] = m[a : a + hi - lo]
    return theta, mom


def options(a, regions: list[str]) -> CrossRegion:
    """The run's cross-region options: strict, or elastic with ``--min-regions``."""
    elastic = {}
    if a.min_regions:
        elastic = dict(min_regions=a.min_regions, grace_s=a.grace_s, heartbeat_s=a.heartbeat_s)
    return CrossRegion(
        enabled=True,
        run_id="f",
        region=a.region,
        regions=regions,
        inner_steps=2,
        transport=transport(a),
        timeout_s=120,
        shard_mb=0.00004,  # 10 fp32 / 20 bf16 elements a shard: many shards, cut unlike the other region
        threads=2,
        payload_dtype=a.payload,
        outer_lr=0.7,
        outer_momentum=0.9,
        keep_rounds=a.keep_rounds,
        snapshot_every=a.snapshot_every,
        **elastic,
    )


def wait_for(path: Path, rank: int, timeout_s: float = 200) -> None:
    """Wait until ``path`` exists; rank 0 first creates ``<path>.asked`` (the test sees where we are)."""
    if rank == 0:
        path.with_name(path.name + ".asked").touch()
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s:g} s")
        time.sleep(0.05)


def main() -> None:
    ap = parser()
    ap.add_argument("--kind", default="fsdp")
    ap.add_argument("--payload", default="bf16")
    ap.add_argument("--min-regions", type=int, default=0, help="0: strict (all); N: elastic")
    ap.add_argument("--grace-s", type=float, default=60)
    ap.add_argument("--heartbeat-s", type=float, default=None)
    ap.add_argument("--keep-rounds", type=int, default=4)
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--leave-at", type=int, default=0, help="after this step: announce a leave and exit")
    ap.add_argument("--crash-at", type=int, default=0, help="after this step: exit, announcing nothing")
    ap.add_argument("--wait-at", type=int, default=0, help="before this step, wait for --wait-for")
    ap.add_argument("--wait-for", default="")
    ap.add_argument("--started", default="", help="rank 0 creates this file once the region has joined")
    a = ap.parse_args()

    info = init_region()
    rank, world = info.rank, info.world_size
    regions = a.regions.split(",")
    torch.manual_seed(regions.index(a.region))  # the regions start apart: alignment must fix that
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    if a.kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
        model: nn.Module = net
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
    xr = options(a, regions)
    events: list[dict] = []
    sync = create(
        xr, model, torch.device("cpu"), info, None, events.append, poll_min_s=0.005, poll_max_s=0.05
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    start = 0
    if a.resume:  # the model and the outer state from a DCP checkpoint, resharded to this world size
        state = {"model": net.state_dict(), "outer": sync.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=a.resume)
        net.load_state_dict(state["model"])
        sync.load_state_dict(state["outer"])
        start = int(state["step"])
    sync.align(start)
    if xr.elastic:  # as the trainer starts: a region that was away fast-forwards to the run
        start = sync.catch_up(start) or start
    if a.started and rank == 0:
        Path(a.started).touch()
    rounds = [(start, *whole_state(sync), None)]
    records: list[dict] = []

    def finish() -> None:
        if rank == 0:
            out = {"rounds": rounds, "records": records, "events": events, "numel": sync.numel}
            out.update(local=sync.local_numel, bytes=sync.outer_bytes())
            torch.save(out, Path(a.out) / f"{a.region}.pt")
        dist.barrier()
        exit_now()

    step = start
    while step < a.steps:
        step += 1
        if step == a.wait_at:
            wait_for(Path(a.wait_for), rank)
        g = torch.Generator().manual_seed(10_000 * regions.index(a.region) + 100 * rank + step)
        x = torch.randn(8, 6, generator=g)
        opt.zero_grad()
        ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
        opt.step()
        before = whole_params(net) if step % xr.inner_steps == 0 else None
        rec = sync.after_optimizer_step(step, 8 * world)
        if rec:
            records.append(rec)
            step = rec.get("xr_adopted_step", step)  # behind the run: fast-forwarded
            rounds.append((step, *whole_state(sync), before))
            assert torch.equal(whole_params(net), rounds[-1][1]), (
                "the model is not theta_outer after the round"
            )
        if step == a.save_at:
            state = {"model": net.state_dict(), "outer": sync.state_dict(), "step": step}
            dcp.save(state, checkpoint_id=str(Path(a.out) / "ckpt"))
        if step == a.crash_at:  # no leave, no close: its heartbeat stops with the process
            finish()
        if step == a.leave_at:
            sync.leave(step, "test")
            sync.close()
            finish()
    sync.close()
    finish()


if __name__ == "__main__":
    main()
