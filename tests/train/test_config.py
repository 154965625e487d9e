"""Train config validation: every error names file:line: field."""

import subprocess
import sys
from pathlib import Path

import pytest

from sbatch_gen.train.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tiny", "demo", "gpt-125m"])
def test_shipped_configs_validate(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert cfg.model.d_model % cfg.model.n_heads == 0


GOOD = """\
model:
  n_layers: 2
  d_model: 64
  n_heads: 4
  seq_len: 32
train:
  steps: 10
  batch_size: 2
optim:
  lr: 1.0e-3
"""


def _err(tmp_path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    return str(ei.value)


def test_good_minimal(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(GOOD)
    cfg = load_config(p)
    assert cfg.checkpoint.keep_last == 3 and cfg.data.source == "python-stdlib"


def test_unknown_key_names_line_and_valid_keys(tmp_path):
    msg = _err(tmp_path, GOOD.replace("  seq_len: 32\n", "  seq_len: 32\n  n_head: 4\n"))
    assert msg.startswith(f"{tmp_path / 'c.yaml'}:6: model.n_head: unknown field (valid: ")
    assert "n_heads" in msg


def test_wrong_type_and_range(tmp_path):
    msg = _err(tmp_path, GOOD.replace("batch_size: 2", "batch_size: two").replace("steps: 10", "steps: -1"))
    lines = msg.splitlines()
    assert any(line.startswith(f"{tmp_path / 'c.yaml'}:7: train.steps: ") and "-1" in line for line in lines)
    assert any(line.startswith(f"{tmp_path / 'c.yaml'}:8: train.batch_size: ") and "'two'" in line for line in lines)


def test_cross_field_rule(tmp_path):
    msg = _err(tmp_path, GOOD.replace("n_heads: 4", "n_heads: 5"))
    assert msg == f"{tmp_path / 'c.yaml'}:4: model.n_heads: Value error, d_model 64 is not divisible by n_heads 5 (got 5)"


def test_missing_section_points_at_top(tmp_path):
    msg = _err(tmp_path, GOOD.replace("optim:\n  lr: 1.0e-3\n", ""))
    assert msg == f"{tmp_path / 'c.yaml'}:1: optim: Field required"


def test_duplicate_key(tmp_path):
    msg = _err(tmp_path, GOOD + "train:\n  steps: 3\n")
    assert ":11: train: duplicate key (first at line 6)" in msg


def test_yaml_syntax_error(tmp_path):
    msg = _err(tmp_path, GOOD.replace("  seq_len: 32", "  seq_len: [32"))
    assert msg.startswith(f"{tmp_path / 'c.yaml'}:") and "(yaml)" in msg


def test_not_a_mapping(tmp_path):
    assert ":1: (top level): expected a mapping" in _err(tmp_path, "- a\n- b\n")


def test_cli_exits_2_before_importing_torch(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(GOOD.replace("lr: 1.0e-3", "lr: 0"))
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "sbatch_gen.train", "--config", str(p)],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2
    assert f"{p}:10: optim.lr: Input should be greater than 0 (got 0)" in r.stderr
    imported = [line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "pydantic" in imported and "torch" not in imported


def test_bad_cross_region_flags_exit_2(tmp_path):
    cfg = REPO / "configs" / "tiny.yaml"
    r = subprocess.run([sys.executable, "-m", "sbatch_gen.train", "--config", str(cfg), "--xr-enabled",
                        "--xr-region", "eu", "--xr-regions", "us,asia"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2
    assert "cross-region flag error" in r.stderr and "region 'eu' is not in regions ['us', 'asia']" in r.stderr


def test_keep_rounds_shorter_than_the_checkpoint_interval_is_reported(tmp_path):
    """tiny.yaml checkpoints every 5 steps: grad mode (one round per step) should keep >= 5 rounds, else a
    region resumed after a crash cannot replay. The trainer warns at start-up (validate rejects it)."""
    from sbatch_gen.train.config import load_config, xr_problems
    from sbatch_gen.xr_options import CrossRegion

    cfg_path = REPO / "configs" / "tiny.yaml"
    cfg = load_config(cfg_path)
    xr = CrossRegion(enabled=True, region="eu", regions=["eu", "us"], sync="grad", keep_rounds=4)
    errs, _ = xr_problems(cfg, xr)
    assert errs == ["cross_region.keep_rounds (4) must cover the 5 rounds between two checkpoints "
                    "(checkpoint.every 5 steps, one round per step): a region resumed after a crash replays "
                    "them. Raise keep_rounds or checkpoint more often."]
    # --max-steps caps the span a replay can cover
    assert xr_problems(cfg, xr, end_step=4) == ([], [])
    assert xr_problems(cfg, xr.model_copy(update={"keep_rounds": 5}))[0] == []
    diloco = xr.model_copy(update={"sync": "diloco", "inner_steps": 7, "keep_rounds": 1})
    errs, warns = xr_problems(cfg, diloco)
    assert errs == [] and warns == ["train.steps (30) is not a multiple of cross_region.inner_steps (7): "
                                    "the last 2 steps stay local to each region"]
