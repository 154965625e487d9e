"""model.safetensors with a canonical header: two regions that end on the same bits write the same bytes."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sbatch_gen.train.export import canonical_header, save_model

TENSORS = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
META = {"step": "4", "model": json.dumps({"d_model": 8, "n_layers": 1})}


def _header(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw, n, json.loads(raw[8 : 8 + n])


def _rewrite(path, header, n=None, indent=None):
    """The file with ``header`` serialized as given (key order kept), padded to ``n`` when given."""
    raw, old_n, _ = _header(path)
    text = json.dumps(header, indent=indent, separators=None if indent else (",", ":")).encode()
    text = text.ljust(n) if n is not None else text + b" " * (-(8 + len(text)) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + old_n :])


def test_the_same_tensors_and_metadata_in_another_order_become_the_same_bytes(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_model(TENSORS, a, META)
    save_file(TENSORS, str(b), metadata=META)
    _, n, header = _header(b)
    reordered = {k: header[k] for k in reversed(header)}  # tensors and __metadata__ in reverse
    reordered["__metadata__"] = dict(reversed(header["__metadata__"].items()))
    _rewrite(b, reordered, n)
    assert a.read_bytes() != b.read_bytes()
    canonical_header(b)
    assert a.read_bytes() == b.read_bytes()
    got = load_file(str(a))
    assert got.keys() == TENSORS.keys() and all(torch.equal(got[k], TENSORS[k]) for k in TENSORS)
    with safe_open(str(a), "pt") as f:
        assert f.metadata() == META


def test_a_header_of_another_length_is_rewritten_whole(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_model(TENSORS, a, META)
    raw_a, n_a, header = _header(a)
    save_file(TENSORS, str(b), metadata=META)
    _rewrite(b, header, indent=2)  # pretty-printed: a longer header, the same data section
    assert _header(b)[1] > n_a
    canonical_header(b)
    assert b.read_bytes() == raw_a and not list(tmp_path.glob("*.canonical"))
    assert torch.equal(load_file(str(b))["w"], TENSORS["w"])
