"""Helpers for the render tests: run the CLI in-process (fast) or as a real process."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from sbatch_gen.cli import cli

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    code: int
    out: str
    err: str


def sg(*args: str) -> Result:
    """Run `sbatch-gen ARGS` in this process (the current directory is the caller's)."""
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return Result(r.exit_code, r.stdout, r.stderr)


def sg_proc(*args: str, cwd: Path, env: dict | None = None) -> Result:
    """Run `sbatch-gen ARGS` as a separate process."""
    p = subprocess.run(
        [sys.executable, "-m", "sbatch_gen.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return Result(p.returncode, p.stdout, p.stderr)


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """A directory with a copy of the repo's sites/, as the current directory."""
    shutil.copytree(REPO / "sites", tmp_path / "sites")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def edit_site(path: Path, **changes) -> None:
    """Set dotted keys in a profile file (rewrites it as plain YAML)."""
    data = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        cur = data
        *parents, last = dotted.split(".")
        for k in parents:
            cur = cur.setdefault(k, {})
        cur[last] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def python_without_torch(bindir: Path) -> Path:
    """``bindir/python``: the test's own interpreter without the site module (-S: no site-packages, the
    venv's or the system's), so torch is never importable through it. Put ``bindir`` first on PATH."""
    bindir.mkdir(exist_ok=True)
    py = bindir / "python"
    py.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n')
    py.chmod(0o755)
    return py
