"""Load site profiles: ``extends:`` chains, ``--set`` overrides, and validation. Torch-free.

The YAML itself is read by :mod:`sbatch_gen.yamlload`: every value remembers where it was written
(:class:`~sbatch_gen.yamlload.Where`), through ``extends:`` chains and overrides, so a pydantic error on
``slurm.time`` becomes ``sites/eu.yaml:12: slurm.time: invalid time ...``.
"""

from __future__ import annotations

import difflib
import os
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sbatch_gen.errors import UserError, cut, mask_secrets
from sbatch_gen.fsutil import display_path
from sbatch_gen.profiles import DEFAULT_KIND, PROFILE_KINDS, ProfileBase
from sbatch_gen.yamlload import (
    DataPath,
    Where,
    format_path,
    format_validation_error,
    lookup_where,
    parse_yaml,
    read_mapping,
)

SITE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


# ---------------------------------------------------------------------------------------------------
# extends: and overrides


def _merge(base: Any, child: Any) -> Any:
    """Mappings merge key by key (recursively); anything else in the child replaces the base."""
    if isinstance(base, dict) and isinstance(child, dict):
        out = dict(base)
        for k, v in child.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return child


def _merged_where(data: Any, child: dict, base: dict, path: DataPath = ()) -> dict[DataPath, Where]:
    out: dict[DataPath, Where] = {}
    items: Iterable = (
        data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    )
    for k, v in items:
        p = (*path, k)
        w = child.get(p) or base.get(p)
        if w is not None:
            out[p] = w
        out.update(_merged_where(v, child, base, p))
    return out


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
        return True
    except ValueError:
        return False


def _load_chain(
    sites_dir: Path, rel: str, stack: tuple[Path, ...]
) -> tuple[dict, dict[DataPath, Where], list[Path]]:
    """Load ``sites_dir/rel`` and its ``extends:`` bases (each relative to the file naming it, and
    inside the sites directory, symlinks resolved)."""
    path = Path(sites_dir) / rel
    real = path.resolve()
    file = display_path(path)
    data, where = read_mapping(path, "profile", file)
    ext = data.pop("extends", None)
    if ext is None:
        return data, where, [path]
    ext_where = where.get(("extends",), Where(file, 1))
    bases = [ext] if isinstance(ext, str) else ext
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise UserError(f"{ext_where}: extends: expected a file name or a list of file names")
    root = Path(sites_dir).resolve()
    merged: dict = {}
    merged_where: dict[DataPath, Where] = {}
    files: list[Path] = []
    for b in bases:
        brel = posixpath.normpath(posixpath.join(posixpath.dirname(rel), b.replace("\\", "/")))
        outside = f"{ext_where}: extends: {b!r} is outside the sites directory {display_path(sites_dir)}"
        if posixpath.isabs(b) or b.startswith("~") or brel == ".." or brel.startswith("../"):
            raise UserError(f"{outside} (bases are paths relative to the profile, inside that directory)")
        bpath = Path(sites_dir) / brel
        if not bpath.is_file():
            raise UserError(f"{ext_where}: extends: {b!r} not found (looked for {display_path(bpath)})")
        if not _inside(bpath, root):
            raise UserError(f"{outside} (a symbolic link leads out of it)")
        if bpath.resolve() in (*stack, real):
            cycle = " -> ".join(display_path(p) for p in (*stack, real, bpath.resolve()))
            raise UserError(f"{ext_where}: extends: cycle: {cycle}")
        bdata, bwhere, bfiles = _load_chain(sites_dir, brel, (*stack, real))
        new = _merge(merged, bdata)
        merged_where = _merged_where(new, bwhere, merged_where)
        merged = new
        files += [f for f in bfiles if f not in files]
    where.pop(("extends",), None)
    result = _merge(merged, data)
    return result, _merged_where(result, where, merged_where), [*files, path]


