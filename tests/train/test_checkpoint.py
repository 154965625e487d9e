"""Checkpoint selection: completion marker, damaged files, keep-last-K, model-shape check."""

import json
import logging

import pytest
import torch

from sbatch_gen.train.checkpoint import (
    MARKER,
    Checkpointer,
    CheckpointError,
    check_complete,
    check_model_shapes,
    newest_complete,
    prune,
    step_dir,
    write_marker,
)
from sbatch_gen.train.config import ModelConfig
from sbatch_gen.train.dist import DistInfo
from sbatch_gen.train.model import GPT


def _fake(run_dir, step, complete=True, crc=False):
    d = step_dir(run_dir, step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 1))
    (d / ".metadata").write_bytes(b"meta")
    if complete:
        write_marker(d, step, crc=crc)
    return d


def test_marker_written_last_lists_every_file(tmp_path):
    d = _fake(tmp_path, 3)
    m = json.loads((d / MARKER).read_text())
    assert m["step"] == 3 and m["files"] == {".metadata": 4, "__0_0.distcp": 256 * 4}
    assert check_complete(d) is None


def test_newest_complete_skips_incomplete_and_damaged(tmp_path, caplog):
    _fake(tmp_path, 5)
    _fake(tmp_path, 10)
    _fake(tmp_path, 15, complete=False)  # a save that never finished
    truncated = _fake(tmp_path, 20)
    with open(truncated / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    flipped = _fake(tmp_path, 25, crc=True)
    data = bytearray((flipped / "__0_0.distcp").read_bytes())
    data[7] ^= 0xFF  # same size, different bytes: only the CRC sees it
    (flipped / "__0_0.distcp").write_bytes(bytes(data))
    garbled = _fake(tmp_path, 30)
    (garbled / MARKER).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="sbatch_gen.train"):
        assert newest_complete(tmp_path) == step_dir(tmp_path, 10)
    text = caplog.text
    assert "step-30 ignored" in text and "unreadable" in text
    assert "step-25 ignored: __0_0.distcp fails its CRC32 check" in text
    assert "step-20 ignored: __0_0.distcp has 100 bytes, the marker says 5376" in text
    assert "step-15 ignored: no COMPLETE.json" in text
    assert check_complete(step_dir(tmp_path, 25), verify_crc=False) is None


def test_newest_complete_none(tmp_path):
    assert newest_complete(tmp_path) is None
    _fake(tmp_path, 1, complete=False)
    assert newest_complete(tmp_path) is None


def test_prune_keeps_last_k_and_newer_incomplete(tmp_path):
    for s in (1, 2, 3, 4):
        _fake(tmp_path, s)
    _fake(tmp_path, 0, complete=False)  # crash leftover older than the newest complete: removed
    _fake(tmp_path, 9, complete=False)  # maybe a save in flight: kept
    removed = prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step-0", "step-1", "step-2"]
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step-3", "step-4", "step-9"]


def _tiny(**kw):
    base = dict(n_layers=1, d_model=16, n_heads=2, seq_len=8)
    base.update(kw)
    return ModelConfig(**base)


def test_real_dcp_roundtrip_and_shape_mismatch(tmp_path):
    torch.manual_seed(0)
    model = GPT(_tiny())
    ck = Checkpointer(tmp_path, DistInfo(), torch.device("cpu"), keep_last=1, async_save=False,
                      marker_extra={"model": _tiny().model_dump()}, crc=True)
    res = ck.save(7, {"model": model.state_dict(), "train": {"step": 7}})
    assert res.path == step_dir(tmp_path, 7) and check_complete(res.path) is None
    assert "crc32" in json.loads((res.path / MARKER).read_text())
    # Saving the same step again is a no-op (a stop right after a periodic save).
    assert ck.save(7, {"model": model.state_dict(), "train": {"step": 7}}).seconds == 0.0
    # Another process reaching step 7 again (it resumed from an older checkpoint) replaces it.
    ck2 = Checkpointer(tmp_path, DistInfo(), torch.device("cpu"), keep_last=1, async_save=False,
                       marker_extra={"model": _tiny().model_dump()})
    assert ck2.save(7, {"model": model.state_dict(), "train": {"step": 7}}).seconds > 0.0

    other = GPT(_tiny())
    state = {"model": other.state_dict(), "train": {"step": 0}}
    ck.load(res.path, state)
    assert state["train"]["step"] == 7
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k])

    wider = GPT(_tiny(d_model=32))
    with pytest.raises(CheckpointError, match=r"saved for a different model: .*has shape \[.*16\] in the "
                       r"checkpoint, \[.*32\] in this model.*model config differs .*d_model=16->32"):
        check_model_shapes(res.path, wider.state_dict(), _tiny(d_model=32).model_dump())
    deeper = GPT(_tiny(n_layers=2))
    with pytest.raises(CheckpointError, match=r"blocks\.1\..* is not in the checkpoint"):
        check_model_shapes(res.path, deeper.state_dict())
