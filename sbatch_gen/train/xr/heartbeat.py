"""A region's liveness in the mailbox (``<run>/_alive/<region>.json``): the heartbeat record, and the thread
of a region's rank 0 that overwrites it every ``heartbeat_s``. How the others read it: :mod:`.membership`
(crashed regions). Torch-free."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from .records import Record
from .store import Store

STALE_BEATS = 3  # heartbeat intervals old (store's clock) or unchanged (reader's clock): the region is gone
log = logging.getLogger("sbatch_gen.train")


@dataclass
class Heartbeat(Record):
    """A region's liveness record, ``<run>/_alive/<region>.json``. Readers judge its age on the store's
    clock and its VALUE over time on their own; ``time`` is the writer's wall clock, shown to people
    (``sbatch-gen status``), never used to decide anything (clocks of different regions may disagree)."""

    WHAT = "heartbeat"

    region: str
    incarnation: (
        str  # random per writing process: a restarted region's counter starts again, its value changes
    )
    beat: int  # 1, 2, 3, ... one per write
    interval_s: float
    time: float
    job: str = ""

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Heartbeat | None:
        """None for an unreadable record; raises :class:`XRLayoutError` for a version not read here."""
        try:
            return cls.read(raw, where)
        except (ValueError, TypeError):
            return None

    @property
    def value(self) -> tuple[str, int]:
        return self.incarnation, self.beat


class HeartbeatWriter:
    """Overwrites one region's heartbeat every ``interval_s`` from a daemon thread until :meth:`stop`
    (also called at interpreter exit). A failed write is logged (once per run of failures) and the next
    beat tries again: a region that cannot beat only makes the others stop waiting for it sooner.

    Thread safety: the thread only calls ``store.put`` (``FsStore``: a temp file with a unique name, then a
    rename; ``S3Store``: a client of its own, :meth:`~.store.Store.clone`, so a beat never waits for a
    connection that payload uploads hold; its retries are not counted in any round's ``xr_retries``)."""

    def __init__(self, store: Store, key: str, region: str, interval_s: float, job: str = "") -> None:
        self.store, self.key, self.region, self.interval_s, self.job = store, key, region, interval_s, job
        self.incarnation = uuid.uuid4().hex[:12]
        self.beats = 0  # writes attempted
        self.failures = 0  # consecutive failed writes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"xr-heartbeat-{region}", daemon=True)

    def start(self) -> None:
        atexit.register(self.stop)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def beat(self) -> None:
        self.beats += 1
        hb = Heartbeat(self.region, self.incarnation, self.beats, self.interval_s, time.time(), self.job)
        try:
            self.store.put(self.key, hb.to_json())
        except Exception as e:  # noqa: BLE001 - a missed beat is retried at the next one
            self.failures += 1
            if self.failures == 1:
                log.warning(
                    "cross-region heartbeat: writing %s failed (%s); retrying every %g s. Other regions "
                    "stop waiting for this one after %d missed beats",
                    self.store.describe(self.key),
                    e,
                    self.interval_s,
                    STALE_BEATS,
                )
            return
        if self.failures:
            log.info("cross-region heartbeat: written again after %d failed writes", self.failures)
            self.failures = 0

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.beat()
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:  # a write took longer than an interval: no burst of catch-up beats
                next_at = now
            self._stop.wait(next_at - now)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop beating; waits up to ``timeout`` for a write in flight."""
        self._stop.set()
        atexit.unregister(self.stop)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
