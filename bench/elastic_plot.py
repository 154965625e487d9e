"""``bench elastic``: the page's plot, ``elastic.png`` (a's progress, a's wait per round, the held-out
losses)."""

from __future__ import annotations

from pathlib import Path

from .common import Result, plt, save_fig
from .elastic_report import label, qlabel
from .elastic_sizes import Sizes


def plot(res: Result, out_dir: Path, good: list[dict], qual: list[dict], sz: Sizes) -> None:
    p = plt()
    fig, (ax, bx, cx) = p.subplots(1, 3, figsize=(17, 4.4))
    for g in good:
        tl = g["timeline"]
        ax.plot([t for t, _ in tl], [s for _, s in tl], label=label(g))
    g0 = next((g for g in good if g["mode"] == "crash"), good[0])
    if g0["gone_at"] == g0["gone_at"]:
        ax.axvspan(
            g0["gone_at"],
            g0["back_at"] if g0["back_at"] == g0["back_at"] else g0["restart_at"],
            color="grey",
            alpha=0.15,
            label=f"b away ({label(g0)})",
        )
    ax.set_xlabel("wall time since a started training, s")
    ax.set_ylabel("a's step")
    ax.set_title("survivor progress (flat = a idle)")
    ax.legend(fontsize=7)
    for g in good:
        if g["mode"] in ("strict", "none"):
            continue
        bx.plot(
            [r for r, _, _ in g["round_waits"]],
            [w for _, w, _ in g["round_waits"]],
            marker="o",
            label=label(g),
        )
    for grace in sorted({g["grace_s"] for g in good if g["mode"] in ("crash", "stop")}):
        bx.axhline(grace, color="grey", linestyle="--", linewidth=0.8)
    bx.set_xlabel("a's round")
    bx.set_ylabel("xr_wait_s")
    bx.set_title("a's wait for b per round (dashed: grace_s)")
    bx.legend(fontsize=7)
    labels = [
        qlabel(q)
        .replace(", then back", "")
        .replace("b leaves for good after", "b gone after")
        .replace(" (1-region run)", "")
        .replace(" (control)", "")
        + (f", seed {q['seed']}" if q["seed"] != sz.q_seeds[0] else "")
        for q in qual
    ]
    cx.bar(range(len(qual)), [q["loss"] for q in qual])
    cx.set_xticks(range(len(qual)), labels, rotation=20, ha="right", fontsize=8)
    cx.set_ylim(min(q["loss"] for q in qual) * 0.98, max(q["loss"] for q in qual) * 1.01)
    cx.set_ylabel("held-out loss")
    cx.set_title(f"final held-out loss, {sz.q_steps} steps")
    save_fig(fig, out_dir / "elastic.png")
    res.plots.append(
        (
            "elastic.png",
            "Left: a's step over wall time. Middle: a's wait per round. Right: final "
            "held-out loss by b's absence.",
        )
    )
