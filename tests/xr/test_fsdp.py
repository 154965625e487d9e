"""Sharded (FSDP2) regions in the DiLoCo library: regions of different shapes exchange deltas through the
mailbox (each cuts its payload into shards where its ranks' parameter shards end; a reader takes what
overlaps its own) and hold bit-identical outer state after every round, equal to a float64 reference; and
what the library refuses, one line naming the parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from sbatch_gen.train.xr.flat import FlatParams, shard_rows
from sbatch_gen.train.xr.protocol import ShardPlan

from .test_sync import xr_for
from .workers import launch
from .workers import wait as _wait_workers

REGIONS = ["eu", "us"]
LR, MU = 0.7, 0.9  # tests/xr/fsdp_worker.py's outer_lr and outer_momentum


def _launch(region: str, kind: str, nproc: int, out: Path, root: Path, payload: str, *extra: str):
    args = ["--root", str(root), "--kind", kind, "--payload", payload, *extra]
    return launch("fsdp_worker", region, REGIONS, nproc, out, *args)


def _reference(theta, mom, xs, tokens, payload):
    """The round in float64 from the unsharded inputs: each region's delta (theta - x in fp32, as it is
    published: bf16-rounded for a bf16 payload), their token-weighted average, the Nesterov step."""
    ds = []
    for x in xs:
        d = theta - x
        ds.append((d.to(torch.bfloat16) if payload == "bf16" else d).double())
    g = sum(t / sum(tokens) * d for t, d in zip(tokens, ds, strict=True))
    m = MU * mom.double() + g
    return theta.double() - LR * (g + MU * m), m


@pytest.mark.slow
@pytest.mark.parametrize(
    "us, payload",
    [(("fsdp", 1), "bf16"), (("ddp", 2), "bf16"), (("ddp", 2), "int8"), (("ddp", 2), "sparse")],
    ids=["fsdp2-fsdp1-bf16", "fsdp2-ddp2-bf16", "fsdp2-ddp2-int8", "fsdp2-ddp2-sparse"],
)
def test_regions_of_different_shapes_hold_the_same_outer_state(us, payload, tmp_path):
    """eu: FSDP2 over 2 ranks (uneven rows; rank 1 holds no row of the last layer), each rank holding the
    outer state of its own shards only; us: FSDP2 over 1 rank or DDP over 2. Three rounds. After each one
    both regions' whole theta_outer and momentum (assembled from their ranks) are the same bits, and (bf16)
    equal to the float64 reference computed here from the unsharded deltas within 1e-6 * (1 + |value|):
    the library computes in fp32, each element through about 8 roundings (the weighted sum's multiplies and
    adds, the momentum and the step), each at most 2**-24 relative; values are O(1). int8: the same bits in
    both regions (the reference would need the quantisation; tests/xr/test_scaled.py covers it); sparse
    likewise (tests/xr/test_sparse.py has the reference)."""
    shapes = {"eu": ("fsdp", 2), "us": us}
    runs = [
        (_launch(r, kind, n, tmp_path / "out", tmp_path / "mailbox", payload), r)
        for r, (kind, n) in shapes.items()
    ]
    _wait_workers(runs)
    res = {r: torch.load(tmp_path / "out" / f"{r}.pt", weights_only=False) for r in REGIONS}
    eu, other = res["eu"]["rounds"], res["us"]["rounds"]
    assert [s for s, *_ in eu] == [s for s, *_ in other] == [0, 2, 4, 6]
    tokens = [8 * 2 * n for _, n in shapes.values()]  # 8 a rank a step, 2 steps a round
    for (step, theta, mom, *_), (_, theta_us, mom_us, *_) in zip(eu, other, strict=True):
        assert not theta.isnan().any() and not mom.isnan().any(), step
        assert torch.equal(theta, theta_us) and torch.equal(mom, mom_us), (
            f"the regions differ after step {step}"
        )
    for i in range(1, len(eu)):
        (_, t0, m0, *_), (step, t1, m1, x_eu, _) = eu[i - 1], eu[i]
        assert not torch.equal(t1, t0), f"round at step {step} changed nothing"
        if payload != "bf16":
            continue
        ref_t, ref_m = _reference(t0, m0, [x_eu, other[i][3]], tokens, payload)
        for got, want in ((t1, ref_t), (m1, ref_m)):
            err = (got.double() - want).abs() / (1 + want.abs())
            assert err.max() <= 1e-6, f"step {step}: {err.max():.3g} from the float64 reference"
    # FSDP: eu's rank 0 holds the outer state of its own shards only, 4 buffers x 4 B each: rows 0:3 of the
    # first layer (18 + 3 elements) and the last layer's only row (5 + 1), 27 of the model's 41 elements
    eu0 = res["eu"]
    # (sparse: 4 B more, the error-feedback buffer; each rank sparsifies its own shards)
    assert (eu0["numel"], eu0["local"], eu0["bytes"]) == (41, 27, (20 if payload == "sparse" else 16) * 27)


@pytest.mark.slow
@pytest.mark.parametrize(
    "payload, size, part, whole",
    # us's one object: W1 (48 x 64), b1, W2 (1 x 48), b2 one after the other; eu rank 0 needs W1's rows 0:24
    # and the first half of b1, W2 and b2; rank 1 W1's rows 24:48 and the rest of b1
    [
        # bf16: W1 at bytes 0..6144, b1 ..6240, W2 ..6336, b2 ..6338. Rank 0 reads chunks 0-11 of W1 and
        # chunk 24 (6144..6338: b1, W2, b2), rank 1 chunks 12-23 and chunk 24: 3072 + 194 bytes each
        ("bf16", 6338, [3266, 3266], 6338),
        # int8 (12 scales, then the values, of each shard): W1 at 0..3120, b1 ..3172, W2 ..3224, b2 ..3229.
        # Rank 0: W1's first 6 blocks (scales 0..24, values 48..1584: chunks 0-6) and chunk 12 (3072..3229);
        # rank 1: the other 6 blocks (scales 24..48: chunk 0; values 1584..3120: chunks 6-12). eu's two
        # objects hold 4 bytes more than us's: b1, cut in two there, has one more scale
        ("int8", 3229, [1792 + 157, 256 + 1693], 3233),
        # sparse (chunks of 64 elements, 6 kept: 15 bytes each, per shard): W1 at 0..720 (48 chunks), b1
        # ..735, W2 ..750, b2 ..765 (one padded chunk each), integrity chunks of 64 bytes. Rank 0 needs W1's
        # chunks 0-23 (0..360: integrity chunks 0-5) and b1, W2, b2 (720..765: chunk 11); rank 1 W1's chunks
        # 24-47 (360..720: chunks 5-11) and b1 (in chunk 11): 445 bytes each. eu's objects: 405 + 375 bytes
        ("sparse", 765, [384 + 61, 445], 780),
    ],
)
def test_an_fsdp_rank_reads_its_part_of_a_peer_and_writes_one_object_a_round(
    payload, size, part, whole, tmp_path
):
    """eu: FSDP2 over 2 ranks; us: FSDP2 over 1. A model of 3169 elements, shard_mb large enough for a
    rank's part, integrity chunks of 256 bytes (sparse, whose object is a few hundred bytes: 64). Every rank writes ONE object a round; an eu rank reads only the chunks
    of us's object that hold its rows (about half of the payload: its rows' bytes rounded out to whole
    chunks), us reads both of eu's objects whole; both regions end each round on the same bits."""
    out = tmp_path / "out"
    extra = ("--dims", "64,48,1", "--shard-mb", "1", "--chunk-bytes", "64" if payload == "sparse" else "256")
    runs = [
        (_launch(r, "fsdp", n, out, tmp_path / "mailbox", payload, *extra), r)
        for r, n in (("eu", 2), ("us", 1))
    ]
    _wait_workers(runs)
    res = {r: torch.load(out / f"{r}.pt", weights_only=False) for r in REGIONS}
    for (step, theta, mom, *_), (_, theta_us, mom_us, *_) in zip(
        res["eu"]["rounds"], res["us"]["rounds"], strict=True
    ):
        assert torch.equal(theta, theta_us) and torch.equal(mom, mom_us), (
            f"the regions differ after step {step}"
        )
    assert res["eu"]["numel"] == 3169 and len(res["eu"]["io"]) == len(res["us"]["io"]) == 3
    for eu, us in zip(res["eu"]["io"], res["us"]["io"], strict=True):
        assert [n for _, n in eu] == [1, 1] and us == [(whole, 1)], (eu, us)
        assert [b for b, _ in eu] == part and all(0.45 < b / size < 0.65 for b in part), eu


