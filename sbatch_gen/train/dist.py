"""Process-group setup: from torchrun's environment, or one plain process.

``DistInfo`` is the trainer's view of where this process sits (the cross-region sync builds on it).
Everything that matters when a job hangs at start is logged before the first collective.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("sbatch_gen.train")

# Environment variables worth seeing when a job hangs or is slow (prefixes and exact names).
_ENV_PREFIXES = ("NCCL_", "TORCH_", "GLOO_", "TORCHELASTIC_", "CUDA_", "FI_", "UCX_")
_ENV_NAMES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "OMP_NUM_THREADS",
    "SLURM_JOB_ID",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_RESTART_COUNT",
    "SLURMD_NODENAME",
    "SLURM_JOB_NODELIST",
    "HOSTNAME",
)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits inside its region.

    ``rank``/``world_size`` span the region's DDP group (every process torchrun started for this job);
    ``node_rank``/``num_nodes`` count torchrun agents (nodes). A plain process is rank 0 of 1.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    is_distributed: bool = False
    backend: str = "none"
    master_addr: str = ""
    master_port: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError as e:
        raise SystemExit(f"environment variable {name}={v!r} is not an integer") from e


def dist_info_from_env(backend: str = "none") -> DistInfo:
    """Read torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ...)."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    local_rank = _env_int("LOCAL_RANK", rank % max(local_world, 1))
    num_nodes = _env_int("GROUP_WORLD_SIZE", max(world // max(local_world, 1), 1))
    node_rank = _env_int("GROUP_RANK", rank // max(local_world, 1))
    if not (0 <= rank < world):
        raise SystemExit(f"RANK={rank} is outside WORLD_SIZE={world}")
    return DistInfo(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        is_distributed=world > 1 or "RANK" in os.environ,
        backend=backend,
        master_addr=os.environ.get("MASTER_ADDR", ""),
        master_port=os.environ.get("MASTER_PORT", ""),
    )


def dist_info_from_process_group() -> DistInfo:
    """This process's place from an initialised default process group (rank, world size, backend) and
    torchrun's variables for what the group does not know (local rank, node rank); a single process when
    no group is initialised. For trainers that set up ``torch.distributed`` themselves."""
    env = dist_info_from_env()
    if not (dist.is_available() and dist.is_initialized()):
        if env.world_size > 1:
            raise RuntimeError(
                f"WORLD_SIZE={env.world_size} but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group() first"
            )
        return DistInfo()
    rank, world = dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" in os.environ and (env.rank, env.world_size) != (rank, world):
        raise RuntimeError(
            f"the default process group is rank {rank} of {world}, the environment says RANK={env.rank} "
            f"WORLD_SIZE={env.world_size}: the region's group must be the default one"
        )
    local_world = env.local_world_size if "LOCAL_WORLD_SIZE" in os.environ else world
    local_rank = env.local_rank if "LOCAL_RANK" in os.environ else rank % local_world
    return DistInfo(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=env.node_rank if "GROUP_RANK" in os.environ else rank // local_world,
        num_nodes=env.num_nodes if "GROUP_WORLD_SIZE" in os.environ else max(world // local_world, 1),
        is_distributed=True,
        backend=str(dist.get_backend()),
        master_addr=env.master_addr,
        master_port=env.master_port,
    )


def pick_device(info: DistInfo) -> torch.device:
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        idx = info.local_rank % n
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def relevant_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}


def init(
    backend: str = "auto", timeout_s: float = 600.0, need_group: bool = False
) -> tuple[DistInfo, torch.device]:
    """Initialise the process group when started by torchrun (or any launcher setting RANK/WORLD_SIZE);
    with ``need_group`` (FSDP shards over a process group) a plain process gets a group of its own, of one
    rank over an in-memory store.

    ``backend``: ``auto`` (NCCL with CUDA, gloo without), ``nccl`` or ``gloo``.
    """
    pre = dist_info_from_env()
    if need_group and not pre.is_distributed:
        pre = DistInfo(**{**pre.__dict__, "is_distributed": True})
    device = pick_device(pre)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise SystemExit("backend nccl needs a CUDA device; none is visible (use gloo or auto)")
    info = DistInfo(**{**pre.__dict__, "backend": backend if pre.is_distributed else "none"})
    log.info(
        "rank %d/%d local_rank %d/%d node %d/%d device %s backend %s master %s:%s pid %d host %s",
        info.rank,
        info.world_size,
        info.local_rank,
        info.local_world_size,
        info.node_rank,
        info.num_nodes,
        device,
        info.backend,
        info.master_addr or "-",
        info.master_port or "-",
        os.getpid(),
        os.uname().nodename,
    )
    if info.is_main:
        for k, v in relevant_env().items():
            log.info("env %s=%s", k, v)
    if (
        info.is_main
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and _env_int("TORCHELASTIC_MAX_RESTARTS", 0) > 0
    ):
        log.warning(
            "torchrun shares its rendezvous store with the process group and may restart workers: a restarted "
            "worker can read the previous attempt's peer addresses and fail to connect (pytorch#135712). "
            "Export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun to get a fresh store per attempt."
        )
    if info.is_distributed:
        t0 = time.perf_counter()
        log.info(
            "init_process_group(%s) waiting for %d ranks (timeout %.0fs)", backend, info.world_size, timeout_s
        )
        dist.init_process_group(
            backend=backend,
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,  # None: the default
            # a plain process: no launcher's rendezvous to join
            store=dist.HashStore() if "RANK" not in os.environ and info.world_size == 1 else None,
        )
        log.info("process group ready in %.2fs", time.perf_counter() - t0)
    return info, device


def barrier(info: DistInfo, device: torch.device) -> None:
    if not info.is_distributed:
        return
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """Destroy every process group (the default one and every ``new_group``, shut down in reverse order of
    creation). A group an object still references (DDP's reducer, the async checkpoint's gloo group, the
    cross-region sync's groups) keeps its gloo worker threads until that object is freed: ``python -m
    sbatch_gen.train`` therefore ends without the interpreter's teardown (``exiting.exit_process``)."""
    if info.is_distributed and dist.is_initialized():
        dist.destroy_process_group()
