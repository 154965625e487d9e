"""The export policy of a job's environment (sbatch_gen/profiles/environment.py: FORCED_ENV_NAMES).

The profile's variables are defaults: a value the submitting shell holds wins (`NCCL_DEBUG=INFO sbatch
out/eu.sbatch`, `NCCL_DEBUG=INFO bash out/lab.sh`); what the job's correctness depends on is set whatever
that shell holds. Checked on the rendered blocks as bash evaluates them, and on a whole Slurm job run under
bash with stub Slurm commands (batch_sandbox.py)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from sbatch_gen.loader import load_site
from sbatch_gen.profiles import RUNTIME_EXPORTS, job_environment
from sbatch_gen.profiles.environment import FORCED_ENV_NAMES, JOB_ENV_NAMES
from sbatch_gen.render import env_default, render_site

from .batch_sandbox import ENV_DUMP_STUBS, prepare
from .conftest import REPO

HOSTILE = "job-$SLURM_JOB_ID \"a\" 'b' \\c } `d` ${e} $(f)"


def _bash_env(code: str, **given: str) -> dict[str, str]:
    """The environment after bash runs ``code`` from one that holds only PATH and ``given``."""
    r = subprocess.run(
        ["env", "-i", "PATH=/usr/bin:/bin", *(f"{k}={v}" for k, v in given.items()), "bash", "-c"]
        + ["set -eu\n" + code + "\nenv -0"],
        capture_output=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr.decode()
    return dict(x.split("=", 1) for x in r.stdout.decode().split("\0") if x)


def _slurm_block(site: str, *sets: str) -> str:
    text = render_site(load_site(REPO / "sites", site, list(sets)))[0].text
    start = text.index("# ---- environment of every job step")
    return text[start : text.index("\n# ---- python_env", start)]


def _ssh_block(site: str, *sets: str) -> str:
    text = render_site(load_site(REPO / "sites", site, list(sets)))[0].text
    start = text.index("\nNODE_ENV=(\n")
    # exported on every node as node_main and preflight_main do
    return text[start : text.index("\n)\n", start) + 3] + 'export "${NODE_ENV[@]}"'


def _profile_env(site: str, *sets: str) -> dict[str, str]:
    p = load_site(REPO / "sites", site, list(sets)).profile
    return {n: v for b in job_environment(p) for n, v in b.vars}


def test_the_default_word_gives_the_value_as_written_and_yields_to_a_set_one():
    word = env_default(HOSTILE, "X")
    assert _bash_env(f'export X="{word}"')["X"] == HOSTILE
    assert _bash_env(f'export X="{word}"', X="mine")["X"] == "mine"
    assert _bash_env(f'export X="{word}"', X="")["X"] == ""  # set, even empty, wins
    with pytest.raises(Exception, match="not a variable name"):
        env_default("v", "X; rm")


def test_the_policy_names_what_is_always_set():
    assert FORCED_ENV_NAMES == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    assert FORCED_ENV_NAMES <= JOB_ENV_NAMES
    assert not set(RUNTIME_EXPORTS) & JOB_ENV_NAMES  # the run-time ones are the scripts', never a default


@pytest.mark.parametrize(("site", "block"), [("eu", _slurm_block), ("lab", _ssh_block)])
def test_without_a_submit_time_value_the_job_gets_the_profiles(site, block):
    want = _profile_env(site)
    assert "NCCL_DEBUG" in want and "OMP_NUM_THREADS" in want
    if block is _slurm_block:  # main sets it from the CPUs Slurm allocated (the test below)
        del want["OMP_NUM_THREADS"]
    got = _bash_env(block(site))
    assert {n: got.get(n) for n in want} == want


@pytest.mark.parametrize(("site", "block"), [("eu", _slurm_block), ("lab", _ssh_block)])
def test_a_submit_time_value_wins_over_the_profiles(site, block):
    given = {
        "NCCL_DEBUG": "INFO",
        "OMP_NUM_THREADS": "3",
        "NCCL_SOCKET_IFNAME": "eth9",
        "NCCL_IB_DISABLE": "",
    }
    got = _bash_env(block(site), **given)
    assert {n: got[n] for n in given} == given


ARGV_AND_ENV_STUBS = {
    **ENV_DUMP_STUBS,
    "srun": r"""#!/bin/bash
