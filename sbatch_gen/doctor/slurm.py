"""``sbatch-gen doctor`` for a ``kind: slurm`` site: the live cluster against the profile and its render.
Torch-free.

Read-only: Slurm is asked with ``scontrol show``, ``sacctmgr show``, ``srun --help`` and ``sbatch
--test-only`` (which schedules nothing). Each check is one small function that returns its rows; the
cluster's answers are fetched once (:mod:`.slurm_facts`) and shared. The node checks are in
:mod:`.slurm_nodes`, account, QOS and preemption in :mod:`.slurm_policy`.
"""

from __future__ import annotations

import difflib
import getpass
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from sbatch_gen import node_program
from sbatch_gen.credentials import inspect_secrets_file
from sbatch_gen.doctor.common import (
    Check,
    CommandMissing,
    Runner,
    error,
    leading_int,
    limit_seconds,
    ok,
    skip,
    warn,
)
from sbatch_gen.doctor.slurm_facts import QueryFailed, SlurmDoctor, SlurmFacts
from sbatch_gen.doctor.slurm_nodes import check_nodes
from sbatch_gen.doctor.slurm_policy import check_account, check_associations, check_preemption
from sbatch_gen.errors import UserError
from sbatch_gen.launch import SLURM, minimum_torch, torchrun_flags_to_check
from sbatch_gen.loader import LoadedSite
from sbatch_gen.profiles.base import CondaEnv, VenvEnv
from sbatch_gen.profiles.slurm import SlurmProfile
from sbatch_gen.profiles.types import slurm_time_seconds
from sbatch_gen.render import Rendered

# Without these the doctor is on the wrong machine: it stops with one line.
CORE_COMMANDS = {"sbatch", "scontrol", "sinfo"}
LOGIN_NODE_HINT = "run doctor on the cluster's login node"

# ---------------------------------------------------------------------------------------------------
# 1. sbatch --test-only of a fresh render

_WOULD_START = re.compile(
    r"Job (\d+) to start at (\S+) using (\d+) processors on nodes? (\S+) in partition (\S+)"
)


def check_test_only(d: SlurmDoctor) -> list[Check]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="sbatch-gen-doctor-") as tmp:
        for r in d.renders:
            name = f"test-only {r.filename}"
            expected = "sbatch --test-only accepts it"
            path = Path(tmp) / r.filename
            path.write_text(r.text)
            res = d.runner(["sbatch", "--test-only", str(path)], cwd=d.cwd)
            m = _WOULD_START.search(res.err + res.out)
            if res.rc == 0 and m:
                found = f"would start {m.group(2)} on {m.group(4)} ({m.group(3)} CPUs)"
                rows.append(ok(name, expected, found))
            elif res.rc == 0:
                rows.append(ok(name, expected, res.message()))
            else:
                rows.append(
                    error(
                        name,
                        expected,
                        res.message(),
                        f"Slurm refuses {r.filename}: {res.message()} (the other rows may say which field)",
                    )
                )
    return rows


# ---------------------------------------------------------------------------------------------------
# 2. the partition and its time limit


def check_partition(d: SlurmDoctor) -> list[Check]:
    expected = f"partition {d.partition} exists, State UP"
    part = d.part()
    if part is None:
        known = sorted(d.facts.partitions())
        close = difflib.get_close_matches(d.partition, known, n=1)
        return [
            error(
                "partition",
                expected,
                f"no partition {d.partition} (there are: {', '.join(known) or 'none'})",
                f"set slurm.partition to one of {', '.join(known) or '(none)'}"
                + (f"; did you mean {close[0]!r}?" if close else ""),
            )
        ]
    state = part.get("State", "?")
    if state.upper() != "UP":
        return [
            error(
                "partition",
                expected,
                f"State={state}",
                f"partition {d.partition} is {state}: jobs queue but do not start (DOWN) or are refused "
                "(DRAIN, INACTIVE); ask the administrators, or use another partition",
            )
        ]
    return [
        ok("partition", expected, f"State=UP, {part.get('TotalNodes', '?')} nodes ({part.get('Nodes', '?')})")
    ]


