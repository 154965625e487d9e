"""bench/memory.py, the analytic memory table: its arithmetic on small known cases, the solver, the figures
it takes from the trainer, and the committed results against a fresh computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import memory as mm
from sbatch_gen.train.dist import DistInfo
from sbatch_gen.train.model import GPT, flops_per_token
from sbatch_gen.train.xr.modes import create
from sbatch_gen.xr_options import CrossRegion, FsTransport

REPO = Path(__file__).resolve().parents[2]
SMALL = mm.Shape("small", "a test shape", 4, 256, 4)


def _xr(root: Path, **kw) -> CrossRegion:
    base = dict(
        enabled=True,
        run_id="t",
        region="a",
        regions=["a", "b", "c"],
        inner_steps=4,
        transport=FsTransport(root=str(root)),
        timeout_s=30,
    )
    return CrossRegion(**{**base, **kw})


def _island(xr: CrossRegion, nodes: int = 2, gpus: int = 4, async_save: bool = True) -> mm.Island:
    return mm.Island("a", nodes, gpus, "h200", xr, async_save)


def test_bytes_per_parameter_add_up_to_the_documented_totals():
    assert sum(mm.DDP_ITEMS.values()) == 18  # fp32 4 + bf16 copies 2 + fp32 grads 4 + AdamW 8
    assert sum(mm.FSDP_ITEMS.values()) == 16  # divided by W
    assert (mm.GATHERED, mm.OFFLOAD_COPIES, mm.SAVED, mm.OUTER_SAVED) == (8, 8, 12, 8)


@pytest.mark.parametrize(
    "sync, overlap, per_param",
    [("diloco", "none", 16), ("diloco", "eager", 20), ("diloco", "streaming", 20), ("grad", "none", 8)],
)
def test_leader_bytes_are_what_the_real_sync_holds(tmp_path, sync, overlap, per_param):
    """The figure the table uses is the state_bytes() of the sync the trainer builds for those options."""
    kw = {"fragments": 2, "fragment_delay_steps": 1} if overlap == "streaming" else {}
    xr = _xr(tmp_path / "mailbox", regions=["a", "b"], sync=sync, overlap=overlap, shard_mb=0.001, **kw)
    s = create(xr, torch.nn.Linear(6, 3), torch.device("cpu"), DistInfo(), None, None)
    try:
        assert s.state_bytes() == per_param * s.numel == s.outer_bytes()
    finally:
        s.close()
    assert mm.leader_bytes_per_param(xr) == per_param


def test_a_small_known_case_by_hand(tmp_path):
    """2 nodes x 4 GPUs, 3 regions, DiLoCo without overlap (16 B/param), bf16 payloads, the outer state
    forced into host memory, async checkpoints: every item against its hand-written bytes."""
    xr = _xr(tmp_path, outer_device="cpu")
    isl = _island(xr)
    m = mm.Model(SMALL, 4)
    n, act, c = m.params, m.activations, mm.counts(SMALL)
    assert n == c.outside + 4 * c.block
    leader, other = mm.ranks(isl, "ddp", m)
    assert (leader.per_node, other.per_node) == (1, 3)
    assert sum(leader.hbm.values()) == sum(other.hbm.values()) == 18 * n + act
    assert leader.host == {
        "outer state": 16 * n,
        # the bf16 staging of a whole upload; the 2 other regions' bf16 payloads and a snapshot's 8 B,
        # these two split between the 2 node leaders
        "transfer buffers": 2 * n + 2 * (2 * n / 2) + 8 * n / 2,
        "checkpoint staging": (12 + 8) * n,
    }
    assert other.host == {"checkpoint staging": 12 * n}
    (fsdp,) = mm.ranks(isl, "fsdp", m)
    assert fsdp.per_node == 4
    assert sum(fsdp.hbm.values()) == pytest.approx(16 * n / 8 + 8 * (c.outside + 2 * c.block) + act)
    assert fsdp.host == pytest.approx(  # payloads of n / 8 elements: approx for the rounding up
        {
            "outer state": 16 * n / 8,
            "transfer buffers": (2 + 2 * 2 + 8) * n / 8,
            "checkpoint staging": 20 * n / 8,
        }
    )
    (off,) = mm.ranks(isl, "fsdp+offload", m)
    assert sum(off.hbm.values()) == pytest.approx((8 + 8 / 8) * (c.outside + 2 * c.block) + act)
    assert sum(off.host.values()) == pytest.approx((16 + 16 + 2 + 4 + 8 + 20) * n / 8)
    # without async checkpoints and with the outer state on the GPU (outer_device auto, it fits)
    isl = _island(_xr(tmp_path), async_save=False)
    leader, other = mm.ranks(isl, "ddp", m)
    assert sum(leader.hbm.values()) == 34 * n + act and "checkpoint staging" not in leader.host
    assert other.host == {}


def test_node_host_memory_counts_every_rank_of_the_node(tmp_path, monkeypatch):
    """Host memory is the node's: a leader and its 3 other ranks together must fit, less the reserve."""
    isl = _island(_xr(tmp_path, outer_device="cpu"))
    leader, other = rs = mm.ranks(isl, "ddp", mm.Model(SMALL, 4))
    node = sum(leader.host.values()) + 3 * sum(other.host.values())
    monkeypatch.setitem(mm.HOST, "h200", (mm.HOST_RESERVE + node, "test"))
    assert mm.over(isl, rs) == []
    monkeypatch.setitem(mm.HOST, "h200", (mm.HOST_RESERVE + node - 1, "test"))
    assert mm.over(isl, rs) == ["host"]


