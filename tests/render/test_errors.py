"""Bad input exits 2 with one line per problem: file:line: field.path: message, and no traceback.
Single-problem cases are one line each in test_bad_input.py; here: several problems at once, checks
across sites and train configs, and a real process."""

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
    assert (
        f"sites/eu.yaml:{line}: slurm.partiton: unknown key 'partiton' (valid keys: version, partition,"
        in err
    )
    assert "did you mean 'partition'?" in err
    # ...and the then missing field is reported too, at its section
    assert f"sites/eu.yaml:{_line_of(eu, 'slurm:')}: slurm.partition: required field is missing" in err


def test_good_time_formats_and_unquoted_sexagesimal(work):
    local = work / "sites" / "local.yaml"
    for value in ("30", "45:00", "1:00:00", "2-00", "2-12:30", "2-12:30:15", "1:30:00"):
        local.write_text(re.sub(r"time: .*", f"time: {value}", local.read_text(), count=1))
        r = sg("render", "--site", "local", "--out", "o")
        assert r.code == 0, (value, r.err)
        assert f"#SBATCH --time={value}\n" in (work / "o" / "local.sbatch").read_text()


def test_regions_disagree_across_sites(work):
    us = work / "sites" / "us.yaml"
    us.write_text(
        us.read_text().replace(
            "cross_region:\n  region: us", "cross_region:\n  region: us\n  regions: [us, eu, asia]"
        )
    )
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


def test_validate_one_site_of_a_run_reads_the_others_for_the_agreement(work):
    """validate --site eu checks eu, and eu against the other sites of its run (us), not eu alone."""
    r = sg("validate", "--site", "eu")
    assert r.code == 0, r.err
    assert r.out.splitlines() == ["ok  sites/eu.yaml", "ok  cross-region run 'llm-xr-1': eu, us agree"]
    us = work / "sites" / "us.yaml"
    us.write_text(us.read_text() + "  inner_steps: 1000\n")
    assert "cross_region.inner_steps: 1000 differs from 500" in _fails("validate", "--site", "eu")
    # a broken site of another run, or of none, is not eu's business
    (work / "sites" / "lab.yaml").write_text("slurm: [\n")
    us.write_text(us.read_text().replace("  inner_steps: 1000\n", ""))
    assert sg("validate", "--site", "eu").code == 0
    # ...but a broken partner is: the run would lack its region
    us.write_text("kind: slurm\nslurm: [\n")
    err = _fails("validate", "--site", "eu")
    assert "sites/us.yaml" in err and "no site of run" not in err, err


def test_regions_reach_the_bucket_each_its_own_way(work):
    """Endpoint, addressing style, bucket region and credential source are a region's own; the bucket and
    prefix are the run's."""
    us = work / "sites" / "us.yaml"
    us.write_text(
        us.read_text() + "  transport:\n    kind: s3\n    bucket: llm-xr-mailbox\n    prefix: runs/llm-xr-1\n"
        "    endpoint_url: https://bucket.vpce-0a1b.s3.us-east-1.vpce.amazonaws.com\n"
        "    addressing_style: virtual\n    region_name: us-east-1\n"
        "    credentials:\n      profile: xr-us\n      access_key_id_env: null\n      secret_access_key_env: null\n"
    )
    r = sg("validate")
    assert r.code == 0, r.err
    _replace(us, "    prefix: runs/llm-xr-1\n", "    prefix: runs/other\n")
    err = _fails("validate")
    assert (
        f"sites/us.yaml:{_line_of(us, 'runs/other')}: cross_region.transport.prefix: 'runs/other' differs"
        in err
    )


def test_transport_disagrees(work):
    eu = work / "sites" / "eu.yaml"
    eu.write_text(eu.read_text() + "  inner_steps: 1000\n")
    err = _fails("validate")
    base = work / "sites" / "_base" / "llm-xr-1.yaml"
    assert (
        f"sites/_base/llm-xr-1.yaml:{_line_of(base, 'inner_steps')}: cross_region.inner_steps: 500 differs from "
        f"1000 in sites/eu.yaml:{_line_of(eu, 'inner_steps')} (sites 'eu' and 'us' are both in run 'llm-xr-1'"
    ) in err


