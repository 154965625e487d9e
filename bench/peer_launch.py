"""``bench peer``: one replica of a run, a torchrun of :data:`.peer_sizes.NPROC` processes, torchft's
(:mod:`bench.peer_torchft`) or our trainer, in its own namespace (the WAN) or on this host. Ours runs as a
user's job runs it (the Slurm and SSH renders): torchrun under the node program's run-trainer, which
announces the replica's leave in the mailbox when torchrun exits non-zero; torchft's is a bare torchrun, as
torchft's own examples start it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sbatch_gen import node_program
from sbatch_gen.contract import ENV_STOP_FILE, EXIT_REQUEUE
from sbatch_gen.testing.faults import ENV_STEP_SLEEP, MODULE
from sbatch_gen.testing.regions import RegionRun
from sbatch_gen.testing.s3server import free_port
from sbatch_gen.xr_options import CrossRegion, FsTransport, to_argv

from .common import PY, REPO, bench_env
from .peer_net import Net
from .peer_sizes import ALPHA, NPROC, OUTER_LR, OUTER_MOMENTUM, Sizes, V
from .regionruns import REGIONS


def launch(
    net: Net,
    root: Path,
    cfg: Path,
    data: Path,
    sz: Sizes,
    v: V,
    r: str,
    *,
    restart: bool = False,
    elastic: bool = False,
) -> RegionRun:
    """Replica ``r`` of run ``v``: a torchrun of :data:`NPROC` processes in its own namespace (the WAN) or on
    this host. ``restart``: after a kill (torchft heals from a live peer; ours resumes from its checkpoint and
    catches up from the mailbox). ``elastic``: ours with ``min_regions: 1`` (torchft's lighthouse decides
    that side: :meth:`Net.start_lighthouse`)."""
    env = {ENV_STEP_SLEEP: repr(sz.sleep_s)}
    if v.system == "torchft":
        env["TORCHFT_LIGHTHOUSE"] = net.lighthouse_url
        cmd = _torchft_cmd(net, root, cfg, sz, v, r)
    else:
        cmd, env_s3 = _ours_cmd(net, root, cfg, data, sz, v, r, restart=restart, elastic=elastic)
        env.update(env_s3)
    return _start(cmd, bench_env(env), root / "logs" / f"{r}.log", r, root / r)


def _torchft_cmd(net: Net, root: Path, cfg: Path, sz: Sizes, v: V, r: str) -> list[str]:
    args = ["--config", str(cfg), "--replica", r, "--out", str(root / r), "--inner-steps", str(sz.h)]
    args += [
        "--fragments",
        str(v.frags),
        "--delay",
        str(v.tau),
        "--alpha",
        str(ALPHA if v.frags > 1 else 0.0),
    ]
    args += ["--outer-lr", repr(OUTER_LR), "--outer-momentum", repr(OUTER_MOMENTUM)]
    # the replica's store is the rendezvous of torchft's cross-replica group: on the replica's address
    return _torchrun(net.prefix(r), net.addr(r), "bench.peer_torchft", args)


def _ours_cmd(
    net: Net, root: Path, cfg: Path, data: Path, sz: Sizes, v: V, r: str, *, restart: bool, elastic: bool
) -> tuple[list[str], dict[str, str]]:
    """Our trainer's command for replica ``r``, and the environment its S3 clients need."""
    env_s3: dict[str, str] = {}
    if v.transport == "s3":
        transport, env_s3 = net.s3("moto" if elastic else "nanio")
    else:
        transport = FsTransport(root=str(root / "mailbox"))
    fields: dict = {
        "enabled": True,
        "run_id": root.name,  # one per link and run: the store outlives a run
        "regions": REGIONS,
        "sync": "diloco",
        "transport": transport,
        "timeout_s": 600,
        "inner_steps": sz.h,
        "outer_lr": OUTER_LR,
        "outer_momentum": OUTER_MOMENTUM,
        "payload_dtype": v.dtype,
        "overlap": v.overlap,
        **({"min_regions": 1} if elastic else {"keep_rounds": 1}),
        **(
            {"fragments": v.frags, "fragment_delay_steps": v.tau, "fragment_alpha": ALPHA}
            if v.frags > 1
            else {}
        ),
    }
    xr = CrossRegion(region=r, **fields)
    resume = "auto" if restart else "none"
    args = [
        "--config",
        str(cfg),
        "--run-dir",
        str(root / r),
        "--resume",
        resume,
        "--data-path",
        str(data),
    ]
    # the trainer with the per-step sleep (ENV_STEP_SLEEP) installed from outside, its torchrun under
    # run-trainer as a job's node 0 runs it: the stop file, and a crash's leave announced
    stop = root / "stop" / r
    stop.parent.mkdir(parents=True, exist_ok=True)
    env_s3.update({ENV_STOP_FILE: str(stop), "SBATCH_GEN_NODE_RANK": "0"})
    supervise = [PY, "-I", str(Path(node_program.__file__)), "run-trainer", "--stop-file", str(stop)]
    supervise += ["--stopped-rc", str(EXIT_REQUEUE), "--"]
    cmd = _torchrun([], "127.0.0.1", MODULE, [*args, *to_argv(xr)])
    return [*net.prefix(r), *supervise, *cmd], env_s3


def _torchrun(prefix: list[str], master: str, module: str, args: list[str]) -> list[str]:
    return [
        *prefix,
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={NPROC}",
        f"--master-addr={master}",
        f"--master-port={free_port()}",
        "--max-restarts=0",
        "-m",
        module,
        *args,
    ]


def _start(cmd: list[str], env: dict, log: Path, region: str, run_dir: Path) -> RegionRun:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        p = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
    return RegionRun(region, run_dir, [p], [log], cmd)
