"""``sbatch-gen init``: a first site profile, commented from the schema. Torch-free.

The values come from flags (or answers); the comments are the profile models' own field descriptions, so
they say what ``sbatch-gen schema`` says. What is written is validated first, exactly as ``validate``
would load it: nothing is written when it does not load (each problem names the flag, or the question, and
the value that caused it: not the line of a file that was never written), and an existing profile is never
overwritten.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sbatch_gen.errors import UserError
from sbatch_gen.fsutil import display_path
from sbatch_gen.loader import SITE_NAME_RE, load_site
from sbatch_gen.profiles import PROFILE_KINDS


@dataclass(frozen=True)
class Key:
    """One line of the profile: its dotted path, its value, and whether it is written commented out (a
    field worth knowing about, left at its default)."""

    path: str
    value: object
    commented: bool = False
    source: str | None = None  # the answer (an Answers field, or "site") its value comes from


@dataclass
class Answers:
    """What init needs to know; None: not given."""

    kind: str = "slurm"
    description: str | None = None
    slurm_version: str | None = None
    partition: str | None = None
    account: str | None = None
    nodes: int | None = None
    hosts: tuple[str, ...] = ()
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    time: str | None = None
    script: str | None = None
    module: str | None = None
    config: str | None = None
    run_dir: str | None = None
    socket_ifname: str | None = None
    # where an answer came from when not from its flag (FLAGS): "question" (asked on a terminal), "scontrol"
    origin: dict[str, str] = field(default_factory=dict)


# The flag of each answer, by which an error names a bad value (init never names the file it did not write).
FLAGS = {
    "slurm_version": "--slurm-version",
    "partition": "--partition",
    "account": "--account",
    "nodes": "--nodes",
    "hosts": "--host",
    "gpus_per_node": "--gpus-per-node",
    "cpus_per_task": "--cpus-per-task",
    "time": "--time",
    "script": "--script",
    "module": "--module",
    "config": "--config",
    "run_dir": "--run-dir",
    "socket_ifname": "--ifname",
    "site": "--site",
}


# What each kind needs (answer field, the flag that gives it), in the order they are asked.
REQUIRED = {
    "slurm": [
        ("partition", "--partition"),
        ("slurm_version", "--slurm-version"),
        ("nodes", "--nodes"),
        ("gpus_per_node", "--gpus-per-node"),
        ("cpus_per_task", "--cpus-per-task"),
        ("time", "--time"),
    ],
    "ssh": [
        ("hosts", "--host"),
        ("socket_ifname", "--ifname"),
        ("gpus_per_node", "--gpus-per-node"),
        ("cpus_per_task", "--cpus-per-task"),
    ],
}


def missing(a: Answers) -> list[tuple[str, str]]:
    """(answer field, flag) of what the kind needs and ``a`` lacks."""
    return [(f, flag) for f, flag in REQUIRED[a.kind] if getattr(a, f) in (None, ())]


def keys(site: str, a: Answers) -> list[Key]:
    """The profile's lines for these answers."""
    run_dir = a.run_dir or f"runs/{site}"
    run_dir_from = "run_dir" if a.run_dir else "site"
    trainer: list[Key] = []
    if a.script:
        trainer += [
            Key("trainer.script", a.script, source="script"),
            Key("trainer.args", ["--config", "{config}"]),
        ]
    elif a.module:
        trainer.append(Key("trainer.module", a.module, source="module"))
    else:
        trainer.append(Key("trainer.module", "sbatch_gen.train"))
    trainer += [
        Key("trainer.config", a.config or "configs/demo.yaml", source="config" if a.config else None),
        Key("trainer.stop_protocol", "sbatch-gen", commented=True),
    ]
    common = [
        Key("paths.code_dir", "."),
        Key("paths.run_dir", run_dir, source=run_dir_from),
        Key("paths.log_dir", f"{run_dir}/logs", source=run_dir_from),
        Key("python_env.kind", "venv"),
        Key("python_env.path", ".venv"),
        Key("python_env.torch_spec", "torch", commented=True),
        *trainer,
    ]
    head = [
        Key(
            "description", a.description or f"{site}: {a.kind} site", source=None if a.description else "site"
        )
    ]
    if a.socket_ifname:
        common.insert(0, Key("network.socket_ifname", a.socket_ifname, source="socket_ifname"))
    if a.gpus_per_node == 0:  # a CPU site: one process per node to start with
        common.insert(len(common) - len(trainer), Key("torchrun.procs_per_node", 1))
    if a.kind == "ssh":
        return [
            Key("kind", "ssh"),
            *head,
            Key("hosts", list(a.hosts), source="hosts"),
            Key("node.gpus", a.gpus_per_node, source="gpus_per_node"),
            Key("node.cpus", a.cpus_per_task, source="cpus_per_task"),
            *common,
            Key("launch.stop_file", f"{run_dir}/STOP", commented=True),
        ]
    slurm = [
        Key("slurm.version", a.slurm_version, source="slurm_version"),
        Key("slurm.partition", a.partition, source="partition"),
        Key("slurm.account", a.account, source="account")
        if a.account
        else Key("slurm.account", "your-account", commented=True),
        Key("slurm.qos", "normal", commented=True),
        Key("slurm.nodes", a.nodes, source="nodes"),
        Key("slurm.gpus_per_node", a.gpus_per_node, source="gpus_per_node"),
        Key("slurm.cpus_per_task", a.cpus_per_task, source="cpus_per_task"),
        Key("slurm.time", a.time, source="time"),
    ]
    preemption = [
        Key("preemption.lead_time_s", 300, commented=True),
        Key("preemption.checkpoint_s", 120, commented=True),
        Key("preemption.margin_s", 60, commented=True),
    ]
    return [*head, *slurm, *common, *preemption]


