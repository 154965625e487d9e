"""Train config validation: every error names file:line: field, as the site profiles' errors do."""

import subprocess
import sys
from pathlib import Path

import pytest

from sbatch_gen.errors import UserError
from sbatch_gen.train.config import load_config

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


def _err(tmp_path, text: str | bytes) -> str:
    p = tmp_path / "c.yaml"
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    with pytest.raises(UserError) as ei:
        load_config(p)
    return str(ei.value)


def test_good_minimal(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(GOOD)
    cfg = load_config(p)
    assert cfg.checkpoint.keep_last == 3 and cfg.data.source == "python-stdlib"


def test_unknown_key_names_line_and_valid_keys(tmp_path):
    msg = _err(tmp_path, GOOD.replace("  seq_len: 32\n", "  seq_len: 32\n  n_head: 4\n"))
    assert msg.startswith(
        f"{tmp_path / 'c.yaml'}:6: model.n_head: unknown key 'n_head' (valid keys: n_layers, "
    )
    assert msg.endswith("; did you mean 'n_heads'?")


def test_unknown_key_suggests_a_close_match(tmp_path):
    """Did-you-mean, as for site profiles: a misspelt optim key names the one it was meant to be."""
    msg = _err(tmp_path, GOOD + "  warmup_stepz: 2\n")
    assert msg == (
        f"{tmp_path / 'c.yaml'}:11: optim.warmup_stepz: unknown key 'warmup_stepz' (valid keys: lr, "
        "min_lr, warmup_steps, weight_decay, beta1, beta2, eps, grad_clip); did you mean 'warmup_steps'?"
    )
    msg = _err(tmp_path, GOOD + "chekpoint:\n  every: 5\n")
    assert "c.yaml:11: chekpoint: unknown key 'chekpoint' (valid keys: model, " in msg
    assert msg.endswith("; did you mean 'checkpoint'?")


def test_wrong_type_and_range(tmp_path):
    msg = _err(tmp_path, GOOD.replace("batch_size: 2", "batch_size: two").replace("steps: 10", "steps: -1"))
    lines = msg.splitlines()
    assert any(line.startswith(f"{tmp_path / 'c.yaml'}:7: train.steps: ") and "-1" in line for line in lines)
    assert any(
        line.startswith(f"{tmp_path / 'c.yaml'}:8: train.batch_size: ") and "'two'" in line for line in lines
    )


def test_cross_field_rule(tmp_path):
    msg = _err(tmp_path, GOOD.replace("n_heads: 4", "n_heads: 5"))
    assert msg == f"{tmp_path / 'c.yaml'}:4: model.n_heads: d_model 64 is not divisible by n_heads 5"


def test_missing_section_points_at_top(tmp_path):
    msg = _err(tmp_path, GOOD.replace("optim:\n  lr: 1.0e-3\n", ""))
    assert msg == f"{tmp_path / 'c.yaml'}:1: optim: required field is missing"


def test_duplicate_key(tmp_path):
    msg = _err(tmp_path, GOOD + "train:\n  steps: 3\n")
    assert ":11: train: duplicate key (first at line 6)" in msg


def test_yaml_syntax_error(tmp_path):
    msg = _err(tmp_path, GOOD.replace("  seq_len: 32", "  seq_len: [32"))
    assert msg.startswith(f"{tmp_path / 'c.yaml'}:6: invalid YAML: while parsing a flow sequence")


_BOMB = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abc", "bcd", strict=True)
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "model: !!python/object/apply:os.system [true]\n",
            ":1: model: YAML tag '!!python/object/apply:os.system' is not allowed",
        ),
        (_BOMB, ": aliases expand to more than 10000 values"),
        ("x: " + "[" * 60 + "]" * 60 + "\n", ": nested more than 50 levels deep"),
        ("model:\n  n_layers: 2\n  n_layers: 3\n", ":3: model.n_layers: duplicate key (first at line 2)"),
        (b"model:\n  n_layers: \xff\n", ":2: not UTF-8 text (byte 0xff)"),
        ("model:\n  n_layers: 2\x07\n", ":2: invalid YAML: character U+0007 (BEL) is not allowed"),
        ("optim: {lr: !!float abc}\n", ":1: optim.lr: cannot read 'abc' as !!float"),
    ],
)
def test_same_limits_and_messages_as_site_profiles(tmp_path, text, expected):
    """Train configs and site profiles are read by one loader: the same YAML gets the same checks and the
    same one-line message (only the file name differs), a UserError either way."""
    from sbatch_gen.loader import load_site

    train = _err(tmp_path, text)
    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "x.yaml").write_bytes(text.encode() if isinstance(text, str) else text)
    with pytest.raises(UserError) as ei:
        load_site(sites, "x")
    site = str(ei.value)
    assert train.startswith(f"{tmp_path / 'c.yaml'}:") and expected in train
    assert site == train.replace(str(tmp_path / "c.yaml"), str(sites / "x.yaml"))
    assert "\n" not in train


