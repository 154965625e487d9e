"""The run spec: flags merged over the train config and the cross-region options once, then frozen."""

import dataclasses
from pathlib import Path

import pytest

from sbatch_gen.train.cli import parse_args
from sbatch_gen.train.spec import RunSpec, SpecError

from .conftest import write_config


def _spec(cfg: Path, flags: str = "") -> RunSpec:
    return RunSpec.from_args(parse_args(["--config", str(cfg), *flags.split()]))


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    return write_config(
        tmp_path / "c.yaml", train={"steps": 20}, data={"path": "cfg-data"}, run_dir="cfg-run"
    )


def test_defaults_come_from_the_config(cfg, monkeypatch):
    monkeypatch.delenv("SBATCH_GEN_STOP_FILE", raising=False)
    s = _spec(cfg)
    assert s.config_path == str(cfg)
    assert s.cfg.run_dir == "cfg-run" and s.run_dir == Path("cfg-run")
    assert s.cfg.data.path == "cfg-data"
    assert s.end_step == 20 and s.cfg.train.steps == 20
    assert s.resume == "auto" and s.stop_file is None
    assert not s.xr.enabled and s.xr_warnings == ()


def test_flags_override_the_config_in_the_spec(cfg):
    s = _spec(
        cfg, "--run-dir flag-run --data-path flag-data --max-steps 7 --resume none --stop-file stop-here"
    )
    # Merged into the effective config: nothing downstream can read the unmerged value.
    assert s.cfg.run_dir == "flag-run" and s.run_dir == Path("flag-run")
    assert s.cfg.data.path == "flag-data"
    # --max-steps caps the end; the LR schedule still spans train.steps.
    assert s.end_step == 7 and s.cfg.train.steps == 20
    assert s.resume == "none" and s.stop_file == Path("stop-here")
    # The rest of the config is the file's.
    assert s.cfg.data.source == "python-stdlib" and s.cfg.model.d_model == 64


def test_max_steps_above_train_steps_is_capped_and_empty_overrides_fall_back(cfg):
    s = RunSpec.from_args(
        parse_args(["--config", str(cfg), "--max-steps", "1000", "--run-dir", "", "--data-path", ""])
    )
    assert s.end_step == 20
    assert s.cfg.run_dir == "cfg-run" and s.cfg.data.path == "cfg-data"


def test_stop_file_falls_back_to_the_environment(cfg, monkeypatch):
    monkeypatch.setenv("SBATCH_GEN_STOP_FILE", "/tmp/env-stop")
    assert _spec(cfg).stop_file == Path("/tmp/env-stop")
    assert _spec(cfg, "--stop-file flag-stop").stop_file == Path("flag-stop")


def test_cross_region_flags_become_validated_options(cfg):
    s = _spec(
        cfg,
        "--xr-enabled --xr-region us --xr-regions eu,us --xr-inner-steps 5 --xr-transport fs --xr-root /mb "
        "--xr-heartbeat-s none --xr-snapshot-every 2",
    )
    assert s.xr.enabled and s.xr.region == "us" and s.xr.regions == ["eu", "us"]
    assert s.xr.inner_steps == 5 and s.xr.transport.root == "/mb" and s.xr.heartbeat_s is None
    assert s.xr_warnings == ()


def test_cross_region_problems_become_warnings_against_the_capped_end(tmp_path):
    """grad mode must keep the rounds between two checkpoints; a --max-steps cap below checkpoint.every
    shortens what a replay can span, so the same flags pass with the cap and warn without it."""
    cfg = write_config(tmp_path / "c.yaml", train={"steps": 30}, checkpoint={"every": 10})
    xr = "--xr-enabled --xr-region eu --xr-regions eu,us --xr-sync grad --xr-keep-rounds 4"
    (warning,) = _spec(cfg, xr).xr_warnings
    assert "cross_region.keep_rounds (4) must cover the 10 rounds" in warning
    assert _spec(cfg, xr + " --max-steps 4").xr_warnings == ()


def test_bad_cross_region_flags_raise_one_line_each(cfg):
    with pytest.raises(SpecError) as e:
        _spec(cfg, "--xr-enabled --xr-inner-steps 0 --xr-threads x")
    head, *lines = str(e.value).splitlines()
    assert head == "cross-region flag error:" and len(lines) == 2
    assert lines[0].startswith("--xr-inner-steps: ") and lines[1].startswith("--xr-threads: ")
    with pytest.raises(SpecError) as e:
        _spec(cfg, "--xr-enabled --xr-region eu --xr-regions us,asia")
    assert "region 'eu' is not in regions ['us', 'asia']" in str(e.value).splitlines()[1]


