"""``bench elastic``: the page's notes, what the numbers say beyond the tables (crash detection, the
budget for heartbeats off, the planned stop, what b's absence costs against the control)."""

from __future__ import annotations

import statistics

from .common import Result
from .elastic_report import loss_gap, quarter_away
from .elastic_sizes import Sizes


def notes(res: Result, sz: Sizes, good: list[dict], qual: list[dict]) -> None:
    crash = next(g for g in good if g["mode"] == "crash" and g["heartbeat_s"])
    off = next((g for g in good if g["mode"] == "crash" and not g["heartbeat_s"]), None)
    res.notes.append(_crash_note(crash))
    if off is not None:
        res.notes.append(_heartbeats_off_note(good, off))
    stop = next((g for g in good if g["mode"] == "stop"), None)
    if stop is not None:
        res.notes.append(_stop_note(sz, stop))
    n25, q25s = quarter_away(sz, qual)
    controls = [q for q in qual if q["withhold"]]
    if q25s and controls:
        res.notes.append(_cost_note(sz, qual, n25, q25s, controls))
    res.notes += [
        "Strict: a's round waits for b until timeout_s, then a checkpoints and exits 42; each requeue pays the "
        "start-up again and re-enters the pending round at start-up (logged as an `xr_pending_round` event, not "
        "a step record: its time is in 'outside steps'). A timeout_s shorter than a start-up makes the two "
        "regions requeue each other in turn (the returning one finds the other restarting; seen with 2 s in "
        "--quick trials), so it is set above a start-up here. W holds the whole time b was away.",
        "Time outside steps (checkpoint saves, metrics writes) is counted as lost in every variant.",
        "Quality runs are deterministic where no timing decides membership (CPU, deterministic algorithms, fixed "
        "seeds): always present, the end control and a alone give bit-identical losses on a rerun. The mid-run "
        "variants depend on the round in which b rejoins and the step it continues at (both from its start-up "
        "time), so they move a little between runs; the table gives what happened.",
    ]


def _max_share(loss: float, grace_s: float, round_s: float) -> float:
    """Largest share f of the rounds b may miss (crash) with a's idle share f*g/(T + f*g) <= loss."""
    return loss * round_s / (grace_s * (1 - loss)) if loss > 0 else 0.0


def _crash_note(crash: dict) -> str:
    closes = crash["missed_closes"]
    by_reason = {why: [w for _, y, w in closes if y == why] for why in dict.fromkeys(y for _, y, _ in closes)}
    return (
        (
            f"Crash with heartbeats (every {crash['heartbeat_s']:g} s): a reads b's heartbeat while it waits in a round "
            f"and, on its own clock, treats b as gone once the value has stood still for 3 beats "
            f"({3 * crash['heartbeat_s']:g} s of watching); it remembers what it saw, so only the first round after the "
            "crash waits for that, the next ones close at once. The rounds b missed closed as: "
            + "; ".join(
                f"{why} {len(ws)}x (wait max {max(ws):.2f} s, median {statistics.median(ws):.2f} s)"
                for why, ws in by_reason.items()
            )
            + "."
            + (
                " ('grace': b was beating again, restarted but not yet back in the rounds: a waits up to grace_s for a "
                "live region, as it should.)"
                if "grace" in by_reason
                else ""
            )
        )
        if closes
        else "Crash with heartbeats: b missed no round."
    )


def _heartbeats_off_note(good: list[dict], off: dict) -> str:
    round_s = statistics.median([r for g in good for r in g["round_s"]] or [float("nan")])
    baseline = next((g for g in good if g["mode"] == "none"), None)
    base_loss = 1 - baseline["goodput"] if baseline else 0.0
    budget = 0.05 - base_loss
    f_max = _max_share(budget, off["grace_s"], round_s)
    g_max = budget * round_s / (0.3 * (1 - budget)) if budget > 0 else 0.0
    if budget <= 0:
        return f"The baseline (b present) already loses {base_loss:.1%} of W: no room for a crash."
    return (
        f"Crash with heartbeats off: a cannot tell an absent region from a slow one, so each round b misses "
        f"costs a grace_s (median wait {off['wait_median']:.2f} s at grace_s {off['grace_s']:g}). A round "
        f"here is {round_s:.1f} s of a's steps (median)"
        + (
            f" and a loses {base_loss:.1%} with b present (baseline: b's start-up lag in round 1, checkpoints)"
            if baseline
            else ""
        )
        + f", so >= 95% leaves {budget:.1%} for the crash: idle share f*g/(T + f*g) <= that allows b to miss "
        f"at most {f_max:.0%} of the rounds at grace_s {off['grace_s']:g} (the sites' ratio), or, for b "
        f"missing 30% of the rounds, grace_s <= {g_max:.2f} s ({g_max / round_s:.0%} of a round)."
    )


def _stop_note(sz: Sizes, stop: dict) -> str:
    back = [
        (r, w, m) for r, w, m in stop["round_waits"] if r > sz.g_leave_round and w > 0.5 * stop["grace_s"]
    ]
    return (
        f"Planned stop: b's leave is on record in the mailbox and a's rounds close at once while b is away "
        f"(median wait {stop['wait_median']:.3f} s, max {stop['wait_max']:.3f} s). On its return b continues at "
        "the run's current step (estimated from the last rounds' close times), so its first round back ends "
        "about with a's"
        + (
            ": a's waits above grace_s/2 after b left: "
            + ", ".join(f"round {r} {w:.2f} s{'' if m else ' (b late, dropped)'}" for r, w, m in back)
            if back
            else "; no round after b left made a wait more than grace_s/2"
        )
        + "."
    )


def _cost_note(sz: Sizes, qual: list[dict], n25: int | None, q25s: list[dict], controls: list[dict]) -> str:
    gap = loss_gap(qual)
    end = next((q for q in qual if q["at_end"]), None)
    d, dc = statistics.mean(gap(q) for q in q25s), statistics.mean(gap(q) for q in controls)
    steps_lost = statistics.mean(sz.q_steps - q["b_steps"] for q in q25s)
    in_missed = statistics.mean(len(q["missed"]) * sz.q_h for q in q25s)
    return (
        f"What b's absence costs, separated by the control: b away for ~{n25} rounds mid-run and back costs "
        f"{d:+.2%} (mean over seeds; b trains {steps_lost:.0f} fewer steps, {in_missed:.0f} of them in the "
        f"rounds it missed, the rest its start-up: it continues at the run's step). The control loses b's "
        f"tokens in the same rounds with no leave, restart or rejoin (b trains every step, its deltas are "
        f"dropped): {dc:+.2%}. So about {dc / d:.0%} of the cost is the tokens b did not contribute, which no "
        "rejoin can give back; the leave-and-rejoin itself (fewer steps from start-up, optimizer moments from "
        f"before the absence) adds {d - dc:+.2%}."
        + (
            f" The tokens' position matters too: b missing the last {len(end['missed'])} rounds instead (lower "
            f"learning rate, {end['b_steps']} b-steps) costs {gap(end):+.2%}."
            if end is not None
            else ""
        )
    )
