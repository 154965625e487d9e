"""Which transfers go first on a region's link: a round's payloads before an outer snapshot's. Torch-free.

An outer snapshot (8 B/param, fp32 theta_outer + momentum) uploads in the background, from the housekeeping
thread, while training and the next rounds go on. Under streaming a fragment round moves 2/F B/param (bf16),
so a snapshot every ``snapshot_every`` fragment rounds is several rounds' worth of bytes on the same link;
measured on ``bench overlap``'s WAN (400 Mbit/s, 80 ms), the rounds it overlapped waited longer for their
payloads. :class:`Traffic` gives the rounds the link: each snapshot object waits to start until no round
transfer of this process is in flight (:meth:`Traffic.give_way`), at most ``max_wait_s`` per object, so a
link the rounds keep busy all the time still lets the snapshot through. An object already on the way is
not interrupted (S3 has no pause): a round that starts meanwhile shares the link with at most
``SNAPSHOT_STREAMS`` objects. Nothing else changes: the snapshot's bytes, its manifest, and the rule that
the rounds it covers are deleted only once it is complete."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

GIVE_WAY_MAX_S = 10.0  # the longest a snapshot object waits for the rounds' transfers


class Traffic:
    """The transfers of one process's mailbox: rounds' (foreground) counted while in flight; background ones
    (snapshots) wait for none to be. Shared by a mailbox and its copies (:meth:`.protocol.Mailbox.with_threads`)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self.waited_s = 0.0  # seconds background transfers spent giving way, summed (for records and tests)
        self.gave_way = 0  # background transfers that found a round's in flight

    @contextmanager
    def foreground(self) -> Iterator[None]:
        """A round's transfers (an upload of its objects, a read of its payloads) in flight while inside."""
        with self._cv:
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                if self._active == 0:
                    self._cv.notify_all()

    @property
    def busy(self) -> bool:
        return self._active > 0

    def give_way(self, max_wait_s: float | None = None) -> float:
        """A background transfer about to start: wait until no round transfer is in flight, at most
        ``max_wait_s`` (:data:`GIVE_WAY_MAX_S`). Returns the seconds waited."""
        if max_wait_s is None:
            max_wait_s = GIVE_WAY_MAX_S
        with self._cv:
            if self._active == 0 or max_wait_s <= 0:
                return 0.0
            t0 = time.monotonic()
            self._cv.wait_for(lambda: self._active == 0, timeout=max_wait_s)
            waited = time.monotonic() - t0
            self.waited_s += waited
            self.gave_way += 1
            return waited
