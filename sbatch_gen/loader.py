"""Load site profiles: YAML with line numbers, ``extends:``, ``--set`` overrides, and error messages that
name file, line and field. Torch-free.

Every value remembers where it was written (:class:`Where`), through ``extends:`` chains and overrides,
so a pydantic error on ``slurm.time`` becomes ``sites/eu.yaml:12: slurm.time: invalid time ...``.
"""

from __future__ import annotations

import difflib
import os
import posixpath
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
    exit status 2. Holds one message per problem, each cleaned by :func:`clean_message` (one line, values
    cut, credentials masked), whoever wrote it."""

    def __init__(self, messages: str | Iterable[str]):
        raw = [messages] if isinstance(messages, str) else list(messages)
        self.messages = [clean_message(m) for m in raw]
        super().__init__("\n".join(self.messages))


# ---------------------------------------------------------------------------------------------------
# Messages: one line, values cut, credentials masked

MAX_VALUE_CHARS = 80  # a value (quoted, or a run without spaces) is cut to this many characters
MAX_MESSAGE_CHARS = 1000  # and a whole message to this many
MAX_PATH_CHARS = 300  # a path (a run with a "/") keeps up to this many, cut in the middle: its end names the file
MASK = "<redacted>"
_ELLIPSIS = "\u2026"

# Things that look like credentials. A message never shows them, even when the value is what is wrong.
_SECRET_RES = [
    re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA)[A-Z0-9]{16}(?![A-Za-z0-9])"),
    re.compile(r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
    re.compile(r"(?<![A-Za-z0-9])xox[abprs]-[A-Za-z0-9-]{10,}"),
    re.compile(r"(?<![A-Za-z0-9])(?:sk|rk|pk)[-_](?:live[-_]|test[-_]|proj[-_])?[A-Za-z0-9_-]{20,}"),
    re.compile(r"(?<![A-Za-z0-9])eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"),  # a JWT
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----(?:.*?-----END [A-Z ]*PRIVATE KEY-----|.*)"),
]
# NAME=value where NAME says it holds a secret (an --set of extra_env.DB_PASSWORD=..., say)
_SECRET_ASSIGN = re.compile(r"(?i)((?:password|passwd|secret|token|apikey|api_key)=['\"]?)[^\s'\"]+?(?=:?(?:[\s'\"]|$))")
_BASE64ISH = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{32,}={0,2}(?![A-Za-z0-9+/=])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# A quoted value (as repr() writes one), else a run without spaces.
_VALUE = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S{" + str(MAX_VALUE_CHARS + 1) + ",}")


def _looks_random(token: str) -> bool:
    """A 32+ character base64-ish token with upper case, lower case and digits, and no lower-case run
    as long as a word (so CamelCase/paths stay readable): an access key, a token, a password hash."""
    return (
        any(c.isupper() for c in token) and any(c.islower() for c in token) and any(c.isdigit() for c in token)
        and not re.search(r"[a-z]{8}", token)
    )


def mask_secrets(text: str) -> str:
    """Replace anything that looks like a credential by <redacted>."""
    for rx in _SECRET_RES:
        text = rx.sub(MASK, text)
    text = _SECRET_ASSIGN.sub(lambda m: m.group(1) + MASK, text)
    return _BASE64ISH.sub(lambda m: MASK if _looks_random(m.group()) else m.group(), text)


def _escape_control(text: str) -> str:
    def esc(m: re.Match) -> str:
        c = m.group()
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
            f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
        )

    return _CONTROL.sub(esc, text)


def cut(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with an ellipsis when it was longer."""
    return text if len(text) <= limit else text[:limit] + _ELLIPSIS


def clean_message(msg: str) -> str:
    """The one helper every user-facing error goes through: control characters (newlines included) are
    escaped so a message is one line, credentials are masked, and each value (a quoted string or a run
    without spaces) is cut to MAX_VALUE_CHARS, the whole message to MAX_MESSAGE_CHARS."""
    msg = mask_secrets(_escape_control(str(msg)))

    def cut_value(m: re.Match) -> str:
        v = m.group()
        if v[0] in "'\"" and v[-1] == v[0] and len(v) > 1:
            return v if len(v) <= MAX_VALUE_CHARS + 2 else v[: MAX_VALUE_CHARS + 1] + _ELLIPSIS + v[-1]
        if "/" in v:  # a path, often with a file:line: long in temp directories, and its end is what counts
            return v if len(v) <= MAX_PATH_CHARS else v[:40] + _ELLIPSIS + v[-(MAX_PATH_CHARS - 40):]
        return cut(v[:-1]) + ":" if v.endswith(":") else cut(v)

    return cut(_VALUE.sub(cut_value, msg), MAX_MESSAGE_CHARS)


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
    p, cwd = Path(p), Path.cwd()
    # as written (a symlink keeps its own name), else with links resolved
    for path, base in ((Path(os.path.abspath(p)), Path(os.path.abspath(cwd))), (p.resolve(), cwd.resolve())):
        try:
            return path.relative_to(base).as_posix()
        except ValueError:
            pass
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