@pytest.mark.slow
def test_a_sharded_region_resumes_with_another_world_size_from_its_checkpoint(tmp_path):
    """eu (FSDP over 2 ranks) checkpoints after round 2 (DCP: the outer state as DTensors placed like the
    parameters) beside us (DDP over 2). eu then comes back as ONE rank from that checkpoint and re-enters
    round 3 (its delta is in the mailbox already): DCP reshards its outer state, and it ends on exactly the
    outer state and parameters of the uninterrupted run, which only a correctly resharded theta_outer and
    momentum give."""
    mb, first, again = tmp_path / "mailbox", tmp_path / "first", tmp_path / "again"
    runs = [
        (_launch("eu", "fsdp", 2, first, mb, "bf16", "--save-at", "4"), "eu"),
        (_launch("us", "ddp", 2, first, mb, "bf16"), "us"),
    ]
    _wait_workers(runs)
    _wait_workers(
        [(_launch("eu", "fsdp", 1, again, mb, "bf16", "--resume", str(first / "ckpt")), "eu again")]
    )
    done = torch.load(first / "eu.pt", weights_only=False)["rounds"]
    back = torch.load(again / "eu.pt", weights_only=False)["rounds"]
    assert [s for s, *_ in back] == [4, 6]
    for (s0, t0, m0, *_), (s1, t1, m1, *_) in zip(done[2:], back, strict=True):
        assert s0 == s1 and torch.equal(t0, t1) and torch.equal(m0, m1), (
            f"step {s0}: the resumed region differs"
        )


