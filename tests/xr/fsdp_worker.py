"""One rank of a test region whose model is FSDP2 (``--kind fsdp``) or DDP (``--kind ddp``), driven by a small
loop (no trainer; ``--save-at STEP`` writes a DCP checkpoint of the model and the outer state, ``--resume DIR``
loads one), under torchrun with gloo; ``tests/xr/test_fsdp.py``, ``test_fsdp_modes.py`` and
``test_fsdp_elastic.py`` start one torchrun per region. ``--sync``, ``--overlap``, ``--inner-steps``,
``--fragments`` and ``--tau`` pick the mode.

The model's dims are chosen to shard unevenly: over 2 ranks the first layer's 5 rows split 3 + 2 and the
last layer's single row leaves rank 1 with none. Before each round every rank records the region's whole
flat parameters (what its delta is taken from); after it, the region's whole ``theta_outer`` and momentum,
assembled from every rank's part (FSDP: each rank holds its shards' only; DDP: the leader holds all), its
parameters (grad mode: each step's gradients before and after the sync; see :func:`train`), and what each
rank read and wrote of the round's objects (:class:`CountingStore`, over a directory). Rank 0 writes
``<out>/<region>.pt`` (also the sync's round records and events).

Elastic runs (``--min-regions N``) start as the trainer does, fast-forwarding a region that was away; the
region can leave (``--leave-at``: announced) or crash (``--crash-at``: nothing announced, its heartbeat
stops) after a step, and the tests order the regions through files: ``--wait-at STEP --wait-for F`` waits
before that step until F exists (creating ``F.asked`` first), ``--started F`` creates F once the region has
joined the run.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from sbatch_gen.train.xr.modes import create
from sbatch_gen.train.xr.store import FsStore
from sbatch_gen.xr_options import CrossRegion, FsTransport

from .workers import exit_now, init_region, parser, resume, transport


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
    ap = parser()
    ap.add_argument("--kind", default="fsdp")
    ap.add_argument("--payload", default="bf16")
    ap.add_argument("--sync", default="diloco")
    ap.add_argument("--overlap", default="none")
    ap.add_argument("--inner-steps", type=int, default=2)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--tau", type=int, default=0)
    ap.add_argument("--dims", default="6,5,1", help="the two Linear layers' in,hidden,out")
    ap.add_argument("--shard-mb", type=float, default=0.00004)  # 10 fp32 / 20 bf16 elements a shard
    ap.add_argument("--chunk-bytes", type=int, default=0, help="the mailbox's integrity chunk (0: its own)")
    ap.add_argument("--min-regions", type=int, default=0, help="0: strict (all); N: elastic")
    ap.add_argument("--grace-s", type=float, default=60)
    ap.add_argument("--heartbeat-s", type=float, default=None)
    ap.add_argument(
        "--keep-rounds", type=int, default=0, help="0: max(4, steps + 1) (grad mode: a round a step)"
    )
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--leave-at", type=int, default=0, help="after this step: announce a leave and exit")
    ap.add_argument("--crash-at", type=int, default=0, help="after this step: exit, announcing nothing")
    ap.add_argument("--wait-at", type=int, default=0, help="before this step, wait for --wait-for")
    ap.add_argument("--wait-for", default="")
    ap.add_argument("--started", default="", help="rank 0 creates this file once the region has joined")
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
    """The run's cross-region options: strict, or elastic with ``--min-regions``."""
    elastic = {}
    if a.min_regions:
        elastic = dict(min_regions=a.min_regions, grace_s=a.grace_s, heartbeat_s=a.heartbeat_s)
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
        transport=transport(a),
        timeout_s=120,
        shard_mb=a.shard_mb,  # (by default many shards, cut unlike the other region)
        threads=2,
        payload_dtype=a.payload,
        **({"sparse_chunk": 64, "sparse_density": 0.1} if a.payload == "sparse" else {}),  # 6 of 64 kept
        outer_lr=0.7,
        outer_momentum=0.9,
        keep_rounds=a.keep_rounds or max(4, a.steps + 1),
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
    a = parse()
    info = init_region()
    net, model = build(a, info.world_size)
    xr = options(a)
    store = CountingStore(xr.transport.root) if isinstance(xr.transport, FsTransport) else None
    events: list[dict] = []
    sync = create(
        xr,
        model,
        torch.device("cpu"),
        info,
        None,
        events.append,
        store=store,
        poll_min_s=0.005,
        poll_max_s=0.05,
    )
    if a.chunk_bytes and sync.mailbox is not None:
        sync.mailbox.chunk_bytes = a.chunk_bytes
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    start = resume(a.resume, net, sync)
    sync.align(start)
    if xr.elastic:  # as the trainer starts: a region that was away fast-forwards to the run
        start = sync.catch_up(start) or start
    if a.started and info.rank == 0:
        Path(a.started).touch()
    out = {"numel": sync.numel, "local": sync.local_numel, "bytes": sync.outer_bytes(), "events": events}
    out.update(train(a, sync, net, model, opt, start, info.rank, info.world_size, store))
    if info.rank == 0:
        out["fragment_bounds"] = sync.flat.fragment_bounds
        torch.save(out, Path(a.out) / f"{a.region}.pt")
    dist.barrier()
    exit_now()