def test_without_flags_the_cross_region_options_come_from_the_environment(cfg, monkeypatch):
    """A profile whose trainer.args has no {xr_args} exports SBATCH_GEN_XR_*; flags, when given, win."""
    monkeypatch.setenv("SBATCH_GEN_XR_ENABLED", "1")
    monkeypatch.setenv("SBATCH_GEN_XR_REGION", "us")
    monkeypatch.setenv("SBATCH_GEN_XR_REGIONS", "eu,us")
    monkeypatch.setenv("SBATCH_GEN_XR_ROOT", "/mb")
    s = _spec(cfg)
    assert s.xr.enabled and s.xr.region == "us" and s.xr.transport.root == "/mb"
    assert _spec(cfg, "--xr-enabled --xr-region eu --xr-regions eu").xr.regions == ["eu"]
    monkeypatch.setenv("SBATCH_GEN_XR_INNER_STEPS", "0")
    with pytest.raises(SpecError) as e:
        _spec(cfg)
    head, line = str(e.value).splitlines()
    assert head == "cross-region environment error:" and line.startswith("SBATCH_GEN_XR_INNER_STEPS: ")


def test_bad_config_raises_with_file_line_field(tmp_path):
    bad = write_config(tmp_path / "bad.yaml", optim={"lr": 0})
    with pytest.raises(SpecError) as e:
        _spec(bad)
    head, *problems = str(e.value).splitlines()
    assert head == "config error:"
    assert len(problems) == 1 and problems[0].startswith(f"{bad}:") and "optim.lr" in problems[0]


def test_the_spec_and_its_config_are_frozen(cfg):
    s = _spec(cfg, "--max-steps 3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.end_step = 10  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.cfg = s.cfg  # type: ignore[misc]
    with pytest.raises(Exception, match="frozen"):
        s.cfg.data.path = "elsewhere"  # type: ignore[misc]
    with pytest.raises(Exception, match="frozen"):
        s.xr.region = "x"  # type: ignore[misc]


def test_the_config_file_is_read_once(cfg, monkeypatch):
    """One merge: from_args loads the config once; the trainer gets the spec, never the flags."""
    import sbatch_gen.train.spec as spec_mod

    calls = []
    real = spec_mod.load_config
    monkeypatch.setattr(spec_mod, "load_config", lambda p: calls.append(p) or real(p))
    s = _spec(cfg, "--max-steps 3")
    assert calls == [str(cfg)] and s.end_step == 3


def test_an_end_step_beyond_the_config_is_refused(cfg):
    s = _spec(cfg)
    with pytest.raises(ValueError, match="end_step 21 is outside 0..train.steps"):
        dataclasses.replace(s, end_step=21)
    with pytest.raises(ValueError, match="end_step -1"):
        dataclasses.replace(s, end_step=-1)


def test_metrics_flags_replace_the_configs_metrics_section(tmp_path):
    cfg = write_config(tmp_path / "m.yaml", metrics={"sinks": ["tensorboard"], "prometheus_every": 3})
    s = _spec(cfg)
    assert s.cfg.metrics.sinks == ["tensorboard"] and s.cfg.metrics.prometheus_every == 3
    s = _spec(cfg, "--metrics-sinks prometheus,wandb --metrics-wandb-project p1")
    m = s.cfg.metrics
    assert m.sinks == ["prometheus", "wandb"] and m.wandb_project == "p1"
    assert m.prometheus_every == 10  # the section is replaced as a whole: the flags are the profile's
    assert _spec(write_config(tmp_path / "n.yaml")).cfg.metrics.sinks == []


def test_metrics_flags_round_trip_and_bad_ones_are_named(tmp_path):
    from sbatch_gen.metrics_options import MetricsOptions, to_argv

    opts = MetricsOptions(
        sinks=["wandb", "prometheus"], prometheus_dir="/var/lib/node_exporter", wandb_entity="team"
    )
    cfg = write_config(tmp_path / "c.yaml")
    assert _spec(cfg, " ".join(to_argv(opts))).cfg.metrics == opts
    assert to_argv(None) == []
    with pytest.raises(SpecError) as e:
        _spec(cfg, "--metrics-sinks tensorboard,tensorboard --metrics-wandb-api-key-env 1BAD")
    assert str(e.value).splitlines() == [
        "metrics flag error:",
        "--metrics-sinks: Value error, listed twice: tensorboard",
        "--metrics-wandb-api-key-env: String should match pattern '^[A-Za-z_][A-Za-z0-9_]{0,127}$'",
    ]


def test_a_metrics_section_error_names_the_file_and_line(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", metrics={"sinks": ["tensorbord"]})
    with pytest.raises(SpecError) as e:
        _spec(cfg)
    assert f"{cfg}:" in str(e.value) and "metrics.sinks" in str(e.value) and "tensorboard" in str(e.value)
