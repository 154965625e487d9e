"""The debug switch: `SBATCH_GEN_DEBUG=1 sbatch out/<site>.sbatch` (and `SBATCH_GEN_DEBUG=1 bash
out/<site>.sh`) turns on NCCL INFO per rank into files beside the node logs and torch's NCCL flight recorder,
dumped on a collective timeout into <run dir>/debug, and says where in one log line; off by default, and
rendered on GPU sites only (NCCL is a GPU site's). Checked on a whole Slurm job run under bash with stub
Slurm commands (batch_sandbox.py), and on the SSH launcher's node_main block as bash runs it."""

from __future__ import annotations

import mmap
import subprocess
from pathlib import Path

import pytest

from sbatch_gen.loader import load_site
from sbatch_gen.render import render_site

from .batch_sandbox import ENV_DUMP_STUBS, prepare
from .conftest import REPO

DEBUG_NAMES = (
    "NCCL_DEBUG_FILE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
)
GPU = ["slurm.gpus_per_node=2", "torchrun.procs_per_node=null"]  # `local` as a GPU site


def _job(tmp_path: Path, given: dict[str, str]) -> tuple[dict[str, str], str, Path]:
    """(the training step's environment, the job's output, the submit directory)."""
    script = render_site(load_site(REPO / "sites", "local", GPU))[0].text
    job, env, stub_dir = prepare(
        tmp_path,
        ENV_DUMP_STUBS,
        "ok",
        script=script,
        env=given,
    )
    for name in ("SBATCH_GEN_DEBUG", "NCCL_DEBUG", *DEBUG_NAMES):
        if name not in given:
            env.pop(name, None)
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    step = (stub_dir / "step.env").read_bytes().decode().split("\0")
    return dict(x.split("=", 1) for x in step if x), r.stdout + r.stderr, job.parent


def test_the_switch_turns_on_nccl_info_per_rank_and_the_flight_recorder(tmp_path):
    step, out, work = _job(tmp_path, {"SBATCH_GEN_DEBUG": "1"})
    p = load_site(REPO / "sites", "local", GPU).profile
    logs = work / p.paths.log_dir
    traces = work / p.paths.run_dir / "debug"
    name = "sbatch-gen-local-77.attempt-0"
    assert step["NCCL_DEBUG"] == "INFO"
    assert step["NCCL_DEBUG_FILE"] == f"{logs}/{name}.nccl.%h.%p.log"  # NCCL: %h host, %p pid
    assert step["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert step["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert step["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{traces}/{name}.rank-"  # torch appends the rank
    assert traces.is_dir()
    said = [line for line in out.splitlines() if "SBATCH_GEN_DEBUG=1" in line]
    assert len(said) == 1 and f"{logs}/{name}.nccl.<host>.<pid>.log" in said[0], out
    assert f"{traces}/{name}.rank-<rank>" in said[0]


@pytest.mark.parametrize("value", [None, "0", ""])
def test_off_by_default(tmp_path, value):
    step, out, _ = _job(tmp_path, {} if value is None else {"SBATCH_GEN_DEBUG": value})
    assert not any(n in step for n in DEBUG_NAMES)
    assert step["NCCL_DEBUG"] == "WARN"  # the profile's
    assert "SBATCH_GEN_DEBUG" not in out


def test_cpu_sites_render_no_switch():
    for site in ("local", "ssh-local"):
        text = render_site(load_site(REPO / "sites", site, []))[0].text
        assert "SBATCH_GEN_DEBUG" not in text and "TORCH_NCCL_DUMP_ON_TIMEOUT" not in text


def _ssh_debug_code() -> tuple[str, str]:
    """debug_env, the SSH library's (shipped to the nodes), and node_main's line that calls it."""
    text = (REPO / "out" / "lab.sh").read_text()
    body = text[text.index("\nnode_main() {\n") :]
    start = body.index("\n  if [[ $DEBUG == 1 ]]; then ")
    lib = (REPO / "out" / "sbatch-gen-ssh.sh").read_text()
    at = lib.index("\ndebug_env() {\n")
    return lib[at : lib.index("\n}\n", at) + 3], body[start : body.index("\n", start + 1)]


@pytest.mark.parametrize("debug", ["1", "0"])
def test_the_ssh_launchers_node_main_exports_them_only_with_the_switch(tmp_path, debug):
    # as node_main runs on a node: in the launch directory, with the launcher's settings (NODE_VARS)
    debug_env, switch = _ssh_debug_code()
    settings = f"DEBUG={debug} LOGS=logs/lab.sbg-t RUN_DIR=runs/lab TAG=sbg-t ATTEMPT=2 rank=1"
    code = f"{settings}\n{debug_env}\nf() {{{switch}\n}}\nf\nenv -0"
    r = subprocess.run(
        ["env", "-i", "PATH=/usr/bin:/bin", "bash", "-c", "set -eu\n" + code],
        cwd=tmp_path,
        capture_output=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr.decode()
    env = dict(x.split("=", 1) for x in r.stdout.decode().split("\0") if x)
    if debug == "0":
        assert not any(n in env for n in ("NCCL_DEBUG", *DEBUG_NAMES))
        return
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["NCCL_DEBUG_FILE"] == f"{tmp_path}/logs/lab.sbg-t/attempt-2.node-1.nccl.%h.%p.log"
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/runs/lab/debug/sbg-t.attempt-2.rank-"
    assert (tmp_path / "runs/lab/debug").is_dir() and (tmp_path / "logs/lab.sbg-t").is_dir()


def test_the_ssh_launcher_says_where_they_go_once():
    text = (REPO / "out" / "lab.sh").read_text()
    assert text.count('log "SBATCH_GEN_DEBUG=1: ') == 1
    assert "DEBUG=${SBATCH_GEN_DEBUG:-0}\n" in text
    assert " LOGS DEBUG)\n" in text  # shipped to the nodes


def test_torch_reads_the_names_the_switch_sets():
    """torch's own source, as installed (the dev constraints pin 2.13): the flight recorder's TORCH_NCCL_*
    names (2.13 reads them as its TORCH_FR_* ones) and the dump on a timeout."""
    torch_dir = Path(pytest.importorskip("torch").__file__).parent
    c10d = torch_dir / "include" / "torch" / "csrc" / "distributed" / "c10d"
    if not c10d.is_dir():
        pytest.skip("this torch has no C++ headers")
    headers = (c10d / "ProcessGroupNCCL.hpp").read_text() + (c10d / "FlightRecorder.hpp").read_text()
    assert '"TORCH_NCCL_DUMP_ON_TIMEOUT"' in headers
    assert '"TORCH_NCCL_TRACE_BUFFER_SIZE"' in headers
    lib = torch_dir / "lib" / "libtorch_cpu.so"
    if not lib.is_file():
        pytest.skip("no libtorch_cpu.so")
    with lib.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m.find(b"TORCH_NCCL_DEBUG_INFO_TEMP_FILE\0") >= 0
