"""Stop requests: SIGUSR1/SIGTERM in-process, and the stop file the batch shell creates.

The handler only records the request (it never raises), so a second signal while a checkpoint is
being written changes nothing: the save runs to its end. The trainer folds :meth:`StopRequest.local`
into the one collective it does every step, so all ranks agree on the same stop step.

Part of the public library (:mod:`sbatch_gen.train.api` re-exports :class:`StopRequest`). Torch-free at
import (:meth:`StopRequest.agree` imports torch); :func:`fast_exit_if_acked` runs before torch is imported.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..contract import (
    ACK_SUFFIX,
    ENV_STOP_FILE,
    EXIT_REQUEUE,
    FATAL_SUFFIX,
    STOPPING_SUFFIX,
    TERM_WITHOUT_STOP_S,
)
from ..fsutil import write_atomic

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def resolve_stop_file(flag: str | None) -> Path | None:
    v = flag or os.environ.get(ENV_STOP_FILE) or None
    return Path(v) if v else None


def ack_path(stop_file: Path) -> Path:
    return stop_file.with_name(stop_file.name + ACK_SUFFIX)


def fatal_path(stop_file: Path) -> Path:
    return stop_file.with_name(stop_file.name + FATAL_SUFFIX)


def stopping_path(stop_file: Path) -> Path:
    return stop_file.with_name(stop_file.name + STOPPING_SUFFIX)


def _first_line(path: Path, limit: int = 200) -> str:
    """The first line of a small file the launcher wrote (who asked to stop), or "" when unreadable."""
    try:
        with path.open("r", encoding="utf-8", errors="replace") as f:
            line = f.readline(limit)
    except OSError:
        return ""
    return " ".join(line.split())


def fast_exit_if_acked(stop_file: Path | None) -> None:
    """Exit 0 at once when the stop file and its .ack both exist: this attempt already checkpointed and
    handed over (the ack says so); workers torchrun restarts, or the same attempt started again, must not
    train again."""
    if stop_file is None:
        return
    ack = ack_path(stop_file)
    if stop_file.exists() and ack.exists():
        sys.stderr.write(
            f"{Path(sys.argv[0]).name or 'python'}: stop file {stop_file} and {ack} exist: already "
            f"checkpointed, exiting 0 without starting\n"
        )
        sys.stderr.flush()
        raise SystemExit(0)


def die_with_agent() -> bool:
    """Under torchrun (``$TORCHELASTIC_RUN_ID`` set) on Linux: SIGKILL this worker when its parent, torchrun's
    agent, dies. torchrun starts every worker in a session of its own, so a cluster that kills a job by
    process group (Slurm's proctrack/pgid) or a launcher that kills the agent would otherwise leave the
    workers running on, e.g. still writing a stop checkpoint into the run dir while the requeued job's next
    attempt already uses it. Returns whether it is armed."""
    if not os.environ.get("TORCHELASTIC_RUN_ID") or not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
    if armed and (parent == 1 or os.getppid() != parent):  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return armed


class StopRequest:
    """A stop request from a signal (``SIGUSR1``/``SIGTERM`` by default) or the stop file, which the rendered
    Slurm job creates when Slurm's warning signal arrives (``trainer.stop_protocol: sbatch-gen``).

    The signal handler only records the request: a second signal during a save changes nothing. Call
    :meth:`agree` once per step (or fold :meth:`local` into a collective of your own, as the companion
    trainer does): every rank gets the same answer at the same step. After the stop checkpoint,
    :meth:`acknowledge` and exit :meth:`exit_code`: the launcher requeues the job once it sees the ack."""

    def __init__(
        self,
        stop_file: str | Path | None = None,
        signals: Iterable[signal.Signals] = STOP_SIGNALS,
        teardown_exit_s: float | None = TERM_WITHOUT_STOP_S,
    ) -> None:
        """``teardown_exit_s``: under torchrun with a stop file, how long a SIGTERM may go without the stop file
        appearing before this process takes it for torchrun's teardown after a failed worker and exits at
        once (:meth:`install`); None: never."""
        self.stop_file = Path(stop_file) if stop_file else None
        self.handled = tuple(signals)
        self.teardown_exit_s = teardown_exit_s
        self.signals: list[str] = []
        self.first_time: float | None = None
        self._prev: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None  # (read end, write end) of the signal wakeup pipe

    @classmethod
    def from_env(cls, stop_file: str | Path | None = None, **kw: Any) -> StopRequest:
        """``stop_file`` when given, else ``$SBATCH_GEN_STOP_FILE`` (neither: signals only)."""
        return cls(resolve_stop_file(str(stop_file) if stop_file else None), **kw)

    def install(self) -> None:
        """Handle the signals (main thread only; elsewhere a no-op). Under torchrun, also ask the kernel to
        SIGKILL this process if torchrun's agent dies (:func:`die_with_agent`), and, with a stop file, tell a
        stop from a crash's teardown (:meth:`_watch_teardown`)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.handled:
            self._prev[sig] = signal.signal(sig, self._handler)
        if die_with_agent():
            self._arm_teardown_exit()

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        for sig, prev in self._prev.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._prev.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            os.close(self._wakeup[1])  # the watcher reads end-of-file and returns; it closes the read end
            self._wakeup = None

    def _arm_teardown_exit(self) -> bool:
        """Under torchrun with a stop file: a thread that sees every SIGTERM (through the interpreter's signal
        wakeup fd, so also while the main thread is stuck in a collective whose peer died, where no Python
        handler runs). Returns whether it is armed: not without a stop file, when SIGTERM is not handled,
        or when something else holds the wakeup fd."""
        if self.stop_file is None or self.teardown_exit_s is None or signal.SIGTERM not in self.handled:
            return False
        if not os.environ.get("SLURM_STEP_ID"):
            # Only a Slurm job step guarantees the order (run-trainer is the step's task: every SIGTERM
            # reaches it, and it writes the stop file first). The SSH launcher's stop signals the workers
            # directly, without a stop file: there a SIGTERM stays a stop request, and a crash takes torch's 30 s.
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)  # the C-level handler must never block
        prev = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if prev != -1:  # someone else's (e.g. an event loop): leave it theirs
            signal.set_wakeup_fd(prev)
            os.close(r)
            os.close(w)
            return False
        self._wakeup = (r, w)
        threading.Thread(target=self._watch_teardown, args=(r,), name="stop-or-teardown", daemon=True).start()
        return True

    def _watch_teardown(self, r: int) -> None:
        """Every launcher of sbatch-gen writes the stop file before it hands SIGTERM on to the workers. A
        SIGTERM with no stop file after ``teardown_exit_s`` is torchrun's agent stopping the survivors of a
        failed worker, which it does with its own 30 s before a SIGKILL (``--shutdown-timeout`` is for the
        stops it handles): exit now, so a crash frees the node in seconds. Nothing is lost that the SIGKILL
        would have kept: checkpoints are complete or ignored. A stop file that appears in time (a stop) or
        existed already (a stop, during which a worker failed: the agent's 30 s then apply) changes
        nothing."""
        try:
            while data := os.read(r, 64):
                if int(signal.SIGTERM) not in data or self._stop_file_exists():
                    continue
                deadline = time.monotonic() + float(self.teardown_exit_s or 0)
                while time.monotonic() < deadline and not self._stop_file_exists():
                    time.sleep(0.05)
                if not self._stop_file_exists():
                    if _node_leader():
                        sys.stderr.write(
                            f"rank {os.environ.get('RANK', '0')}: SIGTERM and no stop file within {self.teardown_exit_s:g} s: "
                            "torchrun is stopping the workers after one failed; exiting now\n"
                        )
                        sys.stderr.flush()
                    os._exit(128 + int(signal.SIGTERM))
        except OSError:
            pass
        finally:
            os.close(r)

    def _stop_file_exists(self) -> bool:
        return self.stop_file is not None and self.stop_file.exists()

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        self.signals.append(signal.Signals(signum).name)
        if self.first_time is None:
            self.first_time = time.time()

    def exit_if_acked(self) -> None:
        """Exit 0 at once when the stop file and its ack both exist: this attempt has already checkpointed and
        handed over (torchrun restarting the workers must not train again; the ack tells the launcher)."""
        fast_exit_if_acked(self.stop_file)

    def local(self) -> bool:
        """Whether this rank has seen a request (signal, or the stop file exists)."""
        return bool(self.signals) or (self.stop_file is not None and self.stop_file.exists())

    def agree(self, device: Any = None) -> bool:
        """Collective (every rank of the default process group, at the same step): whether any rank has
        seen a request. One all-reduce of one number; without an initialised process group, :meth:`local`.
        ``device``: where the number goes (default: the current CUDA device with NCCL, else the CPU)."""
        import torch
        import torch.distributed as tdist

        if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
            return self.local()
        if device is None:
            nccl = tdist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        flag = torch.tensor([1.0 if self.local() else 0.0], device=device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def reason(self) -> str:
        """What asked to stop, for logs and the ack: the signals seen, the stop file (with the first line the
        launcher wrote into it: which signal reached which shell), or "another rank"."""
        parts = []
        if self.signals:
            parts.append("+".join(dict.fromkeys(self.signals)))
        if self.stop_file is not None and self.stop_file.exists():
            said = _first_line(self.stop_file)
            parts.append(f"stop file: {said}" if said else f"stop file {self.stop_file}")
        return ", ".join(parts) or "another rank"

    def saving(self, step: int, resume_step: int | None) -> str:
        """Not collective; call it on every rank as the stop checkpoint of ``step`` starts. ``resume_step``: the
        newest complete checkpoint's step (None: there is none). Returns one line for the log: what is
        redone if the save does not complete (the cluster may end the job first); the first rank of every
        node also writes it to ``<stop file>.stopping``, where the launcher finds it when no ack follows."""
        since = resume_step or 0
        where = (
            f"the newest complete checkpoint is step {since}"
            if resume_step
            else "there is no complete checkpoint"
        )
        redone = step - since
        line = (
            f"stop checkpoint of step {step} started ({self.reason()}); {where}: if the job ends before this "
            f"save completes, the next attempt resumes from step {since} and redoes steps {since + 1}-{step} "
            f"({redone} step{'s' if redone != 1 else ''})"
        )
        if self.stop_file is not None and _node_leader():
            try:
                self.stop_file.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(stopping_path(self.stop_file), line + "\n", fsync=False)
            except OSError as e:
                sys.stderr.write(f"cannot write {stopping_path(self.stop_file)} ({e})\n")
        return line

    def exit_code(self) -> int:
        """The exit code after :meth:`acknowledge`: 0 under a launcher (a stop file is set: the launcher reads
        the ack, and torchrun stays quiet about a clean exit), else ``EXIT_REQUEUE`` (nobody reads an ack:
        the exit code says "checkpointed, requeue me")."""
        return 0 if self.stop_file is not None else EXIT_REQUEUE

    def acknowledge(
        self, step: int, checkpoint: str | Path | None = None, reason: str | None = None
    ) -> Path | None:
        """Collective (every rank calls it, once the stop checkpoint is complete on every rank): all ranks meet
        in a barrier (every rank's part of the checkpoint is written), then the first rank of every node
        (``$LOCAL_RANK`` 0, else rank 0) writes ``<stop file>.ack`` (JSON: step, checkpoint, reason, time)
        atomically, so that the launcher shell of every node finds it on its own filesystem, and all ranks
        meet again, so that no rank exits before the acks are there (torchrun SIGTERMs a node's other
        workers once one exits). Creates the stop file first when nothing did (a stop of the trainer's own,
        e.g. no cross-region quorum): workers torchrun restarts then exit at once (:meth:`exit_if_acked`).
        Then exit with :meth:`exit_code`. Returns the ack's path where this rank wrote one, else None (also
        without a stop file)."""
        ack = None
        _barrier()
        if self.stop_file is not None and _node_leader():
            if not self.stop_file.exists():
                self.stop_file.parent.mkdir(parents=True, exist_ok=True)
                self.stop_file.touch()
            ack = write_ack(
                self.stop_file, step, Path(checkpoint) if checkpoint else None, reason or self.reason()
            )
        _barrier()
        return ack

    def fatal(self, reason: str) -> Path | None:
        """Not collective. The trainer cannot run and no requeue would change that (a bad config or flag,
        the run dir leased by another job): rank 0 writes ``<stop file>.fatal``, ``reason`` on one line, so
        the batch shell ends the job without a requeue and logs it. Returns its path; None on the other
        ranks, without a stop file, or when it cannot be written (said on stderr: the error being reported
        stays the one that counts, and the job is requeued as before). Call it just before exiting
        non-zero."""
        if self.stop_file is None or _rank() != 0:
            return None
        lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
        one = " ".join([lines[0], "; ".join(lines[1:])]) if len(lines) > 1 else "".join(lines)
        path = fatal_path(self.stop_file)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, one + "\n")
        except OSError as e:
            sys.stderr.write(f"cannot write {path} ({e}): the launcher may requeue this job\n")
            return None
        return path


