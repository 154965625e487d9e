"""Benchmark: sparse outer updates (``payload_dtype: sparse``, issue 43) against dense bf16 DiLoCo, side by
side in one run: held-out loss and bytes per round.

The harness of :mod:`.quality` (two regions, each one process of the real trainer, an fs mailbox, strict
rounds, the same seed, data and tokens in every variant): per H, dense bf16 at plain averaging (outer lr 1,
momentum 0) and at lr 1 / momentum 0.5 (the best of quality.md at H 50 and 100), and sparse at each density
with error feedback (``sparse_beta``) over an outer lr grid, momentum 0 (the error feedback replaces it, as
in SparseLoCo). Bytes: what region a puts on the wire per round, its objects (``xr_bytes_up``) and its
manifest (the JSON index, read from the mailbox), so everything a round uploads is counted.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sbatch_gen.train.data import prepare

from .common import Result
from .quality import FULL, QUICK, Sizes, Variant, _ckpt_every, _keep_all, _variant
from .regionruns import DATA_BYTES, HELDOUT, REGIONS, train_config


@dataclass(frozen=True)
class Plan:
    sizes: Sizes
    hs: tuple[int, ...]
    densities: tuple[float, ...]
    sparse_lrs: tuple[float, ...]
    betas: tuple[float, ...]
    dense: tuple[tuple[float, float], ...] = ((1.0, 0.0), (1.0, 0.5))


FULL_PLAN = Plan(FULL, hs=(10, 50), densities=(0.01, 0.03), sparse_lrs=(1.0, 2.0, 4.0), betas=(0.95, 1.0))
QUICK_PLAN = Plan(QUICK, hs=(4,), densities=(0.03,), sparse_lrs=(1.0,), betas=(0.95,), dense=((1.0, 0.0),))


def _variants(p: Plan) -> list[Variant]:
    out = []
    for h in p.hs:
        out += [Variant("diloco", h, lr, m) for lr, m in p.dense]
        out += [
            Variant("diloco", h, lr, 0.0, "sparse", density=d, beta=b)
            for d in p.densities
            for lr in p.sparse_lrs
            for b in p.betas
        ]
    return out


def _manifest_bytes(root: Path) -> float:
    """The mean size of region a's round manifests still in the mailbox (JSON; the last keep_rounds)."""
    sizes = [f.stat().st_size for f in root.glob("mailbox/*/r*/a.done")]
    return sum(sizes) / len(sizes) if sizes else 0.0


def _one(work: Path, data: Path, cfg: Path, sz: Sizes, v: Variant) -> dict:
    t0 = time.monotonic()
    r = _variant(work, data, cfg, sz, v)
    r["manifest_bytes"] = _manifest_bytes(work / v.key)
    r["density"], r["beta"] = v.density, v.beta
    r["up_per_round"] = r["bytes_total"] / max(1, r["rounds"]) / 4  # (up + down of both regions) / 4
    print(f"  sparse: {v.label}: held-out {r['heldout']:.4f} ({time.monotonic() - t0:.0f} s)", flush=True)
    shutil.rmtree(work / v.key, ignore_errors=True)
    return r


def run(out_dir: Path, quick: bool = False) -> Result:
    p = QUICK_PLAN if quick else FULL_PLAN
    sz = p.sizes
    res = Result("sparse", "Sparse outer updates with error feedback vs dense bf16 DiLoCo", quick)
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-sparse-", dir=shm if shm.is_dir() else None))
    try:
        data = work / "data"
        prepare(data, [*REGIONS, HELDOUT], "python-stdlib", DATA_BYTES)
        cfg = train_config(
            work / "sparse.yaml",
            steps=sz.steps,
            model=sz.model,
            batch=sz.batch,
            data_dir=data,
            ckpt_every=_ckpt_every(sz),
            warmup=sz.warmup,
            lr=sz.lr,
            seed=sz.seed,
        )
        _keep_all(cfg, sz.evals + 1)
        plan = _variants(p)
        with ThreadPoolExecutor(sz.parallel) as pool:
            got = list(pool.map(lambda v: _one(work, data, cfg, sz, v), plan))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(res, p, got)
    if not quick:  # the variants' figures (not their curves), to redraw the tables without rerunning
        keep = ("label", "h", "lr", "momentum", "dtype", "density", "beta", "rounds", "heldout", "same")
        keep += ("up_per_round", "manifest_bytes", "bytes_total", "train_loss_last", "wall_s", "curve")
        raw = [{k: r[k] for k in keep} for r in got]
        (out_dir / "sparse-variants.json").write_text(json.dumps(raw, indent=1) + "\n")
    return res


