"""The metric sinks' own process: it follows metrics.jsonl and feeds the sinks, outside the training process.

Rank 0 starts it (:class:`SinkProcess`, from :meth:`.metrics.MetricsWriter.open_sinks`) when the train config
lists sinks; it runs ``python -m sbatch_gen.train.sinkproc`` at a lower priority (``os.nice``), so the sinks'
Python work (TensorBoard's protobufs, W&B's log calls) never holds the training process's GIL: the step pays
for its metrics.jsonl line only. The process:

- starts the sinks (:func:`.sinks.open_sinks`; W&B's start may wait on the network, the trainer does not);
- reads metrics.jsonl from the byte where this attempt began (a resumed attempt continues the runs as
  :mod:`.sinks` says), every ``poll_s`` seconds, and hands the complete lines read to the sinks as one batch;
  a line not yet ended by its newline waits for the next read, one that is not JSON (cut by a crash, then
  appended to) is skipped with a warning;
- watches the trainer: its stdin is a pipe whose other end only the trainer holds, so EOF comes when the
  trainer closes it (its normal end, a stop) or dies (SIGKILL included); a changed parent pid says the same.
  Then it reads the file to its end, closes the sinks (W&B's finish) and exits: it never outlives its
  trainer by more than that (or than W&B's start, which it waits for first: up to
  ``wandb_init_timeout_s``), and a requeued attempt starts a fresh one;
- ignores the stop signals (SIGUSR1/SIGTERM, which Slurm sends to every process of the step) and SIGINT:
  the trainer stops on them and closes the pipe, and the last records still reach the sinks;
- logs to the trainer's stderr in the trainer's format: its warnings (a sink not started, a sink failed and
  dropped) are lines of the trainer's log.

At a normal end the trainer closes metrics.jsonl, then the pipe, and waits up to ``timeout`` seconds for
this process (:meth:`SinkProcess.close`), saying in its log if it did not finish.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from ..metrics_options import MetricsOptions
from .logsetup import setup_logging
from .signals import STOP_SIGNALS
from .sinks import open_sinks

log = logging.getLogger("sbatch_gen.train")

POLL_S = 0.5  # how often the file is read: the sinks lag training by about this much
NICE = 10  # added to the trainer's niceness
CLOSE_TIMEOUT_S = 60.0  # how long the trainer's normal end waits for the last records to reach the sinks


class SinkProcess:
    """The trainer's side: the process started, and its pipe."""

    def __init__(
        self,
        opts: MetricsOptions,
        path: Path,
        *,
        run_id: str,
        region: str,
        first_step: int,
        start: int,
        poll_s: float = POLL_S,
    ) -> None:
        argv = [
            sys.executable,
            "-m",
            __name__,
            "--metrics",
            str(path),
            "--options",
            opts.model_dump_json(),
            "--run-id",
            run_id,
            "--region",
            region,
            "--first-step",
            str(first_step),
            "--start",
            str(start),
            "--poll-s",
            str(poll_s),
        ]
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the package's parent: found whatever the cwd
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # stdin: the pipe it watches (its write end is close-on-exec: no other child of the trainer holds
        # it); stderr: the trainer's log
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Tell it the trainer is done (metrics.jsonl is complete), and wait up to ``timeout`` seconds for
        it to write the last records and close the sinks. False (and a warning) when it did not finish:
        it goes on alone and exits when done."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning(
                "metrics sinks (pid %d) still writing after %.0f s: not waiting for them; the last records "
                "may be missing from them (metrics.jsonl is complete)",
                self.proc.pid,
                timeout,
            )
            return False
        return True


class Tail:
    """The records appended to a JSONL file from byte ``offset`` on, complete lines only."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path = path
        self.offset = offset
        self.rest = b""  # a line not yet ended by its newline

    def read(self) -> list[dict]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:  # cut by a crash, then appended to by the next attempt
                log.warning("metrics sinks: a line of %s is not JSON: skipped", self.path)
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


def trainer_gone(parent: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds on stdin, the trainer's pipe: True once it closed (the trainer
    ended or died) or the parent changed."""
    ready, _, _ = select.select([sys.stdin.fileno()], [], [], timeout)
    if ready and not os.read(sys.stdin.fileno(), 4096):
        return True
    return os.getppid() != parent


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sbatch_gen.train.sinkproc", description=__doc__)
    p.add_argument("--metrics", type=Path, required=True, help="the run's metrics.jsonl")
    p.add_argument("--options", required=True, help="the metrics options, as JSON")
    p.add_argument("--run-id", required=True)
    p.add_argument("--region", required=True)
    p.add_argument("--first-step", type=int, required=True, help="this attempt's first step")
    p.add_argument("--start", type=int, required=True, help="the byte of metrics.jsonl this attempt began at")
    p.add_argument("--poll-s", type=float, default=POLL_S)
    return p.parse_args(argv)


def _setup() -> None:
    for sig in (*STOP_SIGNALS, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        os.nice(NICE)
    except OSError:
        pass  # not allowed here: the same priority as the trainer
    setup_logging()


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    parent = os.getppid()
    _setup()
    opts = MetricsOptions.model_validate_json(a.options)
    sinks = open_sinks(
        opts,
        a.metrics.parent,
        run_id=a.run_id,
        region=a.region,
        first_step=a.first_step,
        start=a.start,
    )
    tail = Tail(a.metrics, a.start)
    done = False
    while not done:
        done = trainer_gone(parent, a.poll_s)
        records = tail.read()
        if sinks is not None:
            sinks.write_batch(records)
    if sinks is not None:
        sinks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