def test_not_a_mapping(tmp_path):
    assert (
        _err(tmp_path, "- a\n- b\n")
        == f"{tmp_path / 'c.yaml'}:1: a train config must be a mapping of keys to "
        "values, not list"
    )
    assert _err(tmp_path, "# nothing\n") == f"{tmp_path / 'c.yaml'}:1: empty train config"


def test_cli_exits_2_before_importing_torch(tmp_path):
    """A bad config: exit 2, the error, and "<stop file>.fatal" on one line (the batch shell does not
    requeue then), all before torch is imported."""
    p = tmp_path / "bad.yaml"
    p.write_text(GOOD.replace("lr: 1.0e-3", "lr: 0").replace("steps: 10", "steps: -1"))
    stop = tmp_path / "stop" / "7.attempt-0"
    r = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "sbatch_gen.train",
            "--config",
            str(p),
            "--stop-file",
            str(stop),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 2
    assert f"{p}:10: optim.lr: Input should be greater than 0 (got 0)" in r.stderr
    fatal = (tmp_path / "stop" / "7.attempt-0.fatal").read_text()
    problems = [ln.strip() for ln in r.stderr.splitlines() if ln.startswith(("  ", str(p)))]
    assert fatal.count("\n") == 1 and len(problems) >= 2, (fatal, r.stderr)
    assert all(x in fatal for x in problems), (fatal, r.stderr)  # every problem, on the one line
    assert not stop.exists()  # the stop file itself is the batch shell's
    imported = [
        line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")
    ]
    assert "pydantic" in imported and "torch" not in imported


def test_bad_cross_region_flags_exit_2(tmp_path):
    cfg = REPO / "configs" / "tiny.yaml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sbatch_gen.train",
            "--config",
            str(cfg),
            "--xr-enabled",
            "--xr-region",
            "eu",
            "--xr-regions",
            "us,asia",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 2
    assert (
        "cross-region flag error" in r.stderr and "region 'eu' is not in regions ['us', 'asia']" in r.stderr
    )


def _xr(**kw):
    from sbatch_gen.xr_options import CrossRegion

    return CrossRegion(enabled=True, region="eu", regions=["eu", "us"], **kw)


def test_grad_mode_keep_rounds_must_cover_the_checkpoint_interval():
    """tiny.yaml checkpoints every 5 steps: grad mode (one round per step, no fast-forward) must keep >= 5
    rounds, else a region resumed after a crash cannot re-enter them. The trainer warns at start-up
    (validate rejects it)."""
    from sbatch_gen.train.config import load_config, xr_problems

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    xr = _xr(sync="grad", keep_rounds=4)
    errs, warns = xr_problems(cfg, xr)
    assert errs == [
        "cross_region.keep_rounds (4) must cover the 5 rounds between two checkpoints "
        "(checkpoint.every 5 steps, one round per step with sync: grad): a region resumed after a "
        "crash re-enters those rounds and grad mode cannot fast-forward. Raise keep_rounds to 5, "
        "or lower checkpoint.every to 4."
    ]
    assert [e.field for e in errs] == ["keep_rounds"] and warns == []
    # the train config's path is named when given (validate does)
    assert (
        "(checkpoint.every 5 steps in configs/tiny.yaml,"
        in xr_problems(cfg, xr, config_name="configs/tiny.yaml")[0][0]
    )
    # --max-steps caps the span a replay can cover
    assert xr_problems(cfg, xr, end_step=4) == ([], [])
    assert xr_problems(cfg, xr.model_copy(update={"keep_rounds": 5})) == ([], [])
    # snapshots do not exist in grad mode: snapshot_every is not checked against the run's rounds
    assert xr_problems(cfg, _xr(sync="grad", keep_rounds=5, snapshot_every=1000)) == ([], [])


