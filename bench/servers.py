"""S3-compatible servers for the benchmarks: nanio (files on disk, SigV4; the default) or moto.

Started by absolute path, stopped by their own PID. Optionally inside a network namespace
(``ip netns exec NS`` execs the server, so the PID we hold is the server's own).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sbatch_gen.testing.procs import terminate
from sbatch_gen.testing.s3server import ACCESS_KEY, SECRET_KEY, S3Server, free_port


def _bin(name: str) -> str:
    p = Path(sys.executable).parent / name
    if not p.exists():
        raise RuntimeError(f"{name} not found next to {sys.executable}: pip install -e '.[dev]'")
    return str(p)


def wait_port(
    host: str, port: int, timeout_s: float, proc: subprocess.Popen, netns: str | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {host}:{port}")
        if netns is None:
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        else:
            rc = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    netns,
                    sys.executable,
                    "-c",
                    f"import socket; socket.create_connection(('{host}', {port}), timeout=0.5)",
                ],
                capture_output=True,
            ).returncode
            if rc == 0:
                return
            time.sleep(0.1)
    raise RuntimeError(f"server did not listen on {host}:{port} within {timeout_s:g} s")


class NanioServer:
    kind = "nanio"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        netns: str | None = None,
        data_dir: str | None = None,
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
    ) -> None:
        """``access_key``/``secret_key``: the one pair nanio accepts (SigV4; any other is refused with 403)."""
        self.host, self.netns = host, netns
        self.access_key, self.secret_key = access_key, secret_key
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="sbgen-nanio-")
        self.data_dir = data_dir or self._tmp.name
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> NanioServer:
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "NANIO_ACCESS_KEY": self.access_key, "NANIO_SECRET_KEY": self.secret_key}
        cmd = [
            _bin("nanio"),
            "serve",
            "--data-dir",
            self.data_dir,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--no-access-log",
            "--log-level",
            "warning",
        ]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        wait_port(self.host, self.port, 30, self.proc, self.netns)
        return self

    def stop(self) -> None:
        p, self.proc = self.proc, None
        terminate(p)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "NO_PROXY": "*",
            "no_proxy": "*",
        }

    def __enter__(self) -> NanioServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MotoServer(S3Server):
    """moto's server (objects in memory; honours conditional writes, which nanio ignores), optionally in a
    network namespace (``netns``: then it binds ``host`` there and is probed from inside it)."""

    kind = "moto"

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, netns: str | None = None) -> None:
        super().__init__(port=port, host=host)
        self.netns = netns

    def start(self, timeout_s: float = 30.0) -> MotoServer:
        if self.netns is None:
            super().start(timeout_s)
            return self
        self.port = self.port or free_port()
        cmd = ["ip", "netns", "exec", self.netns, _bin("moto_server"), "-H", self.host, "-p", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_port(self.host, self.port, timeout_s, self.proc, self.netns)
        return self

    def env(self) -> dict[str, str]:
        return {**super().env(), "NO_PROXY": "*", "no_proxy": "*"}


def make_server(kind: str, **kw):
    if kind == "nanio":
        return NanioServer(**kw)
    if kind == "moto":
        return MotoServer(**{k: v for k, v in kw.items() if k in ("host", "port", "netns")})
    raise ValueError(f"unknown server {kind!r} (nanio, moto)")


def s3_client(endpoint_url: str, threads: int = 16, lean: bool = True):
    """A boto3 client with the same lean settings the S3 mailbox uses (or botocore's defaults)."""
    import boto3
    from botocore.config import Config

    kw = dict(max_pool_connections=max(10, threads + 4))
    if lean:
        kw.update(
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
    else:
        kw.update(s3={"addressing_style": "path"})
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=Config(**kw),
    )
