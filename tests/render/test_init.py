"""`sbatch-gen init`: a first profile from flags, commented from the schema, validated before it is written,
never over an existing one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sbatch_gen.init_profile import describe
from sbatch_gen.profiles import PROFILE_KINDS

from .conftest import REPO, sg, sg_proc

SLURM = ["--partition", "gpu", "--nodes", "2", "--gpus-per-node", "8", "--cpus-per-task", "96"]
SLURM += ["--time", "1-00:00:00", "--slurm-version", "24.05"]
SSH = ["--kind", "ssh", "--host", "vm1", "--host", "vm2", "--ifname", "eth0", "--gpus-per-node", "8"]
SSH += ["--cpus-per-task", "64", "--script", "train.py"]


def test_a_slurm_profile_from_flags_validates_and_renders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = sg("init", "--site", "mine", *SLURM)
    assert r.code == 0, r.err
    assert r.out == "wrote sites/mine.yaml: check it with `sbatch-gen validate --site mine`, then render it\n"
    text = (tmp_path / "sites" / "mine.yaml").read_text()
    data = yaml.safe_load(text)
    assert data["slurm"] == {
        "version": "24.05",
        "partition": "gpu",
        "nodes": 2,
        "gpus_per_node": 8,
        "cpus_per_task": 96,
        "time": "1-00:00:00",
    }
    assert data["trainer"] == {"module": "sbatch_gen.train", "config": "configs/demo.yaml"}
    # the comments are the schema's own descriptions
    for line in describe(PROFILE_KINDS["slurm"], "slurm.time").split(". ")[:1]:
        assert line in text
    assert "\n  # account: " in text and "\n# preemption:\n" in text  # defaults worth knowing, commented
    assert (
        "\n  # lead_time_s: 600\n" in text
    )  # a commented value is the schema's default: uncommenting changes nothing
    assert sg("validate", "--site", "mine").code == 0
    r = sg("render", "--site", "mine")
    assert r.code == 0, r.err
    assert (tmp_path / "out" / "mine.sbatch").is_file()


def test_an_ssh_profile_with_a_trainer_of_ones_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sg("init", "--site", "vms", *SSH).code == 0
    data = yaml.safe_load((tmp_path / "sites" / "vms.yaml").read_text())
    assert data["kind"] == "ssh" and data["hosts"] == ["vm1", "vm2"]
    assert data["network"] == {"socket_ifname": "eth0"}
    assert data["trainer"] == {
        "script": "train.py",
        "args": ["--config", "{config}"],
        "config": "configs/demo.yaml",
    }
    r = sg("render", "--site", "vms")
    assert r.code == 0, r.err


def test_what_the_kind_needs_is_named_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = sg("init", "--site", "vms", "--kind", "ssh", "--host", "vm1")
    assert r.code == 2
    assert r.err.splitlines() == [
        "sbatch-gen: init --kind ssh: --ifname is required",
        "sbatch-gen: init --kind ssh: --gpus-per-node is required",
        "sbatch-gen: init --kind ssh: --cpus-per-task is required",
    ]
    assert not (tmp_path / "sites").exists()


def _with(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced (or the flag added)."""
    if flag not in args:
        return [*args, flag, value]
    i = args.index(flag)
    return [*args[: i + 1], value, *args[i + 2 :]]


@pytest.mark.parametrize(
    "base, flag, value, lines",
    [
        (
            SLURM,
            "--time",
            "never",
            [
                "init --time 'never': slurm.time: invalid time 'never' (expected D-HH:MM:SS, HH:MM:SS or minutes)",
            ],
        ),
        (
            SLURM,
            "--partition",
            "gpu x",
            [
                "init --partition 'gpu x': slurm.partition: invalid name 'gpu x' (letters, digits, . _ -; at most 64)"
            ],
        ),
        (
            SLURM,
            "--slurm-version",
            "2405",
            ["init --slurm-version '2405': slurm.version: invalid Slurm version '2405' (e.g. 23.11)"],
        ),
        (
            SLURM,
            "--nodes",
            "200000",
            ["init --nodes 200000: slurm.nodes: Input should be less than or equal to 100000 (got 200000)"],
        ),
        (
            SLURM,
            "--run-dir",
            "~/runs",
            [
                "init --run-dir '~/runs': paths.run_dir: path '~/runs' starts with '~', which is not expanded; "
                "write the path out",
                "init --run-dir '~/runs': paths.log_dir: path '~/runs/logs' starts with '~', which is not "
                "expanded; write the path out",
            ],
        ),
        (
            SSH,
            "--ifname",
            "eth 0",
            ["init --ifname 'eth 0': network.socket_ifname: invalid interface name 'eth 0'"],
        ),
        (
            SSH,
            "--host",
            "vm 1",
            [
                "init --host 'vm 1' --host 'vm2': hosts[0].name: invalid host name 'vm 1' (letters, digits, . _ -)"
            ],
        ),
    ],
)
def test_a_bad_value_names_its_flag_and_value_and_nothing_is_written(
    tmp_path, monkeypatch, base, flag, value, lines
):
    """init validates what it would write before writing it: a bad value is said of the flag that gave it,
    with the value, never of sites/NAME.yaml:LINE (a file that does not exist); nothing is written."""
    monkeypatch.chdir(tmp_path)
    r = sg("init", "--site", "mine", *_with(base, flag, value))
    assert r.code == 2
    assert r.err.splitlines() == [f"sbatch-gen: {line}" for line in lines]
    assert not (tmp_path / "sites").exists()


