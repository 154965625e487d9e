"""What the test regions' workers share (``tests/xr/outer_worker.py``, ``tests/xr/fsdp_worker.py``: one rank of
a region driven by a small loop, no trainer, under torchrun with gloo): their common flags, the process group
and its :class:`DistInfo`, the mailbox's transport, the exit; and, on the test's side, one torchrun per
region started and waited for."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from sbatch_gen.train.dist import DistInfo
from sbatch_gen.xr_options import FsTransport, S3Transport, Transport

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 240  # per worker run; generous: the 2 cores are shared


def parser() -> argparse.ArgumentParser:
    """The flags every worker takes: its region, the run's regions, the mailbox (``--root``: a directory;
    ``--transport``: a transport as JSON, e.g. S3), where it writes (``--out``), how long it trains, and the
    DCP checkpoint it writes after ``--save-at`` or resumes from (``--resume``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--region", required=True)
    ap.add_argument("--regions", required=True)
    ap.add_argument("--root", default="")
    ap.add_argument("--transport", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--resume", default="")
    return ap


def transport(a: argparse.Namespace) -> FsTransport | S3Transport:
    """The mailbox's transport: ``--transport`` (JSON) or the directory ``--root``."""
    if a.transport:
        from pydantic import TypeAdapter

        return TypeAdapter(Transport).validate_json(a.transport)
    if not a.root:
        raise SystemExit("a worker needs --root or --transport")
    return FsTransport(root=a.root)


def init_region(nodes: int = 1) -> DistInfo:
    """The region's gloo process group, its ranks split into ``nodes`` pretend nodes (node_rank = rank //
    per_node, local_rank = rank % per_node)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = world // nodes
    return DistInfo(
        rank=rank,
        world_size=world,
        local_rank=rank % per_node,
        local_world_size=per_node,
        node_rank=rank // per_node,
        num_nodes=nodes,
        is_distributed=True,
        backend="gloo",
    )


def exit_now() -> None:
    """Leave without tearing the process groups down: gloo frees a finished work that a later barrier still
    held on its own thread, which needs the GIL that the thread destroying the group (DDP's reducer, at
    exit) holds while it joins that thread; on a loaded machine the worker then hangs at exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def resume(path: str, net, sync) -> int:
    """The model and the outer state from the DCP checkpoint at ``path`` (``--resume``; resharded to this
    world size), and its step; 0 without one."""
    if not path:
        return 0
    import torch.distributed.checkpoint as dcp

    state = {"model": net.state_dict(), "outer": sync.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=path)
    net.load_state_dict(state["model"])
    sync.load_state_dict(state["outer"])
    return int(state["step"])


def launch(module: str, region: str, regions: list[str], nproc: int, out: Path, *args: str, env=None):
    """One torchrun of ``nproc`` ranks running ``tests.xr.<module>`` for ``region``; its output goes to
    ``<out>/<region>.log``. Returns (process, log) for :func:`wait`."""
    from sbatch_gen.testing.regions import clean_env

    # as a module from the checkout: run as a script, tests/xr/concurrent.py would shadow the standard library's
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["--module", f"tests.xr.{module}", "--region", region, "--regions", ",".join(regions)]
    cmd += ["--out", str(out), *args]
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"{region}.log", "ab")  # noqa: SIM115 - closed by wait()
    p = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=clean_env(env), cwd=REPO, start_new_session=True
    )
    return p, log


def wait(runs, timeout: float = TIMEOUT) -> None:
    """Wait for each ``((process, log), name)`` to exit 0 within ``timeout`` s in all; kill what is left."""
    deadline = time.monotonic() + timeout
    try:
        for (p, log), name in runs:
            try:
                rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = f"nothing (killed after {timeout} s)"
            assert rc == 0, f"{name} exited {rc}:\n{Path(log.name).read_text()[-4000:]}"
    finally:
        stop(runs)


def stop(runs) -> None:
    """Kill what is left of each ``((process, log), name)`` and close its log."""
    from sbatch_gen.testing.regions import RegionRun

    for (p, log), _ in runs:
        if p.poll() is None:  # the torchrun agent's session (its workers run in sessions of their own)
            RegionRun("", Path(), [p], []).kill()
        log.close()
