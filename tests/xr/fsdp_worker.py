"""One rank of a test region whose model is FSDP2 (``--kind fsdp``) or DDP (``--kind ddp``), driven by a small
loop (no trainer; ``--save-at STEP`` writes a DCP checkpoint of the model and the outer state, ``--resume DIR``
loads one), under torchrun with gloo; ``tests/xr/test_fsdp.py`` and ``test_fsdp_modes.py`` start one torchrun
per region. ``--sync``, ``--overlap``, ``--inner-steps``, ``--fragments`` and ``--tau`` pick the mode.

The model's dims are chosen to shard unevenly: over 2 ranks the first layer's 5 rows split 3 + 2 and the
last layer's single row leaves rank 1 with none. Before each round every rank records the region's whole
flat parameters (what its delta is taken from); after it, the region's whole ``theta_outer`` and momentum,
assembled from every rank's part (FSDP: each rank holds its shards' only; DDP: the leader holds all), its
parameters (grad mode: each step's gradients before and after the sync; see :func:`train`), and what each
rank read and wrote of the round's objects (:class:`CountingStore`). Rank 0 writes ``<out>/<region>.pt``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from sbatch_gen.train.dist import DistInfo
from sbatch_gen.train.xr.modes import create
from sbatch_gen.train.xr.store import FsStore
from sbatch_gen.xr_options import CrossRegion, FsTransport


class CountingStore(FsStore):
    """A directory mailbox that counts the bytes this rank reads of objects (whole or in ranges) and the
    objects it writes."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.bytes_read, self.objects_put = 0, 0
        self._lock = threading.Lock()

    def _add(self, nbytes: int, objects: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.objects_put += objects

    def put(self, key, data) -> None:
        self._add(0, key.endswith(".bin"))
        super().put(key, data)

    def get_range(self, key, offset, out, total) -> None:  # get_into reads through it too
        self._add(memoryview(out).nbytes, 0)
        super().get_range(key, offset, out, total)

    def get_view(self, key, nbytes):
        self._add(nbytes, 0)
        return super().get_view(key, nbytes)


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


def whole_grads(net: nn.Module) -> torch.Tensor:
    """The region's gradients as one canonical flat vector (FSDP: gathered; collective)."""
    from torch.distributed.tensor import DTensor

    parts = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in net.parameters()]
    return torch.cat([g.detach().reshape(-1) for g in parts]).clone()


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--region", required=True)
    ap.add_argument("--regions", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", default="fsdp")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--payload", default="bf16")
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--resume", default="")
    ap.add_argument("--sync", default="diloco")
    ap.add_argument("--overlap", default="none")
    ap.add_argument("--inner-steps", type=int, default=2)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--tau", type=int, default=0)
    ap.add_argument("--dims", default="6,5,1", help="the two Linear layers' in,hidden,out")
    ap.add_argument("--shard-mb", type=float, default=0.00004)  # 10 fp32 / 20 bf16 elements a shard
    ap.add_argument("--chunk-bytes", type=int, default=0, help="the mailbox's integrity chunk (0: its own)")
    return ap.parse_args()


def build(a: argparse.Namespace, world: int) -> tuple[nn.Module, nn.Module]:
    """The test model (the region's seed), and the module the steps call (FSDP2 or DDP)."""
    regions = a.regions.split(",")
    torch.manual_seed(regions.index(a.region))  # the regions start apart: alignment must fix that
    d_in, hidden, d_out = (int(x) for x in a.dims.split(","))
    net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))
    if a.kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
        return net, net
    from torch.nn.parallel import DistributedDataParallel as DDP

    return net, DDP(net)


def options(a: argparse.Namespace) -> CrossRegion:
    return CrossRegion(
        enabled=True,
        run_id="f",
        region=a.region,
        regions=a.regions.split(","),
        sync=a.sync,
        overlap=a.overlap,
        inner_steps=a.inner_steps,
        fragments=a.fragments,
        fragment_delay_steps=a.tau,
        transport=FsTransport(root=a.root),
        timeout_s=120,
        shard_mb=a.shard_mb,  # (by default many shards, cut unlike the other region)
        threads=2,
        payload_dtype=a.payload,
        outer_lr=0.7,
        outer_momentum=0.9,
        keep_rounds=max(4, a.steps + 1),  # (grad mode: every step is a round)
    )


