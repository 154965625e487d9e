"""User-written YAML (site profiles, train configs) with line numbers, and validation errors that name
``file:line: field``. Torch-free.

Every value remembers where it was written (:class:`Where`), so a pydantic error on ``slurm.time`` becomes
``sites/eu.yaml:12: slurm.time: invalid time ...`` and an unknown key gets the valid keys and a close
match. Every file goes through the same checks before it is built into values: UTF-8 text, nesting depth,
allowed tags only, and a bound on what aliases expand to. Every problem is a
:class:`~sbatch_gen.errors.UserError`.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from sbatch_gen.errors import FieldError, FieldErrors, UserError
from sbatch_gen.fsutil import display_path

DataPath = tuple[str | int, ...]
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Where:
    """Where a value was written: a file and line, or a command-line override."""

    file: str
    line: int | None = None

    def __str__(self) -> str:
        return self.file if self.line is None else f"{self.file}:{self.line}"


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
    return "!!" + tag[len(_TAG_PREFIX) :] if tag.startswith(_TAG_PREFIX) else tag


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
        line = ev.start_mark.line + 1 if lines and ev.start_mark is not None else None
        return UserError(f"{_loc(file, line)}: {format_path(tuple(path))}: {msg}")

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
            raise fail(
                ev,
                f"YAML tag {_tag_name(tag)!r} is not allowed (plain values only: strings, numbers, "
                "booleans, null, lists and mappings)",
            )
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
                raise fail(
                    ev,
                    f"aliases expand to more than {MAX_ALIAS_VALUES} values (a YAML alias bomb?); "
                    "write the values out or use fewer aliases",
                )
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


def _convert(
    node: yaml.Node, path: DataPath, where: dict[DataPath, Where], file: str, lines: bool = True
) -> Any:
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
            key_path = (*path, key)
            if key in out:
                first = where.get(key_path)
                raise UserError(
                    f"{w}: {format_path(key_path)}: duplicate key (first at line "
                    f"{first.line if first and first.line else '?'})"
                )
            where[key_path] = w
            out[key] = _convert(v_node, key_path, where, file, lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            item_path = (*path, i)
            where[item_path] = at(item)
            items.append(_convert(item, item_path, where, file, lines))
        return items
    assert isinstance(node, yaml.ScalarNode)  # the composer makes only mapping, sequence and scalar nodes
    return _scalar(node, path, file, lines)


def _char_name(code: int) -> str:
    names = {0: "NUL", 7: "BEL", 8: "BS", 0x1B: "ESC", 0x7F: "DEL"}
    return f"U+{code:04X}" + (f" ({names[code]})" if code in names else "")


def parse_yaml(
    text: str, file: str, line_offset: int = 0, lines: bool = True
) -> tuple[Any, dict[DataPath, Where]]:
    """Parse YAML text; return the data and a map from data path to where each key/item was written.
    ``lines=False`` (a ``--set`` value): errors and the map name ``file`` without a line number."""
    try:
        _prescan(text, file, lines)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1 + line_offset if isinstance(e.position, int) else None
        what = _char_name(e.character) if isinstance(e.character, int) else repr(e.character)
        raise UserError(
            f"{_loc(file, line if lines else None)}: invalid YAML: character {what} is not allowed "
            "(control characters cannot be written in YAML)"
        ) from None
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


def _quote_hint(value: int | float) -> str:
    """A number or a YAML boolean where a string is meant (``NCCL_NET_GDR_LEVEL: 2``, ``X: yes``): YAML
    typed the value, so ask for quotes; the value as written is not known here (``1.10`` reads as 1.1)."""
    if isinstance(value, bool):
        got = f"the YAML boolean {str(value).lower()} (true/false, yes/no, on/off are booleans in YAML)"
        example = ""
    elif isinstance(value, int):
        got, example = f"the integer {value!r}", f" ('{value!r}')"
    else:
        got, example = f"the number {value!r} (as YAML reads it)", ""
    return f"Input should be a valid string, got {got}: quote it as written{example} to give a string"


def format_validation_error(
    exc: ValidationError,
    root: type[BaseModel],
    where: dict[DataPath, Where],
    default: Where,
    top_level_extra: Iterable[str] = (),
) -> list[str]:
    """One ``file:line: field.path: message`` line per pydantic error (reusable for other YAML configs). An
    error in a section whose ``kind`` a command-line override set, from any other source, says so: the keys
    there were written for another kind."""
    kinds = {p[:-1]: w for p, w in where.items() if p and p[-1] == "kind" and w.line is None}
    lines: list[tuple[tuple[str, int], str]] = []
    errors: list[Any] = []
    for err in exc.errors(include_url=False):  # several errors raised together: one line each
        many = (err.get("ctx") or {}).get("error")
        if isinstance(many, FieldErrors):
            errors += [{**err, "ctx": {**err["ctx"], "error": e}} for e in many.errors]
        else:
            errors.append(err)
    for err in errors:
        loc = tuple(err["loc"])
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, FieldError):
            loc = loc + ctx_error.path
        path, parent = resolve_loc(root, loc)
        typ = err["type"]
        if typ == "extra_forbidden":
            key = str(path[-1]) if path else "?"
            valid = (
                list(parent.model_fields)
                if isinstance(parent, type) and issubclass(parent, BaseModel)
                else []
            )
            if len(path) == 1:
                valid += list(top_level_extra)
            msg = f"unknown key {key!r} (valid keys: {', '.join(valid)})"
            close = difflib.get_close_matches(key, valid, n=1)
            if close:
                msg += f"; did you mean {close[0]!r}?"
        elif typ == "missing":
            msg = "required field is missing"
        elif typ == "union_tag_invalid":  # a discriminated section's kind: named at its own line
            ctx = err.get("ctx") or {}
            path = (*path, str(ctx.get("discriminator", "kind")).strip("'"))
            msg = f"unknown {path[-1]} {ctx.get('tag')!r} (valid: {ctx.get('expected_tags')})"
        elif ctx_error is not None and typ in ("value_error", "assertion_error"):
            msg = str(ctx_error)
        elif typ == "string_type" and isinstance(err.get("input"), int | float):
            msg = _quote_hint(err["input"])
        else:
            msg = err["msg"]
            inp = err.get("input")
            if isinstance(inp, str | int | float | bool) or inp is None:
                msg += f" (got {inp!r})"
        w = lookup_where(where, path, default)
        kind = next((kinds[path[:n]] for n in range(len(path), -1, -1) if path[:n] in kinds), None)
        if kind is not None and kind.file != w.file:
            msg += f" (after {kind})"
        lines.append(((w.file, w.line or 0), f"{w}: {format_path(path)}: {msg}"))
    # In file order; the same message once.
    return list(dict.fromkeys(text for _, text in sorted(lines, key=lambda x: x[0])))


def read_mapping(path: Path, what: str, label: str | None = None) -> tuple[dict, dict[DataPath, Where]]:
    """:func:`read_yaml` for a file that must hold a mapping (``what`` names it in messages: "profile")."""
    file = label or display_path(path)
    data, where = read_yaml(path, file)
    if data is None:
        raise UserError(f"{file}:1: empty {what}")
    if not isinstance(data, dict):
        raise UserError(f"{file}:1: a {what} must be a mapping of keys to values, not {type(data).__name__}")
    return data, where


def load_model(cls: type[M], path: Path, what: str, label: str | None = None) -> M:
    """Read ``path`` and validate it as ``cls``; every problem, one ``file:line: field: message`` each, in
    one :class:`UserError`. ``label``: how messages name the file (default: :func:`display_path`)."""
    file = label or display_path(path)
    data, where = read_mapping(path, what, file)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, cls, where, Where(file, 1))) from None
