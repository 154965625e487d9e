"""Benchmark: sbatch-gen against torchft on the same work and the same emulated WAN, side by side in one run.

Two replicas (regions) a and b, each a torchrun of 2 processes (one DDP group over gloo), train the same
GPT on the same shards with the same inner AdamW, schedule, H, outer Nesterov lr and momentum and the
same injected per-step sleep (standing in for a faster device's compute):

* **torchft** 0.2.0 as its documentation sets it up: its lighthouse (``torchft_lighthouse``), a
  ``Manager`` per rank with a gloo process group across the replicas, ``torchft.local_sgd.DiLoCo``
  (:mod:`bench.peer_torchft`). The replicas exchange pseudo-gradients by allreduce, each rank with the
  same rank of the other replica.
* **ours**: the real trainer (``python -m sbatch_gen.testing.faults``: ``sbatch_gen.train`` with the per-step
  sleep installed, under torchrun, torchrun under the node program's run-trainer as the Slurm and SSH renders
  run it), DiLoCo over the S3 mailbox (nanio, the mailbox's test server) or over fs.

Variants: DiLoCo without overlap, and Streaming DiLoCo (F fragments, tau steps of delay; the same split
of the parameters and the same ``alpha`` on both sides). Ours with an fp32 payload (torchft's) and its
default bf16; torchft's quantized allreduce needs triton and CUDA, so it is fp32 here (and our int8, with
nothing to set beside it, is left to ``bench overlap`` and ``bench payload``).

The network (:class:`bench.wan.Star`): every replica in its own network namespace with its own link
(``tc tbf``) to a hub namespace; every TCP connection a replica opens gets the RTT and a per-stream
window from a transparent delay proxy, which also counts the bytes. torchft's lighthouse and our object
store both live in the hub: a replica's traffic to its peer (torchft) or to the store (ours) crosses its
own link. Faults, the same schedule on both sides (:data:`.peer_faults.FAULTS`): one replica killed and restarted, both,
and the coordinator lost (torchft's lighthouse, our store). ``--quick``: a tiny model, no WAN (everything on
this host's loopback, ours over fs), and the one-replica fault only.

This module is the entry (``python -m bench peer``): which runs, on which links, and the page. The pieces:
:mod:`.peer_sizes` (variants and sizes), :mod:`.peer_net` (loopback or the WAN, the coordinators),
:mod:`.peer_launch` (one replica), :mod:`.peer_runs` (one side-by-side run and its figures),
:mod:`.peer_faults` (the fault schedule), :mod:`.peer_report` (the page and ``peer.png``).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from sbatch_gen.train.data import prepare

from .common import Result
from .peer_faults import fault_run
from .peer_net import Net
from .peer_report import plot, report, report_faults
from .peer_runs import one
from .peer_sizes import FULL, QUICK, SUBSETS, SYSTEMS, Sizes
from .regionruns import DATA_BYTES, HELDOUT, REGIONS, train_config
from .wan import Star, available_star

__all__ = ["FULL", "QUICK", "run"]


def run(out_dir: Path, quick: bool = False, subset: str | None = None) -> Result:
    if subset is not None and subset not in SUBSETS:
        raise ValueError(f"peer: no subset {subset!r} (known: {', '.join(SUBSETS)})")
    sz = SUBSETS[subset] if subset is not None and not quick else QUICK if quick else FULL
    res = Result(
        "peer",
        "Side by side with torchft: the same model, data and WAN, measured in one run",
        quick,
        subset=sz.subset,
    )
    why = available_star() if sz.links else "--quick"
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-peer-", dir=shm if shm.is_dir() else None))
    try:
        rows, faults, fault_link = _measure(res, _inputs(work, sz), why)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_report(res, out_dir, sz, rows, why, faults, fault_link)
    return res


def write_report(
    res: Result,
    out_dir: Path,
    sz: Sizes,
    rows: list[dict],
    why: str | None,
    faults: list[dict],
    fault_link: str,
) -> None:
    """The page: setup, tables, goals, headline numbers and notes, and ``peer.png`` in ``out_dir``."""
    report(res, sz, rows, why)
    report_faults(res, sz, faults, fault_link)
    plot(res, out_dir, rows)


@dataclass(frozen=True)
class _Inputs:
    """What every run reads: the work directory, the data, the two train configs and their sizes."""

    work: Path
    data: Path
    cfg: Path  # the side-by-side runs
    fcfg: Path  # the fault runs
    sz: Sizes
    fsz: Sizes  # the fault runs' (their own per-step sleep)


def _inputs(work: Path, sz: Sizes) -> _Inputs:
    data = work / "data"
    prepare(data, [*REGIONS, HELDOUT], "python-stdlib", DATA_BYTES)
    cfg = train_config(
        work / "peer.yaml",
        steps=sz.h * sz.rounds,
        model=sz.model,
        batch=sz.batch,
        data_dir=data,
        ckpt_every=1_000_000,
        warmup=1,
    )
    fcfg = train_config(
        work / "fault.yaml",
        steps=sz.h * sz.fault_rounds,
        model=sz.model,
        batch=sz.batch,
        data_dir=data,
        ckpt_every=sz.h,  # ours resumes a restarted replica from its newest checkpoint
        warmup=1,
    )
    return _Inputs(work, data, cfg, fcfg, sz, replace(sz, sleep_s=sz.fault_sleep_s))


def _measure(res: Result, w: _Inputs, why: str | None) -> tuple[list[dict], list[dict], str]:
    """Every run: (side-by-side rows, fault runs, the link the faults ran on)."""
    sz = w.sz
    rows: list[dict] = []
    faults: list[dict] = []
    fault_link = "-"
    # loopback: the systems' own costs, no network; then each emulated link; the faults on the first
    net = Net(None, w.work)
    for v in sz.variants(wan=False) if sz.loopback else ():
        rows.append(one(net, w.work, w.cfg, w.data, sz, v, "loopback"))
    links = sz.links if why is None else ()
    if not links and sz.faults:
        faults = _loopback_faults(net, w)
        fault_link = "loopback"
    for k, (rate, rtt) in enumerate(links):
        link = f"{rate} Mbit/s, {rtt:g} ms"
        with Star(rate_mbit=rate, rtt_ms=rtt, window_kb=sz.window_kb) as star:
            net = Net(star, w.work)
            got = _on_link(net, w, link, rows, with_faults=k == 0)
            if got is not None:
                faults, fault_link = got, link
            res.setup.append(f"**{link}**: {star.describe()}")
    if sz.links and why is not None:
        res.notes.append(f"No emulated WAN ({why}): loopback only, the goals not judged.")
    return rows, faults, fault_link


def _loopback_faults(net: Net, w: _Inputs) -> list[dict]:
    net.start_s3("moto")
    try:
        return [
            fault_run(net, w.work, w.fcfg, w.data, w.fsz, sy, f)
            for f in w.sz.faults
            if f != "coordinator"  # an unreachable store needs the WAN's namespaces
            for sy in SYSTEMS
        ]
    finally:
        net.stop()


def _on_link(net: Net, w: _Inputs, link: str, rows: list[dict], *, with_faults: bool) -> list[dict] | None:
    """Every variant on one emulated link (appended to ``rows``), then, on the first, the fault runs."""
    net.start_s3("nanio")
    if with_faults and w.sz.faults:
        net.start_s3("moto")
    try:
        for v in w.sz.variants(wan=True):
            rows.append(one(net, w.work, w.cfg, w.data, w.sz, v, link))
        if with_faults:
            return [
                fault_run(net, w.work, w.fcfg, w.data, w.fsz, sy, f) for f in w.sz.faults for sy in SYSTEMS
            ]
        return None
    finally:
        net.stop()
