"""Fixtures for the CLI's mailbox tests: a site profile pointed at a mailbox, and the real S3 server of the
cross-region tests (tests/xr/conftest.py; tests/ is on sys.path, as for every test package here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from xr.conftest import KEY_ENV, SECRET_ENV, bucket, s3env, s3server  # noqa: F401 - fixtures, reused

from sbatch_gen.cli import cli

REPO = Path(__file__).resolve().parents[2]


def write_site(sites_dir: Path, name: str, cross_region: str) -> Path:
    """``<sites_dir>/<name>.yaml``: the repo's local test site plus a ``cross_region`` section (YAML text).
    Its slurm.secrets_file, where the job and `status` read the S3 keys a cross_region names, is
    ``<sites_dir>/secrets.env`` (:func:`write_secrets`)."""
    sites_dir.mkdir(parents=True, exist_ok=True)
    text = (REPO / "sites" / "local.yaml").read_text()
    text = text.replace("\nslurm:\n", f"\nslurm:\n  secrets_file: {sites_dir / 'secrets.env'}\n", 1)
    path = sites_dir / f"{name}.yaml"
    path.write_text(text + "\ncross_region:\n" + "".join(f"  {line}\n" for line in cross_region.splitlines()))
    return path


def write_secrets(sites_dir: Path, values: dict[str, str], mode: int = 0o600) -> Path:
    """The sites' slurm.secrets_file (write_site): NAME=value lines, ``mode``."""
    sites_dir.mkdir(parents=True, exist_ok=True)
    path = sites_dir / "secrets.env"
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    path.chmod(mode)
    return path


def sg(*args: str):
    """``sbatch-gen ARGS`` in this process: (exit code, stdout, stderr)."""
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture
def sites(tmp_path) -> Path:
    return tmp_path / "sites"


__all__ = ["KEY_ENV", "SECRET_ENV", "sg", "write_secrets", "write_site"]
