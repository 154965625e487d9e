"""Checkpoint selection: completion marker, damaged files, keep-last-K, model-shape check."""

import json
import logging
import warnings

import pytest
import torch

from sbatch_gen.train.checkpoint import (
    MARKER,
    Checkpointer,
    CheckpointError,
    check_complete,
    check_model_shapes,
    drop_unsaved,
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
    ck = Checkpointer(
        tmp_path,
        DistInfo(),
        torch.device("cpu"),
        keep_last=1,
        async_save=False,
        marker_extra={"model": _tiny().model_dump()},
        crc=True,
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        res = ck.save(7, {"model": model.state_dict(), "train": {"step": 7}})
    # a single-process run's log gets no UserWarning from DCP that it assumes one process (nor on load, below)
    assert not [str(w.message) for w in said if "torch.distributed" in str(w.message)], said
    assert res.path == step_dir(tmp_path, 7) and check_complete(res.path) is None
    assert "crc32" in json.loads((res.path / MARKER).read_text())
    # Saving the same step again is a no-op (a stop right after a periodic save).
    assert ck.save(7, {"model": model.state_dict(), "train": {"step": 7}}).seconds == 0.0
    # Another process reaching step 7 again (it resumed from an older checkpoint) replaces it.
    ck2 = Checkpointer(
        tmp_path,
        DistInfo(),
        torch.device("cpu"),
        keep_last=1,
        async_save=False,
        marker_extra={"model": _tiny().model_dump()},
    )
    assert ck2.save(7, {"model": model.state_dict(), "train": {"step": 7}}).seconds > 0.0

    other = GPT(_tiny())
    state = {"model": other.state_dict(), "train": {"step": 0}}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ck.load(res.path, state)
    assert not [str(w.message) for w in said if "torch.distributed" in str(w.message)], said
    assert state["train"]["step"] == 7
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k])

    wider = GPT(_tiny(d_model=32))
    with pytest.raises(
        CheckpointError,
        match=r"saved for a different model: .*has shape \[.*16\] in the "
        r"checkpoint, \[.*32\] in this model.*model config differs .*d_model=16->32",
    ):
        check_model_shapes(res.path, wider.state_dict(), _tiny(d_model=32).model_dump())
    deeper = GPT(_tiny(n_layers=2))
    with pytest.raises(CheckpointError, match=r"blocks\.1\..* is not in the checkpoint"):
        check_model_shapes(res.path, deeper.state_dict())


def test_loading_asks_only_for_the_rng_and_outer_keys_the_checkpoint_has(tmp_path):
    """A CPU process saved rng.rank0.cpu only; a GPU process asks for rng.rank0.cuda too. DCP would raise
    on the missing key: the optional subtrees are cut to what was saved, the rest must match."""
    torch.manual_seed(0)
    model = GPT(_tiny())
    ck = Checkpointer(
        tmp_path,
        DistInfo(),
        torch.device("cpu"),
        keep_last=2,
        async_save=False,
        marker_extra={"model": _tiny().model_dump()},
    )
    rng = torch.get_rng_state()
    path = ck.save(
        3, {"model": model.state_dict(), "rng": {"rank0": {"cpu": rng}}, "outer": {"round": 1}}
    ).path

    def gpu_request(more: bool = True):
        state = {
            "model": GPT(_tiny()).state_dict(),
            "rng": {"rank0": {"cpu": torch.zeros_like(rng), "cuda": torch.zeros(16, dtype=torch.uint8)}},
            "outer": {"round": 0},
        }
        if more:  # another rank's RNG (world size changed), an outer field added since
            state["rng"]["rank1"] = {"cpu": torch.zeros_like(rng)}
            state["outer"]["pending"] = 5
        return state

    # what the trainer used to hit: DCP refuses a requested key the checkpoint lacks
    with pytest.raises(BaseException, match=r"Missing key in checkpoint state_dict: rng\.rank0\.cuda"):
        ck.load(path, gpu_request(more=False))
    state = gpu_request()
    dropped = ck.load(path, state, optional=("rng", "outer"))
    assert sorted(dropped) == ["outer.pending", "rng.rank0.cuda", "rng.rank1.cpu"]
    assert torch.equal(state["rng"]["rank0"]["cpu"], rng) and list(state["rng"]) == ["rank0"]
    assert state["outer"] == {"round": 1}
    for k, v in model.state_dict().items():
        assert torch.equal(v, state["model"][k])
    # Only the optional subtrees are cut: a model tensor the checkpoint lacks is still an error.
    state = gpu_request()
    state["model"]["extra.weight"] = torch.zeros(2)
    with pytest.raises(BaseException, match="extra.weight"):
        ck.load(path, state, optional=("rng", "outer"))


