"""Cross-region consistency: the sites of one run must agree on everything they share. Torch-free.

Sites whose ``cross_region.enabled`` is true are grouped by ``cross_region.run_id``. Within a group every
site must have the same :meth:`CrossRegion.shared_view` (regions, sync mode, H, outer optimizer,
transport location, ...), its own distinct ``region``, and the ``regions`` list must be exactly the set of
the group's regions. Each problem is reported with both files and the differing field. The version locks
of a run's sites (``python_env.lock_dir``, one per architecture) must pin one torch release.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from sbatch_gen.credentials import config_metrics
from sbatch_gen.errors import UserError
from sbatch_gen.loader import LoadedSite
from sbatch_gen.yamlload import format_path


def _flatten(d: object, prefix: tuple = ()) -> dict[tuple, object]:
    if isinstance(d, dict):
        out: dict[tuple, object] = {}
        for k, v in d.items():
            out.update(_flatten(v, (*prefix, k)))
        return out
    return {prefix: d}


def check_cross_region(sites: Iterable[LoadedSite]) -> list[str]:
    """Return one message per inconsistency (empty when the runs are consistent)."""
    runs: dict[str, list[LoadedSite]] = {}
    for s in sites:
        xr = s.profile.cross_region
        if xr.enabled:
            runs.setdefault(xr.run_id, []).append(s)
    errors: list[str] = []
    for run_id, group in sorted(runs.items()):
        group = sorted(group, key=lambda s: s.name)
        ref = group[0]
        ref_view = _flatten(ref.profile.cross_region.shared_view())
        for other in group[1:]:
            view = _flatten(other.profile.cross_region.shared_view())
            for key in sorted(set(ref_view) | set(view), key=lambda k: [str(x) for x in k]):
                a, b = ref_view.get(key, "(unset)"), view.get(key, "(unset)")
                if a != b:
                    path = ("cross_region", *key)
                    field = format_path(path)
                    errors.append(
                        f"{other.at(*path)}: {field}: {b!r} differs from {a!r} in {ref.at(*path)} "
                        f"(sites {ref.name!r} and {other.name!r} are both in run {run_id!r} and must agree)"
                    )
        # Each site is one region; the regions list is exactly the run's sites' regions.
        by_region: dict[str, LoadedSite] = {}
        for s in group:
            r = s.profile.cross_region.region
            if r in by_region:
                errors.append(
                    f"{s.at('cross_region', 'region')}: cross_region.region: {r!r} is also the region of "
                    f"{by_region[r].at('cross_region', 'region')} (run {run_id!r}): each site is one region"
                )
            by_region.setdefault(r, s)
        # (A site whose list differs from the first one's is already reported above.)
        for s in group[:1]:
            listed = set(s.profile.cross_region.regions)
            have = set(by_region)
            if listed != have:
                missing = sorted(listed - have)
                extra = sorted(have - listed)
                parts = []
                if missing:
                    parts.append(f"no site of run {run_id!r} has region {', '.join(map(repr, missing))}")
                if extra:
                    where = ", ".join(f"{by_region[r].at('cross_region', 'region')}" for r in extra)
                    parts.append(f"region {', '.join(map(repr, extra))} ({where}) is not listed")
                errors.append(
                    f"{s.at('cross_region', 'regions')}: cross_region.regions: {sorted(listed)} does not match "
                    f"the regions of run {run_id!r}'s sites {sorted(have)}: {'; '.join(parts)}"
                )
        errors += check_locks(group, run_id)
    return list(dict.fromkeys(errors))


_TORCH_PIN = re.compile(r"torch==([0-9][^+\s;#]*)")


def check_locks(group: list[LoadedSite], run_id: str, root: Path = Path(".")) -> list[str]:
    """The locks of one run's sites (python_env.lock_dir/<arch>.txt under ``root``, the submit directory;
    those that exist) pin one torch release: regions on other architectures install other wheels, never
    another release (a local version such as +cu128 is the build, not the release)."""
    dirs = {d for s in group if (d := s.profile.python_env.lock_dir) is not None and (root / d).is_dir()}
    pins: dict[str, str] = {}  # release -> file:line
    for lock in sorted(lock for d in dirs for lock in (root / d).glob("*.txt")):
        for n, line in enumerate(lock.read_text(errors="replace").splitlines(), 1):
            m = _TORCH_PIN.match(line.strip())
            if m:
                pins.setdefault(m.group(1), f"{lock.relative_to(root)}:{n}")
    if len(pins) < 2:
        return []
    said = ", ".join(f"{where}: torch=={v}" for v, where in sorted(pins.items()))
    return [
        f"the version locks of run {run_id!r} pin {len(pins)} torch releases: {said}; every region must "
        "train with one (python_env.lock_dir: set the regions up again with one torch_spec, then commit the locks)"
    ]


_TORCH_SPEC_PIN = re.compile(r"torch(?:\[[^\]]*\])?(?:==|===|~=|<=?)\s*([0-9][^,\s]*)")


def check_torch_minimum(sites: Iterable[LoadedSite], root: Path = Path(".")) -> list[str]:
    """The torch a site is pinned to (its ``python_env.torch_spec`` when it caps or pins a release, and the
    lock files of ``python_env.lock_dir`` under ``root``), against the oldest torch whose torchrun takes
    every flag its render gives torchrun (:func:`sbatch_gen.launch.minimum_torch`): the job's preflight
    would fail on every node, after the queue wait. One message per site and lock."""
    from sbatch_gen.launch import LAUNCHERS, minimum_torch, torch_release

    errors = []
    for s in sites:
        p = s.profile
        need = minimum_torch(p, LAUNCHERS[p.kind])
        if need is None:
            continue
        (major, minor), why = need
        pins: list[tuple[str, str]] = []  # (where, version)
        m = _TORCH_SPEC_PIN.match(p.python_env.torch_spec.replace(" ", ""))
        if m:
            pins.append((f"{s.at('python_env', 'torch_spec')}: python_env.torch_spec", m.group(1)))
        lock_dir = p.python_env.lock_dir
        if lock_dir is not None and (root / lock_dir).is_dir():
            for lock in sorted((root / lock_dir).glob("*.txt")):
                for n, line in enumerate(lock.read_text(errors="replace").splitlines(), 1):
                    if lm := _TORCH_PIN.match(line.strip()):
                        pins.append((f"{lock.relative_to(root)}:{n}: python_env.lock_dir", lm.group(1)))
        for where, version in pins:
            release = torch_release(version)
            if release is not None and release < (major, minor):
                errors.append(
                    f"{where}: torch {version} for site {s.name!r}, whose render gives torchrun {why}: that "
                    f"flag needs torch >= {major}.{minor}, and the preflight would fail every node after the "
                    f"queue wait; install torch >= {major}.{minor} (python_env.torch_spec, then set the site up "
                    "again), or see docs/slurm.md#an-older-torch"
                )
    return errors


def check_trainer_files(sites: Iterable[LoadedSite], root: Path = Path(".")) -> list[str]:
    """Warnings for a ``trainer.config`` or ``trainer.script`` that is not a file here (relative paths: from
    ``root``, the directory the job is submitted from, as the job resolves them), each at its field's line.

    Warnings, not errors: the job's preflight checks both on every node, the file may be written between
    ``validate`` and ``sbatch`` (a profile from ``init`` names its train config before it exists), and an
    absolute path may lie on a cluster filesystem this machine does not see. But a relative path lies in the
    checkout, where its absence is almost always a typo that the preflight would find only after the queue
    wait: so it is said here, at the field's line."""
    notes = []
    for s in sites:
        trainer = s.profile.trainer
        for field, value in (("script", trainer.script), ("config", trainer.config)):
            if value is None or (root / value).is_file():
                continue
            path = Path(value)
            found = "is not a file" if (root / value).exists() else "does not exist"
            if path.is_absolute():
                why = (
                    f"{found} on this machine: the job's preflight fails on every node unless it is there "
                    "(on a filesystem the nodes see)"
                )
            else:
                why = (
                    f"{found} here (a relative path is read from the directory the job is submitted from; "
                    "validate takes that to be this one): the job's preflight would fail on every node, after "
                    "the queue wait"
                )
            more = ""
            if field == "config" and s.profile.cross_region.enabled and trainer.args is None:
                more = "; the cross-region settings are not checked against it"
            if field == "config" and s.profile.SECRETS_FROM_CONFIG and config_metrics(s.profile, root):
                more += (
                    "; a W&B key its metrics section names is not sent to the hosts (the render reads the "
                    "section from it): name the key in the profile's metrics section"
                )
            notes.append(f"{s.at('trainer', field)}: warning: trainer.{field}: {value!r} {why}{more}")
    return list(dict.fromkeys(notes))