# -- refusals and the plan, in this process (a one-rank gloo group) ----------------------------------------------


def _placed(placements, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    net = nn.Sequential(nn.Linear(3, 4))
    net[0].weight = nn.Parameter(distribute_tensor(net[0].weight.detach(), mesh, placements))
    net[0].bias = nn.Parameter(distribute_tensor(net[0].bias.detach(), mesh, [Replicate()] * len(mesh_shape)))
    return net


def test_tensor_parallel_dtensors_are_refused_naming_the_parameter(one_rank):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard

    with pytest.raises(
        ValueError, match=r"^parameter 0.weight is a DTensor placed as \[Replicate\(\)\] on a 1-D "
    ):
        FlatParams(_placed([Replicate()], (1,)))
    with pytest.raises(
        ValueError, match=r"^parameter 0.weight is a DTensor placed as .* on a 2-D mesh: only "
    ):
        FlatParams(_placed([Shard(0), Replicate()], (1, 1)))
    with pytest.raises(ValueError, match=r"^parameter 0.weight is a DTensor placed as \[Shard\(dim=1\)\]"):
        FlatParams(_placed([Shard(1)], (1,)))
    half = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(half[0])  # the root left whole: 1.weight stays a plain tensor
    with pytest.raises(
        ValueError, match=r"^parameter 1.weight is a plain tensor beside sharded \(DTensor\) ones"
    ):
        FlatParams(half)


def test_a_sharded_model_takes_every_sync_mode(one_rank, tmp_path):
    """Each mode builds its sync on a sharded model (tests/xr/test_fsdp_modes.py runs them across regions);
    with fragments, each fragment's payload is tiled by the ranks' pieces of it, counted from its start."""
    from torch.distributed.fsdp import fully_shard

    from sbatch_gen.train.xr.modes import create

    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(net)
    for opts in (
        {"sync": "grad"},
        {"overlap": "eager"},
        {"overlap": "streaming", "fragments": 2, "fragment_delay_steps": 1},
    ):
        sync = create(xr_for("eu", str(tmp_path), **opts), net, torch.device("cpu"), one_rank)
        assert sync.sharded, opts
        sync.close()
    flat = FlatParams(net, fragments=2)
    assert flat.fragment_bounds == [0, 16, 26] and [flat.fragment(p) for p in (0, 1)] == [(0, 16), (16, 26)]
    numel, pieces, at, mine = flat.fragment_payload(1)
    assert (
        (numel, pieces, mine) == (10, [(0, 8, 0), (8, 10, 0)], 10) and at is not None and at(8, 10) == (8, 10)
    )


def test_a_sharded_region_cuts_its_payload_where_each_ranks_rows_end():
    """Shard(0)'s rows (torch.chunk's split, the last ranks possibly empty) and the plan every rank of a
    region derives from them: each rank owns the shards of its own ranges, cut at shard_mb."""
    assert [shard_rows(5, 2, k) for k in range(2)] == [(0, 3), (3, 5)]
    assert [shard_rows(1, 2, k) for k in range(2)] == [(0, 1), (1, 1)]
    assert [shard_rows(3, 4, k) for k in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    plan = ShardPlan.pieces(10, [(0, 6, 0), (6, 10, 1)], 4, 16 / (1 << 20))  # 4 elements a shard
    assert plan.bounds == ((0, 4), (4, 6), (6, 10))
    assert plan.owned(0, 2) == [0, 1] and plan.owned(1, 2) == [2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "opts, last",
    [
        ({"snapshot_every": 2}, 3),
        ({"snapshot_every": 2, "overlap": "eager"}, 3),
        ({"snapshot_every": 2, "overlap": "streaming", "fragments": 2, "fragment_delay_steps": 1}, 6),
        ({"sync": "grad", "keep_rounds": 12}, 12),
    ],
    ids=["diloco", "eager", "streaming", "grad"],
)
def test_the_trainer_trains_an_fsdp_region_beside_a_ddp_region_to_the_same_model(
    opts, last, tmp_path, repo, data_dir
):
    """The trainer with ``parallelism.kind: fsdp`` and each cross-region sync mode: eu FSDP over 2 ranks, us
    DDP on 1 rank, over a directory mailbox; 12 steps, H=4 (DiLoCo: a snapshot every 2 rounds; eu, the first
    member, publishes every second round's snapshot from its ranks' shards; grad mode clips, by the
    canonical norm). Both record the same rounds, up to ``last``, and end on the same exported bytes."""
    from .test_multiproc import assert_same_params, metrics, train_regions

    shapes = {"eu": ({"kind": "fsdp"}, 2), "us": ({"kind": "ddp"}, 1)}
    train_regions(tmp_path, repo, data_dir, shapes, **opts)
    assert_same_params(tmp_path / "eu", tmp_path / "us")
    rounds = [[x["xr_round"] for x in metrics(tmp_path / r) if "xr_round" in x] for r in REGIONS]
    assert rounds[0] == rounds[1] and rounds[0][-1] == last, rounds
    shots = [x for x in metrics(tmp_path / "eu") if x.get("event") == "xr_snapshot"]
    assert [x["round"] for x in shots] == (list(range(2, last + 1, 2)) if "snapshot_every" in opts else [])


def test_a_manifest_may_tile_the_payload_any_way_but_not_leave_gaps():
    """A reader takes any contiguous tiling in order (another region's cut) and finds the shards over a range;
    a gap, an overlap or a short cover is refused, naming the shard."""
    from sbatch_gen.train.xr.errors import XRLayoutError
    from sbatch_gen.train.xr.protocol import Expect, Manifest, ShardInfo, overlapping

    mine = ShardPlan.make(10, 4, 16 / (1 << 20))  # 4 elements a shard: [0,4) [4,8) [8,10)

    def manifest(cuts):
        shards = [ShardInfo(i, a, b - a, 4 * (b - a), "") for i, (a, b) in enumerate(cuts)]
        return Manifest("t", "us", "r000001", "delta", 1, "fp32", 10, "L", "raw", 1, shards)

    expect = Expect("delta", "fp32", 10, "L", "raw", mine)
    other = manifest([(0, 3), (3, 5), (5, 10)])
    expect.check(other, "t", "r000001", "us", "here")
    assert [s.index for s in overlapping(other.shards, 4, 8)] == [1, 2]
    assert [s.index for s in overlapping(other.shards, 0, 3)] == [0]
    for cuts, why in (
        ([(0, 3), (4, 10)], "shard 1 covers \\[4, 10\\), expected shard 1 from element 3"),
        ([(0, 5), (3, 10)], "shard 1 covers \\[3, 10\\), expected shard 1 from element 5"),
        ([(0, 5), (5, 9)], "the shards cover \\[0, 9\\), expected \\[0, 10\\)"),
    ):
        with pytest.raises(XRLayoutError, match=why):
            expect.check(manifest(cuts), "t", "r000001", "us", "here")
