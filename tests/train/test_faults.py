"""The per-step sleep, the held stop checkpoint and the lease's short period live in sbatch_gen.testing.faults,
installed from outside the trainer: the production trainer reads none of these variables (nor their old names);
with the faults installed, the real trainer sleeps after every step, holds its stop checkpoint between its files
and its marker, and beats its run-dir lease at the test's period."""

import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sbatch_gen.testing import faults
from sbatch_gen.train import finish, lease, loop
from sbatch_gen.train.checkpoint import MARKER, check_complete, step_dir
from sbatch_gen.train.cli import parse_args
from sbatch_gen.train.spec import RunSpec
from sbatch_gen.train.trainer import run

from .conftest import write_config

REPO = Path(__file__).resolve().parents[2]
SLEEP_S, HOLD_S = 3600.0, 7200.0  # never slept: the recorder below returns at once for them
OLD_NAMES = (
    "SBATCH_GEN_STEP_SLEEP_S",
    "SBATCH_GEN_STEP_SLEEP_RANKS",
    "SBATCH_GEN_STOP_SAVE_HOLD_S",
    "SBATCH_GEN_LEASE_PERIOD_S",
)
LEASE_S = 123.0  # a lease period no one uses


@pytest.fixture
def lease_periods(monkeypatch):
    """The heartbeat period of every run-dir lease the trainer takes, in order."""
    periods: list[float] = []
    cls = lease.Lease

    class Recording(cls):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            periods.append(self.period_s)

    monkeypatch.setattr(lease, "Lease", Recording)
    return periods


@pytest.fixture
def sleeps(monkeypatch):
    """time.sleep, recording the calls of SLEEP_S and HOLD_S (and returning at once for them) with the state
    of the stop checkpoint (step 2 of the run dir in ``sleeps.run_dir``) when they came."""
    real = time.sleep
    seen: list[tuple[float, str]] = []

    def sleep(s):
        if s in (SLEEP_S, HOLD_S):
            path = step_dir(rec.run_dir, 2)
            state = "absent" if not path.exists() else ("complete" if (path / MARKER).exists() else "files")
            seen.append((s, state))
            return
        real(s)

    rec = SimpleNamespace(calls=seen, run_dir=None)
    monkeypatch.setattr(time, "sleep", sleep)
    return rec


def _stopped_run(tmp_path, data_dir, sleeps) -> None:
    """4 steps configured, a stop file there from the start: the trainer stops after step 2, saves a stop
    checkpoint of step 2 and acks."""
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 4}, checkpoint={"every": 100})
    stop = tmp_path / "stop"
    stop.write_text("a test's stop\n")
    sleeps.run_dir = tmp_path / "r"
    argv = ["--config", str(cfg), "--run-dir", str(sleeps.run_dir), "--data-path", str(data_dir)]
    args = parse_args([*argv, "--stop-file", str(stop)])
    assert run(RunSpec.from_args(args)) == 0
    assert check_complete(step_dir(sleeps.run_dir, 2)) is None


def test_the_trainer_reads_no_sleep_hold_or_lease_period_variable(
    tmp_path, data_dir, clean_env, monkeypatch, sleeps, lease_periods
):
    for name in (faults.ENV_STEP_SLEEP, OLD_NAMES[0]):
        monkeypatch.setenv(name, repr(SLEEP_S))
    for name in (faults.ENV_STOP_SAVE_HOLD, OLD_NAMES[2]):
        monkeypatch.setenv(name, repr(HOLD_S))
    for name in (faults.ENV_LEASE_PERIOD, OLD_NAMES[3]):
        monkeypatch.setenv(name, repr(LEASE_S))
    _stopped_run(tmp_path, data_dir, sleeps)
    assert sleeps.calls == []
    assert lease_periods == [lease.DEFAULT_PERIOD_S]