def test_the_locks_of_a_run_must_pin_one_torch_release(work):
    """python_env.lock_dir: one lock per architecture; the builds may differ (+cu128), the release may not."""
    locks = work / "locks"
    locks.mkdir()
    (locks / "x86_64.txt").write_text("numpy==2.1.0\ntorch==2.13.0+cu128\n")
    (locks / "aarch64.txt").write_text("torch==2.13.0\n")
    assert sg("validate").code == 0
    (locks / "aarch64.txt").write_text("numpy==2.1.0\ntorch==2.12.1\n")
    err = _fails("validate")
    assert (
        "the version locks of run 'llm-xr-1' pin 2 torch releases: locks/aarch64.txt:2: torch==2.12.1, "
        "locks/x86_64.txt:2: torch==2.13.0; every region must train with one"
    ) in err, err


def test_a_torch_older_than_the_renders_torchrun_flags_is_refused_before_the_queue(work):
    """torchrun's --numa-binding came with torch 2.9, --signals-to-handle with 2.10, --shutdown-timeout with
    2.12. A site pinned to an older torch (torch_spec, or a lock) than a flag torchrun cannot do without
    would fail every node's preflight after the queue wait. Under stop_protocol sbatch-gen the last two are
    not needed: run-trainer's compat shim keeps SIGTERM from an older torchrun."""
    local = work / "sites" / "local.yaml"
    _replace(local, "  python: python3\n", "  python: python3\n  torch_spec: torch==2.4.1\n")
    assert sg("validate", "--site", "local").code == 0  # sbatch-gen: through the compat shim
    _replace(local, "  resume: auto\n", "  resume: auto\n  stop_protocol: signal\n")
    err = _fails("validate", "--site", "local")
    assert (
        f"sites/local.yaml:{_line_of(local, 'torch_spec')}: python_env.torch_spec: torch 2.4.1 for site 'local', "
        "whose render gives torchrun --shutdown-timeout (preemption.checkpoint_s + preemption.margin_s (trainer."
        "stop_grace_s unset)): that flag needs torch >= 2.12"
    ) in err, err
    _replace(local, "torch==2.4.1", "torch>=2.4")  # a floor pins nothing
    assert sg("validate", "--site", "local").code == 0
    # a lock of the run's regions: eu renders --numa-binding (topology.numa_binding)
    (work / "locks").mkdir()
    (work / "locks" / "aarch64.txt").write_text("numpy==2.1.0\ntorch==2.8.0+cu128\n")
    err = _fails("validate", "--site", "eu")
    assert (
        "locks/aarch64.txt:2: python_env.lock_dir: torch 2.8.0 for site 'eu', whose render gives torchrun "
        "--numa-binding (topology.numa_binding): that flag needs torch >= 2.9"
    ) in err, err
    (work / "locks" / "aarch64.txt").write_text("torch==2.9.1+cu128\n")
    assert sg("validate", "--site", "eu").code == 0


def test_real_process_exit_code_and_no_traceback(work):
    (work / "sites" / "local.yaml").write_text("slurm: [\n")
    r = sg_proc("validate", cwd=work)
    assert r.code == 2
    assert r.err.startswith("sbatch-gen: sites/local.yaml:")
    assert "Traceback" not in r.err
    r = sg_proc("render", "--bogus-option", cwd=REPO)
    assert (r.code, r.err) == (
        2,
        "sbatch-gen: render: No such option '--bogus-option' (see sbatch-gen render --help)\n",
    )


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ("doctor", "--site", "local", "--timeout", "0"),
            "doctor --timeout: 0 is not in the range 1<=x<=3600",
        ),
        (("status", "--site", "eu", "--interval", "x"), "status --interval: 'x' is not a valid float range"),
        (("schema", "--kind", "k8s"), "schema --kind: 'k8s' is not one of 'slurm', 'ssh'"),
        (("show",), "show: Missing option '--site'"),
        (("init", "--site", "x", "--kindd", "ssh"), "init: No such option '--kindd'. Did you mean '--kind'?"),
        (("render", "--site", "local", "--all"), "render: give --site NAME or --all, not both"),
        (("report",), "report: Missing argument 'RUN_DIRS...'"),
        (("bogus",), "No such command 'bogus'"),
        (("--bogus",), "No such option '--bogus'"),
    ],
)
def test_clicks_own_errors_are_one_line_like_every_other(work, args, line):
    """A bad flag value, an unknown or missing option or command: one line, the command and flag named,
    exit 2, as the profile's errors (click's own format is three lines: usage, hint, error)."""
    command = args[0] if not args[0].startswith("-") and args[0] != "bogus" else ""
    r = sg(*args)
    assert (r.code, r.out) == (2, "")
    assert r.err == f"sbatch-gen: {line} (see {('sbatch-gen ' + command).strip()} --help)\n"


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
    r = sg(
        "show",
        "--site",
        "local",
        "--set",
        "slurm.extra_directives=[--mail-type=FAIL]",
        "--set",
        "slurm.extra_directives.1=--comment=x",
        "--set",
        "paths.data=null",
    )
    assert r.code == 0, r.err
    assert "- --mail-type=FAIL\n  - --comment=x" in r.out


