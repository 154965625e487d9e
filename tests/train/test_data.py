"""Data preparation and the resumable sampler."""

import hashlib
import json

import numpy as np
import pytest

from sbatch_gen.train.data import DOC_END, Sampler, ensure_shard, main, prepare, source_files


def test_prepare_is_deterministic_and_splits_by_file(tmp_path):
    a = prepare(tmp_path / "a", ["eu", "us"], max_bytes=200_000)
    b = prepare(tmp_path / "b", ["eu", "us"], max_bytes=200_000)
    for r in ("eu", "us"):
        assert (tmp_path / "a" / f"{r}.bin").read_bytes() == (tmp_path / "b" / f"{r}.bin").read_bytes()
        assert a["regions"][r] == b["regions"][r]
        meta = json.loads((tmp_path / "a" / f"{r}.json").read_text())
        assert meta["sha256"] == hashlib.sha256((tmp_path / "a" / f"{r}.bin").read_bytes()).hexdigest()
    # Whole files, in sorted order, each to the region with the fewest bytes so far.
    root, files = source_files("python-stdlib")
    docs = [(root / f).read_bytes() + DOC_END for f in files[: a["files"]]]
    expect = {"eu": [], "us": []}
    for d in docs:
        r = min(("eu", "us"), key=lambda k: (sum(map(len, expect[k])), k != "eu"))
        expect[r].append(d)
    eu = (tmp_path / "a" / "eu.bin").read_bytes()
    us = (tmp_path / "a" / "us.bin").read_bytes()
    assert eu == b"".join(expect["eu"]) and us == b"".join(expect["us"])
    assert abs(len(eu) - len(us)) <= max(map(len, docs))
    # The two shards together hold exactly the one-region corpus.
    one = prepare(tmp_path / "one", ["local"], max_bytes=200_000)
    assert (tmp_path / "one" / "local.bin").read_bytes() == b"".join(docs)
    assert one["regions"]["local"]["tokens"] == len(eu) + len(us)


def test_ensure_shard_prepares_a_missing_directory_shard(tmp_path):
    p = ensure_shard(tmp_path / "d", "us", ["eu", "us"], "common-licenses", 0)
    assert p == tmp_path / "d" / "us.bin" and p.stat().st_size > 0
    assert (tmp_path / "d" / "eu.bin").exists()
    with pytest.raises(FileNotFoundError, match="prepare it with"):
        ensure_shard(tmp_path / "nope.bin", "eu", ["eu"], "python-stdlib", 0)


def test_cli_prepare(tmp_path, capsys):
    assert main(["prepare", "--out", str(tmp_path), "--regions", "eu,us", "--max-bytes", "50000"]) == 0
    out = capsys.readouterr().out
    assert "eu.bin" in out and "us.bin" in out


def _run(sampler, n, tokens):
    return [sampler.batch(tokens) for _ in range(n)]


def test_sampler_resume_sees_the_same_batches():
    tokens = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    full = Sampler(tokens.size, 16, 3, rank=1, world_size=2, seed=7)
    ref = _run(full, 400, tokens)  # several epochs (624 windows / 6 per step)
    part = Sampler(tokens.size, 16, 3, rank=1, world_size=2, seed=7)
    _run(part, 150, tokens)
    state = json.loads(json.dumps(part.state_dict()))
    resumed = Sampler(tokens.size, 16, 3, rank=1, world_size=2, seed=7)
    resumed.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(ref[150:], _run(resumed, 250, tokens), strict=True):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)


def test_sampler_ranks_disjoint_and_epoch_covers_each_window_once():
    n_tokens, seq, bs, world = 6_401, 16, 4, 2  # 400 windows, 8 per step -> 50 steps per epoch
    offs = {r: [] for r in range(world)}
    samplers = [Sampler(n_tokens, seq, bs, r, world, seed=3) for r in range(world)]
    for _ in range(50):
        for r, s in enumerate(samplers):
            offs[r].extend(s.next_offsets().tolist())
    seen = offs[0] + offs[1]
    assert sorted(seen) == [i * seq for i in range(400)]
    assert set(offs[0]).isdisjoint(offs[1])
    assert samplers[0].epoch == 0
    nxt = samplers[0].next_offsets()
    assert samplers[0].epoch == 1 and len(nxt) == bs


def test_sampler_targets_are_inputs_shifted():
    tokens = (np.arange(1000) % 251).astype(np.uint8)
    x, y = Sampler(tokens.size, 8, 2, 0, 1, seed=0).batch(tokens)
    assert x.shape == (2, 8) and np.array_equal(x[:, 1:], y[:, :-1])


def test_sampler_refuses_changed_data():
    s = Sampler(10_000, 16, 2, 0, 1, seed=0)
    other = Sampler(9_000, 16, 2, 0, 1, seed=0)
    with pytest.raises(ValueError, match="the data changed"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="fewer than one global micro-batch"):
        Sampler(100, 16, 4, 0, 2, seed=0)


# ---- resuming at another world size (docs/trainer.md: "the cursor is in the checkpoint, so a resumed run sees
# exactly the batches the uninterrupted run would have (also after a world-size change)") ------------

N_WINDOWS, SEQ, BS, SEED = 400, 16, 2, 11  # 400 windows: a whole number of global batches at 1, 2, 4 ranks
N_TOKENS = N_WINDOWS * SEQ + 1