class Counts:
    """What this rank read and wrote through ``store`` since :meth:`mark` (zeros without a counting store)."""

    def __init__(self, store: CountingStore | None) -> None:
        self.store, self.at = store, (0, 0)

    def now(self) -> tuple[int, int]:
        return (self.store.bytes_read, self.store.objects_put) if self.store is not None else (0, 0)

    def mark(self) -> None:
        self.at = self.now()

    def since(self, world: int) -> list:
        """Every rank's (bytes read, objects written) since its mark (collective)."""
        now = self.now()
        got: list = [None] * world
        dist.all_gather_object(got, (now[0] - self.at[0], now[1] - self.at[1]))
        return got


def train(a, sync, net, model, opt, start: int, rank: int, world: int, store: CountingStore | None) -> dict:
    """The steps. DiLoCo records, at each record of a round (and the final one of ``finish``): (step, the
    region's whole theta_outer and momentum, its parameters before the round and after it); every step's
    parameters before the sync are kept too (``xs``: streaming takes a fragment's delta at its round's
    start). grad mode records each step's gradients before and after the sync, and the parameters after
    the optimizer step. ``io``: per round, every rank's (bytes read, objects written) during it;
    ``records``: the sync's round records. A crash or a leave ends the steps early (``--crash-at``,
    ``--leave-at``)."""
    regions = a.regions.split(",")
    diloco = a.sync == "diloco"
    rounds = [(start, *whole_state(sync), whole_params(net), whole_params(net))] if diloco else []
    xs, grads, io, records = {}, [], [], []
    counts = Counts(store)
    step = start
    while step < a.steps:
        step += 1
        if step == a.wait_at:
            wait_for(Path(a.wait_for), rank)
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
        counts.mark()
        rec = sync.after_optimizer_step(step, 8 * world)
        if not diloco:
            grads[-1] += (whole_params(net),)
        elif rec:
            records.append(rec)
            step = rec.get("xr_adopted_step", step)  # behind the run: fast-forwarded
            rounds.append((step, *whole_state(sync), xs.get(step), whole_params(net)))
            io.append(counts.since(world))
            if a.overlap == "none":
                assert torch.equal(rounds[-1][4], rounds[-1][1]), (
                    "the model is not theta_outer after the round"
                )
        if step == a.save_at:
            state = {"model": net.state_dict(), "outer": sync.state_dict(), "step": step}
            dcp.save(state, checkpoint_id=str(Path(a.out) / "ckpt"))
        if step == a.crash_at:  # no leave, no close: its heartbeat stops with the process
            return {"rounds": rounds, "xs": xs, "grads": grads, "io": io, "records": records}
        if step == a.leave_at:
            sync.leave(step, "test")
            sync.close()
            return {"rounds": rounds, "xs": xs, "grads": grads, "io": io, "records": records}
    if diloco and sync.finish(a.steps):
        rounds.append((a.steps, *whole_state(sync), xs[a.steps], whole_params(net)))
    if diloco and a.overlap != "none":
        assert torch.equal(whole_params(net), rounds[-1][1]), "the model is not theta_outer at the end"
    sync.close()
    return {"rounds": rounds, "xs": xs, "grads": grads, "io": io, "records": records}


if __name__ == "__main__":
    main()