def test_diloco_needs_no_keep_rounds_for_the_checkpoint_interval():
    """DiLoCo fast-forwards from outer snapshots: keep_rounds 1 with 5 rounds between checkpoints is fine."""
    from sbatch_gen.train.config import load_config, xr_problems

    cfg = load_config(REPO / "configs" / "tiny.yaml")  # 30 steps, checkpoint every 5
    assert xr_problems(cfg, _xr(inner_steps=1, keep_rounds=1, snapshot_every=30)) == ([], [])
    assert xr_problems(cfg, _xr(inner_steps=1, keep_rounds=1, snapshot_every=1, min_regions=1)) == ([], [])


def test_diloco_snapshot_every_beyond_the_runs_rounds_is_an_error():
    from sbatch_gen.train.config import load_config, xr_problems

    cfg = load_config(REPO / "configs" / "tiny.yaml")  # 30 steps: 6 rounds of 5
    errs, warns = xr_problems(cfg, _xr(inner_steps=5, snapshot_every=7), config_name="configs/tiny.yaml")
    assert errs == [
        "cross_region.snapshot_every (7) is more than the 6 outer rounds of the run (train.steps 30 "
        "in configs/tiny.yaml // inner_steps 5): no outer snapshot is ever written, and rounds are "
        "deleted only once a snapshot covers them, so keep_rounds never takes effect and the mailbox "
        "keeps every region's payload of every round until someone deletes it by hand. Set "
        "snapshot_every to at most 6."
    ]
    assert [e.field for e in errs] == ["snapshot_every"] and warns == []
    assert xr_problems(cfg, _xr(inner_steps=5, snapshot_every=6)) == ([], [])
    # elastic or strict: the same (DiLoCo cleans up behind snapshots either way)
    elastic = xr_problems(
        cfg, _xr(inner_steps=5, snapshot_every=7, min_regions=1), config_name="configs/tiny.yaml"
    )
    assert elastic == (errs, [])
    # a run shorter than one round has no rounds to clean up: only the warning that it never synchronises
    errs, warns = xr_problems(cfg, _xr(inner_steps=40, snapshot_every=10))
    assert errs == [] and warns == [
        "train.steps (30) is fewer than cross_region.inner_steps (40): the run ends before its first "
        "round, and the regions never synchronise. Lower inner_steps, or raise train.steps."
    ]
    assert [w.field for w in warns] == ["inner_steps"]


def test_diloco_steps_not_a_multiple_of_inner_steps_warns():
    from sbatch_gen.train.config import load_config, xr_problems

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    errs, warns = xr_problems(cfg, _xr(inner_steps=7, keep_rounds=1, snapshot_every=4))
    assert errs == [] and warns == [
        "train.steps (30) is not a multiple of cross_region.inner_steps (7): the "
        "last 2 steps stay local to each region. Make train.steps a multiple of "
        "inner_steps to end on a synchronised model."
    ]
    assert [w.field for w in warns] == ["inner_steps"]
    # disabled: nothing to check
    assert xr_problems(cfg, _xr(inner_steps=7, snapshot_every=400).model_copy(update={"enabled": False})) == (
        [],
        [],
    )


@pytest.mark.parametrize(
    "h, lr, mu, field",
    [
        (10, 1.0, 0.5, "outer_momentum"),  # any momentum below H=50
        (49, 0.4, 0.9, "outer_momentum"),
        (50, 0.7, 0.9, "outer_lr"),  # effective step 7
        (100, 0.4, 0.9, "outer_lr"),  # effective step 4
        (100, 1.0, 0.6, "outer_lr"),  # 2.5
        (10, 1.0, 0.0, None),  # the defaults: plain averaging
        (50, 1.0, 0.5, None),  # effective step 2: measured better than plain at H 50-100
        (100, 0.7, 0.0, None),
        (101, 0.7, 0.9, None),  # beyond the measured H: no evidence either way
        (500, 0.7, 0.9, None),
    ],
)
def test_outer_settings_that_measured_worse_than_plain_averaging_warn(h, lr, mu, field):
    from sbatch_gen.train.config import load_config, xr_problems

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    xr = _xr(inner_steps=h, outer_lr=lr, outer_momentum=mu, snapshot_every=1)
    errs, warns = xr_problems(cfg, xr)
    outer = [w for w in warns if w.field in ("outer_lr", "outer_momentum")]
    assert errs == [] and [w.field for w in outer] == ([field] if field else [])
    if field:
        assert "bench/results/quality.md" in outer[0] and "plain averaging" in outer[0]
    # grad mode has no outer step
    assert xr_problems(cfg, xr.model_copy(update={"sync": "grad", "keep_rounds": 1000}))[1] == []


