"""A stand-in for a foreign trainer, for the tests of trainer.stop_protocol signal and none. Torch-free.

The rendered jobs start it as the trainer (``paths.code_dir`` = this directory, ``trainer.module`` =
sbg_stop_probe): torchrun runs ``python -m sbg_stop_probe <the rendered trainer argv>`` on every node, and
``trainer.extra_args`` choose what it does (``--probe-mode``, ...). It reads ``--run-dir`` and writes, under
``<run dir>/probe/``, one file per rank R (the ``RANK`` torchrun gives it):

- ``start.attempt-A.rank-R.json`` at start: pid, attempt (``SLURM_RESTART_COUNT`` or
  ``SBATCH_GEN_ATTEMPT``), what it resumes from, and its ``VERSION``.
- ``--probe-mode signal`` (a trainer that saves on a signal): it records every delivery of SIGUSR1, SIGUSR2
  and SIGTERM in ``signals.rank-R`` (one line each: attempt and signal name); on the first one it saves
  slowly (sleeps ``--probe-save-s``), writes ``saved.rank-R`` (JSON: attempt, signal, save time) and exits
  0. Started again with ``saved.rank-R`` present, it has resumed: it exits 0 at once (training done).
- ``--probe-mode end`` (a trainer that has nothing left to do): writes ``done.attempt-A.rank-R`` (the time) and
  exits 0 at once; the first time, the ranks of the nodes ``--probe-hang-nodes`` name hang instead (until
  ``--probe-max-s``; ``hung.node-N.local-L`` notes it: JSON attempt and rank), as a node stuck after the others
  finished. A node is named by its index in the launch (``SBATCH_GEN_NODE_RANK`` or ``SLURM_NODEID``), not by
  its ranks: torch's c10d rendezvous orders the agents by address and pid, so which node gets ranks 0.. is not
  the launch's order, and may differ from one attempt to the next. So "the first time" is the node's (and
  local rank's) first time, never the rank's: a node that got other ranks in the next attempt must not hang
  again.
- ``--probe-mode none`` (a trainer that only checkpoints periodically): no signal handler; every
  ``--probe-step-s`` it takes a step and writes its step to ``ckpt.rank-R`` (atomically). Started again with
  a ``ckpt.rank-R``, it resumes from that step and exits 0 after ``--probe-more-steps`` more.

A first attempt (nothing to resume from) runs until it is stopped, at most ``--probe-max-s`` seconds (then it
exits 3), so that a test that never stops it cannot hang.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
# Which code this is, in its start record: the pin test edits it between two attempts.
VERSION = "as-submitted"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sbg_stop_probe")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--probe-mode", choices=["signal", "none", "end"], required=True)
    ap.add_argument("--probe-hang-nodes", default="")
    ap.add_argument("--probe-save-s", type=float, default=3.0)
    ap.add_argument("--probe-step-s", type=float, default=0.2)
    ap.add_argument("--probe-more-steps", type=int, default=5)
    ap.add_argument("--probe-max-s", type=float, default=300.0)
    args, _ = ap.parse_known_args(argv)  # the rest of the rendered trainer argv: --config, --resume, ...

    rank = int(os.environ.get("RANK", "0"))
    node = os.environ.get("SBATCH_GEN_NODE_RANK") or os.environ.get("SLURM_NODEID") or "0"
    attempt = int(os.environ.get("SLURM_RESTART_COUNT") or os.environ.get("SBATCH_GEN_ATTEMPT") or 0)
    d = Path(args.run_dir) / "probe"
    d.mkdir(parents=True, exist_ok=True)
    saved = d / f"saved.rank-{rank}"
    ckpt = d / f"ckpt.rank-{rank}"
    got: list[str] = []

    def on_signal(signum: int, frame: object) -> None:  # noqa: ARG001 - signal API
        name = signal.Signals(signum).name
        got.append(name)
        with open(d / f"signals.rank-{rank}", "a") as f:
            f.write(f"{attempt} {name}\n")

    resumed: object = None
    if args.probe_mode == "signal":
        if saved.exists():
            resumed = json.loads(saved.read_text())
        else:
            for sig in SIGNALS:
                signal.signal(sig, on_signal)
    elif ckpt.exists():
        resumed = int(ckpt.read_text())
    _write(
        d / f"start.attempt-{attempt}.rank-{rank}.json",
        json.dumps(
            {"pid": os.getpid(), "attempt": attempt, "rank": rank, "resumed": resumed, "version": VERSION}
        ),
    )
    print(f"probe rank {rank} attempt {attempt}: {args.probe_mode}, resumed from {resumed}", flush=True)

    if args.probe_mode == "end":
        hung = d / f"hung.node-{node}.local-{os.environ.get('LOCAL_RANK', '0')}"
        if node in args.probe_hang_nodes.split(",") and not hung.exists():
            _write(hung, json.dumps({"attempt": attempt, "rank": rank}))
            time.sleep(args.probe_max_s)
            return 3
        _write(d / f"done.attempt-{attempt}.rank-{rank}", repr(time.time()))
        return 0
    if args.probe_mode == "signal":
        if resumed is not None:
            return 0
        deadline = time.monotonic() + args.probe_max_s
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        if not got:
            return 3
        print(f"probe rank {rank}: {got[0]}: saving ({args.probe_save_s} s)", flush=True)
        t0 = time.monotonic()
        time.sleep(args.probe_save_s)  # a slow save: torchrun's agent must wait for it
        _write(saved, json.dumps({"attempt": attempt, "signal": got[0], "save_s": time.monotonic() - t0}))
        print(f"probe rank {rank}: saved", flush=True)
        return 0

    step = resumed if isinstance(resumed, int) else 0
    stop_at = step + args.probe_more_steps if resumed is not None else None
    deadline = time.monotonic() + args.probe_max_s
    while time.monotonic() < deadline:
        time.sleep(args.probe_step_s)
        step += 1
        _write(ckpt, str(step))
        if stop_at is not None and step >= stop_at:
            print(f"probe rank {rank}: done at step {step}", flush=True)
            return 0
    return 3


if __name__ == "__main__":
    sys.exit(main())