def _inner(annotation: object) -> type[BaseModel] | None:
    """The model class inside an annotation (Optional, Annotated and unions of models: the first)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner(arg)
        if found is not None:
            return found
    if isinstance(annotation, types.UnionType):
        for arg in annotation.__args__:
            found = _inner(arg)
            if found is not None:
                return found
    return None


def _field(model: type[BaseModel], path: str) -> FieldInfo | None:
    """The field of a dotted path (through the first model of a union: e.g. a venv's), or None."""
    cls: type[BaseModel] | None = model
    field = None
    for part in path.split("."):
        if cls is None or part not in cls.model_fields:
            return None
        field = cls.model_fields[part]
        cls = _inner(field.annotation)
    return field


def describe(model: type[BaseModel], path: str) -> str:
    """The schema's description of a dotted field path."""
    field = _field(model, path)
    return (field.description or "") if field is not None else ""


def default(model: type[BaseModel], path: str) -> object:
    """The schema's default of a dotted field path (None when it has none)."""
    field = _field(model, path)
    return None if field is None else field.get_default(call_default_factory=True)


def _value(v: object) -> str:
    """A YAML value: strings in double quotes (JSON's, which YAML reads alike: no time or number
    surprises), numbers and lists as JSON."""
    return json.dumps(v)


def text(site: str, a: Answers) -> str:
    """The commented profile."""
    return _lines(site, a)[0]


def _lines(site: str, a: Answers) -> tuple[str, dict[int, Key]]:
    """The commented profile, and the key each line number (from 1) writes, where it writes one."""
    model = PROFILE_KINDS[a.kind]
    at: dict[int, Key] = {}
    lines = [
        f"# Site profile {site!r} ({a.kind}), written by `sbatch-gen init`. Every key: `sbatch-gen schema`.",
        f"# Check it: sbatch-gen validate --site {site}; on the cluster: sbatch-gen doctor --site {site}.",
        f"# Render it: sbatch-gen render --site {site} (then review and commit out/).",
        "# Lines starting with '# key:' are defaults worth knowing: uncomment to change them.",
    ]
    section = None
    every = keys(site, a)
    live = {k.path.split(".")[0] for k in every if not k.commented}  # sections with a key set
    for k in every:
        parts = k.path.split(".")
        indent = "  " * (len(parts) - 1)
        if len(parts) > 1 and parts[0] != section:
            section = parts[0]
            lines += ["", f"{section}:" if section in live else f"# {section}:"]
        elif len(parts) == 1:
            section = None
            lines.append("")
        for c in textwrap.wrap(describe(model, k.path), 100 - len(indent) - 2):
            lines.append(f"{indent}# {c}")
        # a commented line shows the schema's default: uncommenting it changes nothing
        schema_default = default(model, k.path) if k.commented else None
        shown = schema_default if schema_default is not None else k.value
        line = f"{parts[-1]}: {_value(shown)}"
        lines.append(f"{indent}# {line}" if k.commented else f"{indent}{line}")
        at[len(lines)] = k
    return "\n".join(lines) + "\n", at


def question(answer: str) -> str:
    """What a terminal is asked for an answer (an Answers field) no flag gave."""
    if answer == "hosts":
        return "hosts, in node-rank order (space-separated)"
    if answer == "slurm_version":
        return "slurm version (MAJOR.MINOR, e.g. 24.05: the cluster's `scontrol --version`)"
    return FLAGS[answer].lstrip("-").replace("-", " ")


def _given(site: str, a: Answers, source: str) -> str:
    """How the user gave an answer, with its value: ``--nodes 0``, ``the answer 'gpu x' to 'partition'``."""
    value = site if source == "site" else getattr(a, source)
    flag = FLAGS[source]
    shown = " ".join(repr(h) for h in value) if isinstance(value, tuple) else repr(value)
    origin = a.origin.get(source)
    if origin == "question":
        return f"the answer {shown} to {question(source)!r}"
    if origin == "scontrol":
        return f"{flag} {shown} (from scontrol --version here; give {flag})"
    if isinstance(value, tuple):
        return " ".join(f"{flag} {h!r}" for h in value)
    return f"{flag} {shown}"


def _name_the_answer(message: str, written: str, site: str, a: Answers, at: dict[int, Key]) -> str:
    """A load error of the profile init would have written (``<written>:LINE: field: message``), said of the
    flag or answer that gave the bad value instead: that file was never written."""
    m = re.match(re.escape(written) + r"(?::(\d+))?: (.*)", message)
    if m is None:
        return message
    key = at.get(int(m.group(1))) if m.group(1) else None
    if key is None or key.source is None:
        return f"init: {m.group(2)}"
    given = _given(site, a, key.source)
    return f"init {given}: {m.group(2)}" if given.startswith("-") else f"init, {given}: {m.group(2)}"


def write(sites_dir: Path, site: str, a: Answers) -> Path:
    """Write ``sites_dir/site.yaml`` once it loads as ``validate`` loads it; never over an existing one."""
    if not SITE_NAME_RE.fullmatch(site):
        raise UserError(
            f"invalid site name {site!r} (letters, digits, '_', '.', '-'; not first '.', '_', '-')"
        )
    target = sites_dir / f"{site}.yaml"
    if target.exists():
        raise UserError(f"{target}: exists already; init never overwrites a profile (choose another --site)")
    body, at = _lines(site, a)
    with tempfile.TemporaryDirectory(prefix="sbatch-gen-init-") as tmp:
        (Path(tmp) / f"{site}.yaml").write_text(body)
        try:
            load_site(Path(tmp), site, [])
        except UserError as e:  # nothing is written: each problem names the flag (or answer) and its value
            written = display_path(Path(tmp) / f"{site}.yaml")
            raise UserError([_name_the_answer(m, written, site, a, at) for m in e.messages]) from None
    sites_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # fails rather than overwrite
    with os.fdopen(fd, "w") as f:
        f.write(body)
    return target
