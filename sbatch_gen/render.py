"""Render site profiles to scripts with Jinja (StrictUndefined). Torch-free.

Data flows one way: YAML -> validated profile -> context -> template -> file. Every value interpolated
into shell code goes through the ``shq`` filter (shlex.quote); values in ``#SBATCH`` lines go through
``sbatch``, which refuses anything outside a safe character set (validation already guarantees it).
The output depends only on the profile files, the overrides and the templates: no timestamps, versions,
random ids or absolute checkout paths, so renders are byte-identical across runs and machines.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.meta

from sbatch_gen import contract
from sbatch_gen.loader import LoadedSite, UserError, display_path
from sbatch_gen.profile import ProfileBase, SlurmProfile, slurm_time_seconds
from sbatch_gen.xr_options import to_argv

# #SBATCH lines are read by sbatch, not by a shell: these characters are literal there. The validators in
# profile.py admit a subset per field (e.g. '&|[]()*!' only in slurm.constraint).
_SBATCH_SAFE = re.compile(r"[A-Za-z0-9_./+:=@,%&|\[\]()*!-]+")
# Left unquoted by `shq`; everything else is single-quoted. ',' and '=' are quoted too, so shellcheck
# does not mistake `a,b` in an array for a typo (SC2054) or `X==y` for a comparison (SC1097).
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_./:+@%-]+")


def default_templates_dir() -> Path:
    """The templates a wheel ships (sbatch_gen/templates), else the checkout's top-level templates/."""
    here = Path(__file__).resolve().parent
    for d in (here / "templates", here.parent / "templates"):
        if d.is_dir():
            return d
    raise UserError("templates not found: neither sbatch_gen/templates nor templates/ exists (use --templates-dir)")


def shell_quote(value: object) -> str:
    """Quote one value as one shell word (like shlex.quote, but ',' and '=' are quoted too)."""
    if value is None or isinstance(value, list | dict | tuple):
        raise jinja2.TemplateRuntimeError(f"shq: cannot quote {type(value).__name__} {value!r}")
    if isinstance(value, bool):
        value = "1" if value else "0"
    s = str(value)
    if _SHELL_SAFE.fullmatch(s):
        return s
    return "'" + s.replace("'", "'\"'\"'") + "'"


# Put after the shebang when a quoted value holds a literal $ or backtick: shellcheck would otherwise
# suspect a forgotten expansion (SC2016); here the single quotes are the point.
_SC2016 = "# shellcheck disable=SC2016  # literal $ or ` in profile values: single-quoted on purpose\n"


def _sbatch(value: object) -> str:
    s = str(value)
    if not _SBATCH_SAFE.fullmatch(s):
        raise jinja2.TemplateRuntimeError(f"unsafe value for an #SBATCH line: {s!r}")
    return s


def _comment(value: object) -> str:
    """Text for a '#' comment line: control characters escaped so the comment cannot end early."""
    return "".join(c if 32 <= ord(c) != 127 else f"\\x{ord(c):02x}" for c in str(value))