def main() -> None:
    a = parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    info = DistInfo(
        rank=rank,
        world_size=world,
        local_rank=rank,
        local_world_size=world,
        node_rank=0,
        num_nodes=1,
        is_distributed=True,
        backend="gloo",
    )
    net, model = build(a, world)
    xr = options(a)
    store = CountingStore(a.root)
    sync = create(
        xr, model, torch.device("cpu"), info, None, None, store=store, poll_min_s=0.005, poll_max_s=0.05
    )
    if a.chunk_bytes and sync.mailbox is not None:
        sync.mailbox.chunk_bytes = a.chunk_bytes
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    start = 0
    if a.resume:  # the model and the outer state from a DCP checkpoint, resharded to this world size
        state = {"model": net.state_dict(), "outer": sync.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=a.resume)
        net.load_state_dict(state["model"])
        sync.load_state_dict(state["outer"])
        start = int(state["step"])
    sync.align(start)
    out = {"numel": sync.numel, "local": sync.local_numel, "bytes": sync.outer_bytes()}
    out.update(train(a, sync, net, model, opt, start, rank, world, store))
    if rank == 0:
        out["fragment_bounds"] = sync.flat.fragment_bounds
        torch.save(out, Path(a.out) / f"{a.region}.pt")
    sync.close()
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see tests/xr/outer_worker.py: no process-group teardown at exit


def train(a, sync, net, model, opt, start: int, rank: int, world: int, store: CountingStore) -> dict:
    """The steps. DiLoCo records, at each record of a round (and the final one of ``finish``): (step, the
    region's whole theta_outer and momentum, its parameters before the round and after it); every step's
    parameters before the sync are kept too (``xs``: streaming takes a fragment's delta at its round's
    start). grad mode records each step's gradients before and after the sync, and the parameters after
    the optimizer step. ``io``: per round, every rank's (bytes read, objects written) during it."""
    regions = a.regions.split(",")
    diloco = a.sync == "diloco"
    rounds = [(start, *whole_state(sync), whole_params(net), whole_params(net))] if diloco else []
    xs, grads, io = {}, [], []
    for step in range(start + 1, a.steps + 1):
        g = torch.Generator().manual_seed(10_000 * regions.index(a.region) + 100 * rank + step)
        x = torch.randn(8, net[0].in_features, generator=g)
        opt.zero_grad()
        ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
        if not diloco:
            before = whole_grads(net)
            sync.before_optimizer_step(step, 8 * world)
            grads.append((step, before, whole_grads(net)))
        opt.step()
        xs[step] = whole_params(net)
        counts = (store.bytes_read, store.objects_put)
        rec = sync.after_optimizer_step(step, 8 * world)
        if not diloco:
            grads[-1] += (whole_params(net),)
        elif rec:
            rounds.append((step, *whole_state(sync), xs[step], whole_params(net)))
            mine = (store.bytes_read - counts[0], store.objects_put - counts[1])
            got: list = [None] * world
            dist.all_gather_object(got, mine)
            io.append(got)
            if a.overlap == "none":
                assert torch.equal(rounds[-1][4], rounds[-1][1]), (
                    "the model is not theta_outer after the round"
                )
        if step == a.save_at:
            state = {"model": net.state_dict(), "outer": sync.state_dict(), "step": step}
            dcp.save(state, checkpoint_id=str(Path(a.out) / "ckpt"))
    if diloco and sync.finish(a.steps):
        rounds.append((a.steps, *whole_state(sync), xs[a.steps], whole_params(net)))
    if diloco and a.overlap != "none":
        assert torch.equal(whole_params(net), rounds[-1][1]), "the model is not theta_outer at the end"
    return {"rounds": rounds, "xs": xs, "grads": grads, "io": io}


if __name__ == "__main__":
    main()
