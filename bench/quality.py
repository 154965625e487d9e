"""Benchmark: DiLoCo quality on held-out data (issue 16 item 3): H = 10 / 50 / 100, an outer lr x momentum
sweep per H, grad mode (the data-parallel reference), one region alone, payload bf16 / int8 / fp8 / int4
and overlap none / eager, side by side in one run.

Every variant: two regions (a, b), each one process of the real trainer (``python -m sbatch_gen.train``,
:func:`.regionruns.launch_region`), meeting only in an fs mailbox, strict rounds (every round has both regions), the
same seed, data and number of steps (so the same tokens). The final model's loss on a held-out shard neither
region trained on (:func:`.finalmodel.heldout_loss`), and the same loss on the periodic checkpoints (held-out
loss against tokens); from the regions' metrics.jsonl the bytes crossing per round (``xr_bytes_up + down``,
for loss against bytes) and the time a round held training up (``xr_exposed_s``).

Phase 1 runs grad mode, one region alone and the lr x momentum grid for every H; phase 2 runs the same grid
with ``overlap: eager`` (eager is compared at its own best grid point: the delay may want other outer
hyper-parameters), the same grid with ``overlap: streaming`` for every fragment count F and delay tau of the
sweep at the H of ``stream_hs`` (each (F, tau) compared at its own best grid point), and the best (lowest
held-out loss) grid point of ``payload_h`` with int8, fp8 and int4 payloads.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from sbatch_gen.train.data import prepare
from sbatch_gen.xr_options import CrossRegion

from .common import Result, fmt
from .finalmodel import heldout_loss, same_params
from .regionruns import DATA_BYTES, HELDOUT, REGIONS, finish, launch_pair, launch_region, train_config
from .rundir import read_records

DEFAULT_LR, DEFAULT_MOMENTUM = 0.7, 0.9  # CrossRegion's defaults
PLAIN = (1.0, 0.0)  # plain averaging: every region adopts the token-weighted mean each round
PAYLOADS = ("int8", "fp8", "int4")  # phase 2: the compressed payloads against bf16


@dataclass(frozen=True)
class Sizes:
    steps: int  # per region, every variant
    hs: tuple[int, ...]
    grid: tuple[tuple[float, float], ...]  # (outer lr, outer momentum) per H
    payload_h: int  # the H whose best grid point also runs with int8 and fp8
    model: dict
    batch: int
    warmup: int
    lr: float
    seed: int
    eval_windows: int
    evals: int  # held-out loss on this many evenly spaced checkpoints (the last: the final model)
    parallel: int  # variants at once (deterministic: changes only the wall time)
    stream_hs: tuple[int, ...] = ()  # overlap streaming: at these H
    stream_frags: tuple[int, ...] = ()  # ... with these fragment counts F
    stream_taus: tuple[int, ...] = (1, 5)  # ... and delays tau, plus the longest, floor(H/F) - 1

    def taus(self, h: int, f: int) -> list[int]:
        """The delays swept at (H, F): ``stream_taus`` and the longest one H/F allows, each below floor(H/F)."""
        return sorted({t for t in (*self.stream_taus, h // f - 1) if 0 <= t < h // f})


FULL = Sizes(
    steps=2000,
    hs=(10, 50, 100),
    grid=((DEFAULT_LR, DEFAULT_MOMENTUM), (0.4, 0.9), (1.0, 0.5), PLAIN, (0.7, 0.0)),
    payload_h=50,
    model={"n_layers": 1, "d_model": 64, "n_heads": 2, "seq_len": 64},
    batch=8,
    warmup=50,
    lr=3e-3,
    seed=1234,
    eval_windows=1024,
    evals=4,
    parallel=2,
    stream_hs=(50, 100),
    stream_frags=(2, 4),
)
QUICK = Sizes(
    steps=8,
    hs=(4,),
    grid=((DEFAULT_LR, DEFAULT_MOMENTUM), PLAIN),
    payload_h=4,
    model={"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16},
    batch=2,
    warmup=2,
    lr=3e-3,
    seed=1234,
    eval_windows=32,
    evals=2,
    parallel=4,
    stream_hs=(4,),
    stream_frags=(2,),
    stream_taus=(1,),
)


@dataclass(frozen=True)
class Variant:
    kind: str  # "diloco" | "grad" | "single" (one region alone, no cross-region sync)
    h: int = 0
    lr: float = PLAIN[0]
    momentum: float = PLAIN[1]
    dtype: str = "bf16"
    overlap: str = "none"
    frags: int = 1  # overlap streaming: F
    tau: int = 0  # overlap streaming: fragment_delay_steps
    density: float = 0.01  # payload sparse: sparse_density (bench/sparse.py)
    beta: float = 0.95  # payload sparse: sparse_beta

    @property
    def key(self) -> str:
        if self.kind != "diloco":
            return self.kind
        stream = f"-f{self.frags}-t{self.tau}" if self.overlap == "streaming" else ""
        sp = f"-d{self.density:g}-b{self.beta:g}" if self.dtype == "sparse" else ""
        return f"h{self.h}-lr{self.lr:g}-m{self.momentum:g}-{self.dtype}{sp}-{self.overlap}{stream}"

    @property
    def label(self) -> str:
        if self.kind == "grad":
            return "grad (every step)"
        if self.kind == "single":
            return "one region alone"
        over = {"none": "", "eager": ", eager", "streaming": f", streaming F={self.frags} tau={self.tau}"}
        dt = f"sparse {self.density:.1%} beta {self.beta:g}" if self.dtype == "sparse" else self.dtype
        extra = "".join([f", {dt}" if self.dtype != "bf16" else "", over[self.overlap]])
        return f"H={self.h}, lr {self.lr:g}, mom {self.momentum:g}{extra}"


def _launch_variant(work: Path, data: Path, cfg: Path, v: Variant) -> list:
    root = work / v.key
    if v.kind == "single":  # the trainer without cross-region sync, on region a's shard
        return [
            launch_region(
                CrossRegion(enabled=False, region="a", regions=["a"]),
                config=cfg,
                run_dir=root / "a",
                data=data / "a.bin",
                resume="none",
                log_dir=root / "logs",
            )
        ]
    return launch_pair(
        root,
        v.key,
        config=cfg,
        data=data,
        sync=v.kind,
        inner_steps=max(1, v.h),
        outer_lr=v.lr,
        outer_momentum=v.momentum,
        payload_dtype=v.dtype,
        overlap=v.overlap,
        **({"fragments": v.frags, "fragment_delay_steps": v.tau} if v.overlap == "streaming" else {}),
        **({"sparse_density": v.density, "sparse_beta": v.beta} if v.dtype == "sparse" else {}),
    )


def _checkpoint_model(ckpt: Path, model_cfg: dict, out: Path) -> Path:
    """The ``model`` subtree of a DCP checkpoint, written as safetensors (for :func:`heldout_loss`)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from sbatch_gen.train.config import ModelConfig
    from sbatch_gen.train.model import GPT

    model = GPT(ModelConfig(**model_cfg))
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    save_file(
        {k: v.detach().contiguous().clone() for k, v in state["model"].items()}, str(out)
    )  # tied: one copy each
    return out