def _report(res: Result, p: Plan, got: list[dict]) -> None:
    sz = p.sizes
    res.setup = [
        f"2 regions (a, b), each one process of the real trainer (gloo, CPU), fs mailbox on tmpfs, strict rounds: "
        f"the model of bench quality ({sz.model}), batch {sz.batch}, {sz.steps} steps per region, inner AdamW lr "
        f"{sz.lr:g}, seed {sz.seed}: the same config, data and tokens in every variant.",
        f"H in {list(p.hs)}; dense bf16 at outer (lr, momentum) {[list(x) for x in p.dense]}; sparse "
        f"(sparse_chunk 4096) at density {list(p.densities)} x outer lr {list(p.sparse_lrs)}, momentum 0, "
        f"sparse_beta {list(p.betas)}.",
        "Held-out loss: of region a's final model (b's checked bit-identical) on the held-out shard, as in bench "
        "quality. Bytes per round: what region a uploads per round, objects (xr_bytes_up) plus its manifest "
        "(JSON: the index and a checksum per 1 MiB chunk); the reader downloads the same.",
    ]
    rows = []
    for h in p.hs:
        dense = [r for r in got if r["h"] == h and r["dtype"] == "bf16"]
        if not dense:
            continue
        best_dense = min(dense, key=lambda r: r["heldout"])
        ref_bytes = best_dense["up_per_round"] + best_dense["manifest_bytes"]
        for r in sorted(
            (r for r in got if r["h"] == h), key=lambda r: (r["dtype"] != "bf16", r["density"], r["lr"])
        ):
            wire = r["up_per_round"] + r["manifest_bytes"]
            objects = r["up_per_round"] / best_dense["up_per_round"]
            rows.append(
                [
                    r["label"],
                    r["rounds"],
                    f"{r['heldout']:.4f}",
                    f"{(r['heldout'] / best_dense['heldout'] - 1) * 100:+.2f}%",
                    f"{r['up_per_round']:.0f} + {r['manifest_bytes']:.0f}",
                    f"1/{1 / objects:.0f}",
                    f"{wire / ref_bytes:.4f} (1/{ref_bytes / wire:.0f})",
                    "yes" if r["same"] else "NO",
                ]
            )
        sparse = [r for r in got if r["h"] == h and r["dtype"] == "sparse"]
        for d in p.densities:
            at = [r for r in sparse if r["density"] == d]
            if not at:
                continue
            b = min(at, key=lambda r: r["heldout"])
            gap = b["heldout"] / best_dense["heldout"] - 1
            ratio = (b["up_per_round"] + b["manifest_bytes"]) / ref_bytes
            objects = b["up_per_round"] / best_dense["up_per_round"]
            res.goal(
                f"H={h}, density {d:.0%}: held-out within +1% of dense bf16 (each at its best outer setting)",
                f"{b['heldout']:.4f} ({b['label']}) vs {best_dense['heldout']:.4f} ({best_dense['label']}): "
                f"{gap * 100:+.2f}%",
                None if res.quick else gap <= 0.01,  # (--quick judges nothing)
            )
            if d <= 0.01:  # (3%: its kept entries alone are 1/38 of bf16's: the table says its bytes)
                res.goal(
                    f"H={h}, density {d:.0%}: bytes per round <= 1/100 of bf16's, manifest included, on this "
                    "small model (at the run's size: bench sparse_scale)",
                    f"{ratio:.4f} (1/{1 / ratio:.0f}; the objects alone 1/{1 / objects:.0f})",
                    None if res.quick else ratio <= 0.01,
                )
    res.table(
        "Held-out loss and bytes per round (region a), against the best dense bf16 of the same H",
        [
            "variant",
            "rounds",
            "held-out loss",
            "vs best bf16",
            "bytes up per round (objects + manifest)",
            "objects vs bf16",
            "all vs bf16",
            "a, b identical",
        ],
        rows,
    )
    res.headline = {
        r["label"]: f"{r['heldout']:.4f}"
        for r in got
        if r["dtype"] == "sparse" and r["lr"] == p.sparse_lrs[0]
    }