def check_config_secrets(sites: Iterable[LoadedSite], root: Path = Path(".")) -> list[str]:
    """Warnings for a Slurm site whose train config's metrics section (where it decides the sinks:
    credentials.config_metrics) names a W&B key the job does not read: a Slurm job reads on the node the
    secrets the profile names (slurm.secrets_file), and its #SBATCH --export leaves the submitting shell's
    out. (The SSH launcher sends that key: its render reads the section.)"""
    notes = []
    for s in sites:
        p = s.profile
        cm = None if p.SECRETS_FROM_CONFIG else config_metrics(p, root)
        m = cm.metrics if cm is not None else None
        if cm is None or m is None or "wandb" not in m.sinks or m.wandb_mode == "offline":
            continue
        named = {x.name for x in getattr(p, "secret_env", lambda: [])()}
        if m.wandb_api_key_env in named:
            continue
        notes.append(
            f"{s.at('trainer', 'config')}: warning: trainer.config: {cm.path!r} sends metrics to W&B with the "
            f"key in {m.wandb_api_key_env} (its metrics.wandb_api_key_env), which the job does not read: it "
            "reads the secrets the profile names from slurm.secrets_file, and takes none from the submitting "
            f"shell; name {m.wandb_api_key_env} in slurm.secrets, or move the section into the profile's metrics"
        )
    return list(dict.fromkeys(notes))


