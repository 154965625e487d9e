"""Benchmark: DiLoCo regions sharded with FSDP2 against DDP regions at the same model size (issue 30, item 3,
measured on this machine's CPUs): the outer state each rank holds, each rank's peak RSS, and the round's
time by phase.

The real trainer, two regions over an fs mailbox, each region its own ``torchrun`` of CPU ranks (gloo), one
model. Variants, run in turn and repeated with the order rotated each time (so a slow spell of the shared
machine does not land on one variant): both regions DDP over 2 ranks (the leader, rank 0, holds the whole
outer state and moves the whole payload, then broadcasts the outer step to rank 1); both FSDP over 2 ranks
(each rank holds the outer state of its own shards and moves only them); and FSDP over 2 beside DDP over 1
(regions of different shapes). Per run, from region ``a``'s own files: the outer state each rank holds (the
``xr_outer_state`` event: the bytes of the flat buffers each rank's sync allocated), the round phases of
rank 0's records (``xr_upload_s`` ... ``xr_total_s``) and the step time; from outside, each rank's peak RSS
(``VmHWM``, sampled every 0.2 s). The two same-shape variants run twice per repetition: with glibc's
default allocator, and with ``MALLOC_MMAP_THRESHOLD_=65536`` (every allocation of 64 KiB or more mapped on its
own and given back when freed), because FSDP allocates and frees the gathered parameters and the unsharded
gradients of every block at every step, and the default allocator keeps much of that memory after it is
freed. Ratios FSDP/DDP are taken per repetition and allocator, both runs of a repetition next to each other;
the headline is their median, with their range.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml

from sbatch_gen.train.data import prepare
from sbatch_gen.train.xr.sync import ROUND_PARTS
from sbatch_gen.xr_options import CrossRegion, FsTransport

from .common import PY, Result, fmt, median
from .regionruns import DATA_BYTES, REGIONS, finish, launch_region
from .trainruns import write_config

MIB = 1 << 20


@dataclass(frozen=True)
class Size:
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    h: int  # inner steps per round
    rounds: int
    reps: int


FULL = Size(d_model=512, n_layers=4, n_heads=8, seq_len=64, batch=2, h=4, rounds=4, reps=3)
QUICK = Size(d_model=64, n_layers=2, n_heads=2, seq_len=32, batch=2, h=2, rounds=2, reps=1)
# name: ((kind, ranks) of region a, of region b)
VARIANTS = {
    "ddp x2 | ddp x2": (("ddp", 2), ("ddp", 2)),
    "fsdp x2 | fsdp x2": (("fsdp", 2), ("fsdp", 2)),
    "fsdp x2 | ddp x1": (("fsdp", 2), ("ddp", 1)),
}
DDP, FSDP, MIXED = VARIANTS
# name: the environment it adds to every rank
ALLOCATORS = {"glibc default": {}, "mmap threshold 64 KiB": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
DEFAULT, MMAP = ALLOCATORS
RUNS = [(DDP, DEFAULT), (FSDP, DEFAULT), (MIXED, DEFAULT), (DDP, MMAP), (FSDP, MMAP)]
PHASES = [f"xr_{p}" for p in ROUND_PARTS] + ["xr_total_s"]


class PeakRss:
    """Every worker's peak RSS (``VmHWM``), by (region, rank), sampled every ``every`` s while the runs go."""

    def __init__(self, runs, every: float = 0.2) -> None:
        self.runs, self.every = runs, every
        self.peak: dict[tuple[str, int], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            for r in self.runs:
                for pid in r.worker_pids():
                    got = _rank_and_hwm(pid)
                    if got is not None:
                        key = (r.region, got[0])
                        self.peak[key] = max(self.peak.get(key, 0), got[1])


def _rank_and_hwm(pid: int) -> tuple[int, int] | None:
    """A torchrun worker's RANK and VmHWM in bytes; None when it is gone or not a worker yet."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
    hwm = next((int(ln.split()[1]) * 1024 for ln in status.splitlines() if ln.startswith("VmHWM:")), None)
    return None if rank is None or hwm is None else (rank, hwm)


def _config(work: Path, data: Path, size: Size, kind: str) -> Path:
    cfg = write_config(
        work / f"{kind}.yaml",
        steps=size.h * size.rounds,
        data_dir=data,
        d_model=size.d_model,
        n_layers=size.n_layers,
        seq_len=size.seq_len,
        batch_size=size.batch,
        warmup=1,
    )
    c = yaml.safe_load(cfg.read_text())
    c["model"]["n_heads"] = size.n_heads
    c["parallelism"] = {"kind": kind}
    cfg.write_text(yaml.safe_dump(c, sort_keys=False))
    return cfg


def _records(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _one_run(
    work: Path, name: str, alloc: str, rep: int, size: Size, data: Path, cfgs: dict[str, Path]
) -> dict:
    """Both regions of variant ``name`` under allocator ``alloc``, to the end; each region's figures."""
    root = work / f"{name.replace(' ', '').replace('|', '-')}-{list(ALLOCATORS).index(alloc)}-{rep}"
    runs = []
    for region, (kind, ranks) in zip(REGIONS, VARIANTS[name], strict=True):
        xr = CrossRegion(
            enabled=True,
            run_id=f"fsdp{rep}",
            region=region,
            regions=REGIONS,
            sync="diloco",
            inner_steps=size.h,
            transport=FsTransport(root=str(root / "mailbox")),
            timeout_s=600,
        )
        torchrun = [
            PY,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            "--no-python",
        ]
        runs.append(
            launch_region(
                xr,
                config=cfgs[kind],
                run_dir=root / region,
                data=data,
                resume="none",
                log_dir=root / "logs",
                env=ALLOCATORS[alloc],
                prefix=torchrun,
            )
        )
    with PeakRss(runs) as rss:
        finish(runs, name)
    out: dict = {"variant": name, "alloc": alloc, "rep": rep}
    for region, (kind, ranks) in zip(REGIONS, VARIANTS[name], strict=True):
        recs = _records(root / region)
        state = next(r for r in recs if r.get("event") == "xr_outer_state")
        steps = [r for r in recs if "step_time_s" in r]
        rounds = [r for r in steps if "xr_total_s" in r][1:]  # the first round also warms up: left out
        plain = [r["step_time_s"] for r in steps[1:] if "xr_total_s" not in r]
        out[region] = {
            "layout": f"{kind} x{ranks}",
            "outer_bytes": state["bytes_per_rank"],
            "numel": state["numel"],
            "rss": [rss.peak.get((region, k), 0) for k in range(ranks)],
            "phases": {p: median([r[p] for r in rounds]) for p in PHASES},
            "bytes_up": median([r["xr_bytes_up"] for r in rounds]),
            "bytes_down": median([r["xr_bytes_down"] for r in rounds]),
            "step_s": median(plain),
            "fsdp_comm_s": median(
                [(r["fsdp_all_gather_s"] or 0.0) + (r["fsdp_reduce_scatter_s"] or 0.0) for r in steps[1:]]
            ),
        }
    return out


# What the ratio tables compare, from one run's region-a figures
MEASURES = {
    "outer state, the rank holding most": lambda a: max(a["outer_bytes"]),
    "outer state, the region (all ranks)": lambda a: sum(a["outer_bytes"]),
    "peak RSS, the largest rank": lambda a: max(a["rss"]),
    "peak RSS, the region (all ranks)": lambda a: sum(a["rss"]),
    "round time (xr_total_s)": lambda a: a["phases"]["xr_total_s"],
    "round time without the wait for the other region": lambda a: (
        a["phases"]["xr_total_s"] - a["phases"]["xr_wait_s"]
    ),
    "upload": lambda a: a["phases"]["xr_upload_s"],
    "download": lambda a: a["phases"]["xr_download_s"],
    "broadcast inside the region": lambda a: a["phases"]["xr_broadcast_s"],
    "payload bytes uploaded (the region)": lambda a: a["bytes_up"],
    "payload bytes downloaded (the region)": lambda a: a["bytes_down"],
    "step time (steps without a round)": lambda a: a["step_s"],
}


def _rss_line(by: dict, size: Size) -> str:
    """The largest rank's peak RSS (MiB, median over repetitions) of DDP and FSDP under each allocator."""
    parts = []
    for alloc in ALLOCATORS:
        d, f = (median([max(by[(v, alloc, i)]["rss"]) / MIB for i in range(size.reps)]) for v in (DDP, FSDP))
        parts.append(f"{alloc}: DDP {d:.0f}, FSDP {f:.0f} ({f - d:+.0f})")
    return "; ".join(parts)


def _med_line(med: dict, what: str) -> str:
    """One measure's median ratio under each allocator, with its range, for the notes."""
    return "; ".join(
        f"{alloc} {med[alloc][what]:.3g} ({med[alloc]['range: ' + what]})" for alloc in ALLOCATORS
    )


def _ms(by: dict, variant: str, phase: str) -> str:
    """The range over a variant's runs (every allocator) of one of region a's phases, in ms."""
    xs = [a["phases"][phase] * 1e3 for (v, _, _), a in by.items() if v == variant]
    return f"{min(xs):.0f}-{max(xs):.0f}"


def _ratio(f: float, d: float) -> float:
    return f / d if d else float("nan")


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.3g}-{max(xs):.3g}" if len(xs) > 1 else "one pair"


