"""Benchmark 4: DiLoCo (H = 10, 50, 100) vs per-step gradient averaging, 2 regions, the same tokens.

Each variant: two regions, each its own torchrun (1 process) of the real trainer (``--quick``: one plain
trainer process, no torchrun agent: half the processes to start), meeting only in an fs mailbox, the same config and the same number of steps (so the same tokens). From the regions'
metrics.jsonl: loss per step, bytes each region uploads/downloads per round, and the time each round
spends in cross-region sync (``xr_total_s``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from sbatch_gen.testing.regions import launch_region
from sbatch_gen.xr_options import CrossRegion, FsTransport

from . import regionruns
from .common import Result
from .trainruns import read_metrics, write_config

REGIONS = ["a", "b"]


def _run_variant(work: Path, cfg: Path, name: str, sync: str, h: int, timeout: float, quick: bool) -> dict:
    runs = []
    for region in REGIONS:
        xr = CrossRegion(
            enabled=True,
            run_id=f"bench-{name}",
            region=region,
            regions=REGIONS,
            sync=sync,
            inner_steps=h,
            transport=FsTransport(root=str(work / f"mailbox-{name}")),
            timeout_s=600,
        )
        if quick:  # the tests: the same trainer, one plain process per region (no torchrun agent to start)
            runs.append(
                regionruns.launch_region(
                    xr,
                    config=cfg,
                    run_dir=work / name / region,
                    data=work / "data",
                    resume="none",
                    log_dir=work / name / "logs",
                )
            )
            continue
        runs.append(
            launch_region(
                xr,
                config=cfg,
                run_dir=work / name / region,
                data_path=work / "data",
                nproc=1,
                resume="none",
                log_dir=work / name / "logs",
            )
        )
    for r in runs:
        rcs = r.wait(timeout)
        if any(rcs):
            for o in runs:
                if o is not r:
                    o.kill()
            raise RuntimeError(f"{name}: region {r.region} exited {rcs}\n{r.tail()}")
    per = {region: read_metrics(work / name / region) for region in REGIONS}
    steps = sorted(set.intersection(*[{x["step"] for x in recs} for recs in per.values()]))
    by = {region: {x["step"]: x for x in recs} for region, recs in per.items()}
    loss = [sum(by[r][s]["loss"] for r in REGIONS) / len(REGIONS) for s in steps]
    tokens = [sum(by[r][s]["tokens"] for r in REGIONS) for s in steps]
    cum, total, sync_s, nrounds = [], 0, 0.0, 0
    for s in steps:
        recs = [by[r][s] for r in REGIONS]
        if "xr_round" in recs[0]:
            total += sum(x.get("xr_bytes_up", 0) + x.get("xr_bytes_down", 0) for x in recs)
            sync_s += max(x["xr_total_s"] for x in recs)
            nrounds += 1
        cum.append(total)
    sent = sum(x.get("xr_bytes_up", 0) for recs in per.values() for x in recs if "xr_round" in x)
    last = loss[-10:]
    step_time = sum(x["step_time_s"] for x in per["a"])
    return {
        "name": name,
        "steps": steps,
        "loss": loss,
        "tokens": tokens,
        "bytes": cum,
        "bytes_total": total,
        "bytes_sent": sent,
        "sync_s": sync_s,
        "rounds": nrounds,
        "final_loss": sum(last) / len(last),
        "train_s": step_time,
    }


def run(out_dir: Path, quick: bool = False) -> Result:
    res = Result("diloco", "DiLoCo vs per-step gradient averaging: 2 regions, same token budget", quick)
    steps = 8 if quick else 300
    hs = [4] if quick else [10, 50, 100]
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-diloco-"))
    variants = []
    try:
        cfg = write_config(
            work / "diloco.yaml",
            steps=steps,
            data_dir=work / "data",
            seq_len=64,
            batch_size=8,
            log_every=1,
            warmup=10,
        )
        plan = [("grad (every step)", "grad", 1)] + [(f"DiLoCo H={h}", "diloco", h) for h in hs]
        for name, sync, h in plan:
            print(f"  diloco: {name}", flush=True)
            key = name.split(" ")[0] + (f"-{h}" if sync == "diloco" else "")
            v = _run_variant(work, cfg, key.replace("=", ""), sync, h, timeout=1200, quick=quick)
            v["label"] = name
            variants.append(v)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    grad = variants[0]
    rows = []
    for v in variants:
        rows.append(
            [
                v["label"],
                v["rounds"],
                v["final_loss"],
                v["bytes_total"] / 1e6,
                v["bytes_sent"] / 1e6,
                f"{grad['bytes_total'] / v['bytes_total']:.0f}x" if v["bytes_total"] else "-",
                v["sync_s"],
                v["train_s"],
                f"{v['sync_s'] / v['train_s']:.0%}",
            ]
        )
    res.table(
        "Same tokens, 2 regions",
        [
            "variant",
            "sync rounds",
            "final loss (mean of last 10 steps)",
            "MB moved (up+down, both regions)",
            "MB sent (uploads)",
            "bytes vs grad",
            "time in sync s",
            "region a train time s",
            "sync share",
        ],
        rows,
        "variants",
    )
    tok = variants[0]["tokens"][-1]
    res.setup += [
        f"2 regions x 1 process ({'one plain trainer process' if quick else 'torchrun, gloo'}, CPU), each "
        "its own data shard; a 2-layer width-128 GPT, "
        f"batch 8 x 64 tokens, {steps} steps per region = {tok} tokens in all, for every variant.",
        "Transport: fs mailbox (local directory), bf16 payloads, CrossRegion defaults otherwise; outer lr 0.7, "
        "momentum 0.9 (Nesterov).",
        "Bytes: the sum over rounds and both regions of `xr_bytes_up + xr_bytes_down` from metrics.jsonl (the "
        "one-off fp32 alignment round at the start is the same for every variant and not counted). "
        "Time in sync: per round the slower region's `xr_total_s`, summed.",
        "Loss is the training loss both regions report (their mean), no held-out set.",
    ]
    for v in variants[1:]:
        res.headline[f"{v['label']}: bytes vs grad, final loss (grad {grad['final_loss']:.3f})"] = (
            f"{grad['bytes_total'] / max(1, v['bytes_total']):.0f}x fewer, {v['final_loss']:.3f}"
        )
    _plot(res, out_dir, variants)
    return res


def _smooth(xs: list[float], k: int = 10) -> list[float]:
    out, acc = [], []
    for x in xs:
        acc.append(x)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def _plot(res: Result, out_dir: Path, variants: list[dict]) -> None:
    from .common import plt, save_fig

    p = plt()
    fig, (a, b) = p.subplots(1, 2, figsize=(11, 4))
    for v in variants:
        y = _smooth(v["loss"])
        a.plot(v["tokens"], y, label=v["label"])
        pts = [(bt, ls) for bt, ls in zip(v["bytes"], y, strict=True) if bt > 0]
        if pts:
            b.plot([q[0] / 1e6 for q in pts], [q[1] for q in pts], label=v["label"])
    a.set_xlabel("tokens (both regions)")
    a.set_ylabel("training loss (10-step mean)")
    a.set_title("loss vs tokens")
    a.legend()
    b.set_xscale("log")
    b.set_xlabel("MB moved across regions (cumulative, log)")
    b.set_ylabel("training loss (10-step mean)")
    b.set_title("loss vs bytes")
    b.legend()
    save_fig(fig, out_dir / "diloco.png")
    res.plots.append(("diloco.png", "Loss vs tokens (left) and vs bytes moved across regions (right)"))