def _global_steps(samplers: list[Sampler], steps: int) -> list[int]:
    """Window indices of `steps` global batches, in rank order within a step (the global stream)."""
    seen = []
    for _ in range(steps):
        for s in samplers:
            seen.extend((s.next_offsets() // SEQ).tolist())
    return seen


def _ranks(world: int, state: dict | None = None) -> list[Sampler]:
    samplers = [Sampler(N_TOKENS, SEQ, BS, r, world, seed=SEED) for r in range(world)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(json.loads(json.dumps(state)))
    return samplers


@pytest.mark.parametrize(
    "new_world, steps_before", [(4, 30), (1, 30), (1, 31), (2, 30)], ids=["2to4", "2to1", "2to1-odd", "2to2"]
)
def test_sampler_resumes_after_a_world_size_change_without_repeating_or_skipping(new_world, steps_before):
    old = _ranks(2)
    before = _global_steps(old, steps_before)
    states = [s.state_dict() for s in old]
    assert all(st == states[0] for st in states)  # one global cursor: every rank saves the same position
    resumed = _ranks(new_world, states[0])
    # Through the end of epoch 0 and well into epoch 1.
    after_windows = 2 * N_WINDOWS - len(before) - 40
    after = _global_steps(resumed, after_windows // (BS * new_world))
    ref = _global_steps(_ranks(2), (len(before) + len(after)) // (BS * 2))
    # The same windows in the same order as the uninterrupted run ...
    assert before + after == ref[: len(before) + len(after)]
    # ... so epoch 0 is every window exactly once (nothing repeated, nothing skipped), and epoch 1 goes on.
    assert sorted(ref[:N_WINDOWS]) == list(range(N_WINDOWS))
    assert all(s.epoch == 1 for s in resumed)


def test_a_resume_off_the_new_batch_boundary_drops_at_most_one_global_batch_at_the_epoch_end():
    """Resumed at a position that is not a multiple of the new global batch (bs x world), the epoch's tail
    holds fewer windows than one global batch: like drop_last, those windows are skipped, and nothing is
    repeated. docs/trainer.md documents it."""
    old = _ranks(2)
    before = _global_steps(old, 31)  # cursor 124: not a multiple of 4 ranks x 2
    resumed = _ranks(4, old[0].state_dict())
    after = _global_steps(resumed, (N_WINDOWS - len(before)) // 8)  # the rest of epoch 0
    assert all(s.epoch == 0 for s in resumed)
    epoch0 = before + after
    assert len(set(epoch0)) == len(epoch0)  # nothing repeated
    skipped = N_WINDOWS - len(epoch0)
    assert skipped == (N_WINDOWS - len(before)) % 8 == 4  # less than one global batch
    _global_steps(resumed, 1)
    assert all(s.epoch == 1 for s in resumed)


def _old_batch(sampler, tokens):
    """The sampler's batch before the loader existed: stacked windows, shifted by one."""
    offs = sampler.next_offsets()
    win = np.stack([tokens[o : o + sampler.seq_len + 1] for o in offs]).astype(np.int64)
    return win[:, :-1], win[:, 1:]


def test_loader_with_prefetch_yields_the_sampler_batches_in_order():
    """Batches (the trainer's loader, one micro-batch ahead) gives exactly the micro-batches, in the
    order, that the sampler gave before: over epoch ends, whatever the prefetch pattern."""
    from sbatch_gen.train.data import Batches

    tokens = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)
    ref = Sampler(tokens.size, 16, 3, rank=1, world_size=2, seed=7)
    expect = [_old_batch(ref, tokens) for _ in range(500)]  # several epochs (639 windows / 6 per draw)
    loader = Batches(Sampler(tokens.size, 16, 3, rank=1, world_size=2, seed=7), tokens)
    got = []
    for i in range(500):
        x, y = loader.next()
        got.append((x.numpy().copy(), y.numpy().copy()))
        if i % 3:  # the trainer prefetches after every backward; also without it the order holds
            loader.prefetch()
            loader.prefetch()  # idempotent
    for (x1, y1), (x2, y2) in zip(expect, got, strict=True):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
        assert np.array_equal(x2[:, 1:], y2[:, :-1])
    assert loader.take_host_s() > 0 and loader.take_host_s() == 0.0


def test_loader_position_is_the_next_batch_it_returns_not_the_prefetched_one():
    """A checkpoint taken with a micro-batch prefetched resumes at that micro-batch (it was not
    trained on), in a fresh loader, and sees the same batches as the uninterrupted run."""
    from sbatch_gen.train.data import Batches

    tokens = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)

    def fresh():
        return Batches(Sampler(tokens.size, 16, 3, rank=0, world_size=2, seed=3), tokens)

    ref = fresh()
    expect = [tuple(t.numpy().copy() for t in ref.next()) for _ in range(300)]
    for cut in (1, 106, 107, 213):  # 106 draws per epoch: around an epoch end too
        part = fresh()
        for _ in range(cut):
            part.next()
            part.prefetch()
        state = json.loads(json.dumps(part.state_dict()))
        plain = Sampler(tokens.size, 16, 3, rank=0, world_size=2, seed=3)
        for _ in range(cut):
            plain.next_offsets()
        assert state == plain.state_dict()  # the position after `cut` consumed micro-batches
        resumed = fresh()
        resumed.load_state_dict(state)
        for i in range(cut, 300):
            x, y = resumed.next()
            resumed.prefetch()
            assert np.array_equal(x.numpy(), expect[i][0]) and np.array_equal(y.numpy(), expect[i][1]), (
                cut,
                i,
            )
    # Loading a position drops what was prefetched for the old one.
    part = fresh()
    part.next()
    part.prefetch()
    part.load_state_dict(fresh().state_dict())
    assert np.array_equal(part.next()[0].numpy(), expect[0][0])
