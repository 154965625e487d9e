"""Load site profiles: YAML with line numbers, ``extends:``, ``--set`` overrides, and error messages that
name file, line and field. Torch-free.

Every value remembers where it was written (:class:`Where`), through ``extends:`` chains and overrides,
so a pydantic error on ``slurm.time`` becomes ``sites/eu.yaml:12: slurm.time: invalid time ...``.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from sbatch_gen.profile import DEFAULT_KIND, PROFILE_KINDS, FieldError, ProfileBase

SITE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
DataPath = tuple[str | int, ...]


class UserError(Exception):
    """A mistake in the user's input (profile, override, command line): printed without a traceback,
    exit status 2. Holds one message per problem."""

    def __init__(self, messages: str | Iterable[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


@dataclass(frozen=True)
class Where:
    """Where a value was written: a file and line, or a command-line override."""

    file: str
    line: int | None = None

    def __str__(self) -> str:
        return self.file if self.line is None else f"{self.file}:{self.line}"


def display_path(p: Path) -> str:
    """A path as shown to people: relative to the current directory when below it (so messages and
    rendered headers do not depend on where the checkout lives)."""
    p = Path(p)
    try:
        return p.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return p.as_posix()


def format_path(path: DataPath) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


# ---------------------------------------------------------------------------------------------------
# YAML with positions

_constructor = yaml.constructor.SafeConstructor()


def _scalar(node: yaml.ScalarNode) -> Any:
    value = _constructor.construct_object(node, deep=True)
    # YAML 1.1 reads 24:00:00 as a base-60 integer and 2024-01-01 as a date: keep what was written.
    if node.style is None and (
        (isinstance(value, int | float) and not isinstance(value, bool) and ":" in node.value)
        or not isinstance(value, str | int | float | bool | type(None))
    ):
        return node.value
    return value


def _convert(node: yaml.Node, path: DataPath, where: dict[DataPath, Where], file: str) -> Any:
    if isinstance(node, yaml.MappingNode):
        _constructor.flatten_mapping(node)  # YAML merge keys (<<)
        out: dict[str, Any] = {}
        for k_node, v_node in node.value:
            line = k_node.start_mark.line + 1
            if not isinstance(k_node, yaml.ScalarNode):
                raise UserError(f"{file}:{line}: {format_path(path)}: keys must be plain strings")
            key = _scalar(k_node)
            if not isinstance(key, str):
                key = k_node.value
            if key in out:
                first = where.get((*path, key))
                raise UserError(
                    f"{file}:{line}: {format_path((*path, key))}: duplicate key (first at line "
                    f"{first.line if first else '?'})"
                )
            where[(*path, key)] = Where(file, line)
            out[key] = _convert(v_node, (*path, key), where, file)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            where[(*path, i)] = Where(file, item.start_mark.line + 1)
            items.append(_convert(item, (*path, i), where, file))
        return items
    return _scalar(node)


def parse_yaml(text: str, file: str, line_offset: int = 0) -> tuple[Any, dict[DataPath, Where]]:
    """Parse YAML text; return the data and a map from data path to where each key/item was written."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = " ".join(x for x in (e.context, e.problem) if x)
        raise UserError(f"{file}:{line}: invalid YAML: {problem}") from None
    except yaml.YAMLError as e:
        raise UserError(f"{file}: invalid YAML: {e}") from None
    where: dict[DataPath, Where] = {}
    if node is None:
        return None, where
    return _convert(node, (), where, file), where


