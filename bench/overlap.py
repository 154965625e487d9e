"""Benchmark: exposed sync time with overlapped rounds (issue 16, item 4; issue 26, item 4):
``cross_region.overlap`` none vs eager vs streaming (F fragments, tau steps of delay), payload bf16 vs int8
vs sparse 1% (issue 43: its round time and exposed share against bf16's), side by side in one run, over the
emulated WAN.

Two regions of the real trainer (each one process, ``python -m sbatch_gen.testing.faults``: the trainer with the
per-step sleep installed) train the same steps in
strict DiLoCo rounds over S3 behind :mod:`bench.wan`'s netns + tbf + delay proxy (the regions run in the
client namespace), once per variant. The model and the step time (the trainer's injected per-step sleep,
``SBATCH_GEN_TEST_STEP_SLEEP_S``, standing in for a GPU's compute) are chosen so that one bf16 round's transfer
is about half of H x step time, as on the production pair; the ratio actually measured (the none variant's
round time against its inner steps) is reported. From the regions' metrics.jsonl: the seconds training was
held up at round boundaries (``xr_exposed_s`` of every round record and of the ``xr_final_round`` event)
against the training wall time (the sum of the steps' ``step_time_s``, the rounds included), the round time
(``xr_total_s``), the bytes per round, and whether both regions end with the same ``model.safetensors``.

``--quick``: a tiny model, an fs mailbox on tmpfs instead of the WAN, the variants four at a time: the
records and the regions' agreement only (no transfer to hide, so its shares say nothing about overlap).
Without root the full run falls back to the same fs mode.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from sbatch_gen.testing.faults import ENV_STEP_SLEEP
from sbatch_gen.train.data import prepare
from sbatch_gen.train.xr.fragments import round_step
from sbatch_gen.xr_options import CrossRegion, S3Transport

from .common import Result, median
from .regionruns import DATA_BYTES, OUTER_LR, OUTER_MOMENTUM, REGIONS, finish, launch_pair, train_config
from .rundir import read_records, step_records
from .wan import Wan, available, s3_behind

SPARSE_DENSITY = 0.01  # payload sparse: 1% of each chunk


@dataclass(frozen=True)
class V:
    """A variant: overlap and payload; streaming: F fragments and tau steps of delay."""

    overlap: str
    dtype: str
    frags: int = 1
    tau: int = 0
    density: float = SPARSE_DENSITY  # payload sparse: sparse_density (sparse_beta and sparse_chunk: defaults)

    @property
    def payload(self) -> str:
        """The payload as the tables name it: the dtype, with its density for sparse (``sparse 1%``)."""
        return f"sparse {self.density * 100:g}%" if self.dtype == "sparse" else self.dtype

    @property
    def label(self) -> str:
        stream = f" F={self.frags} tau={self.tau}" if self.overlap == "streaming" else ""
        return f"{self.overlap}{stream}, {self.payload}"

    @property
    def name(self) -> str:
        stream = f"-f{self.frags}-t{self.tau}" if self.overlap == "streaming" else ""
        sp = f"-d{self.density:g}" if self.dtype == "sparse" else ""
        return f"o-{self.overlap}{stream}-{self.dtype}{sp}"

    @property
    def final_join(self) -> bool:
        """Whether a round is still in flight after the last step (its join is the xr_final_round event)."""
        return self.overlap == "eager" or (self.overlap == "streaming" and self.tau > 0)


SPARSE = (V("none", "sparse"), V("eager", "sparse"))  # sparse 1% (issue 43): round time and exposed vs bf16
BASE = (V("none", "bf16"), V("eager", "bf16"), V("none", "int8"), V("eager", "int8"), *SPARSE)
GOAL_SHARE = 0.05  # eager: exposed sync time at most 5% of the wall time
GOAL_STREAMING = 0.02  # streaming: at most 2%, the run's end included
MERGE_WAIT_S = 0.1  # streaming: a merge that waited longer for its round is listed with its round
# issue 40's goal: streaming at F=4, tau=2 (bf16) at most 5% of wall time, the run's end included
GOAL_F4_TAU2 = (V("streaming", "bf16", 4, 2), 0.05)


@dataclass(frozen=True)
class Sizes:
    model: dict
    batch: int
    h: int
    rounds: int
    sleep_s: float  # injected at the end of every step (the compute a faster device would do)
    wan: bool  # False: an fs mailbox on tmpfs, the variants at once (quick)
    wan_mbit: int
    wan_rtt_ms: float
    wan_window_kb: int
    streaming: tuple[V, ...] = ()
    base: tuple[V, ...] = BASE
    subset: str | None = None  # the name of a subset of FULL's variants (SUBSETS)

    @property
    def variants(self) -> tuple[V, ...]:
        return (*self.base, *self.streaming)


FULL = Sizes(
    model={"n_layers": 4, "d_model": 384, "n_heads": 6, "seq_len": 32},
    batch=1,
    h=12,
    rounds=12,
    sleep_s=0.4,
    wan=True,
    wan_mbit=400,
    wan_rtt_ms=80.0,
    wan_window_kb=1024,
    # H=12: F=4 starts a round every 3 steps (tau up to 2), F=2 every 6 (tau up to 5)
    streaming=(
        *(V("streaming", "bf16", 4, t) for t in (0, 1, 2)),
        *(V("streaming", "bf16", 2, t) for t in (1, 3, 5)),
        V("streaming", "int8", 4, 2),
        V("streaming", "int8", 2, 5),
    ),
)
QUICK = Sizes(
    model={"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16},
    batch=1,
    h=4,
    rounds=2,
    sleep_s=0.02,
    wan=False,
    wan_mbit=400,
    wan_rtt_ms=20.0,
    wan_window_kb=1024,
    streaming=(V("streaming", "bf16", 2, 0), V("streaming", "bf16", 2, 1)),
)


# --subset NAME: FULL's sizes, fewer variants. goals: the streaming goal (F=4, tau=2, bf16) against
# none, and eager's goal, bf16; sparse 1% with none and eager beside bf16 (issue 43)
SUBSETS = {
    "goals": replace(
        FULL,
        base=(V("none", "bf16"), V("eager", "bf16"), *SPARSE),
        streaming=(V("streaming", "bf16", 4, 2),),
        subset="goals",
    ),
}


def _boundaries(sz: Sizes, v: V) -> set[int]:
    """The steps whose records carry ``xr_exposed_s``: every round boundary (none, eager); with streaming
    every round's start and merge (the last round's merge is the final event when tau > 0)."""
    if v.overlap != "streaming":
        return {sz.h * b for b in range(1, sz.rounds + 1)}
    starts = [round_step(k, sz.h, v.frags) for k in range(1, sz.rounds * v.frags + 1)]
    return set(starts) | {s + v.tau for s in starts if s + v.tau <= sz.h * sz.rounds}


def _region_figures(name: str, recs: list[dict], sz: Sizes, v: V) -> dict:
    """One region's figures from its metrics.jsonl: exposed seconds (every record carrying ``xr_exposed_s``:
    the step records of round boundaries, a streaming round's start and merge, and the ``xr_final_round``
    event), wall time, rounds."""
    steps = step_records(recs)
    if [r["step"] for r in steps] != list(range(1, sz.h * sz.rounds + 1)):
        raise RuntimeError(f"{name}: steps {[r['step'] for r in steps][:5]}... of {len(steps)}")
    final = [r for r in recs if r.get("event") == "xr_final_round"]
    rounds = [r for r in steps if "xr_round" in r] + final
    got = [r["xr_round"] for r in rounds]
    if got != list(range(1, sz.rounds * v.frags + 1)):
        raise RuntimeError(f"{name}: rounds {got}")
    if v.final_join != bool(final):
        raise RuntimeError(f"{name}: {v.label} with {len(final)} xr_final_round events")
    marks = [r for r in steps + final if "xr_exposed_s" in r]  # the boundaries, in order (+ the final)
    exposed = [r["xr_exposed_s"] for r in marks]
    boundary = {r["step"] for r in steps if "xr_exposed_s" in r}
    if boundary != _boundaries(sz, v):
        raise RuntimeError(f"{name}: boundaries at steps {sorted(boundary)}")
    wall = sum(r["step_time_s"] for r in steps)
    inner = [r["step_time_s"] for r in steps if r["step"] not in boundary and r["step"] > 1]
    ups = [r["xr_bytes_up"] for r in rounds]
    if v.overlap != "streaming" and len(set(ups)) != 1:
        raise RuntimeError(f"{name}: bytes uploaded per round differ: {sorted(set(ups))}")
    final_exposed = final[0]["xr_exposed_s"] if final else 0.0
    return {
        "exposed_s": sum(exposed),
        "exposed_final_s": final_exposed,
        "exposed_each": exposed,
        "wall_s": wall,
        "steps": len(steps),
        "inner_step_s": median(inner),
        "round_s": [r["xr_total_s"] for r in rounds],
        "join_s": [r["xr_join_s"] for r in marks if "xr_join_s" in r],
        # per boundary: the wait for the round in flight (eager, a streaming merge)
        "wait_each": [r.get("xr_join_s", 0.0) for r in marks],
        # streaming: what a round's start and its merge held training up for (the final event left out)
        "start_each": [r["xr_exposed_s"] for r in steps if "xr_inflight" in r and "xr_round" not in r],
        "merge_each": [r["xr_exposed_s"] for r in steps if "xr_round" in r],
        # streaming: per merge (the final event's included), its round and its wait for the round's exchange
        "merge_waits": [(r["xr_round"], r.get("xr_join_s", 0.0)) for r in rounds if "xr_exposed_s" in r],
        # the snapshots this region uploaded (theta_outer + momentum, fp32; every snapshot_every rounds, by the
        # round's first member, in the background): (round, upload s, the end's wait for it s or None)
        "snapshots": [
            (e["round"], e["seconds"], e.get("end_wait_s")) for e in recs if e.get("event") == "xr_snapshot"
        ],
        # the outer step and the mailbox cleanup at the boundary (the round's own record)
        "outer_cleanup_s": [r["xr_outer_step_s"] + r.get("xr_cleanup_s", 0.0) for r in rounds],
        "bytes_up": max(ups),  # streaming: the largest fragment's
        "bytes_up_total": sum(ups),
    }


def _variant(
    work: Path,
    data: Path,
    cfg: Path,
    sz: Sizes,
    v: V,
    transport: S3Transport | None,
    prefix: list[str] | None = None,
    env: dict | None = None,
) -> dict:
    name = v.name
    root = work / name
    t0 = time.monotonic()
    runs = launch_pair(
        root,
        name,
        config=cfg,
        data=data,
        env={**(env or {}), ENV_STEP_SLEEP: repr(sz.sleep_s)},
        prefix=prefix,
        inner_steps=sz.h,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
        overlap=v.overlap,
        payload_dtype=v.dtype,
        keep_rounds=1,
        **({"sparse_density": v.density} if v.dtype == "sparse" else {}),
        **({"fragments": v.frags, "fragment_delay_steps": v.tau} if v.overlap == "streaming" else {}),
        **({"transport": transport} if transport is not None else {}),
    )
    finish(runs, name)
    took = time.monotonic() - t0
    per = {
        region: _region_figures(f"{name} {region}", read_records(root / region), sz, v) for region in REGIONS
    }
    models = [root / region / "model.safetensors" for region in REGIONS]
    # the export is canonical: the same tensors are the same bytes
    same = models[0].read_bytes() == models[1].read_bytes()
    # the transfer of one round: per round the smaller of the two regions' xr_total_s (the region that arrived
    # last, whose round holds no wait for the other's compute), median over the rounds
    transfer = median([min(x) for x in zip(*(per[r]["round_s"] for r in REGIONS), strict=True)])
    shutil.rmtree(root, ignore_errors=True)
    if {per[r]["bytes_up"] for r in REGIONS} != {per["a"]["bytes_up"]}:
        raise RuntimeError(f"{name}: regions upload different bytes per round")
    return {
        "overlap": v.overlap,
        "dtype": v.dtype,
        "frags": v.frags,
        "tau": v.tau,
        "label": v.label,
        "variant": v,
        "regions": per,
        "same": same,
        "transfer_s": transfer,
        "bytes_up": per["a"]["bytes_up"],
        "bytes_up_total": per["a"]["bytes_up_total"],
        "took_s": took,
    }


def _run_variants(work: Path, data: Path, sz: Sizes, res: Result) -> list[dict]:
    cfg = train_config(
        work / "overlap.yaml",
        steps=sz.h * sz.rounds,
        model=sz.model,
        batch=sz.batch,
        data_dir=data,
        ckpt_every=1_000_000,
        warmup=1,
    )

    def show(v: dict) -> dict:
        share = max(v["regions"][r]["exposed_s"] / v["regions"][r]["wall_s"] for r in REGIONS)
        print(
            f"  overlap: {v['label']}: exposed {share:.1%} of wall, round {v['transfer_s']:.2f} s "
            f"({v['took_s']:.0f} s)",
            flush=True,
        )
        return v

    why = available() if sz.wan else "--quick"
    if why is not None:
        res.setup.append(
            "**fs**: the mailbox is a directory on tmpfs and the four variants run at once: no transfer to hide, "
            f"the records and the regions' agreement only (no WAN: {why})."
        )
        if sz.wan:
            res.notes.append(f"WAN not available ({why}): fs mailbox, the goals not judged.")
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda v: show(_variant(work, data, cfg, sz, v, None)), sz.variants))
    w = Wan(rate_mbit=sz.wan_mbit, rtt_ms=sz.wan_rtt_ms, window_kb=sz.wan_window_kb)
    res.setup.append(
        f"**WAN**: the regions run in one network namespace, the S3 store (nanio) in another behind a veth "
        f"pair: {w.describe()} (bench/wan.py). Both regions share the link, as two sites share one object "
        "store's. The variants run one after the other."
    )
    out = []
    with w, s3_behind(w, work, "overlap") as (t, env):
        for v in sz.variants:
            out.append(show(_variant(work, data, cfg, sz, v, t, w.exec_prefix(), env)))
    return out


def run(out_dir: Path, quick: bool = False, subset: str | None = None) -> Result:
    if subset is not None and subset not in SUBSETS:
        raise ValueError(f"overlap: no subset {subset!r} (known: {', '.join(SUBSETS)})")
    sz = SUBSETS[subset] if subset is not None and not quick else QUICK if quick else FULL
    res = Result(
        "overlap",
        "Overlapped rounds over the emulated WAN: exposed sync time, overlap none vs eager, bf16 vs int8 vs sparse",
        quick,
        subset=sz.subset,
    )
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-overlap-", dir=shm if shm.is_dir() else None))
    try:
        data = work / "data"
        prepare(data, REGIONS, "python-stdlib", DATA_BYTES)
        vs = _run_variants(work, data, sz, res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(res, sz, vs, wan=sz.wan and available() is None)
    _plot(res, out_dir, vs)
    return res


def _share(v: dict, region: str) -> float:
    f = v["regions"][region]
    return f["exposed_s"] / f["wall_s"]


def _report(res: Result, sz: Sizes, vs: list[dict], wan: bool) -> None:
    m = sz.model
    numel = next(v["bytes_up"] for v in vs if v["dtype"] == "bf16") / 2
    res.setup += [
        f"2 regions (a, b), each one process of the real trainer (`python -m sbatch_gen.testing.faults`: "
        "`sbatch_gen.train` with the per-step sleep installed from outside; gloo, CPU, one "
        f"thread), a {m['n_layers']}-layer width-{m['d_model']} GPT ({numel / 1e6:.2f}M parameters: bf16's bytes "
        f"per round / 2), batch {sz.batch} x {m['seq_len']} tokens, "
        f"DiLoCo H={sz.h}, {sz.rounds} rounds ({sz.h * sz.rounds} steps), strict rounds (min_regions all), outer "
        f"lr {OUTER_LR:g}, momentum {OUTER_MOMENTUM:g}; a per-step sleep of {sz.sleep_s:g} s "
        f"(`{ENV_STEP_SLEEP}`) stands in for a faster device's compute. One run per variant: "
        f"{'; '.join(v.label for v in sz.variants)}; the same steps, data and seed. Streaming: "
        "`fragments` F, `fragment_delay_steps` tau, `fragment_alpha` "
        f"{CrossRegion.model_fields['fragment_alpha'].default:g}; a round every floor(H/F) steps or so, one "
        "fragment each. CrossRegion defaults otherwise (16 MiB shards, 16 threads, raw).",
        "Exposed: the sum of `xr_exposed_s` over every record that has it: the step records of the round "
        "boundaries (none: the whole round; eager: the wait for the round in flight plus the boundary's own "
        "work, encoding and applying the fresh delta; streaming: a round's start, its delta and encoding, and "
        "tau steps later its merge, the wait for its exchange plus the outer step and the merge) and, with "
        "eager or a streaming tau above 0, the `xr_final_round` event (after the last step the trainer waits "
        "for the round still in flight: the run's end counts). Wall: the sum of the steps' "
        "`step_time_s` (the rounds, the final join and the first step's warm-up included; start-up and the "
        "final checkpoint left out). Share = exposed / wall, per region.",
        "Round: `xr_total_s`, the round's own duration (publish, wait, fetch, average; with eager in the "
        "background thread). Transfer: per round the smaller of the two regions' `xr_total_s` (the region "
        "that arrived last, so no wait for the other's compute), median over the rounds. H x step: H times "
        "the median step time of the steps without a round boundary (step 1 left out).",
        "Same model: a's and b's exported `model.safetensors` hold the same tensor table and the same data bytes "
        "(the header's `__metadata__` is left out: safetensors writes its keys in an order that differs from "
        "process to process).",
    ]
    if sz.subset is not None:
        res.setup.append(
            f"Subset `{sz.subset}` (`python -m bench overlap --subset {sz.subset}`): only the variants above, of "
            "the full run's none / eager x bf16 / int8 / sparse 1% and its streaming variants."
        )
    if any(v.dtype == "sparse" for v in sz.variants):
        res.setup.append(
            f"Sparse (issue 43): `payload_dtype: sparse`, `sparse_density` {SPARSE_DENSITY:g} (1% of each chunk), "
            f"`sparse_chunk` {CrossRegion.model_fields['sparse_chunk'].default} and `sparse_beta` "
            f"{CrossRegion.model_fields['sparse_beta'].default:g} (the defaults), outer lr {OUTER_LR:g} and "
            f"momentum {OUTER_MOMENTUM:g} as the others: the same rounds with about 1/100 of bf16's bytes, against "
            "bf16 at the same overlap (round time, exposed share, bytes, the regions' agreement; its held-out loss "
            "is bench sparse's)."
        )
    by = {v["label"]: v for v in vs}
    rows = []
    for v in vs:
        a, b = v["regions"]["a"], v["regions"]["b"]
        hstep = _hstep(v, sz)
        rows.append(
            [
                v["overlap"],
                v["variant"].payload,
                f"{_share(v, 'a'):.2%}",
                f"{_share(v, 'b'):.2%}",
                statistics.mean([a["exposed_s"], b["exposed_s"]]),
                statistics.mean([a["exposed_final_s"], b["exposed_final_s"]]),
                statistics.mean([a["wall_s"], b["wall_s"]]),
                statistics.mean(a["round_s"] + b["round_s"]),
                v["transfer_s"],
                hstep,
                f"{v['transfer_s'] / hstep:.2f}",
                v["bytes_up"],
                v["same"],
            ]
        )
    res.table(
        f"Exposed sync time per variant ({sz.rounds} rounds of H={sz.h}; a and b, or their mean)",
        [
            "overlap",
            "payload",
            "exposed / wall, a",
            "exposed / wall, b",
            "exposed s",
            "of which final round s",
            "wall s",
            "round s (mean xr_total_s)",
            "transfer s",
            "H x step s",
            "transfer / (H x step)",
            "bytes up per round",
            "a == b tensors (bitwise)",
        ],
        rows,
        "variants",
    )
    _sparse_table(res, by)
    res.table(
        "Exposed seconds per round boundary, in order (eager: the last is the xr_final_round event)",
        [
            "variant",
            "region",
            "exposed s per boundary",
            "join s (eager)",
            "snapshots (round: upload s, the end's wait s)",
        ],
        [
            [
                v["label"],
                r,
                ", ".join(f"{x:.3f}" for x in v["regions"][r]["exposed_each"]),
                ", ".join(f"{x:.3f}" for x in v["regions"][r]["join_s"]) or "-",
                ", ".join(
                    f"{rd}: {x:.3f}" + (f", {w:.3f}" if w is not None else "")
                    for rd, x, w in v["regions"][r]["snapshots"]
                )
                or "-",
            ]
            for v in vs
            if v["overlap"] != "streaming"
            for r in REGIONS
        ],
        "boundaries",
    )

    res.table(
        "Where the exposed time went, per region (seconds, and share of that region's wall time)",
        [
            "variant",
            "region",
            "exposed s",
            "final round's join s",
            "waits for the round in flight s",
            "the rest s (none: the rounds; eager: boundary work)",
            "boundary work s per boundary (median)",
            "outer step + cleanup s per round (median)",
            "exposed / wall",
            "without the final join / wall",
        ],
        [
            [
                v["label"],
                r,
                f["exposed_s"],
                pt["final"],
                pt["wait"],
                pt["rest"],
                median(_boundary_work(f, v["variant"].final_join)),
                median(f["outer_cleanup_s"]),
                f"{f['exposed_s'] / f['wall_s']:.2%}",
                f"{(f['exposed_s'] - pt['final']) / f['wall_s']:.2%}",
            ]
            for v in vs
            for r in REGIONS
            for f in [v["regions"][r]]
            for pt in [_parts(f, v["variant"].final_join)]
        ],
        "parts",
    )

    stream = [v for v in vs if v["overlap"] == "streaming"]
    if stream:
        res.table(
            "Streaming: exposed time against tau (F fragments; per region the worse, a or b)",
            [
                "variant",
                "F",
                "tau",
                "exposed / wall (end included)",
                "exposed ms per step",
                "round start ms (median)",
                "merge ms (median: wait + merge)",
                "final join s",
                "rounds",
                "round s (median transfer)",
                "largest round bytes up",
                "bytes up per region, whole run",
                "a == b tensors (bitwise)",
            ],
            [
                [
                    v["label"],
                    v["frags"],
                    v["tau"],
                    f"{max(_share(v, r) for r in REGIONS):.2%}",
                    max(f["exposed_s"] / f["steps"] for f in v["regions"].values()) * 1e3,
                    max(median(f["start_each"] or [0.0]) for f in v["regions"].values()) * 1e3,
                    max(median(f["merge_each"] or [0.0]) for f in v["regions"].values()) * 1e3,
                    max(f["exposed_final_s"] for f in v["regions"].values()),
                    len(v["regions"]["a"]["round_s"]),
                    v["transfer_s"],
                    v["bytes_up"],
                    v["bytes_up_total"],
                    v["same"],
                ]
                for v in stream
            ],
            "streaming",
        )
        res.table(
            f"Streaming: the merges that waited over {MERGE_WAIT_S:g} s for their round's exchange, and the "
            "snapshots each region uploaded meanwhile (theta_outer + momentum, fp32, every snapshot_every "
            "rounds, by the round's first member, in the background)",
            [
                "variant",
                "region",
                "merge waits s, all rounds",
                f"merges waiting over {MERGE_WAIT_S:g} s (round: wait s)",
                "snapshots (round: upload s)",
            ],
            [
                [
                    v["label"],
                    r,
                    sum(w for _, w in f["merge_waits"]),
                    ", ".join(f"{rd}: {w:.2f}" for rd, w in f["merge_waits"] if w > MERGE_WAIT_S) or "-",
                    ", ".join(f"{rd}: {x:.2f}" for rd, x, _ in f["snapshots"]) or "-",
                ]
                for v in stream
                for r in REGIONS
                for f in [v["regions"][r]]
            ],
            "streaming_waits",
        )

    # goals
    dtypes = [
        d for d in dict.fromkeys(v.payload for v in sz.base) if f"none, {d}" in by and f"eager, {d}" in by
    ]
    for dtype in dtypes:
        e, n = by[f"eager, {dtype}"], by[f"none, {dtype}"]
        worse = max(REGIONS, key=lambda r: _share(e, r))
        f = e["regions"][worse]
        pt = {k: x / f["wall_s"] for k, x in _parts(f, True).items()}
        es, ns = _share(e, worse), max(_share(n, r) for r in REGIONS)
        res.goal(
            f"{dtype}: exposed sync time with eager at most {GOAL_SHARE:.0%} of wall time, where none shows the "
            "full transfer",
            f"eager {es:.2%} (region {worse}: final round's join {pt['final']:.2%}, waits for the round in flight "
            f"{pt['wait']:.2%}, boundary work {pt['rest']:.2%}); none "
            f"{ns:.2%}; transfer / (H x step) {n['transfer_s'] / _hstep(n, sz):.2f}",
            None if (res.quick or not wan) else es <= GOAL_SHARE,
        )
        mine = [v for v in stream if v["variant"].payload == dtype]
        if mine:
            n = by[f"none, {dtype}"]
            top = min(mine, key=lambda v: max(_share(v, r) for r in REGIONS))
            share = max(_share(top, r) for r in REGIONS)
            res.goal(
                f"{dtype}: exposed sync time with streaming at most {GOAL_STREAMING:.0%} of wall time, the run's "
                "end included, where none shows the full transfer",
                f"best {top['label']} {share:.2%} (its final join "
                f"{max(f['exposed_final_s'] / f['wall_s'] for f in top['regions'].values()):.2%}); "
                + ", ".join(f"{v['label']} {max(_share(v, r) for r in REGIONS):.2%}" for v in mine)
                + f"; none {max(_share(n, r) for r in REGIONS):.2%}",
                None if (res.quick or not wan) else share <= GOAL_STREAMING,
            )
    want, limit = GOAL_F4_TAU2
    if want.label in by and "none, bf16" in by:
        v, n = by[want.label], by["none, bf16"]
        share = max(_share(v, r) for r in REGIONS)
        res.goal(
            f"{want.label}: exposed sync time at most {limit:.0%} of wall time, the run's end included (issue 40)",
            f"{share:.2%} (final join {max(f['exposed_final_s'] / f['wall_s'] for f in v['regions'].values()):.2%}"
            f", waits and merges the rest); none {max(_share(n, r) for r in REGIONS):.2%}",
            None if (res.quick or not wan) else share <= limit,
        )
    res.goal(
        "both regions end with bit-identical model.safetensors tensors, every variant",
        ", ".join(f"{v['label']}: {'yes' if v['same'] else 'NO'}" for v in vs),
        all(v["same"] for v in vs),
    )

    # headline
    for v in vs:
        res.headline[f"exposed sync / wall, {v['label']}"] = f"{max(_share(v, r) for r in REGIONS):.2%}" + (
            f" ({_steady(v):.2%} without the final join)" if v["variant"].final_join else ""
        )
    for dtype in dtypes:
        n = by[f"none, {dtype}"]
        res.headline[f"transfer / (H x step), {dtype}"] = (
            f"{n['transfer_s'] / _hstep(n, sz):.2f} ({n['transfer_s']:.2f} s / {_hstep(n, sz):.2f} s)"
        )

    # notes
    # (variant, region, round, upload s, the end's wait s, the boundary it started at, that boundary's own
    # work s, the other region's most exposed s over the next two boundaries, that region's median exposed s)
    snaps = []
    for v in vs:
        if v["overlap"] == "streaming":  # a boundary per round start and merge: see the streaming table
            continue
        eager = v["overlap"] == "eager"
        for r in REGIONS:
            for rd, x, w in v["regions"][r]["snapshots"]:
                i = rd + (1 if eager else 0)  # eager: snapshot rd starts where round rd is joined
                own = _own_work(v["regions"][r])
                snaps.append(
                    (v["label"], r, rd, x, w, i, own[i - 1] if i <= len(own) else 0.0, *_next(v, r, i))
                )
    for dtype in dtypes:
        e, n = by[f"eager, {dtype}"], by[f"none, {dtype}"]
        ew = {r: e["regions"][r]["wall_s"] for r in REGIONS}
        nw = {r: n["regions"][r]["wall_s"] for r in REGIONS}
        work = [x for r in REGIONS for x in _boundary_work(e["regions"][r], True)]
        fin = {r: e["regions"][r]["exposed_final_s"] for r in REGIONS}
        top = []  # per region: the boundary with the most own work (the final event included)
        for r in REGIONS:
            own = _own_work(e["regions"][r])
            i = max(range(len(own)), key=own.__getitem__)
            top.append(f"{r} {'final' if i == len(own) - 1 else f'boundary {i + 1}'} {own[i]:.2f} s")
        res.notes.append(
            f"{dtype}: eager trains the same steps in {statistics.mean(ew.values()):.1f} s against none's "
            f"{statistics.mean(nw.values()):.1f} s (mean of a and b); exposed sync goes from "
            f"{statistics.mean(n['regions'][r]['exposed_s'] for r in REGIONS):.1f} s to "
            f"{statistics.mean(e['regions'][r]['exposed_s'] for r in REGIONS):.1f} s. What stays exposed with "
            f"eager: the final round's join ({fin['a']:.2f} s in a, {fin['b']:.2f} s in b; after the last step "
            "nothing is left to train while the last round crosses, so one whole round per run stays exposed "
            f"whatever the overlap, its share shrinking as 1 / rounds); the boundary's own work, median "
            f"{median(work):.3f} s per boundary (the fresh delta, its encode and decode, the outer step, the "
            "start of the housekeeping (snapshot upload, mailbox cleanup: in the background), the scatter; the "
            "most, the "
            f"final event's included: {', '.join(top)}), all in the foreground; the waits for the round in flight"
            + (" (see the snapshots, next note)." if snaps else ".")
        )
    if snaps:
        res.notes.append(
            "Every snapshot_every rounds (default 10) the round's first member uploads a snapshot of the outer "
            "state (theta_outer + momentum, fp32: 8 B per parameter, 4x a bf16 round's payload) in the "
            "background: at the boundary a thread of its leaders copies the state to host memory and uploads "
            "it, 2 shards at a time, while training and the next rounds go on, sharing the link with them. Per snapshot (variant, region, round: the upload's seconds; the "
            "end's wait for it; the boundary it started at and that boundary's own work, exposed minus the "
            "join; the other region's most exposed seconds over the next two boundaries, against its median): "
            + "; ".join(
                f"{lbl}, {r}, round {rd}: {x:.2f} s; "
                + (f"end wait {w:.2f} s" if w is not None else "no end wait")
                + f"; boundary {i}: {e:.2f} s; {o:.2f} s against {med:.2f} s"
                for lbl, r, rd, x, w, i, e, o, med in snaps
            )
            + ". The mailbox deletes a round's objects only once a complete snapshot covers it (keep_rounds 1 "
            "here), so the cleanup after a snapshot deletes every round since the previous one: in the same "
            "background job, after the upload."
        )
    if "none, int8" not in by or "none, bf16" not in by:
        return
    bf, i8 = by["none, bf16"], by["none, int8"]
    res.notes.append(
        f"int8 sends {i8['bytes_up'] / bf['bytes_up']:.4f} of bf16's bytes per round; its round (none) takes "
        f"{i8['transfer_s']:.2f} s against bf16's {bf['transfer_s']:.2f} s (transfer / (H x step) "
        f"{i8['transfer_s'] / _hstep(i8, sz):.2f} against {bf['transfer_s'] / _hstep(bf, sz):.2f}). The variants "
        f"run {'one after the other' if wan else 'at once'} on 2 cores that other work shares, so the step time "
        "(H x step column) varies between them by that load; exposed time is compared as a share of each "
        "variant's own wall time."
    )


def _sparse_table(res: Result, by: dict[str, dict]) -> None:
    """Sparse against bf16 at the same overlap: round time, transfer, exposed share (the worse region), bytes,
    the regions' agreement; and the ratios to the headline."""
    rows = []
    for overlap in ("none", "eager"):
        bf = by.get(f"{overlap}, bf16")
        sp = [v for label, v in by.items() if label.startswith(f"{overlap}, sparse")]
        if bf is None:
            continue
        for v in sp:
            shares = [max(_share(x, r) for r in REGIONS) for x in (v, bf)]
            rounds = [
                statistics.mean(x["regions"]["a"]["round_s"] + x["regions"]["b"]["round_s"]) for x in (v, bf)
            ]
            rows.append(
                [
                    v["label"],
                    f"{v['bytes_up']} / {bf['bytes_up']} (1/{bf['bytes_up'] / v['bytes_up']:.0f})",
                    f"{rounds[0]:.3f} / {rounds[1]:.3f} ({rounds[0] / rounds[1]:.2f})",
                    f"{v['transfer_s']:.3f} / {bf['transfer_s']:.3f} ({v['transfer_s'] / bf['transfer_s']:.2f})",
                    f"{shares[0]:.2%} / {shares[1]:.2%} ({shares[0] / shares[1]:.2f})",
                    f"{_steady(v):.2%} / {_steady(bf):.2%}",
                    "yes" if v["same"] else "NO",
                ]
            )
            res.headline[f"{v['label']} vs {overlap}, bf16: transfer, exposed share"] = (
                f"{v['transfer_s']:.2f} s vs {bf['transfer_s']:.2f} s; {shares[0]:.2%} vs {shares[1]:.2%}"
            )
    if rows:
        res.table(
            "Sparse against bf16 at the same overlap (sparse / bf16 (ratio); exposed share: the worse region)",
            [
                "variant",
                "bytes up per round",
                "round s (mean xr_total_s)",
                "transfer s",
                "exposed / wall, end included",
                "exposed / wall without the final join",
                "a == b tensors (bitwise)",
            ],
            rows,
            "sparse",
        )


