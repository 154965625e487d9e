"""YAML with line numbers, and pydantic errors that name ``file:line: field``.

Torch-free. Keys are located by walking PyYAML's node tree, so an error points at the line that holds
the offending value (or, for a missing field, at its parent mapping).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

Loc = tuple[str | int, ...]


class ConfigError(Exception):
    """A config file that does not parse or validate. ``str(err)`` is one line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def _walk(node: yaml.Node, loc: Loc, lines: dict[Loc, int], path: str) -> None:
    lines[loc] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, val_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            line = key_node.start_mark.line + 1
            if key in seen:
                where = ".".join(str(x) for x in (*loc, key))
                raise ConfigError([f"{path}:{line}: {where}: duplicate key (first at line {seen[key]})"])
            seen[key] = line
            _walk(val_node, (*loc, key), lines, path)
            # Errors about a key itself (unknown field) point at the key's line.
            lines[(*loc, key)] = line
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, (*loc, i), lines, path)


def load_yaml(path: str | Path) -> tuple[dict, dict[Loc, int]]:
    """Parse ``path``; return the mapping and ``{location tuple: line}``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([f"{p}: cannot read: {e.strerror or e}"]) from e
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise ConfigError([f"{p}:1: (top level): the file is empty; expected a mapping"])
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError([f"{p}:{node.start_mark.line + 1}: (top level): expected a mapping of keys"])
        lines: dict[Loc, int] = {}
        _walk(node, (), lines, str(p))
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        raise ConfigError([f"{p}:{line}: (yaml): {e.problem or e}"]) from e
    finally:
        loader.dispose()
    return data, lines


def _line_for(loc: Loc, lines: dict[Loc, int]) -> int:
    for n in range(len(loc), -1, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return 1


def _valid_keys(cls: type[BaseModel] | None, loc: Loc) -> list[str] | None:
    """Field names of the model at ``loc`` (None when it is not a model)."""
    for part in loc:
        if cls is None or not isinstance(part, str) or part not in cls.model_fields:
            return None
        ann = cls.model_fields[part].annotation
        cls = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return sorted(cls.model_fields) if cls is not None else None


def format_validation_error(
    err: ValidationError, path: str | Path, lines: dict[Loc, int], cls: type[BaseModel] | None = None
) -> list[str]:
    out = []
    for e in err.errors(include_url=False):
        loc = tuple(x for x in e["loc"] if not (isinstance(x, str) and x.startswith("function-")))
        field = ".".join(str(x) for x in loc) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(cls, loc[:-1])
            msg = "unknown field" + (f" (valid: {', '.join(valid)})" if valid else "")
        elif e["type"] != "missing" and "input" in e and not isinstance(e["input"], dict | list):
            msg = f"{msg} (got {e['input']!r})"
        out.append(f"{path}:{_line_for(loc, lines)}: {field}: {msg}")
    return out


def load_model(cls: type[M], path: str | Path, overrides: dict | None = None) -> M:
    """Load ``path`` as ``cls``; raise :class:`ConfigError` naming file:line:field on any problem."""
    data, lines = load_yaml(path)
    if overrides:
        data = {**data, **overrides}
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, path, lines, cls)) from None
