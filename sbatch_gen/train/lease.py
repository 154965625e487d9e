"""The run-directory lease: one trainer at a time per run directory. Torch-free.

``<run_dir>/lease.json`` names the job that trains into the directory (``SLURM_JOB_ID``, else
``pid:<pid>@<host>``), its host and pid, and a heartbeat time that a thread refreshes every
``period_s``. The trainer's rank 0 takes it at start and releases it on exit. A second trainer finds it
and refuses to start (exit 2) with one line naming the holder and the age of its heartbeat, unless the
lease is *stale*:

* its heartbeat is older than ``STALE_PERIODS`` x the holder's period (the holder died without
  releasing it: SIGKILL, a node failure), or
* it is held by the same job id (a requeue, or a torchrun restart, of the same job) or by a job of the same
  run (``$SBATCH_GEN_RUN_JOB``: a continuation job, which Slurm starts only once its predecessor ended), or
* the holder's pid no longer exists on this host.

A holder whose lease was taken over stops at once (its heartbeat thread finds another token and calls
``on_lost``; the trainer exits): an attempt left running on a node Slurm has given up on (NODE_FAIL) must not
write into the run directory beside the attempt that replaced it.

Taking the lease (fresh or over a stale one) happens under an exclusive ``flock`` of
``<run_dir>/.lease.lock`` (released by the kernel if the process dies, so it never goes stale itself);
the lease file is only ever replaced atomically (a complete temp file, then ``link()`` when there is
none, or ``rename()`` over a stale one), and re-read afterwards: of two trainers starting at once,
exactly one holds it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from ..contract import ENV_RUN_JOB
from ..proc import pid_alive

log = logging.getLogger("sbatch_gen.train")

LEASE_FILE = "lease.json"
LOCK_FILE = ".lease.lock"
DEFAULT_PERIOD_S = 30.0  # heartbeat period (tests shorten it from outside: sbatch_gen.testing.faults)
STALE_PERIODS = 4  # a heartbeat older than this many periods: the holder is gone


class LeaseHeld(Exception):
    """Another live trainer holds the run directory."""


def default_period() -> float:
    """The heartbeat period of a lease taken without one: :data:`DEFAULT_PERIOD_S` (the tests install a
    shorter one from outside: :mod:`sbatch_gen.testing.faults`)."""
    return DEFAULT_PERIOD_S


def current_job_id(pid: int | None = None, host: str | None = None) -> str:
    jid = os.environ.get("SLURM_JOB_ID", "").strip()
    if jid:
        return jid
    return f"pid:{pid or os.getpid()}@{host or socket.gethostname()}"


def current_run_job() -> str | None:
    """The run this Slurm job belongs to ($SBATCH_GEN_RUN_JOB: its submission's job id), or None."""
    return os.environ.get(ENV_RUN_JOB, "").strip() or None


def stale_reason(
    holder: dict, *, job_id: str, host: str, now: float, period_s: float, run_job: str | None = None
) -> str | None:
    """Why the lease ``holder`` may be taken over by ``job_id`` (of run ``run_job``) on ``host``, or None
    while it is live."""
    try:
        beat = float(holder["heartbeat"])
        their_period = float(holder.get("period_s", period_s))
    except (KeyError, TypeError, ValueError):
        return "the lease file is unreadable"
    if str(holder.get("job_id", "")) == job_id:
        return f"held by this same job {job_id} (a requeue or restart)"
    if run_job is not None and str(holder.get("run_job") or "") == run_job:
        return f"held by job {holder.get('job_id', '?')} of the same run {run_job}, which has ended"
    limit = STALE_PERIODS * max(their_period, period_s)
    if now - beat > limit:
        return f"its heartbeat is {now - beat:.0f} s old (stale after {limit:g} s)"
    pid = holder.get("pid")
    if holder.get("host") == host and isinstance(pid, int) and not pid_alive(pid):
        return f"its pid {pid} is gone from this host"
    return None


def describe_holder(holder: dict, now: float, period_s: float) -> str:
    age = now - float(holder.get("heartbeat", now))
    limit = STALE_PERIODS * max(float(holder.get("period_s", period_s)), period_s)
    return (
        f"job {holder.get('job_id', '?')} on host {holder.get('host', '?')} (pid {holder.get('pid', '?')}), "
        f"heartbeat {age:.0f} s ago (stale after {limit:g} s)"
    )


class Lease:
    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        period_s: float | None = None,
        job_id: str | None = None,
        host: str | None = None,
        pid: int | None = None,
        run_job: str | None = None,
        clock=time.time,
        on_lost=None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LEASE_FILE
        self.period_s = default_period() if period_s is None else float(period_s)
        self.host = host or socket.gethostname()
        self.pid = pid or os.getpid()
        self.job_id = job_id or current_job_id(self.pid, self.host)
        self.run_job = run_job if run_job is not None else current_run_job()
        self.on_lost = on_lost  # called (from the heartbeat thread) once the lease was taken over
        self.token = uuid.uuid4().hex  # tells this holder from a later one of the same job
        self.clock = clock
        self.held = False
        self._acquired: float | None = None
        self.lost: str | None = None  # why the heartbeat thread stopped, if it did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()

    # -- file helpers
    def _record(self) -> dict:
        return {
            "job_id": self.job_id,
            "run_job": self.run_job,
            "host": self.host,
            "pid": self.pid,
            "heartbeat": self.clock(),
            "period_s": self.period_s,
            "token": self.token,
            "acquired": self._acquired,
        }

    def _temp(self) -> Path:
        tmp = self.run_dir / f".{LEASE_FILE}.tmp-{self.pid}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            json.dump(self._record(), f, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:  # a filesystem without flock: link()/rename() + re-read still decide
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            yield
        finally:
            os.close(fd)  # releases the flock

    # -- acquire / refresh / release
    def acquire(self) -> str | None:
        """Take the lease. Returns None (fresh) or why an existing lease was taken over; raises
        :class:`LeaseHeld` with one line naming the live holder."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._acquired = self.clock()
        with self._locked():
            tmp = self._temp()
            try:
                took_over = None
                try:
                    os.link(tmp, self.path)  # only if there is no lease
                except FileExistsError:
                    holder = self.read()
                    if holder is None:  # released in between
                        os.link(tmp, self.path)
                    else:
                        now = self.clock()
                        why = stale_reason(
                            holder,
                            job_id=self.job_id,
                            host=self.host,
                            now=now,
                            period_s=self.period_s,
                            run_job=self.run_job,
                        )
                        if why is None:
                            raise LeaseHeld(
                                f"run dir {self.run_dir} is in use by {describe_holder(holder, now, self.period_s)}: "
                                f"not starting a second trainer on it (remove {self.path} only if that job is "
                                "really gone)"
                            ) from None
                        os.replace(tmp, self.path)
                        took_over = f"took over the lease of job {holder.get('job_id', '?')}: {why}"
            finally:
                tmp.unlink(missing_ok=True)
            mine = self.read()
            if not mine or mine.get("token") != self.token:  # lost a race with a writer outside the lock
                holder = mine or {}
                raise LeaseHeld(
                    f"run dir {self.run_dir} is in use by "
                    f"{describe_holder(holder, self.clock(), self.period_s)}"
                )
        self.held = True
        return took_over

    def refresh(self) -> bool:
        """Write a new heartbeat; False (and ``lost`` set) if the lease is no longer this holder's."""
        with self._write_lock:
            if not self.held:
                return False
            cur = self.read()
            if cur is not None and cur.get("token") != self.token:
                self.lost = (
                    f"the lease was taken over by {describe_holder(cur or {}, self.clock(), self.period_s)}"
                )
                self.held = False
                return False
            tmp = self._temp()
            try:
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
            return True

    def _beat(self) -> None:
        warned = False
        while not self._stop.wait(self.period_s):
            try:
                if not self.refresh():
                    log.error("run-dir lease lost: %s", self.lost)
                    if self.on_lost is not None:
                        self.on_lost(self.lost)
                    return
                warned = False
            except OSError as e:
                if not warned:
                    log.warning(
                        "run-dir lease heartbeat not written (%s: %s); retrying every %g s",
                        self.path,
                        e.strerror or e,
                        self.period_s,
                    )
                    warned = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="run-dir-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._write_lock:
            if not self.held:
                return
            self.held = False
            try:
                cur = self.read()
                if cur is not None and cur.get("token") == self.token:
                    self.path.unlink(missing_ok=True)
            except OSError as e:
                log.warning("run-dir lease %s not released: %s", self.path, e)
