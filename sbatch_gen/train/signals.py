"""Stop requests: SIGUSR1/SIGTERM in-process, and the stop file the batch shell creates.

The handler only records the request (it never raises), so a second signal while a checkpoint is
being written changes nothing: the save runs to its end. The trainer folds :meth:`StopRequest.local`
into the one collective it does every step, so all ranks agree on the same stop step.

Torch-free; :func:`fast_exit_if_acked` runs before torch is imported.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..contract import ACK_SUFFIX, ENV_STOP_FILE, EXIT_REQUEUE
from ..fsutil import write_atomic

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def resolve_stop_file(flag: str | None) -> Path | None:
    v = flag or os.environ.get(ENV_STOP_FILE) or None
    return Path(v) if v else None


def ack_path(stop_file: Path) -> Path:
    return stop_file.with_name(stop_file.name + ACK_SUFFIX)


def fast_exit_if_acked(stop_file: Path | None) -> None:
    """Exit 42 at once when the stop file and its .ack both exist: this attempt already checkpointed
    and handed over; torchrun restarting workers after our exit 42 must not train again."""
    if stop_file is None:
        return
    ack = ack_path(stop_file)
    if stop_file.exists() and ack.exists():
        sys.stderr.write(
            f"sbatch_gen.train: stop file {stop_file} and {ack} exist: already checkpointed, "
            f"exiting {EXIT_REQUEUE} without starting\n"
        )
        sys.stderr.flush()
        raise SystemExit(EXIT_REQUEUE)


class StopRequest:
    """Collects stop requests from signals and the stop file (checked on every :meth:`local` call)."""

    def __init__(self, stop_file: Path | None):
        self.stop_file = stop_file
        self.signals: list[str] = []
        self.first_time: float | None = None
        self._prev: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            self._prev[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        for sig, prev in self._prev.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._prev.clear()

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        self.signals.append(signal.Signals(signum).name)
        if self.first_time is None:
            self.first_time = time.time()

    def local(self) -> bool:
        """Whether this rank has seen a request (signal, or the stop file exists)."""
        return bool(self.signals) or (self.stop_file is not None and self.stop_file.exists())

    def reason(self) -> str:
        parts = []
        if self.signals:
            parts.append("+".join(dict.fromkeys(self.signals)))
        if self.stop_file is not None and self.stop_file.exists():
            parts.append(f"stop file {self.stop_file}")
        return ", ".join(parts) or "another rank"


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
