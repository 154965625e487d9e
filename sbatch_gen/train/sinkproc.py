"""The metric sinks' own process: it follows metrics.jsonl and feeds the sinks, outside the training process.

Rank 0 starts it (:class:`SinkProcess`, from :meth:`.metrics.MetricsWriter.open_sinks`) when the train config
lists sinks; it runs ``python -m sbatch_gen.train.sinkproc`` at a lower priority (``os.nice`` and Linux's
``SCHED_IDLE``: it yields its CPU to the trainer's threads at once), so the sinks' Python work (TensorBoard's
protobufs, W&B's log calls) never holds the training process's GIL: the step pays for its metrics.jsonl line
only. It imports no torch (TensorBoard is written with the tensorboard package's
own event writer). The process:

- starts with the stop signals (SIGUSR1/SIGTERM, which Slurm sends to every process of the step) and SIGINT
  blocked (the trainer blocks them around the spawn), ignores them, then unblocks them: one that arrived
  while it started is dropped, it never kills it; the trainer stops on them and closes the pipe, and the
  last records still reach the sinks;
- takes ``<run-dir>/sinks.lock`` (``flock``) before it starts any sink: an earlier attempt's sinks'
  process still flushing (its trainer killed, the job requeued) finishes first, so two never write the same
  TensorBoard directory or W&B run at once. It waits up to ``lock_wait_s`` for it, saying so in one line;
  if the lock is still held then, this attempt's sinks stay off, in one line;
- starts the sinks (:func:`.sinks.open_sinks`; W&B's start may wait on the network, the trainer does not)
  and logs one line when they started, with the last step metrics.jsonl held then;
- reads metrics.jsonl from the byte where this attempt began (a resumed attempt continues the runs as
  :mod:`.sinks` says), every ``poll_s`` seconds, and hands the complete lines read to the sinks as one batch;
  a line not yet ended by its newline waits for the next read, one that is not JSON (cut by a crash, then
  appended to) is skipped with a warning;
- watches the trainer, in a thread, from its first moment: its stdin is a pipe whose other end only the
  trainer holds, so EOF comes when the trainer closes it (its normal end, a stop) or dies (SIGKILL
  included); a changed parent pid says the same. Then it leaves the low priority where the system allows
  it (:func:`leave_low_priority`: its own threads and W&B's service; there is no trainer left to yield to,
  and on a busy machine the idle class could starve the last records past the deadline), reads the file to
  where it was at that moment (what follows is a requeued attempt's, whose own sinks' process feeds it),
  closes the sinks (W&B's finish) and exits. From the trainer's end on it has ``deadline_s`` seconds,
  whatever it is doing (waiting for the lock, W&B still starting, W&B's finish): past them it says in one
  line what it was still doing and exits. So it never outlives its trainer by more than that, and a
  requeued attempt starts a fresh one;
- logs to the trainer's stderr in the trainer's format: its warnings (a sink not started, a sink failed and
  dropped) are lines of the trainer's log.

At a normal end the trainer closes metrics.jsonl, then the pipe, and waits up to ``timeout`` seconds for
this process (:meth:`SinkProcess.close`), saying in its log if it did not finish.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..jsonl import complete_lines
from ..metrics_options import MetricsOptions
from ..proc import descendants
from .logsetup import setup_logging
from .signals import STOP_SIGNALS
from .sinks import last_logged_step, open_sinks

log = logging.getLogger("sbatch_gen.train")

POLL_S = 0.5  # how often the file is read: the sinks lag training by about this much
NICE = 10  # added to the trainer's niceness
CLOSE_TIMEOUT_S = 60.0  # how long the trainer's normal end waits for the last records to reach the sinks
DEADLINE_S = CLOSE_TIMEOUT_S  # how long the process may go on once its trainer ended
LOCK_WAIT_S = DEADLINE_S + 30.0  # for an earlier attempt's sinks' process: it ends within its deadline
LOCK_FILE = "sinks.lock"
BLOCKED = (*STOP_SIGNALS, signal.SIGINT)  # blocked around the spawn, then ignored by the sinks' process


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
        deadline_s: float = DEADLINE_S,
        lock_wait_s: float = LOCK_WAIT_S,
    ) -> None:
        argv = [sys.executable, "-m", __name__, "--metrics", str(path), "--options", opts.model_dump_json()]
        argv += [
            "--run-id",
            run_id,
            "--region",
            region,
            "--first-step",
            str(first_step),
            "--start",
            str(start),
        ]
        argv += ["--poll-s", str(poll_s), "--deadline-s", str(deadline_s), "--lock-wait-s", str(lock_wait_s)]
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the package's parent: found whatever the cwd
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # the child starts with the stop signals blocked (a mask survives exec) until it ignores them: one
        # sent to the process group while it starts stays pending here, for the trainer's own handlers
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
        try:
            # stdin: the pipe it watches (its write end is close-on-exec: no other child of the trainer
            # holds it); stderr: the trainer's log
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Tell it the trainer is done (metrics.jsonl is complete), and wait up to ``timeout`` seconds for
        it to write the last records and close the sinks. False (and a warning) when it did not finish:
        it goes on alone, within its own deadline."""
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

    def read(self, end: int | None = None) -> list[dict]:
        """The records from the last read on, to byte ``end`` (default: the file's end)."""
        lines, self.offset = complete_lines(self.path, self.offset, end)  # a line being written: next time
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