def test_an_override_is_one_line_and_never_cut_at_a_yaml_comment(work):
    """VALUE is YAML: a newline in it, or a ` #` that YAML would read as a comment, is refused in one line
    naming the override (the value used would not be the one typed); a quoted # is kept."""
    err = _fails("validate", "--site", "eu", "--set", "paths.log_dir=logs\n#SBATCH --wrap=id")
    assert err == (
        "sbatch-gen: --set paths.log_dir=logs\\n#SBATCH --wrap=id: the value spans lines: a --set value is one line\n"
    ), err
    err = _fails("validate", "--site", "eu", "--set", "slurm.account=llm #x")
    assert err == (
        "sbatch-gen: --set slurm.account=llm #x: YAML reads ' #' as the start of a comment, which would leave "
        "'llm': quote the value (--set 'slurm.account=\"...\"') to keep it whole\n"
    ), err
    r = sg("show", "--site", "local", "--set", 'description="run #3"')
    assert r.code == 0 and "run #3" in r.out, r.err


def test_render_says_the_warnings_validate_says_of_the_sites_it_renders(work):
    """render prints validate's warnings of a site and writes: here sparse payloads' measured loss at H=50,
    and the streaming settings the base profile gives, which overlap none ignores."""
    _with_configs(work)
    sets = ["cross_region.payload_dtype=sparse", "cross_region.overlap=none", "cross_region.outer_momentum=0"]
    sets.append("cross_region.inner_steps=50")
    r = sg("render", "--site", "eu", "--out", "o", *[w for x in sets for w in ("--set", x)])
    assert r.code == 0 and (work / "o" / "eu.sbatch").exists(), r.err
    assert "warning: cross_region.payload_dtype sparse (0.01 of each chunk) with inner_steps 50" in r.err, (
        r.err
    )
    assert "warning: cross_region.fragments is set, but overlap is none" in r.err, r.err


def test_overrides_apply_in_order_the_later_wins(work):
    """--set in order: a key set again takes the later value (a wrapper's defaults, then the user's own)."""
    r = sg("show", "--site", "local", "--set", "slurm.partition=first", "--set", "slurm.partition=second")
    assert r.code == 0 and "\n  partition: second\n" in r.out and "partition: first" not in r.out, r.err


def _with_configs(work):
    import shutil

    shutil.copytree(REPO / "configs", work / "configs")
    return work / "sites" / "_base" / "llm-xr-1.yaml"


def test_diloco_keep_rounds_need_not_cover_the_checkpoint_interval(work):
    """DiLoCo fast-forwards from outer snapshots: 10 rounds between checkpoints with keep_rounds 1 is fine."""
    base = _with_configs(work)
    _replace(base, "inner_steps: 500", "inner_steps: 50")  # gpt-125m checkpoints every 500 steps: 10 rounds
    _replace(base, "fragment_delay_steps: 50", "fragment_delay_steps: 5")  # below 50 / 4
    _replace(base, "keep_rounds: 19", "keep_rounds: 1")
    r = sg("validate")
    assert r.code == 0, r.err


def test_grad_mode_keep_rounds_must_cover_the_checkpoint_interval(work):
    """validate reads each cross-region site's train config: in grad mode (no fast-forward) the mailbox must
    keep the rounds a region resumed from its last checkpoint re-enters. The error points at keep_rounds,
    once for the two sites that share it."""
    base = _with_configs(work)
    _replace(base, "sync: diloco", "sync: grad")
    _replace(base, "overlap: streaming", "overlap: none")  # grad mode has nothing to overlap
    _replace(base, "min_regions: 1", "min_regions: all")  # grad mode is strict
    err = _fails("validate")
    msg = (
        f"sites/_base/llm-xr-1.yaml:{_line_of(base, 'keep_rounds: 19')}: cross_region.keep_rounds (19) must "
        "cover the 500 rounds between two checkpoints (checkpoint.every 500 steps in configs/gpt-125m.yaml, "
        "one round per step with sync: grad)"
    )
    assert msg in err and err.count(msg) == 1
    assert "Raise keep_rounds to 500, or lower checkpoint.every to 19." in err
    _replace(base, "keep_rounds: 19", "keep_rounds: 500")
    r = sg("validate")
    assert r.code == 0, r.err


