"""The command lines every launcher starts on the nodes, built once for every kind. Torch-free.

The Slurm batch script and the SSH launcher both run ``torchrun <torchrun argv> -m <trainer.module>
<trainer argv>`` (or ``torchrun <torchrun argv> <trainer.script> <trainer argv>``) on every node. Both
argument lists are built here from the profile, as lists of :class:`Option` (one option per rendered line),
and the templates render them through ``shq``. Values that are only known when the script runs (the node
count, the rendezvous endpoint, the run id, the resume mode of a relaunch) are shell variables: :class:`Var`
and :class:`Concat` stand for them here and ``shq`` renders them as double-quoted expansions
(``"$MASTER_ADDR:$MASTER_PORT"``). Each launcher says which of its variables hold those values in a
:class:`Launcher`.

The trainer's arguments are today's fixed flags (``--config``, ``--run-dir``, ...), or, when the profile
sets ``trainer.args``, that list with its placeholders (``{run_dir}``, ``{xr_args}``, ...; see
:data:`PLACEHOLDERS` and :func:`parse_arg`) replaced by the same values and shell variables.
"""

from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass
from typing import Protocol

from sbatch_gen.metrics_options import MetricsOptions
from sbatch_gen.metrics_options import to_argv as metrics_argv
from sbatch_gen.node_program import COMPAT_FLAGS, TORCHRUN_FLAG_SINCE
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


def _starts_option(w: Word) -> bool:
    """Whether ``w`` looks like an option (``-x``, ``--name``, ``--name=value``), not like a value."""
    head = w if isinstance(w, str) else w.parts[0] if isinstance(w, Concat) else ""
    return isinstance(head, str) and re.match(r"--?[A-Za-z]", head) is not None


def group_flags(words: list[Word]) -> list[list[Word]]:
    """One option per line: a word that looks like an option starts a line, the values after it follow it
    (["--a", "1", "--b", "--c", "x"] -> [["--a", "1"], ["--b"], ["--c", "x"]])."""
    groups: list[list[Word]] = []
    for w in words:
        if _starts_option(w) or not groups:
            groups.append([w])
        else:
            groups[-1].append(w)
    return groups


@dataclass(frozen=True)
class Option:
    """One line of an argument list: a flag with its value(s), or one extra argument. ``key`` names the
    profile field behind a line whose value is written here (for a comment after it)."""

    words: tuple[Word, ...]
    key: str | None = None


@dataclass(frozen=True)
class Launcher:
    """Where a launcher keeps the values it only knows at run time (shell variables set before torchrun).

    The other values torchrun and the trainer get are the same for every launcher: $NPROC_PER_NODE,
    $MASTER_ADDR:$MASTER_PORT (the rendezvous endpoint), $TRAIN_CONFIG, $RUN_DIR, $DATA_PATH, $RESUME."""

    nnodes: Var  # the node count of this attempt
    run_id: Word  # --rdzv-id: one per attempt
    is_host: Var | None  # 1 on the node whose torchrun hosts the c10d store (None: the node program names it)
    local_addr: Var | None  # this node's address on the pinned interface (None: the node program's)
    rank_logs: Word  # torchrun.rank_logs: torchrun's --log-dir for this attempt


