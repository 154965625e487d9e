"""trainer.args and trainer.script: a trainer's own command line, with placeholders for what sbatch-gen
knows (sbatch_gen/launch.py: PLACEHOLDERS, parse_arg). Validation errors are one line, file:line: field:
message, naming the list index; the filled-in arguments are checked here as the Python lists the templates
render, in test_launch_argv.py as both kinds' scripts expand them, in test_hostile.py with hostile values."""

from __future__ import annotations

import json
import re

import pytest

from sbatch_gen.launch import (
    PLACEHOLDERS,
    SLURM,
    SSH,
    Concat,
    PlaceholderError,
    Ref,
    Var,
    parse_arg,
    trainer_argv,
)
from sbatch_gen.loader import load_site

from .conftest import REPO, sg
from .script_parts import SCRIPT_SUFFIXES

TRAINER = "trainer:\n  module: sbatch_gen.train\n  config: configs/tiny.yaml\n  resume: auto\n"
KNOWN = ", ".join("{" + n + "}" for n in PLACEHOLDERS)
ESCAPES = "write {{ and }} for a literal brace"


def _write(work, trainer: str, extra: str = ""):
    local = work / "sites" / "local.yaml"
    text = local.read_text()
    assert TRAINER in text
    local.write_text(text.replace(TRAINER, trainer) + extra)
    return local


def _line_of(path, needle: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(needle)


def _error(work, trainer: str, extra: str = "") -> tuple[str, object]:
    path = _write(work, trainer, extra)
    r = sg("render", "--site", "local", "--out", "o")
    assert r.code == 2, (r.out, r.err)
    assert "Traceback" not in r.err
    assert len(r.err.splitlines()) == 1, r.err
    return r.err.rstrip("\n"), path


def _args(*args: str) -> str:
    return "  args:\n" + "".join(f"    - {json.dumps(a)}\n" for a in args)


SCRIPT = "trainer:\n  script: train.py\n  config: configs/tiny.yaml\n"


# ---- the placeholder syntax -------------------------------------------------------------------------


def test_parse_arg_splits_literal_text_and_placeholders():
    assert parse_arg("--out={run_dir}/x") == ("--out=", Ref("run_dir"), "/x")
    assert parse_arg("{config}") == (Ref("config"),)
    assert parse_arg("{nnodes}x{nproc_per_node}") == (Ref("nnodes"), "x", Ref("nproc_per_node"))
    assert parse_arg("{{run_dir}}") == ("{run_dir}",)  # escaped: literal braces, no placeholder
    assert parse_arg("a{{b}}c") == ("a{b}c",)
    assert parse_arg("{{{site}}}") == ("{", Ref("site"), "}")
    assert parse_arg("") == ()
    assert parse_arg("$HOME `x` 'y'") == ("$HOME `x` 'y'",)
    assert parse_arg("{xr_args}") == (Ref("xr_args"),)


@pytest.mark.parametrize(
    "arg, message",
    [
        ("{foo}", "unknown placeholder {foo} in '{foo}' (known: " + KNOWN + "; " + ESCAPES + ")"),
        (
            "--dir={rundir}",
            "unknown placeholder {rundir} in '--dir={rundir}' (did you mean {run_dir}? known: "
            + KNOWN
            + "; "
            + ESCAPES
            + ")",
        ),
        (
            "{RUN_DIR}",
            "unknown placeholder {RUN_DIR} in '{RUN_DIR}' (did you mean {run_dir}? known: "
            + KNOWN
            + "; "
            + ESCAPES
            + ")",
        ),
        (
            "${HOME}/x",
            "unknown placeholder {HOME} in '${HOME}/x' (known: " + KNOWN + "; " + ESCAPES + ")",
        ),
        (
            "{ run_dir}",
            "malformed placeholder '{ run_dir}' in '{ run_dir}' (placeholders are {name}, e.g. {run_dir}; "
            + ESCAPES
            + ")",
        ),
        (
            "{}",
            "malformed placeholder '{}' in '{}' (placeholders are {name}, e.g. {run_dir}; " + ESCAPES + ")",
        ),
        (
            "{run_dir",
            "a single '{' in '{run_dir' is neither a placeholder nor a literal brace (placeholders are {name}; "
            + ESCAPES
            + ")",
        ),
        (
            "a}b",
            "a single '}' in 'a}b' is neither a placeholder nor a literal brace (placeholders are {name}; "
            + ESCAPES
            + ")",
        ),
        (
            "--x={xr_args}",
            "{xr_args} stands for several arguments (the --xr-* flags of cross_region): it must be an argument "
            "of its own, not part of '--x={xr_args}'",
        ),
    ],
    ids=[
        "unknown",
        "close-match",
        "upper-case",
        "shell-brace",
        "space",
        "empty",
        "unclosed",
        "lone-close",
        "list-in-word",
    ],
)
def test_parse_arg_refuses_what_could_collide_with_a_real_argument(arg, message):
    with pytest.raises(PlaceholderError) as e:
        parse_arg(arg)
    assert str(e.value) == message


# ---- validation: file:line: trainer.args[i]: message ---------------------------------------------------


def test_an_unknown_placeholder_names_file_line_and_index(work):
    err, path = _error(work, SCRIPT + _args("--out", "{rundir}"))
    line = _line_of(path, '- "{rundir}"')
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.args[1]: unknown placeholder {{rundir}} in '{{rundir}}' "
        "(did you mean {run_dir}? known: " + KNOWN + "; " + ESCAPES + ")"
    )