def check_time(d: SlurmDoctor) -> list[Check]:
    want = slurm_time_seconds(d.profile.slurm.time)
    expected = f"MaxTime >= slurm.time {d.profile.slurm.time} ({want} s)"
    part = d.part()
    if part is None:
        return [skip("time limit", expected, f"no partition {d.partition}")]
    raw = part.get("MaxTime", "UNLIMITED")
    limit = limit_seconds(raw)
    if limit is None:
        return [
            warn("time limit", expected, f"MaxTime={raw}", f"cannot read MaxTime={raw!r}; check it by hand")
        ]
    if limit < want:
        return [
            error(
                "time limit",
                expected,
                f"MaxTime={raw} ({limit:.0f} s)",
                f"partition {d.partition} ends jobs after {raw}: lower slurm.time to at most {raw} "
                "(the job requeues itself and resumes), or use a partition with a longer MaxTime",
            )
        ]
    return [ok("time limit", expected, f"MaxTime={raw}")]


# ---------------------------------------------------------------------------------------------------
# 3. the nodes: slurm_nodes.py; 4. account and QOS: slurm_policy.py

# ---------------------------------------------------------------------------------------------------
# 5. the Slurm version


def version_matches(profile: str, running: str) -> bool:
    """``22.05`` matches 22.05.x; ``22.05.8`` only 22.05.8."""
    return running == profile or running.startswith(profile + ".")


def check_version(d: SlurmDoctor) -> list[Check]:
    want = d.profile.slurm.version
    expected = f"Slurm {want} (slurm.version)"
    running = d.facts.config().get("SLURM_VERSION", "")
    if not running:
        r = d.runner(["scontrol", "version"])
        m = re.search(r"\d+\.\d+(\.\d+)?", r.out)
        running = m.group(0) if r.rc == 0 and m else ""
    if not running:
        return [warn("version", expected, "unknown", "cannot read the Slurm version (scontrol version)")]
    if version_matches(want, running):
        return [ok("version", expected, f"Slurm {running}")]
    major = ".".join(running.split(".")[:2])
    return [
        warn(
            "version",
            expected,
            f"Slurm {running}",
            f"the cluster runs Slurm {running}: set slurm.version to {major!r} and review the render "
            "(the job warns about the mismatch too)",
        )
    ]


# ---------------------------------------------------------------------------------------------------
# 6. preemption: slurm_policy.py

# ---------------------------------------------------------------------------------------------------
# 7. requeue, 8. pyxis


def check_requeue(d: SlurmDoctor) -> list[Check]:
    expected = "requeue allowed (--requeue or JobRequeue=1)"
    job_template = SlurmProfile.OUTPUTS[0][0]  # the training job (the setup job is not requeued)
    main = next(r for r in d.renders if r.template == job_template).text.splitlines()
    asks = "#SBATCH --requeue" in main
    raw = d.facts.config().get("JobRequeue", "?")
    found = f"JobRequeue={raw}; the render {'has' if asks else 'lacks'} #SBATCH --requeue"
    if not asks and leading_int(raw) == 0:
        return [
            error(
                "requeue",
                expected,
                found,
                "the job cannot be requeued (JobRequeue=0 and no --requeue in the render): re-render it",
            )
        ]
    return [ok("requeue", expected, found)]


def check_pyxis(d: SlurmDoctor) -> list[Check]:
    c = d.profile.container
    if c is None:
        return [skip("pyxis", "srun --container-image (container:)", "the profile has no container:")]
    expected = f"srun --container-image (container.image {c.image})"
    try:
        r = d.runner(["srun", "--help"])
    except CommandMissing:
        return [error("pyxis", expected, "srun not found", f"srun is missing: {LOGIN_NODE_HINT}")]
    if "--container-image" in r.out + r.err:
        return [ok("pyxis", expected, "srun --help lists --container-image (pyxis)")]
    return [
        error(
            "pyxis",
            expected,
            "srun has no --container-image",
            "pyxis is not installed for this cluster's srun: ask the administrators for pyxis/enroot, or drop "
            "container: and use a python_env",
        )
    ]


