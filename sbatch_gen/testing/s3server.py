"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks: ``moto_server`` in its own process
(through :mod:`sbatch_gen.testing.moto_atomic`: moto's conditional writes made atomic).

    with S3Server() as s3:            # picks a free port, waits until it answers
        s3.create_bucket("mailbox")
        env = s3.env()                # AWS_* variables a client process needs (dummy credentials)
        ... s3.endpoint_url ...

The server is started by absolute path and stopped by its own PID (never by name). Torch-free.
Notes (see the project's test-server notes): moto keeps memory after deletes, ``reset()`` frees it;
use ``get_object`` rather than ranged downloads against it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from sbatch_gen.testing.procs import terminate

ACCESS_KEY = "sbatch-gen-test"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is always local
SECRET_KEY = "sbatch-gen-test-secret"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class S3Server:
    """``host``: the address to bind, 127.0.0.1 unless the clients live in network namespaces of the test's
    own (then the address of the bridge they reach this machine by)."""

    def __init__(
        self, port: int | None = None, log_path: str | os.PathLike | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.host = host
        self.port = port
        self._fixed_port = port
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> S3Server:
        last_err = None
        for _attempt in range(3):  # a port picked free can be taken before the server binds it
            port = self._fixed_port or free_port(self.host)
            log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
            self.proc = subprocess.Popen(
                # moto_server, its conditional writes made atomic (moto_atomic.py says why)
                [sys.executable, "-m", "sbatch_gen.testing.moto_atomic", "-H", self.host, "-p", str(port)],
                stdout=subprocess.DEVNULL if log is None else log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            if log is not None:
                log.close()
            self.port = port
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    last_err = f"moto_server exited with {self.proc.returncode}"
                    break
                try:
                    with _NO_PROXY.open(f"{self.endpoint_url}/moto-api/", timeout=2):
                        return self
                except (urllib.error.URLError, ConnectionError, OSError):
                    time.sleep(0.1)
            else:
                last_err = f"moto_server did not answer on {self.endpoint_url} within {timeout_s:g} s"
            self.stop()
        raise RuntimeError(last_err or "moto_server failed to start")

    def stop(self) -> None:
        p, self.proc = self.proc, None
        terminate(p)  # by PID: only the process we started

    def reset(self) -> None:
        """Drop every bucket and object (moto keeps memory after deletes otherwise)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with _NO_PROXY.open(req, timeout=10):
            pass

    def env(self) -> dict[str, str]:
        """Environment a client process needs: dummy credentials, a region, no proxy for loopback."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "NO_PROXY": f"{self.host},127.0.0.1,localhost",
            "no_proxy": f"{self.host},127.0.0.1,localhost",
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def __enter__(self) -> S3Server:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
