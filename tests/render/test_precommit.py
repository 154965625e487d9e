""".pre-commit-config.yaml in a fresh clone: `pre-commit run --all-files` passes on the committed tree, and its
hooks catch what they are for (a render not regenerated, a bad profile field, unformatted Python). The hooks
are local: pre-commit fetches nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow  # a clone of the tree and pre-commit runs (about 15 s)

VENV_BIN = REPO / ".venv" / "bin"


def _git(*args: str, cwd: Path) -> str:
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return r.stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone of this tree as it is now (committed or not: what the tests test), without .venv."""
    tmp = tmp_path_factory.mktemp("precommit")
    src = tmp / "src"
    files = _git("ls-files", "--cached", "--others", "--exclude-standard", "-z", cwd=REPO).split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, src / f)
    _git("init", "-q", cwd=src)
    _git("add", "-A", cwd=src)
    _git("-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "tree", cwd=src)
    _git("clone", "-q", str(src), str(tmp / "clone"), cwd=tmp)
    return tmp / "clone"


def _run(clone: Path, *files: str) -> subprocess.CompletedProcess:
    """pre-commit on ``files`` (default: all), staged first: pre-commit checks what is to be committed
    (it stashes unstaged changes while the hooks run)."""
    _git("add", "-A", cwd=clone)
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # no .venv in the clone: tools on PATH
        "PRE_COMMIT_HOME": str(clone.parent / "pre-commit-home"),
    }
    args = ["--files", *files] if files else ["--all-files"]
    return subprocess.run(
        [str(VENV_BIN / "pre-commit"), "run", *args],
        cwd=clone,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_the_hooks_pass_on_a_fresh_clone_and_catch_what_they_are_for(clone):
    r = _run(clone)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("sbatch-gen validate", "sbatch-gen check", "ruff check", "ruff format --check"):
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(name))
        assert line.endswith("Passed"), r.stdout

    # a profile changed without rendering again: check fails with the diff, validate still passes
    local = clone / "sites" / "local.yaml"
    text = local.read_text()
    assert "  cpus_per_task: 2\n" in text
    local.write_text(text.replace("  cpus_per_task: 2\n", "  cpus_per_task: 1\n", 1))
    r = _run(clone, "sites/local.yaml")
    assert r.returncode == 1, r.stdout
    assert "sbatch-gen check" in r.stdout and "differ from a fresh render" in r.stdout, r.stdout
    # a bad field: validate names it with its file and line
    local.write_text(text.replace("\nslurm:\n", "\nnot_a_field: 1\nslurm:\n", 1))
    r = _run(clone, "sites/local.yaml")
    assert r.returncode == 1 and "sites/local.yaml:" in r.stdout and "not_a_field" in r.stdout, r.stdout
    local.write_text(text)
    _git("add", "-A", cwd=clone)

    # unformatted Python: ruff format --check fails on that file
    bad = clone / "bench" / "_unformatted.py"
    bad.write_text("x = ( 1,2 )\n")
    r = _run(clone, "bench/_unformatted.py")
    assert r.returncode == 1 and "would be reformatted" in r.stdout + r.stderr, r.stdout
    bad.unlink()
    _git("add", "-A", cwd=clone)
