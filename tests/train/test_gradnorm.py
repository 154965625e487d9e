"""The canonical gradient norm of grad mode (sbatch_gen/train/gradnorm.py). Its sharding independence is
checked end to end by tests/xr/test_fsdp.py (the grad-mode trainer run: FSDP over 2 ranks beside DDP on 1,
clipping on, the same exported bytes; torch's norm gave different bytes there)."""

from __future__ import annotations

import torch

from sbatch_gen.train.gradnorm import canonical_grad_norm, tree_sum


def test_a_rows_tree_sum_has_the_same_bits_whatever_the_rows_beside_it():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(7, 37, generator=g) * torch.logspace(-3, 3, 37)
    whole = tree_sum(m)
    for lo, hi in ((0, 4), (4, 7), (3, 4), (0, 7)):  # Shard(0) slices of any world size
        assert torch.equal(tree_sum(m[lo:hi]), whole[lo:hi])
    assert torch.allclose(whole.double(), m.double().sum(1), rtol=1e-6)
    assert tree_sum(torch.tensor([2.5])).item() == 2.5 and tree_sum(torch.zeros(0)).item() == 0.0


def test_the_norm_is_torchs_within_rounding_and_a_missing_gradient_counts_as_zero():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    net(torch.randn(5, 9)).square().sum().backward()
    params = list(net.parameters())
    want = torch.nn.utils.get_total_norm([p.grad for p in params])
    got = canonical_grad_norm(params, torch.device("cpu"))
    assert got.dtype == torch.float32 and got.shape == ()
    assert abs(got.item() - want.item()) <= 1e-6 * want.item(), (got, want)
    params[1].grad = None
    rest = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    assert abs(canonical_grad_norm(params, torch.device("cpu")).item() - rest.item()) <= 1e-6 * rest.item()
