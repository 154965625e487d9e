"""The preflight with a script entry point (trainer.script): every node must be able to read the script, and
its python must import torch; one line per node as for a module, naming trainer.script. Run for real under
bash: the Slurm render's preflight function (as srun runs it on a node) and the SSH launcher's node program
(preflight_main, as the launcher runs it on node 0)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sbatch_gen.testing.s3server import free_port
from sbatch_gen.testing.ssh_launcher import ssh_launcher_functions

from .conftest import REPO, python_without_torch, sg
from .script_parts import node_library

CONFIG = REPO / "configs" / "tiny.yaml"


def _render(tmp_path: Path, site: str, script: Path, port: int) -> str:
    out = tmp_path / "out"
    r = sg(
        "render",
        "--site",
        site,
        "--sites-dir",
        str(REPO / "sites"),
        "--out",
        str(out),
        "--set",
        f"trainer={{script: {script}, config: {CONFIG}, args: ['--cfg={{config}}']}}",
        "--set",
        f"paths.run_dir={tmp_path / 'run'}",
        "--set",
        f"torchrun.rdzv_port={port}",
    )
    assert r.code == 0, r.err
    return (out / (f"{site}.sbatch" if site == "local" else f"{site}.sh")).read_text()


def _env(path_first: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SBATCH_GEN"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    path = f"{Path(sys.executable).parent}:{env['PATH']}"
    if path_first is not None:
        path = f"{path_first}:{path}"
    env.update(PATH=path, PYTHONPATH=str(REPO), SLURMD_NODENAME="node0")
    return env


def _slurm_preflight(tmp_path: Path, script: Path, path_first: Path | None = None):
    """The rendered Slurm preflight on one node, with the settings the batch script gives it."""
    port = free_port()
    text = _render(tmp_path, "local", script, port)
    functions = node_library(text)
    settings = [
        f"script={script}",
        f"config={CONFIG}",
        "ifname=lo",
        "gpus=0",
        f"run_dir={tmp_path / 'run'}",
        "rdzv_host=127.0.0.1",
        f"rdzv_port={port}",
        "connect_timeout_s=5",
    ]
    cmd = ["bash", "-c", functions + '\npreflight node_id=0 nnodes=1 "$@"', "preflight", *settings]
    return subprocess.run(cmd, env=_env(path_first), cwd=REPO, capture_output=True, text=True, timeout=60)


def _ok_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("preflight ok on ")]
    assert len(lines) == 1, r.stdout
    return lines[0]


def test_a_readable_script_and_torch_pass(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    ok = _ok_line(_slurm_preflight(tmp_path, script))
    assert f", trainer script {script}, torch importable, train config {CONFIG}, interface lo " in ok, ok


def test_a_missing_script_fails_naming_the_field(tmp_path):
    script = tmp_path / "no-such-train.py"
    r = _slurm_preflight(tmp_path, script)
    assert r.returncode == 1
    failed = [x for x in r.stderr.splitlines() if x.startswith("preflight FAILED")]
    assert failed == [
        f"preflight FAILED on node0: trainer script {script} not readable from {REPO} (trainer.script)"
    ]


def test_a_python_without_torch_fails_as_for_a_module(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    bindir = python_without_torch(tmp_path / "no-torch").parent
    r = _slurm_preflight(tmp_path, script, path_first=bindir)
    assert r.returncode == 1
    assert (
        f"preflight FAILED on node0: torch not importable by {bindir / 'python'} from {REPO} (python_env)\n"
        == r.stderr
    ), r.stderr


def test_the_ssh_launchers_node_program_checks_the_script(tmp_path):
    """preflight_main as the launcher runs it on node 0: its settings come from the shipped variables
    (NODE_VARS, which must carry TRAINER_SCRIPT: the node program runs with set -u)."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    _render(tmp_path, "ssh-local", script, free_port())
    run = (
        ssh_launcher_functions(tmp_path / "out" / "ssh-local.sh")
        + 'bash -c "$NODE_PROGRAM" sbatch-gen-node preflight_main 0\n'
    )
    env = _env()
    env["HOSTNAME"] = "node0"
    r = subprocess.run(["bash", "-c", run], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    ok = _ok_line(r)
    assert f", trainer script {script}, torch importable, train config {CONFIG}, " in ok, ok
    script.unlink()
    r = subprocess.run(["bash", "-c", run], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert f"trainer script {script} not readable from {REPO} (trainer.script)" in r.stderr, r.stderr


def _fake_torch(root: Path, version: str, run_py: str) -> Path:
    """A torch package with only what the flag check reads: version.py and distributed/run.py."""
    pkg = root / "torch"
    (pkg / "distributed").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text(f"__version__ = '{version}'\n")
    (pkg / "distributed" / "run.py").write_text(run_py)
    return root


@pytest.mark.parametrize(
    ("run_py", "missing"),
    [
        ('parser.add_argument("--nnodes")\n', ["--signals-to-handle", "--shutdown-timeout"]),
        ('p.add_argument("--shutdown-timeout", "--shutdown_timeout")\n', ["--signals-to-handle"]),
        ('p.add_argument("--signals_to_handle")\np.add_argument("--shutdown-timeout")\n', []),
    ],
)
def test_a_torch_whose_torchrun_lacks_a_flag_the_render_uses_fails_naming_it(tmp_path, run_py, missing):
    """trainer.stop_protocol signal renders --signals-to-handle and --shutdown-timeout: a node whose torch
    predates them fails its preflight, naming the flag, the torch version that has it and the profile field.
    The flags checked are those of torchrun's arguments, after the settings (as preflight_nodes passes the
    script's TORCHRUN_ARGS)."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    port = free_port()
    text = _render(tmp_path, "local", script, port)
    functions = node_library(text)
    settings = [
        f"script={script}",
        "stop_protocol=signal",
        "gpus=0",
        f"run_dir={tmp_path / 'run'}",
        "--",
        "--nnodes",
        "1",
        "--signals-to-handle=SIGTERM,SIGUSR1",
        "--shutdown-timeout=300",
    ]
    env = _env()
    env["PYTHONPATH"] = f"{_fake_torch(tmp_path / 'old', '2.4.1', run_py)}:{REPO}"
    cmd = ["bash", "-c", functions + '\npreflight node_id=0 nnodes=1 "$@"', "preflight", *settings]
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    if not missing:
        _ok_line(r)
        return
    assert r.returncode == 1, r.stdout
    since = {"--signals-to-handle": "2.10", "--shutdown-timeout": "2.12"}
    want = "; ".join(
        f"torchrun of torch 2.4.1 has no {f} (trainer.stop_protocol: signal): use torch >= {since[f]}"
        for f in missing
    )
    assert r.stderr == f"preflight FAILED on node0: {want}\n", r.stderr


# srun's stand-in for the preflight step: the settings each node's preflight gets (after bash -c's $0,
# "preflight"), NUL-separated, and whether the run dir's marker file was there while it ran
RECORD_SRUN = """#!/bin/bash
for ((i = 1; i <= $#; i++)); do [[ ${!i} == preflight ]] && break; done
printf '%s\\0' "${@:i+1}" >"$RECORDED"
for a in "${@:i+1}"; do [[ $a != shared_marker=* || -e ${a#shared_marker=} ]] || echo missing >"$RECORDED.marker"; done
"""


@pytest.mark.parametrize("entry", ["module", "script"])
@pytest.mark.parametrize("pinned", [True, False], ids=["env pinned", "no pin"])
def test_the_job_library_gives_every_node_the_settings_every_site_has(tmp_path, entry, pinned):
    """preflight_nodes (the job library) hands each node's preflight the settings every site has, from the
    script's settings and main's state, then the render's own PREFLIGHT_ARGS, then `--` and torchrun's
    arguments (TORCHRUN_ARGS): the trainer's module or
    script, its config and data, the interface, the GPUs, the run dir with a marker file this shell wrote,
    the rendezvous, and the environment's fingerprint where pin_env set one. A value with spaces or quotes
    stays one setting."""
    from sbatch_gen.render import job_library

    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text(RECORD_SRUN)
    (stubs / "srun").chmod(0o755)
    run_dir = tmp_path / "run dir"
    run_dir.mkdir()
    recorded = tmp_path / "recorded"
    entry_value = "pkg.train" if entry == "module" else "bin/my train's.py"
    state = {
        "TRAINER_MODULE" if entry == "module" else "TRAINER_SCRIPT": entry_value,
        "TRAIN_CONFIG": "configs/a b.yaml",
        "DATA_PATH": "/data/x",
        "PINNED_IFNAME": "ib0",
        "EXPECTED_GPUS": "8",
        "RUN_DIR": str(run_dir),
        "SLURM_JOB_ID": "77",
        "ATTEMPT": "2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
        "SLURM_NNODES": "2",
        "CPUS_PER_TASK": "4",
        **({"ENV_PINNED": "torch 2.13.0, Python 3.11.7 on x86_64, 9 packages (abc)"} if pinned else {}),
    }
    prog = (
        job_library().text
        + "\nlog() { :; }\nSTOP_REQUESTED=''\nrc=0\n"
        + "".join(f"{k}={shlex.quote(v)}\n" for k, v in state.items())
        + "STOP_PROTOCOL=sbatch-gen\n"
        + "PREFLIGHT_ARGS=(log_topology=1 connect_timeout_s=60)\n"
        + "TORCHRUN_ARGS=(--nnodes 2 --numa-binding=node '--rdzv-conf=join_timeout=900')\n"
        + "preflight_nodes && echo ok\n"
    )
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "RECORDED": str(recorded)}
    r = subprocess.run(
        ["bash", "-c", prog], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
    marker = f"{run_dir}/.sbatch-gen-shared.77.2"
    assert recorded.read_text().split("\0")[:-1] == [
        f"{entry}={entry_value}",
        "config=configs/a b.yaml",
        "data=/data/x",
        "ifname=ib0",
        "gpus=8",
        "gpus_key=slurm.gpus_per_node",
        f"run_dir={run_dir}",
        f"shared_marker={marker}",
        "rdzv_host=n1",
        "rdzv_port=29500",
        *([f"env_fingerprint={state['ENV_PINNED']}"] if pinned else []),
        "stop_protocol=sbatch-gen",
        "log_topology=1",
        "connect_timeout_s=60",
        "--",  # then torchrun's own arguments: the preflight checks the flags and NUMA binding they give
        "--nnodes",
        "2",
        "--numa-binding=node",
        "--rdzv-conf=join_timeout=900",
    ]
    assert not (tmp_path / "recorded.marker").exists()  # the marker was there while the preflight ran
    assert not Path(marker).exists()  # and is removed after it