def _initialised_group() -> Any:
    """torch.distributed when a default process group is initialised (and torch already imported), else
    None."""
    tdist = sys.modules.get("torch.distributed")
    if tdist is not None and tdist.is_available() and tdist.is_initialized():
        return tdist
    return None


def _barrier() -> None:
    tdist = _initialised_group()
    if tdist is not None and tdist.get_world_size() > 1:
        tdist.barrier()


def _node_leader() -> bool:
    """Whether this process is the first of its node: ``$LOCAL_RANK`` 0 (torchrun sets it), else rank 0."""
    local = os.environ.get("LOCAL_RANK", "")
    return int(local) == 0 if local.strip().isdigit() else _rank() == 0


def _rank() -> int:
    """torch.distributed's rank when it is initialised (looked up only if torch is already imported), else
    ``$RANK``, else 0."""
    tdist = _initialised_group()
    return int(tdist.get_rank()) if tdist is not None else int(os.environ.get("RANK", "0") or 0)


def write_ack(stop_file: Path, step: int, checkpoint: Path | None, reason: str) -> Path:
    """rank 0: ``<stop file>.ack`` as JSON, atomically (the batch shell polls for it)."""
    ack = ack_path(stop_file)
    ack.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "step": step,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "reason": reason,
        "time": time.time(),
    }
    write_atomic(ack, json.dumps(record) + "\n")
    return ack
