"""The profile package: no import cycle, the shared checks the same for every kind, the reserved environment
derived from what the job exports, one strict base model and one #SBATCH character set."""

from __future__ import annotations

import ast
import copy
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

import sbatch_gen.train.config
import sbatch_gen.xr_options
from sbatch_gen import profiles
from sbatch_gen.errors import FieldError
from sbatch_gen.loader import load_site
from sbatch_gen.profiles import PROFILE_KINDS, ProfileBase, SlurmProfile, SshProfile, job_environment
from sbatch_gen.profiles import base as pbase
from sbatch_gen.profiles import slurm as pslurm
from sbatch_gen.profiles import ssh as pssh
from sbatch_gen.profiles import types as ptypes
from sbatch_gen.profiles.environment import (
    JOB_ENV_NAMES,
    RESERVED_ENV,
    RUNTIME_EXPORTS,
    SSH_LAUNCHER_EXPORTS,
)
from sbatch_gen.render import LIBRARIES
from sbatch_gen.strict import StrictModel

from .conftest import REPO, sg
from .script_parts import SCRIPT_SUFFIXES

pytestmark = pytest.mark.slow  # imports the package in fresh interpreters

PKG = Path(profiles.__file__).resolve().parent
SRC = PKG.parent  # sbatch_gen/
PACKAGE_MODULES = sorted(f"sbatch_gen.profiles.{f.stem}" for f in PKG.glob("*.py") if f.stem != "__init__")


# ---- no import cycle ---------------------------------------------------------------------------------


def _module_file(name: str) -> Path | None:
    rel = Path(*name.split("."))
    for f in (SRC.parent / rel.with_suffix(".py"), SRC.parent / rel / "__init__.py"):
        if f.is_file():
            return f
    return None


def _imports(name: str) -> set[str]:
    """The sbatch_gen modules `name` imports when it is loaded: module-level imports, not those under
    `if TYPE_CHECKING:` or inside functions."""
    f = _module_file(name)
    assert f is not None, name
    package = name if f.name == "__init__.py" else name.rpartition(".")[0]
    deps: set[str] = set()
    for node in ast.parse(f.read_text()).body:  # module level only
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{a.name}"
                deps.add(sub if _module_file(sub) is not None else base)
    return {d for d in deps if d.startswith("sbatch_gen.") and _module_file(d) is not None}


def test_the_profile_modules_import_no_cycle():
    graph: dict[str, set[str]] = {}
    todo = ["sbatch_gen.profiles", *PACKAGE_MODULES]
    while todo:
        m = todo.pop()
        if m not in graph:
            graph[m] = _imports(m)
            todo += sorted(graph[m])

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen: set[str] = set()
        while stack:
            m, path = stack.pop()
            for d in sorted(graph[m]):
                if d == start:
                    return [*path, d]
                if d not in seen:
                    seen.add(d)
                    stack.append((d, [*path, d]))
        return None

    for m in ["sbatch_gen.profiles", *PACKAGE_MODULES, "sbatch_gen.strict", "sbatch_gen.xr_options"]:
        assert cycle_from(m) is None, " -> ".join(cycle_from(m) or [])
    # The submodules never import the package itself (its __init__ imports them).
    for m in PACKAGE_MODULES:
        assert "sbatch_gen.profiles" not in graph[m], m