@pytest.mark.parametrize("mode", mm.MODES)
def test_the_largest_model_fits_and_one_block_more_does_not(mode):
    eu, us = mm.islands()
    for isl in (eu, us):
        for shape in mm.SHAPES:
            x = mm.largest(isl, mode, shape)
            assert x is not None
            assert (x.model.n_layers == mm.MAX_LAYERS) == (x.bound == "depth limit")
            assert mm.over(isl, mm.ranks(isl, mode, x.model)) == []
            if x.bound != "depth limit":
                deeper = mm.ranks(isl, mode, mm.Model(shape, x.model.n_layers + 1))
                assert " and ".join(mm.over(isl, deeper)) == x.bound != ""
        top = mm.best(isl, mode)
        assert top is not None
        assert top.model.params == max(mm.largest(isl, mode, s).model.params for s in mm.SHAPES)


def test_counts_and_flops_are_the_trainers():
    """The affine count from 1 and 2 blocks equals the model built at the stated depth, and the FLOPs
    are the trainer's MFU count of it."""
    for shape in (SMALL, *mm.SHAPES):
        with torch.device("meta"):
            g = GPT(shape.config(shape.n_layers))
        m = mm.Model(shape, shape.n_layers)
        assert m.params == g.num_params()
        assert m.flops_per_token == flops_per_token(g.cfg, g.num_params(exclude_embeddings=True))[0]
    assert mm.Model(mm.SHAPES[1], 32).params == 6_721_904_640  # Llama-2-7B's shape in the trainer's GPT


def test_islands_come_from_the_production_profiles():
    eu, us = mm.islands()
    assert (eu.region, eu.ranks, eu.gpus_per_node, eu.gpu) == ("eu", 16, 8, "h200")
    assert (us.region, us.ranks, us.gpu) == ("us", 1, "gh200")
    assert eu.xr.overlap == us.xr.overlap == "streaming" and eu.async_save


def test_committed_results_match_a_fresh_computation():
    """bench/results/memory.{md,json} are what `python -m bench memory` computes now; rerun it after
    changing the inputs, the profiles or the trainer's model."""
    res = mm.compute()
    assert res.markdown() == (REPO / "bench" / "results" / "memory.md").read_text()
    assert res.json_text() == (REPO / "bench" / "results" / "memory.json").read_text()
    assert "nothing measured" in res.markdown().split("\n")[2]
