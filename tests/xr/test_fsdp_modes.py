"""Sharded (FSDP2) regions with the other sync modes: streaming DiLoCo, DiLoCo with ``overlap: eager`` and
per-step gradient averaging (``sync: grad``). Each time two regions of different shapes (one FSDP over 2
ranks, whose rank 1 holds no row of the last layer; the other FSDP or DDP on 1 rank) hold bit-identical
shared state after every round, equal to a float64 reference computed here from the unsharded inputs; and
the trainer runs each mode with an FSDP region beside a DDP one to the same model."""

from __future__ import annotations

import pytest
import torch

from sbatch_gen.train.xr.fragments import fragment_of, round_step

from .test_fsdp import LR, MU, REGIONS, _launch
from .test_overlap import nesterov64
from .workers import wait as _wait_workers

pytestmark = pytest.mark.slow  # torchrun regions over a directory mailbox

TOL = 1e-6  # see test_fsdp.test_regions_of_different_shapes_hold_the_same_outer_state


def _run(tmp_path, shapes: dict, *extra: str) -> dict:
    """One torchrun of tests/xr/fsdp_worker.py per region (bf16 payloads); their results."""
    out, mb = tmp_path / "out", tmp_path / "mailbox"
    _wait_workers([(_launch(r, kind, n, out, mb, "bf16", *extra), r) for r, (kind, n) in shapes.items()])
    return {r: torch.load(out / f"{r}.pt", weights_only=False) for r in REGIONS}


def _tokens(shapes: dict) -> list[int]:
    """Each region's token weight (8 tokens a rank a step: proportional to its ranks in every round)."""
    return [n for _, n in shapes.values()]


def _average(xs: list[torch.Tensor], shapes: dict) -> torch.Tensor:
    """The regions' values as they cross the wire (bf16), token-weighted, in float64."""
    w = _tokens(shapes)
    return sum(t / sum(w) * x.to(torch.bfloat16).double() for t, x in zip(w, xs, strict=True))


def _step(theta: torch.Tensor, mom: torch.Tensor, deltas: list[torch.Tensor], shapes: dict):
    """The outer Nesterov step of the regions' deltas, in float64: (theta_outer, momentum)."""
    return nesterov64(theta.double(), mom.double(), _average(deltas, shapes), LR, MU)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got.double() - want).abs() / (1 + want.abs())
    assert err.max() <= TOL, f"{what}: {err.max():.3g} from the float64 reference"


def _same_every_round(res: dict) -> list:
    """Both regions recorded the same steps, and the same theta_outer and momentum bits at each; eu's."""
    eu, us = res["eu"]["rounds"], res["us"]["rounds"]
    assert [e[0] for e in eu] == [e[0] for e in us]
    for (step, t, m, *_), (_, t_us, m_us, *_) in zip(eu, us, strict=True):
        assert not t.isnan().any() and not m.isnan().any(), step
        assert torch.equal(t, t_us) and torch.equal(m, m_us), f"the regions differ after step {step}"
    return eu