def test_the_regions_of_a_run_must_train_the_same_parameters(work):
    """validate compares the companion model's parameter names and shapes (the flat vector the regions
    exchange) across the sites of a run, whatever their parallelism: us training with FSDP and CPU offload
    is fine; a longer context or a deeper model is one line at us's trainer.config naming both files, the
    first parameter that differs and both shapes."""
    import shutil

    base = _with_configs(work)
    _replace(base, "overlap: streaming", "overlap: none")  # (FSDP regions: overlap none for now)
    us = work / "sites" / "us.yaml"
    own = work / "configs" / "gpt-us.yaml"
    shutil.copy(work / "configs" / "gpt-125m.yaml", own)
    _replace(own, "  kind: ddp ", "  kind: fsdp\n  cpu_offload: true ")
    with us.open("a") as f:
        f.write("\ntrainer:\n  config: configs/gpt-us.yaml\n")
    r = sg("validate")
    assert r.code == 0, r.err
    at_us = f"sites/us.yaml:{_line_of(us, 'config: configs/gpt-us.yaml')}"
    at_eu = f"sites/_base/llm-xr-1.yaml:{_line_of(base, 'config: configs/')}"
    tail = "the regions of run 'llm-xr-1' must train the same parameters (their parallelism may differ)"
    for old, new, ours, theirs in (
        (
            "seq_len: 1024",
            "seq_len: 2048",
            "parameter 1 pos.weight of shape [2048, 768]",
            "parameter 1 pos.weight of shape [1024, 768]",
        ),
        (
            "n_layers: 18",
            "n_layers: 19",
            "parameter 146 blocks.18.ln1.weight of shape [768]",
            "parameter 146 ln_f.weight of shape [768]",
        ),
    ):
        _replace(own, old, new)
        err = _fails("validate")
        assert err.splitlines() == [
            f"sbatch-gen: {at_us}: trainer.config: 'configs/gpt-us.yaml' has {ours}, where "
            f"'configs/gpt-125m.yaml' ({at_eu}, site 'eu') has {theirs}: {tail}"
        ], err
        _replace(own, new, old)


def test_snapshot_every_must_fit_in_the_runs_rounds(work):
    """gpt-125m has 20000 steps: 40 cycles of 500, each 4 rounds of one fragment (overlap streaming, 4
    fragments): 160 rounds. A snapshot every 161 rounds is never written; without streaming, 40 rounds."""
    base = _with_configs(work)
    _replace(base, "snapshot_every: 20", "snapshot_every: 161")
    err = _fails("validate")
    msg = (
        f"sites/_base/llm-xr-1.yaml:{_line_of(base, 'snapshot_every: 161')}: cross_region.snapshot_every (161) "
        "is more than the 160 outer rounds of the run (train.steps 20000 in configs/gpt-125m.yaml with "
        "fragments 4: 4 rounds per inner_steps 500): no outer snapshot is ever written"
    )
    assert msg in err and err.count(msg) == 1
    assert "Set snapshot_every to at most 160." in err
    # render checks the sites it renders as validate does: the same error, and nothing written
    err = _fails("render", "--site", "eu", "--out", "o")
    assert msg in err and not (work / "o").exists(), err
    _replace(base, "snapshot_every: 161", "snapshot_every: 41")
    _replace(base, "overlap: streaming", "overlap: none")
    err = _fails("validate")
    assert (
        "cross_region.snapshot_every (41) is more than the 40 outer rounds of the run (train.steps 20000 in "
        "configs/gpt-125m.yaml // inner_steps 500)"
    ) in err
    _replace(base, "snapshot_every: 41", "snapshot_every: 40")
    assert sg("validate").code == 0


def test_a_field_left_at_its_default_is_reported_at_each_sites_section(work):
    """snapshot_every is written nowhere (default 10): each site's `cross_region:` section is named."""
    base = _with_configs(work)
    _replace(base, "  snapshot_every: 20\n", "")
    _replace(base, "inner_steps: 500", "inner_steps: 5000")  # 4 cycles of 4 fragments: 16 rounds
    _replace(base, "fragments: 4", "fragments: 1")  # 4 rounds
    err = _fails("validate")
    for site in ("eu", "us"):
        path = work / "sites" / f"{site}.yaml"
        assert (
            f"sites/{site}.yaml:{_line_of(path, 'cross_region:')}: cross_region.snapshot_every (10) is more "
            "than the 4 outer rounds of the run"
        ) in err