def test_the_outer_defaults_are_plain_averaging():
    xr = _xr()
    assert (xr.outer_lr, xr.outer_momentum) == (1.0, 0.0)


@pytest.mark.parametrize(
    "section, expected",
    [
        (
            "  cpu_offload: true\n",
            ":12: parallelism.cpu_offload: true needs parallelism.kind: fsdp (kind is ddp",
        ),
        (
            "  kind: ddp\n  reshard_after_forward: false\n",
            ":13: parallelism.reshard_after_forward: false needs",
        ),
        (
            "  grad_accumulation: unsharded\n",
            ":12: parallelism.grad_accumulation: unsharded needs parallelism",
        ),
        (
            "  kind: zero3\n  cpu_offload: true\n",
            ":12: parallelism.kind: Input should be 'ddp' or 'fsdp' (got 'zero3')",
        ),
    ],
)
def test_fsdp_options_need_fsdp_and_kind_is_ddp_or_fsdp(tmp_path, section, expected):
    msg = _err(tmp_path, GOOD + "parallelism:\n" + section)
    assert msg.startswith(f"{tmp_path / 'c.yaml'}{expected}") and "\n" not in msg, msg


def test_fsdp_options_with_fsdp(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(GOOD + "parallelism:\n  kind: fsdp\n  cpu_offload: true\n  grad_accumulation: unsharded\n")
    par = load_config(p).parallelism
    assert (par.kind, par.cpu_offload, par.reshard_after_forward, par.grad_accumulation) == (
        "fsdp",
        True,
        True,
        "unsharded",
    )
    assert load_config(REPO / "configs" / "tiny.yaml").parallelism.kind == "ddp"  # the default


def test_fsdp_with_cross_region_sync_validates_like_ddp_in_every_mode(tmp_path):
    """A sharded region takes every sync mode (DiLoCo with overlap none, eager or streaming; grad mode):
    xr_problems (sbatch-gen validate) finds no error in an fsdp config, and warns of nothing it does not
    with ddp (grad mode's clipping included: its norm has the same bits whatever the sharding)."""
    from sbatch_gen.train.config import xr_problems

    cfgs = []
    for kind in ("fsdp", "ddp"):
        p = tmp_path / f"{kind}.yaml"
        p.write_text(GOOD + f"parallelism:\n  kind: {kind}\n")
        cfgs.append(load_config(p))
    for opts in (
        {},
        dict(overlap="eager"),
        dict(overlap="streaming", fragments=2),
        dict(sync="grad", keep_rounds=10),
    ):
        fsdp, ddp = (xr_problems(c, _xr(snapshot_every=1, **opts), config_name="c.yaml") for c in cfgs)
        assert fsdp[0] == ddp[0] == [], opts
        assert [str(w) for w in fsdp[1]] == [str(w) for w in ddp[1]], opts


def test_compile_is_a_bool_or_enabled_and_mode(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(GOOD.replace("  batch_size: 2\n", "  batch_size: 2\n  compile: true\n"))
    assert load_config(p).train.compile.model_dump() == {"enabled": True, "mode": "default"}
    p.write_text(
        GOOD.replace(
            "  batch_size: 2\n",
            "  batch_size: 2\n  compile: {enabled: true, mode: max-autotune-no-cudagraphs}\n",
        )
    )
    assert load_config(p).train.compile.mode == "max-autotune-no-cudagraphs"
    assert load_config(REPO / "configs" / "tiny.yaml").train.compile.enabled is False  # the default


@pytest.mark.parametrize(
    "value, expected",
    [
        (
            "{enabled: true, mode: reduce-overhead}",
            ":9: train.compile.mode: Input should be 'default' or 'max-autotune-no-cudagraphs' "
            "(got 'reduce-overhead')",
        ),
        (
            "{enable: true}",
            ":9: train.compile.enable: unknown key 'enable' (valid keys: enabled, mode); did you mean 'enabled'?",
        ),
        (
            "fast",
            ":9: train.compile: must be true, false or a mapping {enabled, mode} (got 'fast'); "
            "modes: default, max-autotune-no-cudagraphs",
        ),
        ("{enabled: maybe}", ":9: train.compile.enabled: "),
    ],
)
def test_bad_compile_values_name_file_line_and_field(tmp_path, value, expected):
    msg = _err(tmp_path, GOOD.replace("  batch_size: 2\n", f"  batch_size: 2\n  compile: {value}\n"))
    assert msg.startswith(f"{tmp_path / 'c.yaml'}{expected}") and "\n" not in msg, msg
