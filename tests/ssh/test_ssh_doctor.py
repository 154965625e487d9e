"""`sbatch-gen doctor` on the ssh-local site against a real sshd on 127.0.0.1: node 0 checked here, node 1
(localhost) over ssh with the launcher's options; torch in the checkout's venv; the run dir. Then each row
fails on its own: an sshd that is not there, a python_env without torch, a GPU count the hosts lack, a run dir
that cannot be created."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from sshkit import free_port

pytestmark = pytest.mark.slow  # a real sshd, and torch imported on each "host"


def doctor(repo: Path, cwd: Path, sshd, *sets: str):
    cmd = [str(repo / ".venv" / "bin" / "sbatch-gen"), "doctor", "--site", "ssh-local", "--json"]
    cmd += ["--sites-dir", str(repo / "sites")]
    base = [
        f"ssh.port={sshd.port}",
        f"ssh.identity_file={sshd.identity}",
        "ssh.options=" + json.dumps(sshd.options()),
        f"python_env.path={repo / '.venv'}",
        f"paths.run_dir={cwd / 'runs' / 'doctor'}",
    ]
    for s in [*base, *sets]:
        cmd += ["--set", s]
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert p.returncode in (0, 1), f"exit {p.returncode}:\n{p.stdout}\n{p.stderr}"
    doc = json.loads(p.stdout)
    assert doc["kind"] == "ssh" and doc["ok"] == (p.returncode == 0)
    return p.returncode, {c["check"]: c for c in doc["checks"]}


def test_ssh_doctor_clean(sshd, repo, tmp_path, clean_env):
    code, rows = doctor(repo, tmp_path, sshd)
    assert code == 0, rows
    assert rows["ssh 127.0.0.1"]["verdict"] == "skip"  # node 0: the launcher's host
    assert rows["ssh localhost"]["verdict"] == "ok"
    import torch  # the checkout's venv: the version both hosts report

    for host in ("127.0.0.1", "localhost"):
        assert rows[f"torch {host}"]["verdict"] == "ok"
        assert f"torch {torch.__version__}" in rows[f"torch {host}"]["found"]
        assert rows[f"gpus {host}"]["verdict"] == "skip"  # a CPU site
        assert rows[f"run dir {host}"]["verdict"] == "ok"
    assert not (tmp_path / "runs").exists()  # the doctor creates nothing


def test_ssh_doctor_failures(sshd, repo, tmp_path, clean_env):
    # no sshd on that port: the ssh row fails, the host's other rows are not checked
    code, rows = doctor(repo, tmp_path, sshd, f"ssh.port={free_port()}")
    assert code == 1
    r = rows["ssh localhost"]
    assert r["verdict"] == "error" and "Connection refused" in r["found"] and "BatchMode=yes" in r["hint"]
    assert rows["torch localhost"]["verdict"] == "skip" and rows["torch 127.0.0.1"]["verdict"] == "ok"
    # a venv that is not there, GPUs the hosts do not have, a run dir under a file
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, rows = doctor(
        repo,
        tmp_path,
        sshd,
        f"python_env.path={tmp_path / 'no-venv'}",
        "node.gpus=1",
        "torchrun.procs_per_node=null",
        f"paths.run_dir={blocker / 'runs'}",
    )
    assert code == 1
    for host in ("127.0.0.1", "localhost"):
        assert (
            rows[f"torch {host}"]["verdict"] == "error"
            and "no-venv/bin/python" in rows[f"torch {host}"]["found"]
        )
        assert rows[f"gpus {host}"]["verdict"] == "error"
        assert rows[f"run dir {host}"]["verdict"] == "error" and "blocked" in rows[f"run dir {host}"]["found"]