def test_a_malformed_placeholder_names_file_line_and_index(work):
    err, path = _error(work, SCRIPT + _args("--a", "--b", "--c={run_dir"))
    line = _line_of(path, '- "--c={run_dir"')
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.args[2]: a single '{{' in '--c={{run_dir' is neither a "
        "placeholder nor a literal brace (placeholders are {name}; " + ESCAPES + ")"
    )


def test_the_xr_flags_placeholder_inside_a_word_is_an_error(work):
    err, path = _error(work, SCRIPT + _args("--sync={xr_args}"))
    line = _line_of(path, "--sync={xr_args}")
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.args[0]: {{xr_args}} stands for several arguments "
        "(the --xr-* flags of cross_region): it must be an argument of its own, not part of '--sync={xr_args}'"
    )


def test_data_path_without_paths_data_is_an_error(work):
    err, path = _error(work, SCRIPT + _args("--data", "{data_path}"))
    line = _line_of(path, '- "{data_path}"')
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.args[1]: {{data_path}}: paths.data is not set (set it, "
        "or write the path here)"
    )


def test_max_steps_placeholder_needs_max_steps(work):
    err, path = _error(work, SCRIPT + _args("--steps={max_steps}"))
    line = _line_of(path, "--steps={max_steps}")
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.args[0]: {{max_steps}}: trainer.max_steps is not set "
        "(set it, or write the value here)"
    )


def test_config_placeholder_needs_config(work):
    err, path = _error(work, "trainer:\n  script: train.py\n" + _args("--cfg", "{config}"))
    line = _line_of(path, '- "{config}"')
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.args[1]: {{config}}: trainer.config is not set (set it, "
        "or write the value here)"
    )


def test_max_steps_that_args_leave_out_is_an_error(work):
    err, path = _error(work, SCRIPT + "  max_steps: 50\n" + _args("--cfg", "{config}"))
    line = _line_of(path, "max_steps: 50")
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.max_steps: trainer.args has no {{max_steps}}, so "
        "max_steps would not reach the trainer: add {max_steps} to trainer.args, or remove max_steps"
    )


def test_extra_args_and_args_together_is_an_error(work):
    err, path = _error(work, SCRIPT + "  extra_args: [--x]\n" + _args("--cfg", "{config}"))
    line = _line_of(path, "extra_args:")
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.extra_args: extra_args add to the fixed flags, and "
        "trainer.args replaces them: put these arguments into trainer.args (or write `extra_args: []` to drop "
        "those of an extends: base)"
    )