for a in "$@"; do [[ $a == preflight ]] && exit 0; done
printf '%s\n' "$@" >"$STUB_DIR/step.argv"
env -0 >"$STUB_DIR/step.env"
""",
}


@pytest.mark.parametrize(
    ("allocated", "given", "cpus", "omp"),
    [
        ({"SLURM_JOB_CPUS_PER_NODE": "6(x1),4"}, None, "4", "2"),  # the fewest of any node, 2 processes
        ({"SLURM_JOB_CPUS_PER_NODE": "8(x2)"}, "3", "8", "3"),  # a submit-time OMP_NUM_THREADS wins
        ({"SLURM_CPUS_ON_NODE": "5"}, None, "5", "2"),
        ({}, None, "2", "1"),  # nothing said: the profile's slurm.cpus_per_task (2)
    ],
)
def test_the_job_steps_take_the_cpus_slurm_allocated(tmp_path, allocated, given, cpus, omp):
    """slurm.cpus_per_task is a request: the training step gets --cpus-per-task from the allocation, its
    processes (local: 2) OMP_NUM_THREADS from that, unless set at submit time."""
    env = {**allocated, **({"OMP_NUM_THREADS": given} if given else {})}
    job, full, stub_dir = prepare(tmp_path, ARGV_AND_ENV_STUBS, "ok", env=env)
    for name in ("SLURM_JOB_CPUS_PER_NODE", "SLURM_CPUS_ON_NODE"):
        if name not in allocated:
            full.pop(name, None)
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=full, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    argv = (stub_dir / "step.argv").read_text().splitlines()
    assert f"--cpus-per-task={cpus}" in argv, argv
    step = dict(x.split("=", 1) for x in (stub_dir / "step.env").read_bytes().decode().split("\0") if x)
    assert step["OMP_NUM_THREADS"] == omp


def test_omp_threads_count_the_physical_cores_of_an_smt_node(tmp_path):
    """A node with two hardware threads per core (Slurm counts both as CPUs): each of the 2 processes gets
    half the cores, not half the CPUs; --cpus-per-task stays what Slurm allocated."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert len(cpus) == 2, "this test needs two CPUs"
    sysfs = tmp_path / "sysfs"
    for cpu in cpus:  # both threads of core 0
        top = sysfs / "sys" / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        top.mkdir(parents=True)
        (top / "thread_siblings_list").write_text(f"{cpus[0]},{cpus[1]}\n")
    env = {"SLURM_JOB_CPUS_PER_NODE": "8(x2)", "SBATCH_GEN_SYSFS_ROOT": str(sysfs)}
    job, full, stub_dir = prepare(tmp_path, ARGV_AND_ENV_STUBS, "ok", env=env)
    r = subprocess.run(
        ["bash", str(job)],
        cwd=job.parent,
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--cpus-per-task=8" in (stub_dir / "step.argv").read_text().splitlines()
    step = dict(x.split("=", 1) for x in (stub_dir / "step.env").read_bytes().decode().split("\0") if x)
    assert step["OMP_NUM_THREADS"] == "2"  # 8 CPUs, 4 cores, 2 processes


def test_eu_renders_its_defaults_as_a_reviewer_reads_them():
    block = _slurm_block("eu")
    assert '\nexport NCCL_DEBUG="${NCCL_DEBUG-WARN}"\n' in block
    assert '\nexport NCCL_IB_HCA="${NCCL_IB_HCA-=mlx5_0,' in block
    # a block of one variable: its profile key on its line
    want = "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # torchrun.max_restarts > 0: a fresh rendezvous store per restart (always)"
    assert f"\n{want}\n" in block


@pytest.mark.parametrize(("site", "block"), [("eu", _slurm_block), ("lab", _ssh_block)])
def test_an_always_variable_is_set_whatever_the_submitting_shell_holds(site, block):
    sets = ["torchrun.max_restarts=2"]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in _profile_env(site, *sets)
    got = _bash_env(block(site, *sets), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0")
    assert got["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_extra_env_is_a_default_too():
    sets = ["extra_env={RUN_TAG: '" + HOSTILE.replace("'", "''") + "'}"]
    assert _profile_env("eu", *sets)["RUN_TAG"] == HOSTILE
    for block in (_slurm_block("eu", *sets), _ssh_block("lab", *sets)):
        assert _bash_env(block)["RUN_TAG"] == HOSTILE
        assert _bash_env(block, RUN_TAG="mine")["RUN_TAG"] == "mine"


def test_the_loader_variables_extra_env_allow_opts_in_to_are_always_set():
    sets = ["extra_env={LD_LIBRARY_PATH: /opt/nccl/lib, RUN_TAG: x}", "extra_env_allow=[LD_LIBRARY_PATH]"]
    for block in (_slurm_block("eu", *sets), _ssh_block("lab", *sets)):
        got = _bash_env(block, LD_LIBRARY_PATH="/from/a/module", RUN_TAG="mine")
        assert got["LD_LIBRARY_PATH"] == "/opt/nccl/lib" and got["RUN_TAG"] == "mine"


def test_a_slurm_job_step_gets_the_submit_time_value_and_the_jobs_own_runtime_variables(tmp_path):
    # as `OMP_NUM_THREADS=3 MASTER_PORT=1 SBATCH_GEN_STOP_FILE=/x sbatch out/local.sbatch` would
    given = {
        "OMP_NUM_THREADS": "3",
        "MASTER_PORT": "1",
        "MASTER_ADDR": "elsewhere",
        "SBATCH_GEN_STOP_FILE": "/x",
    }
    job, env, stub_dir = prepare(tmp_path, ENV_DUMP_STUBS, "ok", env=given)
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    step = dict(x.split("=", 1) for x in (stub_dir / "step.env").read_bytes().decode().split("\0") if x)
    assert step["OMP_NUM_THREADS"] == "3"  # the profile's default (1) yields
    assert step["MASTER_PORT"] == "29500" and step["MASTER_ADDR"] == "n1"  # the job's rendezvous
    assert step["SBATCH_GEN_STOP_FILE"].endswith("/stop/77.attempt-0")  # the job's stop file


def _export_line(text: str) -> list[str]:
    (line,) = [x for x in text.splitlines() if x.startswith("#SBATCH --export=")]
    return line.removeprefix("#SBATCH --export=").split(",")


def test_a_slurm_job_takes_from_the_submitting_shell_only_what_its_export_line_names():
    """#SBATCH --export (sbatch's default is the whole environment): PATH, sbatch-gen's switches, then every
    variable the script sets as a default (so a submit-time value wins), and no secret; the job steps take
    the script's whole environment (SLURM_EXPORT_ENV=ALL: srun reads sbatch's --export from it otherwise)."""
    p = load_site(REPO / "sites", "eu", []).profile
    text = render_site(load_site(REPO / "sites", "eu", []))[0].text
    names = _export_line(text)
    assert names[:4] == ["PATH", "SBATCH_GEN_CONTINUES", "SBATCH_GEN_RUN_JOB", "SBATCH_GEN_DEBUG"]
    block = _slurm_block("eu")
    defaults = re.findall(r'^export (\w+)="\$\{\1-', block, re.M)
    assert "NCCL_DEBUG" in defaults and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in names  # always set
    assert names[4:] == [
        *defaults[: defaults.index("PYTHONUNBUFFERED")],
        "OMP_NUM_THREADS",
        "PYTHONUNBUFFERED",
    ]
    library = (REPO / "out" / "sbatch-gen-job.sh").read_text()  # main's start_attempt and use_allocated_cpus
    assert "${SBATCH_GEN_CONTINUES:-}" in library and "${OMP_NUM_THREADS+given}" in library  # read them
    secrets = [s.name for s in p.secret_env()]
    assert secrets == ["XR_S3_ACCESS_KEY_ID", "XR_S3_SECRET_ACCESS_KEY", "WANDB_API_KEY"]
    assert not set(secrets) & set(names)
    assert "\nexport SLURM_EXPORT_ENV=ALL " in block
    assert "PYTHONPATH" not in names and "CUDA_VISIBLE_DEVICES" not in names


def test_slurm_export_widens_it_and_a_cpu_site_has_no_debug_switch():
    text = render_site(load_site(REPO / "sites", "local", ["slurm.export=[HF_HOME, WANDB_ENTITY]"]))[0].text
    assert _export_line(text) == [
        "PATH",
        "SBATCH_GEN_CONTINUES",
        "SBATCH_GEN_RUN_JOB",
        "OMP_NUM_THREADS",
        "PYTHONUNBUFFERED",
        "HF_HOME",
        "WANDB_ENTITY",
    ]
    assert "# slurm.export: all the job takes from the submitting shell" in text


@pytest.mark.parametrize(
    ("site", "overrides"),
    [("eu", []), ("us", []), ("local", ["slurm.export=[HF_HOME, HTTPS_PROXY]"])],
)
def test_the_setup_job_takes_what_the_training_job_takes(site, overrides):
    """The setup job (out/<site>.setup.sbatch) has the training job's #SBATCH --export line (one policy,
    submit_exports), not sbatch's default of the submitting shell's whole environment; its job step (the
    container probe's srun) takes the batch script's environment, as the training job's steps do."""
    loaded = load_site(REPO / "sites", site, overrides)
    train, setup = (r.text for r in render_site(loaded)[:2])
    assert "setup" in render_site(loaded)[1].filename
    assert _export_line(setup) == _export_line(train)
    assert "PYTHONPATH" not in _export_line(setup) and "XR_S3_SECRET_ACCESS_KEY" not in _export_line(setup)
    assert "\nexport SLURM_EXPORT_ENV=ALL " in setup
    main = setup.index("\nmain() {")
    assert setup.index("\nexport SLURM_EXPORT_ENV=ALL ") < main  # a setting, before any srun