def test_streaming_fsdp_region_beside_a_ddp_region(tmp_path):
    """Streaming DiLoCo, F = 2 fragments (layer 0, 35 elements; layer 2, 6: eu's rank 1 holds none of it),
    H = 4, tau = 1: a round every 2 steps, merged a step later, the last one by ``finish``. Each merge
    changes its fragment's theta_outer and momentum only, by the float64 reference of the deltas taken at
    its round's start (theta_outer - x, bf16 on the wire); the rest stays the same bits."""
    shapes = {"eu": ("fsdp", 2), "us": ("ddp", 1)}
    h, f, tau = 4, 2, 1
    res = _run(tmp_path, shapes, "--overlap", "streaming", "--inner-steps", str(h), "--steps", "8",
               "--fragments", str(f), "--tau", str(tau))  # fmt: skip
    eu = _same_every_round(res)
    bounds = res["eu"]["fragment_bounds"]
    assert len(bounds) == f + 1 and bounds[-1] == res["eu"]["numel"] == 41
    merges = 0
    for (_, t0, m0, *_), (step, t1, m1, *_) in zip(eu, eu[1:], strict=False):
        if torch.equal(t1, t0):
            continue  # a round started: nothing merged yet
        merges += 1
        p, start = fragment_of(merges, f), round_step(merges, h, f)
        assert step == min(start + tau, 8), f"round {merges} merged at step {step}"
        lo, hi = bounds[p], bounds[p + 1]
        deltas = [t0[lo:hi] - res[r]["xs"][start][lo:hi] for r in REGIONS]  # fp32, as published
        ref_t, ref_m = _step(t0[lo:hi], m0[lo:hi], deltas, shapes)
        _close(t1[lo:hi], ref_t, f"theta_outer of fragment {p} at step {step}")
        _close(m1[lo:hi], ref_m, f"momentum of fragment {p} at step {step}")
        rest = torch.ones(t0.numel(), dtype=torch.bool)
        rest[lo:hi] = False
        assert torch.equal(t1[rest], t0[rest]) and torch.equal(m1[rest], m0[rest]), step
    assert merges == 4
    # eu's rank 0 holds its shards only: 27 of the 41 elements (see test_fsdp), 5 buffers of 4 B each
    assert (res["eu"]["local"], res["eu"]["bytes"]) == (27, 5 * 4 * 27)


def test_eager_fsdp_region_beside_a_one_rank_fsdp_region(tmp_path):
    """overlap eager, H = 2, 6 steps: round b's exchange runs during the next H steps; at boundary b the
    shared state takes round b-1's average (of each region's bf16(w - x): w the model given at the boundary
    before, x the parameters reached since), then ``finish`` takes the last round's."""
    shapes = {"eu": ("fsdp", 2), "us": ("fsdp", 1)}
    res = _run(tmp_path, shapes, "--overlap", "eager")
    eu = _same_every_round(res)
    assert [e[0] for e in eu] == [0, 2, 4, 6, 6]
    assert torch.equal(eu[1][1], eu[0][1]), "the first boundary has no round to take in"
    us = res["us"]["rounds"]
    for b in range(2, len(eu)):
        (_, t0, m0, *_), (step, t1, m1, *_) = eu[b - 1], eu[b]
        deltas = [rounds[b - 2][4] - rounds[b - 1][3] for rounds in (eu, us)]  # w - x, fp32 as published
        ref_t, ref_m = _step(t0, m0, deltas, shapes)
        _close(t1, ref_t, f"theta_outer at boundary {b} (step {step})")
        _close(m1, ref_m, f"momentum at boundary {b} (step {step})")
    assert (res["eu"]["local"], res["eu"]["bytes"]) == (27, 5 * 4 * 27)


def test_grad_mode_fsdp_region_beside_a_ddp_region(tmp_path):
    """sync: grad, 4 steps: each region's gradient (FSDP: reduce-scattered, each rank averages its shards'
    part across regions) becomes the token-weighted average of the regions' bf16 gradients, the same bits in
    both, and the parameters after every optimizer step are the same bits."""
    shapes = {"eu": ("fsdp", 2), "us": ("ddp", 1)}
    res = _run(tmp_path, shapes, "--sync", "grad", "--steps", "4")
    eu, us = res["eu"]["grads"], res["us"]["grads"]
    assert [g[0] for g in eu] == [g[0] for g in us] == [1, 2, 3, 4]
    for (step, before, after, params), (_, before_us, after_us, params_us) in zip(eu, us, strict=True):
        assert not torch.equal(before, before_us), step
        assert torch.equal(after, after_us), f"the averaged gradients differ at step {step}"
        assert torch.equal(params, params_us), f"the parameters differ after step {step}"
        _close(after, _average([before, before_us], shapes), f"the averaged gradient at step {step}")
