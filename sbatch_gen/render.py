"""Render site profiles to scripts with Jinja (StrictUndefined). Torch-free.

Data flows one way: YAML -> validated profile -> context -> template -> file. Every value interpolated
into shell code goes through the ``shq`` filter (shlex.quote); values in ``#SBATCH`` lines go through
``sbatch``, which refuses anything outside a safe character set (validation already guarantees it).
The output depends only on the profile files, the overrides and the templates: no timestamps, versions,
random ids or absolute checkout paths, so renders are byte-identical across runs and machines.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.meta

from sbatch_gen import contract
from sbatch_gen.credentials import config_metrics
from sbatch_gen.errors import UserError
from sbatch_gen.fsutil import display_path, write_atomic
from sbatch_gen.launch import (
    LAUNCHERS,
    SSH,
    Concat,
    Var,
    container_argv,
    torchrun_argv,
    torchrun_flags_to_check,
    trainer_argv,
)
from sbatch_gen.loader import LoadedSite
from sbatch_gen.profiles import job_environment, preflight_ib_hca
from sbatch_gen.profiles.environment import SLURM_RUN_TIME_ENV, set_at_run_time
from sbatch_gen.profiles.types import SBATCH_LINE_RE

# Left unquoted by `shq`; everything else is single-quoted. ',' and '=' are quoted too, so shellcheck
# does not mistake `a,b` in an array for a typo (SC2054) or `X==y` for a comparison (SC1097).
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_./:+@%-]+")
# A long option with its value in one word (--rdzv-conf=join_timeout=900): left unquoted too when the value is
# made of safe characters and single '=' (no '==', no ','); else only the value is quoted (--x='a b').
_SHELL_SAFE_FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9-]*=[A-Za-z0-9_./:+@%-]+(=[A-Za-z0-9_./:+@%-]+)*")
_FLAG_VALUE = re.compile(r"(--[A-Za-z0-9][A-Za-z0-9-]*=)(.+)", re.S)


def default_templates_dir() -> Path:
    """The templates a wheel ships (sbatch_gen/templates), else the checkout's top-level templates/."""
    here = Path(__file__).resolve().parent
    for d in (here / "templates", here.parent / "templates"):
        if d.is_dir():
            return d
    raise UserError(
        "templates not found: neither sbatch_gen/templates nor templates/ exists (use --templates-dir)"
    )


def _template_files(d: Path) -> dict[str, bytes]:
    try:
        return {f.relative_to(d).as_posix(): f.read_bytes() for f in sorted(d.rglob("*.j2")) if f.is_file()}
    except OSError:
        return {}


def other_templates_note(cwd: Path | None = None) -> str | None:
    """The default templates are those of the sbatch-gen that runs (:func:`default_templates_dir`): the code
    that fills them in and they go together, so a working directory's ``templates/`` is never read unasked.
    When the working directory has one that differs (another checkout, edited templates), a note says
    which were used and how to use the others; None otherwise."""
    here = Path(cwd) if cwd is not None else Path.cwd()
    local = here / "templates"
    if not local.is_dir():
        return None
    try:
        used = default_templates_dir()
    except UserError:
        return None
    if local.resolve() == used.resolve():
        return None
    theirs, ours = _template_files(local), _template_files(used)
    if theirs == ours or not theirs.keys() & ours.keys():  # the same, or a templates/ of something else
        return None
    code = Path(__file__).resolve().parent
    return (
        f"note: rendering with the templates of the sbatch-gen that runs, {display_path(used)} (its code is "
        f"{display_path(code)}), not with ./templates, which differ: pass --templates-dir templates, or run "
        "this checkout's sbatch-gen (python -m sbatch_gen.cli from it, or pip install -e . into the venv)"
    )


def shell_quote(value: object) -> str:
    """Quote one value as one shell word (like shlex.quote, but ',' and '=' are quoted too). A run-time
    value (sbatch_gen.launch.Var, Concat) becomes a double-quoted expansion of its shell variables."""
    if isinstance(value, Var | Concat):
        return value.shell()
    if value is None or isinstance(value, list | dict | tuple):
        raise jinja2.TemplateRuntimeError(f"shq: cannot quote {type(value).__name__} {value!r}")
    if isinstance(value, bool):
        value = "1" if value else "0"
    s = str(value)
    if _SHELL_SAFE.fullmatch(s) or _SHELL_SAFE_FLAG.fullmatch(s):
        return s
    m = _FLAG_VALUE.fullmatch(s)
    if m:
        return m.group(1) + shell_quote(m.group(2))
    return "'" + s.replace("'", "'\"'\"'") + "'"