def test_drop_unsaved_removes_emptied_subtrees():
    state = {"rng": {"rank1": {"cpu": 1}}, "outer": {"a": 1, "b": {"c": 2}}, "model": {"w": 0}}
    assert drop_unsaved(state, {"outer.a", "model.w"}, ("rng", "outer")) == ["rng.rank1.cpu", "outer.b.c"]
    assert state == {"outer": {"a": 1}, "model": {"w": 0}}


@pytest.fixture
def one_rank_group(tmp_path):
    """A real 1-rank gloo process group (async saves need one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield DistInfo(is_distributed=True, backend="gloo")
    finally:
        dist.destroy_process_group()


def test_async_saves_share_one_stager_and_each_saves_its_own_values(tmp_path, one_rank_group):
    """One DefaultStager for the run: its cached CPU copies are refilled by every save, so each
    checkpoint must hold the values of its own step, not the first one's; close() releases it."""
    torch.manual_seed(0)
    model = GPT(_tiny())
    ck = Checkpointer(
        tmp_path,
        one_rank_group,
        torch.device("cpu"),
        keep_last=5,
        async_save=True,
        marker_extra={"model": _tiny().model_dump()},
    )
    snapshots = {}
    stagers = set()
    cached = []
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(step))
        snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
        assert (
            ck.save(step, {"model": model.state_dict(), "train": {"step": step}}) is None
        )  # in the background
        stagers.add(id(ck.stager()))
        # the save went through this stager: it holds a CPU copy per parameter storage, refilled each time
        # (DCP's cache; torch is pinned by constraints-dev.txt)
        cached.append(len(ck.stager()._state_dict_stager._cached_storage_mapping))
        with torch.no_grad():  # the training goes on while the write runs: must not leak into the save
            for p in model.parameters():
                p.mul_(-1.0)
    assert len(stagers) == 1
    n_storages = len({p.untyped_storage().data_ptr() for p in model.parameters()})
    assert cached == [n_storages] * 3, cached
    ck.close()
    assert ck._stager is None
    for step, expect in snapshots.items():
        assert check_complete(step_dir(tmp_path, step)) is None
        other = GPT(_tiny())
        state = {"model": other.state_dict(), "train": {"step": 0}}
        ck.load(step_dir(tmp_path, step), state)
        assert state["train"]["step"] == step
        for k, v in expect.items():
            assert torch.equal(state["model"][k], v), (step, k)


def test_async_saves_survive_a_stager_that_closes_itself_after_staging(tmp_path, one_rank_group, monkeypatch):
    """torch 2.11's DefaultStager closes its copier at the end of every stage (pytorch#183413): the next
    save through the same stager failed with KeyError: <class 'type'> (seen on an H200 with torch 2.11).
    Emulated here on the pinned torch: every save must still complete with its own values."""
    from torch.distributed.checkpoint.staging import DefaultStager

    staged = DefaultStager._stage

    def stage_then_close(self, state_dict, **kw):
        out = staged(self, state_dict, **kw)
        self._state_dict_stager.close()
        return out

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    torch.manual_seed(0)
    model = GPT(_tiny())
    ck = Checkpointer(
        tmp_path,
        one_rank_group,
        torch.device("cpu"),
        keep_last=5,
        async_save=True,
        marker_extra={"model": _tiny().model_dump()},
    )
    expect = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(step))
        expect[step] = {k: v.clone() for k, v in model.state_dict().items()}
        assert ck.save(step, {"model": model.state_dict(), "train": {"step": step}}) is None
    ck.close()
    for step, want in expect.items():
        assert check_complete(step_dir(tmp_path, step)) is None
        state = {"model": GPT(_tiny()).state_dict(), "train": {"step": 0}}
        ck.load(step_dir(tmp_path, step), state)
        for k, v in want.items():
            assert torch.equal(state["model"][k], v), (step, k)
