"""A job in flight in a thread of a region's leaders while training goes on: the exchange of one round
(``overlap: eager``), or the upload of an outer snapshot.

Each kind of job runs on a gloo process group of the leaders of its own
(:meth:`.region.Region.background`), so its collectives never interleave with the trainer's or the other
kind's; a round writes only the average buffer, which the outer sync reads after :meth:`InFlight.result`,
a snapshot reads only its own copy of the outer state. The thread is a daemon: a job that exits (a stop,
a crash) never waits for an upload to finish; what it left half-written is not in any manifest, and the
region publishes the round again when it resumes (a snapshot: at the next one due).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from .errors import XRCancelled

T = TypeVar("T")
CANCEL_WAIT_S = 10.0  # how long close() waits for a cancelled round to notice (it polls twice a second)


class InFlight(Generic[T]):
    """``fn(cancel)`` in a daemon thread; :meth:`result` waits for it and returns or raises its outcome."""

    def __init__(self, fn: Callable[[threading.Event], T], name: str, device: torch.device) -> None:
        self.cancel_event = threading.Event()
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                if device.type == "cuda":  # the current device is per thread
                    torch.cuda.set_device(device)
                self._result = fn(self.cancel_event)
            except BaseException as e:  # noqa: BLE001 - handed to the joining thread
                self._error = e
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (None: for ever) for the job to end; whether it has."""
        return self._done.wait(timeout_s)

    def result(self) -> T:
        """Wait for the round; its result, or its error raised here."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def cancel(self, wait_s: float = CANCEL_WAIT_S) -> None:
        """Call the round off and wait up to ``wait_s`` for the thread (an upload in progress is left to
        finish or to die with the process)."""
        self.cancel_event.set()
        self._done.wait(wait_s)

    def cancelled(self) -> bool:
        return isinstance(self._error, XRCancelled)
