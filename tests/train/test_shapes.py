"""The companion model's parameter names and shapes without torch (``sbatch_gen/train/shapes.py``, what
``sbatch-gen validate`` compares across the sites of a run and Streaming DiLoCo splits into fragments) are
exactly what the torch model builds."""

from __future__ import annotations

import pytest

from sbatch_gen.train.config import ModelConfig
from sbatch_gen.train.model import GPT
from sbatch_gen.train.shapes import parameter_shapes


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_layers=1, d_model=16, n_heads=2, seq_len=8),
        dict(n_layers=3, d_model=32, n_heads=4, seq_len=12, tie_embeddings=False),
        dict(n_layers=2, d_model=24, n_heads=3, seq_len=5, vocab_size=300, mlp_ratio=2),
    ],
    ids=["tied", "untied", "vocab-mlp"],
)
def test_the_torch_free_shapes_are_the_models_named_parameters(kw):
    cfg = ModelConfig(**kw)
    built = [(name, tuple(p.shape)) for name, p in GPT(cfg).named_parameters()]
    assert parameter_shapes(cfg) == built
    assert cfg.parameter_names() == [name for name, _ in built]
