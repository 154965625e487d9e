"""The command lines every launcher starts on the nodes, built once for every kind. Torch-free.

The Slurm batch script and the SSH launcher both run ``torchrun <torchrun argv> -m <trainer.module>
<trainer argv>`` on every node. Both argument lists are built here from the profile, as lists of
:class:`Option` (one option per rendered line), and the templates render them through ``shq``. Values that
are only known when the script runs (the node count, the rendezvous endpoint, the run id, the resume mode
of a relaunch) are shell variables: :class:`Var` and :class:`Concat` stand for them here and ``shq``
renders them as double-quoted expansions (``"$MASTER_ADDR:$MASTER_PORT"``). Each launcher says which of
its variables hold those values in a :class:`Launcher`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from sbatch_gen.xr_options import CrossRegion, to_argv

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FLAG_PREFIX = re.compile(r"--[A-Za-z0-9][A-Za-z0-9-]*=")


@dataclass(frozen=True)
class Var:
    """A shell variable, expanded when the script runs: renders as ``"$NAME"``."""

    name: str

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"not a shell variable name: {self.name!r}")

    def shell(self) -> str:
        return f'"${self.name}"'


@dataclass(frozen=True)
class Concat:
    """One shell word made of literal text and variables, e.g. ``--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT``.

    Renders as one double-quoted word; a leading ``--flag=`` stays outside the quotes, as it would be
    written by hand (``--rdzv-id="$TAG.$ATTEMPT"``)."""

    parts: tuple[str | Var, ...]

    def __post_init__(self) -> None:
        if not any(isinstance(p, Var) for p in self.parts):
            raise ValueError("Concat without a Var: use a plain string")

    def shell(self) -> str:
        parts = list(self.parts)
        head = ""
        if parts and isinstance(parts[0], str):
            m = _FLAG_PREFIX.match(parts[0])
            if m:
                head = m.group(0)
                parts[0] = parts[0][m.end() :]
        body = []
        for i, p in enumerate(parts):
            if isinstance(p, Var):
                nxt = parts[i + 1] if i + 1 < len(parts) else ""
                # ${NAME} when the next literal would otherwise extend the name
                joined = isinstance(nxt, str) and nxt[:1] != "" and (nxt[0].isalnum() or nxt[0] == "_")
                body.append(f"${{{p.name}}}" if joined else f"${p.name}")
            else:
                body.append(re.sub(r'([\\"$`])', r"\\\1", p))
        return head + '"' + "".join(body) + '"'


Word = str | Var | Concat


@dataclass(frozen=True)
class Option:
    """One line of an argument list: a flag with its value(s), or one extra argument. ``key`` names the
    profile field behind a line whose value is written here (for a comment after it)."""

    words: tuple[Word, ...]
    key: str | None = None


def group_flags(argv: list[str]) -> list[list[str]]:
    """["--a", "1", "--b", "--c", "x"] -> [["--a", "1"], ["--b"], ["--c", "x"]] (one flag per line)."""
    groups: list[list[str]] = []
    for a in argv:
        if a.startswith("--") or not groups:
            groups.append([a])
        else:
            groups[-1].append(a)
    return groups


@dataclass(frozen=True)
class Launcher:
    """Where a launcher keeps the values it only knows at run time (shell variables set before torchrun).

    The other values torchrun and the trainer get are the same for every launcher: $NPROC_PER_NODE,
    $MASTER_ADDR:$MASTER_PORT (the rendezvous endpoint), $TRAIN_CONFIG, $RUN_DIR, $DATA_PATH, $RESUME."""

    nnodes: Var  # the node count of this attempt
    run_id: Word  # --rdzv-id: one per attempt
    is_host: Var | None  # 1 on the node whose torchrun hosts the c10d store (None: torchrun decides)
    local_addr: Var | None  # this node's address on the pinned interface (None: torchrun's default)


# Slurm: the allocation's node count and the job id; torchrun recognises the first node by its hostname.
SLURM = Launcher(nnodes=Var("SLURM_NNODES"), run_id=Var("SLURM_JOB_ID"), is_host=None, local_addr=None)
# SSH: the endpoint is an IP address, so node 0 is told it hosts the store; every node binds to the
# pinned interface's address.
SSH = Launcher(
    nnodes=Var("NNODES"),
    run_id=Concat((Var("TAG"), ".", Var("ATTEMPT"))),
    is_host=Var("IS_HOST"),
    local_addr=Var("NODE_ADDR"),
)
LAUNCHERS: dict[str, Launcher] = {"slurm": SLURM, "ssh": SSH}


# The profile sections read here, as every kind has them (structural: no import of the profile classes).
class _Paths(Protocol):
    @property
    def run_dir(self) -> str: ...
    @property
    def data(self) -> str | None: ...


class _Trainer(Protocol):
    @property
    def max_steps(self) -> int | None: ...
    @property
    def extra_args(self) -> list[str]: ...


class _Torchrun(Protocol):
    @property
    def rdzv_timeout_s(self) -> int: ...
    @property
    def max_restarts(self) -> int: ...


class _Topology(Protocol):
    @property
    def numa_binding(self) -> str | None: ...


class Profile(Protocol):
    @property
    def paths(self) -> _Paths: ...
    @property
    def trainer(self) -> _Trainer: ...
    @property
    def torchrun(self) -> _Torchrun: ...
    @property
    def topology(self) -> _Topology: ...
    @property
    def cross_region(self) -> CrossRegion: ...


class Container(Protocol):
    @property
    def image(self) -> str: ...
    @property
    def mounts(self) -> list[str]: ...
    @property
    def mount_home(self) -> bool: ...


def trainer_argv(p: Profile) -> list[Option]:
    """The trainer's arguments (after ``-m trainer.module``), the same for every launcher."""
    opts = [
        Option(("--config", Var("TRAIN_CONFIG"))),
        Option(("--run-dir", Var("RUN_DIR"))),
        Option(("--resume", Var("RESUME"))),
    ]
    if p.paths.data is not None:
        opts.append(Option(("--data-path", Var("DATA_PATH"))))
    if p.trainer.max_steps is not None:
        opts.append(Option(("--max-steps", str(p.trainer.max_steps)), "trainer.max_steps"))
    opts += [Option(tuple(g)) for g in group_flags(to_argv(p.cross_region))]
    opts += [Option((a,)) for a in p.trainer.extra_args]
    return opts


