"""The strict pydantic base model of every configuration model of the project. Torch-free.

Site profiles (:mod:`sbatch_gen.profiles`), the cross-region options (:mod:`sbatch_gen.xr_options`) and the
train config (:mod:`sbatch_gen.train.config`) all build on :class:`StrictModel`: unknown keys are errors
(a typo never passes silently) and a validated model cannot be changed afterwards.

A model's checks between its fields are methods marked :func:`check` (not pydantic's own after-validators,
which stop at the first that fails): every one runs, and their problems are raised together, so that one
run reports every independent problem of a model. Pydantic runs them only once the model's fields are
valid.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, model_validator

from sbatch_gen.errors import FieldError, FieldErrors, raise_all

F = TypeVar("F", bound=Callable[..., Any])

_CHECK = "_sbatch_gen_check"


def check(f: F) -> F:
    """Mark a method ``(self) -> None`` (or returning self) as one of its model's checks between fields: it
    raises :class:`FieldError` (or :class:`FieldErrors`) for what it finds."""
    setattr(f, _CHECK, True)
    return f


class StrictModel(BaseModel):
    """Unknown keys rejected (``extra="forbid"``), instances immutable (``frozen``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _run_checks(self) -> StrictModel:
        """Every :func:`check` of the model (base classes' first, each in the order it is written), all of
        them whatever the others find; their problems raised together."""
        found: list[FieldError] = []
        for name in _checks(type(self)):
            try:
                getattr(self, name)()
            except FieldErrors as e:
                found += e.errors
            except FieldError as e:
                found.append(e)
        raise_all(found)
        return self


@functools.cache
def _checks(cls: type) -> tuple[str, ...]:
    """The names of the :func:`check` methods of ``cls``, base classes' first, each in written order."""
    names: dict[str, None] = {}
    for c in reversed(cls.__mro__):
        names.update((n, None) for n, f in vars(c).items() if getattr(f, _CHECK, False))
    return tuple(names)
