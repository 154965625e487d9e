"""The demo's summary of the elastic rounds (sbatch_gen.demo), from a region's metrics as the trainer writes
them: no training here."""

from __future__ import annotations

import json

from sbatch_gen.demo import _away_lines


def _rejoin_line(tmp_path, into: int, adopted: int) -> str:
    us = tmp_path / "us"
    us.mkdir()
    (tmp_path / "eu").mkdir()
    rejoin = {"event": "xr_rejoin", "step": 96, "adopted_step": adopted, "from_round": 4, "to_round": 8}
    rejoin |= {"replayed": 4, "via": ["rounds"], "steps_into_round": into, "seconds": 0.25}
    (us / "metrics.jsonl").write_text(json.dumps(rejoin) + "\n")
    (line,) = _away_lines(tmp_path, ["eu", "us"], grace_s=5.0)
    return line


def test_a_rejoin_says_which_step_it_continued_after_and_why(tmp_path):
    """A region that fast-forwarded continues after the run's step, not after the end of the round it adopted:
    the line says both, and how far into the next round the run was."""
    assert _rejoin_line(tmp_path, into=18, adopted=178) == (
        "us: rejoined: fast-forwarded from round 4 to 8 (4 round(s) replayed, via rounds) in 0.25 s; continued "
        "after the run's step 178 (round 8 ended at step 160; the run was 18 step(s) into the next by the "
        "store's clock), its data from where it left off"
    )


def test_a_rejoin_at_a_rounds_end_says_so(tmp_path):
    assert _rejoin_line(tmp_path, into=0, adopted=160).endswith(
        "; continued after the run's step 160 (the end of round 8), its data from where it left off"
    )
