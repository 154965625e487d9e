"""Value types and validators of site profiles, shared by every kind. Torch-free.

Validation rule for everything that ends up in a script: a value is either restricted to a safe
character set (names, numbers, anything written into an ``#SBATCH`` line, which Slurm does not
shell-parse) or it is shell-quoted by the renderer and reaches the job exactly as written. Values that
would silently mean something else (``$VAR`` or ``~`` in a path, control characters, ``%`` in a Slurm
filename pattern, a leading ``-`` where the value becomes a command's argument, a YAML boolean where a
number is meant) are rejected with a message saying why.

Rules for every string of a profile (keys included), checked once for the whole document before any field
(:meth:`ProfileSection._every_string`): no control characters (C0, DEL, C1) and no Unicode bidirectional
controls, so what a reviewer reads is what runs; and nothing shaped like a literal credential (the message
says ``<redacted>``, never the value).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ModelWrapValidatorHandler,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails, InitErrorDetails
from typing_extensions import Self

from sbatch_gen.errors import FieldError
from sbatch_gen.strict import StrictModel
from sbatch_gen.xr_options import credential_message, credential_shape, unsafe_chars, unsafe_chars_message

# ---------------------------------------------------------------------------------------------------
# #SBATCH lines are read by sbatch, not by a shell, so these characters are literal there. The renderer's
# `sbatch` filter admits exactly SBATCH_LINE_CHARS; each field admits a subset (tests/render check that).

SBATCH_LINE_CHARS = r"A-Za-z0-9_./+:=@,%&|\[\]()*!-"
SBATCH_LINE_RE = re.compile(f"[{SBATCH_LINE_CHARS}]+")
# Paths and plain values (paths.log_dir): no '%' (Slurm reads it as a filename pattern in --output) and none
# of the constraint operators.
SBATCH_PLAIN_CHARS = r"A-Za-z0-9_./+:=@,-"
# The value of one of slurm.extra_directives: the plain characters and '%'.
SBATCH_DIRECTIVE_VALUE_CHARS = r"A-Za-z0-9_./+:=@,%-"
# slurm.constraint: feature names, counts and the operators & | [ ] ( ) * !.
SBATCH_CONSTRAINT_CHARS = r"A-Za-z0-9_&|\[\]()*:.!,-"


# ---------------------------------------------------------------------------------------------------
# Validators


def pattern_check(pattern: str, what: str) -> Callable[[str], str]:
    """A validator: the value must match ``pattern`` in full. ``what`` is "thing" or "thing (what is
    allowed)"."""
    rx = re.compile(pattern)
    name, _, hint = what.partition(" (")

    def check(v: str) -> str:
        if not rx.fullmatch(v):
            raise ValueError(f"invalid {name} {v!r}" + (f" ({hint}" if hint else ""))
        return v

    return check


def no_control(v: str) -> str:
    """No control characters and no Unicode bidi controls."""
    bad = unsafe_chars(v)
    if bad:
        raise ValueError(unsafe_chars_message(bad))
    return v


def not_an_option(what: str) -> Callable[[str], str]:
    """A validator for values that become a command's argument: a leading '-' would make it an option."""

    def check(v: str) -> str:
        if v.startswith("-"):
            raise ValueError(f"{what} {v!r} starts with '-': the command would read it as an option")
        return v

    return check


def strict_int(v: object) -> object:
    """Before-validator of every integer field: pydantic would take the YAML booleans (yes/no/on/off/
    true/false) as 1/0, "2" as 2 and 2.0 as 2."""
    if isinstance(v, bool):
        raise ValueError("Input should be a valid integer, got a YAML boolean (true/false, yes/no, on/off)")
    if isinstance(v, str):
        hint = " (write the number without quotes)" if v.strip().isdigit() else ""
        raise ValueError(f"Input should be a valid integer, got the string {v!r}{hint}")
    if not isinstance(v, int):
        raise ValueError(f"Input should be a valid integer, got {v!r}")
    return v