def read_yaml(path: Path) -> tuple[Any, dict[DataPath, Where]]:
    file = display_path(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: cannot read: {e}") from None
    return parse_yaml(text, file)


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
    items: Iterable = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        p = (*path, k)
        w = child.get(p) or base.get(p)
        if w is not None:
            out[p] = w
        out.update(_merged_where(v, child, base, p))
    return out


def _load_chain(path: Path, stack: tuple[Path, ...]) -> tuple[dict, dict[DataPath, Where], list[Path]]:
    path = Path(path)
    real = path.resolve()
    if real in stack:
        cycle = " -> ".join(display_path(p) for p in (*stack, real))
        raise UserError(f"{display_path(path)}: extends: cycle: {cycle}")
    data, where = read_yaml(path)
    file = display_path(path)
    if data is None:
        raise UserError(f"{file}:1: empty profile")
    if not isinstance(data, dict):
        raise UserError(f"{file}:1: a profile must be a mapping of keys to values, not {type(data).__name__}")
    ext = data.pop("extends", None)
    if ext is None:
        return data, where, [path]
    ext_where = where.get(("extends",), Where(file, 1))
    bases = [ext] if isinstance(ext, str) else ext
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise UserError(f"{ext_where}: extends: expected a file name or a list of file names")
    merged: dict = {}
    merged_where: dict[DataPath, Where] = {}
    files: list[Path] = []
    for b in bases:
        bpath = path.parent / b
        if not bpath.is_file():
            raise UserError(f"{ext_where}: extends: {b!r} not found (looked for {display_path(bpath)})")
        bdata, bwhere, bfiles = _load_chain(bpath, (*stack, real))
        new = _merge(merged, bdata)
        merged_where = _merged_where(new, bwhere, merged_where)
        merged = new
        files += [f for f in bfiles if f not in files]
    where.pop(("extends",), None)
    result = _merge(merged, data)
    return result, _merged_where(result, where, merged_where), [*files, path]


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """``dotted.key=value`` -> (path, value). The value is YAML (a scalar, or a flow list/mapping)."""
    src = f"--set {text}"
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UserError(f"{src}: expected dotted.key=value")
    parts: list[str | int] = []
    for part in key.split("."):
        if not part:
            raise UserError(f"{src}: empty key segment in {key!r}")
        parts.append(int(part) if part.isdigit() else part)
    value, _ = parse_yaml(raw, src) if raw.strip() else ("", {})
    return parts, value


def apply_overrides(data: dict, where: dict[DataPath, Where], overrides: Iterable[str]) -> None:
    """Apply ``--set`` overrides in place; every value set gets the override as its source."""
    for text in overrides:
        parts, value = parse_override(text)
        src = Where(f"--set {text}")
        cur: Any = data
        for i, part in enumerate(parts[:-1]):
            nxt = parts[i + 1]
            if isinstance(cur, dict):
                if not isinstance(cur.get(part), dict | list):
                    cur[part] = {}
                cur = cur[part]
            elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
                if not isinstance(cur[part], dict | list):
                    cur[part] = {} if not isinstance(nxt, int) else []
                cur = cur[part]
            else:
                raise UserError(f"{src}: {format_path(tuple(parts[: i + 1]))}: cannot set inside a {type(cur).__name__}")
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
        for p in [p for p in where if p[: len(prefix)] == prefix]:
            del where[p]
        where[prefix] = src
        for p in _all_paths(value, prefix):
            where[p] = src


def _all_paths(data: Any, path: DataPath) -> Iterable[DataPath]:
    items: Iterable = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        yield (*path, k)
        yield from _all_paths(v, (*path, k))


# ---------------------------------------------------------------------------------------------------
# Validation errors -> file:line: field: message


def _unwrap(tp: Any) -> Any:
    """Strip Annotated/Optional; a real union becomes a tuple of its members."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _unwrap(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
        return tuple(_unwrap(a) for a in members)
    return tp


def _tag_of(cls: Any) -> str | None:
    if isinstance(cls, type) and issubclass(cls, BaseModel) and "kind" in cls.model_fields:
        ann = _unwrap(cls.model_fields["kind"].annotation)
        if get_origin(ann) is Literal:
            return get_args(ann)[0]
    return None


def resolve_loc(root: type[BaseModel], loc: Iterable[Any]) -> tuple[DataPath, Any]:
    """Turn a pydantic error location into a data path (dropping union tags and '[key]' markers) and
    return the type found at the parent of the last element (for listing valid keys)."""
    cur: Any = root
    path: list[str | int] = []
    parent: Any = None
    for part in loc:
        if part == "[key]":
            continue
        if isinstance(cur, tuple):  # a tagged union: this loc element names the member
            member = next((m for m in cur if _tag_of(m) == part), None)
            if member is not None:
                cur = member
                continue
            cur = None
        parent = cur
        path.append(part)
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            f = cur.model_fields.get(part) if isinstance(part, str) else None
            cur = _unwrap(f.annotation) if f is not None else None
        elif get_origin(cur) is list and isinstance(part, int):
            cur = _unwrap(get_args(cur)[0])
        elif get_origin(cur) is dict:
            cur = _unwrap(get_args(cur)[1])
        else:
            cur = None
    return tuple(path), parent


def lookup_where(where: dict[DataPath, Where], path: DataPath, default: Where) -> Where:
    for n in range(len(path), 0, -1):
        w = where.get(tuple(path[:n]))
        if w is not None:
            return w
    return default


def format_validation_error(
    exc: ValidationError, root: type[BaseModel], where: dict[DataPath, Where], default: Where,
    top_level_extra: Iterable[str] = (),
) -> list[str]:
    """One ``file:line: field.path: message`` line per pydantic error (reusable for other YAML configs)."""
    lines: list[tuple[tuple[str, int], str]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, FieldError):
            loc = loc + ctx_error.path
        path, parent = resolve_loc(root, loc)
        typ = err["type"]
        if typ == "extra_forbidden":
            key = str(path[-1]) if path else "?"
            valid = list(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
            if len(path) == 1:
                valid += list(top_level_extra)
            msg = f"unknown key {key!r} (valid keys: {', '.join(valid)})"
            close = difflib.get_close_matches(key, valid, n=1)
            if close:
                msg += f"; did you mean {close[0]!r}?"
        elif typ == "missing":
            msg = "required field is missing"
        elif ctx_error is not None and typ in ("value_error", "assertion_error"):
            msg = str(ctx_error)
        else:
            msg = err["msg"]
            inp = err.get("input")
            if isinstance(inp, str | int | float | bool) or inp is None:
                msg += f" (got {inp!r})"
        w = lookup_where(where, path, default)
        lines.append(((w.file, w.line or 0), f"{w}: {format_path(path)}: {msg}"))
    # In file order; the same message once.
    return list(dict.fromkeys(text for _, text in sorted(lines, key=lambda x: x[0])))


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

    @property
    def display(self) -> str:
        return display_path(self.path)

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


def validate_profile(data: dict, where: dict[DataPath, Where], default: Where) -> ProfileBase:
    kind = data.get("kind", DEFAULT_KIND)
    if kind not in PROFILE_KINDS:
        w = lookup_where(where, ("kind",), default)
        raise UserError(f"{w}: kind: unknown kind {kind!r} (valid kinds: {', '.join(PROFILE_KINDS)})")
    cls = PROFILE_KINDS[kind]
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, cls, where, default, top_level_extra=["extends"])) from None


def load_site(sites_dir: Path, name: str, overrides: Iterable[str] = ()) -> LoadedSite:
    if not SITE_NAME_RE.fullmatch(name):
        raise UserError(f"invalid site name {name!r}")
    path = site_path(sites_dir, name)
    data, where, files = _load_chain(path, ())
    overrides = list(overrides)
    apply_overrides(data, where, overrides)
    profile = validate_profile(data, where, Where(display_path(path), 1))
    return LoadedSite(name=name, path=path, files=files, overrides=overrides, data=data, where=where,
                      profile=profile)
