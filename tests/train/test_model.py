"""The demo model: shapes, activation checkpointing, FLOP accounting, LR schedule, MFU peaks."""

import pytest
import torch

from sbatch_gen.train.config import ModelConfig
from sbatch_gen.train.metrics import peak_flops, percentile
from sbatch_gen.train.model import GPT, flops_per_token


def _cfg(**kw):
    base = dict(n_layers=2, d_model=32, n_heads=4, seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def test_forward_and_tied_head():
    torch.manual_seed(0)
    m = GPT(_cfg())
    x = torch.randint(0, 256, (3, 16))
    assert m(x).shape == (3, 16, 256)
    assert m.head.weight is m.tok.weight
    loss = m(x, torch.randint(0, 256, (3, 16)))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near uniform at init


def test_activation_checkpointing_gives_the_same_gradients():
    x = torch.randint(0, 256, (2, 16))
    grads = []
    for ac in (False, True):
        torch.manual_seed(0)
        m = GPT(_cfg(activation_checkpointing=ac, dropout=0.1))
        torch.manual_seed(1)
        m(x, x).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_flops_per_token():
    cfg = _cfg()
    m = GPT(cfg)
    n = m.num_params(exclude_embeddings=True)
    assert n == m.num_params() - 16 * 32  # position embedding only (head is tied to tok)
    model, hw = flops_per_token(cfg, n)
    assert model == 6 * n + 12 * 2 * 32 * 16 and hw == model
    _, hw_ac = flops_per_token(_cfg(activation_checkpointing=True), n)
    assert hw_ac == pytest.approx(model * 4 / 3)


def test_peaks_and_percentile():
    assert peak_flops("NVIDIA GH200 480GB") == 989e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA B200") == 2250e12
    assert peak_flops("Tesla T4") is None
    xs = list(range(1, 101))
    assert percentile(xs, 50) == 50 and percentile(xs, 99) == 99 and percentile(xs, 100) == 100


def test_lr_schedule(tmp_path):
    from sbatch_gen.train.config import load_config
    from sbatch_gen.train.optim import lr_at

    from .conftest import write_config

    cfg = load_config(
        write_config(
            tmp_path / "c.yaml", train={"steps": 100}, optim={"lr": 1.0, "min_lr": 0.1, "warmup_steps": 10}
        )
    )
    assert lr_at(cfg, 1) == pytest.approx(0.1) and lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 55) == pytest.approx(0.55) and lr_at(cfg, 100) == pytest.approx(0.1)
    assert all(lr_at(cfg, s) >= lr_at(cfg, s + 1) for s in range(10, 100))
