"""``kind: ssh`` site profiles: plain machines reached over SSH, no Slurm. Torch-free.

Renders ``out/<site>.sh``, a launcher run on the first host: preflight on every host, torchrun (c10d)
on every host (the first one locally, the others over ssh), a process tag on everything it starts,
cleanup by that tag on every host, and whole-job relaunches with ``--resume auto`` after a cool-down.
The sections that do not depend on how the job is launched (paths, python_env, network, nccl,
extra_env, trainer, torchrun, topology, cross_region) and their checks are the shared ones of
:mod:`sbatch_gen.profiles.base`.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from sbatch_gen.credentials import SecretEnv, bucket_check, config_metrics, secret_env, with_listed
from sbatch_gen.errors import FieldError, raise_all
from sbatch_gen.profiles.base import ProfileBase
from sbatch_gen.profiles.environment import job_environment, secret_name_problems
from sbatch_gen.profiles.types import EnvName, Int, PathStr, ProfileSection, Text, no_control, pattern_check
from sbatch_gen.strict import check

# An ssh destination as written in the profile: a host name, an alias from ~/.ssh/config or an IPv4
# address. Never starts with '-' (ssh would read it as an option); user and port go in `ssh:`.
HostName = Annotated[
    str,
    AfterValidator(pattern_check(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}", "host name (letters, digits, . _ -)")),
]

# ssh options the launcher sets itself from typed fields (or must not be changed for it to work).
_MANAGED_SSH_OPTIONS = {
    "batchmode": "always yes: the launcher cannot answer prompts",
    "connecttimeout": "set ssh.connect_timeout_s",
    "serveraliveinterval": "set ssh.server_alive_interval_s",
    "serveralivecountmax": "set ssh.server_alive_count_max",
    "port": "set ssh.port",
    "user": "set ssh.user",
    "identityfile": "set ssh.identity_file",
    "requesttty": "the launcher needs no terminal",
    "remotecommand": "the launcher sends its own commands",
}


def _ssh_option(v: str) -> str:
    no_control(v)
    m = re.fullmatch(r"([A-Za-z][A-Za-z0-9]*)=(\S.*)", v)
    if m is None:
        raise ValueError(
            f"ssh option {v!r}: expected Key=Value, as for ssh -o (e.g. StrictHostKeyChecking=yes)"
        )
    why = _MANAGED_SSH_OPTIONS.get(m.group(1).lower())
    if why:
        raise ValueError(f"ssh option {m.group(1)}: {why}")
    return v


def _host_shorthand(v: object) -> object:
    return {"name": v} if isinstance(v, str) else v


class SshHost(ProfileSection):
    """One machine. Position in the list = node rank among the enabled hosts."""

    name: HostName = Field(description="ssh destination: host name, ~/.ssh/config alias or IPv4 address.")
    enabled: bool = Field(
        default=True, description="false leaves the host out of the job (kept for the record)."
    )
    note: Text | None = Field(default=None, description="Why the host is left out; shown in the script.")


class SshConnection(ProfileSection):
    """How the launcher reaches the other hosts. Unset fields fall back to ssh's own config."""

    user: (
        Annotated[str, AfterValidator(pattern_check(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", "user name"))] | None
    ) = Field(default=None, description="Remote user (ssh -l); unset: ssh's default.")
    port: Int | None = Field(
        default=None, ge=1, le=65535, description="sshd port (ssh -p); unset: ssh's default."
    )
    identity_file: PathStr | None = Field(
        default=None,
        description="Private key (ssh -i, with IdentitiesOnly=yes); relative to the launch directory.",
    )
    connect_timeout_s: Int = Field(default=10, ge=1, le=600, description="ConnectTimeout.")
    server_alive_interval_s: Int = Field(
        default=15, ge=1, le=3600, description="ServerAliveInterval: probe a silent connection this often."
    )
    server_alive_count_max: Int = Field(
        default=4,
        ge=1,
        le=100,
        description="ServerAliveCountMax: drop the connection after this many lost probes.",
    )
    options: list[Annotated[str, AfterValidator(_ssh_option)]] = Field(
        default_factory=list,
        description="More ssh -o Key=Value options, e.g. StrictHostKeyChecking=yes, UserKnownHostsFile=..., "
        "ProxyJump=bastion.",
    )

    def argv_lines(self) -> list[list[str]]:
        """ssh arguments, one option (flag and value) per line."""
        lines = [
            ["-o", "BatchMode=yes"],
            ["-o", f"ConnectTimeout={self.connect_timeout_s}"],
            ["-o", f"ServerAliveInterval={self.server_alive_interval_s}"],
            ["-o", f"ServerAliveCountMax={self.server_alive_count_max}"],
        ]
        if self.port is not None:
            lines.append(["-p", str(self.port)])
        if self.user is not None:
            lines.append(["-l", self.user])
        if self.identity_file is not None:
            lines += [["-i", self.identity_file], ["-o", "IdentitiesOnly=yes"]]
        lines += [["-o", o] for o in self.options]
        return lines


class SshLaunch(ProfileSection):
    """Attempts: wait for every node, clean up, relaunch the whole job with --resume auto."""

    max_attempts: Int = Field(
        default=5, ge=1, le=1000, description="Launches in total, the first one included."
    )
    cooldown_s: Int = Field(
        default=900,
        ge=0,
        le=86400,
        description="Pause before a relaunch (the default 15 minutes lets a node recover).",
    )
    stop_file: PathStr = Field(
        default="STOP",
        description="Sentinel file (relative to the launch directory): when it exists the launcher stops after "
        "the current attempt. Checked between attempts and during the cool-down, never mid-attempt.",
    )
    kill_grace_s: Int = Field(
        default=30,
        ge=1,
        le=3600,
        description="Cleanup: seconds between SIGTERM (the trainer checkpoints on it) and SIGKILL; also "
        "torchrun's --shutdown-timeout, so that its agent waits as long before it SIGKILLs the workers. With "
        "trainer.stop_protocol signal the default of trainer.stop_grace_s; unused with none (SIGKILL at once).",
    )
    failure_grace_s: Int = Field(
        default=120,
        ge=0,
        le=86400,
        description="After one node has ended (failed, or finished while others still run), how long the others "
        "may take to end on their own before cleanup kills them; also how long a node whose workers have "
        "finished waits for the others (torchrun's exit barrier, set by the node program; torch's own is 300 s).",
    )
    preflight_timeout_s: Int = Field(default=120, ge=5, le=3600, description="Preflight limit per host.")
    shared_run_dir: bool = Field(
        default=True,
        description="Preflight checks that every host sees node 0's paths.run_dir (sharded checkpoints need it).",
    )
    secrets: list[EnvName] = Field(
        default_factory=list,
        description="More secrets the launcher sends to every host, by name, besides those the profile names "
        "(cross_region.transport.credentials, metrics.wandb_api_key_env): e.g. HF_TOKEN for a trainer of one's "
        "own. Each is required: its value is taken from the launching shell's environment (unset or empty: the "
        "launch exits 2 before anything starts) and reaches torchrun and the trainer on every host over ssh's "
        "stdin, never on a command line, in a file or in a log. A name the launcher or the profile sets is "
        "refused. Default: none.",
    )


class SshNode(ProfileSection):
    """What every host has (the hosts of one site are alike)."""

    gpus: Int = Field(
        ge=0,
        le=64,
        description="GPUs per host, one process each; 0 for a CPU site (then set torchrun.procs_per_node).",
    )
    cpus: Int = Field(ge=1, le=4096, description="CPU cores per host; OMP_NUM_THREADS = cpus / processes.")


class SshProfile(ProfileBase):
    """Plain machines over SSH: renders out/<site>.sh, a launcher to run on the first host."""

    kind: Literal["ssh"] = Field(
        default="ssh",
        description="ssh: plain machines reached over SSH, no scheduler; renders <site>.sh. Must be written: "
        "a profile without kind is read as kind slurm.",
    )
    hosts: list[Annotated[SshHost, BeforeValidator(_host_shorthand)]] = Field(
        min_length=1,
        description="The machines, in node-rank order; the first one runs the launcher (and node 0). "
        "A plain string is a host name.",
    )
    node: SshNode = Field(description="What every host has: GPUs and CPU cores (required).")
    ssh: SshConnection = Field(
        default_factory=SshConnection,
        description="How the launcher reaches the other hosts (user, key, options); unset fields: ssh's own config.",
    )
    launch: SshLaunch = Field(
        default_factory=SshLaunch,
        description="Attempts: relaunches after a failure, waits, the stop file and the kill grace.",
    )

    OUTPUTS: ClassVar[tuple[tuple[str, str], ...]] = (("ssh-launcher.sh.j2", "{site}.sh"),)

    GPUS_FIELD: ClassVar[str] = "node.gpus"
    NODE_WORD: ClassVar[str] = "host"
    SECRETS_FROM_CONFIG: ClassVar[bool] = True
    SECRET_HOW: ClassVar[str] = (
        "the SSH launcher sends it to every host over ssh's stdin instead: name it in launch.secrets (its value "
        "in the launching shell's environment)"
    )

    def gpus_per_node(self) -> int:
        return self.node.gpus

    def cpus_per_node(self) -> int:
        return self.node.cpus

    def node_count(self) -> int:
        return len(self.enabled_hosts())

    def stop_signal(self) -> str:
        return "TERM"

    def stop_budget(self) -> tuple[int, str]:
        return self.launch.kill_grace_s, "launch.kill_grace_s"

    def enabled_hosts(self) -> list[str]:
        return [h.name for h in self.hosts if h.enabled]

    def secret_env(self) -> list[SecretEnv]:
        """The secrets the launcher sends to every host over ssh's stdin: those the profile names
        (credentials.secret_env; the W&B key of the train config's metrics section too, where that decides the
        sinks: read from the directory render runs in, the launch directory's checkout), then launch.secrets
        (required), each once."""
        named = secret_env(self, config_metrics(self))
        return with_listed(named, self.launch.secrets, "launch.secrets")

    def template_context(self, site_name: str) -> dict[str, object]:
        # the secrets every node gets over ssh's stdin, and the preflight's bucket check within the ssh
        # connect timeout (sbatch_gen/credentials.py)
        return {
            "secret_env": self.secret_env(),
            "bucket_check": bucket_check(self.cross_region, self.ssh.connect_timeout_s),
        }

    @check
    def _checks(self) -> SshProfile:
        names = [h.name for h in self.hosts]
        found = [
            FieldError(("hosts", i, "name"), f"host {n!r} is listed twice")
            for i, n in enumerate(names)
            if n in names[:i]
        ]
        if not self.hosts[0].enabled:
            found.append(
                FieldError(
                    ("hosts", 0, "enabled"),
                    "the first host runs the launcher and node 0, so it cannot be left out: move another host "
                    "first",
                )
            )
        if not self.network.socket_ifname:
            found.append(
                FieldError(
                    ("network", "socket_ifname"),
                    "required for kind ssh: MASTER_ADDR is this interface's IPv4 address on the first host, and "
                    "NCCL/Gloo sockets are pinned to it (e.g. ib0, eth0; lo for a single machine)",
                )
            )
        profile_sets = [n for b in job_environment(self) for n, _ in b.vars]
        found += secret_name_problems(("launch", "secrets"), self.launch.secrets, profile_sets, "ssh")
        raise_all(found)
        return self
