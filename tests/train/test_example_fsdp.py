"""examples/train_fsdp.py, the torchtitan-style FSDP2 example on the public library, as users run it: two
regions, each its own ``torchrun --standalone --nproc-per-node 2`` (CPU, gloo), each rank holding half of
every parameter, meeting only in an fs mailbox. Both train with DiLoCo on their local shards (an outer round
every H steps), checkpoint through DCP and end with bitwise identical final.pt."""

from __future__ import annotations

import pytest

from .conftest import REPO
from .example_regions import Region, assert_same_weights

pytestmark = pytest.mark.slow  # two torchrun regions running the example script

SCRIPT = REPO / "examples" / "train_fsdp.py"
STEPS, H, SAVE_EVERY = 10, 5, 5  # 2 outer rounds; a checkpoint at the end of each; a loss line at 10


@pytest.mark.parametrize("sync", ["diloco", "grad"])
def test_two_fsdp_regions_train_with_diloco_and_end_with_identical_weights(sync, tmp_path, example_data):
    """DiLoCo, and per-step gradient averaging (the example's before_optimizer_step: each rank's gradient
    shards averaged over the regions)."""
    rs = [Region(tmp_path, name, example_data, SCRIPT, STEPS, H, SAVE_EVERY, sync) for name in ("a", "b")]
    rounds = STEPS // H if sync == "diloco" else STEPS
    try:
        for r in rs:
            r.start()
        for r in rs:
            assert r.wait() == 0, r.tail()
    finally:
        for r in rs:
            r.kill()
    a, b = rs
    for r in rs:
        log = r.log.read_text()
        assert f"region {r.name}, 2 processes (FSDP), steps 1..{STEPS}" in log, r.tail()
        assert f"done at step {STEPS} after {rounds} outer rounds" in log, r.tail()
        assert "Traceback" not in log, r.tail()
        # a DCP checkpoint: every rank wrote its own shards
        latest = r.run_dir / "ckpt" / (r.run_dir / "ckpt" / "latest").read_text()
        assert latest.name == f"step-{STEPS}" and len(list(latest.glob("*.distcp"))) == 2, r.tail()
    assert a.final() == b.final(), "final.pt differs between the regions"
    assert_same_weights(a.run_dir / "final.pt", b.run_dir / "final.pt")
    # each region trained on its own batches in between: the logged losses differ
    losses = [[ln for ln in r.log.read_text().splitlines() if " loss " in ln] for r in rs]
    assert losses[0] != losses[1]
