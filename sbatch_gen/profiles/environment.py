"""What the job exports: one declaration for every kind (Slurm, SSH). Torch-free.

:func:`job_environment` builds the variables every job step gets from the table :data:`_ENV_TABLE`, so the
names sbatch-gen sets are known without a profile (:data:`JOB_ENV_NAMES`), and ``extra_env`` refuses exactly
those plus what the scripts export at run time (:data:`RESERVED_ENV`) and every ``SBATCH_GEN_XR_*`` name
(:data:`RESERVED_ENV_PREFIXES`: cross_region's variables, for a trainer.args without ``{xr_args}``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from sbatch_gen import contract, xr_options
from sbatch_gen.errors import FieldError


class JobProfile(Protocol):
    """What the job environment reads of a profile: :class:`sbatch_gen.profiles.base.ProfileBase` has it
    all. A protocol, so that this module need not import the profile's, which imports it (the names
    ``extra_env`` may not set)."""

    @property
    def network(self) -> Any: ...
    @property
    def nccl(self) -> Any: ...
    @property
    def topology(self) -> Any: ...
    @property
    def torchrun(self) -> Any: ...
    @property
    def trainer(self) -> Any: ...
    @property
    def cross_region(self) -> xr_options.CrossRegion: ...
    @property
    def extra_env(self) -> Mapping[str, str]: ...
    def uses_gpus(self) -> bool: ...
    def cpus_per_node(self) -> int: ...
    def nproc_per_node(self) -> int: ...


@dataclass(frozen=True)
class EnvBlock:
    key: str  # the profile key(s) behind these variables, for the comment above them
    vars: tuple[tuple[str, str], ...]
    # False: each value is a default, and a value the job's environment already holds (set at submit time:
    # `NCCL_DEBUG=INFO sbatch out/eu.sbatch`) wins. True: the value is set whatever the environment holds
    # (the policy: FORCED_ENV_NAMES, below).
    forced: bool = False
    # variables of this block the script sets later, at run time (NAME, where and from what), not here
    later: tuple[tuple[str, str], ...] = ()


# The variables a Slurm job sets at run time, not from the profile's value (main's use_allocated_cpus).
SLURM_RUN_TIME_ENV = {
    "OMP_NUM_THREADS": "main's use_allocated_cpus sets it, from the physical cores Slurm allocated"
}


def set_at_run_time(blocks: Sequence[EnvBlock], names: Mapping[str, str]) -> list[EnvBlock]:
    """BLOCKS with the variables NAMES lists moved to their block's ``later`` (with NAMES' words)."""
    return [
        replace(
            b,
            vars=tuple((n, v) for n, v in b.vars if n not in names),
            later=b.later + tuple((n, names[n]) for n, _ in b.vars if n in names),
        )
        for b in blocks
    ]


def nccl_ib_hca(p: JobProfile) -> str:
    """NCCL_IB_HCA as NCCL reads it: '=' first for exact names (else prefixes), then name[:port],..."""
    return ("=" if p.nccl.ib_hca_exact else "") + ",".join(p.nccl.ib_hca)


def preflight_ib_hca(p: JobProfile) -> str:
    """The NCCL_IB_HCA value the preflight checks on every node; empty when NCCL will not use the adapters
    (a CPU site, no nccl.ib_hca, or nccl.ib_disable)."""
    if not p.uses_gpus() or not p.nccl.ib_hca or p.nccl.ib_disable:
        return ""
    return nccl_ib_hca(p)


def _flag(on: bool) -> str:
    return "1" if on else "0"


def _unless_none(v: object) -> str | None:
    return None if v is None else str(v)


def _omp_threads(p: JobProfile) -> str:
    return str(max(1, p.cpus_per_node() // p.nproc_per_node()))


# A variable: its name and its value for a profile (None: not exported for this profile).
_Var = tuple[str, Callable[["JobProfile"], "str | None"]]


@dataclass(frozen=True)
class _Block:
    key: str  # EnvBlock.key
    when: Callable[[JobProfile], bool]  # whether the block is exported at all
    vars: tuple[_Var, ...]
    forced: bool = False  # EnvBlock.forced


def xr_in_environment(p: JobProfile) -> bool:
    """Whether the job carries cross_region to the trainer as SBATCH_GEN_XR_* variables: it is enabled, and
    trainer.args has no {xr_args} (the fixed flags and {xr_args} carry it as --xr-* flags instead)."""
    return p.cross_region.enabled and not p.trainer.passes("xr_args")


# Every variable sbatch-gen sets from profile fields, grouped by the profile section they come from, in the
# order of the script. (extra_env follows them.)
_ENV_TABLE: tuple[_Block, ...] = (
    _Block(
        "network.socket_ifname",
        lambda p: bool(p.network.socket_ifname),
        (
            ("NCCL_SOCKET_IFNAME", lambda p: p.network.socket_ifname if p.uses_gpus() else None),
            ("GLOO_SOCKET_IFNAME", lambda p: p.network.socket_ifname),
        ),
    ),
    _Block(
        "nccl",
        lambda p: p.uses_gpus(),
        (
            ("NCCL_IB_HCA", lambda p: nccl_ib_hca(p) if p.nccl.ib_hca else None),
            ("NCCL_IB_DISABLE", lambda p: _flag(p.nccl.ib_disable)),
            ("NCCL_IB_GID_INDEX", lambda p: _unless_none(p.nccl.ib_gid_index)),
            ("NCCL_P2P_DISABLE", lambda p: _flag(p.nccl.p2p_disable)),
            ("NCCL_NVLS_ENABLE", lambda p: None if p.nccl.nvls_enable is None else _flag(p.nccl.nvls_enable)),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", lambda p: _flag(p.nccl.async_error_handling)),
            ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", lambda p: _unless_none(p.nccl.heartbeat_timeout_s)),
            ("NCCL_DEBUG", lambda p: p.nccl.debug),
            ("NCCL_DEBUG_SUBSYS", lambda p: p.nccl.debug_subsys),
        ),
    ),
    _Block(
        "topology.nccl_topo_file",
        lambda p: p.uses_gpus() and p.topology.nccl_topo_file is not None,
        (("NCCL_TOPO_FILE", lambda p: p.topology.nccl_topo_file),),
    ),
    _Block("derived: the CPUs per process", lambda p: True, (("OMP_NUM_THREADS", _omp_threads),)),
    _Block("unbuffered output for the logs", lambda p: True, (("PYTHONUNBUFFERED", lambda p: "1"),)),
    # torchrun otherwise reuses its rendezvous TCP store across worker restarts, and restarted workers can
    # read the dead attempt's peer addresses (pytorch/pytorch#135712).
    _Block(
        "torchrun.max_restarts > 0: a fresh rendezvous store per restart",
        lambda p: p.torchrun.max_restarts > 0,
        (("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", lambda p: "1"),),
        forced=True,
    ),
)

# The export policy for the profile's variables: every one is a default that a value set at submit time
# overrides (the nccl section, network.socket_ifname, topology.nccl_topo_file, OMP_NUM_THREADS,
# PYTHONUNBUFFERED, extra_env), except these, always set: what the job's correctness depends on,
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE (restarted workers must not read a dead attempt's peers) and
# cross_region's SBATCH_GEN_XR_* (validate checks them across the regions of a run), and extra_env's LD_*
# names (LOADER_PREFIX). What the scripts set at run time (RUNTIME_EXPORTS, ACTIVATION_EXPORTS,
# SSH_LAUNCHER_EXPORTS below) is always set too.
FORCED_ENV_NAMES: frozenset[str] = frozenset(name for b in _ENV_TABLE if b.forced for name, _ in b.vars)

# extra_env's names that are the dynamic loader's (extra_env_allow): always set, not defaults.
LOADER_PREFIX = "LD_"

# Every name job_environment can set from profile fields (extra_env and cross_region's SBATCH_GEN_XR_*
# aside: which of those a job gets depends on the transport; RESERVED_ENV_PREFIXES covers them).
JOB_ENV_NAMES: frozenset[str] = frozenset(name for b in _ENV_TABLE for name, _ in b.vars)

# Variables the scripts set at run time (besides job_environment), for pyxis --container-env. The Slurm job's
# preflight finds the node program it staged in the run dir in SBATCH_GEN_NODE_PY.
RUNTIME_EXPORTS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTHONPATH",
    contract.ENV_STOP_FILE,
    contract.ENV_RUN_JOB,
    contract.ENV_PINNED_CODE,
    "SBATCH_GEN_NODE_PY",
)
# Variables the activation of python_env sets (a venv: VIRTUAL_ENV, and its bin/ first on PATH).
ACTIVATION_EXPORTS = ("PATH", "VIRTUAL_ENV")

# Variables the SSH launcher sets on every node for torchrun and the trainer (the process tag cleanup
# kills by, the node rank, the attempt number).
SSH_LAUNCHER_EXPORTS = ("SBATCH_GEN_TAG", "SBATCH_GEN_NODE_RANK", "SBATCH_GEN_ATTEMPT")

# What the Slurm training script exports for srun: the job steps take its whole environment (sbatch puts
# the job's --export in SLURM_EXPORT_ENV, which srun would otherwise apply to every step).
SLURM_STEP_EXPORTS = ("SLURM_EXPORT_ENV",)

# What extra_env may not set: sbatch-gen sets these from other profile fields.
RESERVED_ENV: frozenset[str] = (
    JOB_ENV_NAMES
    | frozenset(RUNTIME_EXPORTS)
    | frozenset(ACTIVATION_EXPORTS)
    | frozenset(SSH_LAUNCHER_EXPORTS)
    | frozenset(SLURM_STEP_EXPORTS)
)


# Prefixes of names extra_env may not set, and the profile field that sets them instead.
RESERVED_ENV_PREFIXES: dict[str, str] = {xr_options.ENV_PREFIX: "cross_region"}

# The comment above cross_region's variables (after the table's blocks, before extra_env).
XR_ENV_KEY = "cross_region, for the trainer as variables: trainer.args has no {xr_args}"


def job_environment(p: JobProfile) -> list[EnvBlock]:
    """Environment variables every job step gets, grouped by the profile section they come from."""
    blocks: list[EnvBlock] = []
    for b in _ENV_TABLE:
        if not b.when(p):
            continue
        values = ((name, value(p)) for name, value in b.vars)
        blocks.append(EnvBlock(b.key, tuple((name, v) for name, v in values if v is not None), b.forced))
    # A trainer with its own command line that takes no --xr-* flags reads the same options from the
    # environment (sbatch_gen.train.api.cross_region_from_env). Forced: validate checks them across the
    # regions of the run.
    if xr_in_environment(p):
        blocks.append(EnvBlock(XR_ENV_KEY, tuple(xr_options.to_env(p.cross_region).items()), forced=True))
    # extra_env: defaults, but for the dynamic loader's variables extra_env_allow opts in to (LD_LIBRARY_PATH,
    # LD_PRELOAD): a submitting shell nearly always has an LD_LIBRARY_PATH of its own (its modules), which
    # would silently win over the one the profile opted in to.
    plain = tuple((n, v) for n, v in p.extra_env.items() if not n.startswith(LOADER_PREFIX))
    loader = tuple((n, v) for n, v in p.extra_env.items() if n.startswith(LOADER_PREFIX))
    if plain:
        blocks.append(EnvBlock("extra_env", plain))
    if loader:
        blocks.append(EnvBlock("extra_env, the loader's (extra_env_allow)", loader, forced=True))
    return blocks


# What a Slurm job takes from the submitting shell besides Slurm's own SLURM_* variables (#SBATCH --export,
# submit_exports): PATH, where the job finds srun, scontrol and sbatch as the submitting shell did; and
# sbatch-gen's switches: a continuation job's SBATCH_GEN_CONTINUES and SBATCH_GEN_RUN_JOB (the job sets them
# itself when it submits one), and on a GPU site SBATCH_GEN_DEBUG (NCCL INFO per rank, the flight recorder).
SUBMIT_PATH = ("PATH",)
SUBMIT_SWITCHES = ("SBATCH_GEN_CONTINUES", contract.ENV_RUN_JOB)
DEBUG_SWITCH = "SBATCH_GEN_DEBUG"


def submit_defaults(p: JobProfile) -> list[str]:
    """The variables the job sets as defaults (every one but FORCED_ENV_NAMES, cross_region's and the
    loader's): a value set at submit time wins, so the job takes each from the submitting shell."""
    return [n for b in job_environment(p) if not b.forced for n, _ in b.vars]


def submit_exports(p: JobProfile, more: Sequence[str] = ()) -> list[str]:
    """#SBATCH --export: everything the job takes from the submitting shell (Slurm adds its SLURM_*): PATH,
    sbatch-gen's switches, the profile's defaults (submit_defaults), then ``more`` (slurm.export). Nothing
    else: no stray PYTHONPATH, CUDA_VISIBLE_DEVICES or NCCL_* variable, and no secret (slurm.secrets_file)."""
    switches = (*SUBMIT_SWITCHES, DEBUG_SWITCH) if p.uses_gpus() else SUBMIT_SWITCHES
    return list(dict.fromkeys([*SUBMIT_PATH, *switches, *submit_defaults(p), *more]))


def container_env_names(p: JobProfile) -> list[str]:
    """The variables pyxis passes into the container (--container-env)."""
    names = [n for b in job_environment(p) for n, _ in b.vars]
    return sorted(set(names) | set(RUNTIME_EXPORTS))


def reserved_reason(name: str, launcher: str = "slurm") -> str | None:
    """Why the job (LAUNCHER "slurm") or the SSH launcher ("ssh"), not the shell it starts from or a secret,
    decides variable NAME; None if nothing does (slurm.export, and the secrets of either kind:
    secret_name_problems)."""
    ssh = launcher == "ssh"
    who, shell = ("the launcher", "the launching shell") if ssh else ("the job", "the submitting shell")
    if name in ("ALL", "NONE") and not ssh:
        return "--export's own word: the job takes only the names listed"
    if name.startswith("SLURM_"):
        if ssh:
            return "a Slurm variable: on a host that had one, the node program and the trainer would take the launch for a Slurm job step"
        return "Slurm's own: Slurm sets the job's SLURM_* variables"
    if name.startswith(("SRUN_", "TORCHELASTIC_", "PET_")):
        return (
            "torchrun reads it as an option"
            if ssh
            else "srun or torchrun reads it as an option of every step"
        )
    for prefix, key in RESERVED_ENV_PREFIXES.items():
        if name.startswith(prefix):
            return f"{who} sets the {prefix}* variables from {key}"
    if name.startswith(("LD_", "BASH_")) or name in ("BASH_ENV", "ENV", "SHELLOPTS", "IFS"):
        return f"it changes how every program or bash {'on the hosts' if ssh else 'in the job'} starts"
    if name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if ssh:
            return "it decides which GPUs the workers of every host see (node.gpus: all of them)"
        return "Slurm sets it in every step from the GPUs it allocated"
    if name in FORCED_ENV_NAMES or (name in RESERVED_ENV and name not in JOB_ENV_NAMES):
        return f"{who} sets it whatever {shell} holds"
    return None


def secret_name_problems(
    field: tuple[str, ...], names: Sequence[str], profile_sets: Sequence[str], launcher: str = "slurm"
) -> list[FieldError]:
    """The problems of a profile's list of secrets by name (slurm.secrets, launch.secrets), at ``field``: a
    name listed twice, one the profile sets (``profile_sets``: its environment sections), one the job, Slurm
    or the launcher sets (reserved_reason, in LAUNCHER's words). Every item's problem at once."""
    key = ".".join(field)
    found: list[FieldError] = []
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            found.append(FieldError((*field, i), f"{name} is named twice (first at {key}[{seen[name]}])"))
            continue
        seen[name] = i
        why = (
            "the profile sets it (its environment sections)"
            if name in profile_sets
            else reserved_reason(name, launcher)
        )
        if why is not None:
            found.append(
                FieldError((*field, i), f"{name}: {why}; a secret is a variable of its own (e.g. HF_TOKEN)")
            )
    return found
