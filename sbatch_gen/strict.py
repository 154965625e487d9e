"""The strict pydantic base model of every configuration model of the project. Torch-free.

Site profiles (:mod:`sbatch_gen.profiles`), the cross-region options (:mod:`sbatch_gen.xr_options`) and the
train config (:mod:`sbatch_gen.train.config`) all build on :class:`StrictModel`: unknown keys are errors
(a typo never passes silently) and a validated model cannot be changed afterwards.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown keys rejected (``extra="forbid"``), instances immutable (``frozen``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
