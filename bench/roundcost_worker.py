"""One region of the round-cost benchmark (:mod:`bench.roundcost`), as its own process.

    python -m bench.roundcost_worker --region eu --regions eu,us --endpoint URL --direct URL \
        --sizes 262144,4194304 --rounds 3 --warmup 1 --barrier-dir D --out F.json

For each payload size (wire bytes per region, bf16) it builds a model of that many parameters and a
DiLoCo sync (``sync: diloco``, ``inner_steps`` 1, otherwise the CrossRegion defaults: strict rounds, bf16,
16 MiB shards, 16 threads) on an S3 mailbox reached through ``--endpoint`` (the delay proxy), aligns it
(theta0) and runs ``warmup + rounds`` outer rounds: ``after_optimizer_step`` of the real trainer code
(``rounds.run_round`` under it). Every round starts together (a file barrier); the last region of
``--regions`` then waits until every other region's claim is in the store (read directly, through
``--direct``, not through the proxy: the harness, not the round) and one more RTT, so that it arrives last
with the others already polling: its round is the critical path of a steady round. Per round it writes its
wall time, its xr_* phases and bytes, and the HTTP requests its store client sent (botocore's
``before-send`` event, by operation).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

from sbatch_gen.fsutil import write_atomic

from .mailbox_worker import barrier

PARAMS = 8  # parameters of the model; the payload is split over them


class Requests:
    """The HTTP requests a boto3 client sends, by operation (PutObject, GetObject, ...), retries included."""

    def __init__(self, client) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        client.meta.events.register("before-send.s3", self._sent)

    def _sent(self, event_name: str = "", **_kw) -> None:
        with self._lock:
            self.counts[event_name.rsplit(".", 1)[-1]] += 1

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.counts)


def _with_expect(store) -> None:
    """The variant with HTTP's ``Expect: 100-continue`` on every PUT, botocore's default, which the trainer's
    store turns off (sbatch_gen/train/xr/store.py): botocore's own handler registered again on the region's
    client, so a PUT waits one RTT for the server's ``100 Continue`` before it sends the body."""
    from botocore.handlers import add_expect_header

    store.client.meta.events.register("before-call.s3", add_expect_header)


def _claimed(client, bucket: str, prefix: str, run_id: str, r: int, regions: list[str]) -> bool:
    """Every one of ``regions`` has its claim for round ``r`` in the store (read without the proxy)."""
    from botocore.exceptions import ClientError

    for reg in regions:
        try:
            client.head_object(Bucket=bucket, Key=f"{prefix}/{run_id}/r{r:06d}/{reg}.done")
        except ClientError:
            return False
    return True


def one_size(a, i: int, wire: int) -> list[dict]:
    import torch
    from torch import nn

    from sbatch_gen.train.dist import DistInfo
    from sbatch_gen.train.xr.modes import create
    from sbatch_gen.train.xr.store import make_store
    from sbatch_gen.xr_options import CrossRegion, S3Transport

    from .servers import s3_client

    regions = a.regions.split(",")
    last = a.region == regions[-1]
    run_id = f"{a.run_prefix}s{i}"
    transport = S3Transport(
        bucket=a.bucket,
        prefix=a.prefix,
        endpoint_url=a.endpoint,
        addressing_style="path",
        region_name="us-east-1",
    )
    xr = CrossRegion(
        enabled=True,
        run_id=run_id,
        region=a.region,
        regions=regions,
        sync="diloco",
        inner_steps=1,
        transport=transport,
        timeout_s=300,
        # no housekeeping inside the measured rounds: the round's own requests only
        keep_rounds=1000,
        snapshot_every=1_000_000,
    )
    n = wire // 2  # bf16 on the wire
    sizes = [n // PARAMS + (1 if j < n % PARAMS else 0) for j in range(PARAMS)]
    torch.manual_seed(0)  # the same theta0 everywhere (adopted anyway)
    model = nn.Module()
    model.params = nn.ParameterList([nn.Parameter(torch.randn(s) * 0.02) for s in sizes])
    store = make_store(transport, xr.threads)
    reqs = Requests(store.client)
    if a.with_expect:
        _with_expect(store)
    sync = create(xr, model, torch.device("cpu"), DistInfo(), store=store)
    sync.align(0)
    direct = s3_client(a.direct, threads=1) if last else None
    g = torch.Generator().manual_seed(zlib.crc32(a.region.encode()) % 2**31)
    noise = [torch.randn(s, generator=g) * 1e-3 for s in sizes]
    out = []
    for r in range(1, a.warmup + a.rounds + 1):
        with torch.no_grad():  # an inner phase's change (different per region)
            for p, d in zip(model.params, noise, strict=True):
                p.add_(d)
        barrier(Path(a.barrier_dir), f"s{i}r{r}", a.region, regions)
        lag = 0.0
        if last:
            t_lag = time.perf_counter()
            deadline = time.monotonic() + 120
            while not _claimed(direct, a.bucket, a.prefix, run_id, r, regions[:-1]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"round {r}: the other regions never claimed")
                time.sleep(0.005)
            time.sleep(a.rtt_ms / 1000)  # the others are in their poll loop now
            lag = time.perf_counter() - t_lag
        before = reqs.snapshot()
        t0 = time.perf_counter()
        rec = sync.after_optimizer_step(r, 1000) or {}
        took = time.perf_counter() - t0
        made = reqs.snapshot() - before
        out.append(
            {
                "size": wire,
                "round": r,
                "warmup": r <= a.warmup,
                "last": last,
                "lag_s": lag,
                "took_s": took,
                "requests": sum(made.values()),
                "by_op": dict(made),
                **{k: v for k, v in rec.items() if k.startswith("xr_") and isinstance(v, int | float)},
                "members": rec.get("xr_members"),
            }
        )
    sync.close()
    if direct is not None:
        direct.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.roundcost_worker")
    ap.add_argument("--region", required=True)
    ap.add_argument("--regions", required=True)
    ap.add_argument("--endpoint", required=True, help="the store as the rounds reach it (the delay proxy)")
    ap.add_argument("--direct", required=True, help="the store without the proxy (the harness's peeks)")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--prefix", default="rc")
    ap.add_argument("--run-prefix", default="rc")
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rtt-ms", type=float, default=80.0)
    ap.add_argument("--with-expect", action="store_true", help="PUTs with Expect: 100-continue (botocore's)")
    ap.add_argument("--barrier-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    res = []
    for i, wire in enumerate(a.sizes):
        res += one_size(a, i, wire)
    write_atomic(a.out, json.dumps(res), fsync=False)


if __name__ == "__main__":
    main()