def _scontrol_stand_in(tmp_path, script: str) -> Path:
    """A folder holding a `scontrol` that runs SCRIPT (sh), to put first on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text("#!/bin/sh\n" + script)
    (bindir / "scontrol").chmod(0o755)
    return bindir


def _init_with_scontrol(tmp_path, monkeypatch, script: str):
    """init without --slurm-version, in TMP_PATH, where `scontrol` is SCRIPT (sh): its result; nothing written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{_scontrol_stand_in(tmp_path, script)}:{os.environ['PATH']}")
    r = sg("init", "--site", "mine", *SLURM[: SLURM.index("--slurm-version")])
    assert r.code == 2 and not (tmp_path / "sites").exists()
    return r


def test_a_bad_slurm_version_from_scontrol_says_so(tmp_path, monkeypatch):
    r = _init_with_scontrol(tmp_path, monkeypatch, 'echo "slurm 24"\n')
    assert r.err == (
        "sbatch-gen: init --slurm-version '24' (from scontrol --version here; give --slurm-version): "
        "slurm.version: invalid Slurm version '24' (e.g. 23.11)\n"
    )


def test_a_scontrol_that_fails_says_why_there_is_no_version(tmp_path, monkeypatch):
    """scontrol --version fails without a configuration (a host outside the cluster, a configless cluster
    without SLURM_CONF): its last line is said, not "gave none" alone."""
    r = _init_with_scontrol(
        tmp_path,
        monkeypatch,
        'echo "scontrol: error: fetch_config: DNS SRV lookup failed" >&2\n'
        'echo "scontrol: fatal: Could not establish a configuration source" >&2\nexit 1\n',
    )
    assert r.err == (
        "sbatch-gen: init --kind slurm: --slurm-version is required (scontrol --version gave none here: "
        "scontrol: fatal: Could not establish a configuration source; run init on the login node, or give it)\n"
    )


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--nodes", "0", "0 is not in the range x>=1"),
        ("--nodes", "two", "'two' is not a valid integer range"),
        ("--gpus-per-node", "-1", "-1 is not in the range x>=0"),
        ("--cpus-per-task", "0", "0 is not in the range x>=1"),
        ("--kind", "k8s", "'k8s' is not one of 'slurm', 'ssh'"),
    ],
)
def test_a_bad_number_is_one_line_naming_the_flag(tmp_path, monkeypatch, flag, value, said):
    """click's checks of a flag (--nodes 0) print as every error does: one line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    r = sg("init", "--site", "mine", *_with(SLURM, flag, value))
    assert (r.code, r.err) == (2, f"sbatch-gen: init {flag}: {said} (see sbatch-gen init --help)\n")
    assert not (tmp_path / "sites").exists()


def test_a_bad_number_is_one_line_from_the_installed_command_too(tmp_path):
    r = sg_proc("init", "--site", "mine", *_with(SLURM, "--nodes", "0"), cwd=tmp_path)
    assert (r.code, r.out) == (2, "")
    assert r.err == "sbatch-gen: init --nodes: 0 is not in the range x>=1 (see sbatch-gen init --help)\n"
    assert list(tmp_path.iterdir()) == []


def test_a_site_name_is_a_name_not_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sg("init", "--site", "../up", *SLURM).code == 2
    assert list(tmp_path.iterdir()) == []


def test_an_existing_profile_is_never_overwritten(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sites").mkdir()
    (tmp_path / "sites" / "mine.yaml").write_text("# mine, by hand\n")
    r = sg("init", "--site", "mine", *SLURM)
    assert r.code == 2 and "exists already; init never overwrites a profile" in r.err
    assert (tmp_path / "sites" / "mine.yaml").read_text() == "# mine, by hand\n"


def _on_a_terminal(
    tmp_path, cmd: str, answers: str, path: str = "/usr/bin:/bin"
) -> subprocess.CompletedProcess:
    """``sbatch-gen CMD`` under a pseudo-terminal (script(1)), ``answers`` typed in, with PATH ``path``."""
    return subprocess.run(
        ["script", "-qec", f"{sys.executable} -m sbatch_gen.cli {cmd}", "/dev/null"],
        input=answers,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": path, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
    )


def test_on_a_terminal_it_asks_for_what_is_missing(tmp_path):
    """Under a pseudo-terminal (script(1)), the missing values are asked for, one prompt each."""
    p = _on_a_terminal(tmp_path, "init --site asked --slurm-version 24.05", "gpu\n2\n0\n4\n00:30:00\n")
    assert p.returncode == 0, p.stdout + p.stderr
    data = yaml.safe_load((tmp_path / "sites" / "asked.yaml").read_text())
    assert data["slurm"]["partition"] == "gpu" and data["slurm"]["time"] == "00:30:00"
    assert data["slurm"]["nodes"] == 2 and data["slurm"]["cpus_per_task"] == 4


def test_on_a_terminal_the_slurm_version_question_says_its_form(tmp_path):
    """Where scontrol gives no version (a stand-in that fails as it does without a configuration), the
    question says what to answer and where it comes from."""
    bindir = _scontrol_stand_in(
        tmp_path, "echo 'scontrol: fatal: Could not establish a configuration source' >&2\nexit 1\n"
    )
    p = _on_a_terminal(
        tmp_path, "init --site asked", "gpu\n24.05\n2\n0\n4\n00:30:00\n", f"{bindir}:/usr/bin:/bin"
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "slurm version (MAJOR.MINOR, e.g. 24.05: the cluster's `scontrol --version`)" in p.stdout, p.stdout
    assert yaml.safe_load((tmp_path / "sites" / "asked.yaml").read_text())["slurm"]["version"] == "24.05"


def test_on_a_terminal_a_bad_number_is_asked_again_and_a_bad_answer_named(tmp_path):
    """A number out of its flag's range (nodes 0) is asked again, as click does for a flag; a value the
    profile refuses is said of the question that got it, and nothing is written."""
    p = _on_a_terminal(tmp_path, "init --site asked --slurm-version 24.05", "gpu\n0\n2\n0\n4\n00:30:00\n")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 is not in the range x>=1" in p.stdout
    assert yaml.safe_load((tmp_path / "sites" / "asked.yaml").read_text())["slurm"]["nodes"] == 2
    p = _on_a_terminal(tmp_path, "init --site other --slurm-version 24.05", "gpu x\n2\n0\n4\n00:30:00\n")
    assert p.returncode == 2, p.stdout
    assert (
        "sbatch-gen: init, the answer 'gpu x' to 'partition': slurm.partition: invalid name 'gpu x'"
        in p.stdout
    )
    assert not (tmp_path / "sites" / "other.yaml").exists()


def test_the_quickstarts_profiles_and_init_commands_work(tmp_path, monkeypatch):
    """docs/quickstart.md: each `# sites/NAME.yaml` block validates and renders; each `sbatch-gen init`
    command writes a profile that does too."""
    import re
    import shlex

    monkeypatch.chdir(tmp_path)
    page = (REPO / "docs" / "quickstart.md").read_text()
    blocks = re.findall(r"```yaml\n# sites/([\w.-]+)\.yaml\n(.*?)```", page, re.S)
    assert [name for name, _ in blocks] == ["mycluster", "vms"]
    (tmp_path / "sites").mkdir()
    for name, body in blocks:
        (tmp_path / "sites" / f"{name}.yaml").write_text(body)
        r = sg("render", "--site", name, "--out", "by-hand")
        assert r.code == 0, (name, r.err)
    commands = [
        c.replace("\\\n", " ") for c in re.findall(r"^sbatch-gen init (.*?)(?<!\\)$", page, re.M | re.S)
    ]
    assert len(commands) == 2
    for c in commands:
        args = shlex.split(c)
        args[args.index("--site") + 1] += "-init"
        if "--kind" not in args:
            args += ["--slurm-version", "24.05"]  # else this host's scontrol --version
        r = sg("init", *args)
        assert r.code == 0, (c, r.err)
    r = sg("render", "--site", "mycluster-init", "--site", "vms-init", "--out", "by-init")
    assert r.code == 0, r.err
