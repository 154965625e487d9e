"""``bench peer``: the page, its setup, tables, goals, headline numbers and notes, for the side-by-side
runs and for the faults, and its plot ``peer.png``."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from sbatch_gen.testing.faults import ENV_STEP_SLEEP
from sbatch_gen.xr_options import CrossRegion

from .common import Result
from .peer_faults import FAULTS, SURVIVORS
from .peer_sizes import ALPHA, NPROC, OUTER_LR, OUTER_MOMENTUM, SYSTEMS, Sizes
from .regionruns import REGIONS


def report(res: Result, sz: Sizes, rows: list[dict], why: str | None) -> None:
    """The side-by-side runs: their setup (before what the links added), table, goals and headline."""
    _setup(res, sz, why)
    _runs_table(res, rows)
    _goals(res, sz, rows, why)


def report_faults(res: Result, sz: Sizes, faults: list[dict], link: str) -> None:
    """The fault runs (on ``link``): setup, table, a note per failed replica, goals."""
    if not faults:
        res.goal("faults: the same schedule on both sides", "not run", None)
        return
    res.setup += _faults_setup(sz, link)
    _faults_table(res, faults)
    for f in faults:
        for r, (after, err) in f["failed"].items():
            when = f"{after:.0f} s after the fault" if after is not None else "(killed at the timeout)"
            res.notes.append(
                f"fault {f['fault']}, {f['system']}: replica {r} exited {f['rcs'][r]} {when}: `{err}`"
            )
    _faults_goals(res, sz, faults)


def _setup(res: Result, sz: Sizes, why: str | None) -> None:
    m = sz.model
    res.setup[:0] = [
        f"2 replicas (a, b), each a torchrun of {NPROC} processes (a DDP group over gloo, CPU, one thread each) on "
        f"this machine's {os.cpu_count()} cores; a {m['n_layers']}-layer width-{m['d_model']} GPT, "
        f"batch {sz.batch} x {m['seq_len']} tokens per process, {sz.h * sz.rounds} steps, DiLoCo H={sz.h} "
        f"({sz.rounds} rounds), outer Nesterov lr {OUTER_LR:g} momentum {OUTER_MOMENTUM:g}, inner AdamW and the "
        f"trainer's schedule; a per-step sleep of {sz.sleep_s:g} s (`{ENV_STEP_SLEEP}`) stands in for a faster "
        "device's compute, on both sides. Both sides take the model, data, optimizer and schedule from our "
        "trainer's code (bench/peer_torchft.py), so each replica sees the same tokens in the same order.",
        f"Streaming: F={sz.frags} fragments, tau={sz.tau}, alpha {ALPHA:g} on both sides (torchft: "
        "`fragment_sync_delay`, `fragment_update_alpha`; the fragments hold the parameters our split assigns). "
        "torchft sends a fragment tau steps before its sync point and merges at it; ours starts a round at the "
        "point and merges tau steps later (the last round after the last step, in the run's wall time).",
        "torchft: lighthouse `torchft_lighthouse --min_replicas 2` in the hub (strict rounds, as ours), a `Manager` per rank "
        "(synchronous quorum, as its DiLoCo requires), `ProcessGroupGloo` across the replicas: each rank "
        "allreduces the whole fp32 pseudo-gradient with the same rank of the other replica. Its quantized "
        "allreduce (`should_quantize`) needs triton and CUDA: not available on this machine, fp32 only.",
        "Ours: the real trainer (`python -m sbatch_gen.testing.faults`: `sbatch_gen.train` with the per-step "
        "sleep installed from outside) under torchrun, strict DiLoCo rounds through the "
        "S3 mailbox (nanio in the hub) on the WAN, through an fs mailbox on tmpfs on loopback; payload fp32 "
        "(torchft's bytes) and bf16 (our default); elastic runs (the faults) over moto in the hub, which honours "
        "the conditional writes our `min_regions` below all needs (nanio ignores them).",
        "Wall: the sum of the steps' times (rank 0; ours: plus the final round's join after the last step). "
        "Exposed: the time the sync held training up. Ours: the trainer's own `xr_exposed_s`. torchft syncs "
        "inside the optimizer step (DiLoCo's step hook): per step the seconds from AdamW's own end (a hook "
        "registered before DiLoCo's) to the step's end. "
        "Per round: exposed / the number of rounds (F per H with streaming). Wire: the bytes the replicas' "
        "links carried both ways (the transparent proxies' count: payload, protocol and control traffic; a "
        "connection is counted by the side that opened it), per replica and round. Held-out: mean next-byte loss of each replica's final model on the held-out shard "
        f"({sz.eval_windows} windows). a == b: the two final models bitwise, else the largest difference.",
    ]
    if why is not None and not sz.links:
        res.setup.append("--quick: loopback only (no WAN), ours over fs.")
    if sz.subset is not None:
        res.setup.append(
            f"Subset `{sz.subset}` (`python -m bench peer --subset {sz.subset}`): ours with payload "
            f"{', '.join(sz.payloads)} only, on {', '.join(f'{r} Mbit/s, {t:g} ms' for r, t in sz.links)}"
            f"{'' if sz.loopback else ' (not on loopback)'}, faults: {', '.join(sz.faults)}."
        )


def _runs_table(res: Result, rows: list[dict]) -> None:
    table = []
    for r in rows:
        per = r["regions"]
        twin = _twin(rows, r)
        rs = [per[x]["round_s"] for x in REGIONS if per[x]["round_s"] is not None]
        table.append(
            [
                r["link"],
                r["variant"].system,
                r["variant"].transport,
                r["variant"].dtype,
                r["variant"].overlap
                + (f" F={r['variant'].frags} tau={r['variant'].tau}" if r["variant"].frags > 1 else ""),
                r["wall_s"],
                f"{r['share']:.1%}",
                r["exposed_per_round_s"],
                max(rs) if rs else "-",
                r["wire_per_round"] / 1e6,
                f"{_mean(r['heldout']):.4f}",
                "identical" if r["same"] else f"{r['max_diff']:.3g}",
                f"{_loss_gap(r, twin):.2g}" if twin else "-",
                r["took_s"],
            ]
        )
    res.table(
        "Each run: wall time, exposed sync share, per round, bytes on the wire, held-out loss, final models",
        [
            "link",
            "system",
            "transport",
            "payload",
            "overlap",
            "wall s",
            "exposed / wall",
            "exposed per round s",
            "ours' round s (xr_total_s)",
            "wire MB per round per replica",
            "held-out loss",
            "a == b",
            "training loss vs torchft's (largest gap)",
            "end to end s",
        ],
        table,
        "runs",
    )


def _goals(res: Result, sz: Sizes, rows: list[dict], why: str | None) -> None:
    """Ours (its default payload, bf16; --quick: fp32) against torchft, per link and overlap mode."""
    for link in dict.fromkeys(r["link"] for r in rows):
        if link == "loopback" and sz.links and why is None:
            continue
        for ov in ("none", "streaming"):
            ft = [
                r
                for r in rows
                if r["link"] == link and r["variant"].system == "torchft" and r["variant"].overlap == ov
            ]
            us = [
                r
                for r in rows
                if r["link"] == link
                and r["variant"].system == "ours"
                and r["variant"].dtype == sz.payloads[-1]
                and r["variant"].overlap == ov
            ]
            if not ft or not us:
                continue
            f, u = ft[0], us[0]
            judge = None if res.quick else True
            lf, lu = _mean(f["heldout"]), _mean(u["heldout"])
            res.goal(
                f"{link}, {ov}: wall time, ours <= torchft",
                f"ours {u['wall_s']:.1f} s, torchft {f['wall_s']:.1f} s ({u['wall_s'] / f['wall_s']:.2f}x)",
                judge and u["wall_s"] <= f["wall_s"],
            )
            res.goal(
                f"{link}, {ov}: exposed sync share, ours <= torchft",
                f"ours {u['share']:.1%}, torchft {f['share']:.1%}",
                judge and u["share"] <= f["share"],
            )
            res.goal(
                f"{link}, {ov}: held-out loss, ours <= torchft + 1%",
                f"ours {lu:.4f}, torchft {lf:.4f} ({(lu / lf - 1) * 100:+.2f}%)",
                judge and lu <= lf * 1.01,
            )
            res.headline[f"{link}, {ov}: wall ours / torchft"] = f"{u['wall_s'] / f['wall_s']:.2f}x"


def _faults_setup(sz: Sizes, link: str) -> list[str]:
    return [
        f"Faults, on {link}: {sz.h * sz.fault_rounds} steps (H={sz.h}), a per-step sleep of {sz.fault_sleep_s:g} s, "
        "no overlap, elastic on both sides at their defaults otherwise: torchft's lighthouse `--min_replicas 1` "
        "(heartbeat timeout 5 s), a `Manager` timeout of 60 s (its default); ours `min_regions: 1` (grace_s "
        f"{CrossRegion.model_fields['grace_s'].default:g}, heartbeat_s {CrossRegion.model_fields['heartbeat_s'].default:g}), "
        f"a checkpoint every {sz.h} steps, payload bf16. Each fault comes when replica a has logged step "
        f"{sz.fault_step}: "
        + "; ".join(f"**{k}**: {FAULTS[k].format(away=sz.away_s, outage=sz.outage_s)}" for k in sz.faults)
        + ". torchft keeps no durable checkpoint (its docs leave that to the trainer), so a replica with no "
        "live peer starts again from step 0; the restarted torchft replica heals from the live one.",
        "Stall: the survivors' longest step after the fault, beyond their median step before it (both "
        "replicas for the coordinator). Back: from the restart to the restarted replica's first step; "
        "rejoined: to its heal (torchft) or its catch-up from the mailbox (ours). Times are when the bench "
        "saw each record appear (polled every 20-50 ms).",
    ]


def _faults_table(res: Result, faults: list[dict]) -> None:
    rows = []
    for f in faults:
        rows.append(
            [
                f["fault"],
                f["system"],
                ", ".join(
                    f"{r}: completed"
                    if x == 0
                    else f"{r}: exited {x} after {f['failed'][r][0] or float('nan'):.0f} s"
                    for r, x in f["rcs"].items()
                ),
                _stall(f) if set(f["failed"]) & SURVIVORS[f["fault"]] else f["stall_s"],
                f["back_s"],
                f["rejoin_s"],
                f["killed_at"] if f["killed_at"] is not None else "-",
                f["path"],
                "; ".join(
                    f"{r}: " + ", ".join(f"{k} x{n}" for k, n in sorted(c.items()))
                    for r, c in sorted(f.get("closed_without", {}).items())
                )
                or "-",
                ", ".join(f"{r}: {n}" for r, n in f.get("steps_during", {}).items()) or "-",
                ", ".join(f"{r}: {x:.4f}" for r, x in f["heldout"].items()) or "-",
                "-" if f["same"] is None else ("identical" if f["same"] else "differ"),
                f["took_s"],
            ]
        )
    res.table(
        "Faults: the same schedule on both sides",
        [
            "fault",
            "system",
            "ended (seconds after the fault)",
            "survivor stall s",
            "back s",
            "rejoined s",
            "b's last step before the kill",
            "catch-up",
            "ours: rounds closed without a region (absent, close reason)",
            "steps while the coordinator was down",
            "held-out loss",
            "a == b",
            "end to end s",
        ],
        rows,
        "faults",
    )


def _faults_goals(res: Result, sz: Sizes, faults: list[dict]) -> None:
    judge = None if res.quick else True
    for kind in sz.faults:
        by = {f["system"]: f for f in faults if f["fault"] == kind}
        if set(by) != set(SYSTEMS):
            continue
        ft, us = by["torchft"], by["ours"]
        ok_us = all(x == 0 for x in us["rcs"].values())
        ok_ft = all(x == 0 for x in ft["rcs"].values())
        lu = statistics.mean(us["heldout"].values()) if us["heldout"] else float("nan")
        lf = statistics.mean(ft["heldout"].values()) if ft["heldout"] else float("nan")
        res.goal(
            f"fault {kind}: ours completes at equal or better held-out loss",
            f"ours {'completed' if ok_us else 'did not complete'} ({lu:.4f}), torchft "
            f"{'completed' if ok_ft else 'did not complete'} ({lf:.4f})",
            judge and ok_us and (not ok_ft or lu <= lf * 1.01),
        )
        if kind != "both":
            # a survivor that failed stalled for good
            surv = SURVIVORS[kind]
            st = {k: float("inf") if surv & set(x["failed"]) else x["stall_s"] for k, x in by.items()}
            if None not in st.values():
                res.goal(
                    f"fault {kind}: survivor stall, ours <= torchft",
                    f"ours {_stall(us)}, torchft {_stall(ft)}",
                    judge and st["ours"] <= st["torchft"],
                )


def _stall(f: dict) -> str:
    if f["failed"]:
        return "failed (" + ", ".join(f"{r} exited {f['rcs'][r]}" for r in sorted(f["failed"])) + ")"
    return f"{f['stall_s']:.1f} s"


def _twin(rows: list[dict], r: dict) -> dict | None:
    """The torchft run ours' run ``r`` compares with: the same link, overlap, F and tau."""
    v = r["variant"]
    if v.system == "torchft":
        return None
    for o in rows:
        w = o["variant"]
        if o["link"] == r["link"] and w.system == "torchft" and (w.frags, w.tau) == (v.frags, v.tau):
            return o
    return None


def _loss_gap(r: dict, twin: dict) -> float:
    """The largest difference between the two runs' training losses, step by step, over both replicas."""
    return max(
        abs(x - y)
        for reg in REGIONS
        for x, y in zip(r["regions"][reg]["losses"], twin["regions"][reg]["losses"], strict=True)
    )


def _mean(d: dict) -> float:
    return statistics.mean(d.values())


def plot(res: Result, out_dir: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        rs = [r for r in rows if r["link"] == link]
        labels = [f"{r['variant'].system} {r['variant'].dtype}\n{r['variant'].overlap}" for r in rs]
        colors = ["tab:red" if r["variant"].system == "torchft" else "tab:blue" for r in rs]
        ax.bar(range(len(rs)), [r["share"] * 100 for r in rs], color=colors)
        ax.set_xticks(range(len(rs)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("exposed sync, % of wall time")
        ax.set_title(link, fontsize=9)
    fig.suptitle("torchft (red) and sbatch-gen (blue): exposed sync share", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "peer.png", dpi=110)
    plt.close(fig)
    res.plots.append(("peer.png", "Exposed sync share per run, per link: torchft red, ours blue."))