def _variant(work: Path, data: Path, cfg: Path, sz: Sizes, v: Variant) -> dict:
    t0 = time.monotonic()
    runs = _launch_variant(work, data, cfg, v)
    finish(runs, v.key)
    wall = time.monotonic() - t0
    root = work / v.key
    regions = REGIONS if v.kind != "single" else ["a"]
    recs = {r: read_records(root / r) for r in regions}
    steps = {r: {x["step"]: x for x in recs[r] if "event" not in x and "step_time_s" in x} for r in regions}
    # a round's record: a step record with xr_round; with eager the last round is the xr_final_round event
    rounds = {
        r: [x for x in recs[r] if "xr_round" in x and ("event" not in x or x["event"] == "xr_final_round")]
        for r in regions
    }
    common = sorted(set.intersection(*[set(s) for s in steps.values()]))
    loss = [sum(steps[r][s]["loss"] for r in regions) / len(regions) for s in common]
    tokens = [sum(steps[r][s]["tokens"] for r in regions) for s in common]
    # cumulative bytes crossing (both regions, up + down) at each step, for loss against bytes
    per_step: dict[int, int] = {}
    for r in regions:
        for x in rounds[r]:
            s = x.get("step", common[-1] if common else 0)
            per_step[s] = per_step.get(s, 0) + x.get("xr_bytes_up", 0) + x.get("xr_bytes_down", 0)
    total, cum = 0, []
    for s in common:
        total += per_step.get(s, 0)
        cum.append(total)
    total = sum(per_step.values())
    # held-out loss on the periodic checkpoints of a (the last: the exported final model)
    model_cfg = {**sz.model, "dropout": 0.0}
    every = _ckpt_every(sz)
    curve = []
    for s in range(every, sz.steps, every):
        ck = root / "a" / "checkpoints" / f"step-{s}"
        if ck.is_dir():
            f = _checkpoint_model(ck, model_cfg, root / f"eval-{s}.safetensors")
            curve.append((s, heldout_loss(f, model_cfg, data / f"{HELDOUT}.bin", sz.eval_windows)))
    final = heldout_loss(
        root / "a" / "model.safetensors", model_cfg, data / f"{HELDOUT}.bin", sz.eval_windows
    )
    curve.append((sz.steps, final))
    tok_per_step = tokens[-1] / common[-1] if common else 0
    cum_at = dict(zip(common, cum, strict=True))
    # what the rounds held training up for: every record with xr_exposed_s (a round's start and its merge
    # are separate records with streaming), the worse region
    exposed = max(
        sum(
            x.get("xr_exposed_s", x.get("xr_total_s", 0.0))
            for x in recs[r]
            if "xr_exposed_s" in x or "xr_round" in x
        )
        for r in regions
    )
    # the most one round moves (region a, up + down): what crosses at once, or within its overlap window
    peak = max((x.get("xr_bytes_up", 0) + x.get("xr_bytes_down", 0) for x in rounds[regions[0]]), default=0)
    train_s = sum(x["step_time_s"] for x in steps["a"].values())
    out = {
        "key": v.key,
        "label": v.label,
        "kind": v.kind,
        "h": v.h,
        "lr": v.lr,
        "momentum": v.momentum,
        "dtype": v.dtype,
        "overlap": v.overlap,
        "frags": v.frags,
        "tau": v.tau,
        "peak_round_bytes": peak,
        "heldout": final,
        "curve": [[s, round(s * tok_per_step), cum_at.get(s, total), ls] for s, ls in curve],
        "train_loss_last": sum(loss[-50:]) / max(1, len(loss[-50:])),
        "steps": common,
        "loss": loss,
        "tokens": tokens,
        "bytes": cum,
        "bytes_total": total,
        "rounds": len(rounds["a"]),
        "exposed_s": exposed,
        "train_s": train_s,
        "wall_s": wall,
        "same": same_params(root / "a" / "model.safetensors", root / "b" / "model.safetensors")
        if v.kind != "single"
        else None,
    }
    return out