def test_steps_not_a_multiple_of_inner_steps_is_a_note_at_inner_steps(work):
    base = _with_configs(work)
    _replace(base, "inner_steps: 500", "inner_steps: 300")  # 20000 = 66 x 300 + 200
    r = sg("validate")
    assert r.code == 0, r.err
    note = (
        f"note sites/_base/llm-xr-1.yaml:{_line_of(base, 'inner_steps: 300')}: warning: train.steps (20000 in "
        "configs/gpt-125m.yaml) is not a multiple of cross_region.inner_steps (300): the last 200 steps stay "
        "local to each region"
    )
    assert note in r.err and r.err.count(note) == 1


def test_an_outer_step_that_measured_worse_is_a_note_at_its_line(work):
    """H=50 with the literature's outer_lr 0.7 / momentum 0.9 and no overlap: a warning at outer_lr's line,
    once for both sites (a shared base), exit 0. (With streaming that setting measured best: no warning.)"""
    base = _with_configs(work)
    _replace(base, "inner_steps: 500", "inner_steps: 50")
    _replace(base, "fragment_delay_steps: 50", "fragment_delay_steps: 5")
    assert "outer_lr 0.7" not in sg("validate").err
    _replace(base, "overlap: streaming", "overlap: none")
    r = sg("validate")
    assert r.code == 0, r.err
    note = (
        f"note sites/_base/llm-xr-1.yaml:{_line_of(base, 'outer_lr: 0.7')}: warning: cross_region.outer_lr 0.7 "
        "with outer_momentum 0.9 is an effective outer step outer_lr / (1 - outer_momentum) of 7"
    )
    assert note in r.err and r.err.count(note) == 1


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("min_regions", "all", "'all' differs from 1"),
        ("grace_s", "45", "45.0 differs from 30.0"),
        ("heartbeat_s", "null", "None differs from 5.0"),
        ("snapshot_every", "10", "10 differs from 20"),
    ],
)
def test_elastic_settings_must_agree_across_the_sites_of_a_run(work, field, value, shown):
    us = work / "sites" / "us.yaml"
    _replace(us, "cross_region:\n  region: us", f"cross_region:\n  region: us\n  {field}: {value}")
    err = _fails("validate")
    base = work / "sites" / "_base" / "llm-xr-1.yaml"
    assert (
        f"sites/us.yaml:{_line_of(us, f'{field}: {value}')}: cross_region.{field}: {shown} in "
        f"sites/_base/llm-xr-1.yaml:{_line_of(base, f'{field}:')} (sites 'eu' and 'us' are both in run "
        "'llm-xr-1' and must agree)"
    ) in err


def test_train_config_missing_here_is_a_warning_not_an_error(work):
    r = sg("validate")  # `work` has no configs/: nothing to cross-check against
    assert r.code == 0, r.err
    base = work / "sites" / "_base" / "llm-xr-1.yaml"
    note = (
        f"note sites/_base/llm-xr-1.yaml:{_line_of(base, 'config:')}: warning: trainer.config: "
        "'configs/gpt-125m.yaml' does not exist here (a relative path is read from the directory the job is "
        "submitted from; validate takes that to be this one): the job's preflight would fail on every node, "
        "after the queue wait; the cross-region settings are not checked against it\n"
    )
    assert r.err.count(note) == 1, r.err  # eu and us share the line: once


def test_a_trainer_file_missing_here_is_a_warning_at_its_line(work):
    """A site without cross_region too: trainer.config (and trainer.script) that are not files here, relative
    to the directory validate runs in (the submit directory), are a warning at the field's line, exit 0; an
    absolute path may be on a filesystem only the nodes see, and is said so."""
    local = work / "sites" / "local.yaml"
    line = _line_of(local, "config: configs/tiny.yaml")
    r = sg("validate", "--site", "local")
    assert r.code == 0, r.err
    assert r.err == (
        f"note sites/local.yaml:{line}: warning: trainer.config: 'configs/tiny.yaml' does not exist here (a "
        "relative path is read from the directory the job is submitted from; validate takes that to be this "
        "one): the job's preflight would fail on every node, after the queue wait\n"
    )
    (work / "configs").mkdir()
    (work / "configs" / "tiny.yaml").write_text("# here\n")
    r = sg("validate", "--site", "local")
    assert r.code == 0 and r.err == "", r.err
    (work / "configs" / "tiny.yaml").unlink()
    (work / "configs" / "tiny.yaml").mkdir()  # a directory is no config either
    assert "trainer.config: 'configs/tiny.yaml' is not a file here" in sg("validate", "--site", "local").err
    _replace(
        local,
        "  module: sbatch_gen.train\n  config: configs/tiny.yaml",
        "  module: null\n  script: t.py\n  config: /nowhere/c.yaml",
    )
    r = sg("validate", "--site", "local")
    assert r.code == 0, r.err
    assert r.err.splitlines() == [
        f"note sites/local.yaml:{line}: warning: trainer.script: 't.py' does not exist here (a relative path is "
        "read from the directory the job is submitted from; validate takes that to be this one): the job's "
        "preflight would fail on every node, after the queue wait",
        f"note sites/local.yaml:{line + 1}: warning: trainer.config: '/nowhere/c.yaml' does not exist on this "
        "machine: the job's preflight fails on every node unless it is there (on a filesystem the nodes see)",
    ]