@pytest.mark.parametrize(
    "first",
    ["sbatch_gen.profiles", *PACKAGE_MODULES, "sbatch_gen.render", "sbatch_gen.loader", "sbatch_gen.cli"],
)
def test_each_module_imports_first_in_a_fresh_interpreter(first):
    code = (
        f"import {first}, sys; import sbatch_gen.profiles as p; print(sorted(p.PROFILE_KINDS)); "
        "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["['slurm', 'ssh']", "False"]


# ---- the shared checks: written once, the same result for every kind ---------------------------------

_COMMON = {
    "paths": {"run_dir": "runs/x"},
    "trainer": {"config": "configs/tiny.yaml"},
    "network": {"socket_ifname": "lo"},
}


def _profile_data(kind: str, gpus: int, **sections: dict) -> dict:
    """Equivalent profiles of each kind: the same shared sections, `gpus` GPUs and 4 CPUs per machine."""
    data = copy.deepcopy(_COMMON)
    if kind == "slurm":
        data["slurm"] = {
            "version": "23.11",
            "partition": "p",
            "nodes": 2,
            "gpus_per_node": gpus,
            "cpus_per_task": 4,
            "time": "01:00:00",
        }
    else:
        data.update(kind="ssh", hosts=["a", "b"], node={"gpus": gpus, "cpus": 4})
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return data


def _outcome(kind: str, data: dict) -> tuple[tuple, str] | None:
    """(location, message) of the first error, the kind's name of its GPU count replaced; None: valid."""
    cls = PROFILE_KINDS[kind]
    try:
        cls.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        ctx = (err.get("ctx") or {}).get("error")
        loc = tuple(err["loc"]) + (ctx.path if isinstance(ctx, FieldError) else ())
        msg = str(ctx) if ctx is not None else err["msg"]
        msg = msg.replace(
            f"differs from {cls.GPU_COUNT_NAME or cls.GPUS_FIELD} (", "differs from <GPU count> ("
        )
        msg = msg.replace(f"({cls.GPUS_FIELD} is 0)", "(<GPU count> is 0)")
        return loc, msg
    return None


SHARED_CASES = {
    "gpu site, procs_per_node = GPUs": (2, {"torchrun": {"procs_per_node": 2}}, None),
    "gpu site, procs_per_node != GPUs": (
        2,
        {"torchrun": {"procs_per_node": 3}},
        ("torchrun", "procs_per_node"),
    ),
    "cpu site, procs_per_node missing": (0, {}, ("torchrun", "procs_per_node")),
    "cpu site, nccl_topo_file": (
        0,
        {"torchrun": {"procs_per_node": 2}, "topology": {"nccl_topo_file": "/etc/t.xml"}},
        ("topology", "nccl_topo_file"),
    ),
    "cpu site, nccl section": (0, {"torchrun": {"procs_per_node": 2}, "nccl": {"debug": "INFO"}}, ("nccl",)),
    "cpu site, numa_binding": (
        0,
        {"torchrun": {"procs_per_node": 2}, "topology": {"numa_binding": "node"}},
        ("topology", "numa_binding"),
    ),
    "gpu site, every GPU setting": (
        2,
        {"topology": {"nccl_topo_file": "/etc/t.xml", "numa_binding": "node"}, "nccl": {"debug": "INFO"}},
        None,
    ),
}


@pytest.mark.parametrize("case", SHARED_CASES)
def test_shared_checks_give_the_same_result_for_slurm_and_ssh(case):
    gpus, sections, where = SHARED_CASES[case]
    slurm = _outcome("slurm", _profile_data("slurm", gpus, **sections))
    ssh = _outcome("ssh", _profile_data("ssh", gpus, **sections))
    assert slurm == ssh
    assert (slurm and slurm[0]) == where


def test_the_gpu_count_is_named_by_each_kind():
    with pytest.raises(ValidationError, match=re.escape("required on a CPU site (node.gpus is 0)")):
        SshProfile.model_validate(_profile_data("ssh", 0))
    with pytest.raises(ValidationError, match=re.escape("required on a CPU site (slurm.gpus_per_node is 0)")):
        SlurmProfile.model_validate(_profile_data("slurm", 0))
    procs = {"torchrun": {"procs_per_node": 3}}
    with pytest.raises(ValidationError, match=re.escape("procs_per_node (3) differs from node.gpus (2)")):
        SshProfile.model_validate(_profile_data("ssh", 2, **procs))
    with pytest.raises(ValidationError, match=re.escape("procs_per_node (3) differs from the GPU count (2)")):
        SlurmProfile.model_validate(_profile_data("slurm", 2, **procs))


@pytest.mark.parametrize("site", ["local", "ssh-local"])
def test_nccl_topo_file_on_a_cpu_site_is_refused_for_every_kind(work, site):
    """It used to be accepted for ssh-local (the SSH kind had its own copy of the checks, without this one),
    and then never reached the script."""
    r = sg("render", "--site", site, "--set", "topology.nccl_topo_file=/etc/topo.xml", "--out", "out")
    assert r.code == 2, r.out
    assert r.err == (
        "sbatch-gen: --set topology.nccl_topo_file=/etc/topo.xml: topology.nccl_topo_file: this site "
        "has no GPUs: remove it\n"
    )
    assert not (work / "out").exists()


# ---- per-kind methods ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", PROFILE_KINDS)
def test_every_kind_answers_the_per_kind_questions(kind):
    cls = PROFILE_KINDS[kind]
    for method in ("gpus_per_node", "cpus_per_node", "node_count"):
        assert getattr(cls, method) is not getattr(ProfileBase, method), f"{cls.__name__} lacks {method}()"
    assert cls.GPUS_FIELD and cls.OUTPUTS
    p = cls.model_validate(_profile_data(kind, 2))
    assert (p.gpus_per_node(), p.cpus_per_node(), p.node_count()) == (2, 4, 2)
    assert p.summary() == f"2 {cls.NODE_WORD}(s) x 2 GPU"
    assert isinstance(p.template_context("x"), dict)


# ---- the reserved environment ----------------------------------------------------------------------------


def _every_variable(kind: str) -> ProfileBase:
    """A GPU profile that turns on every optional variable job_environment can export."""
    data = _profile_data(
        kind,
        2,
        nccl={
            "ib_hca": ["mlx5_0"],
            "ib_gid_index": 3,
            "nvls_enable": True,
            "heartbeat_timeout_s": 60,
            "debug": "INFO",
            "debug_subsys": "INIT,NET",
        },
        topology={"nccl_topo_file": "/etc/topo.xml"},
        torchrun={"max_restarts": 2},
    )
    return PROFILE_KINDS[kind].model_validate(data)


@pytest.mark.parametrize("kind", PROFILE_KINDS)
def test_every_variable_the_job_gets_is_refused_in_extra_env(kind):
    p = _every_variable(kind)
    emitted = {name for block in job_environment(p) for name, _ in block.vars}
    assert emitted == JOB_ENV_NAMES  # the profile above really turns every variable on
    for name in sorted(emitted | set(RUNTIME_EXPORTS)):
        data = p.model_dump(mode="json", exclude_defaults=True)
        data["extra_env"] = {name: "1"}
        with pytest.raises(ValidationError) as e:
            PROFILE_KINDS[kind].model_validate(data)
        assert f"{name} is set by sbatch-gen from other profile fields; set it there" in str(e.value), name


def test_reserved_env_is_what_the_job_gets_plus_the_runtime_and_activation_exports():
    assert JOB_ENV_NAMES <= RESERVED_ENV
    assert set(RUNTIME_EXPORTS) <= RESERVED_ENV
    assert set(SSH_LAUNCHER_EXPORTS) <= RESERVED_ENV
    assert RESERVED_ENV - JOB_ENV_NAMES - set(RUNTIME_EXPORTS) - set(SSH_LAUNCHER_EXPORTS) == {
        "PATH",
        "VIRTUAL_ENV",
        "SLURM_EXPORT_ENV",  # the Slurm job's steps take its whole environment
    }


# export NAME[=VALUE]... (inside `if ...; then ...; fi` too), a comment after it: the names. Each name is
# followed by a space or the end, so no word can be split two ways (no backtracking blow-up on long lines).
_NAME_WORD = r"[A-Za-z_][A-Za-z0-9_]*(?:=[^\s;]*)?"
_EXPORT = re.compile(
    rf"^\s*(?:if .*; then )?export ({_NAME_WORD}(?:[ \t]+{_NAME_WORD})*)(?:; fi)?(?:[ \t]+#.*)?$"
)


@pytest.mark.parametrize(
    "script", sorted(p.name for p in (REPO / "out").iterdir() if p.name.endswith(SCRIPT_SUFFIXES))
)
def test_every_variable_a_rendered_script_exports_is_reserved(script):
    """A script that exports a variable the profile's extra_env could also set would silently win or lose:
    every `export NAME` in the committed renders must be a reserved name (or come from extra_env)."""
    if script in LIBRARIES:  # no site's: the Slurm training scripts' job library, the SSH launchers' library
        allowed = set(RESERVED_ENV)
    else:
        allowed = RESERVED_ENV | set(load_site(REPO / "sites", script.split(".")[0]).profile.extra_env)
    exported = set()
    for line in (REPO / "out" / script).read_text().splitlines():
        m = _EXPORT.match(line)
        if m:
            exported |= {w.split("=", 1)[0] for w in m.group(1).split()}
    assert exported, "no export lines found: the pattern is stale"
    assert exported <= allowed, sorted(exported - allowed)


# ---- one strict base model -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [sbatch_gen.xr_options, sbatch_gen.train.config, ptypes, pbase, pslurm, pssh],
    ids=lambda m: m.__name__,
)
def test_every_model_builds_on_the_one_strict_model(module):
    models = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, BaseModel) and c.__module__ == module.__name__
    ]
    assert models
    for c in models:
        assert issubclass(c, StrictModel), c
        assert c.model_config.get("extra") == "forbid" and c.model_config.get("frozen") is True, c


# ---- one #SBATCH character set ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "subset", ["SBATCH_PLAIN_CHARS", "SBATCH_DIRECTIVE_VALUE_CHARS", "SBATCH_CONSTRAINT_CHARS"]
)
def test_each_field_admits_a_subset_of_what_an_sbatch_line_may_hold(subset):
    rx = re.compile(f"[{getattr(ptypes, subset)}]")
    admitted = [chr(c) for c in range(32, 127) if rx.fullmatch(chr(c))]
    assert admitted
    assert [c for c in admitted if not ptypes.SBATCH_LINE_RE.fullmatch(c)] == []


def test_the_sbatch_filter_uses_the_line_character_set():
    from sbatch_gen import render

    env = render.make_env(render.default_templates_dir())
    ok = "".join(chr(c) for c in range(32, 127) if ptypes.SBATCH_LINE_RE.fullmatch(chr(c)))
    assert env.filters["sbatch"](ok) == ok
    for bad in (" ", "'", '"', "$", ";", "#", "\\"):
        with pytest.raises(Exception, match="unsafe value for an #SBATCH line"):
            env.filters["sbatch"](f"a{bad}b")