def test_cross_region_without_xr_args_goes_to_the_environment(work):
    """Not an error: the trainer gets the options as SBATCH_GEN_XR_* variables (test_xr_env.py)."""
    xr = "cross_region:\n  enabled: true\n  region: a\n  regions: [a, b]\n"
    _write(work, SCRIPT + _args("--cfg", "{config}"), xr)
    r = sg("render", "--site", "local", "--out", "o")
    assert r.code == 0, r.err
    text = (work / "o" / "local.sbatch").read_text()
    assert (
        "# cross_region, for the trainer as variables: trainer.args has no {xr_args} (always)\n"
        "export SBATCH_GEN_XR_ENABLED=1\nexport SBATCH_GEN_XR_RUN_ID=run\nexport SBATCH_GEN_XR_REGION=a\n"
    ) in text
    assert "--xr-" not in text


def test_module_and_script_together_is_an_error(work):
    err, path = _error(work, "trainer:\n  module: my.train\n  script: train.py\n  config: c.yaml\n")
    line = _line_of(path, "script: train.py")
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.script: trainer.module is set too (my.train): set "
        "exactly one of module and script (write `module: null` to drop a module that an extends: base sets)"
    )


def test_no_entry_point_is_an_error(work):
    err, path = _error(work, "trainer:\n  module: null\n  config: c.yaml\n")
    line = _line_of(path, "module: null")
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.module: set trainer.module or trainer.script "
        "(what torchrun starts)"
    )


def test_config_stays_required_for_the_fixed_flags(work):
    err, path = _error(work, "trainer:\n  module: sbatch_gen.train\n")
    line = _line_of(path, "trainer:")
    assert err == (
        f"sbatch-gen: sites/local.yaml:{line}: trainer.config: required field is missing (unless trainer.args "
        "is set)"
    )


def test_an_unset_module_next_to_a_script_drops_an_inherited_module(work):
    base = work / "sites" / "_base" / "trainer.yaml"
    base.write_text("trainer:\n  module: my.train\n")
    local = _write(work, "trainer:\n  module: null\n  script: train.py\n  config: c.yaml\n")
    local.write_text("extends: _base/trainer.yaml\n" + local.read_text())
    r = sg("render", "--site", "local", "--out", "o")
    assert r.code == 0, r.err
    text = (work / "o" / "local.sbatch").read_text()
    assert "TRAINER_SCRIPT=train.py  # trainer.script\n" in text and "TRAINER_MODULE" not in text


# ---- what the templates render from -------------------------------------------------------------------


def _profile(*sets: str):
    return load_site(REPO / "sites", "local", list(sets)).profile


def test_placeholders_become_values_and_each_launchers_variables():
    p = _profile(
        "trainer={script: t.py, config: c.toml, max_steps: 9}",
        "paths.data=d",
        "trainer.args=[--cfg, '{config}', '--dump={run_dir}/out', '{max_steps}', --n, '{nnodes}x{nproc_per_node}',"
        " '--tag={site}', '{{literal}}', '--resume={resume}', '{data_path}']",
    )
    words = [w for o in trainer_argv(p, SLURM, "local") for w in o.words]
    assert words == [
        "--cfg",
        Var("TRAIN_CONFIG"),
        Concat(("--dump=", Var("RUN_DIR"), "/out")),
        "9",
        "--n",
        Concat((Var("SLURM_NNODES"), "x", Var("NPROC_PER_NODE"))),
        "--tag=local",
        "{literal}",
        Concat(("--resume=", Var("RESUME"))),
        Var("DATA_PATH"),
    ]
    ssh_words = [w for o in trainer_argv(p, SSH, "local") for w in o.words]
    assert ssh_words[5] == Concat((Var("NNODES"), "x", Var("NPROC_PER_NODE")))
    assert ssh_words[:5] + ssh_words[6:] == words[:5] + words[6:]


def test_one_option_per_line_and_the_xr_flags_in_place():
    p = _profile(
        "cross_region={enabled: true, region: a, regions: [a, b], transport: {kind: fs, root: /m}}",
        "trainer.args=[--first, '1', '2', '{xr_args}', -v, --last]",
    )
    lines = [o.words for o in trainer_argv(p, SLURM, "local")]
    assert lines[0] == ("--first", "1", "2")
    assert lines[1] == ("--xr-enabled",)
    assert ("--xr-regions", "a,b") in lines and ("--xr-root", "/m") in lines
    assert lines[-2:] == [("-v",), ("--last",)]