def test_a_bad_train_config_is_one_line_per_problem_with_a_close_match(work):
    """validate reads the train config with the profiles' loader: each problem is its own line (once for
    the two sites that share the setting), naming the site's trainer.config and then the config's
    file:line: field, with did-you-mean for a misspelt key."""
    _with_configs(work)
    cfg = work / "configs" / "gpt-125m.yaml"
    _replace(cfg, "  warmup_steps: 500", "  warmup_stepz: 500")
    _replace(cfg, "  batch_size: 16 ", "  batch_size: -1 ")
    err = _fails("validate")
    where = f"sites/_base/llm-xr-1.yaml:{_line_of(work / 'sites' / '_base' / 'llm-xr-1.yaml', 'config: configs/')}"
    head = f"sbatch-gen: {where}: trainer.config 'configs/gpt-125m.yaml' does not validate: configs/gpt-125m.yaml:"
    lines = err.splitlines()
    assert (
        f"{head}{_line_of(cfg, 'batch_size: -1')}: train.batch_size: Input should be greater than or equal to 1 "
        "(got -1)" in lines
    )
    unknown = [line for line in lines if "optim.warmup_stepz" in line]
    assert len(unknown) == 1 and unknown[0].startswith(
        f"{head}{_line_of(cfg, 'warmup_stepz')}: optim.warmup_stepz: "
        "unknown key 'warmup_stepz' (valid keys: lr, "
    )
    assert unknown[0].endswith("; did you mean 'warmup_steps'?")


def test_streaming_schedule_and_fragments_are_checked_at_their_lines(work):
    """overlap: streaming: a fragment's delay must end before the next round starts (tau < H / F), and the
    model must have a parameter tensor for every fragment; each error names its line."""
    base = _with_configs(work)
    _replace(base, "fragment_delay_steps: 50", "fragment_delay_steps: 125")
    err = _fails("validate")
    assert (
        f"sites/_base/llm-xr-1.yaml:{_line_of(base, 'fragment_delay_steps: 125')}: "
        "cross_region.fragment_delay_steps: fragment_delay_steps 125 must be below inner_steps / fragments "
        "(500 / 4: rounds start every 125 steps or more)" in err
    )
    _replace(base, "fragment_delay_steps: 125", "fragment_delay_steps: 5")
    _replace(base, "fragment_delay_steps: 5", "fragment_delay_steps: 1")
    _replace(base, "  fragments: 4", "  fragments: 200")  # gpt-125m: 18 layers, 148 parameter tensors
    err = _fails("validate")
    msg = (
        f"sites/_base/llm-xr-1.yaml:{_line_of(base, 'fragments: 200')}: cross_region.fragments 200: the "
        "model has only 148 parameter tensors to split (each fragment needs one at least); lower "
        "cross_region.fragments (model.n_layers 18 in configs/gpt-125m.yaml)"
    )
    assert msg in err and err.count(msg) == 1, err
    _replace(base, "  fragments: 200", "  fragments: 4")
    r = sg("validate")
    assert r.code == 0, r.err


def test_an_ssh_section_in_a_slurm_profile_is_an_unknown_key_not_a_forgotten_kind(work):
    # The "did you mean kind: ssh?" line is only for a profile with none of kind slurm's sections.
    local = work / "sites" / "local.yaml"
    local.write_text(local.read_text() + "node:\n  gpus: 0\n  cpus: 4\n")
    err = _fails("validate", "--site", "local")
    assert "node: unknown key 'node'" in err and "did you mean kind" not in err


