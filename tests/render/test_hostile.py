"""Hostile values (spaces, quotes, $, backticks, newlines, globs, ...) are either rejected with a clear
error naming file, line and field, or reach the job exactly as written: render, run the rendered
settings/environment block under bash, and compare."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sbatch_gen.xr_options import credential_shape, unsafe_chars

from .conftest import REPO, sg
from .script_parts import flat

pytestmark = pytest.mark.slow  # runs rendered scripts in a sandbox

_PIECES = list(" '\"$`\\\n\t*?[]{}~!#;&|<>()%,=:@+-_./aZ0é") + ["$(id)", "${X}", "'\"'", "runs", "--x"]
HOSTILE = st.lists(st.sampled_from(_PIECES), min_size=1, max_size=12).map("".join)

# Field -> how the rendered script exposes it (a bash expression evaluated after the settings block).
SHELL_FIELDS = {
    ("paths", "run_dir"): '"$RUN_DIR"',
    ("paths", "data"): '"$DATA_PATH"',
    ("paths", "code_dir"): '"$CODE_DIR"',
    ("paths", "log_dir"): '"$LOG_DIR"',
    ("trainer", "config"): '"$TRAIN_CONFIG"',
    ("trainer", "resume"): '"$RESUME"',
    ("extra_env", "MY_SETTING"): '"$MY_SETTING"',
}
# Fields that go into #SBATCH lines: the value must appear there verbatim (or be rejected).
SBATCH_FIELDS = {
    ("slurm", "partition"): "#SBATCH --partition=",
    ("slurm", "account"): "#SBATCH --account=",
    ("slurm", "constraint"): "#SBATCH --constraint=",
}
BASE = yaml.safe_load((REPO / "sites" / "local.yaml").read_text())


def _settings_block(script: str) -> str:
    """The profile's settings: the settings block, then python_env's (up to main())."""
    start = script.index("# ---- settings from the profile")
    end = script.index("\nmain() {")
    return script[start:end]


def _trainer_args(script: str) -> str:
    """The trainer's argument list (TRAINER_ARGS=(...), built by sbatch_gen/launch.py)."""
    script = flat(script)
    start = script.index("\nTRAINER_ARGS=(\n")
    return script[start : script.index("\n)\n", start) + 3]


def _bash_values(script: str, exprs: list[str]) -> list[str]:
    code = _settings_block(script) + _trainer_args(script) + "\nprintf '%s\\0' " + " ".join(exprs) + "\n"
    r = subprocess.run(["bash", "-c", code], capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode().split("\0")[:-1]


def _render(data: dict) -> tuple[int, str, str]:
    d = Path(tempfile.mkdtemp(prefix="sg-hostile-"))
    try:
        (d / "sites").mkdir()
        path = d / "sites" / "local.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
        r = sg("render", "--site", "local", "--sites-dir", str(d / "sites"), "--out", str(d / "out"))
        script = (d / "out" / "local.sbatch").read_text() if r.code == 0 else ""
        return r.code, r.err, script
    finally:
        shutil.rmtree(d)


def _line_of_key(data: dict, path: tuple[str, ...]) -> int:
    """The line `yaml.safe_dump` wrote the key on (what the error must point at)."""
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    node = yaml.compose(text)
    for i, key in enumerate(path):
        for k, v in node.value:
            if k.value == key:
                if i == len(path) - 1:
                    return k.start_mark.line + 1
                node = v
                break
    raise AssertionError(path)


def _check(field: tuple[str, ...], value, script_expr=None, sbatch_prefix=None):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    cur = data
    for k in field[:-1]:
        cur = cur.setdefault(k, {})
    cur[field[-1]] = value
    code, err, script = _render(data)
    dotted = ".".join(field)
    if code != 0:
        assert code == 2, err
        assert "Traceback" not in err
        assert len(err.splitlines()) == 1, err  # one problem, one line
        line = _line_of_key(data, field)
        assert re.search(rf"local\.yaml:{line}: {re.escape(dotted)}(\[\d+\])?: \S", err), err
        return "rejected"
    if script_expr is not None:
        assert _bash_values(script, [script_expr]) == [value]
    if sbatch_prefix is not None:
        lines = [line for line in script.splitlines() if line.startswith(sbatch_prefix)]
        assert lines == [sbatch_prefix + value]
    return "accepted"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(SHELL_FIELDS)), value=HOSTILE)
