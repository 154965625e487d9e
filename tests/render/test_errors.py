"""Bad input exits 2 with one line per problem: file:line: field.path: message, and no traceback."""

import re

import pytest

from .conftest import REPO, sg, sg_proc


def _replace(path, old, new):
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def _line_of(path, needle):
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(needle)


def _fails(*args):
    r = sg(*args)
    assert r.code == 2, (r.code, r.out, r.err)
    assert "Traceback" not in r.err
    return r.err


def test_unknown_key_lists_valid_keys_and_a_close_match(work):
    eu = work / "sites" / "eu.yaml"
    _replace(eu, "  partition: h200", "  partiton: h200")
    err = _fails("validate")
    line = _line_of(eu, "partiton")
    assert f"sites/eu.yaml:{line}: slurm.partiton: unknown key 'partiton' (valid keys: version, partition," in err
    assert "did you mean 'partition'?" in err
    # ...and the then missing field is reported too, at its section
    assert f"sites/eu.yaml:{_line_of(eu, 'slurm:')}: slurm.partition: required field is missing" in err


def test_unknown_top_level_key(work):
    us = work / "sites" / "us.yaml"
    us.write_text(us.read_text() + "preemtion:\n  max_requeues: 2\n")
    err = _fails("render", "--site", "us")
    assert f"sites/us.yaml:{_line_of(us, 'preemtion')}: preemtion: unknown key 'preemtion'" in err
    assert "did you mean 'preemption'?" in err


def test_wrong_type(work):
    eu = work / "sites" / "eu.yaml"
    _replace(eu, "  nodes: 2", "  nodes: two")
    err = _fails("render", "--site", "eu")
    assert re.search(rf"sites/eu\.yaml:{_line_of(eu, 'nodes: two')}: slurm\.nodes: .*integer.*'two'", err)


def test_missing_field(work):
    local = work / "sites" / "local.yaml"
    _replace(local, "  partition: debug\n", "")
    err = _fails("render", "--site", "local")
    assert f"sites/local.yaml:{_line_of(local, 'slurm:')}: slurm.partition: required field is missing" in err


@pytest.mark.parametrize("bad", ["25:00:00x", "1-25:00:00", "00:61:00", "soon", "-5"])
def test_bad_time_format(work, bad):
    eu = work / "sites" / "eu.yaml"
    _replace(eu, 'time: "2-00:00:00"', f'time: "{bad}"')
    err = _fails("render", "--site", "eu")
    assert f"sites/eu.yaml:{_line_of(eu, 'time:')}: slurm.time: invalid time '{bad}'" in err


def test_good_time_formats_and_unquoted_sexagesimal(work):
    local = work / "sites" / "local.yaml"
    for value in ("30", "45:00", "1:00:00", "2-00", "2-12:30", "2-12:30:15", "1:30:00"):
        local.write_text(re.sub(r"time: .*", f"time: {value}", local.read_text(), count=1))
        r = sg("render", "--site", "local", "--out", "o")
        assert r.code == 0, (value, r.err)
        assert f"#SBATCH --time={value}\n" in (work / "o" / "local.sbatch").read_text()


def test_broken_yaml(work):
    us = work / "sites" / "us.yaml"
    _replace(us, "  nodes: 1\n", "  nodes: [1\n")
    err = _fails("validate")
    assert re.search(r"sites/us\.yaml:\d+: invalid YAML: ", err)


def test_duplicate_key(work):
    local = work / "sites" / "local.yaml"
    _replace(local, "  nodes: 2\n", "  nodes: 2\n  nodes: 3\n")
    err = _fails("render", "--site", "local")
    assert f"sites/local.yaml:{_line_of(local, 'nodes: 3')}: slurm.nodes: duplicate key" in err


def test_regions_disagree_across_sites(work):
    us = work / "sites" / "us.yaml"
    us.write_text(us.read_text().replace("cross_region:\n  region: us", "cross_region:\n  region: us\n  regions: [us, eu, asia]"))
    err = _fails("validate")
    assert (
        f"sites/us.yaml:{_line_of(us, 'regions: [us, eu, asia]')}: cross_region.regions: "
        "['us', 'eu', 'asia'] differs from ['eu', 'us'] in sites/_base/llm-xr-1.yaml:" in err
    )
    assert "run 'llm-xr-1'" in err
    # render --all refuses too; a single site renders (the check is across sites)
    assert sg("render", "--all", "--out", "o").code == 2
    assert sg("render", "--site", "us", "--out", "o").code == 0


def test_region_list_must_match_the_sites_of_the_run(work):
    base = work / "sites" / "_base" / "llm-xr-1.yaml"
    _replace(base, "regions: [eu, us]", "regions: [eu, us, asia]")
    err = _fails("validate")
    assert f"sites/_base/llm-xr-1.yaml:{_line_of(base, 'regions:')}: cross_region.regions:" in err
    assert "no site of run 'llm-xr-1' has region 'asia'" in err


def test_transport_disagrees(work):
    eu = work / "sites" / "eu.yaml"
    eu.write_text(eu.read_text() + "  inner_steps: 100\n")
    err = _fails("validate")
    base = work / "sites" / "_base" / "llm-xr-1.yaml"
    assert (
        f"sites/_base/llm-xr-1.yaml:{_line_of(base, 'inner_steps')}: cross_region.inner_steps: 500 differs from "
        f"100 in sites/eu.yaml:{_line_of(eu, 'inner_steps')} (sites 'eu' and 'us' are both in run 'llm-xr-1'"
    ) in err


