"""The CLI never imports torch, and an installed wheel renders with the templates it carries."""

import shutil
import subprocess
import sys
import zipfile

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow  # builds and installs the wheel, starts the CLI in subprocesses

_NO_TORCH = r"""
import sys
from sbatch_gen.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
else:
    code = 0
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
if loaded:
    print("TORCH IMPORTED:", loaded[:5], file=sys.stderr)
    sys.exit(99)
sys.exit(code)
"""


@pytest.mark.parametrize(
    "args, code",
    [
        (["render", "--site", "eu", "--site", "us", "--site", "local", "--out", "{tmp}"], 0),
        (["check"], None),  # 0 or 1 depending on other areas' work in progress: either way, no torch
        (["validate", "--site", "eu", "--site", "us", "--site", "local"], 0),
        (["show", "--site", "eu"], 0),
        (["schema"], 0),
        (["sites"], 0),
        (["diff", "--site", "us"], 0),
        (["render", "--site", "local", "--set", "slurm.time=x"], 2),
        # status reads the mailbox through the (torch-free) protocol modules: an empty one, then a missing one
        (["status", "--site", "eu", "--set", "cross_region.transport={kind: fs, root: '{tmp}'}"], 0),
        (
            [
                "status",
                "--site",
                "eu",
                "--json",
                "--set",
                "cross_region.transport={kind: fs, root: '{tmp}/none'}",
            ],
            0,
        ),
        # doctor runs Slurm's client commands (read-only); its exit depends on whether a cluster answers here
        (["doctor", "--site", "local", "--timeout", "5"], None),
    ],
    ids=[
        "render",
        "check",
        "validate",
        "show",
        "schema",
        "sites",
        "diff",
        "error",
        "status",
        "status-json",
        "doctor",
    ],
)
def test_cli_never_imports_torch(tmp_path, args, code):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert "TORCH IMPORTED" not in r.stderr, r.stderr
    assert r.returncode != 99
    if code is not None:
        assert r.returncode == code, r.stderr


def test_wheel_install_renders_with_its_own_templates(tmp_path):
    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = wheels.glob("sbatch_gen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sbatch_gen/templates/slurm.sbatch.j2" in names
    assert "sbatch_gen/templates/_common.j2" in names
    # Install into a plain directory and run from a directory that has sites/ but no templates/.
    target = tmp_path / "site-packages"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    run = tmp_path / "project"
    shutil.copytree(REPO / "sites", run / "sites")
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    probe = (
        "import sbatch_gen, sbatch_gen.render as r; print(sbatch_gen.__file__); "
        "print(r.default_templates_dir())"
    )
    r = subprocess.run([sys.executable, "-c", probe], cwd=run, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pkg_file, tdir = r.stdout.split()
    assert pkg_file.startswith(str(target)) and tdir == str(target / "sbatch_gen" / "templates")
    cmd = [
        sys.executable,
        "-c",
        "from sbatch_gen.cli import main; main()",
        "render",
        "--site",
        "eu",
        "--site",
        "us",
        "--site",
        "local",
    ]
    r = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("eu.sbatch", "us.sbatch", "local.sbatch", "eu.setup.sbatch"):
        assert (run / "out" / name).read_bytes() == (REPO / "out" / name).read_bytes(), name


def test_version_is_the_packages_and_the_clis(tmp_path):
    """Every region of a run must run one sbatch-gen: `--version` says which (pyproject's version)."""
    import tomllib

    want = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    r = subprocess.run(
        [sys.executable, "-m", "sbatch_gen.cli", "--version"], capture_output=True, text=True, cwd=tmp_path
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, f"sbatch-gen {want}\n", "")