def run(out: Path, quick: bool = False) -> Result:
    size = QUICK if quick else FULL
    res = Result(
        "fsdp", "DiLoCo with FSDP2 regions vs DDP regions: outer state, memory and round time", quick
    )
    load_before = os.getloadavg()[0]
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="sbgen-fsdp-") as tmp:
        work = Path(tmp)
        data = work / "data"
        prepare(data, REGIONS, "python-stdlib", DATA_BYTES)
        cfgs = {k: _config(work, data, size, k) for k in ("ddp", "fsdp")}
        for rep in range(size.reps):
            for name, alloc in RUNS[rep % len(RUNS) :] + RUNS[: rep % len(RUNS)]:  # the order rotates
                results.append(_one_run(work, name, alloc, rep, size, data, cfgs))
    _report(res, size, results, load_before)
    return res


def _report(res: Result, size: Size, results: list[dict], load_before: float) -> None:
    numel = results[0]["a"]["numel"]
    res.setup += [
        f"The trainer (`python -m sbatch_gen.train`) as two regions `a`, `b`, each a `torchrun --standalone` of "
        f"CPU ranks (gloo, one thread each) on this 2-core machine, over one fs mailbox: a GPT of "
        f"{size.n_layers} layers, d_model {size.d_model}, seq_len {size.seq_len} ({numel / 1e6:.2f}M "
        f"parameters), batch {size.batch} per rank, fp32; DiLoCo (`overlap: none`, bf16 payloads, the "
        f"default shard size) every {size.h} steps, {size.rounds} rounds.",
        f"Variants (region a | region b): {', '.join(f'`{v}`' for v in VARIANTS)}; the first two also with "
        "every rank under `MALLOC_MMAP_THRESHOLD_=65536` (glibc maps every allocation of 64 KiB or more on its "
        "own and unmaps it when freed). "
        f"{size.reps} repetition(s), each running the {len(RUNS)} runs once, the order rotated from one "
        "repetition to the next.",
        "Per run, region a: the outer state each rank holds (`xr_outer_state` event, `bytes_per_rank`: the "
        "flat buffers its sync allocated), each rank's peak RSS (`VmHWM` of the worker, sampled every 0.2 s, "
        "so the whole run: start-up, rounds and the final checkpoint), the median over rounds 2.. of rank 0's "
        "round phases (`xr_*_s`) and payload bytes, the median step time of steps without a round (the "
        "first left out), and FSDP's all-gather + reduce-scatter seconds per step (`fsdp_all_gather_s` + "
        "`fsdp_reduce_scatter_s`).",
        "Ratios FSDP/DDP: region a under `fsdp x2 | fsdp x2` over region a under `ddp x2 | ddp x2` of the "
        "same repetition and allocator; the headline is the median over repetitions, with their range.",
    ]
    rows = []
    for r in results:
        a = r["a"]
        ph = a["phases"]
        rows.append(
            [
                r["variant"],
                r["alloc"],
                r["rep"] + 1,
                " / ".join(fmt(b / MIB) for b in a["outer_bytes"]),
                " / ".join(fmt(b / MIB) for b in r["b"]["outer_bytes"]),
                " / ".join(fmt(b / MIB) for b in a["rss"]),
                *(round(ph[p], 4) for p in PHASES),
                round(a["bytes_up"] / MIB, 2),
                round(a["bytes_down"] / MIB, 2),
                round(a["step_s"], 4),
                round(a["fsdp_comm_s"], 4),
            ]
        )
    res.table(
        "Every run: region a (outer state and peak RSS per rank, MiB; rank 0's round phases, s; the region's "
        "payload MiB per round, up and down; step time and FSDP's collectives per step, s)",
        [
            "variant",
            "allocator",
            "rep",
            "outer MiB/rank, a",
            "outer MiB/rank, b",
            "peak RSS MiB/rank, a",
            *(p.removeprefix("xr_") for p in PHASES),
            "MiB up",
            "MiB down",
            "step s",
            "FSDP comm s/step",
        ],
        rows,
        key="runs",
    )
    by = {(r["variant"], r["alloc"], r["rep"]): r["a"] for r in results}
    med: dict[str, dict[str, float]] = {}
    for alloc in ALLOCATORS:
        table = []
        for what, get in MEASURES.items():
            rs = [_ratio(get(by[(FSDP, alloc, i)]), get(by[(DDP, alloc, i)])) for i in range(size.reps)]
            table.append([what, median(rs), _spread(rs), ", ".join(f"{x:.3g}" for x in rs)])
        res.table(
            f"FSDP x2 / DDP x2, region a, per repetition: {alloc}",
            ["measure", "median", "range", "pairs"],
            table,
            "ratios" if alloc == DEFAULT else "ratios_mmap",
        )
        med[alloc] = {row[0]: row[1] for row in table} | {f"range: {row[0]}": row[2] for row in table}
    res.headline["outer state per rank, FSDP x2 / DDP x2 (the rank holding most)"] = fmt(
        med[DEFAULT]["outer state, the rank holding most"]
    )
    for alloc in ALLOCATORS:
        res.headline[f"peak RSS of the largest rank, FSDP x2 / DDP x2 ({alloc})"] = fmt(
            med[alloc]["peak RSS, the largest rank"]
        )
    res.headline["round time, FSDP x2 / DDP x2"] = fmt(med[DEFAULT]["round time (xr_total_s)"])
    res.headline["step time, FSDP x2 / DDP x2"] = fmt(med[DEFAULT]["step time (steps without a round)"])
    mixed = [r for r in results if r["variant"] == MIXED]
    same = all(r["a"]["numel"] == r["b"]["numel"] for r in mixed)
    res.notes += [
        f"Outer state: a DDP region's leader holds all of it ({fmt(max(by[(DDP, DEFAULT, 0)]['outer_bytes']) / MIB)} MiB, "
        "16 B/param: theta_outer, momentum and two staging buffers) and rank 1 none; each rank of an FSDP x2 "
        "region holds the part of its own shards, half. The region as a whole holds the same. This is the "
        "figure that scales: over N ranks, 16/N B/param per rank.",
        "Peak RSS includes what every process has regardless of the model (the Python interpreter, torch, "
        "gloo: about 0.5 GiB here), so its ratio is far from the outer state's. "
        f"In MiB, the largest rank: {_rss_line(by, size)}. With glibc's default allocator FSDP's ranks peak "
        "higher than DDP's leader, although each holds half of everything that grows with the model "
        "(parameters, gradients, AdamW, outer state): FSDP allocates and frees the gathered parameters and "
        "the unsharded gradients of every block at every step, and the default allocator keeps much of what "
        "was freed (its mmap threshold rises after such frees, so later buffers come from a heap that does "
        "not shrink; the trainer's own per-step `mem_bytes` creeps up from step to step under FSDP, flat "
        "under DDP). With `MALLOC_MMAP_THRESHOLD_=65536` those buffers are mapped and unmapped each time and "
        "FSDP's ranks peak lower than DDP's leader by about what the sharding saves. This is the CPU's "
        "case: on GPUs the gathered buffers are device memory under torch's caching allocator, and "
        "`cpu_offload`'s host shards are pinned memory allocated once.",
        "Round time on CPU: the round's own work is small at this size (tens of ms); the wait for the other "
        "region is most of xr_total_s and depends on which region reached the round first (the run's timing, "
        "not the sharding). The round's own work (total minus that wait), FSDP/DDP: "
        f"{_med_line(med, 'round time without the wait for the other region')}: on this shared machine no "
        "firm difference either way. What is firm: the region's payload bytes are the same up and down; "
        "DDP's leader moves the whole payload and then broadcasts the new parameters to rank 1 "
        f"(`broadcast_s`, {_ms(by, DDP, 'xr_broadcast_s')} ms here), which FSDP skips; each FSDP rank "
        "uploads only its own shards but at least one object per parameter it holds (many small files "
        "instead of a few large ones), and downloads every object that overlaps its shards: download "
        f"{_med_line(med, 'download')}, on a phase of a few ms. Beside a region sharded another way (the "
        "DDP x1 region of `fsdp x2 | ddp x1`) the FSDP region downloads twice the bytes (`MiB down`): "
        "whole objects, not ranges. On 2 shared cores the ranks also compete for CPU, which on a GPU node "
        "(a core per rank, the network per node) they would not.",
        "Step time: FSDP gathers each block's parameters for its forward and again for its backward, and "
        "reduce-scatters its gradients; on gloo all of it blocks the host (the `FSDP comm s/step` column), "
        "where DDP does one all-reduce per bucket. FSDP/DDP step time: "
        f"{_med_line(med, 'step time (steps without a round)')}. The mmap threshold costs FSDP's step (every "
        "gathered buffer is a fresh mapping: page faults each time) and hardly DDP's, whose buffers live "
        "through the run: on CPU it trades FSDP's step time for its memory. On GPUs the collectives "
        "overlap the compute and the buffers are the caching allocator's (not measured here).",
        f"`fsdp x2 | ddp x1`: regions of different shapes finished every run and hold the same layout "
        f"({'the same' if same else 'NOT the same'} number of parameters); their equality bit for bit is "
        "tested in tests/xr/test_fsdp.py, not here.",
        f"The machine is shared with other developers' work: load average {load_before:.1f} before the run "
        f"and {os.getloadavg()[0]:.1f} after it, on 2 cores; the range column says how far one pair is to be "
        "trusted.",
    ]