def check_path(v: str) -> str:
    """A path as written in a profile: not empty, no variables, no '~', no leading '-'."""
    if not v:
        raise ValueError("empty path")
    no_control(v)
    if "$" in v:
        raise ValueError(
            f"path {v!r} contains '$': variables are not expanded in profile paths; write the path out"
        )
    if v.startswith("~"):
        raise ValueError(f"path {v!r} starts with '~', which is not expanded; write the path out")
    if v.startswith("-"):
        raise ValueError(
            f"path {v!r} starts with '-': a command taking it as an argument would read an option; "
            f"write ./{v}"
        )
    return v


_SBATCH_PLAIN_RE = re.compile(f"[{SBATCH_PLAIN_CHARS}]+")


def check_log_dir(v: str) -> str:
    """paths.log_dir: a path that goes into '#SBATCH --output='."""
    check_path(v)
    if not _SBATCH_PLAIN_RE.fullmatch(v):
        raise ValueError(
            f"log dir {v!r} goes into '#SBATCH --output=', which Slurm does not quote: use only letters, "
            "digits and . _ / + : = @ , -"
        )
    return v


def numeric_to_str(v: object) -> object:
    """Before-validator: YAML reads 23.11 as a float and 60 as an int; accept them where a string is meant."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float):
        return str(v)
    return v


_TIME_RE = re.compile(
    r"(?:(?P<d>\d+)-(?P<dh>\d{1,2})(?::(?P<dm>\d{1,2})(?::(?P<ds>\d{1,2}))?)?)"  # D-H[:M[:S]]
    r"|(?P<h>\d+):(?P<hm>\d{1,2}):(?P<hs>\d{1,2})"  # H:M:S
    r"|(?P<m>\d+):(?P<ms>\d{1,2})"  # M:S
    r"|(?P<mins>\d+)"  # minutes
)


def slurm_time_seconds(v: str) -> int:
    """Seconds of a Slurm time limit string (raises ValueError)."""
    m = _TIME_RE.fullmatch(v)
    if m is None:
        raise ValueError(f"invalid time {v!r} (expected D-HH:MM:SS, HH:MM:SS or minutes)")
    g = {k: int(x) for k, x in m.groupdict().items() if x is not None}
    for k in ("dm", "ds", "hm", "hs", "ms"):
        if g.get(k, 0) >= 60:
            raise ValueError(f"invalid time {v!r}: minutes and seconds must be below 60")
    if "dh" in g and g["dh"] >= 24:
        raise ValueError(f"invalid time {v!r}: hours after 'D-' must be below 24")
    if "d" in g:
        secs = g["d"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0)
    elif "h" in g:
        secs = g["h"] * 3600 + g["hm"] * 60 + g["hs"]
    elif "m" in g:
        secs = g["m"] * 60 + g["ms"]
    else:
        secs = g["mins"] * 60
    if secs <= 0:
        raise ValueError(f"invalid time {v!r}: must be positive")
    return secs


def check_slurm_time(v: str) -> str:
    slurm_time_seconds(v)
    return v


# ---------------------------------------------------------------------------------------------------
# Types

Name = Annotated[
    str,
    AfterValidator(
        pattern_check(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", "name (letters, digits, . _ -; at most 64)")
    ),
]
EnvName = Annotated[
    str, AfterValidator(pattern_check(r"[A-Za-z_][A-Za-z0-9_]{0,127}", "environment variable name"))
]
ModuleName = Annotated[
    str,
    AfterValidator(pattern_check(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", "Python module name")),
]
PathStr = Annotated[str, AfterValidator(check_path)]
# Every integer field: no YAML booleans, strings or floats.
Int = Annotated[int, BeforeValidator(strict_int)]
LogDir = Annotated[str, AfterValidator(check_log_dir)]
SlurmTime = Annotated[str, BeforeValidator(numeric_to_str), AfterValidator(check_slurm_time)]
Text = Annotated[str, AfterValidator(no_control)]
Url = Annotated[str, AfterValidator(pattern_check(r"https?://[A-Za-z0-9.:\[\]_~%/+-]+", "URL"))]


# ---------------------------------------------------------------------------------------------------
# Base model of every profile section


class ProfileSection(StrictModel):
    """A :class:`StrictModel` that applies the rules for every string before any field is validated."""

    @model_validator(mode="wrap")
    @classmethod
    def _every_string(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        """The rules for every string (values and keys) of the section, before any field is validated, so
        no other message can quote a credential. A string that breaks them is reported and left out (a bad
        key with its value; a bad value replaced by a stand-in, :func:`_stand_in`), and the rest is validated
        all the same: every other bad field is reported in the same run, the errors at a refused string's
        own path left out."""
        problems: list[tuple[tuple[str | int, ...], str]] = []
        clean = _without_bad_strings(data, (), problems)
        if not problems:
            return handler(data)
        errors = [_field_error(path, msg) for path, msg in problems]
        try:
            handler(clean)
        except ValidationError as e:
            bad = [path for path, _ in problems]
            for err in e.errors(include_url=False):
                if not any(_within(_data_path(cls, err), b) for b in bad):
                    errors.append(_as_init_error(err))
        raise ValidationError.from_exception_data(cls.__name__, errors)


_PLACEHOLDER = "redacted"  # stands in for a credential-shaped string (its own errors are left out)


def _without_bad_strings(data: object, path: tuple[str | int, ...], problems: list) -> object:
    """A copy of ``data`` without the strings that break the rules (see :meth:`ProfileSection._every_string`),
    each one's problem appended to ``problems``."""
    if isinstance(data, dict):
        out: dict = {}
        for k, v in data.items():
            at = (*path, k)
            why = _string_problem(k) if isinstance(k, str) else None
            if why is not None:
                problems.append((at, why))
                continue
            out[k] = _without_bad_strings(v, at, problems)
        return out
    if isinstance(data, list):
        return [_without_bad_strings(v, (*path, i), problems) for i, v in enumerate(data)]
    if isinstance(data, str):
        why = _string_problem(data)
        if why is not None:
            problems.append((path, why))
            return _stand_in(data)
    return data


