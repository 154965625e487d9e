"""The secrets a Slurm job reads on the node (slurm.secrets_file, the job library's load_secrets): the profile
names them (metrics.wandb_api_key_env here, and slurm.secrets), the submitting shell's values never count, the
job steps get the file's, and no value is printed or written anywhere. Checked on a whole Slurm job run under
bash with stub Slurm commands (batch_sandbox.py); tests/e2e/test_job_environment.py submits one to the local
cluster and searches Slurm's own records too."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .batch_sandbox import ENV_DUMP_STUBS, prepare, render_local

WANDB = "wandb-value-1f3a"  # metrics.wandb_api_key_env=SBG_WANDB, wandb_mode online: required
TOKEN = "tok en=value-7c2e"  # slurm.secrets=[SBG_TOKEN]: required, in quotes in the file
SUBMITTED = "submitted-value-9d41"  # what a submitting shell held (sbatch --export=ALL)
OPTIONAL = "SBG_OPTIONAL"  # slurm.secrets would make it required; the W&B key with wandb_mode auto is not


def _script(secrets_file: str, mode: str = "online") -> str:
    return render_local(
        "metrics.sinks=[wandb]",
        f"metrics.wandb_mode={mode}",
        "metrics.wandb_api_key_env=SBG_WANDB",
        "slurm.secrets=[SBG_TOKEN]",
        f"slurm.secrets_file={secrets_file}",
    )


GOOD = f"""# the job's secrets
SBG_WANDB={WANDB}

export SBG_TOKEN='{TOKEN}'
SBG_OTHER=not-taken
"""


def _run(
    tmp_path: Path, text: str | None, *, file_mode: int = 0o600, env=None, secrets_file=None, mode="online"
):
    """(exit status, the job's output, the training step's environment or None, the submit directory)."""
    home = tmp_path / "home"
    home.mkdir()
    secrets = home / "job.env"
    if text is not None:
        secrets.write_text(text)
        secrets.chmod(file_mode)
    job, full, stub_dir = prepare(
        tmp_path,
        ENV_DUMP_STUBS,
        "ok",
        script=_script(secrets_file or str(secrets), mode),
        env={"HOME": str(home), **(env or {})},
    )
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=full, capture_output=True, text=True, timeout=60
    )
    step_file = stub_dir / "step.env"
    step = None
    if step_file.exists():
        step = dict(x.split("=", 1) for x in step_file.read_bytes().decode().split("\0") if x)
    return r.returncode, r.stdout + r.stderr, step, job.parent


def _files_holding(root: Path, values: list[str]) -> list[str]:
    found = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath, n)
            if p.is_symlink() or not p.is_file():
                continue
            data = p.read_bytes()
            found += [f"{p}: {v}" for v in values if v.encode() in data]
    return found


def test_the_job_steps_get_the_files_secrets_and_nothing_else_holds_them(tmp_path):
    rc, out, step, work = _run(tmp_path, GOOD, env={"SBG_TOKEN": SUBMITTED, "SBG_WANDB": SUBMITTED})
    assert rc == 0, out
    assert step is not None
    assert step["SBG_WANDB"] == WANDB and step["SBG_TOKEN"] == TOKEN  # the file's, quotes dropped
    assert "SBG_OTHER" not in step  # only the names the profile lists
    said = [x for x in out.splitlines() if "secrets from" in x]
    assert len(said) == 1 and said[0].endswith("(slurm.secrets_file): SBG_WANDB SBG_TOKEN"), out
    # a value the job started with (sbatch --export=ALL) is dropped, by name
    warned = [x for x in out.splitlines() if "held SBG_WANDB SBG_TOKEN at its start" in x]
    assert len(warned) == 1 and "WARNING" in warned[0], out
    for v in (WANDB, TOKEN, "value-7c2e", SUBMITTED):
        assert v not in out
    # nothing the job wrote holds a value: the run dir, the logs, its pinned code and script copies
    assert _files_holding(work, [WANDB, "value-7c2e", SUBMITTED]) == []


def test_the_home_directory_of_the_node(tmp_path):
    rc, out, step, _ = _run(tmp_path, GOOD, secrets_file="~/job.env")
    assert rc == 0, out
    assert step is not None and step["SBG_TOKEN"] == TOKEN
    assert f"secrets from {tmp_path}/home/job.env (slurm.secrets_file)" in out


def test_an_optional_secret_may_be_missing(tmp_path):
    """wandb_mode auto: the W&B key is taken when the file has it; the job runs without it (offline)."""
    rc, out, step, _ = _run(tmp_path, f"SBG_TOKEN={TOKEN}\n", mode="auto", env={"SBG_WANDB": SUBMITTED})
    assert rc == 0, out
    assert step is not None and step["SBG_TOKEN"] == TOKEN
    assert "SBG_WANDB" not in step  # not the submitting shell's either
    assert "secrets from" in out and out.count("SBG_WANDB") == 1  # the warning names it, the summary does not


@pytest.mark.parametrize(
    ("text", "file_mode", "error"),
    [
        pytest.param(GOOD, 0o640, "is mode 640: others may read it; chmod 600", id="group-readable"),
        pytest.param(GOOD, 0o604, "is mode 604: others may read it", id="world-readable"),
        pytest.param(
            f"SBG_WANDB={WANDB}\n",
            0o600,
            "has no value for SBG_TOKEN (slurm.secrets[0])",
            id="a-required-one-missing",
        ),
        pytest.param(
            f"SBG_WANDB={WANDB}\nSBG_TOKEN=\n",
            0o400,
            "has no value for SBG_TOKEN (slurm.secrets[0])",
            id="a-required-one-empty",
        ),
        pytest.param(
            f"SBG_WANDB={WANDB}\n{TOKEN}\n",
            0o600,
            "(slurm.secrets_file), line 2: not NAME=value",
            id="not-name-value",
        ),
        pytest.param(
            None,
            0o600,
            "job.env (slurm.secrets_file) on ",
            id="no-file",
        ),
    ],
)
def test_an_unsafe_or_incomplete_file_stops_the_job_before_any_step(tmp_path, text, file_mode, error):
    rc, out, step, _ = _run(tmp_path, text, file_mode=file_mode)
    assert rc == 1, out
    assert step is None  # no job step started
    errors = [x for x in out.splitlines() if "ERROR" in x]
    assert len(errors) == 1 and error in errors[0], out
    assert "slurm.secrets_file" in errors[0]
    for v in (WANDB, TOKEN, "value-7c2e"):
        assert v not in out
    if text is None:
        assert (
            "write NAME=value lines for SBG_WANDB (metrics.wandb_api_key_env) SBG_TOKEN (slurm.secrets[0])"
            in out
        )


def test_a_file_of_another_user_stops_the_job(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root can give the file to another user")
    home = tmp_path / "file-of-nobody"
    home.mkdir()
    f = home / "job.env"
    f.write_text(GOOD)
    f.chmod(0o600)
    os.chown(f, 65534, 65534)
    rc, out, step, _ = _run(tmp_path, None, secrets_file=str(f))
    assert rc == 1 and step is None, out
    assert "belongs to uid 65534, not to this job's user (uid 0)" in out
