"""Sections every kind of site profile has, and :class:`ProfileBase` with the checks of every kind. Torch-free.

The sections that do not depend on how the job is launched (paths, Python env, network/NCCL, extra_env,
trainer, torchrun, topology, cross-region) live here; a kind (:mod:`.slurm`, :mod:`.ssh`) adds its own
sections and says, through a few methods, how many GPUs, CPUs and machines it has. The checks that only
depend on those (procs_per_node against the GPU count, GPU-only settings on a CPU site) are written once,
here, and run for every kind.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal, get_args

from pydantic import AfterValidator, Field, field_validator, model_validator

from sbatch_gen.errors import FieldError, raise_all
from sbatch_gen.launch import PLACEHOLDERS, PlaceholderError, Ref, parse_arg, placeholders_used
from sbatch_gen.metrics_options import MetricsOptions
from sbatch_gen.profiles.environment import RESERVED_ENV, RESERVED_ENV_PREFIXES
from sbatch_gen.profiles.types import (
    EnvName,
    Int,
    LogDir,
    ModuleName,
    Name,
    PathStr,
    ProfileSection,
    Text,
    Url,
    check_path,
    no_control,
    not_an_option,
    pattern_check,
)
from sbatch_gen.strict import check
from sbatch_gen.xr_options import CrossRegion


class Paths(ProfileSection):
    """Where things are. Relative paths are relative to the directory the job is submitted from."""

    code_dir: PathStr = Field(
        default=".", description="The code checkout; put first on PYTHONPATH and installed by the setup job."
    )
    run_dir: PathStr = Field(
        description="Run directory on a filesystem every node sees: checkpoints/, metrics.jsonl, stop files."
    )
    data: PathStr | None = Field(default=None, description="Training data; passed as --data-path.")
    log_dir: LogDir = Field(
        default="logs", description="Job logs. Slurm does not create it: create it before submitting."
    )


class _EnvCommon(ProfileSection):
    modules: list[
        Annotated[
            str,
            AfterValidator(pattern_check(r"[A-Za-z0-9_.+/-]+", "module name")),
            AfterValidator(not_an_option("module `module load`")),
        ]
    ] = Field(
        default_factory=list, description="Environment modules to `module load` first (e.g. cuda/12.4)."
    )
    torch_spec: Annotated[
        str,
        AfterValidator(pattern_check(r"[A-Za-z0-9_.,<>=!~\[\]-]+", "pip requirement")),
        AfterValidator(not_an_option("requirement for `pip install`")),
    ] = Field(default="torch", description="Setup job: pip requirement for torch, e.g. torch==2.6.0.")
    torch_index_url: Url | None = Field(
        default=None,
        description="Setup job: index for the torch wheel (e.g. https://download.pytorch.org/whl/cu128).",
    )
    extras: list[Name] = Field(
        default_factory=lambda: ["train", "s3"], description="Setup job: extras of sbatch-gen to install."
    )
    lock_dir: PathStr | None = Field(
        default="locks",
        description="Setup job: the directory of the version locks the regions share (in the checkout, "
        "relative to the submit directory): one pip constraints file per architecture, <arch>.txt (`uname "
        "-m`: x86_64, aarch64). The setup job installs torch and this checkout with the lock of its node's "
        "architecture (`pip install -c`), and writes one from what it installed when there is none: commit "
        "it, and every region of that architecture installs the same versions. null: no lock.",
    )


class VenvEnv(_EnvCommon):
    """A Python virtual environment (created by the setup job)."""

    kind: Literal["venv"] = Field(
        default="venv", description="venv: a virtual environment at path (the default python_env)."
    )
    path: PathStr = Field(default=".venv", description="The venv directory.")
    python: Annotated[
        str,
        AfterValidator(pattern_check(r"[A-Za-z0-9_./+-]+", "interpreter")),
        AfterValidator(not_an_option("interpreter")),
    ] = Field(default="python3", description="Setup job: interpreter that creates the venv.")


class CondaEnv(_EnvCommon):
    """A conda environment, activated with `conda activate` (created by the setup job)."""

    kind: Literal["conda"] = Field(
        default="conda",
        description="conda: a conda environment (conda_sh, and name or prefix), activated with `conda activate`.",
    )
    conda_sh: PathStr = Field(description="Path of etc/profile.d/conda.sh of the conda installation.")
    name: Name | None = Field(default=None, description="Environment name (or give prefix).")
    prefix: PathStr | None = Field(default=None, description="Environment prefix path (or give name).")
    python_version: Annotated[str, AfterValidator(pattern_check(r"3\.\d{1,2}", "Python version"))] = Field(
        default="3.11", description="Setup job: Python version of a new environment."
    )

    @check
    def _one_of(self) -> CondaEnv:
        if (self.name is None) == (self.prefix is None):
            raise FieldError(("name",), "set exactly one of name and prefix")
        return self


class NoEnv(_EnvCommon):
    """No activation: python/torchrun from PATH (a container image, or a site-wide installation)."""

    kind: Literal["none"] = Field(
        default="none",
        description="none: no activation; python and torchrun from PATH (a container image, a site-wide "
        "installation).",
    )


PythonEnv = Annotated[VenvEnv | CondaEnv | NoEnv, Field(discriminator="kind")]


class Network(ProfileSection):
    socket_ifname: (
        Annotated[
            str,
            AfterValidator(pattern_check(r"[A-Za-z0-9_.:@-]{1,15}", "interface name")),
            AfterValidator(not_an_option("interface name")),
        ]
        | None
    ) = Field(
        default=None,
        description="Pin bootstrap/socket traffic to this interface (NCCL_SOCKET_IFNAME, "
        "GLOO_SOCKET_IFNAME); the preflight checks it exists on every node.",
    )


class Nccl(ProfileSection):
    """NCCL and torch.distributed settings, exported to every job step. Ignored on CPU sites."""

    ib_hca: list[Annotated[str, AfterValidator(pattern_check(r"[A-Za-z0-9_.-]+(:\d+)?", "HCA name"))]] = (
        Field(default_factory=list, description="NCCL_IB_HCA: InfiniBand adapters to use (e.g. mlx5_0).")
    )
    ib_hca_exact: bool = Field(
        default=True,
        description="Prefix NCCL_IB_HCA with '=' (exact names). false: each name is a prefix and NCCL uses every "
        "adapter that starts with it (mlx5_1 also matches mlx5_10); the preflight then wants at least one match.",
    )
    ib_link_layer: Literal["InfiniBand", "Ethernet"] = Field(
        default="InfiniBand",
        description="The link layer the adapters of ib_hca must have (Ethernet: RoCE). NCCL uses a listed port "
        "whatever its link layer, so a storage or management Ethernet port in the list carries training traffic; "
        "the preflight reads /sys/class/infiniband/<hca>/ports/<port>/link_layer on every node (the port an "
        "entry names with ':port', else every port of the adapter) and fails on another value, or on a port "
        "whose state is not ACTIVE (NCCL silently leaves such a port out).",
    )
    ib_disable: bool = Field(default=False, description="NCCL_IB_DISABLE=1: no InfiniBand/RoCE.")
    p2p_disable: bool = Field(default=False, description="NCCL_P2P_DISABLE=1: no NVLink/PCIe peer-to-peer.")
    nvls_enable: bool | None = Field(
        default=None, description="NCCL_NVLS_ENABLE (NVLink SHARP); unset = NCCL decides."
    )
    ib_gid_index: Int | None = Field(default=None, ge=0, le=255, description="NCCL_IB_GID_INDEX (RoCE).")
    async_error_handling: bool = Field(
        default=True, description="TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed collective aborts the process."
    )
    heartbeat_timeout_s: Int | None = Field(
        default=600,
        ge=10,
        le=86400,
        description="TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: a hung rank is killed after this long.",
    )
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(
        default="WARN", description="NCCL_DEBUG."
    )
    debug_subsys: Annotated[str, AfterValidator(pattern_check(r"\^?[A-Z,]+", "NCCL_DEBUG_SUBSYS"))] | None = (
        Field(default=None, description="NCCL_DEBUG_SUBSYS, e.g. INIT,NET.")
    )

    @check
    def _link_layer(self) -> Nccl:
        if "ib_link_layer" in self.model_fields_set and (not self.ib_hca or self.ib_disable):
            why = "ib_disable is true" if self.ib_disable else "ib_hca is empty"
            raise FieldError(
                ("ib_link_layer",),
                f"ib_link_layer is set but {why}, so no adapter is checked: "
                "remove it (or list the adapters in ib_hca)",
            )
        return self


# How a running trainer is stopped (trainer.stop_protocol; docs/slurm.md, docs/ssh.md).
StopProtocol = Literal["sbatch-gen", "signal", "none"]


# trainer.args: the description lists the placeholders (sbatch_gen/launch.py: PLACEHOLDERS).
ARGS_DESCRIPTION = (
    "The trainer's whole argument list, instead of the fixed flags (--config, --run-dir, --resume, --data-path, "
    "--max-steps, the --xr-* flags, extra_args): for a trainer with its own command line. Each entry is one "
    "argument, passed as written except for placeholders, which sbatch-gen fills in: "
    + "; ".join(f"{{{k}}}: {v}" for k, v in PLACEHOLDERS.items())
    + ". A placeholder may be part of an argument (--job.dump_folder={run_dir}/titan); run-time values "
    "(the node count, the resume mode) stay shell variables of the launcher. Write {{ and }} for a literal "
    "brace; any other brace, and an unknown placeholder, is an error. Unset: the fixed flags. Not with "
    "extra_args; trainer.max_steps, when set, must appear as {max_steps}. With cross_region enabled and no "
    "{xr_args}, the job exports the same options to the trainer as environment variables instead "
    "(--xr-foo-bar VALUE as SBATCH_GEN_XR_FOO_BAR=VALUE, --xr-enabled as SBATCH_GEN_XR_ENABLED=1), which "
    "sbatch_gen.train.api.cross_region_from_env reads."
)


class Trainer(ProfileSection):
    module: ModuleName | None = Field(
        default="sbatch_gen.train",
        description="Entry module, run as `torchrun ... -m MODULE`. Set exactly one of module and script; "
        "with script, module defaults to unset (write `module: null` to drop one an extends: base sets).",
    )
    script: PathStr | None = Field(
        default=None,
        description="Entry script instead of a module, run as `torchrun ... SCRIPT` (a path relative to the "
        "submit directory; the preflight checks every node can read it).",
    )
    config: PathStr | None = Field(
        default=None,
        description="Train config, passed as --config (or where trainer.args says {config}); the preflight "
        "checks it is readable. Required unless trainer.args is set.",
    )
    resume: Annotated[str, AfterValidator(no_control)] = Field(
        default="auto",
        min_length=1,
        description="--resume (or {resume} in trainer.args): auto, none, or a checkpoint path.",
    )
    max_steps: Int | None = Field(
        default=None,
        ge=1,
        description="--max-steps (unset: the config's); with trainer.args only through {max_steps}.",
    )
    extra_args: list[Text] = Field(
        default_factory=list,
        description="More trainer arguments after the fixed flags, passed as given. Not with trainer.args "
        "(put them there).",
    )
    args: list[Text] | None = Field(default=None, description=ARGS_DESCRIPTION)
    stop_protocol: StopProtocol = Field(
        default="sbatch-gen",
        description="How a running trainer is stopped: on Slurm at the preemption signal (then the job is "
        "requeued), with the SSH launcher when it is stopped (Ctrl-C, SIGTERM, SIGHUP) or kills the nodes left "
        "after a failure. sbatch-gen: Slurm creates the stop file ($SBATCH_GEN_STOP_FILE), the trainer "
        "checkpoints at a step every rank agrees on, writes the .ack and exits 0; SSH sends SIGTERM to every "
        "process of the launch and SIGKILL after launch.kill_grace_s. signal: the signal goes to torchrun's agent "
        "of every node (Slurm: preemption.signal, through srun; SSH: SIGTERM), which forwards it to its workers "
        "and waits up to stop_grace_s for them to save and exit (rendered as torchrun --signals-to-handle and "
        "--shutdown-timeout, torch >= 2.12; sbatch-gen gives them too, and on an older torch runs torchrun "
        "through the node program's compat shim without them). Then Slurm requeues and SSH SIGKILLs what is left; "
        "resuming "
        "is the trainer's job. none: no graceful stop: Slurm requeues at once (the training step is killed), SSH "
        "sends SIGKILL at once; the trainer resumes from its own periodic checkpoints. See docs/slurm.md and "
        "docs/ssh.md.",
    )
    stop_grace_s: Int | None = Field(
        default=None,
        ge=1,
        le=3600,
        description="stop_protocol signal only: how long the workers have, from the signal, to save and exit "
        "(torchrun's --shutdown-timeout; then SIGKILL). Unset: on Slurm preemption.checkpoint_s + "
        "preemption.margin_s, with SSH launch.kill_grace_s. On Slurm it must be shorter than "
        "preemption.lead_time_s.",
    )

    @check
    def _stop_grace(self) -> Trainer:
        if self.stop_grace_s is not None and self.stop_protocol != "signal":
            raise FieldError(
                ("stop_grace_s",),
                f"only stop_protocol: signal uses stop_grace_s (stop_protocol is {self.stop_protocol}): remove it",
            )
        return self

    @check
    def _resume(self) -> Trainer:
        if self.resume not in ("auto", "none"):
            try:
                check_path(self.resume)
            except ValueError as e:
                raise FieldError(("resume",), f"must be auto, none or a checkpoint path: {e}") from None
        return self

    def passes(self, placeholder: str) -> bool:
        """Whether the trainer's arguments carry a value: with trainer.args, whether one of them names
        {placeholder}; the fixed flags carry every value that is set."""
        if self.args is None:
            return True
        return any(placeholder in names for _, names in placeholders_used(self.args))

    @model_validator(mode="before")
    @classmethod
    def _module_default(cls, data: object) -> object:
        """A script replaces the default module (an explicit module next to it is an error, below)."""
        if isinstance(data, dict) and data.get("script") is not None and "module" not in data:
            return {**data, "module": None}
        return data

    @check
    def _command_line(self) -> Trainer:
        """The entry point, and trainer.args against the fields it replaces or refers to."""
        if self.module is None and self.script is None:
            raise FieldError(("module",), "set trainer.module or trainer.script (what torchrun starts)")
        if self.module is not None and self.script is not None:
            raise FieldError(
                ("script",),
                f"trainer.module is set too ({self.module}): set exactly one of module and script "
                "(write `module: null` to drop a module that an extends: base sets)",
            )
        if self.args is None:
            if self.config is None:
                raise FieldError(("config",), "required field is missing (unless trainer.args is set)")
            return self
        if self.extra_args:
            raise FieldError(
                ("extra_args",),
                "extra_args add to the fixed flags, and trainer.args replaces them: put these arguments into "
                "trainer.args (or write `extra_args: []` to drop those of an extends: base)",
            )
        used: list[tuple[int, set[str]]] = []
        for i, a in enumerate(self.args):
            try:
                names = {x.name for x in parse_arg(a) if isinstance(x, Ref)}
            except PlaceholderError as e:
                raise FieldError(("args", i), str(e)) from None
            for name, value in (("config", self.config), ("max_steps", self.max_steps)):
                if name in names and value is None:
                    raise FieldError(
                        ("args", i),
                        f"{{{name}}}: trainer.{name} is not set (set it, or write the value here)",
                    )
            used.append((i, names))
        if self.max_steps is not None and not any("max_steps" in names for _, names in used):
            raise FieldError(
                ("max_steps",),
                "trainer.args has no {max_steps}, so max_steps would not reach the trainer: add {max_steps} to "
                "trainer.args, or remove max_steps",
            )
        return self


class Torchrun(ProfileSection):
    rdzv_port: Int = Field(
        default=29500, ge=1024, le=65535, description="c10d rendezvous port on the first node."
    )
    rdzv_timeout_s: Int = Field(
        default=900,
        ge=10,
        le=86400,
        description="--rdzv-conf join_timeout: how long nodes wait for each other.",
    )
    max_restarts: Int = Field(
        default=0,
        ge=0,
        le=100,
        description="--max-restarts: worker restarts inside one job attempt before the step fails.",
    )
    procs_per_node: Int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="--nproc-per-node for CPU sites; on GPU sites it is the GPU count (leave unset).",
    )
    rank_logs: bool = Field(
        default=False,
        description="One log per rank beside each node's: torchrun --log-dir and --tee=3 write every worker's "
        "stdout and stderr to <node>/<job id>_*/attempt_<restart>/<local rank>/{stdout,stderr}.log under "
        "<paths.log_dir>/<job>-<job id>.attempt-<n>.ranks/ (Slurm) or <launch logs>/attempt-<n>.node-<rank>.ranks/ "
        "(SSH), and prefix each of their lines in the node's log with [default<local rank>]:. For a trainer "
        "of one's own whose lines name no rank (the companion trainer's name theirs: [rank R/W]).",
    )


class Topology(ProfileSection):
    """CPU/NUMA placement of the local ranks and the GPU-NIC affinity NCCL uses."""

    numa_binding: Literal["node", "socket", "exclusive", "core-complex"] | None = Field(
        default=None,
        description="torchrun --numa-binding: bind each local rank's CPUs and memory to its "
        "GPU's NUMA node (torch >= 2.8; GPU sites only). torchrun refuses to start the workers, without a "
        "fallback, when numactl is missing or when the job step may use no CPU of a GPU's NUMA node; the "
        "preflight checks both on every node (exclusive: a physical core per GPU; socket: a usable CPU on every "
        "NUMA node, as torch needs).",
    )
    nccl_topo_file: PathStr | None = Field(
        default=None,
        description="NCCL_TOPO_FILE: the PCI/NUMA topology XML for NCCL where it cannot see it (VMs). NCCL "
        "gives each GPU the nearest HCA of nccl.ib_hca from the topology, so this is how the GPU-local "
        "NIC is chosen when autodetection is wrong.",
    )
    log_topology: bool = Field(default=True, description="Preflight logs `nvidia-smi topo -m` on every node.")


# extra_env names refused because they change how the shell, the dynamic loader or the Python interpreter
# behaves rather than configuring the program: a reviewer reading `export X=...` should not have to know
# that it reorders word splitting, runs a file at every bash start or injects a library into every process.
# Prefixes: BASH_* (bash's own: BASH_ENV, BASH_XTRACEFD, BASH_COMPAT, BASH_FUNC_name%% = exported functions).
_SHELL_ENV = {
    "ENV",
    "SHELLOPTS",
    "BASHOPTS",
    "IFS",
    "PS1",
    "PS2",
    "PS3",
    "PS4",
    "PROMPT_COMMAND",
    "CDPATH",
    "GLOBIGNORE",
    "EXECIGNORE",
    "POSIXLY_CORRECT",
    "TMOUT",
    "FUNCNEST",
    "HISTFILE",
    "INPUTRC",
    "SHELL",
}
_SHELL_ENV_PREFIXES = ("BASH_",)
_PYTHON_ENV = {
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONINSPECT",
    "PYTHONEXECUTABLE",
    "PYTHONUSERBASE",
    "PYTHONPLATLIBDIR",
    "PYTHONSAFEPATH",
    "PYTHONNOUSERSITE",
}
# The dynamic loader (glibc ld.so): LD_*, GLIBC_TUNABLES, GCONV_PATH. extra_env_allow may opt in to the
# two with everyday uses (a library directory; a preloaded allocator such as tcmalloc).
_LOADER_ENV = {"GLIBC_TUNABLES", "GCONV_PATH"}
_LOADER_ENV_PREFIXES = ("LD_",)
LoaderEnvOptIn = Literal["LD_LIBRARY_PATH", "LD_PRELOAD"]
LOADER_ENV_OPT_IN: tuple[str, ...] = get_args(LoaderEnvOptIn)
# Credentials: their value would be written into out/, which is committed. Well-known names, and names
# ending in a credential word.
_CREDENTIAL_ENV = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HUGGINGFACE_TOKEN",
    "WANDB_API_KEY",
    "GITHUB_TOKEN",
    "GH_TOKEN",
    "GITLAB_TOKEN",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_API_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS_JSON",
    "NGC_API_KEY",
    "DOCKER_PASSWORD",
    "COMET_API_KEY",
    "NEPTUNE_API_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
}
_CREDENTIAL_ENV_RE = re.compile(
    r".*(?:^|_)(?:SECRET|SECRET_KEY|SECRET_ACCESS_KEY|TOKEN|PASSWORD|PASSWD|API_KEY|APIKEY|ACCESS_KEY|PRIVATE_KEY)"
)


def _env_names(v: object, secret_how: str) -> object:
    """extra_env names, checked before the values are validated (so no message can quote a value); every
    name's problem at once. ``secret_how``: where the profile's kind takes a secret instead (SECRET_HOW)."""
    if not isinstance(v, dict):
        return v
    raise_all([e for k in v if isinstance(k, str) and (e := _env_name_problem(k, secret_how)) is not None])
    return v


def _env_name_problem(k: str, secret_how: str) -> FieldError | None:
    """Why extra_env may not set ``k`` (None: it may)."""
    prefix = next((x for x in RESERVED_ENV_PREFIXES if k.startswith(x)), None)
    if prefix is not None:
        field = RESERVED_ENV_PREFIXES[prefix]
        return FieldError((k,), f"{k}: {prefix}* variables are set by sbatch-gen from {field}; set it there")
    if k in RESERVED_ENV:
        return FieldError((k,), f"{k} is set by sbatch-gen from other profile fields; set it there")
    if k.startswith(("SLURM_", "SBATCH_")):
        return FieldError((k,), f"{k}: SLURM_*/SBATCH_* variables belong to Slurm")
    if is_credential_name(k):
        return FieldError(
            (k,),
            f"{k} holds a credential (value <redacted>): it would be written into out/, which "
            f"is committed; {secret_how}",
        )
    if k in _SHELL_ENV or k.startswith(_SHELL_ENV_PREFIXES):
        return FieldError(
            (k,),
            f"{k} changes how bash runs the script (see 'Value rules' in docs/profiles.md); "
            "it cannot be set from the profile",
        )
    if k in _PYTHON_ENV:
        return FieldError(
            (k,),
            f"{k} changes which code the Python interpreter runs; it cannot be set from the "
            "profile (python_env and paths.code_dir choose the code)",
        )
    return None


def is_credential_name(name: str) -> bool:
    """Whether a variable's name says it holds a credential (a well-known one, or one ending in a credential
    word): extra_env may not set one, slurm.export may not take one from the submitting shell."""
    return name in _CREDENTIAL_ENV or bool(_CREDENTIAL_ENV_RE.fullmatch(name))


def _is_loader_env(name: str) -> bool:
    return name in _LOADER_ENV or name.startswith(_LOADER_ENV_PREFIXES)


class ProfileBase(ProfileSection):
    """Fields every kind of site profile has."""

    kind: str = Field(description="The kind of site, which picks the profile model (slurm when absent).")
    description: Text | None = Field(default=None, description="Free text, for people.")
    paths: Paths = Field(
        description="Where the code, the run directory, the data and the logs are; relative paths are "
        "relative to the directory the job starts from (required)."
    )
    python_env: PythonEnv = Field(default_factory=VenvEnv, description="How python/torchrun are found.")
    network: Network = Field(
        default_factory=Network,
        description="The interface for bootstrap and socket traffic; unset: NCCL and Gloo choose.",
    )
    nccl: Nccl = Field(
        default_factory=Nccl,
        description="NCCL and torch.distributed settings exported to every job step (GPU sites only).",
    )
    extra_env: dict[EnvName, Text] = Field(
        default_factory=dict,
        description="More environment variables exported to every job step. Not: "
        "credentials, variables of the shell (BASH_*, IFS, ENV, SHELLOPTS, PS4, ...), the dynamic loader (LD_*) "
        "or the Python interpreter (PYTHONHOME, PYTHONSTARTUP, ...).",
    )
    extra_env_allow: list[LoaderEnvOptIn] = Field(
        default_factory=list,
        description="Dynamic-loader variables extra_env may set after all (LD_LIBRARY_PATH, LD_PRELOAD): an "
        "explicit opt-in, for a library directory or a preloaded allocator.",
    )
    trainer: Trainer = Field(
        description="What every node runs under torchrun: the entry point, its train config, resume mode, "
        "arguments and stop protocol (required)."
    )
    torchrun: Torchrun = Field(
        default_factory=Torchrun,
        description="torchrun's rendezvous port and timeout, restarts, and processes per node on CPU sites.",
    )
    topology: Topology = Field(
        default_factory=Topology,
        description="CPU/NUMA placement of the ranks and the topology file NCCL uses (both off by default), and "
        "the preflight's log of the GPU topology (on by default).",
    )
    cross_region: CrossRegion = Field(
        default_factory=CrossRegion,
        description="This site as one region of a cross-region run (DiLoCo or gradient averaging through a "
        "mailbox); off by default.",
    )
    metrics: MetricsOptions | None = Field(
        default=None,
        description="The companion trainer's metric sinks (TensorBoard, W&B, a Prometheus textfile), as "
        "--metrics-* flags that replace the train config's metrics section; with trainer.args, placed by "
        "{metrics_args}. Secrets stay in the environment: wandb_api_key_env names the variable.",
    )

    # The files this kind renders: (template, output file name pattern with {site}).
    OUTPUTS: ClassVar[tuple[tuple[str, str], ...]] = ()

    # The field that holds the GPU count, and how the messages of the shared checks name that count.
    GPUS_FIELD: ClassVar[str] = ""
    GPU_COUNT_NAME: ClassVar[str] = ""
    # What one machine of this kind is called in `sbatch-gen sites` ("node", "host").
    NODE_WORD: ClassVar[str] = "node"
    # Whether the render reads the train config's metrics section for the W&B key it sends (the SSH launcher,
    # credentials.config_metrics; a Slurm job reads its secrets on the node, named by the profile)
    SECRETS_FROM_CONFIG: ClassVar[bool] = False
    # How this kind takes a secret that extra_env refuses, for that refusal's message (its own secrets key).
    SECRET_HOW: ClassVar[str] = "name it as a secret of the profile's kind instead"

    @field_validator("extra_env", mode="before")
    @classmethod
    def _extra_env_names(cls, v: object) -> object:
        return _env_names(v, cls.SECRET_HOW)

    def gpus_per_node(self) -> int:
        """GPUs of one machine (0: a CPU site)."""
        raise NotImplementedError

    def cpus_per_node(self) -> int:
        """CPU cores the job has on one machine (OMP_NUM_THREADS = this / processes per node)."""
        raise NotImplementedError

    def node_count(self) -> int:
        """Machines the job runs on."""
        raise NotImplementedError

    def template_context(self, site_name: str) -> dict[str, object]:
        """Template variables only this kind's templates use (besides the common context of the renderer)."""
        return {}

    def stop_signal(self) -> str:
        """The signal (without SIG) that trainer.stop_protocol signal delivers to the workers."""
        raise NotImplementedError

    def stop_budget(self) -> tuple[int, str]:
        """What the profile budgets for a stop checkpoint: (seconds, the fields it comes from)."""
        raise NotImplementedError

    def stop_grace(self) -> tuple[int, str]:
        """How long stop_protocol signal gives the workers to save and exit: (seconds, the fields it comes from)."""
        if self.trainer.stop_grace_s is not None:
            return self.trainer.stop_grace_s, "trainer.stop_grace_s"
        secs, key = self.stop_budget()
        return secs, f"{key} (trainer.stop_grace_s unset)"

    def torchrun_shutdown_timeout(self) -> tuple[int, str] | None:
        """torchrun's --shutdown-timeout: how long its agent lets the workers exit after passing a signal on
        (or after a worker failed), before SIGKILL (seconds, the fields it comes from). Its default, 30 s,
        would cut a longer stop checkpoint short; None with stop_protocol none (no stop checkpoint)."""
        if self.trainer.stop_protocol == "signal":
            return self.stop_grace()
        if self.trainer.stop_protocol == "sbatch-gen":
            return self.stop_budget()
        return None

    def warnings(self) -> list[tuple[tuple[str | int, ...], str]]:
        """What validates but is likely not what was meant: (the field's path, the message), which
        ``validate`` and ``render`` print as notes at the field's line (docs/profiles.md)."""
        out: list[tuple[tuple[str | int, ...], str]] = []
        for name, value in self.extra_env.items():
            if "$" in value or "`" in value:
                out.append(
                    (
                        ("extra_env", name),
                        f"extra_env.{name}: {value!r} is exported as written: values are quoted, so '$' and "
                        "'`' are not expanded (the job's own variables, SLURM_JOB_ID and the like, are in every "
                        "process's environment already: read them there; write a path out in full)",
                    )
                )
        return out

    def nproc_per_node(self) -> int:
        g = self.gpus_per_node()
        return g if g > 0 else (self.torchrun.procs_per_node or 1)

    def uses_gpus(self) -> bool:
        return self.gpus_per_node() > 0

    def summary(self) -> str:
        """Machines and processes, for `sbatch-gen sites`: "2 node(s) x 8 GPU"."""
        per_node = f"{self.gpus_per_node()} GPU" if self.uses_gpus() else f"{self.nproc_per_node()} CPU procs"
        return f"{self.node_count()} {self.NODE_WORD}(s) x {per_node}"

    @check
    def _trainer_args_against_the_profile(self) -> ProfileBase:
        """trainer.args against the other sections: {data_path} needs paths.data. (An enabled cross_region
        without {xr_args} reaches the trainer as SBATCH_GEN_XR_* variables: environment.xr_in_environment.)"""
        args = self.trainer.args
        if args is None:
            return self
        used = placeholders_used(args)  # Trainer has refused malformed ones
        if self.metrics is not None and not self.trainer.passes("metrics_args"):
            raise FieldError(
                ("metrics",),
                "trainer.args has no {metrics_args}: the trainer would not get these settings (add "
                "{metrics_args} as an argument of its own, or remove metrics)",
            )
        for i, names in used:
            if "data_path" in names and self.paths.data is None:
                raise FieldError(
                    ("trainer", "args", i),
                    "{data_path}: paths.data is not set (set it, or write the path here)",
                )
        return self

    @check
    def _numa_binding_needs_gpus(self) -> ProfileBase:
        if self.topology.numa_binding is not None and not self.uses_gpus():
            raise FieldError(
                ("topology", "numa_binding"),
                "this site has no GPUs, and torchrun binds each worker to its GPU's NUMA node (it fails without "
                "a GPU): remove it",
            )
        return self

    @check
    def _loader_env(self) -> ProfileBase:
        for k in self.extra_env:
            if _is_loader_env(k) and k not in self.extra_env_allow:
                hint = (
                    f"; if it is meant, opt in with extra_env_allow: [{k}]"
                    if k in LOADER_ENV_OPT_IN
                    else "; it cannot be set from the profile"
                )
                raise FieldError(
                    ("extra_env", k),
                    f"{k} changes how the dynamic loader loads every program of the job{hint}",
                )
        for i, k in enumerate(self.extra_env_allow):
            if k not in self.extra_env:
                raise FieldError(
                    ("extra_env_allow", i), f"{k} is allowed but extra_env does not set it: remove it"
                )
        return self

    @check
    def _gpu_checks(self) -> ProfileBase:
        """The checks of every kind that depend on whether the site has GPUs."""
        gpus = self.gpus_per_node()
        procs = self.torchrun.procs_per_node
        if gpus > 0 and procs not in (None, gpus):
            raise FieldError(
                ("torchrun", "procs_per_node"),
                f"torchrun.procs_per_node ({procs}) differs from {self.GPU_COUNT_NAME or self.GPUS_FIELD} "
                f"({gpus}); on GPU sites it is derived from the GPU count: remove it",
            )
        if gpus == 0 and procs is None:
            raise FieldError(
                ("torchrun", "procs_per_node"), f"required on a CPU site ({self.GPUS_FIELD} is 0)"
            )
        if gpus == 0 and self.topology.nccl_topo_file is not None:
            raise FieldError(("topology", "nccl_topo_file"), "this site has no GPUs: remove it")
        if gpus == 0 and "nccl" in self.model_fields_set:
            raise FieldError(
                ("nccl",), "this site has no GPUs, so NCCL settings would be ignored: remove the section"
            )
        return self
