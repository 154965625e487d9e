"""Faults and paces the tests and benchmarks inject into the trainer, from outside its code: the trainer's
own modules carry no test hook. Torch-free to import (the trainer is imported when a fault is installed).

- :func:`withholding`: a region publishes nothing in some rounds, as if its payload always arrived after
  the round closed; it trains on and applies the committed update like any late region. In a test:
  ``monkeypatch.setattr(Exchange, "upload", withholding(Exchange.upload, "us", {2}))``.
- :func:`starting_together`: regions start their first step together, whichever took longer to start up
  (a fresh run's first region publishes theta0 and trains on at once; under load its peer can still be
  importing torch while it passes the round a benchmark waits for).
- :func:`sleeping`: every step (or only some ranks' steps: an injected straggler) sleeps after its
  cross-region round, standing in for a faster device's compute, or giving a test time to act mid-run;
  with ``SBATCH_GEN_TEST_STEP_SLEEP_WHILE`` (a path) only while that file exists, so that a test stops the
  pace once what it had to do mid-run is done (a requeued attempt, a continuation job, inherit the variables).
- ``SBATCH_GEN_TEST_LEASE_PERIOD_S``: the run-dir lease's heartbeat period (:mod:`sbatch_gen.train.lease`,
  30 s) shortened, so that a test sees a lease go stale, or a takeover stop its holder, in seconds.
- ``SBATCH_GEN_TEST_SNAPSHOT_GIVE_WAY_S``: how long an outer snapshot's object waits for the rounds' transfers
  in flight (:mod:`sbatch_gen.train.xr.traffic`, 10 s); 0: it never waits, as before the rounds went first
  (``bench.goals40_diag streaming`` runs both side by side).
- ``SBATCH_GEN_TEST_NO_CLEANUP``: no mailbox cleanup behind the rounds (snapshots are still uploaded), for
  ``bench.goals40_diag cleanup``: what the per-round cleanup costs a streaming run.
- ``SBATCH_GEN_TEST_STEP_GATE``: a path; every step waits after its cross-region round while that file
  exists (:func:`gated`), so that a test holds a region at a step boundary until another has done something
  (a restarted region's rejoin) whatever the machine's load.
- :func:`holding_stop_save`: the stop checkpoint waits between writing its files and marking them complete,
  as a large checkpoint takes (the preemption tests: a stop that Slurm's kill reached would be cut short).
- ``python -m sbatch_gen.testing.faults ARGS``: the trainer (``python -m sbatch_gen.train ARGS``) with the
  faults that the environment names (:data:`FAULT_ENVS`) installed first. :func:`trainer_module` names
  the module to run for an environment (:func:`~sbatch_gen.testing.regions.launch_region`'s default); the
  end-to-end tests render their jobs with it as ``trainer.module``.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# "<region>:<round>,<round>,...": that region publishes nothing in those rounds (not an SBATCH_GEN_XR_*
# name: those are the trainer's options, which it refuses when it does not know them)
ENV_WITHHOLD_ROUNDS = "SBATCH_GEN_TEST_WITHHOLD_ROUNDS"
# "<directory>:<processes>": every process waits before its first step until that many have arrived there
ENV_START_TOGETHER = "SBATCH_GEN_TEST_START_TOGETHER"
START_TOGETHER_TIMEOUT_S = 300.0
# seconds every step sleeps after its cross-region round; with ENV_STEP_SLEEP_RANKS ("1,3") only those ranks
ENV_STEP_SLEEP = "SBATCH_GEN_TEST_STEP_SLEEP_S"
ENV_STEP_SLEEP_RANKS = "SBATCH_GEN_TEST_STEP_SLEEP_RANKS"
# a path: with ENV_STEP_SLEEP, a step sleeps only while that file exists
ENV_STEP_SLEEP_WHILE = "SBATCH_GEN_TEST_STEP_SLEEP_WHILE"
# a path: every step waits after its cross-region round while that file exists
ENV_STEP_GATE = "SBATCH_GEN_TEST_STEP_GATE"
# seconds the stop checkpoint waits between writing its files and its marker
ENV_STOP_SAVE_HOLD = "SBATCH_GEN_TEST_STOP_SAVE_HOLD_S"
# seconds between the run-dir lease's heartbeats (sbatch_gen.train.lease.DEFAULT_PERIOD_S otherwise)
ENV_LEASE_PERIOD = "SBATCH_GEN_TEST_LEASE_PERIOD_S"
# seconds a snapshot object gives way to the rounds (sbatch_gen.train.xr.traffic.GIVE_WAY_MAX_S otherwise)
ENV_SNAPSHOT_GIVE_WAY = "SBATCH_GEN_TEST_SNAPSHOT_GIVE_WAY_S"
# "1": the outer sync deletes nothing behind its rounds (OuterSync._cleanup_now does nothing)
ENV_NO_CLEANUP = "SBATCH_GEN_TEST_NO_CLEANUP"
FAULT_ENVS = (
    ENV_WITHHOLD_ROUNDS,
    ENV_START_TOGETHER,
    ENV_STEP_SLEEP,
    ENV_STEP_SLEEP_RANKS,
    ENV_STEP_SLEEP_WHILE,
    ENV_STEP_GATE,
    ENV_STOP_SAVE_HOLD,
    ENV_LEASE_PERIOD,
    ENV_SNAPSHOT_GIVE_WAY,
    ENV_NO_CLEANUP,
)
MODULE = "sbatch_gen.testing.faults"
TRAINER = "sbatch_gen.train"


def trainer_module(environ: dict[str, str] | None) -> str:
    """The module to run the trainer as with ``environ``: this one (:data:`MODULE`) when it names a fault,
    else the trainer itself, which reads none of them."""
    return MODULE if any((environ or {}).get(name) for name in FAULT_ENVS) else TRAINER


def _round(tag: str) -> int | None:
    return int(tag[1:]) if tag[:1] == "r" and tag[1:].isdigit() else None


def withholding(upload: Callable[..., Any], region: str, rounds: Iterable[int]) -> Callable[..., Any]:
    """``Exchange.upload`` (``upload``), except that ``region``'s round payloads (kinds delta and grad) of
    ``rounds`` publish nothing: no object, no claim (:func:`~sbatch_gen.train.xr.rounds.run_round` then
    waits for the round without a manifest of its own, and finds itself late). Every rank of the region
    must run it, as every rank calls the upload."""
    withheld = frozenset(int(r) for r in rounds)

    def withheld_upload(self, tag, name, kind, *args, **kw):
        if kind in ("delta", "grad") and name == region and _round(tag) in withheld:
            return None, {}, 0
        return upload(self, tag, name, kind, *args, **kw)

    return withheld_upload


def parse_withheld(value: str) -> tuple[str, frozenset[int]]:
    """``"us:2,7"`` -> ``("us", {2, 7})``."""
    region, _, rounds = value.partition(":")
    if not region or not rounds:
        raise ValueError(f"{ENV_WITHHOLD_ROUNDS}: {value!r} is not <region>:<round>,<round>,...")
    return region.strip(), frozenset(int(r) for r in rounds.split(",") if r.strip())


def starting_together(begin: Callable[..., Any], directory: str, processes: int) -> Callable[..., Any]:
    """``begin`` (the trainer's begin_loop, called once after the resume and the join), except that it first
    marks this process arrived in ``directory`` and waits until ``processes`` have."""

    def begin_together(*args, **kw):
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / str(os.getpid())).touch()
        deadline = time.monotonic() + START_TOGETHER_TIMEOUT_S
        while len(list(d.iterdir())) < processes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{ENV_START_TOGETHER}: {processes} processes never arrived in {d}")
            time.sleep(0.02)
        return begin(*args, **kw)

    return begin_together


def sleeping(
    cross_region_round: Callable[..., Any],
    sleep_s: float,
    ranks: Iterable[int] | None,
    while_path: str | None = None,
):
    """The loop's ``_cross_region_round(t, step)`` (``cross_region_round``, run after every optimizer step,
    with or without a cross-region sync), followed by a sleep of ``sleep_s`` on the ranks ``ranks`` (None:
    every rank) unless it ended the loop (None: no quorum); with ``while_path``, only while that file exists."""
    only = None if ranks is None else frozenset(ranks)

    def round_then_sleep(t, step):
        out = cross_region_round(t, step)
        if (
            out is not None
            and (only is None or t.info.rank in only)
            and (not while_path or os.path.exists(while_path))
        ):
            time.sleep(sleep_s)
        return out

    return round_then_sleep


def gated(cross_region_round: Callable[..., Any], gate: str) -> Callable[..., Any]:
    """The loop's ``_cross_region_round(t, step)``, then a wait while the file ``gate`` exists."""

    def round_then_gate(t, step):
        out = cross_region_round(t, step)
        while os.path.exists(gate):
            time.sleep(0.05)
        return out

    return round_then_gate


