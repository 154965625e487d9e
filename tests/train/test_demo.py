"""The demo a new user runs first (`make demo`, python -m sbatch_gen.demo): two regions of the real trainer
over the fs mailbox, here small (the tiny config, 30 steps, no stop midway), with the payload and overlap a
user may pick: both regions end on the same parameters and the summary says what went over the wire."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow  # two torchruns of two processes each


@pytest.mark.parametrize(("payload", "overlap"), [("sparse", "none"), ("int8", "streaming")])
def test_the_demo_trains_two_regions_to_the_same_parameters(tmp_path, payload, overlap):
    argv = [sys.executable, "-m", "sbatch_gen.demo", "--config", str(REPO / "configs" / "tiny.yaml")]
    argv += ["--steps", "30", "--inner-steps", "10", "--no-stop", "--out", str(tmp_path / "out")]
    argv += ["--payload-dtype", payload, "--overlap", overlap]
    p = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert f"overlap {overlap}, payloads {payload}" in out and f"payloads {payload}\n" in out, out
    assert "final parameters identical across regions: yes" in out, out
    # bf16's bytes per round: 2 per parameter; sparse at 1% (chunks of 4096: 81 bytes each) about 1/100,
    # int8 about half (streaming: of one fragment of 2)
    ratio = float(out.split(" of bf16's)")[0].rsplit("(", 1)[1])
    assert (0.005 < ratio < 0.02) if payload == "sparse" else (0.2 < ratio < 0.3), out