# ---------------------------------------------------------------------------------------------------
# 9. torch: the site's own python, where this host sees it


def _site_python(d: SlurmDoctor) -> tuple[Path | None, str]:
    """The python the job activates, where it can be known from here: (its path, or None; what it is)."""
    env = d.profile.python_env
    if d.profile.container is not None:
        return None, f"the image {d.profile.container.image} (the setup job probes it on a compute node)"
    if isinstance(env, VenvEnv):
        return d.cwd / env.path / "bin" / "python", f"python_env.path {env.path}"
    if isinstance(env, CondaEnv) and env.prefix is not None:
        return d.cwd / env.prefix / "bin" / "python", f"python_env.prefix {env.prefix}"
    if isinstance(env, CondaEnv):
        return None, f"the conda environment {env.name} (python_env.name: only a prefix is looked at)"
    return None, "python from PATH after python_env.modules on a compute node (python_env.kind none)"


def check_torch(d: SlurmDoctor) -> list[Check]:
    need = minimum_torch(d.profile, SLURM)
    expected = (
        f"torch >= {need[0][0]}.{need[0][1]} (torchrun {need[1].split(' (')[0]})"
        if need
        else "torch importable (python_env)"
    )
    python, what = _site_python(d)
    if python is None:
        return [skip("torch", expected, f"not visible from here: {what}; the job's preflight checks it")]
    if not python.exists():
        return [
            skip(
                "torch",
                expected,
                f"no {python} ({what}): not set up yet, or not on this host's filesystem; run the setup "
                "job (out/<site>.setup.sbatch)",
            )
        ]
    r = d.runner([str(python), "-c", node_program.PROBE, "torch"], cwd=d.cwd)
    try:
        probe = json.loads(r.out.strip().splitlines()[-1]) if r.rc == 0 and r.out.strip() else None
    except ValueError:
        probe = None
    if not isinstance(probe, dict):
        return [error("torch", expected, r.message(), f"{python} did not run: {r.message()}")]
    version = probe.get("version")
    if not version:
        return [
            error(
                "torch",
                expected,
                f"{python} cannot import torch",
                "install torch into it (the setup job installs python_env.torch_spec)",
            )
        ]
    flags = torchrun_flags_to_check(d.profile, SLURM)
    protocol = d.profile.trainer.stop_protocol
    lacks = node_program.missing_torchrun_flags(flags, probe, protocol)
    found = f"torch {version} ({python})"
    shimmed = node_program.shimmed_torchrun_flags(flags, probe, protocol)
    if shimmed:
        found += f"; without {', '.join(shimmed)}: torchrun through the compat shim"
    if lacks:
        return [
            error(
                "torch",
                expected,
                found,
                "; ".join(lacks)
                + " (python_env.torch_spec, then the setup job again); see docs/slurm.md#an-older-torch",
            )
        ]
    return [ok("torch", expected, found)]


# ---------------------------------------------------------------------------------------------------
# 10. the secrets file, where this host sees it (the job reads it on its first node)


