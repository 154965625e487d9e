"""The companion GPT's trainable parameters and their shapes, from its config, without torch: what the
regions of a cross-region run must agree on (they exchange one flat vector of these parameters in this
order, however each region shards them), so ``sbatch-gen validate`` can compare the sites' train configs.
:class:`~.model.GPT` builds exactly these (``tests/train/test_shapes.py``)."""

from __future__ import annotations

from typing import Protocol

Shape = tuple[int, ...]


class Dims(Protocol):
    """What the shapes depend on: the fields of :class:`~.config.ModelConfig` of those names."""

    n_layers: int
    d_model: int
    vocab_size: int
    seq_len: int
    mlp_ratio: int
    tie_embeddings: bool


def parameter_shapes(m: Dims) -> list[tuple[str, Shape]]:
    """``(name, shape)`` of each trainable parameter, in ``GPT(m).named_parameters()`` order."""
    d, hidden = m.d_model, m.mlp_ratio * m.d_model
    block: list[tuple[str, Shape]] = [
        ("ln1.weight", (d,)),
        ("ln1.bias", (d,)),
        ("attn.qkv.weight", (3 * d, d)),
        ("attn.proj.weight", (d, d)),
        ("ln2.weight", (d,)),
        ("ln2.bias", (d,)),
        ("mlp.up.weight", (hidden, d)),
        ("mlp.down.weight", (d, hidden)),
    ]
    out: list[tuple[str, Shape]] = [("tok.weight", (m.vocab_size, d)), ("pos.weight", (m.seq_len, d))]
    out += [(f"blocks.{i}.{n}", s) for i in range(m.n_layers) for n, s in block]
    out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    # tied: the head is the token embedding, which named_parameters() names once
    return out if m.tie_embeddings else [*out, ("head.weight", (m.vocab_size, d))]
