"""A diagnostic trainer for ``bench.goals40_diag trace``: ``python -m sbatch_gen.testing.faults`` (the trainer
with the environment's faults) that also writes, to the file ``SBGEN_TRACE`` names, one JSON line per event
on the machine-wide monotonic clock, so that two regions' lines line up: each step's start and its
cross-region call (in, out; the process's CPU seconds at each), each round's phases (as
:func:`~sbatch_gen.train.xr.rounds.run_round` returns them), each snapshot upload and mailbox cleanup (start,
end), each give-way of a snapshot object, and every object-store request (op, key, start, end, bytes).
Everything is wrapped from outside, here; the trainer carries no hook of its own.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time
from functools import wraps

ENV_TRACE = "SBGEN_TRACE"


def install(path: str) -> None:
    lock = threading.Lock()
    f = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def emit(**kw) -> None:
        kw.setdefault("t", time.monotonic())
        kw["th"] = threading.current_thread().name
        line = json.dumps(kw, default=str)
        with lock:
            f.write(line + "\n")

    from sbatch_gen.train import loop, trainer
    from sbatch_gen.train.xr import diloco, snapshots, store, sync, traffic

    step_fn = trainer.train_step

    @wraps(step_fn)
    def train_step(t):
        emit(ev="step_in", step=t.step + 1, cpu=time.process_time())
        return step_fn(t)

    trainer.train_step = train_step

    xr_fn = loop._cross_region_round

    @wraps(xr_fn)
    def cross_region_round(t, step):
        emit(ev="xr_in", step=step, cpu=time.process_time())
        try:
            return xr_fn(t, step)
        finally:
            emit(ev="xr_out", step=step, cpu=time.process_time())

    loop._cross_region_round = cross_region_round

    run_round = diloco.run_round

    @wraps(run_round)
    def traced_round(ex, tag, kind, step, *a, **kw):
        res = run_round(ex, tag, kind, step, *a, **kw)
        emit(ev="round", tag=tag, step=step, bg=ex.background, times=res.times, late=res.late)
        return res

    diloco.run_round = traced_round

    publish = snapshots.SnapshotSync._publish_snapshot

    @wraps(publish)
    def traced_publish(self, ex, r, step, state):
        t0 = time.monotonic()
        try:
            return publish(self, ex, r, step, state)
        finally:
            emit(ev="snapshot", round=r, t0=t0)

    snapshots.SnapshotSync._publish_snapshot = traced_publish

    cleanup = sync.OuterSync._cleanup_now

    @wraps(cleanup)
    def traced_cleanup(self, ex, r, need_snapshot):
        t0 = time.monotonic()
        try:
            return cleanup(self, ex, r, need_snapshot)
        finally:
            emit(ev="cleanup", round=r, t0=t0)

    sync.OuterSync._cleanup_now = traced_cleanup

    give_way = traffic.Traffic.give_way

    @wraps(give_way)
    def traced_give_way(self, max_wait_s=None):
        t0 = time.monotonic()
        waited = give_way(self, max_wait_s)
        if waited:
            emit(ev="give_way", t0=t0, waited=waited)
        return waited

    traffic.Traffic.give_way = traced_give_way

    def req(op: str, fn):
        @wraps(fn)
        def traced(self, key, *a, **kw):
            t0 = time.monotonic()
            n = None
            try:
                out = fn(self, key, *a, **kw)
                if isinstance(out, bytes | bytearray):
                    n = len(out)
                elif isinstance(out, list):
                    n = len(out)
                return out
            finally:
                if op in ("put", "create") and a:
                    n = memoryview(a[0]).nbytes
                shown = key if isinstance(key, str) else f"{len(key)} keys"
                emit(ev="req", op=op, key=shown, t0=t0, n=n, store=id(self))

        return traced

    for op in ("put", "create", "get", "get_into", "get_range", "get_aged", "list", "children", "delete"):
        setattr(store.S3Store, op, req(op, getattr(store.S3Store, op)))


def main() -> None:
    path = os.environ.get(ENV_TRACE)
    from sbatch_gen.testing import faults

    faults.install_from_env()
    if path:
        install(path)
    sys.argv[0] = "sbatch_gen.train"
    runpy.run_module("sbatch_gen.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