# Put after the shebang when a quoted value holds a literal $ or backtick: shellcheck would otherwise
# suspect a forgotten expansion (SC2016); here the single quotes are the point.
_SC2016 = "# shellcheck disable=SC2016  # literal $ or ` in profile values: single-quoted on purpose\n"


def _sbatch(value: object) -> str:
    s = str(value)
    if not SBATCH_LINE_RE.fullmatch(s):  # the profile's validators admit a subset per field
        raise jinja2.TemplateRuntimeError(f"unsafe value for an #SBATCH line: {s!r}")
    return s


def _comment(value: object) -> str:
    """Text for a '#' comment line: control characters escaped so the comment cannot end early."""
    return "".join(c if 32 <= ord(c) != 127 else f"\\x{ord(c):02x}" for c in str(value))


@dataclass
class RenderState:
    """What one render notes while it runs; a fresh one goes into each render's context (RENDER_STATE)."""

    literal_dollar: bool = False  # a single-quoted value holds a literal $ or `: the script gets _SC2016


RENDER_STATE = "_render_state"


@jinja2.pass_context
def _shq(ctx: jinja2.runtime.Context, value: object) -> str:
    q = shell_quote(value)
    if not isinstance(value, Var | Concat) and "'" in q and ("$" in q or "`" in q):
        state = ctx.get(RENDER_STATE)
        if not isinstance(state, RenderState):
            # a macro of a template imported without context: it cannot see this render's state
            raise jinja2.TemplateRuntimeError(
                "shq: no render state here (import the template `with context`)"
            )
        state.literal_dollar = True
    return q


_DQ_WORD_SPECIAL = re.compile(r'([\\$`"}])')


