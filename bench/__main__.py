"""``python -m bench [NAME ...] [--quick] [--out DIR]``: run benchmarks, write Markdown/JSON/PNG results.

Names: mailbox, outer, ddp, diloco, elastic, payload, overlap, quality, peer, sinks, render, memory, fsdp,
roundcost, sparse, sparse_scale (default: all,
in that order). ``--quick`` runs tiny sizes in seconds (for the tests); results of a quick run go to a temporary
directory unless ``--out`` is given. ``--subset goals`` (overlap, peer): only the full runs their goals judge.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

from sbatch_gen.fsutil import write_atomic

from .common import RESULTS, machine, md_table, now_utc

BENCHES = {
    "mailbox": "mailbox exchange throughput (fs, s3, emulated WAN): ours vs naive vs ceiling",
    "outer": "outer step (weighted average + Nesterov) vs memory bandwidth",
    "ddp": "DDP (gloo, 1/2/4 ranks): compute vs all-reduce, straggler slope",
    "diloco": "DiLoCo (H = 10/50/100) vs per-step gradient averaging, same tokens",
    "elastic": "elastic rounds (min_regions 1 of 2): survivor idle, goodput vs strict, held-out loss vs absence",
    "payload": "compressed payloads: bf16 vs int8 vs fp8 bytes and round time (WAN, fs), held-out loss",
    "overlap": "overlapped rounds over the emulated WAN: exposed sync time, overlap none vs eager, bf16 vs int8",
    "quality": "DiLoCo held-out loss: H 10/50/100 x outer lr/momentum, grad mode, one region, int8/fp8, eager",
    "peer": "torchft vs ours on the same work and WAN: wall, exposed sync, bytes per round, held-out loss",
    "sinks": "metric sinks (TensorBoard, W&B, Prometheus) on vs off: step time of a tiny CPU trainer",
    "render": "sbatch-gen render --all over 20 sites, as a whole process (no torch)",
    "memory": "analytic, not measured: HBM and host bytes per rank, DDP vs FSDP vs FSDP+offload, largest model",
    "fsdp": "DiLoCo regions FSDP x2 vs DDP x2 (CPU): outer state and peak RSS per rank, round time by phase",
    "roundcost": "fixed cost of a steady DiLoCo round at 80 ms RTT (delay proxy), 2/4/8 regions: fit, requests",
    "sparse": "sparse outer updates (top-k, 2-bit, error feedback) vs dense bf16 DiLoCo: held-out loss, bytes",
    "sparse_scale": "sparse vs bf16: the bytes of one round at the eu/us run's model size (~128M parameters)",
}
# the benchmarks that run a named subset of their full runs (--subset NAME; each module's SUBSETS)
SUBSETS = ("overlap", "peer")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCHES)}")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, seconds (for tests)")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default: bench/results)")
    ap.add_argument("--server", choices=["nanio", "moto"], default="nanio", help="S3 server for `mailbox`")
    ap.add_argument("--no-wan", action="store_true", help="mailbox: skip the emulated WAN")
    ap.add_argument(
        "--sizes",
        type=lambda v: [int(x) for x in v.split(",")],
        default=None,
        help="mailbox: parameter sizes in MiB, e.g. 16,64 (default: 16,64,256,1024; WAN 16,64,256)",
    )
    ap.add_argument(
        "--subset",
        default=None,
        help="overlap, peer: run only the named subset of the full runs (goals: the runs their goals judge)",
    )
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    a = ap.parse_args(argv)
    if a.list:
        for k, v in BENCHES.items():
            print(f"{k:8} {v}")
        return 0
    names = a.names or list(BENCHES)
    bad = [n for n in names if n not in BENCHES]
    if bad:
        ap.error(f"unknown benchmark(s) {', '.join(bad)}; known: {', '.join(BENCHES)}")
    out = a.out or (Path(tempfile.mkdtemp(prefix="sbgen-bench-quick-")) if a.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for n in names:
        t0 = time.time()
        print(f"== bench {n}{' (quick)' if a.quick else ''}", flush=True)
        mod = importlib.import_module(f"bench.{n}")
        kw = {"server_kind": a.server, "wan": not a.no_wan, "sizes": a.sizes} if n == "mailbox" else {}
        if a.subset is not None:
            if n not in SUBSETS:
                ap.error(f"--subset: {n} has no subsets (only {', '.join(SUBSETS)})")
            kw["subset"] = a.subset
        try:
            res = mod.run(out, quick=a.quick, **kw)
        except Exception:  # noqa: BLE001 - report it, run the others, exit non-zero
            traceback.print_exc()
            failed.append(n)
            continue
        path = res.write(out)
        print(f"== bench {n}: {time.time() - t0:.0f} s -> {path}", flush=True)
        for g, m, ok in res.goals:
            print(f"   goal {'met' if ok else 'NOT met' if ok is not None else '-'}: {g}: {m}")
    _summary(out)
    print(f"results in {out}")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _summary(out: Path) -> None:
    """bench/results/README.md: every benchmark's goals and headline numbers, from their JSON files."""
    rows, goals = [], []
    for n in BENCHES:
        f = out / f"{n}.json"
        if not f.is_file():
            continue
        d = json.loads(f.read_text())
        when = "analytic, not measured" if d.get("analytic") else d["date"]
        when += " (quick)" if d.get("quick") else ""
        for k, v in d.get("headline", {}).items():
            rows.append([f"[{n}]({n}.md)", k, v, when])
        for g in d.get("goals", []):
            goals.append(
                [
                    f"[{n}]({n}.md)",
                    g["goal"],
                    g["measured"],
                    "-" if g["met"] is None else ("yes" if g["met"] else "NO"),
                ]
            )
    text = [
        "# Benchmark results",
        "",
        f"Summary written {now_utc()} on {machine()}. Each benchmark's page has its setup, tables and plots. "
        "Reproduce everything with `make bench` (or `python -m bench NAME`).",
        "",
    ]
    if goals:
        text += ["## Goals", "", md_table(["bench", "goal", "measured", "met"], goals), ""]
    if rows:
        text += ["## Headline numbers", "", md_table(["bench", "what", "value", "measured"], rows), ""]
    write_atomic(out / "README.md", "\n".join(text), fsync=False)


if __name__ == "__main__":
    raise SystemExit(main())
