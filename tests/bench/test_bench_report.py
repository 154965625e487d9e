"""`sbatch-gen report`: from real (tiny) training runs to a Markdown report with PNG plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sbatch_gen.report import ReportError, build, load_run, recoveries, slo, write_report

pytestmark = pytest.mark.slow  # trains small runs to report on

PNG = b"\x89PNG\r\n\x1a\n"


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "sbatch-gen"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def _is_png(p: Path) -> bool:
    return p.is_file() and p.read_bytes()[:8] == PNG and p.stat().st_size > 1000


def test_single_region_report(single_run, tmp_path):
    out = tmp_path / "rep"
    p = _cli("report", str(single_run), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stdout
    md = (out / "report.md").read_text()
    for section in ("# Run report", "## SLO baseline", "## Loss", "## Step time"):
        assert section in md
    assert "## Cross-region sync" not in md  # no sync rounds in a single-region run
    for metric in (
        "step time, mean",
        "step time, p99",
        "comm fraction",
        "checkpoint write, mean",
        "resume time",
        "fault-recovery downtime",
    ):
        assert metric in md
    assert _is_png(out / "loss.png") and _is_png(out / "step_time.png")
    assert not (out / "sync.png").exists()
    base = json.loads((out / "slo.json").read_text())
    (region,) = base
    assert region == "local"
    assert base[region]["last_step"] == 6 and base[region]["steps_logged"] == 6
    assert base[region]["restarts"] == 0 and base[region]["sync_rounds"] == 0
    assert base[region]["step_time_p99_s"] >= base[region]["step_time_p50_s"] > 0
    assert base[region]["checkpoint_writes"] >= 1  # the final save


def test_two_region_report_has_sync_split(xr_runs, tmp_path):
    p = _cli("report", *map(str, xr_runs))
    assert p.returncode == 0, p.stderr
    out = xr_runs[0].parent / "report"  # default: the run dirs' common parent
    md = (out / "report.md").read_text()
    assert "## Cross-region sync" in md
    for phase in ("upload", "wait for peers", "download", "average", "outer step", "broadcast"):
        assert f"| {phase} |" in md
    assert "| metric | a | b |" in md
    assert _is_png(out / "sync.png") and _is_png(out / "loss.png") and _is_png(out / "step_time.png")
    base = json.loads((out / "slo.json").read_text())
    assert set(base) == {"a", "b"}
    for r in base.values():
        assert r["sync_rounds"] == 2  # steps 3 and 6 with H = 3
        assert r["bytes_across_regions"] > 0
        assert 0 < r["cross_region_sync_fraction"] < 1


def test_report_errors_name_the_file(tmp_path):
    p = _cli("report", str(tmp_path / "missing"))
    assert p.returncode == 2 and "missing: run directory not found" in p.stderr
    d = tmp_path / "run"
    d.mkdir()
    p = _cli("report", str(d))
    assert p.returncode == 2 and "metrics.jsonl: not found" in p.stderr
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "step_time_s": 0.1}\n{"step": 2, oops\n')
    p = _cli("report", str(d))
    assert p.returncode == 2 and "metrics.jsonl:2: not valid JSON" in p.stderr
    assert not (d / "report" / "report.md").exists()  # nothing half-written


def test_cut_last_line_is_tolerated(single_run, tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    text = (single_run / "metrics.jsonl").read_text()
    (d / "metrics.jsonl").write_text(text + '{"step": 7, "loss"')  # a crash mid-write
    run = load_run(d)
    assert run.steps[-1]["step"] == 6


def test_restart_and_downtime_from_records(tmp_path):
    """A SIGKILLed process resumed from the step-4 checkpoint: steps 5..6 are trained twice."""
    d = tmp_path / "run"
    d.mkdir()
    recs = [{"step": s, "loss": 3.0 - 0.1 * s, "step_time_s": 0.1, "time": 100.0 + s} for s in range(1, 7)]
    recs += [{"step": s, "loss": 3.0 - 0.1 * s, "step_time_s": 0.1, "time": 130.0 + s} for s in range(5, 9)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(d)
    (rec,) = recoveries(run)
    assert rec == {"last_step_before": 6, "first_step_after": 5, "steps_redone": 2, "downtime_s": 29.0}
    s = slo(run)
    assert s["restarts"] == 1 and s["fault_recovery_downtime_s"] == 29.0
    path = write_report([d], tmp_path / "out")
    assert "restart after step 6, resumed at step 5" in path.read_text()


def test_no_run_dirs_is_an_error():
    with pytest.raises(ReportError):
        write_report([])


def test_report_command_does_not_import_torch(single_run, tmp_path):
    code = (
        "import sys\n"
        "from sbatch_gen.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "assert not bad, bad[:5]\n"
        "assert 'matplotlib' in sys.modules\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, "report", str(single_run), "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from sbatch_gen.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'matplotlib' not in sys.modules",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr


def test_comm_fractions_account_for_sampled_records(tmp_path):
    """log_every 10 with a sync round every 20 steps: rounds are always logged, plain steps only sampled,
    so the fractions are over the estimated whole run (40 steps x 0.1 s + 2 rounds x 0.5 s = 5 s)."""
    d = tmp_path / "run"
    d.mkdir()
    recs = []
    for s in (1, 10, 20, 30, 40):
        r = {"step": s, "loss": 3.0, "step_time_s": 0.1, "comm_time_s": 0.02}
        if s % 20 == 0:
            r.update(xr_round=s // 20, xr_total_s=0.5, step_time_s=0.6)
        recs.append(r)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = slo(load_run(d))
    assert s["cross_region_sync_fraction"] == pytest.approx(1.0 / 5.0)
    assert s["in_region_comm_fraction"] == pytest.approx(0.02 * 40 / 5.0)
    assert s["comm_fraction"] == pytest.approx((1.0 + 0.8) / 5.0)


def test_overlapped_rounds_count_only_their_exposed_time(tmp_path):
    """overlap eager: a round's exchange (xr_total_s 0.5 s) runs behind training; only xr_exposed_s held it
    up. The round after the last step is an xr_final_round event: it is a round too, and its exposed time
    counts (40 steps x 0.1 s + 0.05 + 0.05 + 0.1 s exposed)."""
    d = tmp_path / "run"
    d.mkdir()
    recs: list[dict] = [{"step": s, "loss": 3.0, "step_time_s": 0.1} for s in (1, 10, 30)]
    recs.insert(2, {"step": 20, "loss": 3.0, "step_time_s": 0.15, "xr_inflight": 1, "xr_exposed_s": 0.05})
    recs.append(
        {"step": 40, "loss": 3.0, "step_time_s": 0.15, "xr_round": 1, "xr_total_s": 0.5, "xr_exposed_s": 0.05}
    )
    recs.append(
        {"event": "xr_final_round", "step": 40, "xr_round": 2, "xr_total_s": 0.5, "xr_exposed_s": 0.1}
    )
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(d)
    assert [r["xr_round"] for r in run.rounds] == [1, 2]
    s = slo(run)
    assert s["sync_rounds"] == 2 and s["sync_round_mean_s"] == pytest.approx(0.5)
    assert s["cross_region_sync_fraction"] == pytest.approx(0.2 / 4.2)


def _xr_rec(
    step: int, r: int, members: list[str], absent: list[str], wait: float, late: bool = False
) -> dict:
    return {
        "step": step,
        "loss": 3.0,
        "step_time_s": 0.1 + wait,
        "time": 1000.0 + step,
        "xr_round": r,
        "xr_step": step,
        "xr_wait_s": wait,
        "xr_total_s": wait + 0.05,
        "xr_members": members,
        "xr_absent": absent,
        "xr_late": late,
        "xr_closed_by": members[0],
        "xr_close_reason": "all" if not absent else "grace",
    }


def test_participation_timeline(tmp_path):
    """Three regions, two run dirs (ap is only known from the commits). us is late in round 3, away in
    rounds 4-5 (it fast-forwards past them), back for 6-7, then leaves: round 8 closes without it."""
    all3, no_us = ["eu", "us", "ap"], ["eu", "ap"]
    eu_waits = {1: 0.5, 2: 0.7, 3: 30.0, 4: 30.0, 5: 31.0, 6: 0.4, 7: 0.6, 8: 0.2}
    eu = [
        _xr_rec(10 * r, r, all3 if r in (1, 2, 6, 7) else no_us, [] if r in (1, 2, 6, 7) else ["us"], w)
        for r, w in eu_waits.items()
    ]
    us = [
        _xr_rec(10, 1, all3, [], 0.1),
        _xr_rec(20, 2, all3, [], 0.1),
        _xr_rec(30, 3, no_us, ["us"], 0.2, late=True),
        {"event": "xr_late", "step": 30, "round": 3, "members": no_us, "streak": 1, "time": 1030.0},
        {"step": 31, "loss": 3.0, "step_time_s": 0.1, "time": 1100.0},
        # behind the run at round 4: fast-forwarded to round 5 (a record without timings), then an event
        {
            "event": "xr_rejoin",
            "step": 40,
            "adopted_step": 50,
            "from_round": 3,
            "to_round": 5,
            "replayed": 2,
            "via": ["rounds"],
            "why": "behind",
            "seconds": 1.5,
            "time": 1140.0,
        },
        {
            "step": 50,
            "loss": 3.0,
            "step_time_s": 1.6,
            "time": 1141.0,
            "xr_round": 5,
            "xr_step": 40,
            "xr_adopted_step": 50,
            "xr_rejoin_from": 3,
        },
        _xr_rec(60, 6, all3, [], 0.2),
        _xr_rec(70, 7, all3, [], 0.3),
        {"event": "xr_leave", "step": 70, "round": 7, "reason": "stopped", "time": 1171.0},
    ]
    dirs = []
    for name, recs in (("eu", eu), ("us", us)):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        dirs.append(d)
    path = write_report(dirs, tmp_path / "out")
    assert _is_png(tmp_path / "out" / "participation.png") and _is_png(tmp_path / "out" / "sync.png")
    md = path.read_text()
    assert "## Participation" in md and "![participation per round](participation.png)" in md
    assert "Rounds 1..8" in md
    assert "| per region | eu | us | ap |" in md
    assert "| rounds taken part | 8 | 4 | 8 |" in md
    assert "| rounds late (delta dropped) | 0 | 1 | 0 |" in md
    assert "| rounds absent | 0 | 3 | 0 |" in md
    assert "| rejoins (fast-forwards) | 0 | 1 | 0 |" in md
    assert "| planned leaves | 0 | 1 | 0 |" in md
    # eu waited out the grace period while us was missing (rounds 3-5); round 8 closed at once (us had left)
    assert "| wait per round while a region was missing, median | 30 s | n/a | n/a |" in md
    assert "| wait per round while a region was missing, max | 31 s | n/a | n/a |" in md
    assert "| wait per round with every region, median | 0.55 s | 0.15 s | n/a |" in md
    assert (
        "us: rejoined the run at step 40 (behind): round 3 -> 5, 2 round(s) replayed via rounds, continued "
        "from step 50" in md
    )
    assert "us: planned leave after round 7 at step 70 (stopped)." in md
    base = json.loads((tmp_path / "out" / "slo.json").read_text())
    assert base["us"]["sync_rounds"] == 5 and base["eu"]["sync_rounds"] == 8  # the fast-forward is no round


def test_no_participation_section_without_membership_records(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    recs = [
        {"step": 10, "loss": 3.0, "step_time_s": 0.6, "xr_round": 1, "xr_total_s": 0.5}
    ]  # an older trainer
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    path = write_report([d], tmp_path / "out")
    assert "## Participation" not in path.read_text()
    assert not (tmp_path / "out" / "participation.png").exists()


def test_participation_names_each_rounds_fragment_under_streaming(tmp_path):
    """overlap streaming (F 2): round k synced fragment (k-1) mod 2; us missed round 3 (fragment 0)."""
    both, eu_only = ["eu", "us"], ["eu"]
    recs = []
    for r in range(1, 5):
        rec = _xr_rec(5 * r + 1, r, eu_only if r == 3 else both, ["us"] if r == 3 else [], 0.1)
        rec["xr_fragment"] = (r - 1) % 2
        recs.append(rec)
    d = tmp_path / "eu"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    path = write_report([d], tmp_path / "out")
    md = path.read_text()
    assert _is_png(tmp_path / "out" / "participation.png")
    assert "| rounds taken part, fragment 0 | 2 | 1 |" in md
    assert "| rounds taken part, fragment 1 | 2 | 2 |" in md


def test_a_sparse_runs_density_and_bytes_per_round(tmp_path):
    """payload_dtype sparse: the round records carry xr_sparse_density; the report shows it beside the mean
    bytes a round uploaded."""
    d = tmp_path / "run"
    d.mkdir()
    recs = [{"step": 1, "loss": 3.0, "step_time_s": 0.1}]
    for r in (1, 2):
        rec = _xr_rec(10 * r, r, ["eu"], [], 0.0)
        rec.update(xr_bytes_up=1000 * r, xr_bytes_down=0, xr_sparse_density=0.01)
        recs.append(rec)
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    text, _ = build([load_run(d)])
    assert "| sparse: share of each chunk sent; kB up per round | 1.00%; 1.5 |" in text