def test_the_trainer_with_the_faults_installed_sleeps_every_step_holds_the_stop_save_and_beats_its_lease(
    tmp_path, data_dir, clean_env, monkeypatch, sleeps, lease_periods
):
    # the seams, restored after the test (install_from_env patches the modules for the process)
    monkeypatch.setattr(loop, "_cross_region_round", loop._cross_region_round)
    monkeypatch.setattr(finish, "hand_off", finish.hand_off)
    monkeypatch.setattr(lease, "default_period", lease.default_period)
    faults.install_from_env(
        {
            faults.ENV_STEP_SLEEP: repr(SLEEP_S),
            faults.ENV_STOP_SAVE_HOLD: repr(HOLD_S),
            faults.ENV_LEASE_PERIOD: repr(LEASE_S),
        }
    )
    _stopped_run(tmp_path, data_dir, sleeps)
    # one sleep after each of the 2 steps, then the hold: the stop checkpoint's files written, no marker yet
    assert sleeps.calls == [(SLEEP_S, "absent"), (SLEEP_S, "absent"), (HOLD_S, "files")]
    assert lease_periods == [LEASE_S]


def test_a_sleep_for_some_ranks_sleeps_only_there_and_not_after_a_round_without_quorum(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    results = iter([(None, None), None])
    wrapped = faults.sleeping(lambda t, step: next(results), 0.5, {1})
    on = SimpleNamespace(info=SimpleNamespace(rank=1))
    off = SimpleNamespace(info=SimpleNamespace(rank=0))
    assert wrapped(off, 1) == (None, None) and slept == []
    results = iter([(None, None), None])
    assert wrapped(on, 1) == (None, None) and slept == [0.5]
    assert wrapped(on, 2) is None and slept == [0.5]  # no quorum: the loop ends, no sleep


def test_a_sleep_while_a_file_exists_stops_once_it_is_gone(monkeypatch, tmp_path):
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    pace = tmp_path / "pace"
    pace.touch()
    wrapped = faults.sleeping(lambda t, step: (None, None), 0.3, None, str(pace))
    t = SimpleNamespace(info=SimpleNamespace(rank=0))
    assert wrapped(t, 1) == (None, None) and slept == [0.3]
    pace.unlink()
    assert wrapped(t, 2) == (None, None) and slept == [0.3]  # gone: no more sleep


def test_the_module_to_run_follows_the_environment_and_a_missing_seam_is_refused():
    assert faults.trainer_module(None) == faults.trainer_module({"OTHER": "1"}) == "sbatch_gen.train"
    assert faults.trainer_module({faults.ENV_STEP_SLEEP: "0.1"}) == "sbatch_gen.testing.faults"
    assert faults.trainer_module({faults.ENV_STOP_SAVE_HOLD: "3"}) == "sbatch_gen.testing.faults"
    assert faults.trainer_module({faults.ENV_LEASE_PERIOD: "0.5"}) == "sbatch_gen.testing.faults"
    assert faults.trainer_module({faults.ENV_SNAPSHOT_GIVE_WAY: "0"}) == "sbatch_gen.testing.faults"
    gone = SimpleNamespace(__name__="sbatch_gen.train.loop")
    with pytest.raises(RuntimeError, match=r"sbatch_gen\.train\.loop\._cross_region_round is gone"):
        faults._patch(gone, "_cross_region_round", lambda f: f)


def test_no_production_module_names_a_test_variable():
    pattern = re.compile(r"SBATCH_GEN_TEST_|" + "|".join(OLD_NAMES))
    named = [
        str(p.relative_to(REPO))
        for p in (REPO / "sbatch_gen").rglob("*.py")
        if "testing" not in p.relative_to(REPO / "sbatch_gen").parts and pattern.search(p.read_text())
    ]
    assert named == []


def test_the_snapshot_give_way_bound_is_installed_from_outside(monkeypatch):
    from sbatch_gen.train.xr import traffic

    monkeypatch.setattr(traffic, "GIVE_WAY_MAX_S", traffic.GIVE_WAY_MAX_S)
    faults.install_from_env({faults.ENV_SNAPSHOT_GIVE_WAY: "0"})
    t = traffic.Traffic()
    with t.foreground():
        assert t.give_way() == 0.0 and t.gave_way == 0  # 0: never waits, as before the rounds went first
