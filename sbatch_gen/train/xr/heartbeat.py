"""A region's liveness in the mailbox (``<run>/_alive/<region>.json``): the heartbeat record, the thread of a
region's rank 0 that overwrites it every ``heartbeat_s``, and the thread that watches the other regions'
(:class:`PeerWatch`). How they are judged: :mod:`.membership` (crashed regions). Torch-free."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .records import Record
from .store import Store

if TYPE_CHECKING:
    from .commit import Presence

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


class PeerWatch:
    """Watches the other regions' heartbeats from a daemon thread of rank 0, every ``interval_s`` (half a
    heartbeat interval), whether a round is waiting or not: a region that crashed while this one trained is
    known gone when the next round starts, and one that crashes during a round's wait within
    ``STALE_BEATS`` intervals of its last beat plus one look. ``judge(region)`` reads a heartbeat and says
    when it turns stale on this region's clock (:meth:`.membership.Membership._judge_heartbeat`: its age on
    the store's clock, and what this region saw of it over time, shared with the rounds' own reads).

    It decides nothing: a round still closes without a region only with ``min_regions`` there, by the
    claims' create-only writes (:mod:`.rounds`). A region wrongly seen gone (a heartbeat delayed past
    three intervals) then costs at most one round without it: its own claim, if first, still wins its
    key, else it is late and applies the round like everyone else."""

    def __init__(
        self,
        regions: list[str],
        judge: Callable[[str], float],
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        name: str = "xr-peer-watch",
        said: Callable[[str], Presence | None] | None = None,
    ) -> None:
        self.regions, self.judge, self.interval_s, self.clock = list(regions), judge, interval_s, clock
        self.said = said  # a region's presence record, read once it looks gone: a planned leave is no warning
        self.due: dict[str, float] = {}  # region -> when its heartbeat turns (turned) stale, self.clock
        self.gone_at: dict[str, float] = {}  # region -> when this watch first saw it gone, self.clock
        self.looks = 0
        self._failing: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        atexit.register(self.stop)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def gone(self) -> set[str]:
        """The regions whose heartbeat is stale now, as last looked at."""
        now = self.clock()
        return {r for r, due in list(self.due.items()) if due <= now}

    def look(self) -> None:
        """Read every watched region's heartbeat once (one after the other: small reads on a client of its
        own), and log a region seen gone, or beating again."""
        for r in self.regions:
            try:
                due = self.judge(r)
            except Exception as e:  # noqa: BLE001 - the rounds read it themselves too
                if r not in self._failing:
                    self._failing.add(r)
                    log.warning("cross-region: reading region %s's heartbeat failed (%s); retrying", r, e)
                continue
            self._failing.discard(r)
            now = self.clock()
            self.due[r] = due
            if due <= now and r not in self.gone_at:
                left = self._left(r)
                if left is not None:
                    log.info("cross-region: region %s beats no more: it %s", r, left)
                else:
                    log.warning(
                        "cross-region: region %s looks gone (no heartbeat for %d intervals): rounds close "
                        "without waiting for it once min_regions have published",
                        r,
                        STALE_BEATS,
                    )
                self.gone_at[r] = now  # (once said)
            elif due > now and r in self.gone_at:
                del self.gone_at[r]
                log.info("cross-region: region %s beats again", r)
        self.looks += 1

    def _left(self, region: str) -> str | None:
        """How ``region`` said it stopped (its presence record: a planned leave, or a refusal), else None."""
        if self.said is None:
            return None
        try:
            p = self.said(region)
        except Exception:  # noqa: BLE001 - then it is judged by its heartbeat alone, as without a record
            return None
        if p is None or p.state not in ("leaving", "refused"):
            return None
        what = "left" if p.state == "leaving" else "refused to take part"
        return f"{what} at step {p.step} (round {p.round}){': ' + p.why if p.why else ''}"

    def _run(self) -> None:
        while not self._stop.is_set():
            self.look()
            self._stop.wait(self.interval_s)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        atexit.unregister(self.stop)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
