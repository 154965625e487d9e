"""``bench peer``: one side-by-side run (a variant on a link, both replicas to the end) and what it
measured, from torchft's per-rank records or our trainer's metrics."""

from __future__ import annotations

import re
import shutil
import statistics
import time
from pathlib import Path

from .common import median
from .finalmodel import distance, heldout_loss
from .peer_launch import launch
from .peer_net import Net
from .peer_sizes import NPROC, Sizes, V
from .regionruns import HELDOUT, REGIONS, finish
from .rundir import read_jsonl


def figures_torchft(ranks: list[list[dict]], sz: Sizes, what: str) -> dict:
    """Rank 0's times; the loss as ours logs it (the mean over the replica's ranks)."""
    steps = [[r for r in recs if "step" in r] for recs in ranks]
    for s in steps:
        if [r["step"] for r in s] != list(range(1, sz.h * sz.rounds + 1)):
            raise RuntimeError(f"{what}: steps {[r['step'] for r in s][:8]}... of {len(s)}")
    first = steps[0]
    return {
        "wall_s": sum(r["step_time_s"] for r in first),
        # the sync runs in DiLoCo's optimizer-step hook: the seconds from AdamW's end to the step's end
        "exposed_s": sum(r["sync_s"] for r in first),
        "syncs": first[-1]["manager_step"],  # torchft counts the committed fragment syncs
        "round_s": None,
        "losses": [statistics.mean(r["loss"] for r in at) for at in zip(*steps, strict=True)],
    }


def figures_ours(recs: list[dict], sz: Sizes, v: V, what: str) -> dict:
    steps = [r for r in recs if "event" not in r and "step_time_s" in r]
    if [r["step"] for r in steps] != list(range(1, sz.h * sz.rounds + 1)):
        raise RuntimeError(f"{what}: steps {[r['step'] for r in steps][:8]}... of {len(steps)}")
    final = [r for r in recs if r.get("event") == "xr_final_round"]
    rounds = [r for r in steps if "xr_round" in r] + final
    if len(rounds) != sz.rounds * v.frags:
        raise RuntimeError(f"{what}: {len(rounds)} rounds")
    final_s = sum(r["xr_exposed_s"] for r in final)
    return {
        "wall_s": sum(r["step_time_s"] for r in steps) + final_s,
        "exposed_s": sum(r["xr_exposed_s"] for r in steps + final if "xr_exposed_s" in r),
        "syncs": len(rounds),
        "round_s": median([r["xr_total_s"] for r in rounds]),
        "losses": [r["loss"] for r in steps if "loss" in r],
    }


def one(net: Net, work: Path, cfg: Path, data: Path, sz: Sizes, v: V, link: str) -> dict:
    root = work / f"{re.sub(r'[^a-z0-9]+', '-', link.lower()).strip('-')}-{v.name}"
    before = net.bytes()
    t0 = time.monotonic()
    if v.system == "torchft":
        net.start_lighthouse(len(REGIONS))
    try:
        finish([launch(net, root, cfg, data, sz, v, r) for r in REGIONS], f"{link} {v.label}")
    finally:
        net.stop_lighthouse()
    took = time.monotonic() - t0
    after = net.bytes()
    per = {}
    for r in REGIONS:
        what = f"{link} {v.label} {r}"
        if v.system == "torchft":
            per[r] = figures_torchft(
                [read_jsonl(root / r / f"rank{i}.jsonl") for i in range(NPROC)], sz, what
            )
        else:
            per[r] = figures_ours(read_jsonl(root / r / "metrics.jsonl"), sz, v, what)
        per[r]["wire_bytes"] = after[r] - before[r]
    models = [root / r / "model.safetensors" for r in REGIONS]
    same, dist = distance(*models)
    loss = {
        r: heldout_loss(m, {**sz.model, "dropout": 0.0}, data / f"{HELDOUT}.bin", sz.eval_windows)
        for r, m in zip(REGIONS, models, strict=True)
    }
    shutil.rmtree(root, ignore_errors=True)
    out = {
        "link": link,
        "variant": v,
        "label": v.label,
        "took_s": took,
        "regions": per,
        "same": same,
        "max_diff": dist,
        "heldout": loss,
        "wall_s": max(per[r]["wall_s"] for r in REGIONS),
        "share": max(per[r]["exposed_s"] / per[r]["wall_s"] for r in REGIONS),
        "exposed_per_round_s": max(per[r]["exposed_s"] for r in REGIONS) / (sz.rounds * v.frags),
        # a connection is counted once, by the proxy of the replica that opened it (torchft's peers open
        # connections to each other): the mean over the replicas is a replica's share
        "wire_per_round": statistics.mean(per[r]["wire_bytes"] for r in REGIONS) / (sz.rounds * v.frags),
    }
    print(
        f"  peer {link}: {v.label}: wall {out['wall_s']:.1f} s, exposed {out['share']:.1%}, "
        f"held-out {statistics.mean(loss.values()):.4f}, same {same} ({took:.0f} s)",
        flush=True,
    )
    return out