def test_a_dollar_in_extra_env_is_a_warning_at_its_line_and_renders_as_written(work):
    """Values are quoted, so `$SLURM_JOB_ID` reaches the job as those characters: validate and render say
    so, one line at the value's line, and still exit 0 (a literal '$' may be meant)."""
    _with_configs(work)  # (else: a warning that trainer.config is not here)
    local = work / "sites" / "local.yaml"
    local.write_text(local.read_text() + 'extra_env:\n  RUN_TAG: "job-$SLURM_JOB_ID"\n  PLAIN: x\n')
    line = _line_of(local, "RUN_TAG")
    note = (
        f"note sites/local.yaml:{line}: warning: extra_env.RUN_TAG: 'job-$SLURM_JOB_ID' is exported as written: "
        "values are quoted, so '$' and '`' are not expanded"
    )
    for args in (("validate", "--site", "local"), ("render", "--site", "local", "--out", "o")):
        r = sg(*args)
        assert r.code == 0, r.err
        assert r.err.count(note) == 1 and len(r.err.splitlines()) == 1, r.err
    # a default (a submit-time RUN_TAG wins), its '$' escaped: the same characters
    assert 'export RUN_TAG="${RUN_TAG-job-\\$SLURM_JOB_ID}"\n' in (work / "o" / "local.sbatch").read_text()
    r = sg("validate", "--site", "lab", "--site", "local")  # a plain value (and the SSH kind): no note
    assert "PLAIN" not in r.err and r.err.count("warning") == 1, r.err


def test_validate_takes_set_as_render_does(work):
    """validate --set applies an override to the sites it validates, as render's --set does: a bad value is
    refused by both in the same words, a good one passes both; with --site the run's other sites are read
    as they are."""
    bad = ("--set", "slurm.partition=bad partition!")
    v, r = _fails("validate", "--site", "eu", *bad), _fails("render", "--site", "eu", "--out", "o", *bad)
    assert "slurm.partition" in v and v == r, (v, r)
    ok = sg("validate", "--site", "eu", "--set", "slurm.partition=h200-long")
    assert ok.code == 0, ok.err
    # an override of a field the run's sites must agree on: with --site, us is read as committed
    err = _fails("validate", "--site", "eu", "--set", "cross_region.inner_steps=1000")
    assert "cross_region.inner_steps: 500 differs from 1000" in err or "differs from 500" in err, err
    # without --site every site gets it, and they agree
    assert sg("validate", "--set", "cross_region.inner_steps=1000").code == 0


def test_keys_a_set_kind_makes_unknown_name_the_override_beside_their_line(work):
    """--set cross_region.transport.kind=fs: the base profile's s3 keys are unknown to the fs transport, and
    its root missing. Each line names where the key is written and the override that changed the kind
    beside it, so the file's lines are not taken for the mistake; an error elsewhere says nothing of it."""
    base = REPO / "sites" / "_base" / "llm-xr-1.yaml"
    err = _fails(
        "validate", "--site", "eu", "--set", "cross_region.transport.kind=fs", "--set", "slurm.nodes=0"
    )
    after = " (after --set cross_region.transport.kind=fs)"
    lines = err.splitlines()
    bucket = _line_of(base, "    bucket: llm-xr-mailbox")
    assert (
        f"sbatch-gen: sites/_base/llm-xr-1.yaml:{bucket}: cross_region.transport.bucket: unknown key 'bucket' "
        f"(valid keys: kind, root){after}"
    ) in lines, err
    assert any(x.endswith(f"cross_region.transport.root: required field is missing{after}") for x in lines), (
        err
    )
    assert [x for x in lines if "slurm.nodes" in x] == [
        "sbatch-gen: --set slurm.nodes=0: slurm.nodes: Input should be greater than or equal to 1 (got 0)"
    ], err
    assert all(x.endswith(after) for x in lines if "cross_region.transport" in x), err


def test_an_unknown_kind_of_a_section_is_named_at_its_kind_line(work):
    """A section's kind that is none of its kinds: one line at the `kind:` line (not the section's), naming the
    kinds there are; set by --set, the line names the override."""
    base = work / "sites" / "_base" / "llm-xr-1.yaml"
    _replace(base, "    kind: s3", "    kind: ftp")
    err = _fails("validate", "--site", "eu")
    line = _line_of(base, "    kind: ftp")
    assert err == (
        f"sbatch-gen: sites/_base/llm-xr-1.yaml:{line}: cross_region.transport.kind: unknown kind 'ftp' "
        "(valid: 'fs', 's3')\n"
    ), err
    err = _fails("validate", "--site", "us", "--set", "cross_region.transport.kind=gcs")
    assert (
        "sbatch-gen: --set cross_region.transport.kind=gcs: cross_region.transport.kind: unknown kind 'gcs' "
        "(valid: 'fs', 's3')"
    ) in err.splitlines(), err