class Watch:
    """The trainer, watched by a thread from this process's start: :attr:`ended` is set once it closed
    the pipe on stdin (``fd``) or died (EOF), or the parent changed; ``deadline_s`` later the process
    exits, saying what it was still doing (:attr:`doing`, kept by the main thread). With ``nice`` (the
    trainer's niceness) it leaves the low priority at the trainer's end."""

    def __init__(
        self,
        metrics: Path,
        parent: int,
        deadline_s: float,
        poll_s: float,
        fd: int = 0,
        nice: int | None = None,
    ) -> None:
        self.ended = threading.Event()
        self.end: int | None = None  # metrics.jsonl's size when the trainer ended: what it wrote
        self.doing = "starting"
        self._args = (metrics, parent, deadline_s, poll_s, fd, nice)
        threading.Thread(target=self._run, name="trainer-watch", daemon=True).start()

    def _run(self) -> None:
        metrics, parent, deadline_s, poll_s, fd, nice = self._args
        while os.getppid() == parent:
            ready, _, _ = select.select([fd], [], [], poll_s)
            if ready and not os.read(fd, 4096):
                break
        if nice is not None:
            leave_low_priority(os.getpid(), nice)
        # what follows is a later attempt's (requeued while this process still writes): its own sinks'
        # process feeds it
        with contextlib.suppress(OSError):
            self.end = metrics.stat().st_size
        self.ended.set()
        time.sleep(deadline_s)
        log.warning(
            "metrics sinks: still %s %.0f s after the trainer ended: exiting; the last records may be "
            "missing from them (metrics.jsonl is complete)",
            self.doing,
            deadline_s,
        )
        logging.shutdown()
        os._exit(1)


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, wait_s: float) -> Iterator[bool]:
    """Hold ``<run-dir>/sinks.lock`` (an exclusive ``flock``; the kernel drops it when the process ends)
    while the body runs; True when held. Held by an earlier attempt's sinks' process: one line, and up to
    ``wait_s`` seconds of waiting for it; still held then: one line, and False. A file system without
    ``flock``: True, without it."""
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        got = _lock(fd, path, wait_s)
        if got:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the next one's line
        yield got
    finally:
        os.close(fd)


