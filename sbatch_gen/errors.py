"""The one error type for mistakes in what a user wrote (a site profile, a train config, an override, a
command-line value), and the message hygiene every such message goes through. Torch-free.

A :class:`UserError` is printed without a traceback, one line per problem, each ``file:line: field:
message``; the CLIs exit 2 on it. A validator that knows which field is wrong raises :class:`FieldError`,
so the loader can point at that field's line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


class UserError(Exception):
    """A mistake in the user's input (profile, train config, override, command line): printed without a
    traceback, exit status 2. Holds one message per problem, each cleaned by :func:`clean_message` (one line, values
    cut, credentials masked), whoever wrote it."""

    def __init__(self, messages: str | Iterable[str]):
        raw = [messages] if isinstance(messages, str) else list(messages)
        self.messages = [clean_message(m) for m in raw]
        super().__init__("\n".join(self.messages))


class FieldError(ValueError):
    """A model-level validation error that belongs to one field: ``path`` is relative to the model that
    raised it, so the loader can point at that field's line."""

    def __init__(self, path: tuple[str | int, ...], msg: str):
        super().__init__(msg)
        self.path = path


class FieldErrors(ValueError):
    """Several independent :class:`FieldError` of one model (the items of a list, the model's checks), raised
    together so that one run reports them all (sbatch_gen/strict.py ``check``, yamlload's formatting)."""

    def __init__(self, errors: list[FieldError]):
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = errors


def raise_all(errors: list[FieldError]) -> None:
    """Raise ``errors``: nothing when empty, the one error itself, else :class:`FieldErrors`."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise FieldErrors(errors)


# ---------------------------------------------------------------------------------------------------
# Messages: one line, values cut, credentials masked

MAX_VALUE_CHARS = 80  # a value (quoted, or a run without spaces) is cut to this many characters
MAX_MESSAGE_CHARS = 1000  # and a whole message to this many
MAX_PATH_CHARS = (
    300  # a path (a run with a "/") keeps up to this many, cut in the middle: its end names the file
)
MASK = "<redacted>"
_ELLIPSIS = "\u2026"

# Things that look like credentials. A message never shows them, even when the value is what is wrong.
_SECRET_RES = [
    re.compile(
        r"(?<![A-Za-z0-9])(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA)[A-Z0-9]{16}(?![A-Za-z0-9])"
    ),
    re.compile(r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
    re.compile(r"(?<![A-Za-z0-9])xox[abprs]-[A-Za-z0-9-]{10,}"),
    re.compile(r"(?<![A-Za-z0-9])(?:sk|rk|pk)[-_](?:live[-_]|test[-_]|proj[-_])?[A-Za-z0-9_-]{20,}"),
    re.compile(r"(?<![A-Za-z0-9])eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"),  # a JWT
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----(?:.*?-----END [A-Z ]*PRIVATE KEY-----|.*)"),
]
# NAME=value where NAME says it holds a secret (an --set of extra_env.DB_PASSWORD=..., say)
_SECRET_ASSIGN = re.compile(
    r"(?i)((?:password|passwd|secret|token|apikey|api_key)=['\"]?)[^\s'\"]+?(?=:?(?:[\s'\"]|$))"
)
# the user part of a URL that carries a password (scheme://user:password@host): all of it goes
_URL_USERINFO = re.compile(r"(://)[^/?#@\s:'\"]*:[^/?#@\s'\"]*@")  # (from "://": linear on long values)
_BASE64ISH = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{32,}={0,2}(?![A-Za-z0-9+/=])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# A quoted value (as repr() writes one), else a run without spaces.
_VALUE = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S{" + str(MAX_VALUE_CHARS + 1) + ",}")


def _looks_random(token: str) -> bool:
    """A 32+ character base64-ish token with upper case, lower case and digits, and no lower-case run
    as long as a word (so CamelCase/paths stay readable): an access key, a token, a password hash."""
    return (
        any(c.isupper() for c in token)
        and any(c.islower() for c in token)
        and any(c.isdigit() for c in token)
        and not re.search(r"[a-z]{8}", token)
    )


def mask_secrets(text: str) -> str:
    """Replace anything that looks like a credential by <redacted>."""
    for rx in _SECRET_RES:
        text = rx.sub(MASK, text)
    text = _SECRET_ASSIGN.sub(lambda m: m.group(1) + MASK, text)
    text = _URL_USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)
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
            return v if len(v) <= MAX_PATH_CHARS else v[:40] + _ELLIPSIS + v[-(MAX_PATH_CHARS - 40) :]
        return cut(v[:-1]) + ":" if v.endswith(":") else cut(v)

    return cut(_VALUE.sub(cut_value, msg), MAX_MESSAGE_CHARS)
