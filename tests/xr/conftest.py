"""Fixtures for the cross-region tests: a real S3-compatible server (moto_server) on 127.0.0.1."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` (the scripted peer) is a top-level package of the checkout
    sys.path.insert(0, str(REPO))

from sbatch_gen.testing.s3server import S3Server  # noqa: E402

KEY_ENV, SECRET_ENV = "XR_TEST_ACCESS_KEY", "XR_TEST_SECRET_KEY"
_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3server(tmp_path_factory):
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with S3Server(log_path=log) as server:
        yield server


@pytest.fixture
def s3env(s3server, monkeypatch):
    """Credentials for clients created in this process, by env var NAMES (as a site profile gives them)."""
    env = s3server.env()
    monkeypatch.setenv(KEY_ENV, env["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv(SECRET_ENV, env["AWS_SECRET_ACCESS_KEY"])
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def bucket(s3server, s3env) -> str:
    name = f"xr-test-{next(_buckets)}"
    s3server.create_bucket(name)
    return name


@pytest.fixture(params=["fs", "s3"])
def transport(request, tmp_path):
    """A CrossRegion transport for a fresh mailbox: a directory, or a fresh bucket on the moto server."""
    from sbatch_gen.xr_options import FsTransport, S3Credentials, S3Transport

    if request.param == "fs":
        return FsTransport(root=str(tmp_path / "mailbox"))
    server = request.getfixturevalue("s3server")
    b = request.getfixturevalue("bucket")
    return S3Transport(
        bucket=b,
        prefix="team/xr",
        endpoint_url=server.endpoint_url,
        addressing_style="path",
        region_name="us-east-1",
        credentials=S3Credentials(access_key_id_env=KEY_ENV, secret_access_key_env=SECRET_ENV),
    )


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, repo):
    """Data shards of regions eu, us and ap for the multi-process tests."""
    from sbatch_gen.train.data import prepare

    d = tmp_path_factory.mktemp("data")
    prepare(d, ["eu", "us", "ap"], source="python-stdlib", max_bytes=400_000)
    return d