def test_signal_plan_is_validated(work):
    local = work / "sites" / "local.yaml"
    _replace(local, "checkpoint_s: 10", "checkpoint_s: 50")
    err = _fails("render", "--site", "local")
    assert f"sites/local.yaml:{_line_of(local, 'lead_time_s')}: preemption.lead_time_s: " in err
    assert "shorter than checkpoint_s + margin_s" in err


def test_hostile_path_is_rejected_with_reason(work):
    err = _fails("render", "--site", "local", "--set", "paths.run_dir=$SCRATCH/run")
    assert "--set paths.run_dir=$SCRATCH/run: paths.run_dir: path '$SCRATCH/run' contains '$'" in err


def test_bad_override_syntax_and_unknown_site(work):
    assert "expected dotted.key=value" in _fails("render", "--site", "local", "--set", "slurm.nodes")
    err = _fails("render", "--site", "eur")
    assert "unknown site 'eur'" in err and "did you mean 'eu'?" in err


def test_extends_missing_and_cycle(work):
    us = work / "sites" / "us.yaml"
    _replace(us, "extends: _base/llm-xr-1.yaml", "extends: _base/nope.yaml")
    err = _fails("render", "--site", "us")
    assert f"sites/us.yaml:{_line_of(us, 'extends')}: extends: '_base/nope.yaml' not found" in err
    _replace(us, "extends: _base/nope.yaml", "extends: _base/a.yaml")
    (work / "sites" / "_base" / "a.yaml").write_text("extends: ../us.yaml\n")
    assert "extends: cycle" in _fails("render", "--site", "us")


def test_real_process_exit_code_and_no_traceback(work):
    (work / "sites" / "local.yaml").write_text("slurm: [\n")
    r = sg_proc("validate", cwd=work)
    assert r.code == 2
    assert r.err.startswith("sbatch-gen: sites/local.yaml:")
    assert "Traceback" not in r.err
    r = sg_proc("render", "--bogus-option", cwd=REPO)
    assert r.code == 2


def test_unknown_kind(work):
    local = work / "sites" / "local.yaml"
    local.write_text("kind: pbs\n" + local.read_text())
    err = _fails("render", "--site", "local")
    assert "sites/local.yaml:1: kind: unknown kind 'pbs' (valid kinds: slurm" in err


def test_extends_list_merges_in_order_and_keeps_lines(work):
    base = work / "sites" / "_base"
    (base / "slurm-eu.yaml").write_text("slurm:\n  account: other\n  qos: high\n")
    eu = work / "sites" / "eu.yaml"
    _replace(eu, "extends: _base/llm-xr-1.yaml", "extends: [_base/llm-xr-1.yaml, _base/slurm-eu.yaml]")
    _replace(eu, "  qos: normal\n", "")
    r = sg("show", "--site", "eu")
    assert r.code == 0, r.err
    assert "account: llm-xr" in r.out  # the site file wins over its bases
    assert "qos: high" in r.out  # the second base fills what the site leaves out
    (base / "slurm-eu.yaml").write_text("slurm:\n  account: other\n  qos: 'bad qos'\n")
    err = _fails("render", "--site", "eu")
    assert "sites/_base/slurm-eu.yaml:3: slurm.qos: invalid name 'bad qos'" in err


def test_override_values_are_yaml(work):
    r = sg("show", "--site", "local", "--set", "slurm.extra_directives=[--mail-type=FAIL]",
           "--set", "slurm.extra_directives.1=--comment=x", "--set", "paths.data=null")
    assert r.code == 0, r.err
    assert "- --mail-type=FAIL\n  - --comment=x" in r.out
    err = _fails("render", "--site", "local", "--set", "slurm.extra_directives=[--output=x]")
    assert "--set slurm.extra_directives=[--output=x]: slurm.extra_directives[0]: '--output=x' is rendered" in err


def test_keep_rounds_must_cover_the_rounds_between_checkpoints(work):
    """validate reads each cross-region site's train config and checks the mailbox keeps enough rounds
    for a region resumed from its last checkpoint to replay them."""
    import shutil

    shutil.copytree(REPO / "configs", work / "configs")
    base = work / "sites" / "_base" / "llm-xr-1.yaml"
    _replace(base, "inner_steps: 500", "inner_steps: 50")  # gpt-125m checkpoints every 500 steps: 10 rounds
    err = _fails("validate")
    eu = work / "sites" / "eu.yaml"  # keep_rounds is not written anywhere: its section in each site is named
    assert (
        f"sites/eu.yaml:{_line_of(eu, 'cross_region:')}: cross_region.keep_rounds (4) must cover "
        "the 10 rounds between two checkpoints (checkpoint.every 500 / inner_steps 50)"
    ) in err
    _replace(base, "inner_steps: 50", "inner_steps: 50\n  keep_rounds: 10")
    r = sg("validate")
    assert r.code == 0, r.err


def test_train_config_missing_here_is_a_note_not_an_error(work):
    r = sg("validate")  # `work` has no configs/: nothing to cross-check against
    assert r.code == 0, r.err
    assert "trainer.config 'configs/gpt-125m.yaml' is not readable here: not cross-checked" in r.err
