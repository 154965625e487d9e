"""The ``sbatch-gen`` command line. Torch-free: it must never import torch, directly or indirectly.

Exit status: 0 ok, 1 drift found by ``check``/``diff``, a mailbox ``status`` cannot read, an error row of
``doctor``, or an I/O error while ``render`` writes (then nothing was changed) or ``check`` reads out/, 2 bad
input (profile, override, usage, an --out that cannot take the files: a file, under a file, not writable, an
output path that is a directory; ``doctor`` away from the cluster: no sbatch/scontrol).
Errors go to stderr as ``file:line: field: message`` (or ``path: message``), one line, without a traceback;
click's own (a bad flag value, an unknown option) too: ``init --nodes: 0 is not in the range x>=1 (see
sbatch-gen init --help)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import click
import yaml

from sbatch_gen import __version__
from sbatch_gen.consistency import (
    check_config_secrets,
    check_cross_region,
    check_torch_minimum,
    check_train_configs,
    check_trainer_files,
)
from sbatch_gen.errors import UserError, clean_message
from sbatch_gen.fsutil import display_path
from sbatch_gen.loader import LoadedSite, list_sites, load_site
from sbatch_gen.profiles import PROFILE_KINDS
from sbatch_gen.render import (
    LIBRARIES,
    NODE_PROGRAM_FILE,
    OutputError,
    Rendered,
    check_out_dir,
    library,
    node_program,
    other_templates_note,
    render_site,
    write_outputs,
)
from sbatch_gen.rendiff import FileChange, grouped_diff

EXIT_DRIFT = 1
EXIT_IO = 1  # `render`: an output file could not be written (nothing was changed); `check`: out/ unreadable
EXIT_STORE = 1  # `status`: the mailbox could not be read
EXIT_DOCTOR = 1  # `doctor`: a check found an error
EXIT_BAD_INPUT = 2


def _click_error_line(e: click.ClickException) -> str:
    """click's own error (a bad option value, an unknown option or command, a missing option: click prints
    them in three lines) as one line like every other: ``init --nodes: 0 is not in the range x>=1 (see
    sbatch-gen init --help)``."""
    msg = e.format_message()
    ctx = getattr(e, "ctx", None)
    if ctx is None:
        return msg.rstrip(".")
    command = ctx.command_path.partition(" ")[2]  # "init" of "sbatch-gen init"; "" for sbatch-gen itself
    where = command
    param = getattr(e, "param", None)
    if type(e) is click.BadParameter and param is not None and e.message:  # (not MissingParameter)
        # the flag as typed, then click's message (which names the value): not "Invalid value for '--x'"
        flag = max(param.opts, key=len) if isinstance(param, click.Option) else param.human_readable_name
        where, msg = f"{command} {flag}".strip(), e.message
    # (not ctx.command_path: a test runner names the program its own way)
    help_of = f"sbatch-gen {command}".strip()
    return f"{where + ': ' if where else ''}{msg.rstrip('.')} (see {help_of} --help)"


# click >= 8.2 answers `sbatch-gen` without arguments with the help, through an error of its own (8.1: none)
_HELP_FOR_NO_ARGS: type[Exception] | tuple[()] = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _Group(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except _HELP_FOR_NO_ARGS:  # plain `sbatch-gen`: the help, as click prints it
            raise
        except click.ClickException as e:  # sbatch-gen's own options: one line too
            click.echo(f"sbatch-gen: {clean_message(_click_error_line(e))}", err=True)
            raise click.exceptions.Exit(e.exit_code) from None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as e:
            for m in e.messages:
                click.echo(f"sbatch-gen: {m}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except OutputError as e:  # render/check/diff: out/ cannot be written or read
            click.echo(f"sbatch-gen: {e}", err=True)
            ctx.exit(EXIT_BAD_INPUT if e.bad_destination else EXIT_IO)
        except click.ClickException as e:  # a command's flags, as click parses them, and its usage errors
            click.echo(f"sbatch-gen: {clean_message(_click_error_line(e))}", err=True)
            ctx.exit(e.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="sbatch-gen", message="%(prog)s %(version)s")
def cli() -> None:
    """Render Slurm job scripts for (cross-region) training from site profiles in sites/*.yaml.

    Workflow: edit a profile, `sbatch-gen render --site NAME`, review `git diff out/`, commit;
    CI runs `sbatch-gen validate` and `sbatch-gen check`.
    """


def _sites_dir_option(f: Callable) -> Callable:
    return click.option(
        "--sites-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("sites"),
        show_default=True,
        help="Directory with the site profiles (<name>.yaml).",
    )(f)


def _templates_option(f: Callable) -> Callable:
    return click.option(
        "--templates-dir",
        type=click.Path(file_okay=False, exists=True, path_type=Path),
        default=None,
        help="Jinja templates (default: those of the sbatch-gen that runs: templates/ of the checkout it was "
        "installed from, or the copy inside the installed package; never the working directory's unasked).",
    )(f)


def _out_option(f: Callable) -> Callable:
    return click.option(
        # Not checked by click (its error is three lines): render/check/diff check it and say so in one line.
        "--out",
        "out_dir",
        type=click.Path(readable=False, path_type=Path),
        default=Path("out"),
        show_default=True,
        help="Directory of the rendered scripts.",
    )(f)


def _set_option(f: Callable) -> Callable:
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override a profile value, e.g. --set slurm.partition=debug (repeatable; VALUE is YAML).",
    )(f)


def _load_many(
    sites_dir: Path, names: Iterable[str], overrides: Iterable[str] = (), cross_region: bool = False
) -> list[LoadedSite]:
    """Load sites (and check cross-region consistency among those that load), collecting every
    problem before failing."""
    loaded, errors = [], []
    for n in names:
        try:
            loaded.append(load_site(sites_dir, n, overrides))
        except UserError as e:
            errors += e.messages
    if cross_region and not errors:  # (with a site missing, its run would look incomplete)
        errors += check_cross_region(loaded)
    if errors:
        raise UserError(errors)
    return loaded


def _site_checks(loaded: list[LoadedSite], run_sites: list[LoadedSite], files: bool = True) -> list[str]:
    """What ``validate`` checks beyond each profile (``render`` checks the same for the sites it renders):
    each cross-region site against its train config, the sites of a run (``run_sites``: ``loaded`` and, for
    validate --site, the other sites of their runs) against each other's models, the torch a render needs;
    raises :class:`UserError` with every error. Returns the notes (warnings), in the order they are printed;
    ``files``: with validate's notes on the trainer's files as this directory holds them (render, which may
    run elsewhere than the jobs are submitted from, leaves those to validate)."""
    errors, notes = check_train_configs(run_sites)
    errors += check_torch_minimum(loaded)
    if errors:
        raise UserError(errors)
    here = [*check_trainer_files(run_sites), *check_config_secrets(loaded)] if files else []
    return [*_profile_notes(loaded), *here, *notes]


def _profile_notes(loaded: Iterable[LoadedSite]) -> list[str]:
    """The profiles' warnings (:meth:`ProfileBase.warnings`), each at its field's line; a line that several
    sites share (a base) once."""
    notes = [
        clean_message(f"{s.at(*path)}: warning: {msg}") for s in loaded for path, msg in s.profile.warnings()
    ]
    return list(dict.fromkeys(notes))


def _run_partners(sites_dir: Path, loaded: list[LoadedSite]) -> list[LoadedSite]:
    """The other sites of sites_dir in the cross-region runs of ``loaded``. A site that does not load is
    left out, unless a run then lacks a region: its errors say why (the check would only say the region is
    missing)."""
    runs = {s.profile.cross_region.run_id for s in loaded if s.profile.cross_region.enabled}
    if not runs:
        return []
    have = {s.name for s in loaded}
    partners, broken = [], []
    for n in list_sites(sites_dir):
        if n in have:
            continue
        try:
            site = load_site(sites_dir, n, ())
        except UserError as e:
            broken += e.messages
            continue
        if site.profile.cross_region.enabled and site.profile.cross_region.run_id in runs:
            partners.append(site)
    if broken:
        regions = {
            s.profile.cross_region.region for s in [*loaded, *partners] if s.profile.cross_region.enabled
        }
        listed = {r for s in loaded for r in s.profile.cross_region.regions if s.profile.cross_region.enabled}
        if listed - regions:
            raise UserError(broken)
    return partners


def _select(sites_dir: Path, names: tuple[str, ...], all_: bool, required: bool = True) -> list[str]:
    if names and all_:
        raise click.UsageError("give --site NAME or --all, not both")
    if all_ or (not names and not required):
        return list_sites(sites_dir)
    if not names:
        raise click.UsageError("give --site NAME (repeatable) or --all")
    return list(names)


def _render_all(loaded: list[LoadedSite], templates_dir: Path | None) -> list[tuple[LoadedSite, Rendered]]:
    """Every site's files, then the node program once when a render runs it (it goes beside them). With the
    default templates, a note when the working directory has other ones (:func:`other_templates_note`)."""
    if templates_dir is None and (note := other_templates_note()) is not None:
        click.echo(note, err=True)
    pairs = [(s, r) for s in loaded for r in render_site(s, templates_dir)]
    users = [s for s, r in pairs if r.uses_node_program]
    if users:
        pairs.append((users[0], node_program()))
    for name in LIBRARIES:
        users = [s for s, r in pairs if name in r.libraries]
        if users:
            pairs.append((users[0], library(name, templates_dir)))
    return pairs


def _output_suffixes() -> list[str]:
    """The endings of the files render writes (what check and diff --against look at)."""
    kinds = {pat.replace("{site}", "") for cls in PROFILE_KINDS.values() for _, pat in cls.OUTPUTS}
    return sorted(kinds | {NODE_PROGRAM_FILE, *LIBRARIES})


def _read_output(path: Path) -> str | None:
    """An output file's text for comparison (None if there is no file; bytes that are not UTF-8 replaced,
    so they differ from any render)."""
    try:
        return path.read_bytes().decode("utf-8", errors="replace") if path.is_file() else None
    except OSError as e:
        raise OutputError(
            f"{display_path(path)}: cannot read: {e.strerror or e}", bad_destination=False
        ) from None


def _drift(pairs: list[tuple[LoadedSite, Rendered]], out_dir: Path, stale_check: bool) -> list[FileChange]:
    """The files of out_dir that differ from a fresh render (and, with stale_check, those no site renders)."""
    check_out_dir(out_dir, writing=False)
    diffs = []
    expected = set()
    for _, r in pairs:
        path = out_dir / r.filename
        expected.add(r.filename)
        old = _read_output(path)
        if old != r.text:
            diffs.append(FileChange(display_path(path), old, r.text))
    if stale_check and out_dir.is_dir():
        suffixes = _output_suffixes()
        for f in sorted(out_dir.iterdir()):
            if f.is_file() and f.name not in expected and any(f.name.endswith(s) for s in suffixes):
                note = "no site renders this file any more (delete it)"
                diffs.append(FileChange(display_path(f), _read_output(f), None, note))
    return diffs


def _git_renders(rev: str, dirs: tuple[Path, ...]) -> list[FileChange]:
    """The rendered files under dirs as committed at git revision rev against the working tree's."""
    suffixes = _output_suffixes()
    try:
        listed = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", "--full-name", rev, "--", *map(str, dirs)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines() or ["git failed"]
        raise UserError([f"--against {rev}: git cannot list it: {detail[-1]}"]) from None
    names = {Path(os.path.relpath(Path(top, n))).as_posix() for n in listed}
    names |= {f.as_posix() for d in dirs if d.is_dir() for f in sorted(d.iterdir()) if f.is_file()}
    changes = []
    for name in sorted(n for n in names if any(n.endswith(s) for s in suffixes)):
        shown = subprocess.run(["git", "show", f"{rev}:./{name}"], capture_output=True, check=False)
        old = shown.stdout.decode("utf-8", errors="replace") if shown.returncode == 0 else None
        new = _read_output(Path(name))
        if old != new:
            changes.append(FileChange(name, old, new))
    return changes


@cli.command()
@click.option("--site", "names", multiple=True, metavar="NAME", help="Site to render (repeatable).")
@click.option("--all", "all_", is_flag=True, help="Render every site in the sites directory.")
@_out_option
@_set_option
@_sites_dir_option
@_templates_option
def render(names, all_, out_dir, overrides, sites_dir, templates_dir) -> None:
    """Validate profiles and write out/<site>.sbatch and out/<site>.setup.sbatch (atomically, mode 0755).

    The profiles are checked as `validate` checks them (their train configs and the torch they need; with
    --all, the sites of each run against each other): an error writes nothing, a warning is printed (the
    trainer's files as this directory holds them: `validate` only).

    Beside them, once, out/sbatch-gen-node.py: the node program the renders' preflight runs, and
    out/sbatch-gen-job.sh: the Slurm training scripts' job library, which they source (they pin both by
    sha256).

    All or nothing: every site is rendered and every destination checked before a file is written; if
    anything fails, out/ is left as it was (exit 2: --out cannot take the files; exit 1: an I/O error).

    \b
    sbatch-gen render --site eu
    sbatch-gen render --all
    sbatch-gen render --site local --set slurm.partition=debug --set paths.run_dir=runs/t1 --out /tmp/r
    """
    selected = _select(sites_dir, names, all_)
    loaded = _load_many(sites_dir, selected, overrides, cross_region=all_)
    # validate's checks of these sites: an error writes nothing
    notes = _site_checks(loaded, loaded, files=False)
    pairs = _render_all(loaded, templates_dir)
    for n in notes:
        click.echo(f"note {n}", err=True)
    written = write_outputs(out_dir, [(r.filename, r.text) for _, r in pairs])
    for path, unchanged in written:
        click.echo(f"{'unchanged' if unchanged else 'wrote'} {display_path(path)}")


@cli.command()
@_out_option
@_sites_dir_option
@_templates_option
def check(out_dir, sites_dir, templates_dir) -> None:
    """Exit 1 with a unified diff if any file in out/ differs from a fresh render (CI runs it through `make check`).

    A hunk that several files carry (a template change) is printed once, with the files that carry it.

    \b
    sbatch-gen check
    """
    loaded = _load_many(sites_dir, list_sites(sites_dir))
    pairs = _render_all(loaded, templates_dir)
    diffs = _drift(pairs, out_dir, stale_check=True)
    if diffs:
        click.echo(grouped_diff(diffs), nl=False)
        click.echo(
            f"sbatch-gen: {len(diffs)} file(s) in {display_path(out_dir)} differ from a fresh render; "
            "run `sbatch-gen render --all` and review the diff",
            err=True,
        )
        sys.exit(EXIT_DRIFT)
    click.echo(f"{display_path(out_dir)} is up to date ({len(pairs)} files from {len(loaded)} sites)")


@cli.command()
@click.option("--site", "names", multiple=True, metavar="NAME", help="Site (repeatable).")
@click.option("--all", "all_", is_flag=True, help="Every site in the sites directory.")
@click.option(
    "--against",
    metavar="GIT-REV",
    help="Compare the renders committed at GIT-REV with the working tree's files (no rendering).",
)
@click.argument("dirs", nargs=-1, type=click.Path(path_type=Path))
@_out_option
@_set_option
@_sites_dir_option
@_templates_option
def diff(names, all_, against, dirs, out_dir, overrides, sites_dir, templates_dir) -> None:
    """Show what `render` would change (exit 1 if anything differs).

    A hunk that several files carry (a template change) is printed once, with the files that carry it;
    then each file's own hunks. With --against, the renders in DIRS (default: out) as committed at GIT-REV
    against the files in the working tree: a pull request's render changes, each shared one once.

    \b
    sbatch-gen diff --site eu
    sbatch-gen diff --all
    sbatch-gen diff --against origin/main out examples/out
    """
    if against is not None:
        if names or all_ or overrides:
            raise click.UsageError("--against compares committed files: no --site, --all or --set")
        changes = _git_renders(against, dirs or (out_dir,))
        if changes:
            click.echo(grouped_diff(changes), nl=False)
            sys.exit(EXIT_DRIFT)
        click.echo(f"no changes against {against} in {', '.join(str(d) for d in dirs or (out_dir,))}")
        return
    if dirs:
        raise click.UsageError("DIRS go with --against; the renders of --site/--all are compared with --out")
    selected = _select(sites_dir, names, all_)
    loaded = _load_many(sites_dir, selected, overrides)
    diffs = _drift(_render_all(loaded, templates_dir), out_dir, stale_check=False)
    if diffs:
        click.echo(grouped_diff(diffs), nl=False)
        sys.exit(EXIT_DRIFT)
    click.echo(f"no changes for {'every site' if all_ else ', '.join(names)}")


@cli.command()
@click.option("--site", "names", multiple=True, metavar="NAME", help="Only these sites (default: all).")
@_set_option
@_sites_dir_option
def validate(names, overrides, sites_dir) -> None:
    """Validate every profile, then check that the sites of each cross-region run agree.

    --set applies to the sites validated, as render's does to the sites it renders (with --site, the other
    sites of a run are read as they are, for the agreement check).

    \b
    sbatch-gen validate
    sbatch-gen validate --site eu --set slurm.partition=h200-long
    """
    selected = _select(sites_dir, names, False, required=False)
    loaded = _load_many(sites_dir, selected, overrides, cross_region=not names)
    run_sites = loaded
    if names:  # the other sites of the same runs are read too: a run's sites must agree
        run_sites = [*loaded, *_run_partners(sites_dir, loaded)]
        if problems := check_cross_region(run_sites):
            raise UserError(problems)
    for n in _site_checks(loaded, run_sites):
        click.echo(f"note {n}", err=True)
    runs: dict[str, list[str]] = {}
    for s in run_sites:
        if s.profile.cross_region.enabled:
            runs.setdefault(s.profile.cross_region.run_id, []).append(s.name)
    for s in loaded:
        click.echo(f"ok  {s.display}")
    for run_id, members in sorted(runs.items()):
        click.echo(f"ok  cross-region run {run_id!r}: {', '.join(members)} agree")


def _slurm_version_here() -> tuple[str | None, str]:
    """MAJOR.MINOR of this host's Slurm (``scontrol --version``), or None and why: scontrol is missing, or it
    failed (its last line: without a configuration, as on a host outside the cluster, even --version fails)."""
    try:
        r = subprocess.run(["scontrol", "--version"], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        return None, "no scontrol on PATH here"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"scontrol --version did not run: {e}"
    parts = r.stdout.split()
    if r.returncode == 0 and len(parts) == 2 and parts[0] == "slurm":
        return ".".join(parts[-1].split(".")[:2]), ""
    said = (r.stderr.strip() or r.stdout.strip()).splitlines()
    return (
        None,
        f"scontrol --version gave none here: {said[-1][:200]}"
        if said
        else "scontrol --version gave none here",
    )


@cli.command()
@click.option("--site", "name", required=True, metavar="NAME", help="Name of the new site (sites/NAME.yaml).")
@click.option("--kind", type=click.Choice(["slurm", "ssh"]), default="slurm", show_default=True)
@click.option("--partition", help="slurm: the partition.")
@click.option("--account", help="slurm: the account (unset: your default).")
@click.option("--slurm-version", help="slurm: MAJOR.MINOR (default: this host's scontrol --version).")
@click.option("--nodes", type=click.IntRange(1), help="slurm: nodes per job.")
@click.option(
    "--host", "hosts", multiple=True, metavar="HOST", help="ssh: a host, in node-rank order (repeat)."
)
@click.option("--ifname", "socket_ifname", help="The network interface between the nodes (ssh: required).")
@click.option("--gpus-per-node", type=click.IntRange(0), help="GPUs of each node (0: CPU only).")
@click.option("--cpus-per-task", type=click.IntRange(1), help="CPUs of each node for the job.")
@click.option("--time", help="slurm: the time limit (e.g. 2-00:00:00).")
@click.option("--script", help="Your trainer script (else the companion trainer, sbatch_gen.train).")
@click.option("--module", help="Your trainer module, run as `torchrun -m MODULE`.")
@click.option("--config", help="The train config passed as --config (default configs/demo.yaml).")
@click.option("--run-dir", help="Where checkpoints and logs go (default runs/NAME).")
@_sites_dir_option
def init(name, kind, sites_dir, hosts, **given) -> None:
    """Write a first site profile, sites/NAME.yaml, commented from the schema and validated.

    Values come from the flags; what the kind needs and no flag gives is asked for on a terminal (else
    each missing flag is named). An existing profile is never overwritten.

    \b
    sbatch-gen init --site mycluster --partition gpu --nodes 2 --gpus-per-node 8 --cpus-per-task 96 --time 1-00:00:00
    sbatch-gen init --site vms --kind ssh --host vm1 --host vm2 --ifname eth0 --gpus-per-node 8 --cpus-per-task 64
    """
    from sbatch_gen import init_profile

    answers = init_profile.Answers(kind=kind, hosts=tuple(hosts), **given)
    no_version = ""
    if kind == "slurm" and not given["slurm_version"]:
        answers.slurm_version, no_version = _slurm_version_here()
        answers.origin["slurm_version"] = "scontrol"
    lacking = init_profile.missing(answers)
    if lacking and sys.stdin.isatty():
        # an answer has its flag's type: a bad number (--nodes 0) is asked again, as click asks
        types = {p.name: p.type for p in click.get_current_context().command.params}
        for field, _ in lacking:
            asked = init_profile.question(field)
            if field == "hosts":
                answers.hosts = tuple(click.prompt(asked).split())
            else:
                setattr(answers, field, click.prompt(asked, type=types.get(field, click.STRING)))
            answers.origin[field] = "question"
        lacking = init_profile.missing(answers)
    if lacking:
        why = {"--slurm-version": f" ({no_version}; run init on the login node, or give it)"}
        raise UserError([f"init --kind {kind}: {flag} is required{why.get(flag, '')}" for _, flag in lacking])
    path = init_profile.write(sites_dir, name, answers)
    click.echo(
        f"wrote {display_path(path)}: check it with `sbatch-gen validate --site {name}`, then render it"
    )


@cli.command()
@click.option("--site", "name", required=True, metavar="NAME", help="Site to show.")
@_set_option
@_sites_dir_option
def show(name, overrides, sites_dir) -> None:
    """Print the resolved profile (extends: merged, overrides and defaults applied) as YAML.

    \b
    sbatch-gen show --site us
    """
    site = load_site(sites_dir, name, overrides)
    data = site.profile.model_dump(mode="json")
    chain = ", ".join(display_path(f) for f in site.files)
    click.echo(f"# site {name}: resolved from {chain}" + "".join(f" --set {o}" for o in overrides))
    click.echo(yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True), nl=False)


@cli.command()
@click.option(
    "--kind",
    type=click.Choice(sorted(PROFILE_KINDS)),
    default=None,
    help="Only this kind (default: all kinds, discriminated by `kind`).",
)
def schema(kind) -> None:
    """Print the JSON schema of a site profile (for editor completion and validation).

    \b
    sbatch-gen schema > profile.schema.json
    """
    from pydantic import Field, TypeAdapter

    if kind is not None or len(PROFILE_KINDS) == 1:
        model = PROFILE_KINDS[kind or next(iter(PROFILE_KINDS))]
        doc = model.model_json_schema()
    else:
        from typing import Annotated, Any, Union

        # Every registered kind, told apart by `kind`: a type built at run time from the registry.
        union: Any = Union[tuple(PROFILE_KINDS.values())]  # noqa: UP007
        any_kind: Any = Annotated[union, Field(discriminator="kind")]
        doc = TypeAdapter(any_kind).json_schema()
    extends = {
        "description": "Base profile file(s), relative to this file, merged first (mappings merge; "
        "other values replace).",
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
    }
    targets = (
        [doc]
        if "properties" in doc
        else [
            d
            for d in doc.get("$defs", {}).values()
            if d.get("title") in {c.__name__ for c in PROFILE_KINDS.values()}
        ]
    )
    for t in targets:
        t.setdefault("properties", {})["extends"] = extends
    doc.setdefault("title", "sbatch-gen site profile")
    click.echo(json.dumps(doc, indent=2, sort_keys=False))


@cli.command("sites")
@_sites_dir_option
def sites_cmd(sites_dir) -> None:
    """List the site profiles.

    \b
    sbatch-gen sites
    """
    for name in list_sites(sites_dir):
        try:
            p = load_site(sites_dir, name).profile
        except UserError as e:
            click.echo(f"{name:12} invalid: {e.messages[0]}")
            continue
        xr = p.cross_region
        region = f"region {xr.region} of run {xr.run_id}" if xr.enabled else "single region"
        click.echo(f"{name:12} {p.kind:6} {p.summary():22} {region}")


@cli.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Report directory (default: RUN_DIR/report, or report/ in the run dirs' common parent).",
)
def report(run_dirs, out_dir) -> None:
    """Write a Markdown run report with PNG plots from trainer run directories (one per region).

    \b
    sbatch-gen report runs/demo/eu runs/demo/us --out runs/demo/report
    """
    from sbatch_gen.report import ReportError, write_report  # lazy: matplotlib only for this command

    try:
        path = write_report(list(run_dirs), out_dir)
    except ReportError as e:
        raise UserError(str(e)) from None
    click.echo(f"wrote {display_path(path)}")


@cli.command()
@click.option("--site", "name", required=True, metavar="NAME", help="A site of the cross-region run.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the status as JSON (--watch: one object per line)."
)
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(0.2, 3600),
    default=5,
    show_default=True,
    help="Seconds between two reads of the mailbox with --watch.",
)
@_set_option
@_sites_dir_option
def status(name, as_json, watch, interval_s, overrides, sites_dir) -> None:
    """Show a cross-region run's state from its mailbox: newest committed round (how long it took, who it
    waited for), newest snapshot, and per region its newest published round, presence (joined / leaving /
    absent), rounds behind, whether it took part in the newest round, and its heartbeat's age.

    Reads the mailbox with the site's transport and credentials (env var names from the profile; a Slurm
    site's values from its slurm.secrets_file, checked as the job checks it); an fs mailbox path is relative
    to the current directory, as for the job. Exit 1 if the mailbox cannot be read
    (with --watch: the error is shown and the next read tried; Ctrl-C ends it, exit 0).

    \b
    sbatch-gen status --site eu
    sbatch-gen status --site eu --json
    sbatch-gen status --site eu --watch --interval 2
    """
    site = load_site(sites_dir, name, overrides)
    xr = site.profile.cross_region
    if not xr.enabled:
        raise UserError(
            f"{site.at('cross_region', 'enabled')}: cross_region.enabled: site {name!r} is not part "
            "of a cross-region run: there is no mailbox to read"
        )
    _secrets_as_the_job_reads_them(site)
    from sbatch_gen.mailbox_status import HeartbeatWatch, location, read_status  # lazy: only here
    from sbatch_gen.train.xr.errors import XRError

    def read():
        try:
            return read_status(xr)
        except ImportError as e:
            click.echo(
                f"sbatch-gen: mailbox {location(xr.transport)}: reading it needs {e.name or e}: "
                "pip install 'sbatch-gen[s3]'",
                err=True,
            )
            sys.exit(EXIT_STORE)

    if watch:
        beats = HeartbeatWatch()
        _watch(lambda: beats.mark(read()), as_json, interval_s, location(xr.transport), (XRError, OSError))
        return
    try:
        st = read()
    except (XRError, OSError) as e:  # StoreError, an unreadable commit, OSError: one line, no traceback
        click.echo(f"sbatch-gen: mailbox {location(xr.transport)}: {e}", err=True)
        sys.exit(EXIT_STORE)
    if as_json:
        click.echo(json.dumps(st.to_dict(), indent=2))
        return
    click.echo("\n".join(_format_status(st)))


def _secrets_as_the_job_reads_them(site: LoadedSite) -> None:
    """A Slurm site's S3 credentials for `status`, where the job reads them: from slurm.secrets_file (its
    checks, its values; the shell's own values of those variables are not used), into this process's
    environment for the store. An SSH site, or one without the file, reads the shell's, as its launcher
    does."""
    from sbatch_gen.credentials import CREDENTIALS_KEY, read_secrets_file, secret_env

    p = site.profile
    where = getattr(getattr(p, "slurm", None), "secrets_file", None)
    if where is None:
        return
    named = [s for s in secret_env(p) if s.key.startswith(CREDENTIALS_KEY)]
    if not named:
        return
    try:
        values = read_secrets_file(where, named)
    except ValueError as e:
        raise UserError(
            f"{site.at('slurm', 'secrets_file')}: slurm.secrets_file: {e} (status reads the S3 credentials "
            "from it, as the job does)"
        ) from None
    for s in named:
        os.environ.pop(s.name, None)
    os.environ.update(values)


def _watch(read, as_json: bool, interval_s: float, where: str, errors: tuple) -> None:
    """`status --watch`: read and print every ``interval_s`` until Ctrl-C (exit 0). On a terminal each
    read replaces the screen; otherwise (a pipe, a log) reads follow each other, --json one per line."""
    tty = sys.stdout.isatty() and not as_json
    try:
        while True:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            try:
                st = read()
                if as_json:
                    out = json.dumps(st.to_dict())
                else:
                    out = "\n".join(
                        [f"{stamp}  (every {interval_s:g} s; Ctrl-C to stop)", *_format_status(st)]
                    )
            except errors as e:
                out = (
                    json.dumps({"error": str(e), "time": time.time()})
                    if as_json
                    else f"{stamp}  mailbox {where}: {e} (trying again in {interval_s:g} s)"
                )
            click.echo(("\x1b[H\x1b[2J" if tty else "" if as_json else "\n") + out)
            time.sleep(interval_s)
    except KeyboardInterrupt:
        if not as_json:
            click.echo("")


@cli.command()
@click.option("--site", "name", required=True, metavar="NAME", help="Site to check.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.IntRange(1, 3600),
    default=60,
    show_default=True,
    help="Seconds each command (scontrol, sbatch --test-only, ssh to a host) may take.",
)
@_set_option
@_sites_dir_option
@_templates_option
def doctor(name, as_json, timeout_s, overrides, sites_dir, templates_dir) -> None:
    """Check the live cluster against a site profile and its render, before the job waits in the queue.

    Slurm sites (run it on the login node, from the directory you submit from): sbatch --test-only of a
    fresh render, the partition and its MaxTime, the nodes' GPUs, CPUs, memory and features, account and
    QOS, the Slurm version, the preemption grace against the stop checkpoint, requeue, pyxis. SSH sites
    (run it on the first host, from the launch directory): every host over ssh, torch in python_env, the
    GPU count, the run dir. Read-only: no job runs, no GPU is used.

    Exit 1 if a check is an error (warnings do not fail it), 2 on bad input or when Slurm's commands are
    not installed here.

    \b
    sbatch-gen doctor --site eu
    sbatch-gen doctor --site eu --set slurm.partition=h200-long --json
    """
    from sbatch_gen.doctor import SubprocessRunner, format_report, run_doctor  # lazy: only this command

    site = load_site(sites_dir, name, overrides)
    report = run_doctor(site, SubprocessRunner(timeout_s), templates_dir)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo("\n".join(format_report(report)))
    if not report.ok:
        sys.exit(EXIT_DOCTOR)


def _format_status(st) -> list[str]:
    from sbatch_gen.mailbox_status import age

    quorum = "all" if st.quorum == st.regions_total else f"{st.quorum}, grace {st.grace_s:g} s"
    if st.heartbeat_s is not None:
        quorum += f", heartbeat every {st.heartbeat_s:g} s"
    lines = [
        f"run:       {st.run_id} ({st.regions_total} regions; min_regions {quorum})",
        f"mailbox:   {st.location}" + ("" if st.exists else " (does not exist yet)"),
    ]
    c = st.newest_commit
    if c is None:
        lines.append("committed: no rounds committed yet")
    else:
        if c.reason == "all":  # the closer waited, after publishing, until the last of the others arrived
            others = [r for r in c.members if r != c.closed_by]
            whom = others[0] if len(others) == 1 else f"the last of {', '.join(others)}" if others else ""
        else:
            whom = ", ".join(c.absent) or "a late region"
        waited = f", waited {c.waited_s:g} s for {whom}" if whom else ""
        took = f", {c.interval_s:.1f} s after the round before" if c.interval_s is not None else ""
        absent = f"; absent: {', '.join(c.absent)}" if c.absent else ""
        stale = f" (heartbeat stale: {', '.join(c.stale)})" if c.stale else ""
        frag = f", fragment {c.fragment} of {st.fragments}" if c.fragment is not None else ""
        lines.append(
            f"committed: round {c.round} (step {c.step}{frag}), closed {age(st.now - c.time) if c.time else '-'} "
            f"by {c.closed_by} ({c.reason}{waited}){took}; members: {', '.join(c.members) or '-'}{absent}{stale}"
        )
    lines.append(
        f"snapshot:  round {st.newest_snapshot}"
        if st.newest_snapshot is not None
        else "snapshot:  none complete"
    )
    if st.payload is not None:
        pl = st.payload
        sent = ", ".join(f"{r} {n:,} B" for r, n in pl.bytes.items())
        ratios = [n / pl.bf16[r] for r, n in pl.bytes.items() if pl.bf16.get(r)]
        of = ""
        if ratios and len(set(pl.bf16.values())) == 1:
            of = f" ({max(ratios):.3g} of bf16's {pl.bf16_bytes:,} B)"
        elif ratios:  # (overlap streaming: the regions' newest rounds carried different fragments)
            of = f" (at most {max(ratios):.3g} of bf16's, each against its own round's fragment in bf16)"
        lines.append(
            f"payload:   {pl.dtype} ({pl.density:.2%} of each chunk); newest round: {sent or '-'}{of}"
        )
    header = [
        "region",
        "last published",
        "presence",
        "behind",
        "in newest commit",
        "presence updated",
        "last heartbeat",
    ]
    rows = []
    for r in st.regions:
        pres = r.presence + (f" (round {r.presence_round})" if r.presence_round is not None else "")
        if r.presence_why:  # a crash's leave reads apart from a planned stop's
            pres += f": {r.presence_why}"
        if r.gone:
            pres = f"GONE, was {pres}"
        beat = "-" if r.heartbeat is None else f"{age(r.heartbeat_age_s)} (#{r.heartbeat})"
        if r.silent_s is not None and r.silent_s >= 1:
            beat += f", unchanged {r.silent_s:.0f} s"
        rows.append(
            [
                r.region + (" *" if r.region == st.site_region else ""),
                "-" if r.last_published is None else f"round {r.last_published}",
                pres,
                "-" if r.behind is None else str(r.behind),
                "-" if r.in_newest_commit is None else ("yes" if r.in_newest_commit else "no"),
                age(r.presence_age_s) + (f" (job {r.job})" if r.job else ""),
                beat,
            ]
        )
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    lines.append("")
    for row in [header, *rows]:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    lines.append(
        "(* this site's region; behind: rounds behind the newest commit; ages of heartbeats use the "
        "writing region's clock)"
    )
    if any(r.gone for r in st.regions):
        lines.append(
            "(GONE: its heartbeat unchanged for 3 intervals on this machine's clock, without a leave: killed or "
            "crashed; the regions close rounds without it)"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="sbatch-gen")


if __name__ == "__main__":
    main()
