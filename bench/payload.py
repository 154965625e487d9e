"""Benchmark: compressed cross-region payloads (issue 16): ``payload_dtype`` bf16 vs int8 vs fp8 vs int4 (fp32
as a reference), side by side in one run.

1. **Bytes and round time**: two regions of the real trainer (each one process, ``python -m sbatch_gen.train``)
   train a ~25M-parameter GPT for a few DiLoCo rounds, once per payload dtype (and int8 with bf16's shard
   count, int4 likewise), over the emulated WAN (S3
   behind :mod:`bench.wan`'s netns + tbf + delay proxy; the regions run in the client namespace) and over
   the fs mailbox on tmpfs (where encoding and decoding show). From the regions' metrics.jsonl: the bytes
   each region uploads per round and the round time with its phases. Plus the encode + decode time of the
   same number of elements in this process (the functions the exchange calls, one thread).
2. **Quality**: the same short two-region DiLoCo run (same seeds, tokens, H) per payload dtype, twice (two
   seeds); the final model's loss on a held-out shard neither region trained on (:func:`.finalmodel.heldout_loss`).
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sbatch_gen.train.data import prepare
from sbatch_gen.train.xr.protocol import ITEMSIZE, QBLOCK, SCALED, ShardPlan, wire_nbytes
from sbatch_gen.xr_options import FsTransport, S3Transport

from .common import Result, median
from .finalmodel import heldout_loss, same_params
from .regionruns import (
    DATA_BYTES,
    HELDOUT,
    OUTER_LR,
    OUTER_MOMENTUM,
    REGIONS,
    finish,
    launch_pair,
    quality_config,
    train_config,
)
from .rundir import read_records, step_records
from .wan import Wan, available, s3_behind

DTYPES = ("fp32", "bf16", "int8", "fp8", "int4")  # round part, fs (fp32: the reference)
# round part, WAN: (label, dtype, shard_mb). shard_mb counts wire bytes, so int8 at the default 16 MiB has half
# bf16's shards, i.e. half its concurrent streams; at 8 MiB it has as many shards as bf16 at 16 MiB
WAN_VARIANTS = (
    ("bf16", "bf16", 16.0),
    ("int8", "int8", 16.0),
    ("fp8", "fp8", 16.0),
    ("int8, shard_mb 8", "int8", 8.0),
    ("int4", "int4", 16.0),
    ("int4, shard_mb 4", "int4", 4.0),
)
Q_DTYPES = ("bf16", "int8", "fp8", "int4")  # quality part
SHARD_MB = 16.0  # CrossRegion's default shard size


@dataclass(frozen=True)
class Sizes:
    r_model: dict  # round part: the model whose deltas cross
    r_batch: int
    r_h: int
    r_rounds: int  # rounds per run ...
    r_warmup: int  # ... of which the first ones are left out (first touch of the staging buffers)
    wan_mbit: int
    wan_rtt_ms: float
    wan_window_kb: int
    q_steps: int  # quality part
    q_h: int
    q_model: dict
    q_batch: int
    q_seeds: tuple[int, ...]
    q_eval_windows: int


FULL = Sizes(
    r_model={"n_layers": 8, "d_model": 512, "n_heads": 8, "seq_len": 64},
    r_batch=2,
    r_h=2,
    r_rounds=4,
    r_warmup=1,
    wan_mbit=400,
    wan_rtt_ms=80.0,
    wan_window_kb=1024,
    q_steps=200,
    q_h=10,
    q_model={"n_layers": 2, "d_model": 128, "n_heads": 4, "seq_len": 64},
    q_batch=8,
    q_seeds=(1234, 99),
    q_eval_windows=1024,
)
# --quick (the tests): the round part's fs runs are the quality part's runs too (one run per dtype, not two):
# the same model, batch, H and number of rounds (q_steps // q_h), with the quality config of q_seeds[0]
QUICK = Sizes(
    r_model={"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16},
    r_batch=2,
    r_h=2,
    r_rounds=4,
    r_warmup=1,
    wan_mbit=400,
    wan_rtt_ms=20.0,
    wan_window_kb=1024,
    q_steps=8,
    q_h=2,
    q_model={"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16},
    q_batch=2,
    q_seeds=(1234,),
    q_eval_windows=32,
)


def expected_bytes(dtype: str, numel: int, shard_mb: float = SHARD_MB) -> tuple[int, int]:
    """(bytes of one region's payload per round, of which scales): the shard plan the exchange makes for
    ``dtype`` (16 MiB of wire values per shard), each shard :func:`wire_nbytes` long."""
    plan = ShardPlan.make(numel, ITEMSIZE[dtype], shard_mb)
    total = sum(wire_nbytes(dtype, hi - lo) for lo, hi in plan.bounds)
    scales = sum(4 * math.ceil((hi - lo) / QBLOCK) for lo, hi in plan.bounds) if dtype in SCALED else 0
    return total, scales


# ---------------------------------------------------------------------------------------------------
# Part 1: bytes and round time


def _round_variant(
    work: Path,
    data: Path,
    cfg: Path,
    sz: Sizes,
    where: str,
    transport: FsTransport | S3Transport,
    dtype: str,
    shard_mb: float = SHARD_MB,
    prefix: list[str] | None = None,
    env: dict | None = None,
    quality: tuple[Sizes, int] | None = None,
) -> dict:
    """One run of the round part. ``quality``: (sizes, seed) when the run is also the quality part's run of
    ``dtype`` and that seed (--quick): its quality figures under ``"quality"``, taken before its files go."""
    name = f"r-{where}-{dtype}-{shard_mb:g}"
    root = work / name
    runs = launch_pair(
        root,
        name,
        config=cfg,
        data=data,
        env=env,
        prefix=prefix,
        inner_steps=sz.r_h,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
        payload_dtype=dtype,
        shard_mb=shard_mb,
        transport=transport,
        keep_rounds=1,
    )
    finish(runs, name)
    recs = {region: read_records(root / region) for region in REGIONS}
    rounds = {region: [r for r in step_records(recs[region]) if "xr_round" in r] for region in REGIONS}
    numel = next(r["numel"] for r in recs["a"] if r.get("event") == "xr_outer_state")
    if [r["xr_round"] for r in rounds["a"]] != list(range(1, sz.r_rounds + 1)):
        raise RuntimeError(f"{name}: a's rounds are {[r['xr_round'] for r in rounds['a']]}")
    per_round = []
    for i in range(sz.r_warmup, sz.r_rounds):
        # the round's cost to the region that arrived last (the smaller xr_total_s: the other region's
        # total also holds its wait for this one's compute)
        later = min((rounds[region][i] for region in REGIONS), key=lambda r: r["xr_total_s"])
        per_round.append(later)
    qual = None if quality is None else _quality_figures(root, data, quality[0], dtype, quality[1])
    shutil.rmtree(root, ignore_errors=True)  # the 25M model's checkpoints live on tmpfs
    ups = {r["xr_bytes_up"] for region in REGIONS for r in rounds[region]}
    if len(ups) != 1:
        raise RuntimeError(f"{name}: bytes uploaded per round differ between rounds/regions: {sorted(ups)}")
    mid = sorted(per_round, key=lambda r: r["xr_total_s"])[len(per_round) // 2]
    return {
        "where": where,
        "dtype": dtype,
        "label": dtype if shard_mb == SHARD_MB else f"{dtype}, shard_mb {shard_mb:g}",
        "shard_mb": shard_mb,
        "shards": len(ShardPlan.make(numel, ITEMSIZE[dtype], shard_mb)),
        "expected": expected_bytes(dtype, numel, shard_mb)[0],
        "numel": numel,
        "bytes_up": ups.pop(),
        "bytes_down": rounds["a"][-1]["xr_bytes_down"],
        "round_s": median([r["xr_total_s"] for r in per_round]),
        "rounds_s": [r["xr_total_s"] for r in per_round],
        "split": {k: mid[f"xr_{k}_s"] for k in ("upload", "wait", "download", "reduce", "outer_step")},
        "quality": qual,
    }


def _codec_times(numel: int, reps: int) -> dict[str, tuple[float, float]]:
    """Best-of-``reps`` seconds to encode and to decode ``numel`` fp32 values, one thread, per wire dtype: the
    functions the exchange calls (int8/fp8: :mod:`.scaled`; bf16: the conversion the raw path makes)."""
    import torch

    from sbatch_gen.train.xr import scaled
    from sbatch_gen.train.xr.protocol import wire_nbytes

    torch.set_num_threads(1)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3

    def best(f) -> float:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    out = {}
    bf = x.to(torch.bfloat16).view(torch.uint8).numpy().data
    out["bf16"] = (
        best(lambda: x.to(torch.bfloat16).view(torch.uint8).numpy().data),
        best(lambda: torch.frombuffer(bf, dtype=torch.bfloat16).float()),
    )
    # int8/fp8 with the buffers the exchange keeps from round to round (an fp32 block buffer, the encoded
    # bytes, the decoded values), as the bf16 path keeps its staging buffer
    scratch, dec = torch.empty(numel + scaled.QBLOCK), torch.empty(numel + scaled.QBLOCK)
    for w in ("int8", "fp8", "int4"):
        enc = torch.empty(wire_nbytes(w, numel), dtype=torch.uint8)
        buf = scaled.encode(x, w, scratch=scratch, out=enc)
        out[w] = (
            best(lambda w=w, e=enc: scaled.encode(x, w, scratch=scratch, out=e)),
            best(lambda w=w, b=buf: scaled.decode(b, numel, w, out=dec)),
        )
    # for scale: what a fresh fp32 buffer of these values costs (page faults) against zeroing one kept
    kept = torch.empty(numel)
    kept.zero_()
    out["fresh"] = (best(lambda: torch.zeros(numel)), best(kept.zero_))
    return out


def _rounds(work: Path, data: Path, sz: Sizes, quick: bool, res: Result) -> dict[str, list[dict]]:
    """Part 1's runs: over the WAN (where it runs), then on fs; --quick: the fs runs with part 2's config of
    its one seed, each also that dtype's quality run (:func:`_quality` then takes their figures)."""
    cfg = train_config(
        work / "round.yaml",
        steps=sz.r_h * sz.r_rounds,
        model=sz.r_model,
        batch=sz.r_batch,
        data_dir=data,
        ckpt_every=1_000_000,
        warmup=1,
    )
    out: dict[str, list[dict]] = {}
    why = available()
    if why is None:
        w = Wan(rate_mbit=sz.wan_mbit, rtt_ms=sz.wan_rtt_ms, window_kb=sz.wan_window_kb)
        res.setup.append(
            f"**WAN**: the regions run in one network namespace, the S3 store (nanio) in another behind a veth "
            f"pair: {w.describe()} (bench/wan.py). Both regions share the link, as two sites share one "
            "object store's."
        )
        with w, s3_behind(w, work, "payload") as (t, env):
            out["wan"] = []
            # quick (the tests): bf16 and int8 only, the transfer path is the same for fp8
            for label, dtype, shard_mb in WAN_VARIANTS[:2] if quick else WAN_VARIANTS:
                t0 = time.monotonic()
                v = _round_variant(work, data, cfg, sz, "wan", t, dtype, shard_mb, w.exec_prefix(), env)
                print(f"  payload: wan {label}: round {v['round_s']:.2f} s ({time.monotonic() - t0:.0f} s)")
                out["wan"].append(v)
    else:
        res.notes.append(f"WAN part skipped: {why}")

    fs_cfg, quality = cfg, None
    if quick:
        (seed,) = sz.q_seeds
        assert sz.r_h * sz.r_rounds == sz.q_steps and sz.r_h == sz.q_h and sz.r_model == sz.q_model
        assert sz.r_batch == sz.q_batch
        fs_cfg, quality = quality_config(work, data, sz, seed), (sz, seed)

    def fs(dtype: str) -> dict:
        t0 = time.monotonic()
        transport = FsTransport(root=str(work / "mailbox"))
        q = quality if dtype in Q_DTYPES else None
        v = _round_variant(work, data, fs_cfg, sz, "fs", transport, dtype, quality=q)
        print(
            f"  payload: fs {dtype}: round {v['round_s']:.3f} s ({time.monotonic() - t0:.0f} s)", flush=True
        )
        return v

    # one dtype at a time for the timings; a quick run (the tests) checks no timing: all at once
    with ThreadPoolExecutor(len(DTYPES) if quick else 1) as pool:
        out["fs"] = list(pool.map(fs, DTYPES))
    return out


# ---------------------------------------------------------------------------------------------------
# Part 2: quality


def _quality_variant(work: Path, data: Path, cfg: Path, sz: Sizes, dtype: str, seed: int) -> dict:
    name = f"q-{dtype}-s{seed}"
    root = work / name
    runs = launch_pair(
        root,
        name,
        config=cfg,
        data=data,
        inner_steps=sz.q_h,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
        payload_dtype=dtype,
    )
    finish(runs, name)
    return _quality_figures(root, data, sz, dtype, seed)


def _quality_figures(root: Path, data: Path, sz: Sizes, dtype: str, seed: int) -> dict:
    """A finished two-region run's quality figures: a's rounds and bytes up, the held-out loss of a's final
    model, and whether b's is bit-identical."""
    rounds = [r for r in step_records(read_records(root / "a")) if "xr_round" in r]
    model = root / "a" / "model.safetensors"
    loss = heldout_loss(model, {**sz.q_model, "dropout": 0.0}, data / f"{HELDOUT}.bin", sz.q_eval_windows)
    return {
        "dtype": dtype,
        "seed": seed,
        "rounds": len(rounds),
        "bytes_up": sum(r["xr_bytes_up"] for r in rounds),
        "loss": loss,
        "same": same_params(model, root / "b" / "model.safetensors"),
    }


def _quality(work: Path, data: Path, sz: Sizes, quick: bool, fs_rounds: list[dict]) -> list[dict]:
    if quick:  # part 1's fs runs were these runs (:func:`_rounds`)
        by = {v["dtype"]: v["quality"] for v in fs_rounds}
        return [by[dtype] for dtype in Q_DTYPES]
    tasks = []
    for seed in sz.q_seeds:
        cfg = quality_config(work, data, sz, seed)
        tasks += [(cfg, dtype, seed) for dtype in Q_DTYPES]

    def one(t: tuple[Path, str, int]) -> dict:
        t0 = time.monotonic()
        q = _quality_variant(work, data, t[0], sz, t[1], t[2])
        print(
            f"  payload: quality {t[1]} seed {t[2]}: {q['loss']:.4f} ({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
        return q

    # deterministic (strict rounds, fixed seeds, CPU), so running them at once changes nothing but the wall time
    with ThreadPoolExecutor(len(tasks) if quick else 2) as pool:
        return list(pool.map(one, tasks))


# ---------------------------------------------------------------------------------------------------


def run(out_dir: Path, quick: bool = False) -> Result:
    sz = QUICK if quick else FULL
    res = Result(
        "payload",
        "Compressed payloads: bf16 vs int8 vs fp8 vs int4 per round, over the WAN and fs; quality",
        quick,
    )
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-payload-", dir=shm if shm.is_dir() else None))
    try:
        data = work / "data"
        prepare(data, [*REGIONS, HELDOUT], "python-stdlib", DATA_BYTES)
        rounds = _rounds(work, data, sz, quick, res)
        numel = rounds["fs"][0]["numel"]
        codec = _codec_times(numel, 2 if quick else 3)
        qual = _quality(work, data, sz, quick, rounds["fs"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(res, sz, rounds, codec, qual, numel)
    _plot(res, out_dir, rounds, qual)
    return res


def _report(
    res: Result, sz: Sizes, rounds: dict[str, list[dict]], codec: dict, qual: list[dict], numel: int
) -> None:
    m = sz.r_model
    res.setup += [
        f"Part 1 (bytes, round time): 2 regions (a, b), each one process of the real trainer (`python -m "
        f"sbatch_gen.train`, gloo, CPU, one thread), a {m['n_layers']}-layer width-{m['d_model']} GPT "
        f"({numel / 1e6:.1f}M fp32 parameters), batch {sz.r_batch} x {m['seq_len']} tokens, DiLoCo H={sz.r_h}, "
        f"{sz.r_rounds} rounds, the first {sz.r_warmup} left out (first touch of the staging buffers); one run "
        f"per variant and place: on fs {', '.join(DTYPES)}; over the WAN "
        f"{', '.join(x[0] for x in WAN_VARIANTS)} (fp32 left out there: its rounds are twice bf16's, a minute "
        f"of the budget). CrossRegion defaults otherwise ({SHARD_MB:g} MiB shards, 16 threads, raw).",
        "Bytes per round: `xr_bytes_up` (one region's payload objects, manifest left out), the same in every "
        "round and both regions; expected: the exchange's shard plan for the dtype with each shard "
        "`wire_nbytes` long (int8/fp8/int4: one fp32 scale per 256 elements; int4 two values per byte).",
        "Round time: per round the smaller of the two regions' `xr_total_s` (publish, wait, fetch, average, "
        "outer step): the region that arrived last, so the other's wait for its compute is left out; median "
        "over the measured rounds. The split is that region's, in the median round.",
        "**fs**: the mailbox is a directory on tmpfs (/dev/shm), so transfer is nearly free and what differs "
        "between dtypes is encoding, checksums and decoding on the 2 cores both regions share.",
        "Encode + decode: the functions the exchange calls on the same number of elements, in the bench "
        "process, one thread, best of 3: int8/fp8/int4 `xr.scaled.encode`/`decode` into buffers kept between "
        "calls, as "
        "the exchange keeps them between rounds; bf16 the conversion of the raw path (`to(bfloat16)`, and back "
        "with `float()`).",
        f"Part 2 (quality): the same 2 regions, a {sz.q_model['n_layers']}-layer width-{sz.q_model['d_model']} "
        f"GPT, batch {sz.q_batch} x {sz.q_model['seq_len']} tokens, {sz.q_steps} steps per region, H={sz.q_h} "
        f"({sz.q_steps // sz.q_h} rounds), fs mailbox, min_regions all (every round has both regions: the same "
        f"tokens in every variant). Outer lr {OUTER_LR:g}, momentum {OUTER_MOMENTUM:g} (plain averaging, as "
        f"bench/elastic.py: the defaults overshoot from scratch over a few hundred steps). Seeds "
        f"{', '.join(map(str, sz.q_seeds))} (train.seed: init and data order); the same seeds, data and H for "
        "every dtype.",
        f"Held-out loss: the final `model.safetensors` (a's; b's checked bit-identical) in the bench process, "
        f"mean next-byte cross-entropy over {sz.q_eval_windows} fixed windows spread over the `{HELDOUT}` shard "
        f"(the stdlib source cut into a, b, {HELDOUT}; {DATA_BYTES / 1e6:g} MB).",
    ]
    if res.quick:
        res.setup.append(
            "--quick: one run per dtype on fs serves both parts (Part 2's config, and its one seed; the same "
            f"model, batch and H as Part 1's, {sz.r_rounds} rounds), so Part 1's fs figures come from those runs."
        )
    by = {(v["where"], v["label"]): v for vs in rounds.values() for v in vs}
    bf = by[("fs", "bf16")]["bytes_up"]
    others = [w for w in rounds if w != "fs"]
    rows = []
    for dtype in DTYPES:
        got = by[("fs", dtype)]["bytes_up"]
        want, scales = expected_bytes(dtype, numel)
        rows.append(
            [dtype, got, want, got == want, scales, f"{got / bf:.6f}", f"{got / numel:.4f}"]
            + [by[(w, dtype)]["bytes_up"] == got if (w, dtype) in by else "-" for w in others]
        )
    res.table(
        f"Bytes per round, one region ({numel} parameters)",
        ["payload", "bytes up per round", "expected", "exact", "of which scales", "vs bf16", "bytes/param"]
        + [f"same on {w}" for w in others],
        rows,
        "bytes",
    )
    parts = ("upload", "wait", "download", "reduce", "outer_step")
    for where, vs in rounds.items():
        b = by[(where, "bf16")]
        res.table(
            f"Round time, {where}",
            ["payload", "shards", "bytes up = expected", "round s (median)", "rounds s", "vs bf16"]
            + ["upload s", "wait s", "download s", "average s", "outer step s"],
            [
                [
                    v["label"],
                    v["shards"],
                    v["bytes_up"] == v["expected"],
                    v["round_s"],
                    ", ".join(f"{x:.3f}" for x in v["rounds_s"]),
                    f"{v['round_s'] / b['round_s']:.2f}",
                ]
                + [v["split"][k] for k in parts]
                for v in vs
            ],
            where,
        )
    res.table(
        f"Encode + decode of {numel} values, one thread (best of 3)",
        ["payload", "encode s", "decode s", "encode + decode s", "vs bf16", "ns/value"],
        [
            [w, e, d, e + d, f"{(e + d) / sum(codec['bf16']):.2f}x", (e + d) / numel * 1e9]
            for w, (e, d) in codec.items()
            if w != "fresh"
        ],
        "codec",
    )
    fresh, kept = codec["fresh"]
    base = {q["seed"]: q["loss"] for q in qual if q["dtype"] == "bf16"}
    res.table(
        "Quality: final held-out loss, same seeds, tokens and H",
        [
            "payload",
            "seed",
            "rounds",
            "MB up (a, whole run)",
            "held-out loss",
            "vs bf16 (same seed)",
            "a == b bitwise",
        ],
        [
            [
                q["dtype"],
                q["seed"],
                q["rounds"],
                q["bytes_up"] / 1e6,
                f"{q['loss']:.4f}",
                f"{q['loss'] / base[q['seed']] - 1:+.3%}",
                q["same"],
            ]
            for q in qual
        ],
        "quality",
    )

    # goals
    i8, i8_scales = by[("fs", "int8")]["bytes_up"], expected_bytes("int8", numel)[1]
    exact = all(by[(w, "int8")]["bytes_up"] == bf // 2 + i8_scales for w in rounds) and bf == 2 * numel
    res.goal(
        "int8 bytes per round: exactly 1/2 of bf16, plus scales",
        f"int8/bf16 = {i8 / bf:.6f}: {i8} B = {bf} / 2 + {i8_scales} B of scales "
        f"({i8_scales / (bf // 2):.3%}; 4 B per {QBLOCK} values of each shard)",
        exact,
    )
    i4, i4_scales = by[("fs", "int4")]["bytes_up"], expected_bytes("int4", numel)[1]
    pad = expected_bytes("int4", numel)[0] - i4_scales - bf // 4  # half a byte per shard of an odd count
    sent4 = [w for w in rounds if (w, "int4") in by]  # a quick run sends int4 over fs only
    exact4 = all(by[(w, "int4")]["bytes_up"] == bf // 4 + pad + i4_scales for w in sent4) and bf % 4 == 0
    res.goal(
        "int4 bytes per round (optional 4-bit): exactly 1/4 of bf16, plus scales",
        f"int4/bf16 = {i4 / bf:.6f}: {i4} B = {bf} / 4 + {i4_scales} B of scales"
        + (f" + {pad} B of padding" if pad else "")
        + f" ({i4_scales / (bf // 4):.3%})",
        exact4,
    )

    def gap(dtype: str) -> tuple[float, str]:
        qs = [q for q in qual if q["dtype"] == dtype]
        d = statistics.mean(q["loss"] / base[q["seed"]] - 1 for q in qs)
        each = "; ".join(
            f"seed {q['seed']}: {q['loss']:.4f} vs {base[q['seed']]:.4f}, {q['loss'] / base[q['seed']] - 1:+.3%}"
            for q in qs
        )
        return d, f"{d:+.3%} (mean over {len(qs)} seed{'s' if len(qs) > 1 else ''}; {each})"

    d8, txt8 = gap("int8")
    res.goal("held-out loss: int8 within +0.5% of bf16", txt8, None if res.quick else d8 <= 0.005)
    df8, txtf8 = gap("fp8")
    res.goal("held-out loss: fp8 vs bf16 (no goal set; reported)", txtf8, None)
    d4, txt4 = gap("int4")
    res.goal("held-out loss: int4 vs bf16 (no goal set; reported)", txt4, None)

    # headline
    res.headline["int8 bytes per round / bf16"] = f"{i8 / bf:.6f} (1/2 + {i8_scales / bf:.4%} scales)"
    res.headline["int4 bytes per round / bf16"] = f"{i4 / bf:.6f} (1/4 + {(i4 - bf // 4) / bf:.4%} scales)"
    for where, vs in rounds.items():
        b = by[(where, "bf16")]["round_s"]
        for v in vs:
            if v["label"] not in ("bf16", "fp32"):
                res.headline[f"round time {where}, {v['label']} / bf16"] = (
                    f"{v['round_s'] / b:.2f} ({v['round_s']:.3g} s vs {b:.3g} s)"
                )
    e8 = sum(codec["int8"]) - sum(codec["bf16"])
    res.headline["encode + decode, int8 - bf16, one thread"] = (
        f"{e8 * 1e3:+.0f} ms ({sum(codec['int8']) / sum(codec['bf16']):.1f}x bf16's) for {numel / 1e6:.1f}M values"
    )
    res.headline["held-out loss, int8 vs bf16"] = f"{d8:+.3%}"
    res.headline["held-out loss, fp8 vs bf16"] = f"{df8:+.3%}"
    res.headline["held-out loss, int4 vs bf16"] = f"{d4:+.3%}"
    e4 = sum(codec["int4"]) - sum(codec["bf16"])
    res.headline["encode + decode, int4 - bf16, one thread"] = (
        f"{e4 * 1e3:+.0f} ms ({sum(codec['int4']) / sum(codec['bf16']):.1f}x bf16's) for {numel / 1e6:.1f}M values"
    )

    # notes
    f8, fb = by[("fs", "int8")], by[("fs", "bf16")]
    res.notes.append(
        f"On fs int8 costs {f8['round_s'] - fb['round_s']:+.3f} s per round against bf16 (upload, which encodes: "
        f"{f8['split']['upload'] - fb['split']['upload']:+.3f} s; average, which decodes: "
        f"{f8['split']['reduce'] - fb['split']['reduce']:+.3f} s). Encode + decode alone differ by {e8:+.3f} s on "
        "one thread; in a round both regions do it at once on the 2 shared cores, next to checksums. The "
        "exchange keeps its int8/fp8 buffers between rounds, as the bf16 path keeps its staging buffer: on this "
        f"VM a fresh fp32 buffer of {numel / 1e6:.1f}M values takes {fresh:.3f} s to zero against {kept:.3f} s "
        "for one kept (first touch)."
    )
    if "wan" in rounds:
        w8, wb = by[("wan", "int8")], by[("wan", "bf16")]
        w88 = by.get(("wan", "int8, shard_mb 8"))
        res.notes.append(
            f"Over the WAN int8 saves {wb['round_s'] - w8['round_s']:.2f} s of a {wb['round_s']:.2f} s bf16 round "
            f"(x{w8['round_s'] / wb['round_s']:.2f}) for half the bytes: upload {wb['split']['upload']:.2f} -> "
            f"{w8['split']['upload']:.2f} s, download {wb['split']['download']:.2f} -> "
            f"{w8['split']['download']:.2f} s. shard_mb counts wire bytes, so at the default {SHARD_MB:g} MiB int8 "
            f"makes {w8['shards']} shards where bf16 makes {wb['shards']}: half the concurrent streams, on a link "
            "where each stream is window-bound (1 MiB per RTT here, like a long-haul TCP stream), so int8's "
            "transfers do not halve."
            + (
                f" With shard_mb 8 int8 keeps bf16's {w88['shards']} shards and its round is {w88['round_s']:.2f} s "
                f"(x{w88['round_s'] / wb['round_s']:.2f} of bf16's)."
                if w88
                else ""
            )
        )
    res.notes.append(
        "Every region decodes the same bytes to the same fp32 values and averages those, so a and b end "
        "bit-identical with every dtype (last column of the quality table)."
    )


def _plot(res: Result, out_dir: Path, rounds: dict[str, list[dict]], qual: list[dict]) -> None:
    from .common import plt, save_fig

    p = plt()
    fig, axes = p.subplots(1, 2 + len(rounds), figsize=(5 * (2 + len(rounds)), 4), layout="constrained")
    fs = rounds["fs"]
    axes[0].bar([v["label"] for v in fs], [v["bytes_up"] / 1e6 for v in fs])
    axes[0].set_ylabel("MB per region per round")
    axes[0].set_title("payload bytes per round")
    parts = ("upload", "wait", "download", "reduce", "outer_step")
    for ax, (where, vs) in zip(axes[1:], rounds.items(), strict=False):
        bottom = [0.0] * len(vs)
        for k in parts:
            h = [v["split"][k] for v in vs]
            ax.bar([v["label"].replace(", ", "\n") for v in vs], h, bottom=bottom, label=k)
            bottom = [b + x for b, x in zip(bottom, h, strict=True)]
        ax.set_ylabel("s")
        ax.set_title(f"round time, {where} (split of the median round)")
        ax.legend(fontsize=7)
    ax = axes[-1]
    seeds = sorted({q["seed"] for q in qual})
    width = 0.8 / len(seeds)
    for j, seed in enumerate(seeds):
        qs = [q for q in qual if q["seed"] == seed]
        ax.bar([i + j * width for i in range(len(qs))], [q["loss"] for q in qs], width, label=f"seed {seed}")
        ax.set_xticks([i + width * (len(seeds) - 1) / 2 for i in range(len(qs))], [q["dtype"] for q in qs])
    lo, hi = min(q["loss"] for q in qual), max(q["loss"] for q in qual)
    ax.set_ylim(lo - 0.05 * (hi - lo + 0.01), hi + 0.05 * (hi - lo + 0.01))
    ax.set_ylabel("held-out loss")
    ax.set_title("final held-out loss")
    ax.legend(fontsize=7)
    save_fig(fig, out_dir / "payload.png")
    res.plots.append(
        (
            "payload.png",
            "Bytes per round, round time split by phase (WAN, fs), and final held-out loss per payload dtype",
        )
    )
