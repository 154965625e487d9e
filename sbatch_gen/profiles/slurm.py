"""``kind: slurm`` site profiles (the default kind): a Slurm cluster. Torch-free.

Renders ``out/<site>.sbatch`` (training) and ``out/<site>.setup.sbatch`` (environment set-up). Builds on the
shared sections of :mod:`sbatch_gen.profiles.base`; adds the Slurm resources, the pyxis container, the
preemption plan and the preflight switch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from sbatch_gen.credentials import SecretEnv, bucket_check, secret_env, with_listed
from sbatch_gen.errors import FieldError, raise_all
from sbatch_gen.profiles.base import Paths, ProfileBase, is_credential_name
from sbatch_gen.profiles.environment import (
    container_env_names,
    job_environment,
    reserved_reason,
    secret_name_problems,
    submit_exports,
)
from sbatch_gen.profiles.types import (
    SBATCH_CONSTRAINT_CHARS,
    SBATCH_DIRECTIVE_VALUE_CHARS,
    EnvName,
    Int,
    Name,
    PathStr,
    ProfileSection,
    SlurmTime,
    Text,
    check_path,
    numeric_to_str,
    pattern_check,
    slurm_time_seconds,
)
from sbatch_gen.strict import check


def _secrets_path(v: str) -> str:
    """slurm.secrets_file: a path as written in a profile (check_path), or one under the home directory, ~/..."""
    if v.startswith("~") and not v.startswith("~/"):
        raise ValueError(
            f"path {v!r}: of '~' only ~/ (the home directory on the node) is expanded; write the path out"
        )
    check_path(v[2:] if v.startswith("~/") else v)
    return v


# slurm.secrets_file: a secret is the user's own, so its file may be named from the home directory (~/)
SecretsPath = Annotated[str, AfterValidator(_secrets_path)]


def _not_exportable(name: str, taken: Sequence[str]) -> str | None:
    """Why slurm.export may not name NAME (None: it may); TAKEN: what the job takes anyway."""
    if name in taken:
        return "the job takes it already (PATH, sbatch-gen's switches and the profile's defaults, which a submit-time value overrides)"
    return reserved_reason(name)


class Preemption(ProfileSection):
    """The signal plan: Slurm signals the batch shell lead_time_s before the limit; the trainer saves a
    checkpoint and the job is requeued. A budget stops crash loops, not progress: only attempts in a row that
    saved no newer checkpoint count against it."""

    signal: Literal["USR1", "USR2"] = Field(default="USR1", description="Signal sent to the batch shell.")
    lead_time_s: Int = Field(
        default=600,
        ge=30,
        le=65535,
        description="Seconds before the time limit. Slurm sends the signal at its periodic check (every 30 s) "
        "once the job is within lead_time_s + 30 s of its limit: between lead_time_s + 30 and lead_time_s "
        "before it.",
    )
    checkpoint_s: Int = Field(default=120, ge=1, description="Expected time of one checkpoint save.")
    margin_s: Int = Field(default=60, ge=0, description="Slack on top of checkpoint_s.")
    ack_timeout_s: Int = Field(
        default=60,
        ge=1,
        le=3600,
        description="How long the batch shell waits for the trainer's .ack (trainer.stop_protocol sbatch-gen).",
    )
    max_requeues_without_progress: Int = Field(
        default=3,
        ge=0,
        le=1000,
        description="Requeues allowed in a row after attempts that saved no newer checkpoint (a crash loop). An "
        "attempt that completed a checkpoint (periodic or stop, in <paths.run_dir>/checkpoints/) newer than "
        "the one it started from resets the count, and one that Slurm preempted leaves it as it is: a run of "
        "many time-limit slices and preemptions is never stopped by it. Counted in <paths.run_dir>/stop/<job>.requeues-without-progress across requeues and "
        "continuation jobs; a new submission starts at 0.",
    )
    max_excluded_nodes: Int = Field(
        default=2,
        ge=0,
        le=1000,
        description="Nodes a job leaves behind at most: a node whose preflight fails is excluded from the next "
        "attempt (scontrol requeuehold, ExcNodeList, release) while fewer than this many are excluded and "
        "the partition keeps enough other nodes; past that the job stops, naming the nodes. 0: a failed "
        "preflight ends the job.",
    )
    exit_wait_s: Int = Field(
        default=60,
        ge=1,
        le=86400,
        description="How long a node whose workers have finished waits for the other nodes (torchrun's exit "
        "barrier, set by the node program; torch's own is 300 s), and once the first node's training task has "
        "exited, how long the others get before srun ends them (srun --wait): a node that hangs after the "
        "others stopped or finished holds the allocation at most about twice this, never until the time limit.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        if isinstance(data, dict) and "max_requeues" in data:
            raise FieldError(
                ("max_requeues",),
                "renamed to max_requeues_without_progress: it now counts only requeues in a row after attempts "
                "that saved no newer checkpoint (time-limit slices and preemptions that checkpointed no "
                "longer use it up); rename the key, keeping the value",
            )
        return data

    @check
    def _plan(self) -> Preemption:
        need = self.checkpoint_s + self.margin_s
        if self.lead_time_s < need:
            raise FieldError(
                ("lead_time_s",),
                f"lead_time_s {self.lead_time_s} is shorter than checkpoint_s + margin_s = "
                f"{self.checkpoint_s} + {self.margin_s} = {need}: the job could be killed mid-checkpoint; "
                "raise lead_time_s or lower checkpoint_s/margin_s",
            )
        return self


class SlurmPaths(Paths):
    """Where things are (relative paths: to the submit directory), and whether the code is pinned."""

    pin_code: bool = Field(
        default=True,
        description="Run every attempt of a run on the code it was submitted with. A new submission "
        "copies code_dir's files (a git checkout's tracked and untracked, not ignored) to "
        "<run_dir>/code/<job id>/ and records the commit and whether the tree was dirty; requeues and "
        "continuation jobs run that copy (first on PYTHONPATH, with trainer.config and trainer.script when "
        "they lie in code_dir), whatever the checkout holds by then. A code_dir that is not a git checkout is "
        "not pinned (a WARNING says so).",
    )
    pin_code_keep: Int = Field(
        default=3,
        ge=1,
        le=1000,
        description="How many submissions' pinned code the run dir keeps (paths.pin_code), the new one included: "
        "when a new submission has pinned its code, the copies and records under <run_dir>/code/ of the older "
        "submissions beyond these are removed, one line each in the batch log, and of sbatch-gen's files staged in "
        "<run_dir>/node/ all but this many most recently used of each kind. A requeue or continuation "
        "job of a removed submission would end in one line (resubmit): as only one job runs on a run dir at a "
        "time, that can only befall a submission whose continuation job still waits in the queue.",
    )

    @check
    def _keep_needs_pin(self) -> SlurmPaths:
        if "pin_code_keep" in self.model_fields_set and not self.pin_code:
            raise FieldError(
                ("pin_code_keep",),
                "pin_code_keep is set but pin_code is false: no submission's code is pinned, so it keeps and "
                "removes nothing: remove it (or set pin_code: true)",
            )
        return self


class Preflight(ProfileSection):
    enabled: bool = Field(default=True, description="Check every node before training starts.")
    health_check: Text | None = Field(
        default=None,
        description="A site's own node health check (NHC, a dcgmi diag, a script of the cluster's), run by bash "
        "on every node in the preflight, from the submit directory with python_env active. Non-zero: the node "
        "fails its preflight with the check's last line of output, and the next attempt leaves it behind "
        "(preemption.max_excluded_nodes).",
    )
    connect_timeout_s: Int = Field(
        default=60, ge=1, le=3600, description="How long nodes try to reach the rendezvous endpoint."
    )


class Container(ProfileSection):
    """Run the job steps in a container with pyxis/enroot (srun --container-*)."""

    image: Annotated[str, AfterValidator(pattern_check(r"[A-Za-z0-9_./:#@+-]+", "container image"))] = Field(
        description="--container-image: registry image (e.g. nvcr.io#nvidia/pytorch:24.10-py3) or a .sqsh path."
    )
    mounts: list[
        # pyxis joins the entries with ',' and splits on it: no ',' anywhere in an entry.
        Annotated[
            str,
            AfterValidator(
                pattern_check(
                    r"/[A-Za-z0-9_./+@=-]*(:/[A-Za-z0-9_./+@=-]*)?(:[a-z0-9+=-]+)?",
                    "mount (SRC[:DST[:FLAGS]], absolute paths, no ',' or spaces)",
                )
            ),
        ]
    ] = Field(default_factory=list, description="--container-mounts entries SRC[:DST[:FLAGS]].")
    mount_home: bool = Field(default=False, description="Mount the home directory (--container-mount-home).")
    name: (
        Annotated[str, AfterValidator(pattern_check(r"[A-Za-z0-9][A-Za-z0-9_.-]*", "container name"))] | None
    ) = Field(
        default="sbatch-gen",
        description="--container-name: the job's steps (the preflight, the training step, each attempt's) "
        "share one container per node, so the image is unpacked once per job, not once per srun (pyxis "
        "removes it when the job ends). null: an unnamed container per step.",
    )
    writable: bool | None = Field(
        default=None,
        description="true: --container-writable, false: --container-readonly; null (default): the cluster's "
        "enroot setting (ENROOT_ROOTFS_WRITABLE).",
    )
    workdir: PathStr | None = Field(
        default=None,
        description="--container-workdir: the working directory inside the container. null (default): the "
        "submit directory ($PWD), which must then be inside container.mounts.",
    )

    @field_validator("image")
    @classmethod
    def _enroot_uri(cls, v: str) -> str:
        """pyxis takes enroot URIs: a registry host is separated from the image by '#', not '/'."""
        head, sep, rest = v.partition("/")
        if (
            sep
            and "#" not in v
            and not v.startswith(("/", "."))
            and ("." in head or ":" in head or head == "localhost")
        ):
            raise ValueError(
                f"{v!r} names the registry {head!r} with '/': pyxis (enroot) wants {head}#{rest}"
            )
        return v

    def mount_targets(self) -> list[str]:
        """Where each mount appears inside the container (DST, else SRC)."""
        out = []
        for m in self.mounts:
            parts = m.split(":")
            out.append(parts[1] if len(parts) > 1 and parts[1].startswith("/") else parts[0])
        return out


# Slurm checks the time limits every 30 s (PERIODIC_TIMEOUT) and sends --signal's signal at the first check
# within its lead time + 30 s of the limit
SLURM_SIGNAL_CHECK_S = 30

# sbatch's long options (Slurm 23.02-24.11, with aliases). sbatch (getopt_long) takes any unique prefix of a
# long option, so `--outp=x` is `--output=x`: extra_directives are matched against this list by prefix.
SBATCH_LONG_OPTIONS = frozenset(
    {
        "account",
        "acctg-freq",
        "array",
        "batch",
        "bb",
        "bbf",
        "begin",
        "chdir",
        "cluster",
        "cluster-constraint",
        "clusters",
        "comment",
        "constraint",
        "container",
        "container-id",
        "contiguous",
        "core-spec",
        "cores-per-socket",
        "cpu-freq",
        "cpus-per-gpu",
        "cpus-per-task",
        "deadline",
        "delay-boot",
        "dependency",
        "distribution",
        "error",
        "exclude",
        "exclusive",
        "export",
        "export-file",
        "extra",
        "extra-node-info",
        "get-user-env",
        "gid",
        "gpu-bind",
        "gpu-freq",
        "gpus",
        "gpus-per-node",
        "gpus-per-socket",
        "gpus-per-task",
        "gres",
        "gres-flags",
        "help",
        "hint",
        "hold",
        "ignore-pbs",
        "immediate",
        "input",
        "job-name",
        "kill-on-invalid-dep",
        "licenses",
        "mail-type",
        "mail-user",
        "mcs-label",
        "mem",
        "mem-bind",
        "mem-per-cpu",
        "mem-per-gpu",
        "mincpus",
        "network",
        "nice",
        "no-kill",
        "no-requeue",
        "nodefile",
        "nodelist",
        "nodes",
        "ntasks",
        "ntasks-per-core",
        "ntasks-per-gpu",
        "ntasks-per-node",
        "ntasks-per-socket",
        "open-mode",
        "output",
        "overcommit",
        "oversubscribe",
        "parsable",
        "partition",
        "power",
        "prefer",
        "priority",
        "profile",
        "propagate",
        "qos",
        "quiet",
        "reboot",
        "requeue",
        "reservation",
        "resv-ports",
        "segment",
        "signal",
        "sockets-per-node",
        "spread-job",
        "stepmgr",
        "switches",
        "tasks",
        "test-only",
        "thread-spec",
        "threads-per-core",
        "time",
        "time-min",
        "tmp",
        "tres-bind",
        "tres-per-task",
        "uid",
        "usage",
        "use-min-nodes",
        "verbose",
        "version",
        "wait",
        "wait-all-nodes",
        "wckey",
        "workdir",
        "wrap",
    }
)

# Most GPUs one node can have, per GRES type (lower case): HGX/DGX boards carry 8 SXM GPUs (H100, H200, B200,
# ...); Grace superchip nodes carry up to 4 (quad GH200 blades; a GB200/GB300 NVL72 tray is 2 superchips = 4
# GPUs); AMD: 8 MI300X/MI250X GCDs, 4 MI300A. Types not listed are only held to the general limit (64).
MAX_GPUS_PER_NODE: dict[str, int] = {
    "h100": 8,
    "h200": 8,
    "h800": 8,
    "h20": 8,
    "b200": 8,
    "b300": 8,
    "gh200": 4,
    "gb200": 4,
    "gb300": 4,
    "mi300x": 8,
    "mi325x": 8,
    "mi250x": 8,
    "mi300a": 4,
}


# Why an extra directive may not set one of the sbatch options that sbatch-gen renders itself (or relies on),
# and what to set instead (SlurmResources._MANAGED).
_ONE_TASK = (
    "one task per node, torchrun, whose processes are slurm.gpus_per_node (torchrun.procs_per_node on a CPU "
    "site)"
)
_GPUS = "set slurm.gpus_per_node, slurm.gpu_type and slurm.gpu_request"
_LOG = (
    "one log per job, <paths.log_dir>/%x-%j.out, appended across requeues, stderr included: set paths.log_dir"
)
_REQUEUE = "a stopped job is requeued; preemption.max_requeues_without_progress bounds a crash loop"
_SUBMIT_DIR = (
    "the job runs in the directory it is submitted from, to which the profile's relative paths are "
    "relative: submit from the directory you mean"
)


class SlurmResources(ProfileSection):
    version: Annotated[
        str,
        BeforeValidator(numeric_to_str),
        AfterValidator(pattern_check(r"\d{2}\.\d{2}(\.\d+)?", "Slurm version (e.g. 23.11)")),
    ] = Field(
        description="Slurm version of the site, e.g. '23.11'; the job warns when the cluster runs another."
    )
    partition: Name = Field(description="--partition: the Slurm partition to run in (required).")
    account: Name | None = Field(
        default=None, description="--account to charge the job to; unset: the user's default account."
    )
    qos: Name | None = Field(
        default=None, description="--qos; unset: the account's or partition's default QOS."
    )
    reservation: Name | None = Field(
        default=None, description="--reservation to run in; unset: no reservation."
    )
    job_name: Name | None = Field(default=None, description="Job name (default: the site name).")
    nodes: Int = Field(
        ge=1, le=100_000, description="--nodes: machines of the job, one task (torchrun) on each (required)."
    )
    gpus_per_node: Int = Field(
        ge=0, le=64, description="0 for a CPU site (then set torchrun.procs_per_node)."
    )
    gpu_type: Name | None = Field(default=None, description="GRES type, e.g. h200 (gpu:h200:8).")
    gpu_request: Literal["gres", "gpus-per-node"] = Field(
        default="gres", description="How GPUs are requested: --gres=gpu[:type]:N or --gpus-per-node."
    )
    cpus_per_task: Int = Field(
        ge=1, le=4096, description="CPUs for the one task per node (torchrun and workers)."
    )
    mem: (
        Annotated[
            str,
            BeforeValidator(numeric_to_str),
            AfterValidator(pattern_check(r"0|[1-9][0-9]*[KMGT]?", "memory (e.g. 480G, or 0 for all)")),
        ]
        | None
    ) = Field(
        default=None,
        description="--mem: memory per node, a number with an optional unit K, M, G or T (no unit: megabytes, "
        "Slurm's default), e.g. 480G; 0 asks for all of a node's memory. Unset: no --mem, the partition's default.",
    )
    time: SlurmTime = Field(description="Time limit: D-HH:MM:SS, HH:MM:SS or minutes.")
    exclusive: bool = Field(
        default=True, description="--exclusive: the nodes are not shared with other jobs (default true)."
    )
    constraint: (
        Annotated[str, AfterValidator(pattern_check(f"[{SBATCH_CONSTRAINT_CHARS}]+", "constraint"))] | None
    ) = Field(
        default=None,
        description="--constraint: node features the nodes must have, with Slurm's operators (e.g. "
        "ib&h200, [rack1|rack2]); unset: any node of the partition.",
    )
    extra_directives: list[
        Annotated[
            str,
            AfterValidator(
                pattern_check(
                    f"--[a-z][a-z0-9-]*(=[{SBATCH_DIRECTIVE_VALUE_CHARS}]+)?",
                    "directive (--name or --name=value, no spaces or quotes)",
                )
            ),
        ]
    ] = Field(default_factory=list, description="More #SBATCH lines, e.g. --mail-type=FAIL.")
    setup_time: SlurmTime = Field(default="01:00:00", description="Time limit of the setup job.")
    export: list[EnvName] = Field(
        default_factory=list,
        description="More variables the job takes from the submitting shell, by name (#SBATCH --export). "
        "Without them the job takes nothing from it but Slurm's SLURM_* variables, PATH, sbatch-gen's switches "
        "(SBATCH_GEN_DEBUG on a GPU site; a continuation job's SBATCH_GEN_CONTINUES and SBATCH_GEN_RUN_JOB) "
        "and every variable the profile sets as a default (nccl, network.socket_ifname, topology.nccl_topo_file, "
        "OMP_NUM_THREADS, PYTHONUNBUFFERED, extra_env), so that `NCCL_DEBUG=INFO sbatch ...` takes effect and a "
        "stray PYTHONPATH or CUDA_VISIBLE_DEVICES stays out. Refused: a secret (the job reads those on the node, "
        "from slurm.secrets_file), what the job takes anyway, what the job or Slurm sets (PYTHONPATH, MASTER_ADDR, "
        "SLURM_*, CUDA_VISIBLE_DEVICES, ...), and what changes how programs start (LD_*, BASH_ENV).",
    )
    secrets: list[EnvName] = Field(
        default_factory=list,
        description="More secrets the job reads from slurm.secrets_file, by name, besides those the profile "
        "names (cross_region.transport.credentials, metrics.wandb_api_key_env): e.g. HF_TOKEN for a trainer of "
        "one's own. Each must be in the file; a name the job, Slurm or the profile sets is refused.",
    )
    secrets_file: SecretsPath | None = Field(
        default=None,
        description="The file the job reads the secrets the profile names from, on the first node, at the start "
        "of every attempt (cross_region.transport.credentials' *_env, metrics.wandb_api_key_env): NAME=value "
        "lines and # comments; a value in matching quotes loses them, nothing is expanded, and only the named "
        "variables are taken. It must belong to the job's user and be readable by no one else (mode 0600 or "
        "0400). ~/ is the user's home directory on the node; a relative path is relative to the submit "
        "directory. Required when a secret is required (the S3 keys; the W&B key with wandb_mode online). The "
        "submitting shell's values are never used (#SBATCH --export leaves them out: Slurm would keep them in "
        "the job's record), and the values are never printed.",
    )

    # The sbatch options sbatch-gen renders itself (or relies on): an extra directive that is, or abbreviates,
    # one of them is refused, with what to set instead.
    _MANAGED: ClassVar[dict[str, str]] = {
        "partition": "set slurm.partition",
        "account": "set slurm.account",
        "qos": "set slurm.qos",
        "reservation": "set slurm.reservation",
        "job-name": "set slurm.job_name",
        "nodes": "set slurm.nodes",
        "ntasks": _ONE_TASK,
        "ntasks-per-node": _ONE_TASK,
        "tasks": _ONE_TASK,  # an alias of ntasks
        "gres": _GPUS,
        "gpus": _GPUS,
        "gpus-per-node": _GPUS,
        "cpus-per-task": "set slurm.cpus_per_task",
        "mem": "set slurm.mem",
        "time": "set slurm.time",
        "exclusive": "set slurm.exclusive",
        "constraint": "set slurm.constraint",
        "output": _LOG,
        "error": _LOG,
        "open-mode": _LOG,
        "signal": "set preemption.signal and preemption.lead_time_s",
        "requeue": _REQUEUE,
        "no-requeue": _REQUEUE,
        "export": "set slurm.export (more variables the job takes from the submitting shell), or extra_env",
        "chdir": _SUBMIT_DIR,
        "workdir": _SUBMIT_DIR,  # an alias of chdir
    }

    @check
    def _directives(self) -> SlurmResources:
        for i, d in enumerate(self.extra_directives):
            name = d[2:].split("=", 1)[0]
            if name in self._MANAGED:
                raise FieldError(
                    ("extra_directives", i),
                    f"{d!r}: sbatch-gen sets --{name} itself: {self._MANAGED[name]}",
                )
            if name in SBATCH_LONG_OPTIONS:
                continue
            full = sorted(o for o in SBATCH_LONG_OPTIONS if o.startswith(name))
            managed = [o for o in full if o in self._MANAGED]
            if managed:
                why = "; ".join(f"--{o}: {self._MANAGED[o]}" for o in managed)
                raise FieldError(
                    ("extra_directives", i),
                    f"{d!r}: sbatch reads --{name} as an abbreviation of "
                    f"{' or '.join('--' + o for o in managed)}, which sbatch-gen sets itself ({why})",
                )
            if full:
                raise FieldError(
                    ("extra_directives", i),
                    f"{d!r}: --{name} abbreviates "
                    f"{' or '.join('--' + o for o in full)}: write the option out in full",
                )
        if self.gpu_type and self.gpus_per_node == 0:
            raise FieldError(("gpu_type",), "gpu_type is set but gpus_per_node is 0")
        most = MAX_GPUS_PER_NODE.get((self.gpu_type or "").lower())
        if most is not None and self.gpus_per_node > most:
            raise FieldError(
                ("gpus_per_node",),
                f"gpus_per_node is {self.gpus_per_node}, but a {self.gpu_type} node has at most {most} GPUs",
            )
        return self


class SlurmProfile(ProfileBase):
    """A Slurm site: renders out/<site>.sbatch (training) and out/<site>.setup.sbatch (env set-up)."""

    kind: Literal["slurm"] = Field(
        default="slurm",
        description="slurm: a Slurm cluster (the default when kind is left out); renders <site>.sbatch and "
        "<site>.setup.sbatch.",
    )
    paths: SlurmPaths = Field(
        description="Where the code, the run directory, the data and the logs are (relative paths: to the "
        "submit directory), and whether each run keeps the code it was submitted with (required)."
    )
    slurm: SlurmResources = Field(
        description="The job's #SBATCH resources: partition, account, nodes, GPUs, CPUs, memory, time limit "
        "(required)."
    )
    container: Container | None = Field(default=None, description="pyxis container for the job steps.")
    preemption: Preemption = Field(
        default_factory=Preemption,
        description="The signal plan before the time limit or a preemption: signal, lead time, checkpoint "
        "budget, requeue budget (defaults: USR1 600 s before the limit).",
    )
    preflight: Preflight = Field(
        default_factory=Preflight,
        description="The checks every node runs before training (on by default), and a site's own health check.",
    )

    SECRET_HOW: ClassVar[str] = (
        "a Slurm job reads it on the node instead: name it in slurm.secrets (its value in slurm.secrets_file)"
    )

    OUTPUTS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("slurm.sbatch.j2", "{site}.sbatch"),
        ("slurm-setup.sbatch.j2", "{site}.setup.sbatch"),
    )

    GPUS_FIELD: ClassVar[str] = "slurm.gpus_per_node"
    GPU_COUNT_NAME: ClassVar[str] = "the GPU count"

    def gpus_per_node(self) -> int:
        return self.slurm.gpus_per_node

    def cpus_per_node(self) -> int:
        return self.slurm.cpus_per_task

    def node_count(self) -> int:
        return self.slurm.nodes

    def gpu_directive(self) -> str | None:
        """The #SBATCH option that requests the GPUs (None on a CPU site)."""
        s = self.slurm
        gpus = s.gpus_per_node
        if gpus == 0:
            return None
        if s.gpu_request == "gres":
            return f"--gres=gpu:{s.gpu_type}:{gpus}" if s.gpu_type else f"--gres=gpu:{gpus}"
        return f"--gpus-per-node={s.gpu_type}:{gpus}" if s.gpu_type else f"--gpus-per-node={gpus}"

    def stop_signal(self) -> str:
        return self.preemption.signal

    def secret_env(self) -> list[SecretEnv]:
        """The secrets the job reads on the node from slurm.secrets_file: those the profile names
        (credentials.secret_env, as the SSH launcher sends them), then slurm.secrets (required), each once."""
        named = secret_env(self)
        return with_listed(named, self.slurm.secrets, "slurm.secrets")

    @check
    def _export_policy(self) -> None:
        """slurm.export names no secret and nothing the job sets anyway; a required secret has a file to be
        read from on the node (slurm.secrets_file). Every item's problem at once."""
        secrets = {s.name: s for s in self.secret_env()}
        taken = submit_exports(self)
        profile_sets = [n for b in job_environment(self) for n, _ in b.vars]
        found: list[FieldError] = []
        for i, name in enumerate(self.slurm.export):
            if name in secrets or is_credential_name(name):
                named = f" ({secrets[name].key} names it)" if name in secrets else ""
                how = "" if name in secrets else " (name it in slurm.secrets)"
                found.append(
                    FieldError(
                        ("slurm", "export", i),
                        f"{name} is a secret{named}: the job reads it on the node from slurm.secrets_file{how}, "
                        "never from the submitting shell: Slurm would keep its value in the job's record; remove "
                        "it from slurm.export",
                    )
                )
                continue
            why = _not_exportable(name, taken)
            if why is not None:
                found.append(
                    FieldError(("slurm", "export", i), f"{name}: {why}; remove it from slurm.export")
                )
        refused = secret_name_problems(("slurm", "secrets"), self.slurm.secrets, profile_sets)
        found += refused
        # (a name refused above needs no secrets file: its one error is the refusal)
        refused_keys = {f"slurm.secrets[{e.path[-1]}]" for e in refused}
        required = [s for s in secrets.values() if s.required and s.key not in refused_keys]
        if required and self.slurm.secrets_file is None:
            names = ", ".join(f"{s.name} ({s.key})" for s in required)
            found.append(
                FieldError(
                    ("slurm", "secrets_file"),
                    f"the profile names secrets the job needs: {names}; set slurm.secrets_file to a file of "
                    "NAME=value lines (mode 0600) that the job reads them from on the node (e.g. "
                    "~/.config/sbatch-gen/secrets.env): the job never takes them from the submitting shell",
                )
            )
        raise_all(found)

    def _paths_inside_the_container(self, c: Container) -> None:
        """The job's steps run in the image: every absolute path they read or write must be mounted into it
        (relative ones resolve in container.workdir, the submit directory by default)."""
        targets = c.mount_targets()
        checks = [
            (("paths", "run_dir"), self.paths.run_dir),
            (("paths", "log_dir"), self.paths.log_dir),
            (("paths", "code_dir"), self.paths.code_dir),
            (("container", "workdir"), c.workdir),
        ]
        for where, path in checks:
            if path is None or not path.startswith("/"):
                continue
            if not any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets):
                raise FieldError(
                    where,
                    f"{path} is not inside the container: no container.mounts entry mounts it (mounted: "
                    f"{', '.join(targets) or 'nothing'}); add one, e.g. {path}:{path}",
                )

    def stop_budget(self) -> tuple[int, str]:
        return (
            self.preemption.checkpoint_s + self.preemption.margin_s,
            "preemption.checkpoint_s + preemption.margin_s",
        )

    def template_context(self, site_name: str) -> dict[str, object]:
        s = self.slurm
        gpu_directive = self.gpu_directive()
        setup_gpu_directive = None
        if gpu_directive is not None:  # the setup job asks for one GPU
            setup_gpu_directive = (
                gpu_directive.rsplit(":", 1)[0] + ":1"
                if ":" in gpu_directive
                else (gpu_directive.split("=")[0] + "=1")
            )
        return {
            "job_name": s.job_name or site_name,
            "gpu_directive": gpu_directive,
            "setup_gpu_directive": setup_gpu_directive,
            "setup_cpus": min(s.cpus_per_task, 16),
            "time_limit_s": slurm_time_seconds(s.time),
            "container_env": ",".join(container_env_names(self)),
            "needed_modules": self.needed_modules(),
            # the preflight's check that every node reaches cross_region's bucket (sbatch_gen/credentials.py)
            "bucket_check": bucket_check(self.cross_region, self.preflight.connect_timeout_s),
            # the export policy: what the job takes from the submitting shell; the secrets, read on the node
            "submit_exports": submit_exports(self, s.export),
            "secret_env": self.secret_env(),
        }

    def needed_modules(self) -> list[str]:
        """What the job's python must import besides torch, for the setup job's probe: the trainer module
        (with a module), and with cross_region the library (sbatch_gen), its checksums (xxhash) and, over S3,
        boto3."""
        mods = [self.trainer.module] if self.trainer.module else []
        xr = self.cross_region
        if xr.enabled:
            mods += ["sbatch_gen", "xxhash"] + (["boto3"] if xr.transport.kind == "s3" else [])
        return list(dict.fromkeys(mods))

    def warnings(self) -> list[tuple[tuple[str | int, ...], str]]:
        out = super().warnings()
        limit = slurm_time_seconds(self.slurm.time)
        lead = self.preemption.lead_time_s
        if lead < limit <= lead + SLURM_SIGNAL_CHECK_S:
            out.append(
                (
                    ("preemption", "lead_time_s"),
                    f"preemption.lead_time_s {lead} s is within {SLURM_SIGNAL_CHECK_S} s of slurm.time "
                    f"({self.slurm.time} = {limit} s), and Slurm sends the signal at its periodic check, up to "
                    f"{SLURM_SIGNAL_CHECK_S} s before lead_time_s: every attempt may be asked to stop seconds "
                    "after it starts, before it trains a step, and attempts without progress end the run "
                    "(preemption.max_requeues_without_progress); raise slurm.time or lower lead_time_s",
                )
            )
        return out

    @check
    def _cross_checks(self) -> SlurmProfile:
        limit = slurm_time_seconds(self.slurm.time)
        if self.preemption.lead_time_s >= limit:
            raise FieldError(
                ("preemption", "lead_time_s"),
                f"preemption.lead_time_s ({self.preemption.lead_time_s} s) is not shorter than "
                f"slurm.time ({self.slurm.time} = {limit} s): the stop signal would come before the job starts",
            )
        grace, source = self.stop_grace()
        if self.trainer.stop_protocol == "signal" and grace >= self.preemption.lead_time_s:
            raise FieldError(
                ("trainer", "stop_grace_s"),
                f"the grace of stop_protocol signal, {source} = {grace} s, is not shorter than "
                f"preemption.lead_time_s ({self.preemption.lead_time_s} s): the workers get "
                f"SIG{self.preemption.signal} lead_time_s before the time limit, and the job must be requeued after "
                "their grace and before the limit; lower trainer.stop_grace_s or raise preemption.lead_time_s",
            )
        return self

    @check
    def _container_checks(self) -> SlurmProfile:
        if self.container is not None:
            self._paths_inside_the_container(self.container)
        if self.container is not None and self.python_env.kind != "none":
            raise FieldError(
                ("python_env", "kind"),
                f"python_env.kind is {self.python_env.kind!r} but a container is set: the image is the "
                "environment; use python_env: {kind: none}",
            )
        return self