def holding_stop_save(hand_off: Callable[..., Any], hold_s: float) -> Callable[..., Any]:
    """finish's ``hand_off(t)`` (``hand_off``: the stop's leave and checkpoint), except that its checkpoint
    waits ``hold_s`` between writing its files and marking them complete. A periodic save still in flight
    completes first, without the wait."""

    def hand_off_holding(t):
        ckpt = t.ckpt
        save = ckpt.save

        def save_holding(*args, **kw):
            ckpt.wait()
            mark = ckpt._finish  # writes the marker: the checkpoint is complete once it returns

            def held_mark(*a, **k):
                time.sleep(hold_s)
                return mark(*a, **k)

            ckpt._finish = held_mark
            try:
                return save(*args, **kw)
            finally:
                del ckpt._finish

        ckpt.save = save_holding
        try:
            return hand_off(t)
        finally:
            del ckpt.save

    return hand_off_holding


def _patch(module: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    """``module.name = wrap(module.name)``; refused when the trainer no longer has ``name`` (a fault that
    patched nothing would pass silently)."""
    if not callable(getattr(module, name, None)):
        raise RuntimeError(
            f"sbatch_gen.testing.faults: {module.__name__}.{name} is gone; the fault needs a new seam"
        )
    setattr(module, name, wrap(getattr(module, name)))


def install_from_env(environ: dict[str, str] | None = None) -> None:
    """Install the faults the environment names (:data:`FAULT_ENVS`) in this process."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_WITHHOLD_ROUNDS, "")
    if value:
        from sbatch_gen.train.xr.exchange import Exchange

        region, rounds = parse_withheld(value)
        _patch(Exchange, "upload", lambda f: withholding(f, region, rounds))
    value = env.get(ENV_START_TOGETHER, "")
    if value:
        from sbatch_gen.train import trainer

        directory, _, n = value.rpartition(":")
        _patch(trainer, "begin_loop", lambda f: starting_together(f, directory, int(n)))
    sleep_s = float(env.get(ENV_STEP_SLEEP, "") or 0)
    if sleep_s > 0:
        from sbatch_gen.train import loop

        listed = env.get(ENV_STEP_SLEEP_RANKS, "").strip()
        ranks = {int(r) for r in listed.split(",") if r.strip()} if listed else None
        while_path = env.get(ENV_STEP_SLEEP_WHILE, "").strip() or None
        _patch(loop, "_cross_region_round", lambda f: sleeping(f, sleep_s, ranks, while_path))
    gate = env.get(ENV_STEP_GATE, "")
    if gate:
        from sbatch_gen.train import loop

        _patch(loop, "_cross_region_round", lambda f: gated(f, gate))
    hold_s = float(env.get(ENV_STOP_SAVE_HOLD, "") or 0)
    if hold_s > 0:
        from sbatch_gen.train import finish

        _patch(finish, "hand_off", lambda f: holding_stop_save(f, hold_s))
    period_s = float(env.get(ENV_LEASE_PERIOD, "") or 0)
    if period_s > 0:
        from sbatch_gen.train import lease

        _patch(lease, "default_period", lambda f: lambda: period_s)
    value = env.get(ENV_SNAPSHOT_GIVE_WAY, "").strip()
    if value:
        from sbatch_gen.train.xr import traffic

        if not isinstance(getattr(traffic, "GIVE_WAY_MAX_S", None), float):
            raise RuntimeError(
                "sbatch_gen.testing.faults: traffic.GIVE_WAY_MAX_S is gone; the fault needs a new seam"
            )
        traffic.GIVE_WAY_MAX_S = float(value)
    if env.get(ENV_NO_CLEANUP, "").strip() == "1":
        from sbatch_gen.train.xr.sync import OuterSync

        _patch(OuterSync, "_cleanup_now", lambda f: lambda self, ex, r, need_snapshot: None)


def main() -> None:
    """The trainer, with the environment's faults installed: ``python -m sbatch_gen.testing.faults ARGS``."""
    install_from_env()
    sys.argv[0] = "sbatch_gen.train"
    runpy.run_module("sbatch_gen.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
