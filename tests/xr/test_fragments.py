"""Streaming DiLoCo's fragments on their own: which parameters each holds, the schedule, the flat order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sbatch_gen.train.xr.flat import FlatParams, layout_fingerprint
from sbatch_gen.train.xr.fragments import assign, fragment_of, layer_of, offsets, round_at, round_step


def test_layers_are_the_prefix_up_to_the_first_index():
    assert layer_of("blocks.3.attn.qkv.weight") == "blocks.3"
    assert layer_of("model.layers.12.mlp.w1") == "model.layers.12"
    assert layer_of("0.weight") == "0"  # an nn.Sequential's
    assert layer_of("tok.weight") is None and layer_of("ln_f.bias") is None


def test_equal_layers_go_round_robin_and_the_rest_balances_the_sizes():
    names = ["tok.weight"] + [f"blocks.{i}.{w}" for i in range(4) for w in ("a", "b")] + ["head.weight"]
    numels = [40] + [10, 5] * 4 + [8]
    got = assign(names, numels, 2)
    # the largest unit first (tok: 40) to fragment 0, then the layers (15 each) to the smaller fragment, in
    # model order: blocks 0, 1, 2 to fragment 1 (15, 30, 45), block 3 to fragment 0 (55), head to fragment 1
    assert got == [0, 1, 1, 1, 1, 1, 1, 0, 0, 1]
    # a layer's parameters always share a fragment
    assert got[1] == got[2] and got[7] == got[8]
    # four fragments of four equal layers: strided, one layer each; the others spread
    got4 = assign([f"blocks.{i}.w" for i in range(4)], [10] * 4, 4)
    assert got4 == [0, 1, 2, 3]
    got8 = assign([f"blocks.{i}.w" for i in range(8)], [10] * 8, 4)
    assert got8 == [0, 1, 2, 3, 0, 1, 2, 3]  # fragment p holds layers p, p+4 (the paper's strided split)


def test_fewer_layers_than_fragments_splits_by_tensor():
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert assign(names, [72, 12, 12, 1], 4) == [0, 1, 2, 3]
    assert assign(names, [72, 12, 12, 1], 2) == [0, 0, 1, 1]  # two layers: one each
    with pytest.raises(ValueError, match=r"fragments 5: the model has only 4 parameter tensors"):
        assign(names, [72, 12, 12, 1], 5)


def test_schedule_offsets_rounds_and_fragments():
    assert offsets(50, 4) == [12, 25, 37, 50]
    assert [round_step(k, 50, 4) for k in range(1, 7)] == [12, 25, 37, 50, 62, 75]
    assert [fragment_of(k, 4) for k in range(1, 7)] == [0, 1, 2, 3, 0, 1]
    assert [round_at(s, 50, 4) for s in (0, 11, 12, 25, 50, 62, 63)] == [0, 0, 1, 2, 4, 5, 0]
    # F = 1 is DiLoCo's numbering: round k at step k*H
    assert [round_step(k, 10, 1) for k in (1, 2, 3)] == [10, 20, 30]
    assert [round_at(s, 10, 1) for s in (5, 10, 20)] == [0, 1, 2]
    for h, f in ((50, 4), (100, 2), (7, 3), (10, 10)):
        for k in range(1, 3 * f + 1):
            assert round_at(round_step(k, h, f), h, f) == k


def test_flat_order_holds_each_fragment_contiguous():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1), nn.Tanh(), nn.Linear(1, 3))
    one = FlatParams(m)
    assert one.layout == layout_fingerprint(m) and one.fragment(0) == (0, one.numel)
    two = FlatParams(m, 2)
    assert two.numel == one.numel and two.layout != one.layout
    assert two.fragment(0)[1] == two.fragment(1)[0] and two.fragment(1)[1] == two.numel
    buf = torch.empty(two.numel)
    two.gather(buf)
    for p in range(2):  # each fragment's range holds exactly its parameters, in model order
        lo, hi = two.fragment(p)
        got = torch.cat([t.reshape(-1) for t in two.tensors_part(lo, hi)])
        assert torch.equal(buf[lo:hi], got)
    # a fragment's delta and scatter touch only its own parameters
    before = [t.clone() for t in two.tensors()]
    lo, hi = two.fragment(1)
    theta = buf + 1.0
    out = torch.zeros(two.numel)
    two.delta_part_into(theta, out, lo, hi)
    assert torch.equal(out[lo:hi], (theta - buf)[lo:hi]) and not out[:lo].any()
    two.scatter_part(theta, lo, hi)
    after = two.tensors()
    inside = {t.data_ptr() for t in two.tensors_part(lo, hi)}
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a, b + 1.0) if a.data_ptr() in inside else torch.equal(a, b)
    with pytest.raises(ValueError, match="parameter boundaries"):
        two.scatter_part(theta, lo + 1, hi)
    # the split is part of the layout: another F is another layout
    assert FlatParams(m, 3).layout not in (one.layout, two.layout)


def test_the_runs_rounds_count_fragment_rounds():
    from pathlib import Path

    from sbatch_gen.train.config import load_config, xr_problems
    from sbatch_gen.xr_options import CrossRegion

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")  # 30 steps, 2 layers
    xr = CrossRegion(
        enabled=True,
        region="eu",
        regions=["eu", "us"],
        inner_steps=10,
        overlap="streaming",
        fragments=4,
        fragment_delay_steps=1,
        snapshot_every=13,
    )
    errs, _ = xr_problems(cfg, xr)  # 3 cycles of 4 fragment rounds: 12 rounds
    assert [e.field for e in errs] == ["snapshot_every"]
    assert (
        "more than the 12 outer rounds of the run (train.steps 30 with fragments 4: 4 rounds per " in errs[0]
    )
    assert xr_problems(cfg, xr.model_copy(update={"snapshot_every": 12}))[0] == []
    # 2 layers of 8 tensors and 4 others: 20 tensors to split
    errs, _ = xr_problems(cfg, xr.model_copy(update={"fragments": 10, "snapshot_every": 1}))
    assert (
        errs == []
        and xr_problems(
            cfg,
            xr.model_copy(
                update={"fragments": 21, "inner_steps": 21, "fragment_delay_steps": 0, "snapshot_every": 1}
            ),
        )[0][0].field
        == "fragments"
    )


def test_streaming_warns_where_the_benchmark_measured_worse():
    from sbatch_gen.xr_options import CrossRegion, outer_step_warnings

    def warn(**kw):
        xr = CrossRegion(enabled=True, region="eu", regions=["eu", "us"], overlap="streaming", **kw)
        return [f for f, _ in outer_step_warnings(xr)]

    # the best of the sweep at H 50 and 100: no warning (without streaming the same setting warns)
    assert warn(inner_steps=100, outer_lr=0.7, outer_momentum=0.9, fragments=4, fragment_delay_steps=5) == []
    none = CrossRegion(
        enabled=True, region="eu", regions=["eu", "us"], inner_steps=100, outer_lr=0.7, outer_momentum=0.9
    )
    assert [f for f, _ in outer_step_warnings(none)] == ["outer_lr"]
    # plain averaging (the defaults) with streaming, and a delay of half the gap or more
    assert warn(inner_steps=100, fragments=4, fragment_delay_steps=5) == ["outer_momentum"]
    assert warn(inner_steps=100, outer_lr=0.7, outer_momentum=0.9, fragments=4, fragment_delay_steps=13) == [
        "fragment_delay_steps"
    ]
    assert warn(inner_steps=100, outer_lr=0.7, outer_momentum=0.9, fragments=4, fragment_delay_steps=12) == []
    # outside the measured H: no evidence either way
    assert warn(inner_steps=500, fragments=4, fragment_delay_steps=100) == []
