"""examples/out is committed like out/: a fresh render of examples/sites must equal it, without make:
    sbatch-gen render --sites-dir examples/sites --out examples/out --all
and the example renders pass bash -n and shellcheck like every other render."""

from __future__ import annotations

import subprocess

import pytest

from sbatch_gen.loader import load_site
from sbatch_gen.train.api import cross_region_from_args

from .conftest import REPO, sg_proc
from .script_parts import SCRIPT_SUFFIXES, flat
from .test_shell import lint

EXAMPLES_OUT = sorted(
    p for p in (REPO / "examples" / "out").iterdir() if p.is_file() and p.name.endswith(SCRIPT_SUFFIXES)
)
EXAMPLE_ARGS = ("--sites-dir", "examples/sites", "--out", "examples/out")


def test_committed_example_renders_are_current():
    r = sg_proc("check", *EXAMPLE_ARGS, cwd=REPO)
    assert r.code == 0, r.out + r.err
    assert "up to date" in r.out


def test_the_example_sites_validate():
    r = sg_proc("validate", "--sites-dir", "examples/sites", cwd=REPO)
    assert r.code == 0, r.out + r.err


def test_the_torchtitan_style_profile_starts_its_script_with_its_own_flags():
    text = flat((REPO / "examples" / "out" / "titan.sbatch").read_text())
    assert "TRAINER_SCRIPT=torchtitan/train.py  # trainer.script\n" in text
    assert '  torchrun "${TORCHRUN_ARGS[@]}" "$TRAINER_SCRIPT" "${TRAINER_ARGS[@]}" &\n' in text
    start = text.index("\nTRAINER_ARGS=(\n")
    assert text[start : text.index("\n)\n", start) + 3] == (
        "\nTRAINER_ARGS=(\n"
        '  --job.config_file "$TRAIN_CONFIG" --job.dump_folder "$RUN_DIR" "--training.dataset_path=$DATA_PATH"\n'
        "  --training.steps 20000 --checkpoint.enable_checkpoint --checkpoint.interval 500\n"
        '  "--job.description=titan: llama3 8B on $SLURM_NNODES nodes x $NPROC_PER_NODE GPUs"\n'
        ")\n"
    )
    assert "--xr-" not in text and "--run-dir" not in text


def _trainer_argv(script: str) -> list[str]:
    """TRAINER_ARGS of a rendered batch script as bash expands it (its settings block first)."""
    settings = script[
        script.index("# ---- settings from the profile") : script.index("# ---- environment of")
    ]
    script = flat(script)
    start = script.index("\nTRAINER_ARGS=(\n")
    array = script[start : script.index("\n)\n", start) + 3]
    code = "set -eu\n" + settings + array + "printf '%s\\0' \"${TRAINER_ARGS[@]}\"\n"
    r = subprocess.run(["bash", "-c", code], capture_output=True, timeout=30, check=True)
    return r.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize(("site", "region"), [("plain", "eu"), ("plain-us", "us")])
def test_the_plain_example_script_reads_back_its_profile_from_the_rendered_arguments(site, region):
    """examples/train_plain.py splits its argv with the public library's cross_region_from_args: the --xr-*
    flags of the rendered job give back the profile's cross_region exactly, the rest are the script's own."""
    text = (REPO / "examples" / "out" / f"{site}.sbatch").read_text()
    assert "TRAINER_SCRIPT=examples/train_plain.py  # trainer.script\n" in text
    assert '  torchrun "${TORCHRUN_ARGS[@]}" "$TRAINER_SCRIPT" "${TRAINER_ARGS[@]}" &\n' in text
    # stop_protocol sbatch-gen; start_attempt exports the stop file (the job library's)
    assert "\n  start_attempt  # this attempt: its stop file (it hands a stop request to the trainer" in text
    xr, rest = cross_region_from_args(_trainer_argv(text), environ={})
    assert xr == load_site(REPO / "examples" / "sites", site).profile.cross_region
    assert xr.enabled and xr.region == region and xr.regions == ["eu", "us"]
    data = "/scratch/plain/data" + ("-us" if region == "us" else "")
    assert rest == ["--run-dir", f"/scratch/plain/runs/{region}", "--data", data] + [
        "--steps",
        "5000",
        "--save-every",
        "500",
    ]


def test_examples_out_holds_renders():
    names = {p.name for p in EXAMPLES_OUT}
    assert {"titan.sbatch", "titan.setup.sbatch"} <= names
    assert {"plain.sbatch", "plain.setup.sbatch", "plain-us.sbatch", "plain-us.setup.sbatch"} <= names


@pytest.mark.slow  # shellcheck on every example render
@pytest.mark.parametrize("path", EXAMPLES_OUT, ids=lambda p: p.name)
def test_example_renders_pass_bash_n_and_shellcheck(path):
    lint(path)