# Slurm: the allocation's node count and the job id; the node program's torchrun names node 0 the store's
# host and binds to the pinned interface (the batch shell expands these arguments once for every node), and
# puts each node's rank logs in a folder of its own under the attempt's.
SLURM = Launcher(
    nnodes=Var("SLURM_NNODES"),
    run_id=Var("SLURM_JOB_ID"),
    is_host=None,
    local_addr=None,
    rank_logs=Concat(
        (
            Var("LOG_DIR"),
            "/",
            Var("SLURM_JOB_NAME"),
            "-",
            Var("SLURM_JOB_ID"),
            ".attempt-",
            Var("ATTEMPT"),
            ".ranks",
        )
    ),
)
# SSH: the endpoint is an IP address, so node 0 is told it hosts the store; every node binds to the
# pinned interface's address.
SSH = Launcher(
    nnodes=Var("NNODES"),
    run_id=Concat((Var("TAG"), ".", Var("ATTEMPT"))),
    is_host=Var("IS_HOST"),
    local_addr=Var("NODE_ADDR"),
    rank_logs=Concat((Var("LOGS"), "/attempt-", Var("ATTEMPT"), ".node-", Var("rank"), ".ranks")),
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
    def config(self) -> str | None: ...
    @property
    def max_steps(self) -> int | None: ...
    @property
    def extra_args(self) -> list[str]: ...
    @property
    def stop_protocol(self) -> str: ...
    @property
    def args(self) -> list[str] | None: ...


class _Torchrun(Protocol):
    @property
    def rdzv_timeout_s(self) -> int: ...
    @property
    def max_restarts(self) -> int: ...
    @property
    def rank_logs(self) -> bool: ...


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
    @property
    def metrics(self) -> MetricsOptions | None: ...
    def stop_signal(self) -> str: ...
    def stop_grace(self) -> tuple[int, str]: ...
    def torchrun_shutdown_timeout(self) -> tuple[int, str] | None: ...


class Container(Protocol):
    @property
    def image(self) -> str: ...
    @property
    def mounts(self) -> list[str]: ...
    @property
    def mount_home(self) -> bool: ...
    @property
    def name(self) -> str | None: ...
    @property
    def writable(self) -> bool | None: ...
    @property
    def workdir(self) -> str | None: ...


# ---- trainer.args: placeholders ------------------------------------------------------------------------

# What a placeholder of trainer.args stands for (the field descriptions are generated from this).
PLACEHOLDERS: dict[str, str] = {
    "config": "trainer.config (must be set)",
    "run_dir": "paths.run_dir",
    "resume": "the resume mode: trainer.resume; auto when the SSH launcher relaunches after a failure",
    "data_path": "paths.data (must be set)",
    "max_steps": "trainer.max_steps (must be set)",
    "xr_args": "the --xr-* flags of cross_region, several arguments (none when cross_region is disabled); "
    "only as an argument of its own",
    "metrics_args": "the --metrics-* flags of the metrics section, several arguments (none without one); only "
    "as an argument of its own",
    "nnodes": "the node count of this attempt (Slurm: $SLURM_NNODES of the allocation; SSH: the enabled hosts)",
    "nproc_per_node": "processes per node (the GPU count, or torchrun.procs_per_node on a CPU site)",
    "site": "the site name",
}
# Placeholders that stand for several arguments: only allowed as a whole argument.
LIST_PLACEHOLDERS = frozenset({"xr_args", "metrics_args"})


@dataclass(frozen=True)
class Ref:
    """A placeholder in one argument of trainer.args: ``{name}``."""

    name: str


class PlaceholderError(ValueError):
    """A malformed or unknown placeholder in one argument of trainer.args (the message says which)."""


# One token of an argument: an escaped brace, a {...} group, a single brace, or a run of other text.
_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]|[^{}]+")
_PLACEHOLDER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ESCAPES = "write {{ and }} for a literal brace"


def parse_arg(arg: str) -> tuple[str | Ref, ...]:
    """One argument of trainer.args as literal text and placeholders: ``--out={run_dir}/x`` ->
    ``("--out=", Ref("run_dir"), "/x")``; ``{{`` and ``}}`` are a literal brace. Raises PlaceholderError for
    an unknown name, a brace that is neither a placeholder nor escaped, and a list placeholder
    (``{xr_args}``) that is not the whole argument."""
    pieces: list[str | Ref] = []
    for m in _TOKEN.finditer(arg):
        tok = m.group(0)
        if tok in ("{{", "}}"):
            piece: str | Ref = tok[0]
        elif tok in ("{", "}"):
            raise PlaceholderError(
                f"a single {tok!r} in {arg!r} is neither a placeholder nor a literal brace "
                f"(placeholders are {{name}}; {_ESCAPES})"
            )
        elif m.group(1) is not None:
            name = m.group(1)
            if not _PLACEHOLDER_NAME.fullmatch(name):
                raise PlaceholderError(
                    f"malformed placeholder {tok!r} in {arg!r} (placeholders are {{name}}, e.g. {{run_dir}}; "
                    f"{_ESCAPES})"
                )
            if name not in PLACEHOLDERS:
                close = difflib.get_close_matches(name.lower(), list(PLACEHOLDERS), n=1)
                hint = f"did you mean {{{close[0]}}}? " if close else ""
                raise PlaceholderError(
                    f"unknown placeholder {tok} in {arg!r} ({hint}known: "
                    + ", ".join(f"{{{n}}}" for n in PLACEHOLDERS)
                    + f"; {_ESCAPES})"
                )
            piece = Ref(name)
        else:
            piece = tok
        if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
            pieces[-1] += piece
        else:
            pieces.append(piece)
    for p in pieces:
        if isinstance(p, Ref) and p.name in LIST_PLACEHOLDERS and len(pieces) > 1:
            raise PlaceholderError(
                f"{{{p.name}}} stands for several arguments ({PLACEHOLDERS[p.name].split(',')[0]}): it must be an "
                f"argument of its own, not part of {arg!r}"
            )
    return tuple(pieces)