MAX_DEPTH = 50  # nested lists/mappings: profiles need a handful; deeper input is refused, not recursed into
MAX_ALIAS_VALUES = 10_000  # values that aliases (*name, << merges) may expand to in one document
_TAG_PREFIX = "tag:yaml.org,2002:"
ALLOWED_TAGS = {"!"} | {_TAG_PREFIX + t for t in ("str", "int", "float", "bool", "null", "seq", "map")}


def _tag_name(tag: str) -> str:
    return "!!" + tag[len(_TAG_PREFIX):] if tag.startswith(_TAG_PREFIX) else tag


def _loc(file: str, line: int | None) -> str:
    return str(Where(file, line))


class _Frame:
    """An open list or mapping while scanning YAML events."""

    __slots__ = ("is_map", "anchor", "size", "key", "index", "want_key")

    def __init__(self, is_map: bool, anchor: str | None):
        self.is_map, self.anchor, self.size = is_map, anchor, 0
        self.key: str | int = "?"
        self.index, self.want_key = 0, True


def _prescan(text: str, file: str, lines: bool) -> None:
    """Check YAML before it is composed into nodes, in one pass over the parser's events (no recursion):
    nesting depth, explicit tags, and how much aliases expand to (a "billion laughs" document is a few
    lines that expand to billions of values). Errors name the line and the field being read."""
    stack: list[_Frame] = []
    sizes: dict[str, int] = {}  # anchor -> values it expands to (itself included)
    open_anchors: set[str] = set()
    aliased = 0

    def fail(ev: yaml.Event, msg: str) -> UserError:
        path: list[str | int] = []
        for f in stack:
            if f.is_map and not f.want_key:
                path.append(f.key)
            elif not f.is_map:
                path.append(f.index)
        return UserError(f"{_loc(file, ev.start_mark.line + 1 if lines else None)}: {format_path(tuple(path))}: {msg}")

    def start(ev: yaml.Event, key: str | int) -> None:
        if stack and stack[-1].is_map and stack[-1].want_key:
            stack[-1].key = key

    def done(size: int) -> None:
        if stack:
            f = stack[-1]
            f.size += size
            if f.is_map:
                f.want_key = not f.want_key
            else:
                f.index += 1

    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        tag = getattr(ev, "tag", None)
        if tag is not None and tag not in ALLOWED_TAGS:
            raise fail(ev, f"YAML tag {_tag_name(tag)!r} is not allowed (plain values only: strings, numbers, "
                           "booleans, null, lists and mappings)")
        if isinstance(ev, yaml.ScalarEvent):
            start(ev, ev.value)
            if ev.anchor is not None:
                sizes[ev.anchor] = 1
            done(1)
        elif isinstance(ev, yaml.AliasEvent):
            if ev.anchor in open_anchors:
                raise fail(ev, f"alias *{ev.anchor} refers to a value that contains it (recursive alias)")
            if ev.anchor not in sizes:
                raise fail(ev, f"alias *{ev.anchor} has no anchor &{ev.anchor} before it")
            start(ev, f"*{ev.anchor}")
            aliased += sizes[ev.anchor]
            if aliased > MAX_ALIAS_VALUES:
                raise fail(ev, f"aliases expand to more than {MAX_ALIAS_VALUES} values (a YAML alias bomb?); "
                               "write the values out or use fewer aliases")
            done(sizes[ev.anchor])
        elif isinstance(ev, yaml.CollectionStartEvent):
            if len(stack) >= MAX_DEPTH:
                raise fail(ev, f"nested more than {MAX_DEPTH} levels deep")
            start(ev, "?")
            stack.append(_Frame(isinstance(ev, yaml.MappingStartEvent), ev.anchor))
            if ev.anchor is not None:
                open_anchors.add(ev.anchor)
        elif isinstance(ev, yaml.CollectionEndEvent):
            f = stack.pop()
            if f.anchor is not None:
                open_anchors.discard(f.anchor)
                sizes[f.anchor] = f.size + 1
            done(f.size + 1)