_KEY_SEGMENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def override_label(text: str) -> str:
    """How an override is named in messages: ``--set key=value``, the value cut (and, like every message,
    credentials masked)."""
    return f"--set {cut(mask_secrets(text))}"


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """``dotted.key=value`` -> (path, value). The value is YAML (a scalar, or a flow list/mapping)."""
    src = override_label(text)
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UserError(f"{src}: expected dotted.key=value")
    parts: list[str | int] = []
    for part in key.split("."):
        if not part:
            raise UserError(f"{src}: empty key segment in {key!r}")
        if not _KEY_SEGMENT_RE.fullmatch(part):
            raise UserError(f"{src}: invalid key segment {part!r} (letters, digits, _ and -)")
        parts.append(int(part) if part.isdigit() else part)
    if "\n" in raw or "\r" in raw:
        raise UserError(f"{src}: the value spans lines: a --set value is one line")
    value, _ = parse_yaml(raw, src, lines=False) if raw.strip() else ("", {})
    if re.search(r"(^|\s)#", raw) and "#" not in repr(value):  # YAML read the rest as a comment
        raise UserError(
            f"{src}: YAML reads ' #' as the start of a comment, which would leave {value!r}: quote the value "
            f"(--set '{key}=\"...\"') to keep it whole"
        )
    return parts, value


def _forget(where: dict[DataPath, Where], prefix: DataPath, src: Where) -> None:
    """``prefix`` (and everything below it) now comes from the override ``src``."""
    for p in [p for p in where if p[: len(prefix)] == prefix]:
        del where[p]
    where[prefix] = src


def apply_overrides(data: dict, where: dict[DataPath, Where], overrides: Iterable[str]) -> None:
    """Apply ``--set`` overrides in place; every value set gets the override as its source, and so does
    every container an override had to create (or put in place of a scalar): an error there names the
    override, not the profile line of the value it replaced."""
    for text in overrides:
        parts, value = parse_override(text)
        src = Where(override_label(text))
        cur: Any = data
        for i, part in enumerate(parts[:-1]):
            nxt = parts[i + 1]
            if isinstance(cur, dict):
                if not isinstance(cur.get(part), dict | list):
                    cur[part] = {}
                    _forget(where, tuple(parts[: i + 1]), src)
                cur = cur[part]
            elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
                if not isinstance(cur[part], dict | list):
                    cur[part] = {} if not isinstance(nxt, int) else []
                    _forget(where, tuple(parts[: i + 1]), src)
                cur = cur[part]
            else:
                raise UserError(
                    f"{src}: {format_path(tuple(parts[: i + 1]))}: cannot set inside a {type(cur).__name__}"
                )
        last = parts[-1]
        if isinstance(cur, dict):
            cur[last] = value
        elif isinstance(cur, list) and isinstance(last, int) and last <= len(cur):
            if last == len(cur):
                cur.append(value)
            else:
                cur[last] = value
        else:
            raise UserError(f"{src}: {format_path(tuple(parts))}: cannot set this index")
        prefix = tuple(parts)
        _forget(where, prefix, src)
        for p in _all_paths(value, prefix):
            where[p] = src


def _all_paths(data: Any, path: DataPath) -> Iterable[DataPath]:
    items: Iterable = (
        data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    )
    for k, v in items:
        yield (*path, k)
        yield from _all_paths(v, (*path, k))


# ---------------------------------------------------------------------------------------------------
# Sites


@dataclass
class LoadedSite:
    name: str
    path: Path
    files: list[Path]  # the extends: chain, bases first, this file last
    overrides: list[str]
    data: dict
    where: dict[DataPath, Where]
    profile: ProfileBase
    sites_dir: Path | None = None

    @property
    def display(self) -> str:
        return display_path(self.path)

    @property
    def header_files(self) -> list[str]:
        """The extends: chain as rendered into script headers: ``<sites dir name>/<path inside it>``, so
        a render does not depend on where the checkout is or where sbatch-gen runs from."""
        if self.sites_dir is None:
            return [display_path(f) for f in self.files]
        name = Path(os.path.abspath(self.sites_dir)).name or "sites"
        return [f"{name}/{Path(f).relative_to(self.sites_dir).as_posix()}" for f in self.files]

    def at(self, *path: str | int) -> Where:
        """Where the value at ``path`` (or its closest written ancestor) came from."""
        return lookup_where(self.where, tuple(path), Where(self.display, 1))


