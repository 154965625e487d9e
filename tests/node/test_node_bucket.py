"""The node program's bucket check (sbatch_gen/node_program.py: check_bucket, the preflight's s3_* settings)
against a real S3-compatible server that checks signatures (nanio): the node's python and boto3 list the
bucket with the credentials the variables hold, and a failure is one problem naming the bucket, the
endpoint, the server's error and the profile field. The node program itself stays standard library only:
boto3 runs in a subprocess of the python it is given."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.servers import NanioServer
from sbatch_gen import node_program as np

pytestmark = pytest.mark.slow  # a real S3 server; boto3 imported in subprocesses

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable  # the venv's: it has boto3
KEY, SECRET = "AKNODETEST", "node-test-secret-value"
BUCKET = "node-bucket"
CREDS = "cross_region.transport.credentials"


@pytest.fixture(scope="module")
def s3():
    server = NanioServer(access_key=KEY, secret_key=SECRET).start()
    try:
        import boto3

        boto3.session.Session(
            aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name="us-east-1"
        ).client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("SBG_NT_KEY", KEY)
    monkeypatch.setenv("SBG_NT_SECRET", SECRET)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return monkeypatch


def settings(endpoint: str, **kw: str) -> dict[str, str]:
    s = dict(np.PREFLIGHT_SETTINGS)
    s.update(
        s3_bucket=BUCKET,
        s3_prefix="runs/x",
        s3_endpoint=endpoint,
        s3_addressing="path",
        s3_region="us-east-1",
        s3_key_env="SBG_NT_KEY",
        s3_secret_env="SBG_NT_SECRET",
        s3_timeout_s="5",
    )
    s.update(kw)
    return s


def test_right_credentials_pass(s3, env):
    assert np.check_bucket(PYTHON, settings(s3.endpoint_url)) == (
        True,
        f"s3 bucket {BUCKET} at {s3.endpoint_url} reachable",
    )


def test_a_wrong_secret_is_the_credentials(s3, env):
    env.setenv("SBG_NT_SECRET", "not-the-secret")
    passed, said = np.check_bucket(PYTHON, settings(s3.endpoint_url))
    assert not passed
    assert said.startswith(f"cannot reach s3 bucket {BUCKET} at {s3.endpoint_url}: 403 SignatureDoesNotMatch")
    assert said.endswith(f"({CREDS})")
    assert "not-the-secret" not in said


def test_an_unknown_key_is_the_credentials(s3, env):
    env.setenv("SBG_NT_KEY", "AKNOBODY")
    passed, said = np.check_bucket(PYTHON, settings(s3.endpoint_url))
    assert not passed and ": 403 InvalidAccessKeyId" in said and said.endswith(f"({CREDS})"), said


def test_a_missing_bucket_is_the_bucket(s3, env):
    passed, said = np.check_bucket(PYTHON, settings(s3.endpoint_url, s3_bucket="no-such-bucket"))
    assert not passed
    assert said.startswith(f"cannot reach s3 bucket no-such-bucket at {s3.endpoint_url}: 404 NoSuchBucket")
    assert said.endswith("(cross_region.transport.bucket)")


def test_a_variable_unset_on_this_node_is_named(s3, env):
    env.delenv("SBG_NT_SECRET")
    passed, said = np.check_bucket(PYTHON, settings(s3.endpoint_url))
    assert (passed, said) == (
        False,
        f"cannot reach s3 bucket {BUCKET} at {s3.endpoint_url}: environment variable SBG_NT_SECRET is not set "
        f"on this node ({CREDS}.secret_access_key_env)",
    )


def test_a_missing_shared_credentials_profile(s3, env, tmp_path):
    env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    env.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    passed, said = np.check_bucket(
        PYTHON, settings(s3.endpoint_url, s3_key_env="", s3_secret_env="", s3_profile="nosuch")
    )
    assert not passed and "nosuch" in said and said.endswith(f"({CREDS}.profile)"), said


def test_a_shared_credentials_profile_passes(s3, env, tmp_path):
    creds = tmp_path / "credentials"
    creds.write_text(f"[team]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n")
    env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    env.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    passed, said = np.check_bucket(
        PYTHON, settings(s3.endpoint_url, s3_key_env="", s3_secret_env="", s3_profile="team")
    )
    assert passed, said


def test_nothing_listening_is_the_endpoint(env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    passed, said = np.check_bucket(PYTHON, settings(f"http://127.0.0.1:{port}"))
    assert not passed
    assert said.startswith(f"cannot reach s3 bucket {BUCKET} at http://127.0.0.1:{port}: ")
    assert said.endswith("(cross_region.transport.endpoint_url)")


def test_a_silent_endpoint_is_bounded_by_the_timeout(env):
    """A server that accepts and never answers: the check gives up after the read timeout (one attempt)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        start = time.monotonic()
        passed, said = np.check_bucket(
            PYTHON, settings(f"http://127.0.0.1:{srv.getsockname()[1]}", s3_timeout_s="2")
        )
        took = time.monotonic() - start
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()
    assert not passed and said.endswith("(cross_region.transport.endpoint_url)"), said
    assert took < 15, took


def test_a_python_without_boto3_is_python_env(s3, env):
    if subprocess.run(["/usr/bin/python3", "-c", "import boto3"], capture_output=True).returncode == 0:
        pytest.skip("the system python has boto3")
    passed, said = np.check_bucket("/usr/bin/python3", settings(s3.endpoint_url))
    assert (
        not passed and "boto3 not importable by /usr/bin/python3" in said and said.endswith("(python_env)")
    ), said


def test_the_preflight_runs_it_and_says_it_in_the_nodes_line(s3, env, tmp_path):
    """The whole program as the nodes run it (`python -I sbatch-gen-node.py preflight ...`, the venv's python
    on PATH): the bucket is one more item of the node's line, and a failure one more problem."""
    program = tmp_path / "sbatch-gen-node.py"
    program.write_text((REPO / "sbatch_gen" / "node_program.py").read_text())
    path = f"{Path(PYTHON).parent}:{os.environ['PATH']}"
    args = [f"{k}={v}" for k, v in settings(s3.endpoint_url).items() if k.startswith("s3_")]
    ok = subprocess.run(
        [PYTHON, "-I", str(program), "preflight", *args],
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert f"s3 bucket {BUCKET} at {s3.endpoint_url} reachable" in ok.stdout
    bad = subprocess.run(
        [PYTHON, "-I", str(program), "preflight", *args],
        env={**os.environ, "PATH": path, "SBG_NT_SECRET": "nope"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("preflight FAILED on ")
    assert f"cannot reach s3 bucket {BUCKET} at {s3.endpoint_url}: 403 " in bad.stderr