def placeholders_used(args: list[str]) -> list[tuple[int, set[str]]]:
    """(index, placeholder names) for every argument of trainer.args (raises PlaceholderError)."""
    return [(i, {p.name for p in parse_arg(a) if isinstance(p, Ref)}) for i, a in enumerate(args)]


def _placeholder_values(p: Profile, launcher: Launcher, site: str) -> dict[str, Word]:
    """The single-word placeholders' values: run-time values are the launchers' shell variables."""
    values: dict[str, Word] = {
        "config": Var("TRAIN_CONFIG"),
        "run_dir": Var("RUN_DIR"),
        "resume": Var("RESUME"),
        "data_path": Var("DATA_PATH"),
        "nnodes": launcher.nnodes,
        "nproc_per_node": Var("NPROC_PER_NODE"),
        "site": site,
    }
    if p.trainer.max_steps is not None:
        values["max_steps"] = str(p.trainer.max_steps)
    return values


def _word(parts: list[str | Var]) -> Word:
    """Literal text and variables as one shell word."""
    if not any(isinstance(x, Var) for x in parts):
        return "".join(x for x in parts if isinstance(x, str))
    if len(parts) == 1 and isinstance(parts[0], Var):
        return parts[0]
    return Concat(tuple(parts))


def _custom_trainer_argv(p: Profile, args: list[str], launcher: Launcher, site: str) -> list[Option]:
    values = _placeholder_values(p, launcher, site)
    words: list[Word] = []
    for arg in args:
        pieces = parse_arg(arg)
        if len(pieces) == 1 and isinstance(pieces[0], Ref) and pieces[0].name in LIST_PLACEHOLDERS:
            words += to_argv(p.cross_region) if pieces[0].name == "xr_args" else metrics_argv(p.metrics)
            continue
        parts: list[str | Var] = []
        for piece in pieces:
            if isinstance(piece, str):
                parts.append(piece)
                continue
            if piece.name not in values:  # the profile's validation refuses this
                raise ValueError(f"{{{piece.name}}} has no value in this profile")
            v = values[piece.name]
            parts += list(v.parts) if isinstance(v, Concat) else [v]
        words.append(_word(parts))
    return [Option(tuple(line)) for line in group_flags(words)]


def trainer_argv(p: Profile, launcher: Launcher, site: str) -> list[Option]:
    """The trainer's arguments (after ``-m trainer.module`` or ``trainer.script``). Without trainer.args
    the fixed flags, the same for every launcher; with it, its placeholders filled in (a run-time value is
    this launcher's shell variable)."""
    if p.trainer.args is not None:
        return _custom_trainer_argv(p, p.trainer.args, launcher, site)
    opts = [
        Option(("--config", Var("TRAIN_CONFIG"))),
        Option(("--run-dir", Var("RUN_DIR"))),
        Option(("--resume", Var("RESUME"))),
    ]
    if p.paths.data is not None:
        opts.append(Option(("--data-path", Var("DATA_PATH"))))
    if p.trainer.max_steps is not None:
        opts.append(Option(("--max-steps", str(p.trainer.max_steps)), "trainer.max_steps"))
    opts += [Option(tuple(g)) for g in group_flags(list(to_argv(p.cross_region)))]
    opts += [Option(tuple(g)) for g in group_flags(list(metrics_argv(p.metrics)))]
    opts += [Option((a,)) for a in p.trainer.extra_args]
    return opts


