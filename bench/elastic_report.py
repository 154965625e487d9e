"""``bench elastic``: the page's setup, tables, goals and headline numbers (its notes:
:mod:`.elastic_notes`; its plots: :mod:`.elastic_plot`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from .common import Result, fmt
from .elastic_sizes import POLL_S, Q_GRACE_S, Sizes
from .regionruns import DATA_BYTES, HELDOUT, OUTER_LR, OUTER_MOMENTUM


def report(res: Result, sz: Sizes, good: list[dict], qual: list[dict]) -> None:
    res.setup += _goodput_setup(sz) + _quality_setup(sz)
    _goodput_tables(res, good)
    _quality_table(res, qual)
    _goals(res, sz, good, qual)
    _headline(res, sz, good, qual)


def label(g: dict) -> str:
    if g["mode"] == "none":
        return "elastic, b stays (baseline)"
    if g["mode"] == "strict":
        return "strict (min_regions all), b crashes"
    hb = f"heartbeat {g['heartbeat_s']:g} s" if g["heartbeat_s"] else "heartbeats off"
    return f"elastic, b {'crashes' if g['mode'] == 'crash' else 'stops (stop file)'}, grace_s {g['grace_s']:g}, {hb}"


def qlabel(q: dict) -> str:
    if q["absent"] is None:
        return "a alone (1-region run)"
    if q.get("withhold"):
        return f"b stays, publishes nothing in rounds {q['withhold'][0]}-{q['withhold'][-1]} (control)"
    if not q["absent"]:
        return "always present"
    if q["at_end"]:
        return f"b leaves for good after round {q['rounds'] - q['absent']}"
    return f"b leaves after round {q['missed'][0] - 1 if q['missed'] else '?'}, then back"


def loss_gap(qual: list[dict]) -> Callable[[dict], float]:
    """A quality run's held-out loss against the always-present run with the same seed, as a ratio - 1."""
    bases = {q["seed"]: q for q in qual if q["absent"] == 0 and not q["withhold"]}

    def gap(q: dict) -> float:  # against always present with the same seed
        return q["loss"] / bases[q["seed"]]["loss"] - 1

    return gap