def _parts(f: dict, eager: bool) -> dict[str, float]:
    """Where one region's exposed seconds went: the final round's join (eager), the waits for the round in
    flight at the other boundaries (eager), and the rest (none: the rounds; eager: the boundary's own work:
    the fresh delta, its encode and decode, the outer step, the mailbox cleanup, the scatter, and whatever
    else the trainer does there, a snapshot upload included when it runs in the foreground). They add up."""
    n = len(f["exposed_each"]) - (1 if eager else 0)  # boundaries before the final join
    final = f["exposed_final_s"]
    wait = sum(f["wait_each"][:n]) if eager else 0.0
    return {"final": final, "wait": wait, "rest": f["exposed_s"] - final - wait}


def _boundary_work(f: dict, eager: bool) -> list[float]:
    """Per boundary before the final join: exposed minus the wait for the round in flight."""
    n = len(f["exposed_each"]) - (1 if eager else 0)
    return [e - w for e, w in zip(f["exposed_each"][:n], f["wait_each"][:n], strict=True)]


def _own_work(f: dict) -> list[float]:
    """Per boundary, the final event included: exposed minus the wait for the round in flight."""
    return [e - w for e, w in zip(f["exposed_each"], f["wait_each"], strict=True)]


def _next(v: dict, region: str, i: int) -> tuple[float, float]:
    """The other region's most exposed seconds at boundaries i+1, i+2 (1-based i; the final event counts),
    and its median exposed seconds per boundary."""
    other = v["regions"][next(r for r in REGIONS if r != region)]["exposed_each"]
    return max(other[i : i + 2], default=0.0), median(other)