def test_empty_args_start_the_trainer_without_arguments():
    assert trainer_argv(_profile("trainer.args=[]"), SLURM, "local") == []


def test_without_args_the_fixed_flags_stay():
    p = _profile("trainer.max_steps=3", "trainer.extra_args=[--x]")
    words = [w for o in trainer_argv(p, SLURM, "local") for w in o.words]
    assert words == [
        "--config",
        Var("TRAIN_CONFIG"),
        "--run-dir",
        Var("RUN_DIR"),
        "--resume",
        Var("RESUME"),
        "--max-steps",
        "3",
        "--x",
    ]


def test_a_script_entry_point_in_both_kinds_renders(work):
    sets = ["--set", "trainer={script: bin/train.py, config: c.toml, args: ['--cfg={config}']}"]
    assert sg("render", "--site", "local", "--site", "ssh-local", "--out", "o", *sets).code == 0
    sb = (work / "o" / "local.sbatch").read_text()
    assert "TRAINER_SCRIPT=bin/train.py  # trainer.script\n" in sb
    assert '  torchrun "${TORCHRUN_ARGS[@]}" "$TRAINER_SCRIPT" "${TRAINER_ARGS[@]}" &\n' in sb
    assert "TRAINER_MODULE" not in sb and "[module]" not in sb
    setup = (work / "o" / "local.setup.sbatch").read_text()
    assert 'print("trainer script", script, "readable:", os.access(script, os.R_OK))' in setup
    assert 'python -c "$PROBE" "$EXPECTED_GPUS" "$TRAINER_SCRIPT" "$NEEDED_MODULES"\n' in setup
    sh = (work / "o" / "ssh-local.sh").read_text()
    assert "TRAINER_SCRIPT=bin/train.py  # trainer.script (the preflight checks it is readable)\n" in sh
    assert ' torchrun "${torchrun_args[@]}" "$TRAINER_SCRIPT" "${trainer_args[@]}" || rc=$?\n' in sh
    assert re.search(r"NODE_VARS=\([^)]* TRAINER_SCRIPT TRAIN_CONFIG\s", sh), "the nodes get TRAINER_SCRIPT"
    assert "TRAINER_MODULE" not in sh


def test_schema_documents_the_placeholders(work):
    r = sg("schema")
    assert r.code == 0
    schema = json.loads(r.out)
    fields = schema["$defs"]["Trainer"]["properties"]
    doc = fields["args"]["description"]
    for name in PLACEHOLDERS:
        assert "{" + name + "}" in doc, name
    assert "Write {{ and }} for a literal brace" in doc
    assert "only as an argument of its own" in doc
    assert "torchrun ... SCRIPT" in fields["script"]["description"]
    assert "Required unless trainer.args is set" in fields["config"]["description"]


@pytest.mark.slow  # shellcheck on the renders
def test_custom_command_lines_render_lint_clean(work):
    from .test_shell import lint

    sets = [
        "--set",
        "trainer={script: bin/my train.py, config: c.toml, max_steps: 5, args: [--cfg, '{config}', "
        "'--out={run_dir}/x', '{max_steps}', 'it''s $HOME `x` {{y}}', '{nnodes}x{nproc_per_node}', '', '{xr_args}']}",
        "--set",
        "cross_region={enabled: true, region: a, regions: [a, b]}",
    ]
    r = sg("render", "--site", "local", "--site", "ssh-local", "--out", "o", *sets)
    assert r.code == 0, r.err
    # values no argument names: not defined at all (shellcheck would flag an unused variable)
    bare = ["--set", "trainer={script: t.py, args: [--x]}", "--set", "preflight.enabled=false"]
    assert sg("render", "--site", "local", "--out", "bare", *bare).code == 0
    text = (work / "bare" / "local.sbatch").read_text()
    assert (
        "# trainer.config: not used (trainer.args has no {config}, and preflight.enabled is false)\n" in text
    )
    assert "# trainer.resume: not used (trainer.args has no {resume})\n" in text
    assert "TRAIN_CONFIG" not in text and "RESUME=" not in text
    for p in sorted((work / "o").iterdir()) + sorted((work / "bare").iterdir()):
        if p.name.endswith(SCRIPT_SUFFIXES):
            lint(p)


