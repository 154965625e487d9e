"""The demo's summary of the elastic rounds (sbatch_gen.demo), from a region's metrics as the trainer writes
them: no training here."""

from __future__ import annotations

import json

from sbatch_gen.demo import _away_lines


def test_a_rejoin_says_which_step_it_continued_at_and_why(tmp_path):
    """A region that fast-forwarded continues at the run's step, not at the end of the round it adopted: the
    line says both, and how far into the next round the run was."""
    us = tmp_path / "us"
    us.mkdir()
    (tmp_path / "eu").mkdir()
    rejoin = {"event": "xr_rejoin", "step": 96, "adopted_step": 178, "from_round": 4, "to_round": 8}
    rejoin |= {"replayed": 4, "via": ["rounds"], "steps_into_round": 18, "seconds": 0.25}
    (us / "metrics.jsonl").write_text(json.dumps(rejoin) + "\n")
    (line,) = _away_lines(tmp_path, ["eu", "us"], grace_s=5.0)
    assert line == (
        "us: rejoined: fast-forwarded from round 4 to 8 (4 round(s) replayed, via rounds) in 0.25 s; continued "
        "at the run's step 178 (round 8 ended at step 160, and the run was 18 step(s) into the next by the "
        "store's clock), its data from where it left off"
    )