def quarter_away(sz: Sizes, qual: list[dict]) -> tuple[int | None, list[dict]]:
    """The mid-run absence closest to 25% of the rounds, and its runs (one per seed)."""
    mids = [q for q in qual if q["absent"] and not q["at_end"] and not q["withhold"]]
    n25 = min({q["absent"] for q in mids}, key=lambda a: abs(a / (sz.q_steps // sz.q_h) - 0.25), default=None)
    q25s = [q for q in mids if q["absent"] == n25]
    return n25, q25s


def _goodput_setup(sz: Sizes) -> list[str]:
    g_round_s = sz.g_h * sz.g_sleep_s
    n_rounds = sz.g_steps // sz.g_h
    return [
        "2 regions (a, b), each one process of the real trainer (`python -m sbatch_gen.train`, gloo, CPU; no "
        "torchrun: a 1-process region needs no agent), meeting only in an fs mailbox (local directory). DiLoCo "
        f"with plain averaging (outer lr {OUTER_LR:g}, momentum {OUTER_MOMENTUM:g}) in every variant: over a few "
        "hundred steps from scratch the defaults (0.7, Nesterov 0.9) train worse (bench/diloco.py). Data: the "
        f"stdlib source cut into three shards (a, b, {HELDOUT}; `sbatch_gen.train.data.prepare`, "
        f"{DATA_BYTES / 1e6:g} MB); each region trains on its own, nobody on `{HELDOUT}`.",
        f"Parts 1-2 (idle, goodput): {sz.g_steps} steps, H={sz.g_h} ({n_rounds} rounds), a "
        f"{sz.g_model['n_layers']}-layer width-{sz.g_model['d_model']} GPT paced to >= {sz.g_sleep_s:g} s per "
        f"step (`SBATCH_GEN_TEST_STEP_SLEEP_S`, standing in for GPU compute), so a round is ~{g_round_s:g} s of "
        f"steps. grace_s {sz.g_grace_s:g} = {sz.g_grace_s / g_round_s:.0%} of that (the eu/us sites: grace_s 30 "
        f"to ~45 s rounds, 67%, sites/_base/llm-xr-1.yaml); heartbeat_s {sz.g_heartbeat_s:g} = "
        f"{sz.g_heartbeat_s / g_round_s:.0%} of a round (the sites: 5 s, 11%), so a region whose heartbeat "
        f"stands still for 3 beats ({3 * sz.g_heartbeat_s:g} s on a's clock) counts as gone"
        + (
            "; a second crash run has heartbeats off (heartbeat_s null: a waits grace_s in every round b misses)"
            if sz.g_no_heartbeat
            else ""
        )
        + f". snapshot_every {sz.g_snapshot_every}, keep_rounds "
        f"{sz.g_keep_rounds} (the sites' values), checkpoints every {sz.g_ckpt_every} steps.",
        f"Schedule (every goodput variant but the baseline): both start; once round {sz.g_leave_round} is "
        "committed, b is SIGKILLed (crash: nothing tells a) or its stop file is created (planned stop: b "
        f"checkpoints, announces its leave in the mailbox, exits 42); {sz.g_away_s:g} s later b is started again "
        "with `--resume auto` and fast-forwards to the run. Strict: min_regions all, timeout_s "
        f"{sz.g_strict_timeout_s:g}; a region whose round finds no quorum exits 42 and is started again at once "
        "(a requeue without queue time), until b is back. b away: from its kill/stop to its presence record "
        "saying it joined again (fast-forward done).",
        "Goodput of the survivor a = (sum of a's `step_time_s` - sum of a's `xr_wait_s`) / W, where W is a's "
        "wall time from its `xr_align` event (training starts) to its final `xr_leave` (finished): the share of "
        "the window a spent in steps and not waiting for b in rounds. Lost: waits in rounds, and everything "
        "outside steps (checkpoint saves, metrics; for strict the blocked round, exits and restarts). The round's "
        "own exchange (upload, download, average) counts as training, as in every DiLoCo run.",
    ]


def _quality_setup(sz: Sizes) -> list[str]:
    return [
        f"Part 3 (quality): {sz.q_steps} steps, H={sz.q_h} ({sz.q_steps // sz.q_h} rounds), a "
        f"{sz.q_model['n_layers']}-layer width-{sz.q_model['d_model']} GPT, batch {sz.q_batch} x "
        f"{sz.q_model['seq_len']} tokens, not paced. One process of a trains all of it (min_regions 1, "
        f"grace_s {Q_GRACE_S:g}: while b is in the run every round waits for it, none closes on a timer). b ends "
        f"after round {sz.q_first} (`--max-steps`: its leave is on record, a's rounds then close at once) and is "
        "started again (`--resume auto`), timed from its start-up and a's pace to join during the round that "
        "leaves it away for 25% / 50% of the rounds; it fast-forwards to the run's step and continues from its "
        "own data position and optimizer state. Which round it first takes part in depends on its start-up "
        "(+-1 round): the table gives the rounds it really missed, from a's metrics. a's steps and LR schedule "
        "are the same in every variant; b trains fewer steps."
        + (
            f" Controls: b leaving for good {sz.q_end} rounds before the end (no return; deterministic), and a "
            "alone (b absent from every round)."
            if sz.q_end
            else ""
        ),
        f"Held-out loss: the final `model.safetensors` (a's; b's is checked bit-identical) evaluated in the bench "
        f"process on CPU, mean next-byte cross-entropy over {sz.q_eval_windows} fixed windows of "
        f"{sz.q_model['seq_len']} tokens spread evenly over the `{HELDOUT}` shard.",
    ]


def _goodput_tables(res: Result, good: list[dict]) -> None:
    rows = []
    for g in good:
        away = f"{g['away_s']:.0f} s ({g['away_share']:.0%})" if g["away_s"] == g["away_s"] else "-"
        rows.append(
            [
                label(g),
                g["rounds"],
                f"{g['missed']} ({g['missed'] / g['rounds']:.0%})",
                g["b_late"] if g["mode"] != "none" else "-",
                away,
                g["wait_max"],
                g["wait_median"],
                g["wait_s"],
                g["missed_wait_s"],
                g["outside_s"],
                g["wall_s"],
                f"{g['goodput']:.1%}",
                "{}, {}".format(*g["requeues"]),
            ]
        )
    res.table(
        "Survivor a: idle time and goodput (parts 1 and 2)",
        [
            "variant",
            "a's rounds",
            "rounds b missed",
            "of which b back but late",
            "b away (share of W)",
            "wait max s (missed rounds)",
            "wait median s (missed)",
            "a's waits in rounds s",
            "... in missed rounds s",
            "outside steps s",
            "W s",
            "goodput",
            "requeues (a, b)",
        ],
        rows,
        "goodput",
    )
    n = max(len(g["round_waits"]) for g in good)
    prow = []
    for i in range(1, n + 1):
        row: list = [i]
        for g in good:
            w = {r: (x, m) for r, x, m in g["round_waits"]}.get(i)
            row.append("-" if w is None else f"{w[0]:.2f}" + ("" if w[1] else " (b out)"))
        prow.append(row)
    res.table(
        "a's wait for b per round, s ('b out': closed without b; '-': no step record, see notes)",
        ["round", *[label(g) for g in good]],
        prow,
        "rounds",
    )


def _quality_table(res: Result, qual: list[dict]) -> None:
    gap = loss_gap(qual)
    qrows = []
    for q in qual:
        share = f"{len(q['missed']) / q['rounds']:.0%}" if q["absent"] is not None else "100%"
        qrows.append(
            [
                qlabel(q),
                q["seed"],
                share,
                ",".join(map(str, q["missed"])) if q["missed"] else "-",
                q["a_steps"],
                q["b_steps"],
                q["loss"],
                f"{gap(q):+.2%}",
                "-" if q["same"] is None else q["same"],
            ]
        )
    res.table(
        "Quality: final held-out loss, same step budget (part 3)",
        [
            "variant",
            "seed",
            "rounds b missed",
            "which",
            "a's steps",
            "b's steps",
            "held-out loss",
            "vs always present (same seed)",
            "a == b bitwise",
        ],
        qrows,
        "quality",
    )


def _goals(res: Result, sz: Sizes, good: list[dict], qual: list[dict]) -> None:
    elastic = [g for g in good if g["mode"] in ("crash", "stop")]
    for g in elastic:
        ok = g["wait_max"] <= g["grace_s"] + POLL_S if g["missed"] else None
        res.goal(
            f"survivor's wait per missed round <= grace_s + one poll ({g['grace_s']:g} + {POLL_S:g} s), "
            f"{label(g)}",
            f"max {fmt(g['wait_max'])} s, median {fmt(g['wait_median'])} s over {g['missed']} rounds",
            ok,
        )
    for g in elastic:  # (the crash with heartbeats off is the comparison: reported, not a goal)
        compare = g["mode"] == "crash" and not g["heartbeat_s"]
        res.goal(
            f"goodput >= 95%, {label(g)}" + (" (comparison)" if compare else ""),
            f"{g['goodput']:.1%} (b missed {g['missed']} of {g['rounds']} rounds, away {fmt(g['away_s'])} s "
            f"of W {g['wall_s']:.0f} s)",
            None if compare else g["goodput"] >= 0.95,
        )
    strict = next(g for g in good if g["mode"] == "strict")
    res.goal(
        "goodput, strict (min_regions all, today's behaviour), same schedule",
        f"{strict['goodput']:.1%} (a requeued {strict['requeues'][0]}x, b {strict['requeues'][1]}x; "
        f"W {strict['wall_s']:.0f} s)",
        None,
    )
    _, q25s = quarter_away(sz, qual)
    controls = [q for q in qual if q["withhold"]]
    gap = loss_gap(qual)
    if q25s:
        d = statistics.mean(gap(q) for q in q25s)
        res.goal(
            "held-out loss with b absent from ~25% of the rounds (and back) <= +1% vs always present"
            + (f" (mean over {len(q25s)} seeds)" if len(q25s) > 1 else ""),
            f"{d:+.2%} ("
            + "; ".join(
                f"seed {q['seed']}: {gap(q):+.2%}, b missed {len(q['missed'])} of {q['rounds']} rounds"
                for q in q25s
            )
            + ")",
            d <= 0.01,
        )
    if controls:
        dc = statistics.mean(gap(q) for q in controls)
        res.goal(
            "the same rounds' tokens lost without any leave or rejoin (control: b stays, publishes nothing "
            "there)" + (f", mean over {len(controls)} seeds" if len(controls) > 1 else ""),
            f"{dc:+.2%} ("
            + "; ".join(f"seed {q['seed']}: {gap(q):+.2%}, {len(q['missed'])} rounds" for q in controls)
            + ")",
            None,
        )


def _headline(res: Result, sz: Sizes, good: list[dict], qual: list[dict]) -> None:
    gap = loss_gap(qual)
    strict = next(g for g in good if g["mode"] == "strict")
    for g in good:
        res.headline[f"survivor goodput, {label(g)}"] = f"{g['goodput']:.1%}" + (
            f" (b missed {g['missed'] / g['rounds']:.0%} of the rounds)" if g["missed"] else ""
        )
    crash = next(g for g in good if g["mode"] == "crash" and g["heartbeat_s"])
    off = next((g for g in good if g["mode"] == "crash" and not g["heartbeat_s"]), None)
    res.headline["survivor wall time for the same steps, strict vs elastic crash"] = (
        f"{strict['wall_s'] / crash['wall_s']:.2f}x"
    )
    for g in (crash, off) if off is not None else (crash,):
        res.headline[f"max wait per missed round, {label(g)}"] = f"{g['wait_max']:.2f} s"
    for q in qual:
        if q["absent"]:
            seed = f", seed {q['seed']}" if q["seed"] != sz.q_seeds[0] else ""
            res.headline[
                f"held-out loss, {qlabel(q)} ({len(q['missed']) / q['rounds']:.0%} of rounds{seed})"
            ] = f"{gap(q):+.2%}"
