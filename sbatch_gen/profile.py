"""Site profile schema (pydantic v2). Torch-free.

One YAML file per site in ``sites/``. The top-level ``kind`` picks the profile model (``slurm`` is the
default); each kind is a model in :data:`PROFILE_KINDS`. Sections that do not depend on how the job is
launched (paths, Python env, network/NCCL, trainer, torchrun, topology, preemption, cross-region) are
separate models so another kind can reuse them.

Validation rule for everything that ends up in a script: a value is either restricted to a safe
character set (names, numbers, anything written into an ``#SBATCH`` line, which Slurm does not
shell-parse) or it is shell-quoted by the renderer and reaches the job exactly as written. Values that
would silently mean something else (``$VAR`` or ``~`` in a path, control characters, ``%`` in a Slurm
filename pattern, a leading ``-`` where the value becomes a command's argument, a YAML boolean where a
number is meant) are rejected with a message saying why.

Rules for every string of a profile (keys included), checked once for the whole document before any field
(:meth:`_Strict._every_string`): no control characters (C0, DEL, C1) and no Unicode bidirectional controls,
so what a reviewer reads is what runs; and nothing shaped like a literal credential (the message says
``<redacted>``, never the value).
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from sbatch_gen.xr_options import (
    CrossRegion,
    credential_message,
    credential_shape,
    unsafe_chars,
    unsafe_chars_message,
)

# ---------------------------------------------------------------------------------------------------
# Value types


def _check(pattern: str, what: str):
    """A validator: `what` is "thing" or "thing (what is allowed)"."""
    rx = re.compile(pattern)
    name, _, hint = what.partition(" (")

    def check(v: str) -> str:
        if not rx.fullmatch(v):
            raise ValueError(f"invalid {name} {v!r}" + (f" ({hint}" if hint else ""))
        return v

    return check


def _no_control(v: str) -> str:
    bad = unsafe_chars(v)
    if bad:
        raise ValueError(unsafe_chars_message(bad))
    return v


def _not_an_option(what: str):
    """A validator for values that become a command's argument: a leading '-' would make it an option."""

    def check(v: str) -> str:
        if v.startswith("-"):
            raise ValueError(f"{what} {v!r} starts with '-': the command would read it as an option")
        return v

    return check


def _strict_int(v: object) -> object:
    # pydantic would take the YAML booleans (yes/no/on/off/true/false) as 1/0, "2" as 2 and 2.0 as 2.
    if isinstance(v, bool):
        raise ValueError("Input should be a valid integer, got a YAML boolean (true/false, yes/no, on/off)")
    if isinstance(v, str):
        hint = " (write the number without quotes)" if v.strip().isdigit() else ""
        raise ValueError(f"Input should be a valid integer, got the string {v!r}{hint}")
    if not isinstance(v, int):
        raise ValueError(f"Input should be a valid integer, got {v!r}")
    return v


def _path(v: str) -> str:
    if not v:
        raise ValueError("empty path")
    _no_control(v)
    if "$" in v:
        raise ValueError(
            f"path {v!r} contains '$': variables are not expanded in profile paths; write the path out"
        )
    if v.startswith("~"):
        raise ValueError(f"path {v!r} starts with '~', which is not expanded; write the path out")
    if v.startswith("-"):
        raise ValueError(f"path {v!r} starts with '-': a command taking it as an argument would read an option; "
                         f"write ./{v}")
    return v


_SBATCH_SAFE = r"[A-Za-z0-9_./+:=@,-]+"


def _log_dir(v: str) -> str:
    _path(v)
    if not re.fullmatch(_SBATCH_SAFE, v):
        raise ValueError(
            f"log dir {v!r} goes into '#SBATCH --output=', which Slurm does not quote: use only letters, "
            "digits and . _ / + : = @ , -"
        )
    return v


def _numeric_to_str(v: object) -> object:
    # YAML reads 23.11 as a float and 60 as an int; accept them where a string is meant.
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float):
        return str(v)
    return v


_TIME_RE = re.compile(
    r"(?:(?P<d>\d+)-(?P<dh>\d{1,2})(?::(?P<dm>\d{1,2})(?::(?P<ds>\d{1,2}))?)?)"  # D-H[:M[:S]]
    r"|(?P<h>\d+):(?P<hm>\d{1,2}):(?P<hs>\d{1,2})"  # H:M:S
    r"|(?P<m>\d+):(?P<ms>\d{1,2})"  # M:S
    r"|(?P<mins>\d+)"  # minutes
)


