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
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, model_validator

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

    @model_validator(mode="before")
    @classmethod
    def _every_string(cls, data: object) -> object:
        """The rules for every string (values and keys) of the section, before any field is validated, so
        no other message can quote a credential."""
        _check_strings(data, ())
        return data


def _check_strings(data: object, path: tuple[str | int, ...]) -> None:
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        if isinstance(k, str):
            _check_string(k, (*path, k))
        if isinstance(v, str):
            _check_string(v, (*path, k))
        else:
            _check_strings(v, (*path, k))


def _check_string(v: str, path: tuple[str | int, ...]) -> None:
    what = credential_shape(v)
    if what is not None:
        raise FieldError(path, credential_message(what))
    bad = unsafe_chars(v)
    if bad:
        raise FieldError(path, unsafe_chars_message(bad))