def make_env(templates_dir: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    literal_dollar: list[bool] = []

    def shq(value: object) -> str:
        q = shell_quote(value)
        if q.startswith("'") and ("$" in q or "`" in q):
            literal_dollar.append(True)
        return q

    env.filters["shq"] = shq
    env.globals["_literal_dollar"] = literal_dollar
    env.filters["sbatch"] = _sbatch
    env.filters["comment"] = _comment
    return env


@functools.lru_cache(maxsize=8)
def _cached_env(templates_dir: str) -> jinja2.Environment:
    # Compiled templates are cached per environment (Jinja re-reads a template whose file changed).
    return make_env(Path(templates_dir))


def _template_closure(env: jinja2.Environment, name: str) -> list[str]:
    """The template and everything it includes/imports/extends, in a stable order."""
    seen: list[str] = []
    todo = [name]
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.append(n)
        src = env.loader.get_source(env, n)[0]
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
        add("template", env.loader.get_source(env, t)[0].encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# What the job exports: shared by every kind (Slurm, SSH), so the environment is defined once.


@dataclass(frozen=True)
class EnvBlock:
    key: str  # the profile key(s) behind these variables, for the comment above them
    vars: tuple[tuple[str, str], ...]


def job_environment(p: ProfileBase) -> list[EnvBlock]:
    """Environment variables every job step gets, grouped by the profile section they come from."""
    blocks: list[EnvBlock] = []
    ifname = p.network.socket_ifname
    if ifname:
        names = ["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"] if p.uses_gpus() else ["GLOO_SOCKET_IFNAME"]
        blocks.append(EnvBlock("network.socket_ifname", tuple((n, ifname) for n in names)))
    if p.uses_gpus():
        n = p.nccl
        v: list[tuple[str, str]] = []
        if n.ib_hca:
            v.append(("NCCL_IB_HCA", nccl_ib_hca(p)))
        v.append(("NCCL_IB_DISABLE", "1" if n.ib_disable else "0"))
        if n.ib_gid_index is not None:
            v.append(("NCCL_IB_GID_INDEX", str(n.ib_gid_index)))
        v.append(("NCCL_P2P_DISABLE", "1" if n.p2p_disable else "0"))
        if n.nvls_enable is not None:
            v.append(("NCCL_NVLS_ENABLE", "1" if n.nvls_enable else "0"))
        v.append(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1" if n.async_error_handling else "0"))
        if n.heartbeat_timeout_s is not None:
            v.append(("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(n.heartbeat_timeout_s)))
        if n.debug is not None:
            v.append(("NCCL_DEBUG", n.debug))
        if n.debug_subsys is not None:
            v.append(("NCCL_DEBUG_SUBSYS", n.debug_subsys))
        blocks.append(EnvBlock("nccl", tuple(v)))
        if p.topology.nccl_topo_file is not None:
            blocks.append(EnvBlock("topology.nccl_topo_file", (("NCCL_TOPO_FILE", p.topology.nccl_topo_file),)))
    threads = max(1, cpus_per_node(p) // p.nproc_per_node())
    blocks.append(
        EnvBlock(
            "derived: CPUs per node / processes per node; unbuffered output for the logs",
            (("OMP_NUM_THREADS", str(threads)), ("PYTHONUNBUFFERED", "1")),
        )
    )
    if p.torchrun.max_restarts > 0:
        # torchrun otherwise reuses its rendezvous TCP store across worker restarts, and restarted workers can
        # read the dead attempt's peer addresses (pytorch/pytorch#135712).
        blocks.append(
            EnvBlock(
                "torchrun.max_restarts > 0: a fresh rendezvous store per restart",
                (("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),),
            )
        )
    if p.extra_env:
        blocks.append(EnvBlock("extra_env", tuple(p.extra_env.items())))
    return blocks


def nccl_ib_hca(p: ProfileBase) -> str:
    """NCCL_IB_HCA as NCCL reads it: '=' first for exact names (else prefixes), then name[:port],..."""
    return ("=" if p.nccl.ib_hca_exact else "") + ",".join(p.nccl.ib_hca)


def preflight_ib_hca(p: ProfileBase) -> str:
    """The NCCL_IB_HCA value the preflight checks on every node; empty when NCCL will not use the adapters
    (a CPU site, no nccl.ib_hca, or nccl.ib_disable)."""
    if not p.uses_gpus() or not p.nccl.ib_hca or p.nccl.ib_disable:
        return ""
    return nccl_ib_hca(p)


def group_flags(argv: list[str]) -> list[list[str]]:
    """["--a", "1", "--b", "--c", "x"] -> [["--a", "1"], ["--b"], ["--c", "x"]] (one flag per line)."""
    groups: list[list[str]] = []
    for a in argv:
        if a.startswith("--") or not groups:
            groups.append([a])
        else:
            groups[-1].append(a)
    return groups


def cpus_per_node(p: ProfileBase) -> int:
    if isinstance(p, SlurmProfile):
        return p.slurm.cpus_per_task
    v = getattr(p, "cpus_per_node", None)  # other kinds: a property or a method
    if callable(v):
        v = v()
    return int(v or 1)


# Variables the script sets at run time (besides job_environment), for pyxis --container-env.
RUNTIME_EXPORTS = ("MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", contract.ENV_STOP_FILE)


def container_env_names(p: ProfileBase) -> list[str]:
    names = [n for b in job_environment(p) for n, _ in b.vars]
    return sorted(set(names) | set(RUNTIME_EXPORTS))


def _slurm_context(site: LoadedSite) -> dict:
    p = site.profile
    assert isinstance(p, SlurmProfile)
    s = p.slurm
    gpus = s.gpus_per_node
    if gpus == 0:
        gpu_directive = None
    elif s.gpu_request == "gres":
        gpu_directive = f"--gres=gpu:{s.gpu_type}:{gpus}" if s.gpu_type else f"--gres=gpu:{gpus}"
    else:
        gpu_directive = f"--gpus-per-node={s.gpu_type}:{gpus}" if s.gpu_type else f"--gpus-per-node={gpus}"
    setup_gpu_directive = None
    if gpu_directive is not None:
        setup_gpu_directive = gpu_directive.rsplit(":", 1)[0] + ":1" if ":" in gpu_directive else (
            gpu_directive.split("=")[0] + "=1"
        )
    return {
        "job_name": s.job_name or site.name,
        "gpu_directive": gpu_directive,
        "setup_gpu_directive": setup_gpu_directive,
        "setup_cpus": min(s.cpus_per_task, 16),
        "time_limit_s": slurm_time_seconds(s.time),
        "container_env": ",".join(container_env_names(p)),
    }


def context(site: LoadedSite, sha: str) -> dict:
    p = site.profile
    chain = site.header_files  # sites-relative: renders do not depend on the checkout location
    ctx = {
        "site": site.name,
        "p": p,
        "profile_file": chain[-1],
        "base_files": chain[:-1],
        "overrides": site.overrides,
        "inputs_sha256": sha,
        "nproc_per_node": p.nproc_per_node(),
        "uses_gpus": p.uses_gpus(),
        "env_blocks": job_environment(p),
        "xr_argv": group_flags(to_argv(p.cross_region)),
        "preflight_ib_hca": preflight_ib_hca(p),
        "EXIT_REQUEUE": contract.EXIT_REQUEUE,
        "ENV_STOP_FILE": contract.ENV_STOP_FILE,
        "ACK_SUFFIX": contract.ACK_SUFFIX,
    }
    if isinstance(p, SlurmProfile):
        ctx.update(_slurm_context(site))
    return ctx


# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rendered:
    filename: str
    text: str
    template: str


def render_site(site: LoadedSite, templates_dir: Path | None = None) -> list[Rendered]:
    tdir = templates_dir or default_templates_dir()
    env = _cached_env(str(Path(tdir).resolve()))
    out = []
    for template, pattern in type(site.profile).OUTPUTS:
        env.globals["_literal_dollar"].clear()
        try:
            names = _template_closure(env, template)
            sha = inputs_sha256(site, env, names)
            text = env.get_template(template).render(context(site, sha))
        except jinja2.TemplateNotFound as e:
            raise UserError(f"{display_path(tdir)}: template {e.name!r} not found") from None
        except jinja2.TemplateSyntaxError as e:
            raise UserError(f"{e.filename or template}:{e.lineno}: template syntax error: {e.message}") from None
        except jinja2.TemplateError as e:
            raise UserError(f"{display_path(tdir)}/{template}: cannot render site {site.name!r}: {e}") from None
        if env.globals["_literal_dollar"] and text.startswith("#!"):
            shebang, rest = text.split("\n", 1)
            text = f"{shebang}\n{_SC2016}{rest}"
        out.append(Rendered(pattern.format(site=site.name), text.rstrip("\n") + "\n", template))
    return out


def write_atomic(path: Path, text: str | bytes, mode: int = 0o755) -> None:
    """Write via a temp file in the same directory + rename: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


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
        what = "is a file, not a directory" if d == out_dir else f"{display_path(d)} is a file, not a directory"
        raise OutputError(f"{shown}: {what}", bad_destination=True)
    if writing and not os.access(d, os.W_OK | os.X_OK):
        where = "directory is not writable" if d == out_dir else f"{display_path(d)} is not writable"
        raise OutputError(f"{shown}: {where} (permission denied or a read-only filesystem)", bad_destination=True)


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
            raise OutputError(f"{display_path(path)}: is a directory; the rendered file cannot replace it "
                              "(nothing was written)", bad_destination=True)
        try:
            old.append((path.read_bytes(), stat.S_IMODE(os.stat(path).st_mode)) if os.path.lexists(path) else None)
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
        raise OutputError(f"{display_path(current)}: cannot write: {why} (nothing was changed)",
                          bad_destination=False) from None
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


def unified_diff(path: Path, old: str | None, new: str | None) -> str:
    name = display_path(path)
    a = [] if old is None else old.splitlines(keepends=True)
    b = [] if new is None else new.splitlines(keepends=True)
    lines = difflib.unified_diff(
        a, b, fromfile=f"a/{name}" if old is not None else "/dev/null",
        tofile=f"b/{name}" if new is not None else "/dev/null",
    )
    return "".join(x if x.endswith("\n") else x + "\n\\ No newline at end of file\n" for x in lines)
