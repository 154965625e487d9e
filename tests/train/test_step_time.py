"""Where a step's time goes (``time_share_*`` in metrics.jsonl, the report's table), in one plain process."""

import pytest

from sbatch_gen.report import build, load_run
from sbatch_gen.train.cli import parse_args
from sbatch_gen.train.phases import SHARES
from sbatch_gen.train.spec import RunSpec
from sbatch_gen.train.trainer import run

from .conftest import read_metrics, write_config

pytestmark = pytest.mark.slow  # in-process trainer runs

TOLERANCE = 0.02  # the shares are timed apart; their sum may pass 1 by rounding of separate clocks


def _train(cfg, run_dir, data_dir, *extra) -> int:
    args = parse_args(["--config", str(cfg), "--run-dir", str(run_dir), "--data-path", str(data_dir), *extra])
    return run(RunSpec.from_args(args))


def test_cpu_records_carry_the_time_shares_and_the_report_shows_them(tmp_path, data_dir, clean_env, capfd):
    """Also: no GPU telemetry on the CPU, and not a word about it."""
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 5, "grad_accum": 2})
    assert _train(cfg, tmp_path / "r", data_dir) == 0
    err = capfd.readouterr().err
    assert "telemetry" not in err and "NVML" not in err and "DCGM" not in err
    recs = read_metrics(tmp_path / "r")
    assert sorted(recs) == [1, 2, 3, 4, 5]
    for rec in recs.values():
        assert not [k for k in rec if k.startswith("DCGM_")]
        shares = [rec[f"time_share_{k}"] for k in SHARES]
        assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in shares), rec
        assert sum(shares) <= 1.0 + TOLERANCE, rec
        assert rec["time_share_fwd_bwd"] > 0 and rec["time_share_optimizer"] > 0
        assert rec["time_share_xr"] == 0.0  # no cross-region run
        assert rec["fwd_bwd_time_s"] == pytest.approx(rec["time_share_fwd_bwd"] * rec["step_time_s"])
        assert rec["optimizer_time_s"] == pytest.approx(rec["time_share_optimizer"] * rec["step_time_s"])
        assert rec["time_share_data"] == pytest.approx(rec["data_time_s"] / rec["step_time_s"])
    md, _ = build([load_run(tmp_path / "r")])
    assert "| parallelism | compile | optimizer | exit |" in md  # the run table: what the summary says
    assert "| none | off | AdamW foreach | completed |" in md
    assert "## Where the time goes" in md
    table = md.split("## Where the time goes", 1)[1].split("\n## ", 1)[0]
    for label in ("forward + backward", "optimizer step", "data", "in-region communication"):
        assert f"| {label}" in table
    assert "| cross-region sync (waited for) | 0.0% |" in table and "| other (not attributed) |" in table


def test_profile_writes_a_trace_of_the_asked_steps_and_trains_the_same(tmp_path, data_dir, clean_env):
    """train.profile: one Chrome trace (rank 0 here) of steps 3..4, each step and its parts named in it;
    the losses bitwise those of a run without it."""
    import json

    plain = write_config(tmp_path / "plain.yaml", train={"steps": 5})
    prof = write_config(tmp_path / "prof.yaml", train={"steps": 5, "profile": {"start_step": 3, "steps": 2}})
    assert _train(plain, tmp_path / "a", data_dir) == 0
    assert _train(prof, tmp_path / "b", data_dir) == 0
    assert not (tmp_path / "a" / "profile").exists()  # off by default
    files = sorted(p.name for p in (tmp_path / "b" / "profile").iterdir())
    assert files == ["rank0.steps-3-4.json"]
    trace = json.loads((tmp_path / "b" / "profile" / files[0]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"step 3", "step 4", "forward_backward", "optimizer"} <= names
    assert "step 2" not in names and "step 5" not in names
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [a[s]["loss"] for s in range(1, 6)] == [b[s]["loss"] for s in range(1, 6)]
    # A process that ends inside the window writes what it recorded; one resumed inside it records the rest.
    win = write_config(tmp_path / "win.yaml", train={"steps": 5, "profile": {"start_step": 3, "steps": 3}})
    assert _train(win, tmp_path / "c", data_dir, "--max-steps", "4") == 0
    assert _train(win, tmp_path / "c", data_dir) == 0
    files = sorted(p.name for p in (tmp_path / "c" / "profile").iterdir())
    assert files == ["rank0.steps-3-4.json", "rank0.steps-5-5.json"]
    c = read_metrics(tmp_path / "c")
    assert [a[s]["loss"] for s in range(1, 6)] == [c[s]["loss"] for s in range(1, 6)]


def test_a_profile_past_the_last_step_is_refused(tmp_path):
    from sbatch_gen.errors import UserError
    from sbatch_gen.train.config import load_config

    cfg = write_config(tmp_path / "c.yaml", train={"steps": 5, "profile": {"start_step": 6}})
    with pytest.raises(UserError, match="start_step 6 is past train.steps 5"):
        load_config(cfg)