def check_train_configs(sites: Iterable[LoadedSite]) -> tuple[list[str], list[str]]:
    """Cross-check each cross-region site against its train config (``trainer.config``), where that file
    is readable from here (relative paths: from the current directory, as at submit time).

    Returns (errors, notes). Errors: bad train config, cross-region settings that do not fit it
    (grad mode: ``keep_rounds`` shorter than the rounds between checkpoints; DiLoCo: ``snapshot_every``
    beyond the run's rounds), or a model whose parameter names and shapes differ from another site's of the
    same run (:func:`_same_models`). Notes: warnings. A config not found here is skipped (not cross-checked:
    :func:`check_trainer_files` warns of it). The trainer repeats the per-site checks at start-up, so nothing
    depends on running this.
    """
    from pathlib import Path

    from sbatch_gen.train.config import load_config, xr_problems  # torch-free
    from sbatch_gen.train.shapes import parameter_shapes  # torch-free
    from sbatch_gen.xr_options import ignored_field_warnings, outer_step_warnings

    errors: list[str] = []
    notes: list[str] = []
    models: dict[str, list[_Model]] = {}  # run id -> its sites' models, where their train config was read
    for s in sites:
        xr = s.profile.cross_region
        if not xr.enabled:
            continue
        trainer = s.profile.trainer
        # (with a train config read below, xr_problems repeats these: reported once)
        notes += [f"{s.at('cross_region', f)}: warning: {m}" for f, m in outer_step_warnings(xr)]
        notes += [f"{s.at('cross_region', f)}: warning: {m}" for f, m in ignored_field_warnings(xr)]
        if trainer.args is not None or trainer.config is None:
            # a command line of its own (trainer.args): its config need not be this trainer's
            notes.append(
                f"{s.at('trainer', 'args')}: trainer.args is set: the train config is not cross-checked"
            )
            continue
        cfg_path = Path(trainer.config)
        where = s.at("trainer", "config")
        if not cfg_path.is_file():  # check_trainer_files warns, saying it is not cross-checked
            continue
        try:
            cfg = load_config(cfg_path)
        except UserError as e:
            errors += [
                f"{where}: trainer.config {str(cfg_path)!r} does not validate: {m}" for m in e.messages
            ]
            continue
        models.setdefault(xr.run_id, []).append(_Model(s, str(cfg_path), parameter_shapes(cfg.model)))
        errs, warns = xr_problems(cfg, xr, config_name=str(cfg_path))
        # Each message points at the line that sets its field (the `cross_region:` section when the field
        # is left at its default). Sites sharing a base file get the same line: reported once.
        errors += [f"{s.at('cross_region', m.field)}: {m}" for m in errs]
        notes += [f"{s.at('cross_region', m.field)}: warning: {m}" for m in warns]
    errors += [e for run_id, group in sorted(models.items()) for e in _same_models(run_id, group)]
    return list(dict.fromkeys(errors)), list(dict.fromkeys(notes))


class _Model(NamedTuple):
    """A site's model, from its train config: ``(name, shape)`` of each parameter, in order."""

    site: LoadedSite
    config: str
    params: list[tuple[str, tuple[int, ...]]]


def _same_models(run_id: str, group: list[_Model]) -> list[str]:
    """The sites of run ``run_id`` train the same parameters (names and shapes, in order: the flat vector
    their regions exchange), whatever their parallelism (DDP or FSDP, any world size): one message per site
    whose model differs from the first site's (in name order), at the first parameter that differs."""
    ref, *others = sorted(group, key=lambda m: m.site.name)
    errors = []
    for m in others:
        if m.params == ref.params:
            continue
        pairs = zip(m.params, ref.params, strict=False)
        i = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(m.params), len(ref.params)))
        errors.append(
            f"{m.site.at('trainer', 'config')}: trainer.config: {m.config!r} has {_param(m, i)}, where "
            f"{ref.config!r} ({ref.site.at('trainer', 'config')}, site {ref.site.name!r}) has "
            f"{_param(ref, i)}: the regions of run {run_id!r} must train the same parameters (their "
            "parallelism may differ)"
        )
    return errors


def _param(m: _Model, i: int) -> str:
    if i >= len(m.params):
        return f"no parameter {i} (it has {len(m.params)})"
    name, shape = m.params[i]
    return f"parameter {i} {name} of shape {list(shape)}"
