"""Diagnostics behind issue 40's two missed goals (docs/benchmarks.md), beside the benchmarks, writing no page.

    sudo .venv/bin/python -m bench.goals40_diag streaming   # ~8 min
    sudo .venv/bin/python -m bench.goals40_diag trace       # ~5 min
    sudo .venv/bin/python -m bench.goals40_diag heartbeat   # ~6 min
    sudo .venv/bin/python -m bench.goals40_diag fault       # ~7 min

``streaming``: ``bench overlap``'s streaming F=4 tau=2 bf16 variant on its WAN, four runs side by side: as the
page runs it (snapshot objects give way to the rounds' transfers); with snapshot objects that never wait
(``SBATCH_GEN_TEST_SNAPSHOT_GIVE_WAY_S`` 0: as before :mod:`sbatch_gen.train.xr.traffic`); with both regions
starting their first step together (:func:`sbatch_gen.testing.faults.starting_together`: no start-up skew);
and starting together without outer snapshots (``snapshot_every`` 1000). Per region: exposed share, the final join, the merges' waits (those over 0.1 s with their round) and
the snapshots it uploaded.

``trace``: the streaming variant starting together, with and without snapshots (:data:`TRACE_RUNS`), each
region's trainer run as :mod:`bench.goals40_trace` (every step, round phase, snapshot, cleanup and store request
timestamped on the machine's monotonic clock, with the process's CPU seconds at each step); the records are kept
(the folder is printed) for a look at the two regions side by side, step by step (docs/benchmarks.md: how the
snapshotting region's steps got faster).

``heartbeat``: ``bench peer``'s one-replica fault (``--subset goals``: 400 Mbit/s, 80 ms), ours only, the
whole replica lost (run-trainer killed with torchrun and its workers, as when a node fails: no leave is
announced, the heartbeat tells), with ``heartbeat_s`` 5 (the default) and 1: the survivor's stall. (bench peer's
own fault kills the training processes and leaves run-trainer, which announces the leave.)

``cleanup``: the streaming variant, both regions starting together, with and without the mailbox cleanup behind
the rounds (``SBATCH_GEN_TEST_NO_CLEANUP``; snapshots uploaded in both), side by side.

``fault``: ``bench peer``'s one-replica fault as its page runs it (``--subset goals``), torchft then ours, on one
link: the survivor's stall, the step where it fell (seconds after the fault; ours: that round's close reason,
absent regions, wait), and ours' rounds closed without a region (a leave, a stale heartbeat, grace).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from sbatch_gen.testing.faults import ENV_NO_CLEANUP, ENV_SNAPSHOT_GIVE_WAY, ENV_START_TOGETHER
from sbatch_gen.train.data import prepare
from sbatch_gen.xr_options import CrossRegion

from . import goals40_trace, overlap, peer_launch
from .common import Result
from .regionruns import DATA_BYTES, REGIONS

STREAMING_RUNS: tuple[tuple[str, bool, dict, dict], ...] = (
    ("as shipped (snapshots give way to the rounds)", False, {}, {}),
    ("snapshots not giving way (as before)", False, {}, {ENV_SNAPSHOT_GIVE_WAY: "0"}),
    ("start together", True, {}, {}),
    ("start together, snapshot_every 1000", True, {"snapshot_every": 1000}, {}),
)


TRACE_RUNS: tuple[tuple[str, bool, dict, dict], ...] = (
    ("start together", True, {}, {}),
    ("start together, snapshot_every 1000", True, {"snapshot_every": 1000}, {}),
)


CLEANUP_RUNS: tuple[tuple[str, bool, dict, dict], ...] = (
    ("start together", True, {}, {}),
    ("start together, no cleanup", True, {}, {ENV_NO_CLEANUP: "1"}),
)


def cleanup(work: Path) -> None:
    streaming(work, CLEANUP_RUNS)


def trace(
    work: Path, keep: Path | None = None, runs: tuple[tuple[str, bool, dict, dict], ...] = TRACE_RUNS
) -> None:
    """The streaming runs ``runs`` (default :data:`TRACE_RUNS`), each region's trainer run as :mod:`bench.goals40_trace`
    (timestamps of its steps, rounds, snapshots, cleanups and store requests), its metrics.jsonl and trace
    kept in ``keep`` (default a new folder under /tmp), named ``<run>-<region>.*``."""
    from . import regionruns

    keep = keep or Path(tempfile.mkdtemp(prefix="goals40-trace-"))
    keep.mkdir(parents=True, exist_ok=True)
    print(f"trace: keeping records in {keep}", flush=True)
    launch_region, read_records = regionruns.launch_region, overlap.read_records
    at = {"run": 0}

    def traced(xr, *, env=None, **kw):
        env = {**(env or {}), goals40_trace.ENV_TRACE: str(keep / f"run{at['run']}-{xr.region}.trace.jsonl")}
        return launch_region(xr, env=env, module="bench.goals40_trace", **kw)

    def kept(run_dir: Path) -> list[dict]:
        shutil.copy(run_dir / "metrics.jsonl", keep / f"run{at['run']}-{run_dir.name}.metrics.jsonl")
        return read_records(run_dir)

    regionruns.launch_region, overlap.read_records = traced, kept
    try:
        for i, run in enumerate(runs):
            at["run"] = i
            (keep / f"run{i}.label").write_text(run[0])
            streaming(work / f"t{i}", (run,))
    finally:
        regionruns.launch_region, overlap.read_records = launch_region, read_records


def streaming(work: Path, runs: tuple[tuple[str, bool, dict, dict], ...] = STREAMING_RUNS) -> None:
    v = overlap.V("streaming", "bf16", 4, 2)
    sz = replace(overlap.FULL, base=(), streaming=(v,))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    prepare(data, REGIONS, "python-stdlib", DATA_BYTES)
    launch_pair = overlap.launch_pair
    try:
        for i, (label, together, xr, extra) in enumerate(runs):

            def pair(root, name, *, env=None, together=together, xr=xr, extra=extra, **rest):
                env = {**(env or {}), **extra}
                if together:
                    env[ENV_START_TOGETHER] = f"{root / 'together'}:2"
                return launch_pair(root, name, env=env, **rest, **xr)

            overlap.launch_pair = pair
            run = work / f"run{i}"  # its own store's directory
            run.mkdir()
            (vs,) = overlap._run_variants(run, data, sz, Result("goals40_diag", label, False))
            for r in REGIONS:
                f = vs["regions"][r]
                waits = [(rd, round(w, 2)) for rd, w in f["merge_waits"] if w > overlap.MERGE_WAIT_S]
                print(
                    f"{label}: region {r}: exposed {f['exposed_s']:.2f} s / wall {f['wall_s']:.1f} s = "
                    f"{f['exposed_s'] / f['wall_s']:.2%}; final join {f['exposed_final_s']:.2f} s; merge waits "
                    f"{sum(w for _, w in f['merge_waits']):.2f} s, over {overlap.MERGE_WAIT_S:g} s (round, s): "
                    f"{waits}; snapshots (round, s): {[(rd, round(x, 2)) for rd, x, _ in f['snapshots']]}",
                    flush=True,
                )
    finally:
        overlap.launch_pair = launch_pair


def heartbeat(work: Path) -> None:
    from .peer import _inputs
    from .peer_faults import fault_run
    from .peer_net import Net
    from .peer_sizes import SUBSETS
    from .wan import Star

    sz = SUBSETS["goals"]
    w = _inputs(work, sz)
    rate, rtt = sz.links[0]
    options = peer_launch.CrossRegion
    try:
        for hb in (5.0, 1.0):
            peer_launch.CrossRegion = lambda **kw: CrossRegion(**{**kw, "heartbeat_s": hb})  # type: ignore[misc,assignment] # noqa: B023
            with Star(rate_mbit=rate, rtt_ms=rtt, window_kb=sz.window_kb) as star:
                net = Net(star, w.work)
                net.start_s3("moto")
                try:
                    out = fault_run(net, w.work, w.fcfg, w.data, w.fsz, "ours", "one", whole_replica=True)
                finally:
                    net.stop()
            print(
                f"heartbeat_s {hb:g}: survivor stall {out['stall_s']:.1f} s, exits {out['rcs']}", flush=True
            )
    finally:
        peer_launch.CrossRegion = options  # type: ignore[misc]


def fault(work: Path) -> None:
    from .peer import _inputs
    from .peer_faults import fault_run
    from .peer_net import Net
    from .peer_sizes import SUBSETS, SYSTEMS
    from .wan import Star

    sz = SUBSETS["goals"]
    w = _inputs(work, sz)
    rate, rtt = sz.links[0]
    with Star(rate_mbit=rate, rtt_ms=rtt, window_kb=sz.window_kb) as star:
        net = Net(star, w.work)
        net.start_s3("moto")
        try:
            for system in SYSTEMS:
                fault_run(net, w.work, w.fcfg, w.data, w.fsz, system, "one")
        finally:
            net.stop()


def main(argv: list[str]) -> int:
    what = {
        "trace": trace,
        "streaming": streaming,
        "heartbeat": heartbeat,
        "fault": fault,
        "cleanup": cleanup,
    }
    if len(argv) != 1 or argv[0] not in what:
        print("usage: python -m bench.goals40_diag streaming|trace|heartbeat|fault|cleanup", file=sys.stderr)
        return 2
    work = Path(
        tempfile.mkdtemp(prefix="sbgen-goals40-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    try:
        what[argv[0]](work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