def list_sites(sites_dir: Path) -> list[str]:
    """Site names: ``<sites_dir>/*.yaml`` except files starting with '_' or '.' (shared bases live in
    ``_base/`` or ``_*.yaml``)."""
    sites_dir = Path(sites_dir)
    if not sites_dir.is_dir():
        raise UserError(f"{display_path(sites_dir)}: sites directory not found (use --sites-dir)")
    names = []
    for p in sorted(sites_dir.iterdir()):
        if p.suffix in (".yaml", ".yml") and p.is_file() and not p.name.startswith(("_", ".")):
            names.append(p.stem)
    return names


def site_path(sites_dir: Path, name: str) -> Path:
    known = list_sites(sites_dir)
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(
            f"unknown site {name!r}: no {display_path(Path(sites_dir) / (name + '.yaml'))} "
            f"(sites: {', '.join(known) or 'none'}){hint}"
        )
    for suffix in (".yaml", ".yml"):
        p = Path(sites_dir) / f"{name}{suffix}"
        if p.is_file():
            return p
    raise AssertionError(name)


def _forgotten_kind(data: dict, default: Where) -> UserError | None:
    """A profile without ``kind`` is read as the default kind. When it has another kind's own sections and
    none of the default kind's (an SSH profile that forgot ``kind: ssh``), one line says so, instead of the
    default kind's errors about every section it does not know."""
    if "kind" in data:
        return None
    shared = set(ProfileBase.model_fields)
    default_own = [k for k in PROFILE_KINDS[DEFAULT_KIND].model_fields if k not in shared]
    if any(k in data for k in default_own):
        return None
    for kind, cls in PROFILE_KINDS.items():
        found = [k for k in cls.model_fields if k not in shared and k in data]
        if kind != DEFAULT_KIND and found:
            return UserError(
                f"{default}: kind: missing: the profile has kind {kind}'s sections ({', '.join(found)}) and "
                f"none of kind {DEFAULT_KIND}'s ({', '.join(default_own)}), the kind of a profile without "
                f"kind: did you mean kind: {kind}?"
            )
    return None


def validate_profile(data: dict, where: dict[DataPath, Where], default: Where) -> ProfileBase:
    forgotten = _forgotten_kind(data, default)
    if forgotten is not None:
        raise forgotten
    kind = data.get("kind", DEFAULT_KIND)
    if kind not in PROFILE_KINDS:
        w = lookup_where(where, ("kind",), default)
        raise UserError(f"{w}: kind: unknown kind {kind!r} (valid kinds: {', '.join(PROFILE_KINDS)})")
    cls = PROFILE_KINDS[kind]
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise UserError(
            format_validation_error(e, cls, where, default, top_level_extra=["extends"])
        ) from None


def load_site(sites_dir: Path, name: str, overrides: Iterable[str] = ()) -> LoadedSite:
    if not SITE_NAME_RE.fullmatch(name):
        raise UserError(f"invalid site name {name!r}")
    path = site_path(sites_dir, name)
    if not _inside(path, Path(sites_dir).resolve()):
        raise UserError(
            f"{display_path(path)}: a symbolic link out of the sites directory "
            f"{display_path(sites_dir)}: profiles must live inside it"
        )
    data, where, files = _load_chain(sites_dir, path.name, ())
    overrides = list(overrides)
    apply_overrides(data, where, overrides)
    profile = validate_profile(data, where, Where(display_path(path), 1))
    return LoadedSite(
        name=name,
        path=path,
        files=files,
        overrides=overrides,
        data=data,
        where=where,
        profile=profile,
        sites_dir=Path(sites_dir),
    )