def slurm_time_seconds(v: str) -> int:
    """Seconds of a Slurm time limit string (raises ValueError)."""
    m = _TIME_RE.fullmatch(v)
    if m is None:
        raise ValueError(f"invalid time {v!r} (expected D-HH:MM:SS, HH:MM:SS or minutes)")
    g = {k: int(x) for k, x in m.groupdict().items() if x is not None}
    for k in ("dm", "ds", "hm", "hs", "ms"):
        if g.get(k, 0) >= 60:
            raise ValueError(f"invalid time {v!r}: minutes and seconds must be below 60")
    if "dh" in g and g["dh"] >= 24:
        raise ValueError(f"invalid time {v!r}: hours after 'D-' must be below 24")
    if "d" in g:
        secs = g["d"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0)
    elif "h" in g:
        secs = g["h"] * 3600 + g["hm"] * 60 + g["hs"]
    elif "m" in g:
        secs = g["m"] * 60 + g["ms"]
    else:
        secs = g["mins"] * 60
    if secs <= 0:
        raise ValueError(f"invalid time {v!r}: must be positive")
    return secs


def _slurm_time(v: str) -> str:
    slurm_time_seconds(v)
    return v


Name = Annotated[
    str,
    AfterValidator(_check(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", "name (letters, digits, . _ -; at most 64)")),
]
EnvName = Annotated[str, AfterValidator(_check(r"[A-Za-z_][A-Za-z0-9_]{0,127}", "environment variable name"))]
ModuleName = Annotated[
    str, AfterValidator(_check(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", "Python module name"))
]
PathStr = Annotated[str, AfterValidator(_path)]
# Every integer field: no YAML booleans, strings or floats.
Int = Annotated[int, BeforeValidator(_strict_int)]
LogDir = Annotated[str, AfterValidator(_log_dir)]
SlurmTime = Annotated[str, BeforeValidator(_numeric_to_str), AfterValidator(_slurm_time)]
Text = Annotated[str, AfterValidator(_no_control)]
SbatchSafe = Annotated[
    str,
    AfterValidator(
        _check(_SBATCH_SAFE, "value for an #SBATCH line (letters, digits and . _ / + : = @ , - only)")
    ),
]
Url = Annotated[str, AfterValidator(_check(r"https?://[A-Za-z0-9.:\[\]_~%/+-]+", "URL"))]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _every_string(cls, data: object) -> object:
        """The rules for every string (values and keys) of the section, before any field is validated, so
        no other message can quote a credential."""
        _check_strings(data, ())
        return data


def _check_strings(data: object, path: tuple[str | int, ...]) -> None:
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        if isinstance(k, str):
            _check_string(k, (*path, k))
        if isinstance(v, str):
            _check_string(v, (*path, k))
        else:
            _check_strings(v, (*path, k))


def _check_string(v: str, path: tuple[str | int, ...]) -> None:
    what = credential_shape(v)
    if what is not None:
        raise FieldError(path, credential_message(what))
    bad = unsafe_chars(v)
    if bad:
        raise FieldError(path, unsafe_chars_message(bad))


class FieldError(ValueError):
    """A model-level validation error that belongs to one field: ``path`` is relative to the model that
    raised it, so the loader can point at that field's line."""

    def __init__(self, path: tuple[str | int, ...], msg: str):
        super().__init__(msg)
        self.path = path


# ---------------------------------------------------------------------------------------------------
# Sections shared by every kind


class Paths(_Strict):
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


class _EnvCommon(_Strict):
    modules: list[Annotated[str, AfterValidator(_check(r"[A-Za-z0-9_.+/-]+", "module name")),
                            AfterValidator(_not_an_option("module `module load`"))]] = Field(
        default_factory=list, description="Environment modules to `module load` first (e.g. cuda/12.4)."
    )
    torch_spec: Annotated[str, AfterValidator(_check(r"[A-Za-z0-9_.,<>=!~\[\]-]+", "pip requirement")),
                          AfterValidator(_not_an_option("requirement for `pip install`"))] = (
        Field(default="torch", description="Setup job: pip requirement for torch, e.g. torch==2.6.0.")
    )
    torch_index_url: Url | None = Field(
        default=None,
        description="Setup job: index for the torch wheel (e.g. https://download.pytorch.org/whl/cu128).",
    )
    extras: list[Name] = Field(
        default_factory=lambda: ["train", "s3"], description="Setup job: extras of sbatch-gen to install."
    )


class VenvEnv(_EnvCommon):
    """A Python virtual environment (created by the setup job)."""

    kind: Literal["venv"] = "venv"
    path: PathStr = Field(default=".venv", description="The venv directory.")
    python: Annotated[str, AfterValidator(_check(r"[A-Za-z0-9_./+-]+", "interpreter")),
                      AfterValidator(_not_an_option("interpreter"))] = Field(
        default="python3", description="Setup job: interpreter that creates the venv."
    )


class CondaEnv(_EnvCommon):
    """A conda environment, activated with `conda activate` (created by the setup job)."""

    kind: Literal["conda"] = "conda"
    conda_sh: PathStr = Field(description="Path of etc/profile.d/conda.sh of the conda installation.")
    name: Name | None = Field(default=None, description="Environment name (or give prefix).")
    prefix: PathStr | None = Field(default=None, description="Environment prefix path (or give name).")
    python_version: Annotated[str, AfterValidator(_check(r"3\.\d{1,2}", "Python version"))] = Field(
        default="3.11", description="Setup job: Python version of a new environment."
    )

    @model_validator(mode="after")
    def _one_of(self) -> CondaEnv:
        if (self.name is None) == (self.prefix is None):
            raise FieldError(("name",), "set exactly one of name and prefix")
        return self


class NoEnv(_EnvCommon):
    """No activation: python/torchrun from PATH (a container image, or a site-wide installation)."""

    kind: Literal["none"] = "none"


PythonEnv = Annotated[VenvEnv | CondaEnv | NoEnv, Field(discriminator="kind")]


class Network(_Strict):
    socket_ifname: Annotated[str, AfterValidator(_check(r"[A-Za-z0-9_.:@-]{1,15}", "interface name")),
                             AfterValidator(_not_an_option("interface name"))] | None = (
        Field(
            default=None,
            description="Pin bootstrap/socket traffic to this interface (NCCL_SOCKET_IFNAME, "
            "GLOO_SOCKET_IFNAME); the preflight checks it exists on every node.",
        )
    )


class Nccl(_Strict):
    """NCCL and torch.distributed settings, exported to every job step. Ignored on CPU sites."""

    ib_hca: list[Annotated[str, AfterValidator(_check(r"[A-Za-z0-9_.-]+(:\d+)?", "HCA name"))]] = Field(
        default_factory=list, description="NCCL_IB_HCA: InfiniBand adapters to use (e.g. mlx5_0)."
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
        "entry names with ':port', else every port of the adapter) and fails on another value.",
    )
    ib_disable: bool = Field(default=False, description="NCCL_IB_DISABLE=1: no InfiniBand/RoCE.")
    p2p_disable: bool = Field(default=False, description="NCCL_P2P_DISABLE=1: no NVLink/PCIe peer-to-peer.")
    nvls_enable: bool | None = Field(default=None, description="NCCL_NVLS_ENABLE (NVLink SHARP); unset = NCCL decides.")
    ib_gid_index: Int | None = Field(default=None, ge=0, le=255, description="NCCL_IB_GID_INDEX (RoCE).")
    async_error_handling: bool = Field(
        default=True, description="TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed collective aborts the process."
    )
    heartbeat_timeout_s: Int | None = Field(
        default=600, ge=10, le=86400,
        description="TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: a hung rank is killed after this long.",
    )
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(default="WARN", description="NCCL_DEBUG.")
    debug_subsys: Annotated[str, AfterValidator(_check(r"\^?[A-Z,]+", "NCCL_DEBUG_SUBSYS"))] | None = Field(
        default=None, description="NCCL_DEBUG_SUBSYS, e.g. INIT,NET."
    )

    @model_validator(mode="after")
    def _link_layer(self) -> Nccl:
        if "ib_link_layer" in self.model_fields_set and (not self.ib_hca or self.ib_disable):
            why = "ib_disable is true" if self.ib_disable else "ib_hca is empty"
            raise FieldError(("ib_link_layer",), f"ib_link_layer is set but {why}, so no adapter is checked: "
                             "remove it (or list the adapters in ib_hca)")
        return self


class Trainer(_Strict):
    module: ModuleName = Field(default="sbatch_gen.train", description="Entry module, run as torchrun -m.")
    config: PathStr = Field(description="Train config passed as --config.")
    resume: Annotated[str, AfterValidator(_no_control)] = Field(
        default="auto", min_length=1, description="--resume: auto, none, or a checkpoint path."
    )
    max_steps: Int | None = Field(default=None, ge=1, description="--max-steps (unset: the config's).")
    extra_args: list[Text] = Field(default_factory=list, description="More trainer arguments, passed as given.")

    @model_validator(mode="after")
    def _resume(self) -> Trainer:
        if self.resume not in ("auto", "none"):
            try:
                _path(self.resume)
            except ValueError as e:
                raise FieldError(("resume",), f"must be auto, none or a checkpoint path: {e}") from None
        return self


class Torchrun(_Strict):
    rdzv_port: Int = Field(default=29500, ge=1024, le=65535, description="c10d rendezvous port on the first node.")
    rdzv_timeout_s: Int = Field(
        default=900, ge=10, le=86400, description="--rdzv-conf join_timeout: how long nodes wait for each other."
    )
    max_restarts: Int = Field(
        default=0, ge=0, le=100,
        description="--max-restarts: worker restarts inside one job attempt before the step fails.",
    )
    procs_per_node: Int | None = Field(
        default=None, ge=1, le=256,
        description="--nproc-per-node for CPU sites; on GPU sites it is the GPU count (leave unset).",
    )


class Topology(_Strict):
    """CPU/NUMA placement of the local ranks and the GPU-NIC affinity NCCL uses."""

    numa_binding: Literal["node", "socket", "exclusive", "core-complex"] | None = Field(
        default=None, description="torchrun --numa-binding: bind each local rank's CPUs and memory to its "
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


class Preemption(_Strict):
    """The signal plan: Slurm signals the batch shell lead_time_s before the limit; the trainer saves a
    checkpoint and the job is requeued while the requeue budget lasts."""

    signal: Literal["USR1", "USR2"] = Field(default="USR1", description="Signal sent to the batch shell.")
    lead_time_s: Int = Field(default=600, ge=30, le=65535, description="Seconds before the time limit.")
    checkpoint_s: Int = Field(default=120, ge=1, description="Expected time of one checkpoint save.")
    margin_s: Int = Field(default=60, ge=0, description="Slack on top of checkpoint_s.")
    ack_timeout_s: Int = Field(
        default=60, ge=1, le=3600, description="How long the batch shell waits for the trainer's .ack."
    )
    max_requeues: Int = Field(default=3, ge=0, le=1000, description="Requeues (SLURM_RESTART_COUNT) allowed.")

    @model_validator(mode="after")
    def _plan(self) -> Preemption:
        need = self.checkpoint_s + self.margin_s
        if self.lead_time_s < need:
            raise FieldError(
                ("lead_time_s",),
                f"lead_time_s {self.lead_time_s} is shorter than checkpoint_s + margin_s = "
                f"{self.checkpoint_s} + {self.margin_s} = {need}: the job could be killed mid-checkpoint; "
                "raise lead_time_s or lower checkpoint_s/margin_s"
            )
        return self


class Preflight(_Strict):
    enabled: bool = Field(default=True, description="Check every node before training starts.")
    connect_timeout_s: Int = Field(
        default=60, ge=1, le=3600, description="How long nodes try to reach the rendezvous endpoint."
    )


_RESERVED_ENV = {
    "MASTER_ADDR", "MASTER_PORT", "PATH", "PYTHONPATH", "VIRTUAL_ENV", "OMP_NUM_THREADS", "PYTHONUNBUFFERED",
    "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE",
    "NCCL_NVLS_ENABLE", "NCCL_IB_GID_INDEX", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "SBATCH_GEN_STOP_FILE",
    "NCCL_TOPO_FILE",
}


# extra_env names refused because they change how the shell, the dynamic loader or the Python interpreter
# behaves rather than configuring the program: a reviewer reading `export X=...` should not have to know
# that it reorders word splitting, runs a file at every bash start or injects a library into every process.
# Prefixes: BASH_* (bash's own: BASH_ENV, BASH_XTRACEFD, BASH_COMPAT, BASH_FUNC_name%% = exported functions).
_SHELL_ENV = {
    "ENV", "SHELLOPTS", "BASHOPTS", "IFS", "PS1", "PS2", "PS3", "PS4", "PROMPT_COMMAND", "CDPATH", "GLOBIGNORE",
    "EXECIGNORE", "POSIXLY_CORRECT", "TMOUT", "FUNCNEST", "HISTFILE", "INPUTRC", "SHELL",
}
_SHELL_ENV_PREFIXES = ("BASH_",)
_PYTHON_ENV = {
    "PYTHONHOME", "PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONEXECUTABLE", "PYTHONUSERBASE", "PYTHONPLATLIBDIR",
    "PYTHONSAFEPATH", "PYTHONNOUSERSITE",
}
# The dynamic loader (glibc ld.so): LD_*, GLIBC_TUNABLES, GCONV_PATH. extra_env_allow may opt in to the
# two with everyday uses (a library directory; a preloaded allocator such as tcmalloc).
_LOADER_ENV = {"GLIBC_TUNABLES", "GCONV_PATH"}
_LOADER_ENV_PREFIXES = ("LD_",)
LOADER_ENV_OPT_IN = ("LD_LIBRARY_PATH", "LD_PRELOAD")
# Credentials: their value would be written into out/, which is committed. Well-known names, and names
# ending in a credential word.
_CREDENTIAL_ENV = {
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_TOKEN", "WANDB_API_KEY", "GITHUB_TOKEN", "GH_TOKEN",
    "GITLAB_TOKEN", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_CLIENT_SECRET", "GOOGLE_API_KEY", "GOOGLE_APPLICATION_CREDENTIALS_JSON", "NGC_API_KEY",
    "DOCKER_PASSWORD", "COMET_API_KEY", "NEPTUNE_API_TOKEN", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
}
_CREDENTIAL_ENV_RE = re.compile(
    r".*(?:^|_)(?:SECRET|SECRET_KEY|SECRET_ACCESS_KEY|TOKEN|PASSWORD|PASSWD|API_KEY|APIKEY|ACCESS_KEY|PRIVATE_KEY)"
)


def _env_names(v: object) -> object:
    """extra_env names, checked before the values are validated (so no message can quote a value)."""
    if not isinstance(v, dict):
        return v
    for k in v:
        if not isinstance(k, str):
            continue
        if k in _RESERVED_ENV:
            raise FieldError((k,), f"{k} is set by sbatch-gen from other profile fields; set it there")
        if k.startswith(("SLURM_", "SBATCH_")):
            raise FieldError((k,), f"{k}: SLURM_*/SBATCH_* variables belong to Slurm")
        if k in _CREDENTIAL_ENV or _CREDENTIAL_ENV_RE.fullmatch(k):
            raise FieldError((k,), f"{k} holds a credential (value <redacted>): it would be written into out/, which "
                             "is committed; leave it in the job's environment (e.g. the submitting shell)")
        if k in _SHELL_ENV or k.startswith(_SHELL_ENV_PREFIXES):
            raise FieldError((k,), f"{k} changes how bash runs the script (see 'extra_env' in the README); "
                             "it cannot be set from the profile")
        if k in _PYTHON_ENV:
            raise FieldError((k,), f"{k} changes which code the Python interpreter runs; it cannot be set from the "
                             "profile (python_env and paths.code_dir choose the code)")
    return v


def _is_loader_env(name: str) -> bool:
    return name in _LOADER_ENV or name.startswith(_LOADER_ENV_PREFIXES)


class ProfileBase(_Strict):
    """Fields every kind of site profile has."""

    kind: str
    description: Text | None = Field(default=None, description="Free text, for people.")
    paths: Paths
    python_env: PythonEnv = Field(default_factory=VenvEnv, description="How python/torchrun are found.")
    network: Network = Field(default_factory=Network)
    nccl: Nccl = Field(default_factory=Nccl)
    extra_env: Annotated[dict[EnvName, Text], BeforeValidator(_env_names)] = Field(
        default_factory=dict, description="More environment variables exported to every job step. Not: "
        "credentials, variables of the shell (BASH_*, IFS, ENV, SHELLOPTS, PS4, ...), the dynamic loader (LD_*) "
        "or the Python interpreter (PYTHONHOME, PYTHONSTARTUP, ...).",
    )
    extra_env_allow: list[Literal[LOADER_ENV_OPT_IN]] = Field(
        default_factory=list,
        description="Dynamic-loader variables extra_env may set after all (LD_LIBRARY_PATH, LD_PRELOAD): an "
        "explicit opt-in, for a library directory or a preloaded allocator.",
    )
    trainer: Trainer
    torchrun: Torchrun = Field(default_factory=Torchrun)
    topology: Topology = Field(default_factory=Topology)
    cross_region: CrossRegion = Field(default_factory=CrossRegion)

    # The files this kind renders: (template, output file name pattern with {site}).
    OUTPUTS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def gpus_per_node(self) -> int:
        raise NotImplementedError

    def nproc_per_node(self) -> int:
        g = self.gpus_per_node()
        return g if g > 0 else (self.torchrun.procs_per_node or 1)

    def uses_gpus(self) -> bool:
        return self.gpus_per_node() > 0

    @model_validator(mode="after")
    def _numa_binding_needs_gpus(self) -> ProfileBase:
        if self.topology.numa_binding is not None and not self.uses_gpus():
            raise FieldError(("topology", "numa_binding"), "this site has no GPUs, and torchrun binds each "
                             "worker to its GPU's NUMA node (it fails without a GPU): remove it")
        return self

    @model_validator(mode="after")
    def _loader_env(self) -> ProfileBase:
        for k in self.extra_env:
            if _is_loader_env(k) and k not in self.extra_env_allow:
                hint = (f"; if it is meant, opt in with extra_env_allow: [{k}]" if k in LOADER_ENV_OPT_IN
                        else "; it cannot be set from the profile")
                raise FieldError(("extra_env", k), f"{k} changes how the dynamic loader loads every program of the "
                                 f"job{hint}")
        for i, k in enumerate(self.extra_env_allow):
            if k not in self.extra_env:
                raise FieldError(("extra_env_allow", i), f"{k} is allowed but extra_env does not set it: remove it")
        return self

    def _check_procs(self) -> None:
        if self.uses_gpus() and self.torchrun.procs_per_node not in (None, self.gpus_per_node()):
            raise FieldError(
                ("torchrun", "procs_per_node"),
                f"torchrun.procs_per_node ({self.torchrun.procs_per_node}) differs from the GPU count "
                f"({self.gpus_per_node()}); on GPU sites it is derived from the GPU count: remove it"
            )
        if not self.uses_gpus() and self.torchrun.procs_per_node is None:
            raise FieldError(("torchrun", "procs_per_node"), "required on a CPU site (slurm.gpus_per_node is 0)")
        if not self.uses_gpus() and self.topology.nccl_topo_file is not None:
            raise FieldError(("topology", "nccl_topo_file"), "this site has no GPUs: remove it")
        if not self.uses_gpus() and "nccl" in self.model_fields_set:
            raise FieldError(("nccl",), "this site has no GPUs, so NCCL settings would be ignored: remove the section")


# ---------------------------------------------------------------------------------------------------
# kind: slurm


class Container(_Strict):
    """Run the job steps in a container with pyxis/enroot (srun --container-*)."""

    image: Annotated[str, AfterValidator(_check(r"[A-Za-z0-9_./:#@+-]+", "container image"))] = Field(
        description="--container-image: registry image (e.g. nvcr.io#nvidia/pytorch:24.10-py3) or a .sqsh path."
    )
    mounts: list[
        # pyxis joins the entries with ',' and splits on it: no ',' anywhere in an entry.
        Annotated[str, AfterValidator(_check(r"/[A-Za-z0-9_./+@=-]*(:/[A-Za-z0-9_./+@=-]*)?(:[a-z0-9+=-]+)?",
                                             "mount (SRC[:DST[:FLAGS]], absolute paths, no ',' or spaces)"))]
    ] = Field(default_factory=list, description="--container-mounts entries SRC[:DST[:FLAGS]].")
    mount_home: bool = Field(default=False, description="Mount the home directory (--container-mount-home).")


# sbatch's long options (Slurm 23.02-24.11, with aliases). sbatch (getopt_long) takes any unique prefix of a
# long option, so `--outp=x` is `--output=x`: extra_directives are matched against this list by prefix.
SBATCH_LONG_OPTIONS = frozenset({
    "account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "chdir", "cluster", "cluster-constraint",
    "clusters", "comment", "constraint", "container", "container-id", "contiguous", "core-spec",
    "cores-per-socket", "cpu-freq", "cpus-per-gpu", "cpus-per-task", "deadline", "delay-boot", "dependency",
    "distribution", "error", "exclude", "exclusive", "export", "export-file", "extra", "extra-node-info",
    "get-user-env", "gid", "gpu-bind", "gpu-freq", "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task",
    "gres", "gres-flags", "help", "hint", "hold", "ignore-pbs", "immediate", "input", "job-name",
    "kill-on-invalid-dep", "licenses", "mail-type", "mail-user", "mcs-label", "mem", "mem-bind", "mem-per-cpu",
    "mem-per-gpu", "mincpus", "network", "nice", "no-kill", "no-requeue", "nodefile", "nodelist", "nodes",
    "ntasks", "ntasks-per-core", "ntasks-per-gpu", "ntasks-per-node", "ntasks-per-socket", "open-mode", "output",
    "overcommit", "oversubscribe", "parsable", "partition", "power", "prefer", "priority", "profile", "propagate",
    "qos", "quiet", "reboot", "requeue", "reservation", "resv-ports", "segment", "signal", "sockets-per-node",
    "spread-job", "stepmgr", "switches", "tasks", "test-only", "thread-spec", "threads-per-core", "time",
    "time-min", "tmp", "tres-bind", "tres-per-task", "uid", "usage", "use-min-nodes", "verbose", "version", "wait",
    "wait-all-nodes", "wckey", "workdir", "wrap",
})

# Most GPUs one node can have, per GRES type (lower case): HGX/DGX boards carry 8 SXM GPUs (H100, H200, B200,
# ...); Grace superchip nodes carry up to 4 (quad GH200 blades; a GB200/GB300 NVL72 tray is 2 superchips = 4
# GPUs); AMD: 8 MI300X/MI250X GCDs, 4 MI300A. Types not listed are only held to the general limit (64).
MAX_GPUS_PER_NODE: dict[str, int] = {
    "h100": 8, "h200": 8, "h800": 8, "h20": 8, "b200": 8, "b300": 8,
    "gh200": 4, "gb200": 4, "gb300": 4,
    "mi300x": 8, "mi325x": 8, "mi250x": 8, "mi300a": 4,
}


class SlurmResources(_Strict):
    version: Annotated[str, BeforeValidator(_numeric_to_str),
                       AfterValidator(_check(r"\d{2}\.\d{2}(\.\d+)?", "Slurm version (e.g. 23.11)"))] = Field(
        description="Slurm version of the site, e.g. '23.11'; the job warns when the cluster runs another."
    )
    partition: Name
    account: Name | None = None
    qos: Name | None = None
    reservation: Name | None = None
    job_name: Name | None = Field(default=None, description="Job name (default: the site name).")
    nodes: Int = Field(ge=1, le=100_000)
    gpus_per_node: Int = Field(ge=0, le=64, description="0 for a CPU site (then set torchrun.procs_per_node).")
    gpu_type: Name | None = Field(default=None, description="GRES type, e.g. h200 (gpu:h200:8).")
    gpu_request: Literal["gres", "gpus-per-node"] = Field(
        default="gres", description="How GPUs are requested: --gres=gpu[:type]:N or --gpus-per-node."
    )
    cpus_per_task: Int = Field(ge=1, le=4096, description="CPUs for the one task per node (torchrun and workers).")
    mem: Annotated[str, BeforeValidator(_numeric_to_str),
                   AfterValidator(_check(r"0|[1-9][0-9]*[KMGT]?", "memory (e.g. 480G, or 0 for all)"))] | None = None
    time: SlurmTime = Field(description="Time limit: D-HH:MM:SS, HH:MM:SS or minutes.")
    exclusive: bool = True
    constraint: Annotated[str, AfterValidator(_check(r"[A-Za-z0-9_&|\[\]()*:.!,-]+", "constraint"))] | None = None
    extra_directives: list[
        Annotated[str, AfterValidator(_check(r"--[a-z][a-z0-9-]*(=[A-Za-z0-9_./+:=@,%-]+)?",
                                             "directive (--name or --name=value, no spaces or quotes)"))]
    ] = Field(default_factory=list, description="More #SBATCH lines, e.g. --mail-type=FAIL.")
    setup_time: SlurmTime = Field(default="01:00:00", description="Time limit of the setup job.")

    _MANAGED: ClassVar[set[str]] = {
        "partition", "account", "qos", "reservation", "job-name", "nodes", "ntasks", "ntasks-per-node",
        "gres", "gpus", "gpus-per-node", "cpus-per-task", "mem", "time", "exclusive", "constraint",
        "output", "error", "open-mode", "signal", "requeue", "no-requeue", "export", "chdir",
        "tasks", "workdir",  # aliases of ntasks and chdir
    }

    @model_validator(mode="after")
    def _directives(self) -> SlurmResources:
        for i, d in enumerate(self.extra_directives):
            name = d[2:].split("=", 1)[0]
            if name in self._MANAGED:
                raise FieldError(("extra_directives", i), f"{d!r} is rendered from other fields; set those instead")
            if name in SBATCH_LONG_OPTIONS:
                continue
            full = sorted(o for o in SBATCH_LONG_OPTIONS if o.startswith(name))
            managed = [o for o in full if o in self._MANAGED]
            if managed:
                raise FieldError(("extra_directives", i), f"{d!r}: sbatch reads --{name} as an abbreviation of "
                                 f"{' or '.join('--' + o for o in managed)}, which is rendered from other fields; "
                                 "set those instead")
            if full:
                raise FieldError(("extra_directives", i), f"{d!r}: --{name} abbreviates "
                                 f"{' or '.join('--' + o for o in full)}: write the option out in full")
        if self.gpu_type and self.gpus_per_node == 0:
            raise FieldError(("gpu_type",), "gpu_type is set but gpus_per_node is 0")
        most = MAX_GPUS_PER_NODE.get((self.gpu_type or "").lower())
        if most is not None and self.gpus_per_node > most:
            raise FieldError(("gpus_per_node",), f"gpus_per_node is {self.gpus_per_node}, but a {self.gpu_type} node "
                             f"has at most {most} GPUs")
        return self


class SlurmProfile(ProfileBase):
    """A Slurm site: renders out/<site>.sbatch (training) and out/<site>.setup.sbatch (env set-up)."""

    kind: Literal["slurm"] = "slurm"
    slurm: SlurmResources
    container: Container | None = Field(default=None, description="pyxis container for the job steps.")
    preemption: Preemption = Field(default_factory=Preemption)
    preflight: Preflight = Field(default_factory=Preflight)

    OUTPUTS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("slurm.sbatch.j2", "{site}.sbatch"),
        ("slurm-setup.sbatch.j2", "{site}.setup.sbatch"),
    )

    def gpus_per_node(self) -> int:
        return self.slurm.gpus_per_node

    @model_validator(mode="after")
    def _cross_checks(self) -> SlurmProfile:
        self._check_procs()
        limit = slurm_time_seconds(self.slurm.time)
        if self.preemption.lead_time_s >= limit:
            raise FieldError(
                ("preemption", "lead_time_s"),
                f"preemption.lead_time_s ({self.preemption.lead_time_s} s) is not shorter than "
                f"slurm.time ({self.slurm.time} = {limit} s): the stop signal would come before the job starts"
            )
        if self.container is not None and self.python_env.kind != "none":
            raise FieldError(
                ("python_env", "kind"),
                f"python_env.kind is {self.python_env.kind!r} but a container is set: the image is the "
                "environment; use python_env: {kind: none}"
            )
        return self


# Registry of profile kinds: the loader picks the model by the top-level `kind` (default "slurm").
PROFILE_KINDS: dict[str, type[ProfileBase]] = {"slurm": SlurmProfile}
DEFAULT_KIND = "slurm"

# kind: ssh (sbatch_gen/ssh_profile.py) builds on the shared sections above and registers itself here.
import sbatch_gen.ssh_profile  # noqa: E402,F401