def _flag(flag: str, value: Word) -> Word:
    """``--flag=value`` as one word."""
    if isinstance(value, str):
        return f"{flag}={value}"
    parts = value.parts if isinstance(value, Concat) else (value,)
    return Concat((f"{flag}=", *parts))


def torchrun_argv(p: Profile, launcher: Launcher) -> list[Option]:
    """torchrun's arguments (before ``-m``): c10d rendezvous at $MASTER_ADDR:$MASTER_PORT."""
    conf: Word = f"join_timeout={p.torchrun.rdzv_timeout_s}"
    if launcher.is_host is not None:
        conf = Concat((f"{conf},is_host=", launcher.is_host))
    opts = [
        Option(("--nnodes", launcher.nnodes)),
        Option(("--nproc-per-node", Var("NPROC_PER_NODE"))),
        Option(("--rdzv-backend=c10d",)),
        Option((_flag("--rdzv-id", launcher.run_id),)),
        Option((_flag("--rdzv-endpoint", Concat((Var("MASTER_ADDR"), ":", Var("MASTER_PORT")))),)),
        Option((_flag("--rdzv-conf", conf),), "torchrun.rdzv_timeout_s"),
    ]
    if launcher.local_addr is not None:
        opts.append(Option((_flag("--local-addr", launcher.local_addr),)))
    opts.append(Option(("--max-restarts", str(p.torchrun.max_restarts)), "torchrun.max_restarts"))
    if p.topology.numa_binding is not None:
        opts.append(Option((f"--numa-binding={p.topology.numa_binding}",), "topology.numa_binding"))
    return opts


def container_argv(c: Container, env_names: str) -> list[Option]:
    """pyxis arguments of every srun that runs in the image (c: the profile's container section; env_names:
    the variables --container-env takes from the job rather than from the image)."""
    opts = [Option((f"--container-image={c.image}",))]
    if c.mounts:
        opts.append(Option((f"--container-mounts={','.join(c.mounts)}",)))
    opts.append(Option(("--container-mount-home" if c.mount_home else "--no-container-mount-home",)))
    opts.append(Option((_flag("--container-workdir", Var("PWD")),)))
    opts.append(Option((f"--container-env={env_names}",)))
    return opts