def _ckpt_every(sz: Sizes) -> int:
    return max(1, sz.steps // sz.evals)


def _run_all(work: Path, data: Path, cfg: Path, sz: Sizes, plan: list[Variant]) -> list[dict]:
    def one(v: Variant) -> dict:
        t0 = time.monotonic()
        r = _variant(work, data, cfg, sz, v)
        print(
            f"  quality: {v.label}: held-out {r['heldout']:.4f}, {r['rounds']} rounds "
            f"({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
        shutil.rmtree(work / v.key, ignore_errors=True)
        return r

    # deterministic (strict rounds, fixed seed, CPU), so running variants at once changes only the wall time
    with ThreadPoolExecutor(sz.parallel) as pool:
        return list(pool.map(one, plan))


def best_per_h(
    res: list[dict], hs: tuple[int, ...], overlap: str = "none", frags: int = 1, tau: int = 0
) -> dict[int, dict]:
    """The grid point with the lowest held-out loss per H (bf16, with this ``overlap``; streaming: with
    these ``frags`` and ``tau``)."""
    out = {}
    for h in hs:
        grid = [r for r in res if r["kind"] == "diloco" and r["h"] == h]
        grid = [r for r in grid if r["dtype"] == "bf16" and r["overlap"] == overlap]
        if overlap == "streaming":
            grid = [r for r in grid if r["frags"] == frags and r["tau"] == tau]
        if grid:
            out[h] = min(grid, key=lambda r: r["heldout"])
    return out


def stream_configs(sz: Sizes) -> list[tuple[int, int, int]]:
    """(H, F, tau) of the streaming sweep."""
    return [(h, f, t) for h in sz.stream_hs if h in sz.hs for f in sz.stream_frags for t in sz.taus(h, f)]


def run(out_dir: Path, quick: bool = False) -> Result:
    sz = QUICK if quick else FULL
    res = Result(
        "quality", "DiLoCo quality: held-out loss vs H, outer lr x momentum, payload, overlap", quick
    )
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-quality-", dir=shm if shm.is_dir() else None))
    try:
        data = work / "data"
        prepare(data, [*REGIONS, HELDOUT], "python-stdlib", DATA_BYTES)
        cfg = train_config(
            work / "quality.yaml",
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
        grid = [Variant("diloco", h, lr, m) for h in sz.hs for lr, m in sz.grid]
        # the long ones first (grad mode: a round every step), so the pool's tail is short
        phase1 = [Variant("grad"), *grid, Variant("single")]
        t0 = time.monotonic()
        first = _run_all(work, data, cfg, sz, phase1)
        best = best_per_h(first, sz.hs)
        b = best[sz.payload_h]
        stream = [
            Variant("diloco", h, lr, m, overlap="streaming", frags=f, tau=t)
            for h, f, t in stream_configs(sz)
            for lr, m in sz.grid
        ]
        phase2 = [*stream, *[replace(v, overlap="eager") for v in grid]]
        phase2 += [replace(_as_variant(b), dtype=d) for d in PAYLOADS]
        second = _run_all(work, data, cfg, sz, phase2)
        wall = time.monotonic() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(res, sz, first, second, best, wall)
    _plot(res, out_dir, first + second, sz)
    return res


def _keep_all(cfg: Path, keep: int) -> None:
    import yaml

    d = yaml.safe_load(cfg.read_text())
    d["checkpoint"]["keep_last"] = keep
    cfg.write_text(yaml.safe_dump(d, sort_keys=False))


def _as_variant(r: dict) -> Variant:
    return Variant(r["kind"], r["h"], r["lr"], r["momentum"], r["dtype"], r["overlap"], r["frags"], r["tau"])


def _l(x: float) -> str:
    """A loss as the tables show it (4 decimals: the gaps that matter are tenths of a percent)."""
    return f"{x:.4f}"


def _gap(x: float, ref: float) -> float:
    return x / ref - 1.0


def _report(res: Result, sz: Sizes, first: list[dict], second: list[dict], best: dict, wall: float) -> None:
    m = sz.model
    allv = first + second
    by = {r["key"]: r for r in allv}
    grad, single = by["grad"], by["single"]
    tok = grad["tokens"][-1] if grad["tokens"] else 0
    res.setup += [
        f"2 regions (a, b), each one process of the real trainer (`python -m sbatch_gen.train`, gloo, CPU), "
        f"fs mailbox on tmpfs, strict rounds (min_regions all): a {m['n_layers']}-layer width-{m['d_model']} GPT, "
        f"batch {sz.batch} x {m['seq_len']} byte tokens, {sz.steps} steps per region ({tok} tokens in all), "
        f"inner AdamW lr {sz.lr:g} (warm-up {sz.warmup}, cosine to lr/10), seed {sz.seed}: the same config, "
        "data and tokens in every two-region variant.",
        f"H in {{{', '.join(map(str, sz.hs))}}}: {', '.join(f'{sz.steps // h} rounds at H={h}' for h in sz.hs)}. "
        f"Outer grid per H (lr, momentum; Nesterov): {', '.join(f'({lr:g}, {mo:g})' for lr, mo in sz.grid)}: "
        f"the defaults ({DEFAULT_LR:g}, {DEFAULT_MOMENTUM:g}), plain averaging ({PLAIN[0]:g}, {PLAIN[1]:g}), a "
        "smaller lr under momentum (0.4, 0.9: the issue's better H=10 point), plain averaging's lr with half the "
        "momentum (1, 0.5), and the default lr without momentum: effective steps lr / (1 - momentum) of 7, 4, 2, 1 "
        "and 0.7; a full 3 x 2 lr x momentum grid per H did not fit the budget next to the other variants.",
        "grad: `sync: grad` (the gradients averaged across the regions every step, bf16): the data-parallel "
        "reference. One region alone: the trainer without cross-region sync on region a's shard, the same "
        "steps and batch (the same tokens per region, half the total): what the second region buys.",
        "Phase 2: the same grid with `overlap: eager` (compared at its own best grid point, and at no "
        "overlap's); the same grid with `overlap: streaming` (Streaming DiLoCo, `fragment_alpha` "
        f"{CrossRegion.model_fields['fragment_alpha'].default:g}) for every (H, F, tau) of "
        + ", ".join(f"({h}, {f}, {t})" for h, f, t in stream_configs(sz))
        + f" (tau: {', '.join(map(str, sz.stream_taus))} and the longest below floor(H/F); each compared at its "
        "own best grid point); from the "
        f"best grid point (lowest held-out loss) of H={sz.payload_h}: `payload_dtype` {', '.join(PAYLOADS)} "
        "(bf16 is the grid run itself).",
        f"Held-out loss: mean next-byte cross-entropy over {sz.eval_windows} fixed windows spread over the "
        f"`{HELDOUT}` shard (the stdlib source cut into a, b, {HELDOUT}; {DATA_BYTES / 1e6:g} MB), no region "
        "trains on it; of region a's final `model.safetensors` (b's checked bit-identical) and, for the curves, "
        f"of a's checkpoints every {_ckpt_every(sz)} steps (the `model` of the DCP checkpoint: region a's "
        "working model at that step).",
        "Bytes: cumulative `xr_bytes_up + xr_bytes_down` of both regions over the rounds (with eager and "
        "streaming the last round's `xr_final_round` event too); the one-off fp32 alignment round at the start "
        "is the same for every variant and not counted. Peak round: the most bytes one round of region a "
        "moves (up + down): without overlap all of it crosses while training waits, with eager during the next "
        "H steps, with streaming during the next tau steps. Exposed: the sum of `xr_exposed_s` over the "
        "records that have it (a streaming round's start and merge are two), the worse region (fs on tmpfs, "
        "both regions on the shared cores: mostly waiting for the other region; the WAN figure is item 4's).",
        f"Variants ran {sz.parallel} at a time on the shared cores (deterministic: no effect on the losses); "
        f"the whole sweep took {wall:.0f} s.",
    ]

    def row(r: dict, ref: dict | None) -> list:
        return [
            r["label"],
            r["rounds"],
            _l(r["heldout"]),
            f"{_gap(r['heldout'], grad['heldout']):+.2%}",
            f"{_gap(r['heldout'], ref['heldout']):+.2%}" if ref is not None and ref is not r else "-",
            f"{r['train_loss_last']:.3f}",
            r["bytes_total"] / 1e6,
            r["exposed_s"],
            fmt(r["same"]),
        ]

    headers = [
        "variant",
        "rounds",
        "held-out loss",
        "vs grad",
        "vs plain averaging (same H)",
        "train loss (mean of last 50 steps)",
        "MB crossed",
        "exposed sync s",
        "a, b identical",
    ]
    rows = [row(grad, None), row(single, None)]
    for h in sz.hs:
        plain = by[Variant("diloco", h, *PLAIN).key]
        for lr, mo in sz.grid:
            rows.append(row(by[Variant("diloco", h, lr, mo).key], plain))
    res.table("Held-out loss: the sweep (bf16, overlap none)", headers, rows, "sweep")

    # phase 2: eager vs none (each at its best grid point, and at none's), int8/fp8/int4 vs bf16
    beste = best_per_h(allv, sz.hs, "eager")
    rows2 = []

    def cmp(what: str, point: str, ref: dict, var: dict) -> list:
        return [
            what,
            point,
            _l(ref["heldout"]),
            _l(var["heldout"]),
            f"{_gap(var['heldout'], ref['heldout']):+.2%}",
        ]

    for h in sz.hs:
        b, e = best[h], beste[h]
        rows2.append(cmp(f"H={h}: eager vs none, each at its best", f"{e['label']} vs {b['label']}", b, e))
        same = by[replace(_as_variant(b), overlap="eager").key]
        if same is not e:
            rows2.append(cmp(f"H={h}: eager vs none, at none's best", b["label"], b, same))
    bp = best[sz.payload_h]
    for d in PAYLOADS:
        rows2.append(
            cmp(f"H={sz.payload_h}: {d} vs bf16", bp["label"], bp, by[replace(_as_variant(bp), dtype=d).key])
        )
    confs = stream_configs(sz)
    bests = {(h, f, t): best_per_h(allv, (h,), "streaming", f, t)[h] for h, f, t in confs}
    for (h, f, t), st in bests.items():
        rows2.append(
            cmp(
                f"H={h}: streaming F={f} tau={t} vs none, each at its best",
                f"{st['label']} vs {best[h]['label']}",
                best[h],
                st,
            )
        )
    res.table(
        "At the best outer lr x momentum per H: overlap and payload",
        ["comparison", "best grid point", "held-out (reference)", "held-out (variant)", "gap"],
        rows2,
        "best",
    )

    def pair(h: int, lr: float, mo: float) -> str:
        n = by[Variant("diloco", h, lr, mo).key]["heldout"]
        e = by[Variant("diloco", h, lr, mo, overlap="eager").key]["heldout"]
        return f"{_l(n)} / {_l(e)} / {_gap(e, n):+.2%}"

    res.table(
        "eager against no overlap at every grid point (held-out loss, bf16)",
        ["outer lr, momentum", *[f"H={h}: none / eager / gap" for h in sz.hs]],
        [[f"lr {lr:g}, momentum {mo:g}", *[pair(h, lr, mo) for h in sz.hs]] for lr, mo in sz.grid],
        "eager_grid",
    )
    if confs:
        srows = []
        for (h, f, t), st in bests.items():
            none, eag = best[h], beste[h]
            srows.append(
                [
                    h,
                    f,
                    t,
                    f"lr {st['lr']:g}, momentum {st['momentum']:g}",
                    _l(st["heldout"]),
                    f"{_gap(st['heldout'], none['heldout']):+.2%}",
                    f"{_gap(st['heldout'], eag['heldout']):+.2%}",
                    st["rounds"],
                    st["bytes_total"] / 1e6,
                    st["peak_round_bytes"] / 1e6,
                    f"{st['peak_round_bytes'] / none['peak_round_bytes']:.3f}",
                    st["peak_round_bytes"] / max(t, 1) / 1e6,
                ]
            )
        res.table(
            "Streaming DiLoCo (bf16) at its best outer lr x momentum per (H, F, tau), against no overlap and "
            "eager at theirs",
            [
                "H",
                "F",
                "tau",
                "best grid point",
                "held-out loss",
                "vs none (best)",
                "vs eager (best)",
                "rounds",
                "MB crossed",
                "peak round MB",
                "peak round / none's",
                "MB per step to hide it (peak / tau)",
            ],
            srows,
            "streaming",
        )

        def cell(h: int, f: int, t: int, lr: float, mo: float) -> str:
            x = by[Variant("diloco", h, lr, mo, overlap="streaming", frags=f, tau=t).key]["heldout"]
            return f"{_l(x)} ({_gap(x, by[Variant('diloco', h, lr, mo).key]['heldout']):+.2%})"

        res.table(
            "Streaming at every grid point (held-out loss, and its gap to no overlap at the same point)",
            ["outer lr, momentum", *[f"H={h} F={f} tau={t}" for h, f, t in confs]],
            [
                [f"lr {lr:g}, momentum {mo:g}", *[cell(h, f, t, lr, mo) for h, f, t in confs]]
                for lr, mo in sz.grid
            ],
            "streaming_grid",
        )
    # the curves: grad, one region, and the best grid point of each overlap (and F, tau) per H, the payloads
    shown = {"grad", "single"} | {
        r["key"] for o in ("none", "eager") for r in best_per_h(allv, sz.hs, o).values()
    }
    shown |= {st["key"] for st in bests.values()}
    shown |= {replace(_as_variant(bp), dtype=d).key for d in PAYLOADS}
    rows3 = []
    for r in allv:
        if r["kind"] == "single" or r["key"] not in shown:
            continue
        for s, t, bts, ls in r["curve"]:
            rows3.append([r["label"], s, t, bts / 1e6, _l(ls)])
    res.table(
        "Held-out loss against tokens and bytes (region a's checkpoints; the last row of each: the final "
        "model), for grad mode, each overlap's (and each streaming F and tau's) best grid point per H and the "
        "payloads",
        ["variant", "step", "tokens (both regions)", "MB crossed so far", "held-out loss"],
        rows3,
        "curves",
    )

    # goals
    g50 = best.get(50) or best[sz.payload_h]
    gap = _gap(g50["heldout"], grad["heldout"])
    res.goal(
        f"DiLoCo H={g50['h']} (bf16, no overlap) at its best outer lr within 2% of grad mode",
        f"{g50['heldout']:.4f} ({g50['label']}) vs {grad['heldout']:.4f}: {gap:+.2%}",
        None if res.quick else gap <= 0.02,
    )
    egaps = {h: _gap(beste[h]["heldout"], best[h]["heldout"]) for h in sz.hs}
    res.goal(
        "eager within +1% of no overlap (held-out, each at its best outer lr x momentum per H)",
        ", ".join(f"H={h} {g:+.2%}" for h, g in egaps.items()),
        None if res.quick else max(egaps.values()) <= 0.01,
    )
    if confs:
        sg = {c: _gap(st["heldout"], best[c[0]]["heldout"]) for c, st in bests.items()}
        res.goal(
            "streaming within +1% of no overlap (held-out, each at its best outer lr x momentum, same H)",
            ", ".join(f"H={h} F={f} tau={t} {g:+.2%}" for (h, f, t), g in sg.items()),
            None if res.quick else max(sg.values()) <= 0.01,
        )
        ratios = {
            f: max(
                st["peak_round_bytes"] / best[h]["peak_round_bytes"]
                for (h, ff, _), st in bests.items()
                if ff == f
            )
            for f in sz.stream_frags
        }
        res.goal(
            "streaming: the peak bytes of one round about 1/F of no overlap's (within 25%)",
            ", ".join(f"F={f}: {r:.3f} (1/F = {1 / f:.3f})" for f, r in ratios.items()),
            None if res.quick else all(r <= 1.25 / f for f, r in ratios.items()),
        )
    q8 = by[replace(_as_variant(bp), dtype="int8").key]
    g8 = _gap(q8["heldout"], bp["heldout"])
    res.goal(
        f"int8 within +0.5% of bf16 (held-out, H={sz.payload_h}, best lr)",
        f"{q8['heldout']:.4f} vs {bp['heldout']:.4f}: {g8:+.2%}",
        None if res.quick else g8 <= 0.005,
    )

    # which settings are never worse than plain averaging
    never = []
    for lr, mo in sz.grid:
        if (lr, mo) == PLAIN:
            continue
        gaps = {
            h: _gap(
                by[Variant("diloco", h, lr, mo).key]["heldout"],
                by[Variant("diloco", h, *PLAIN).key]["heldout"],
            )
            for h in sz.hs
        }
        ok = all(g <= 0 for g in gaps.values())
        never.append([f"lr {lr:g}, momentum {mo:g}", *[f"{gaps[h]:+.2%}" for h in sz.hs], fmt(ok)])
    res.table(
        "Held-out loss of each grid point relative to plain averaging (lr 1, momentum 0) at the same H",
        ["outer lr, momentum", *[f"H={h}" for h in sz.hs], "never worse than plain"],
        never,
        "vs_plain",
    )
    res.headline["grad mode held-out loss"] = f"{grad['heldout']:.4f}"
    for h in sz.hs:
        res.headline[f"H={h} best: {best[h]['label']}"] = (
            f"{best[h]['heldout']:.4f} ({_gap(best[h]['heldout'], grad['heldout']):+.2%} vs grad)"
        )
    for (h, _f, _t), st in bests.items():
        if st is min((x for (hh, _, _), x in bests.items() if hh == h), key=lambda x: x["heldout"]):
            res.headline[f"H={h} streaming best: {st['label']}"] = (
                f"{st['heldout']:.4f} ({_gap(st['heldout'], best[h]['heldout']):+.2%} vs none)"
            )
    gain = single["heldout"] - grad["heldout"]
    if gain > 0:
        share = ", ".join(f"H={h} {(single['heldout'] - best[h]['heldout']) / gain:.0%}" for h in sz.hs)
        res.notes.append(
            f"What the second region buys: one region alone ends {_gap(single['heldout'], grad['heldout']):+.2%} "
            f"above grad mode ({_l(single['heldout'])} vs {_l(grad['heldout'])}); DiLoCo at the best grid point "
            f"of each H recovers this share of that gap: {share}."
        )
    res.notes.append(
        "exposed sync s is the fs mailbox on tmpfs with both regions on the same 2 shared cores: mostly one "
        "region waiting for the other's compute, not transfer; it says nothing about the WAN (item 4)."
    )
    for r in allv:
        if r["same"] is False:
            res.notes.append(f"{r['label']}: regions a and b ended on different parameters")


def _plot(res: Result, out_dir: Path, allv: list[dict], sz: Sizes) -> None:
    from .common import plt, save_fig

    p = plt()
    fig, (a, b) = p.subplots(1, 2, figsize=(12, 4.5))
    keys = {"grad", "single"} | {
        r["key"] for o in ("none", "eager") for r in best_per_h(allv, sz.hs, o).values()
    }
    streaming: dict[tuple[int, int], dict] = {}  # the best streaming run per (H, F), over tau and the grid
    for r in allv:
        if r["overlap"] == "streaming" and r["dtype"] == "bf16":
            k = (r["h"], r["frags"])
            if k not in streaming or r["heldout"] < streaming[k]["heldout"]:
                streaming[k] = r
    keys |= {r["key"] for r in streaming.values()}
    for r in allv:
        if r["key"] not in keys:
            continue
        c = r["curve"]
        a.plot([x[1] for x in c], [x[3] for x in c], marker="o", label=r["label"])
        if r["bytes_total"]:
            b.plot([max(x[2], 1) / 1e6 for x in c], [x[3] for x in c], marker="o", label=r["label"])
    a.set_xlabel("tokens (all regions)")
    a.set_ylabel("held-out loss")
    a.set_title("held-out loss vs tokens")
    a.legend(fontsize=7)
    b.set_xscale("log")
    b.set_xlabel("MB crossed between regions (cumulative, log)")
    b.set_ylabel("held-out loss")
    b.set_title("held-out loss vs bytes")
    b.legend(fontsize=7)
    save_fig(fig, out_dir / "quality.png")
    res.plots.append(
        (
            "quality.png",
            "Held-out loss vs tokens (left) and vs bytes crossed (right): grad, one region, the best grid point "
            "per H without overlap and with eager, and the best streaming run per H and F",
        )
    )
