"""One region (or the single ceiling client) of the mailbox benchmark, as its own process.

    python -m bench.mailbox_worker ours    --region a --regions a,b --numel N --rounds R ...
    python -m bench.mailbox_worker naive   --region a --regions a,b --numel N --rounds R ...
    python -m bench.mailbox_worker ceiling --nbytes B --rounds R ...

* ours: the real cross-region code path (:class:`sbatch_gen.train.xr.sync.OuterSync`, one process per
  region) exchanging a flat gradient of ``numel`` fp32 parameters each round (``--xr-sync grad``: the
  same exchange round DiLoCo uses, without its outer-state buffers, so 1 GB of parameters fits this
  machine twice). The switches are the CrossRegion fields (payload dtype, shard size, threads,
  serialization).
* naive: what a first version does: fp32, ``torch.save`` of the whole vector into one object, one
  stream, one ``aws s3 cp`` process per transfer (s3), or ``torch.save``/``torch.load`` on the
  directory (fs); peers poll for the object; the two regions' vectors are averaged.
* ceiling: one client moving the same bytes (both regions' uploads, then both downloads) as fast as it
  can: one big object, or 16 MiB objects on 16 threads, whichever is faster (raw file write + read
  for fs).

Rounds start together (a file barrier in ``--barrier-dir``); each writes its timings to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import zlib
from pathlib import Path

from sbatch_gen.fsutil import write_atomic


def barrier(d: Path, tag: str, region: str, regions: list[str], timeout_s: float = 600) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{tag}-{region}").touch()
    deadline = time.monotonic() + timeout_s
    while not all((d / f"{tag}-{r}").exists() for r in regions):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {tag}: peers never arrived in {d}")
        time.sleep(0.002)


def _transport(a):
    from sbatch_gen.xr_options import FsTransport, S3Transport

    if a.transport == "fs":
        return FsTransport(root=a.root)
    return S3Transport(
        bucket=a.bucket,
        prefix=a.prefix,
        endpoint_url=a.endpoint,
        addressing_style="path",
        region_name="us-east-1",
    )


def ours(a) -> list[dict]:
    import torch
    from torch import nn

    from sbatch_gen.train.dist import DistInfo
    from sbatch_gen.train.xr.modes import create
    from sbatch_gen.xr_options import CrossRegion

    torch.set_num_threads(1)
    xr = CrossRegion(
        enabled=True,
        run_id=a.run_id,
        region=a.region,
        regions=a.regions.split(","),
        sync="grad",
        inner_steps=1,
        transport=_transport(a),
        timeout_s=600,
        keep_rounds=1,
        payload_dtype=a.payload_dtype,
        shard_mb=a.shard_mb,
        threads=a.threads,
        serialization=a.serialization,
    )
    n, k = a.numel, 8
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    model = nn.Module()
    model.params = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in sizes])
    g = torch.Generator().manual_seed(zlib.crc32(a.region.encode()) % 2**31)
    for p in model.params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    sync = create(xr, model, torch.device("cpu"), DistInfo())
    sync.load_state_dict({"round": 0, "aligned": 1, "tokens": 0})  # as resumed: no theta0 round needed
    out = []
    for r in range(1, a.rounds + 1):
        barrier(Path(a.barrier_dir), f"r{r}", a.region, xr.regions)
        t0 = time.perf_counter()
        sync.before_optimizer_step(r, 1000)
        wall = time.perf_counter() - t0
        t = sync.after_optimizer_step(r, 1000)
        exch = t["xr_upload_s"] + t["xr_wait_s"] + t["xr_download_s"] + t["xr_reduce_s"] + t["xr_broadcast_s"]
        out.append({"round": r, "exchange_s": exch, "wall_s": wall, **t})
    sync.close()
    return out


def _aws(args: list[str], env: dict) -> None:
    p = subprocess.run(["aws", *args], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"aws {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")


def naive(a) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    regions = a.regions.split(",")
    peers = [r for r in regions if r != a.region]
    g = torch.Generator().manual_seed(zlib.crc32(a.region.encode()) % 2**31)
    flat = torch.randn(a.numel, generator=g) * 1e-3
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    client = None
    if a.transport == "s3":
        from .servers import s3_client

        client = s3_client(a.endpoint, threads=1, lean=False)
        env = {**os.environ, "AWS_CONFIG_FILE": a.aws_config}
        url = f"s3://{a.bucket}/{a.prefix}/naive"
    out = []
    for r in range(1, a.rounds + 1):
        barrier(Path(a.barrier_dir), f"r{r}", a.region, regions)
        t0 = time.perf_counter()
        if a.transport == "s3":
            mine = work / f"up-{a.region}-{r}.pt"
            torch.save(flat, mine)
            _aws(
                [
                    "--endpoint-url",
                    a.endpoint,
                    "s3",
                    "cp",
                    "--only-show-errors",
                    str(mine),
                    f"{url}/r{r}/{a.region}.pt",
                ],
                env,
            )
            t1 = time.perf_counter()
            for p in peers:
                while True:
                    try:
                        client.head_object(Bucket=a.bucket, Key=f"{a.prefix}/naive/r{r}/{p}.pt")
                        break
                    except client.exceptions.ClientError:
                        time.sleep(0.05)
            t2 = time.perf_counter()
            got = []
            for p in peers:
                dst = work / f"down-{a.region}-{p}-{r}.pt"
                _aws(
                    [
                        "--endpoint-url",
                        a.endpoint,
                        "s3",
                        "cp",
                        "--only-show-errors",
                        f"{url}/r{r}/{p}.pt",
                        str(dst),
                    ],
                    env,
                )
                got.append(torch.load(dst, weights_only=True))
                dst.unlink()
            mine.unlink()
        else:
            box = Path(a.root) / "naive" / f"r{r}"
            box.mkdir(parents=True, exist_ok=True)
            tmp = box / f".{a.region}.pt.tmp"
            torch.save(flat, tmp)
            os.replace(tmp, box / f"{a.region}.pt")
            t1 = time.perf_counter()
            for p in peers:
                while not (box / f"{p}.pt").exists():
                    time.sleep(0.05)
            t2 = time.perf_counter()
            got = [torch.load(box / f"{p}.pt", weights_only=True) for p in peers]
        avg = flat.clone()
        for x in got:
            avg.add_(x)
        avg.div_(len(regions))
        t3 = time.perf_counter()
        out.append(
            {
                "round": r,
                "exchange_s": t3 - t0,
                "upload_s": t1 - t0,
                "wait_s": t2 - t1,
                "download_s": t3 - t2,
                "bytes_up": a.numel * 4,
            }
        )
        del got, avg
        if a.transport == "s3" and r > 1:  # keep the server's disk small
            client.delete_objects(
                Bucket=a.bucket,
                Delete={"Objects": [{"Key": f"{a.prefix}/naive/r{r - 1}/{x}.pt"} for x in regions]},
            )
    return out


def ceiling(a) -> list[dict]:
    """Best single-client raw transfer of ``nbytes`` up, then down; each way the faster of two modes."""
    from concurrent.futures import ThreadPoolExecutor

    data = bytes(a.nbytes)
    out = []
    if a.transport == "fs":
        root = Path(a.root)
        root.mkdir(parents=True, exist_ok=True)
        buf = bytearray(a.nbytes)
        for r in range(1, a.rounds + 1):
            path = root / f"ceiling-{r}.bin"
            t0 = time.perf_counter()
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            t1 = time.perf_counter()
            with open(path, "rb") as f:
                view, got = memoryview(buf), 0
                while got < a.nbytes:
                    got += f.readinto(view[got:])
            t2 = time.perf_counter()
            path.unlink()
            out.append(
                {
                    "round": r,
                    "up_s": t1 - t0,
                    "down_s": t2 - t1,
                    "mode_up": "one file",
                    "mode_down": "one file",
                    "exchange_s": t2 - t0,
                }
            )
        return out
    from sbatch_gen.train.xr.store import S3Store

    store = S3Store(
        a.bucket,
        f"{a.prefix}/ceiling",
        endpoint_url=a.endpoint,
        addressing_style="path",
        region_name="us-east-1",
        threads=16,
    )
    pool = ThreadPoolExecutor(16)
    buf = bytearray(a.nbytes)
    bview = memoryview(buf)
    equal = -(-a.nbytes // 16)
    modes = {  # name -> part size
        "one object": a.nbytes,
        f"{-(-a.nbytes // (16 << 20))} x 16 MiB, 16 threads": 16 << 20,
        f"16 x {equal / 2**20:.3g} MiB, 16 threads": equal,
    }
    for r in range(1, a.rounds + 1):
        ups, downs = {}, {}
        for name, size in modes.items():
            parts = [(i, o, min(a.nbytes, o + size)) for i, o in enumerate(range(0, a.nbytes, size))]
            keys = [f"r{r}/{size}/s{i:05d}.bin" for i, _, _ in parts]
            t0 = time.perf_counter()
            if len(parts) == 1:
                store.put(keys[0], data)
            else:
                list(pool.map(lambda p, k=keys: store.put(k[p[0]], data[p[1] : p[2]]), parts))
            t1 = time.perf_counter()
            list(pool.map(lambda p, k=keys: store.get_into(k[p[0]], bview[p[1] : p[2]]), parts))
            t2 = time.perf_counter()
            ups[name], downs[name] = t1 - t0, t2 - t1
            store.delete(keys)
        res = {"round": r}
        res["mode_up"], res["up_s"] = min(ups.items(), key=lambda kv: kv[1])
        res["mode_down"], res["down_s"] = min(downs.items(), key=lambda kv: kv[1])
        res["all_up"], res["all_down"] = ups, downs
        res["exchange_s"] = res["up_s"] + res["down_s"]
        out.append(res)
    pool.shutdown()
    store.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.mailbox_worker")
    ap.add_argument("mode", choices=["ours", "naive", "ceiling", "mkbucket"])
    ap.add_argument("--region", default="a")
    ap.add_argument("--regions", default="a,b")
    ap.add_argument("--numel", type=int, default=0)
    ap.add_argument("--nbytes", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--run-id", default="bench")
    ap.add_argument("--transport", choices=["fs", "s3"], default="fs")
    ap.add_argument("--root", default="")
    ap.add_argument("--endpoint", default="")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--prefix", default="mb")
    ap.add_argument("--payload-dtype", default="bf16")
    ap.add_argument("--shard-mb", type=float, default=16.0)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--serialization", default="raw")
    ap.add_argument("--barrier-dir", default="")
    ap.add_argument("--work", default="")
    ap.add_argument("--aws-config", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.mode == "mkbucket":
        from .servers import s3_client

        s3_client(a.endpoint).create_bucket(Bucket=a.bucket)
        return
    res = {"ours": ours, "naive": naive, "ceiling": ceiling}[a.mode](a)
    write_atomic(a.out, json.dumps(res), fsync=False)


if __name__ == "__main__":
    main()
