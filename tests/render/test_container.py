"""Containers as pyxis users run them: a named container per job, writable or read-only, a work directory,
the enroot `#` form of an image checked, and every absolute path the job uses inside the mounts."""

from __future__ import annotations

import pytest

from .conftest import edit_site, sg

BASE = {
    "python_env": {"kind": "none"},
    "paths.run_dir": "/lustre/eu/runs/x",
    "paths.log_dir": "/lustre/eu/runs/x/logs",
}


def _render(work, **container):
    eu = work / "sites" / "eu.yaml"
    edit_site(
        eu,
        **BASE,
        container={"image": "nvcr.io#nvidia/pytorch:24.05-py3", "mounts": ["/lustre/eu"], **container},
    )
    return sg("render", "--site", "eu", "--out", "o")


def _args(work) -> list[str]:
    text = (work / "o" / "eu.sbatch").read_text()
    block = text.split("CONTAINER_ARGS=(\n", 1)[1].split("\n)\n", 1)[0]
    return [line.strip().split("  #")[0] for line in block.splitlines()]


def test_by_default_one_named_container_per_job_in_the_submit_directory(work):
    r = _render(work)
    assert r.code == 0, r.err
    args = _args(work)
    assert args[:5] == [
        "--container-image='nvcr.io#nvidia/pytorch:24.05-py3'",
        "--container-name=sbatch-gen",
        "--container-mounts=/lustre/eu",
        "--no-container-mount-home",
        '--container-workdir="$PWD"',
    ], args
    assert not [a for a in args if "writable" in a or "readonly" in a]  # the cluster's enroot default


def test_name_writable_and_workdir_as_the_profile_says(work):
    r = _render(work, name=None, writable=False, workdir="/lustre/eu/code")
    assert r.code == 0, r.err
    args = _args(work)
    assert "--container-readonly" in args and "--container-workdir=/lustre/eu/code" in args
    assert not [a for a in args if a.startswith("--container-name")]
    assert _render(work, writable=True).code == 0 and "--container-writable" in _args(work)


def test_a_registry_image_with_a_slash_is_refused_with_the_enroot_form(work):
    r = _render(work, image="nvcr.io/nvidia/pytorch:24.05-py3")
    assert r.code == 2
    assert (
        "container.image: 'nvcr.io/nvidia/pytorch:24.05-py3' names the registry 'nvcr.io' with "
        "'/': pyxis (enroot) wants nvcr.io#nvidia/pytorch:24.05-py3"
    ) in r.err, r.err
    for ok in ("nvidia/cuda:12.4.1-base-ubuntu22.04", "/lustre/eu/images/x.sqsh", "ubuntu:24.04"):
        assert _render(work, image=ok).code == 0, ok


def test_a_path_outside_the_mounts_is_refused_at_its_field(work):
    r = _render(work, mounts=["/scratch:/scratch"])
    assert r.code == 2
    assert (
        "paths.run_dir: /lustre/eu/runs/x is not inside the container: no container.mounts entry mounts it"
        in r.err
    )
    assert "(mounted: /scratch); add one, e.g. /lustre/eu/runs/x:/lustre/eu/runs/x" in r.err
    r = _render(work, workdir="/opt/code")
    assert r.code == 2 and "container.workdir: /opt/code is not inside the container" in r.err, r.err
    # a mount's destination counts, not its source
    assert _render(work, mounts=["/gpfs/eu:/lustre/eu"]).code == 0


def _probe(work, site: str) -> tuple[str, str]:
    text = (work / "o" / f"{site}.setup.sbatch").read_text()
    probe = text.split("read -r -d '' PROBE <<'PY' || true\n", 1)[1].split("\nPY\n", 1)[0]
    needed = next(line for line in text.splitlines() if line.startswith("NEEDED_MODULES="))
    return probe, needed.split("=", 1)[1].split("  #")[0].strip("'")


@pytest.mark.slow  # the probe in two real python processes, each importing torch
def test_the_setup_jobs_probe_names_what_the_image_lacks_for_cross_region(work):
    """A container (or any environment) without the library: the setup job says so, and how to add it."""
    import subprocess
    import sys

    r = _render(work)
    assert r.code == 0, r.err
    probe, needed = _probe(work, "eu")
    assert needed == "sbatch_gen.train,sbatch_gen,xxhash,boto3"  # eu: the companion trainer, over S3
    ok = subprocess.run(
        [sys.executable, "-c", probe, "0", "sbatch_gen.train", needed], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "imports: sbatch_gen.train,sbatch_gen,xxhash,boto3" in ok.stdout, ok.stderr
    bad = subprocess.run(
        [sys.executable, "-c", probe, "0", "sbatch_gen.train", needed + ",no_such_module_xr"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().startswith("this environment lacks no_such_module_xr: install them into it")