def codec_times(n: int = 1 << 22, reps: int = 7, device: str = "cpu") -> list[list]:
    """Encode and decode seconds per million elements of one fp32 shard of ``n`` random values on ``device``
    (the wire bytes in host memory, as the exchange has them: a GPU's times include the copies), median of
    ``reps`` interleaved repetitions each, with reused buffers: int8 and int4 (the scaled payloads) against
    sparse at 1% and 3% (chunk 4096). Rows: dtype, encode, decode, both (ms per million), wire bytes per
    element."""
    import statistics

    import torch

    from sbatch_gen.train.xr import scaled, sparse
    from sbatch_gen.train.xr.protocol import wire_nbytes

    dev = torch.device(device)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dev)
    scratch, out = torch.empty(n + 4096, device=dev), torch.empty(n + 4096, device=dev)
    cases = {
        w: (
            lambda w=w: scaled.encode(x, w, scratch=scratch),
            lambda b, w=w: scaled.decode(b, n, w, dev, out=out),
        )
        for w in ("int8", "int4")
    }
    for d in (0.01, 0.03):
        k = sparse.kept(4096, d)
        cases[f"sparse {d:.0%}"] = (
            lambda k=k: sparse.encode(x, 4096, k, scratch=scratch),
            lambda b, k=k: sparse.decode(b, n, 4096, k, dev, out=out),
        )

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    times: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}
    for _ in range(reps):
        for c, (enc, dec) in cases.items():
            sync()
            t0 = time.perf_counter()
            b = bytearray(enc())
            t1 = time.perf_counter()
            dec(b)
            sync()
            times[c].append((t1 - t0, time.perf_counter() - t1))
    rows = []
    per = n / 1e6
    for c, ts in times.items():
        e, d = statistics.median(t[0] for t in ts) / per, statistics.median(t[1] for t in ts) / per
        wire = c if not c.startswith("sparse") else f"sparse-c4096-k{sparse.kept(4096, float(c[7:-1]) / 100)}"
        rows.append([c, f"{e * 1e3:.2f}", f"{d * 1e3:.2f}", f"{(e + d) * 1e3:.2f}", wire_nbytes(wire, n) / n])
    return rows


def same_bytes_as_cpu(n: int, device: str) -> bool:
    """Whether the sparse encoder writes the same bytes from the same values on ``device`` as on the CPU (1%,
    chunk 4096; random values: no ties), and each decodes them to the same bits: a region may encode on its
    GPU and another decode on its CPU."""
    import torch

    from sbatch_gen.train.xr import sparse

    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    k = sparse.kept(4096, 0.01)
    here, there = bytes(sparse.encode(x, 4096, k)), bytes(sparse.encode(x.to(device), 4096, k))
    a = sparse.decode(bytearray(here), n, 4096, k, "cpu")
    b = sparse.decode(bytearray(there), n, 4096, k, device).cpu()
    return here == there and torch.equal(a.view(torch.int32), b.view(torch.int32))


if __name__ == "__main__":  # python -m bench.sparse: the codec times alone (seconds; one process)
    import torch

    from .common import machine, md_table, now_utc

    print(f"Measured {now_utc()} on {machine()}, torch threads {torch.get_num_threads()}, 4 Mi elements:\n")
    print(md_table(["payload", "encode ms/M", "decode ms/M", "both ms/M", "wire B/element"], codec_times()))