def _hstep(v: dict, sz: Sizes) -> float:
    """H x the step time without a round (mean of the two regions' medians)."""
    return sz.h * statistics.mean(v["regions"][r]["inner_step_s"] for r in REGIONS)


def _steady(v: dict) -> float:
    """The worse region's exposed share without the final round's join (eager's xr_final_round)."""
    return max(
        (v["regions"][r]["exposed_s"] - v["regions"][r]["exposed_final_s"]) / v["regions"][r]["wall_s"]
        for r in REGIONS
    )


def _plot(res: Result, out_dir: Path, vs: list[dict]) -> None:
    from .common import plt, save_fig

    p = plt()
    fig, ax = p.subplots(1, 1, figsize=(7, 4), layout="constrained")
    labels = [v["label"].replace(", ", "\n") for v in vs]
    exposed = [v["regions"]["a"]["exposed_s"] for v in vs]
    train = [v["regions"]["a"]["wall_s"] - x for v, x in zip(vs, exposed, strict=True)]
    ax.bar(labels, train, label="training (steps)")
    ax.bar(labels, exposed, bottom=train, label="exposed sync")
    for i, v in enumerate(vs):
        ax.text(i, v["regions"]["a"]["wall_s"], f"{_share(v, 'a'):.1%}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("s (region a)")
    ax.set_title("wall time: training vs exposed sync")
    ax.legend(fontsize=7)
    save_fig(fig, out_dir / "overlap.png")
    res.plots.append(
        ("overlap.png", "Region a's wall time per variant: training steps and exposed sync time")
    )
