"""The renders of trainer.stop_protocol signal and none pass bash -n and shellcheck (the apt shellcheck and
the venv's, as `make lint` runs on out/), for both kinds; the default protocol's are the goldens in out/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sbatch_gen.render import LIBRARIES

from .conftest import REPO, sg
from .script_parts import SCRIPT_SUFFIXES

pytestmark = pytest.mark.slow  # shellcheck on every render

SHELLCHECKS = [c for c in (shutil.which("shellcheck"), str(Path(sys.executable).parent / "shellcheck")) if c]


@pytest.mark.parametrize("protocol", ["signal", "none"])
def test_stop_protocol_renders_are_lint_clean(tmp_path, monkeypatch, protocol):
    monkeypatch.chdir(REPO)
    sites = ["local", "eu", "ssh-local", "lab"]
    r = sg(
        "render", *[w for s in sites for w in ("--site", s)], "--out", str(tmp_path),
        "--set", f"trainer.stop_protocol={protocol}",
    )  # fmt: skip
    assert r.code == 0, r.err
    scripts = sorted(
        p
        for p in tmp_path.iterdir()
        if p.name.endswith(SCRIPT_SUFFIXES) and not p.name.endswith(".setup.sbatch")
    )
    assert [p.name for p in scripts] == [
        "eu.sbatch",
        "lab.sh",
        "local.sbatch",
        "sbatch-gen-job.sh",
        "sbatch-gen-ssh.sh",
        "ssh-local.sh",
    ]
    assert len(SHELLCHECKS) == 2 and all(Path(c).exists() for c in SHELLCHECKS), SHELLCHECKS
    for path in scripts:
        assert f"trainer.stop_protocol {protocol}" in path.read_text() or path.name in LIBRARIES
        p = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert p.returncode == 0, f"bash -n {path}:\n{p.stderr}"
        for sc in SHELLCHECKS:
            p = subprocess.run([sc, "-x", str(path)], capture_output=True, text=True)
            assert p.returncode == 0, f"{sc} {path}:\n{p.stdout}{p.stderr}"
