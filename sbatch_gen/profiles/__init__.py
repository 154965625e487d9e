"""Site profile schema (pydantic v2), one YAML file per site in ``sites/``. Torch-free.

The top-level ``kind`` picks the profile model from :data:`PROFILE_KINDS` (``slurm`` when absent). Modules:

- :mod:`.types`: value types and validators shared by every kind;
- :mod:`.environment`: the environment variables the job gets, and those ``extra_env`` may not set;
- :mod:`.base`: the sections every kind has, and :class:`ProfileBase` with the checks of every kind;
- :mod:`.slurm`, :mod:`.ssh`: one module per kind.

A new kind is a :class:`ProfileBase` subclass in its own module, added to :data:`PROFILE_KINDS` here.
"""

from __future__ import annotations

from sbatch_gen.profiles.base import (
    LOADER_ENV_OPT_IN,
    CondaEnv,
    Nccl,
    Network,
    NoEnv,
    Paths,
    ProfileBase,
    PythonEnv,
    Topology,
    Torchrun,
    Trainer,
    VenvEnv,
)
from sbatch_gen.profiles.environment import (
    RESERVED_ENV,
    RUNTIME_EXPORTS,
    EnvBlock,
    container_env_names,
    job_environment,
    nccl_ib_hca,
    preflight_ib_hca,
)
from sbatch_gen.profiles.slurm import (
    MAX_GPUS_PER_NODE,
    SBATCH_LONG_OPTIONS,
    Container,
    Preemption,
    Preflight,
    SlurmProfile,
    SlurmResources,
)
from sbatch_gen.profiles.ssh import SshConnection, SshHost, SshLaunch, SshNode, SshProfile
from sbatch_gen.profiles.types import slurm_time_seconds

# The kinds of site profile: the loader picks the model by the top-level `kind`.
PROFILE_KINDS: dict[str, type[ProfileBase]] = {"slurm": SlurmProfile, "ssh": SshProfile}
DEFAULT_KIND = "slurm"

__all__ = [
    "DEFAULT_KIND",
    "LOADER_ENV_OPT_IN",
    "MAX_GPUS_PER_NODE",
    "PROFILE_KINDS",
    "RESERVED_ENV",
    "RUNTIME_EXPORTS",
    "SBATCH_LONG_OPTIONS",
    "CondaEnv",
    "Container",
    "EnvBlock",
    "Nccl",
    "Network",
    "NoEnv",
    "Paths",
    "Preemption",
    "Preflight",
    "ProfileBase",
    "PythonEnv",
    "SlurmProfile",
    "SlurmResources",
    "SshConnection",
    "SshHost",
    "SshLaunch",
    "SshNode",
    "SshProfile",
    "Topology",
    "Torchrun",
    "Trainer",
    "VenvEnv",
    "container_env_names",
    "job_environment",
    "nccl_ib_hca",
    "preflight_ib_hca",
    "slurm_time_seconds",
]