def check_secrets(d: SlurmDoctor) -> list[Check]:
    named = d.profile.secret_env()
    if not named:
        return [skip("secrets", "-", "the profile names no secret")]
    where = d.profile.slurm.secrets_file
    expected = f"{', '.join(s.name for s in named)} in slurm.secrets_file, mode 0600, yours"
    if where is None:  # only optional ones (a required one needs the file to validate)
        return [skip("secrets", expected, "no slurm.secrets_file: the optional secrets stay unset")]
    f = inspect_secrets_file(where, named, d.cwd)
    path = f.path
    required = [s for s in named if s.required]
    if f.refused == "missing":
        if not required:
            return [warn("secrets", expected, f"no {path}", "the optional secrets stay unset")]
        wanted = ", ".join(f"{s.name} ({s.key})" for s in required)
        return [
            error(
                "secrets", expected, f"no {path}", f"write NAME=value lines for {wanted} into it, chmod 600"
            )
        ]
    refused = {
        "unreadable": (f"cannot read {path}: {f.detail}", "the job reads it as you"),
        "owner": (f"{path} belongs to uid {f.detail}", "the job refuses a file of another user"),
        "mode": (f"{path} is mode {f.mode:o}", f"others may read it: chmod 600 {path}"),
        "line": (f"{path}: line {f.detail} is not NAME=value", "the job stops on it"),
    }
    if f.refused is not None:
        return [error("secrets", expected, *refused[f.refused])]
    names = f.values
    missing = [s for s in named if s.name not in names]
    found = f"{path} (mode {f.mode:o}) has {', '.join(s.name for s in named if s.name in names) or 'none of them'}"
    if [s for s in missing if s.required]:
        names_missing = ", ".join(f"{s.name} ({s.key})" for s in missing if s.required)
        return [error("secrets", expected, found, f"the job stops without {names_missing}: add it to {path}")]
    if missing:
        return [warn("secrets", expected, found, f"{', '.join(s.name for s in missing)} unset: optional")]
    return [ok("secrets", expected, found + " (the job reads it on its first node: the same file there?)")]


# ---------------------------------------------------------------------------------------------------


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no USER/LOGNAME and no passwd entry (a bare container)
        return str(os.getuid())


CHECKS: list[tuple[str, Callable[[SlurmDoctor], list[Check]]]] = [
    ("test-only", check_test_only),
    ("partition", check_partition),
    ("time limit", check_time),
    ("nodes", check_nodes),
    ("account", check_account),
    ("associations", check_associations),
    ("version", check_version),
    ("preemption", check_preemption),
    ("requeue", check_requeue),
    ("pyxis", check_pyxis),
    ("torch", check_torch),
    ("secrets", check_secrets),
]
# the checks that ask this host only (its python_env, its secrets file), not the controller
LOCAL_CHECKS = ("torch", "secrets")


def run_checks(site: LoadedSite, renders: list[Rendered], runner: Runner, cwd: Path) -> list[Check]:
    assert isinstance(site.profile, SlurmProfile)
    d = SlurmDoctor(site, site.profile, renders, SlurmFacts(runner), runner, cwd, _user())
    checks = CHECKS
    rows: list[Check] = []
    try:
        d.facts.config()  # the checks ask slurmctld: when it cannot be reached, one row says so
    except CommandMissing as e:
        raise UserError(f"{e.name} not found: {LOGIN_NODE_HINT}") from None
    except QueryFailed as e:
        rows.append(
            error(
                "controller",
                "scontrol reaches slurmctld",
                e.result.message(),
                f"{e.what} failed: {e.result.message()}; only what this host shows was checked "
                f"({', '.join(LOCAL_CHECKS)}), not what the controller knows: {LOGIN_NODE_HINT}, and check "
                "that it reaches slurmctld (scontrol ping)"
                + (
                    "; where no configuration is found, set SLURM_CONF to the cluster's slurm.conf (a "
                    "configless cluster's hosts find their controller by DNS SRV)"
                    if "configuration source" in e.result.message()
                    else ""
                ),
            )
        )
        checks = [(name, fn) for name, fn in CHECKS if name in LOCAL_CHECKS]
    for name, fn in checks:
        try:
            rows += fn(d)
        except CommandMissing as e:
            if e.name in CORE_COMMANDS:
                raise UserError(f"{e.name} not found: {LOGIN_NODE_HINT}") from None
            rows.append(error(name, "-", f"{e.name} not found", LOGIN_NODE_HINT))
        except QueryFailed as e:
            rows.append(error(name, "-", str(e), f"{e.what} failed: {e.result.message()}"))
    return rows