def _stand_in(v: str) -> str:
    """What validates in place of a refused string: a credential-shaped one is replaced whole (nothing of it
    may reach a message); from any other, the forbidden characters are dropped, so that checks between
    fields still see the rest (a ``{max_steps}`` in ``trainer.args``, say) and report nothing the refused
    value did not cause."""
    if credential_shape(v) is not None:
        return _PLACEHOLDER
    return "".join(c for c in v if not unsafe_chars(c))


def _string_problem(v: str) -> str | None:
    what = credential_shape(v)
    if what is not None:
        return credential_message(what)
    bad = unsafe_chars(v)
    return unsafe_chars_message(bad) if bad else None


def _field_error(path: tuple[str | int, ...], msg: str) -> InitErrorDetails:
    return {"type": "value_error", "loc": (), "input": _PLACEHOLDER, "ctx": {"error": FieldError(path, msg)}}


def _data_path(root: type[BaseModel], err: ErrorDetails) -> tuple:
    """The data path a pydantic error is about (a model validator's FieldError included; union tags out)."""
    from sbatch_gen.yamlload import resolve_loc

    loc = tuple(err["loc"])
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, FieldError):
        loc = loc + ctx_error.path
    return resolve_loc(root, loc)[0]


def _within(path: tuple, prefix: tuple) -> bool:
    return path[: len(prefix)] == prefix


def _as_init_error(err: ErrorDetails) -> InitErrorDetails:
    """A pydantic error as :meth:`ValidationError.from_exception_data` takes it back."""
    out: InitErrorDetails = {"type": err["type"], "loc": err["loc"], "input": err["input"]}
    if "ctx" in err:
        out["ctx"] = err["ctx"]
    return out