def test_shell_values_reach_the_job_exactly_or_are_rejected(field, value):
    _check(field, value, script_expr=SHELL_FIELDS[field])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(SBATCH_FIELDS)), value=HOSTILE)
def test_sbatch_values_appear_verbatim_or_are_rejected(field, value):
    outcome = _check(field, value, sbatch_prefix=SBATCH_FIELDS[field])
    if outcome == "accepted":
        assert re.fullmatch(r"[A-Za-z0-9_./+:=@,%&|\[\]()*!-]+", value)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=st.lists(HOSTILE, min_size=1, max_size=4))
def test_trainer_extra_args_reach_the_job_exactly(args):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data["trainer"]["extra_args"] = args
    code, err, script = _render(data)
    if code != 0:
        assert code == 2 and "control characters" in err, err
        _one_line_per_refused_item(err, "trainer.extra_args", args)
        return
    # trainer.extra_args come last in the trainer's arguments
    assert _bash_values(script, [f'"${{TRAINER_ARGS[@]: -{len(args)}}}"']) == args


def test_known_hostile_examples():
    # A few fixed cases, so the behaviour is pinned even if hypothesis draws differently.
    assert _check(("paths", "run_dir"), 'runs/it\'s a "test" `date` *', '"$RUN_DIR"') == "accepted"
    assert _check(("paths", "run_dir"), "runs/$HOME", '"$RUN_DIR"') == "rejected"
    assert _check(("paths", "run_dir"), "runs/a\nb", '"$RUN_DIR"') == "rejected"
    assert _check(("paths", "run_dir"), "~/runs", '"$RUN_DIR"') == "rejected"
    assert (
        _check(("extra_env", "MY_SETTING"), "$(touch /tmp/pwned) `id` ; rm -rf *", '"$MY_SETTING"')
        == "accepted"
    )
    assert (
        _check(("slurm", "partition"), "debug --exclusive", sbatch_prefix="#SBATCH --partition=")
        == "rejected"
    )
    assert _check(("paths", "log_dir"), "logs dir", '"$LOG_DIR"') == "rejected"
    # Slurm's constraint syntax reaches the #SBATCH line as written (found by hypothesis: '&' once crashed)
    assert (
        _check(("slurm", "constraint"), "[ib&h200|gh200]*2", sbatch_prefix="#SBATCH --constraint=")
        == "accepted"
    )


# ---- trainer.args: literal text and placeholders ------------------------------------------------------

# Hostile values behind the placeholders too (accepted paths: no '$', '~' or leading '-').
ARGS_RUN_DIR = 'runs/it\'s a "test" `date` * \\ {x}'
ARGS_CONFIG = "configs/t'i \"n` y.toml"
# What each placeholder becomes when the script runs (SLURM_NNODES: the allocation's node count).
ARGS_VALUES = {
    "config": ARGS_CONFIG,
    "run_dir": ARGS_RUN_DIR,
    "resume": "auto",
    "max_steps": "7",
    "nnodes": "2",
    "nproc_per_node": "2",
    "site": "local",
}
# One argument: literal pieces (braces escaped as {{ }}) and placeholders, in any order.
ARG = st.lists(
    st.one_of(
        HOSTILE.map(lambda s: ("text", s)), st.sampled_from(sorted(ARGS_VALUES)).map(lambda n: ("ph", n))
    ),
    min_size=0,
    max_size=4,
)


def _args_data(args: list[str]) -> dict:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data["paths"]["run_dir"] = ARGS_RUN_DIR
    data["trainer"] = {"script": "bin/train.py", "config": ARGS_CONFIG, "max_steps": 7, "args": args}
    if not any("{max_steps}" in a for a in args):
        del data["trainer"]["max_steps"]
    return data


