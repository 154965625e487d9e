"""`sbatch-gen init`: a first profile from flags, commented from the schema, validated before it is written,
never over an existing one."""

from __future__ import annotations

import subprocess
import sys

import yaml

from sbatch_gen.init_profile import describe
from sbatch_gen.profiles import PROFILE_KINDS

from .conftest import REPO, sg

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


def test_a_bad_value_is_refused_at_its_line_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [a if a != "1-00:00:00" else "never" for a in SLURM]
    r = sg("init", "--site", "mine", *args)
    assert r.code == 2
    assert r.err.startswith("sbatch-gen: sites/mine.yaml:") and "slurm.time: invalid time 'never'" in r.err, (
        r.err
    )
    assert not (tmp_path / "sites" / "mine.yaml").exists()
    assert sg("init", "--site", "../up", *SLURM).code == 2  # a name, not a path


def test_an_existing_profile_is_never_overwritten(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sites").mkdir()
    (tmp_path / "sites" / "mine.yaml").write_text("# mine, by hand\n")
    r = sg("init", "--site", "mine", *SLURM)
    assert r.code == 2 and "exists already; init never overwrites a profile" in r.err
    assert (tmp_path / "sites" / "mine.yaml").read_text() == "# mine, by hand\n"


def test_on_a_terminal_it_asks_for_what_is_missing(tmp_path):
    """Under a pseudo-terminal (script(1)), the missing values are asked for, one prompt each."""
    answers = "gpu\n2\n0\n4\n00:30:00\n"
    cmd = f"{sys.executable} -m sbatch_gen.cli init --site asked --slurm-version 24.05"
    p = subprocess.run(
        ["script", "-qec", cmd, "/dev/null"],
        input=answers,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
    )
    assert p.returncode == 0, p.stdout + p.stderr
    data = yaml.safe_load((tmp_path / "sites" / "asked.yaml").read_text())
    assert data["slurm"]["partition"] == "gpu" and data["slurm"]["time"] == "00:30:00"
    assert data["slurm"]["nodes"] == 2 and data["slurm"]["cpus_per_task"] == 4


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
