"""The JSON records of the mailbox (round commits, presence, heartbeats, outer snapshot markers): one writer
and one reader, so that a newer sbatch-gen can extend them. Torch-free. (Payload manifests have their own
``format``: :mod:`.protocol`.)

- Every record carries ``version``, an integer: :data:`VERSION`. A writer that only ADDS fields keeps the
  version, and readers ignore the fields they do not know; a change of an existing field's meaning raises it.
- A record without ``version`` was written before records had one: it is read as version 1, its layout, so a
  run started with that code continues with this one (a commit's old ``format: 1`` is then an unknown field).
- A record of another version is refused in one line naming its key, the version found and the version
  read here (:class:`~.errors.XRLayoutError`): never taken for an absent record, which would make a live
  region look gone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any, TypeVar

from .errors import XRLayoutError

VERSION = 1
T = TypeVar("T")
R = TypeVar("R", bound="Record")


def dump(record: dict[str, Any]) -> bytes:
    """A record's bytes, with this version."""
    return json.dumps({**record, "version": VERSION}, sort_keys=True, separators=(",", ":")).encode()


def load(raw: bytes, what: str, where: str) -> dict[str, Any]:
    """The fields of a record (``version`` taken out). Raises ValueError when ``raw`` is no JSON object,
    :class:`XRLayoutError` when it is a version this code does not read."""
    d = json.loads(raw)
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    v = d.pop("version", 1)
    if type(v) is not int or v != VERSION:
        raise XRLayoutError(
            f"{what} {where} is version {v!r}, this sbatch-gen reads version {VERSION}: "
            "every region of a run must run the same sbatch-gen version"
        )
    return d


def build(cls: type[T], d: dict[str, Any]) -> T:
    """The dataclass ``cls`` from a record's fields; the fields it does not have are ignored (a newer
    writer's additions). A missing one raises TypeError."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in d.items() if k in names})


class Record:
    """Base of the dataclass records: written by :func:`dump`, read by :func:`load` and :func:`build`."""

    WHAT = "record"  # names the record in errors

    def to_json(self) -> bytes:
        return dump(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def read(cls: type[R], raw: bytes, where: str) -> R:
        """The record in ``raw`` (from ``where``, for errors): see :func:`load` and :func:`build`."""
        return build(cls, load(raw, cls.WHAT, where))