def _trainer_argv(script: str) -> list[str]:
    """The trainer's arguments as the batch shell expands them (with the allocation's node count)."""
    code = _settings_block(script) + _trainer_args(script) + "\nprintf '%s\\0' \"${TRAINER_ARGS[@]}\"\n"
    env = {"PATH": "/usr/bin:/bin", "SLURM_NNODES": "2"}
    r = subprocess.run(["bash", "-c", code], capture_output=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode().split("\0")[:-1]


def _one_line_per_refused_item(err: str, field: str, items: list[str]) -> None:
    """Every refused item of a list field is reported, one line each, in order (every bad field of a
    profile is reported in one run), and no other line."""
    bad = [i for i, a in enumerate(items) if unsafe_chars(a) or credential_shape(a)]
    lines = err.splitlines()
    assert bad and len(lines) == len(bad), err
    assert all(f"{field}[{i}]:" in line for i, line in zip(bad, lines, strict=True)), err


def _check_args(pieces_per_arg: list[list[tuple[str, str]]]) -> str:
    args = [
        "".join(v.replace("{", "{{").replace("}", "}}") if k == "text" else "{" + v + "}" for k, v in pieces)
        for pieces in pieces_per_arg
    ]
    expected = ["".join(v if k == "text" else ARGS_VALUES[v] for k, v in pieces) for pieces in pieces_per_arg]
    code, err, script = _render(_args_data(args))
    if code != 0:
        assert code == 2 and "control characters" in err, err
        _one_line_per_refused_item(err, "trainer.args", args)
        return "rejected"
    assert _trainer_argv(script) == expected
    return "accepted"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces_per_arg=st.lists(ARG, min_size=1, max_size=4))
def test_trainer_args_reach_the_job_exactly_with_placeholders_filled_in(pieces_per_arg):
    _check_args(pieces_per_arg)


def test_known_hostile_trainer_args():
    T, P = "text", "ph"
    cases = [
        [[(T, "$(touch /tmp/pwned) `id` ; rm -rf *")]],
        [[(T, "--dump="), (P, "run_dir"), (T, "/x $HOME 'q' \"dq\" \\")]],
        [[(T, "{run_dir}")], [(T, "${HOME}")], [(T, "{{")], [(T, "")]],  # literal braces, escaped
        [[(P, "nnodes"), (T, "$NPROC_PER_NODE"), (P, "nproc_per_node")], [(T, "-"), (P, "site")]],
        [[(P, "config"), (P, "config")], [(T, "--steps="), (P, "max_steps")], [(P, "resume")]],
    ]
    for case in cases:
        assert _check_args(case) == "accepted", case
    assert _check_args([[(T, "a\nb")]]) == "rejected"
    # the refused argument held {max_steps}: no second line saying max_steps would not reach the trainer
    assert _check_args([[(P, "max_steps"), (T, "\n")]]) == "rejected"


def test_a_hostile_script_path_reaches_the_job_exactly_or_is_rejected():
    for path, outcome in [
        ('bin/it\'s my "train" `x`.py', "accepted"),
        ("bin/$HOME/train.py", "rejected"),
        ("-m", "rejected"),
    ]:
        data = yaml.safe_load(yaml.safe_dump(BASE))
        del data["trainer"]["module"]
        data["trainer"]["script"] = path
        code, err, script = _render(data)
        if outcome == "rejected":
            assert code == 2 and "trainer.script: " in err and len(err.splitlines()) == 1, err
            continue
        assert code == 0, err
        assert _bash_values(script, ['"$TRAINER_SCRIPT"']) == [path]
        assert '  torchrun "${TORCHRUN_ARGS[@]}" "$TRAINER_SCRIPT" "${TRAINER_ARGS[@]}" &\n' in script


def _preflight_args(script: str) -> str:
    """The preflight's settings (PREFLIGHT_ARGS=(...) in main), flattened."""
    script = flat(script)
    start = script.index("\nPREFLIGHT_ARGS=(\n")
    return script[start : script.index("\n)\n", start) + 3]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=HOSTILE)
@example(value="test ! -e \"$HOME/x\" || echo 'a`b` $(id) ${X}'; exit 3")
def test_a_hostile_health_check_reaches_the_preflight_exactly_or_is_rejected(value):
    """preflight.health_check is a command the nodes run: the render must hand it on as written, one
    argument, never interpreted on the way."""
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data.setdefault("preflight", {})["health_check"] = value
    code, err, script = _render(data)
    if code != 0:
        assert code == 2 and len(err.splitlines()) == 1, err
        line = _line_of_key(data, ("preflight", "health_check"))
        assert re.search(rf"local\.yaml:{line}: preflight\.health_check: \S", err), err
        return
    prog = (
        _settings_block(script)
        + "\nTRAIN_CONFIG='' PREFLIGHT_MARKER=m MASTER_ADDR=h\n"
        + _preflight_args(script)
        + '\nfor a in "${PREFLIGHT_ARGS[@]}"; do [[ $a != health_check=* ]] || printf "%s\\0" "${a#health_check=}"; done\n'
    )
    r = subprocess.run(["bash", "-c", prog], capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().split("\0")[:-1] == [value]
