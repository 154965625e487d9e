"""The outer state and the mailbox live on the region's leaders only: using either on another rank is an
internal error with one clear line, never an AttributeError on None."""

from __future__ import annotations

import pytest
import torch

from sbatch_gen.train.dist import DistInfo
from sbatch_gen.train.xr.errors import XRError
from sbatch_gen.train.xr.exchange import Exchange
from sbatch_gen.train.xr.region import Region, held

from .test_sync import xr_for


def test_held_returns_the_buffer_and_names_a_missing_one():
    t = torch.zeros(3)
    assert held(t, "avg") is t
    with pytest.raises(XRError, match="internal: theta_outer is used on a rank that holds none"):
        held(None, "theta_outer")


def test_a_rank_without_a_mailbox_says_so():
    cpu = torch.device("cpu")
    ex = Exchange(xr_for("eu", "unused"), Region(DistInfo(), cpu), None, None, 8, "x", [0], cpu, cpu)
    with pytest.raises(XRError, match="rank 0 holds no mailbox"):
        ex.mb()
    with pytest.raises(XRError, match="rank 0 holds no mailbox"):
        ex.ms()