def _lock(fd: int, path: Path, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as e:  # ENOLCK: no locks on this file system
            log.warning("metrics sinks: %s cannot be locked (%s): going on without", path, e.strerror)
            return True
        if not said:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            log.warning(
                "metrics sinks: an earlier attempt's sinks' process (pid %s) still writes to this run's "
                "sinks (%s): waiting up to %.0f s for it to finish",
                holder,
                path,
                wait_s,
            )
            said = True
        if time.monotonic() >= end:
            log.warning(
                "metrics sinks: %s still held after %.0f s: this attempt's sinks stay off (metrics.jsonl is "
                "written; the sinks may lack this attempt's steps)",
                path,
                wait_s,
            )
            return False
        time.sleep(0.2)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sbatch_gen.train.sinkproc", description=__doc__)
    p.add_argument("--metrics", type=Path, required=True, help="the run's metrics.jsonl")
    p.add_argument("--options", required=True, help="the metrics options, as JSON")
    p.add_argument("--run-id", required=True)
    p.add_argument("--region", required=True)
    p.add_argument("--first-step", type=int, required=True, help="this attempt's first step")
    p.add_argument("--start", type=int, required=True, help="the byte of metrics.jsonl this attempt began at")
    p.add_argument("--poll-s", type=float, default=POLL_S)
    p.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="left once the trainer ended")
    p.add_argument("--lock-wait-s", type=float, default=LOCK_WAIT_S, help="for an earlier attempt's")
    return p.parse_args(argv)


def leave_low_priority(root: int, nice: int) -> bool:
    """Every thread of ``root``'s process tree back in the normal class (from ``SCHED_IDLE``) at niceness
    ``nice`` (the trainer's). Linux lets a process raise its priority only with ``CAP_SYS_NICE`` (root) or a
    ``RLIMIT_NICE`` that allows that niceness: elsewhere it stays low and False is returned."""
    done = True
    for pid in [root, *descendants(root)]:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:  # both are per thread on Linux
            try:
                if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                if os.getpriority(os.PRIO_PROCESS, tid) > nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
            except ProcessLookupError:
                continue
            except (AttributeError, OSError):
                done = False
    return done


def _setup() -> None:
    for sig in BLOCKED:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)  # blocked by the trainer around the spawn
    try:
        os.nice(NICE)
    except OSError:
        pass  # not allowed here: the same priority as the trainer
    try:
        # Linux's idle class on top: it runs when a CPU has nothing else to run, and a trainer thread that
        # wakes preempts it at once. nice alone still let it take turns on the trainer's CPU (bench sinks:
        # the trainer waited 12-16 us per 1.8 ms step on a run queue while the sinks ran, 1 us without)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # inherited by W&B's service
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: nice alone
    setup_logging()


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    parent = os.getppid()
    nice = os.getpriority(os.PRIO_PROCESS, 0)  # the trainer's, inherited
    _setup()
    watch = Watch(a.metrics, parent, a.deadline_s, a.poll_s, nice=nice)
    opts = MetricsOptions.model_validate_json(a.options)
    watch.doing = "waiting for an earlier attempt's sinks"
    with run_dir_lock(a.metrics.parent, a.lock_wait_s) as locked:
        if locked:
            follow(a, opts, watch)
    return 0


def follow(a: argparse.Namespace, opts: MetricsOptions, watch: Watch) -> None:
    """Start the sinks, then feed them what metrics.jsonl grows by until the trainer ended (and once more
    after that), and close them."""
    t0 = time.monotonic()
    watch.doing = "starting the sinks"
    sinks = open_sinks(
        opts, a.metrics.parent, run_id=a.run_id, region=a.region, first_step=a.first_step, start=a.start
    )
    if sinks is None or not sinks.sinks:
        return
    log.info(
        "metrics sinks %s started in %.1f s, metrics.jsonl at step %s",
        ", ".join(s.name for s in sinks.sinks),
        time.monotonic() - t0,
        last_logged_step(a.metrics),
    )
    tail = Tail(a.metrics, a.start)
    watch.doing = "writing to the sinks"
    done = False
    while not done:
        done = watch.ended.wait(a.poll_s)
        sinks.write_batch(tail.read(watch.end))
    watch.doing = "closing the sinks"
    sinks.close()


if __name__ == "__main__":
    sys.exit(main())