# The signals torchrun's agent handles by default (torch 2.13, torch/distributed/run.py): on one of them it
# sends it on to its workers, waits --shutdown-timeout seconds, then SIGKILLs them.
TORCHRUN_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


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
    if p.torchrun.rank_logs:
        opts.append(Option((_flag("--log-dir", launcher.rank_logs), "--tee=3"), "torchrun.rank_logs"))
    if p.topology.numa_binding is not None:
        opts.append(Option((f"--numa-binding={p.topology.numa_binding}",), "topology.numa_binding"))
    if p.trainer.stop_protocol == "signal":
        # The agent forwards the stop signal to its workers (their process groups) and waits up to the grace
        # before SIGKILL; without --signals-to-handle it would die of SIGUSR1/SIGUSR2 (their default action).
        signals = ",".join(dict.fromkeys([*TORCHRUN_DEFAULT_SIGNALS, "SIG" + p.stop_signal()]))
        opts.append(Option((f"--signals-to-handle={signals}",), "trainer.stop_protocol: signal"))
    elif p.trainer.stop_protocol == "sbatch-gen":
        # SIGTERM is a stop request for the workers, never for the agent: it runs with SIGTERM ignored
        # (run-trainer, sbatch_gen/node_program.py), so it must not install a handler of its own for it.
        signals = ",".join(s for s in TORCHRUN_DEFAULT_SIGNALS if s != "SIGTERM")
        opts.append(Option((f"--signals-to-handle={signals}",), "trainer.stop_protocol: sbatch-gen"))
    shutdown = p.torchrun_shutdown_timeout()
    if shutdown is not None:
        opts.append(Option((f"--shutdown-timeout={shutdown[0]}",), shutdown[1]))
    return opts


# torchrun flags a render may use that older torch releases lack, the first torch release that has each, and
# those run-trainer's compat shim does without under stop_protocol sbatch-gen: the node program's
# (sbatch_gen/node_program.py), whose preflight checks every node's torch against them.
def newer_torchrun_flags(p: Profile, launcher: Launcher) -> list[tuple[str, str, tuple[int, int], bool]]:
    """The flags of :data:`TORCHRUN_FLAG_SINCE` this render gives torchrun: (flag, the profile fields behind
    it, the first torch release that has it, whether an older torch runs without it through the compat shim:
    :data:`COMPAT_FLAGS` under stop_protocol sbatch-gen)."""
    shim = p.trainer.stop_protocol == "sbatch-gen"
    found = []
    for o in torchrun_argv(p, launcher):
        word = o.words[0]
        name = word.split("=", 1)[0] if isinstance(word, str) else ""
        if name in TORCHRUN_FLAG_SINCE:
            found.append((name, o.key or name, TORCHRUN_FLAG_SINCE[name], shim and name in COMPAT_FLAGS))
    return found


def minimum_torch(p: Profile, launcher: Launcher) -> tuple[tuple[int, int], str] | None:
    """The oldest torch release whose torchrun takes every flag of this render that an older torch cannot do
    without, and the flag that decides it with its fields (``--numa-binding (topology.numa_binding)``);
    None: any."""
    flags = [f for f in newer_torchrun_flags(p, launcher) if not f[3]]
    if not flags:
        return None
    name, key, since, _ = max(flags, key=lambda f: f[2])
    return since, f"{name} ({key})"


def torch_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string (``2.13.0+cu128``, ``2.4.0a0+07cecf4``); None if unreadable."""
    parts = version.split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    minor = "".join(itertools.takewhile(str.isdigit, parts[1]))
    return (int(parts[0]), int(minor)) if minor else None


def torchrun_flags_to_check(p: Profile, launcher: Launcher) -> str:
    """The preflight's ``torchrun_flags`` setting: the flags of :func:`newer_torchrun_flags`, comma-separated
    (empty: nothing to check); the node program knows the first torch with each."""
    return ",".join(name for name, _, _, _ in newer_torchrun_flags(p, launcher))


def container_argv(c: Container, env_names: str) -> list[Option]:
    """pyxis arguments of every srun that runs in the image (c: the profile's container section; env_names:
    the variables --container-env takes from the job rather than from the image)."""
    opts = [Option((f"--container-image={c.image}",), "container.image")]
    if c.name is not None:
        opts.append(Option((f"--container-name={c.name}",), "container.name"))
    if c.mounts:
        opts.append(Option((f"--container-mounts={','.join(c.mounts)}",), "container.mounts"))
    opts.append(Option(("--container-mount-home" if c.mount_home else "--no-container-mount-home",)))
    if c.writable is not None:
        opts.append(
            Option(("--container-writable" if c.writable else "--container-readonly",), "container.writable")
        )
    workdir = c.workdir if c.workdir is not None else Var("PWD")
    opts.append(Option((_flag("--container-workdir", workdir),), "container.workdir"))
    opts.append(Option((f"--container-env={env_names}",)))
    return opts