def test_every_independent_problem_of_a_profile_in_one_run(work):
    """One run reports every independent problem a file has, each `file:line: field: message`: every bad
    name of a mapping (extra_env), and every check between fields of the profile (every bad item of
    slurm.secrets and slurm.export, and each rule), not only the first. Pydantic checks between fields only
    once the fields themselves are valid: a field error comes first, alone with the other field errors."""
    local = work / "sites" / "local.yaml"
    original = local.read_text()
    local.write_text(original + "extra_env:\n  SLURM_A: x\n  MASTER_ADDR: y\n")
    err = _fails("validate", "--site", "local")
    assert err.strip().splitlines() == [
        f"sbatch-gen: sites/local.yaml:{_line_of(local, 'SLURM_A:')}: extra_env.SLURM_A: SLURM_A: SLURM_*/SBATCH_* "
        "variables belong to Slurm",
        f"sbatch-gen: sites/local.yaml:{_line_of(local, 'MASTER_ADDR:')}: extra_env.MASTER_ADDR: MASTER_ADDR is set "
        "by sbatch-gen from other profile fields; set it there",
    ], err
    local.write_text(original + "topology:\n  numa_binding: node\nnccl:\n  ib_hca: [mlx5_0]\n")
    _replace(
        local,
        "\nslurm:\n",
        "\nslurm:\n  secrets: [SLURM_X, BASH_ENV, HF_TOKEN]\n  export: [AWS_SECRET_ACCESS_KEY, ALL]\n",
    )
    lines = _fails("validate", "--site", "local").strip().splitlines()
    want = {
        "topology.numa_binding: this site has no GPUs": "numa_binding:",
        "nccl: this site has no GPUs": "nccl:",
        "slurm.secrets[0]: SLURM_X: Slurm's own": "secrets:",
        "slurm.secrets[1]: BASH_ENV: ": "secrets:",
        "slurm.export[0]: AWS_SECRET_ACCESS_KEY is a secret": "export:",
        "slurm.export[1]: ALL: ": "export:",
        # (only for the name it does not refuse)
        "slurm.secrets_file: the profile names secrets the job needs: HF_TOKEN (slurm.secrets[2]);": "slurm:",
    }
    for text, key in want.items():
        line = f"sbatch-gen: sites/local.yaml:{_line_of(local, key)}: {text}"
        assert any(x.startswith(line) for x in lines), (line, lines)
    assert len(lines) == len(want), lines


def test_every_repeated_host_in_one_run(work):
    lab = work / "sites" / "ssh-local.yaml"
    err = _fails("validate", "--site", "ssh-local", "--set", "hosts=[a, a, b, b]")
    assert err.strip().splitlines() == [
        "sbatch-gen: --set hosts=[a, a, b, b]: hosts[1].name: host 'a' is listed twice",
        "sbatch-gen: --set hosts=[a, a, b, b]: hosts[3].name: host 'b' is listed twice",
    ], err
    assert lab.exists()


def test_a_lead_time_within_slurms_check_of_the_limit_is_a_warning(work):
    """Slurm sends --signal's signal at its periodic check (every 30 s) once the job is within lead_time_s + 30 s
    of its limit: with slurm.time 2:00 and lead_time_s 90 that is the first check, seconds after the start
    (an attempt in CI was signalled in its first second). validate and render say so at lead_time_s's line
    and exit 0; 30 s more of slurm.time and the note is gone."""
    _with_configs(work)
    local = work / "sites" / "local.yaml"
    _replace(local, 'time: "00:30:00"', 'time: "00:02:00"')
    _replace(local, "lead_time_s: 60", "lead_time_s: 90")
    line = _line_of(local, "lead_time_s")
    note = (
        f"note sites/local.yaml:{line}: warning: preemption.lead_time_s 90 s is within 30 s of slurm.time "
        "(00:02:00 = 120 s), and Slurm sends the signal at its periodic check, up to 30 s before lead_time_s: "
        "every attempt may be asked to stop seconds after it starts"
    )
    for args in (("validate", "--site", "local"), ("render", "--site", "local", "--out", "o")):
        r = sg(*args)
        assert r.code == 0, r.err
        assert r.err.count(note) == 1 and len(r.err.splitlines()) == 1, r.err
    _replace(local, 'time: "00:02:00"', 'time: "00:02:01"')
    r = sg("validate", "--site", "local")
    assert r.code == 0 and "lead_time_s" not in r.err, r.err