def test_validate_does_not_read_a_foreign_train_config_as_the_companion_trainers(work):
    """`validate` cross-checks a cross-region site's train config against cross_region; with trainer.args the
    config is the other trainer's (here a TOML file that exists), so it is only noted."""
    (work / "titan.toml").write_text('[job]\ndump_folder = "x"\n')
    eu = work / "sites" / "eu.yaml"
    eu.write_text(
        eu.read_text()
        + "\ntrainer:\n  module: titan.train\n  config: titan.toml\n  args: [--c, '{config}', '{xr_args}']\n"
        + "metrics: null  # the base's sinks are the companion trainer's\n"
    )
    r = sg("validate")
    assert r.code == 0, r.err
    line = _line_of(eu, "  args: ")
    assert f"sites/eu.yaml:{line}: trainer.args is set: the train config is not cross-checked" in r.err
    assert "titan.toml" not in r.err


# ---- the metrics section ------------------------------------------------------------------------------


def test_the_metrics_section_becomes_the_trainers_metrics_flags():
    """The fixed flags carry it after the cross-region flags; the trainer parses them back to the same
    options (the one model, sbatch_gen.metrics_options); the W&B key is only named."""
    from sbatch_gen.metrics_options import MetricsOptions, from_namespace
    from sbatch_gen.train.cli import parse_args

    p = _profile(
        "metrics={sinks: [wandb, prometheus], prometheus_dir: '/var/lib/node exporter', wandb_entity: team}",
        "metrics.wandb_api_key_env=TEAM_WANDB_KEY",
    )
    words = [w for o in trainer_argv(p, SLURM, "local") for w in o.words]
    flags = words[words.index("--metrics-sinks") :]
    assert flags[:2] == ["--metrics-sinks", "wandb,prometheus"]
    assert all(isinstance(w, str) for w in flags)
    got = from_namespace(parse_args(["--config", "c.yaml", *flags]))
    assert (
        got
        == p.metrics
        == MetricsOptions(
            sinks=["wandb", "prometheus"],
            prometheus_dir="/var/lib/node exporter",
            wandb_entity="team",
            wandb_api_key_env="TEAM_WANDB_KEY",
        )
    )
    assert "--metrics-" not in " ".join(
        str(w) for o in trainer_argv(_profile(), SLURM, "local") for w in o.words
    )


def test_metrics_args_places_them_in_a_trainers_own_command_line():
    p = _profile("metrics={sinks: [tensorboard]}", "trainer.args=[--a, '{metrics_args}', --b]")
    lines = [o.words for o in trainer_argv(p, SLURM, "local")]
    assert lines[0] == ("--a",) and lines[-1] == ("--b",)
    assert ("--metrics-sinks", "tensorboard") in lines


def test_metrics_without_metrics_args_in_a_trainers_own_command_line_is_an_error(work):
    err, path = _error(work, SCRIPT + _args("--cfg", "{config}"), "metrics:\n  sinks: [tensorboard]\n")
    assert err == (
        f"sbatch-gen: {path.relative_to(work)}:{_line_of(path, 'metrics:')}: metrics: trainer.args has no {{metrics_args}}: "
        "the trainer would not get these settings (add {metrics_args} as an argument of its own, or remove metrics)"
    )


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "  sinks: [tensorbord]\n",
            "metrics.sinks[0]: Input should be 'tensorboard', 'wandb' or 'prometheus'",
        ),
        ("  wandb_api_key_env: 'a key'\n", "metrics.wandb_api_key_env: String should match pattern"),
        ("  prometheus_every: 0\n", "metrics.prometheus_every: Input should be greater than or equal to 1"),
    ],
)
def test_a_bad_metrics_field_is_named(work, value, message):
    err, path = _error(work, TRAINER, "metrics:\n" + value)
    assert message in err and f"{path.relative_to(work)}:" in err, err