def env_default(value: object, name: str) -> str:
    """`${NAME-value}` for inside double quotes: the variable's value when the environment has it (set at
    submit time, even empty), else the profile's value as written (its \\ $ ` " } escaped, a ' as "'": no
    expansion, the same characters the single-quoted export gave)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise jinja2.TemplateRuntimeError(f"env_default: not a variable name: {name!r}")
    # bash reads a ' in that word as a quote to match: it goes in double quotes of its own ("'")
    word = _DQ_WORD_SPECIAL.sub(r"\\\1", str(value)).replace("'", '"\'"')
    return "${" + name + "-" + word + "}"


# How many options packed_options writes to a line (those of a flag family, and those with no profile key of
# their own). A fixed count, not a width: a changed value changes its own line only, never the wrapping of the
# ones after it.
PACKED_PER_LINE = 3
# The trainer's flag families (--xr-<field>, --metrics-<field>) and the profile section they come from, named
# in a comment line before them.
FLAG_FAMILIES = {"xr": "cross_region", "metrics": "metrics"}


@jinja2.pass_context
def packed_options(ctx: jinja2.runtime.Context, options) -> list[str]:
    """The lines of an argument list (launch.py's Options, each ``words`` and ``key``): an option with a key
    on a line of its own, the key in a comment after it; the others PACKED_PER_LINE to a line, each option's
    words together, a run of them broken by a keyed option or a change of flag family, each of the trainer's
    flag families (--xr-*, --metrics-*) after a comment naming its profile section."""
    lines: list[str] = []
    run: list[str] = []
    family = None
    for o in options:
        words = " ".join(_shq(ctx, w) for w in o.words)
        first = str(o.words[0])
        this = next((f for f in FLAG_FAMILIES if first.startswith(f"--{f}-")), "")
        if run and (o.key or this != family or len(run) == PACKED_PER_LINE):
            lines.append(" ".join(run))
            run = []
        if this and this != family:
            lines.append(f"# {FLAG_FAMILIES[this]}: the trainer's --{this}-* flags, from its fields")
        if o.key:
            lines.append(f"{words}  # {o.key}")
        else:
            run.append(words)
        family = this
    return lines + ([" ".join(run)] if run else [])


def _sha256(text: str) -> str:
    """The hex sha256 of a rendered block (the node library's fence names its own)."""
    return hashlib.sha256(str(text).encode()).hexdigest()


def git_blob(text: str) -> str:
    """The id git gives a file with this text (`git hash-object`, in a SHA-1 repository): a job finds a
    pinned file in git's objects by it (`git cat-file blob`) when the checkout holds another version by then."""
    data = str(text).encode()
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def pinned(text: str) -> dict[str, str]:
    """How a script pins a file of the render directory: its sha256, and its git blob id to find it by."""
    return {"sha256": _sha256(text), "git": git_blob(text)}


def make_env(templates_dir: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["shq"] = _shq
    env.filters["sbatch"] = _sbatch
    env.filters["comment"] = _comment
    env.filters["sha256"] = _sha256
    env.filters["env_default"] = env_default
    env.filters["packed_options"] = packed_options
    return env


@functools.lru_cache(maxsize=8)
def _cached_env(templates_dir: str) -> jinja2.Environment:
    # Compiled templates are cached per environment (Jinja re-reads a template whose file changed).
    return make_env(Path(templates_dir))


def _template_source(env: jinja2.Environment, name: str) -> str:
    if env.loader is None:  # make_env always sets one
        raise ValueError("the jinja2 environment has no template loader")
    return env.loader.get_source(env, name)[0]


def _template_closure(env: jinja2.Environment, name: str) -> list[str]:
    """The template and everything it includes/imports/extends, in a stable order."""
    seen: list[str] = []
    todo = [name]
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.append(n)
        src = _template_source(env, n)
        refs = jinja2.meta.find_referenced_templates(env.parse(src))
        todo += sorted(r for r in refs if r is not None)
    return seen


def inputs_sha256(site: LoadedSite, env: jinja2.Environment, templates: list[str]) -> str:
    """sha256 over the contents of the profile files (extends chain), the overrides and the templates."""
    h = hashlib.sha256()

    def add(tag: str, data: bytes) -> None:
        h.update(f"{tag}\0{len(data)}\0".encode())
        h.update(data)

    for f in site.files:
        add("profile", Path(f).read_bytes())
    for o in site.overrides:
        add("set", o.encode())
    for t in templates:
        add("template", _template_source(env, t).encode())
    # the train config's metrics section, where the render takes the W&B key's variable from it
    if site.profile.SECRETS_FROM_CONFIG and (cm := config_metrics(site.profile)) is not None:
        section = cm.metrics.model_dump(mode="json") if cm.metrics is not None else None
        add("train-config-metrics", json.dumps(section, sort_keys=True).encode())
    return h.hexdigest()


def context(site: LoadedSite, sha: str) -> dict:
    p = site.profile
    chain = site.header_files  # sites-relative: renders do not depend on the checkout location
    env_blocks = job_environment(p)
    ctx = {
        "site": site.name,
        "p": p,
        "profile_file": chain[-1],
        "base_files": chain[:-1],
        "overrides": site.overrides,
        "inputs_sha256": sha,
        "nproc_per_node": p.nproc_per_node(),
        "uses_gpus": p.uses_gpus(),
        "env_blocks": env_blocks,
        "slurm_env_blocks": set_at_run_time(env_blocks, SLURM_RUN_TIME_ENV),
        # the command line on every node, built once for every kind (sbatch_gen/launch.py)
        "trainer_argv": {name: trainer_argv(p, launcher, site.name) for name, launcher in LAUNCHERS.items()},
        "torchrun_argv": {name: torchrun_argv(p, launcher) for name, launcher in LAUNCHERS.items()},
        # the SSH launcher's preflight setting (a Slurm job's preflight takes them from TORCHRUN_ARGS)
        "ssh_torchrun_flags": torchrun_flags_to_check(p, SSH),
        "container_argv": container_argv,
        "preflight_ib_hca": preflight_ib_hca(p),
        # the node program: its file name (render writes it beside the renders), the sha256 it must have, its git blob id
        "node_py": node_py_pin(),
        **CONTRACT_CONTEXT,
    }
    ctx.update(p.template_context(site.name))
    return ctx


# The trainer's side of the stop hand-off and the run dir's layout (contract.py), for every template.
CONTRACT_CONTEXT = {
    "EXIT_REQUEUE": contract.EXIT_REQUEUE,
    "ENV_STOP_FILE": contract.ENV_STOP_FILE,
    "ENV_PINNED_CODE": contract.ENV_PINNED_CODE,
    "ENV_RUN_JOB": contract.ENV_RUN_JOB,
    "ACK_SUFFIX": contract.ACK_SUFFIX,
    "FATAL_SUFFIX": contract.FATAL_SUFFIX,
    "STOPPING_SUFFIX": contract.STOPPING_SUFFIX,
    "CHECKPOINTS_DIR": contract.CHECKPOINTS_DIR,
    "CHECKPOINT_MARKER": contract.CHECKPOINT_MARKER,
}


# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rendered:
    filename: str
    text: str
    template: str
    uses_node_program: bool = False  # the script runs the node program (NODE_PROGRAM_FILE, its sha256 pinned)
    libraries: tuple[str, ...] = ()  # the LIBRARIES the script sources (their sha256 pinned)


# The node program (sbatch_gen/node_program.py): `render` writes it beside the renders under this name, once
# for all of them; a render that runs it names its path and pins its sha256.
NODE_PROGRAM_FILE = "sbatch-gen-node.py"


def node_program_text() -> str:
    """The node program as `render` writes it: sbatch_gen/node_program.py, byte for byte."""
    return (Path(__file__).resolve().parent / "node_program.py").read_text(encoding="utf-8")


def node_program() -> Rendered:
    """The node program as a file of the render directory, beside the renders that run it."""
    return Rendered(NODE_PROGRAM_FILE, node_program_text(), "")


def node_py_pin() -> dict[str, str]:
    """The node program as the templates pin it (``node_py``): its file name, sha256 and git blob id."""
    return {"name": NODE_PROGRAM_FILE, **pinned(node_program_text())}


# The libraries of the launchers' functions, the same for every site: the Slurm training scripts' job library
# (templates/slurm-job.sh.j2: main's helpers and the node functions) and the SSH launchers' library
# (templates/ssh-lib.sh.j2: the launcher's functions and the nodes'). `render` writes each beside the renders
# under its name, once for all of them; a script that sources one pins its sha256 (in the variable named here).
# They depend on no site's settings: only the contract's names, and the node program's file name.
JOB_LIBRARY_FILE = "sbatch-gen-job.sh"
SSH_LIBRARY_FILE = "sbatch-gen-ssh.sh"
LIBRARIES = {  # file -> (template, the context key and the variable a script pins its sha256 in)
    JOB_LIBRARY_FILE: ("slurm-job.sh.j2", "job_lib", "JOB_LIB_SHA256"),
    SSH_LIBRARY_FILE: ("ssh-lib.sh.j2", "ssh_lib", "SSH_LIB_SHA256"),
}


def library(name: str, templates_dir: Path | None = None) -> Rendered:
    """One of the LIBRARIES as a file of the render directory, beside the scripts that source it."""
    template = LIBRARIES[name][0]
    tdir = templates_dir or default_templates_dir()
    env = _cached_env(str(Path(tdir).resolve()))
    try:
        text = env.get_template(template).render({**CONTRACT_CONTEXT, "node_py": node_py_pin()})
    except jinja2.TemplateNotFound as e:
        raise UserError(f"{display_path(tdir)}: template {e.name!r} not found") from None
    except jinja2.TemplateError as e:
        raise UserError(f"{display_path(tdir)}/{template}: cannot render: {e}") from None
    return Rendered(name, text.rstrip("\n") + "\n", template)


def job_library(templates_dir: Path | None = None) -> Rendered:
    """The Slurm training scripts' job library (:func:`library`)."""
    return library(JOB_LIBRARY_FILE, templates_dir)


def render_site(site: LoadedSite, templates_dir: Path | None = None) -> list[Rendered]:
    """The site's files (those that run the node program or source a library say so: node_program() and
    library() go beside them)."""
    tdir = templates_dir or default_templates_dir()
    env = _cached_env(str(Path(tdir).resolve()))
    out = []
    # the libraries a script pins: the same text for every template of the site
    libs = {
        key: {"name": name, **pinned(library(name, tdir).text)} for name, (_, key, _) in LIBRARIES.items()
    }
    for template, pattern in type(site.profile).OUTPUTS:
        state = RenderState()
        try:
            names = _template_closure(env, template)
            sha = inputs_sha256(site, env, names)
            ctx = context(site, sha)
            ctx.update(libs)
            text = env.get_template(template).render({**ctx, RENDER_STATE: state})
        except jinja2.TemplateNotFound as e:
            raise UserError(f"{display_path(tdir)}: template {e.name!r} not found") from None
        except jinja2.TemplateSyntaxError as e:
            raise UserError(
                f"{e.filename or template}:{e.lineno}: template syntax error: {e.message}"
            ) from None
        except jinja2.TemplateError as e:
            raise UserError(
                f"{display_path(tdir)}/{template}: cannot render site {site.name!r}: {e}"
            ) from None
        if state.literal_dollar and text.startswith("#!"):
            shebang, rest = text.split("\n", 1)
            text = f"{shebang}\n{_SC2016}{rest}"
        pins = tuple(
            name for name, (_, key, var) in LIBRARIES.items() if f"{var}={libs[key]['sha256']}" in text
        )
        # the job library pins the node program: a script that sources it runs that program
        uses = f"NODE_PY_SHA256={ctx['node_py']['sha256']}" in text or JOB_LIBRARY_FILE in pins
        out.append(Rendered(pattern.format(site=site.name), text.rstrip("\n") + "\n", template, uses, pins))
    return out


class OutputError(Exception):
    """Rendered files could not be written; nothing was changed. ``bad_destination``: the --out directory or
    an output path cannot take the files (bad input, exit 2); otherwise an I/O error while writing (exit 1)."""

    def __init__(self, message: str, bad_destination: bool):
        super().__init__(message)
        self.bad_destination = bad_destination


def check_out_dir(out_dir: Path, writing: bool) -> None:
    """Raise OutputError(bad_destination=True) if ``out_dir`` is not (or cannot become) a directory we can use:
    it is a file, an ancestor is a file, or (``writing``) the directory that would hold the files is not
    writable."""
    out_dir = Path(out_dir)
    shown = f"--out {display_path(out_dir)}"
    d = out_dir
    while not os.path.lexists(d):  # the first part of the path that exists
        if d.parent == d:
            break
        d = d.parent
    if os.path.lexists(d) and not d.is_dir():
        what = (
            "is a file, not a directory" if d == out_dir else f"{display_path(d)} is a file, not a directory"
        )
        raise OutputError(f"{shown}: {what}", bad_destination=True)
    if writing and not os.access(d, os.W_OK | os.X_OK):
        where = "directory is not writable" if d == out_dir else f"{display_path(d)} is not writable"
        raise OutputError(
            f"{shown}: {where} (permission denied or a read-only filesystem)", bad_destination=True
        )


def write_outputs(out_dir: Path, files: list[tuple[str, str]], mode: int = 0o755) -> list[tuple[Path, bool]]:
    """Write rendered files all-or-nothing: check every destination first, write each one to a temp file
    in ``out_dir``, then rename them into place. On any failure the temp files and any directory made for
    them are removed, files already renamed get their old contents (and mode) back, and OutputError says
    why. Returns (path, unchanged) per file."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, writing=True)
    paths = [out_dir / name for name, _ in files]
    old: list[tuple[bytes, int] | None] = []
    for path in paths:
        if os.path.isdir(path):
            raise OutputError(
                f"{display_path(path)}: is a directory; the rendered file cannot replace it "
                "(nothing was written)",
                bad_destination=True,
            )
        try:
            old.append(
                (path.read_bytes(), stat.S_IMODE(os.stat(path).st_mode)) if os.path.lexists(path) else None
            )
        except OSError:
            old.append(None)  # unreadable: it is replaced, but cannot be restored
    new = [text.encode("utf-8") for _, text in files]

    made: list[Path] = []  # directories created here, outermost first
    temps: list[str] = []
    done: list[int] = []  # indexes renamed into place
    current = out_dir
    try:
        missing = []
        d = out_dir
        while not os.path.lexists(d):
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            current = d
            os.mkdir(d)
            made.append(d)
        for path, data in zip(paths, new, strict=True):
            current = path
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=out_dir)
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
        for i, (path, tmp) in enumerate(zip(paths, temps, strict=True)):
            current = path
            os.replace(tmp, path)
            done.append(i)
    except OSError as e:
        _roll_back(paths, old, temps, done, made)
        why = e.strerror or str(e)
        raise OutputError(
            f"{display_path(current)}: cannot write: {why} (nothing was changed)", bad_destination=False
        ) from None
    except BaseException:
        _roll_back(paths, old, temps, done, made)
        raise
    return [(p, o is not None and o[0] == n) for p, o, n in zip(paths, old, new, strict=True)]


def _roll_back(paths: list[Path], old: list, temps: list[str], done: list[int], made: list[Path]) -> None:
    for tmp in temps:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    for i in done:
        try:
            if old[i] is None:
                os.unlink(paths[i])
            else:
                write_atomic(paths[i], old[i][0], mode=old[i][1])
        except OSError:
            pass
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            pass