def _scalar(node: yaml.ScalarNode, path: DataPath, file: str, lines: bool) -> Any:
    try:
        value = _constructor.construct_object(node, deep=True)
    except Exception:  # noqa: BLE001 - `!!int abc`, `!!bool maybe`, ...: the user's input, one line
        raise UserError(
            f"{_loc(file, node.start_mark.line + 1 if lines else None)}: {format_path(path)}: cannot read "
            f"{node.value!r} as {_tag_name(node.tag)}"
        ) from None
    # YAML 1.1 reads 24:00:00 as a base-60 integer and 2024-01-01 as a date: keep what was written.
    if node.style is None and (
        (isinstance(value, int | float) and not isinstance(value, bool) and ":" in node.value)
        or not isinstance(value, str | int | float | bool | type(None))
    ):
        return node.value
    return value


def _convert(node: yaml.Node, path: DataPath, where: dict[DataPath, Where], file: str, lines: bool = True) -> Any:
    def at(n: yaml.Node) -> Where:
        return Where(file, n.start_mark.line + 1 if lines else None)

    if isinstance(node, yaml.MappingNode):
        own = sum(1 for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge")
        _constructor.flatten_mapping(node)  # YAML merge keys (<<); bounded by _prescan
        merged = len(node.value) - own  # flatten puts the merged pairs first
        out: dict[str, Any] = {}
        from_merge: set[str] = set()
        for i, (k_node, v_node) in enumerate(node.value):
            w = at(k_node)
            if not isinstance(k_node, yaml.ScalarNode):
                raise UserError(f"{w}: {format_path(path)}: keys must be plain strings")
            key = _scalar(k_node, path, file, lines)
            if not isinstance(key, str):
                key = k_node.value
            if i < merged and key in out:
                continue  # the first merged mapping that has the key wins
            if i < merged:
                from_merge.add(key)
            elif key in from_merge:  # a key written here overrides a merged one
                from_merge.discard(key)
                del out[key]
            if key in out:
                first = where.get((*path, key))
                raise UserError(
                    f"{w}: {format_path((*path, key))}: duplicate key (first at line "
                    f"{first.line if first and first.line else '?'})"
                )
            where[(*path, key)] = w
            out[key] = _convert(v_node, (*path, key), where, file, lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            where[(*path, i)] = at(item)
            items.append(_convert(item, (*path, i), where, file, lines))
        return items
    return _scalar(node, path, file, lines)


def _char_name(code: int) -> str:
    names = {0: "NUL", 7: "BEL", 8: "BS", 0x1B: "ESC", 0x7F: "DEL"}
    return f"U+{code:04X}" + (f" ({names[code]})" if code in names else "")


def parse_yaml(text: str, file: str, line_offset: int = 0, lines: bool = True) -> tuple[Any, dict[DataPath, Where]]:
    """Parse YAML text; return the data and a map from data path to where each key/item was written.
    ``lines=False`` (a ``--set`` value): errors and the map name ``file`` without a line number."""
    try:
        _prescan(text, file, lines)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1 + line_offset if isinstance(e.position, int) else None
        what = _char_name(e.character) if isinstance(e.character, int) else repr(e.character)
        raise UserError(f"{_loc(file, line if lines else None)}: invalid YAML: character {what} is not allowed "
                        "(control characters cannot be written in YAML)") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = (mark.line + 1 if mark is not None else 1) + line_offset
        problem = " ".join(x for x in (e.context, e.problem) if x)
        raise UserError(f"{_loc(file, line if lines else None)}: invalid YAML: {problem}") from None
    except yaml.YAMLError as e:
        raise UserError(f"{file}: invalid YAML: {e}") from None
    except RecursionError:  # (not reached with MAX_DEPTH, but never a traceback)
        raise UserError(f"{file}: invalid YAML: nested too deep") from None
    where: dict[DataPath, Where] = {}
    if node is None:
        return None, where
    try:
        return _convert(node, (), where, file, lines), where
    except RecursionError:
        raise UserError(f"{file}: invalid YAML: nested too deep") from None


def read_yaml(path: Path, label: str | None = None) -> tuple[Any, dict[DataPath, Where]]:
    file = label or display_path(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise UserError(f"{file}: no such file") from None
    except OSError as e:
        raise UserError(f"{file}: cannot read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{file}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x})") from None
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
    value, _ = parse_yaml(raw, src, lines=False) if raw.strip() else ("", {})
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
        _forget(where, prefix, src)
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
    if not _inside(path, Path(sites_dir).resolve()):
        raise UserError(f"{display_path(path)}: a symbolic link out of the sites directory "
                        f"{display_path(sites_dir)}: profiles must live inside it")
    data, where, files = _load_chain(sites_dir, path.name, ())
    overrides = list(overrides)
    apply_overrides(data, where, overrides)
    profile = validate_profile(data, where, Where(display_path(path), 1))
    return LoadedSite(name=name, path=path, files=files, overrides=overrides, data=data, where=where,
                      profile=profile, sites_dir=Path(sites_dir))
