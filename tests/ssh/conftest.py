"""Fixtures for the SSH launcher tests: a real OpenSSH server on 127.0.0.1 started by the test (own host
and user keys, ``StrictModes=no`` because the keys live under a temporary directory, stopped by its PID),
a prepared data shard, and ``ssh_launch`` to render ssh-local for one test and start its launcher."""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
import subprocess
from pathlib import Path

import pytest
from sshkit import (
    Launch,
    Sshd,
    base_overrides,
    free_port,
    render_site,
    start_sshd,
    stop_sshd,
    tagged_pids,
    tiny_config,
)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """The sshd every launch test uses: 127.0.0.1 and localhost both reach it."""
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        stop_sshd(server)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """One prepared data shard (region 'local') for every launch: prepared once, not per node."""
    from sbatch_gen.train.data import prepare

    d = tmp_path_factory.mktemp("ssh-data")
    prepare(d, ["local"], source="python-stdlib", max_bytes=300_000)
    return d


@pytest.fixture
def ssh_launch(sshd, data_dir, tmp_path, clean_env, repo):
    """start(overrides..., config=...) renders ssh-local for this test and starts the launcher in
    tmp_path; teardown kills whatever a failed test left behind (launcher and tagged processes)."""
    started: list[Launch] = []

    def start(
        *overrides: str, config: Path | None = None, server: Sshd | None = None, wrap: tuple[str, ...] = ()
    ) -> Launch:
        """``server``: another sshd than the session's; ``wrap``: a prefix for the launcher command (it must
        exec the launcher, so the PID in the tag stays the launcher's)."""
        config = config or tiny_config(tmp_path / "tiny.yaml")
        port = free_port()
        for o in overrides:  # an explicit port wins
            if o.startswith("torchrun.rdzv_port="):
                port = int(o.split("=", 1)[1])
        script = render_site(
            repo,
            tmp_path / "out",
            [*base_overrides(repo, server or sshd, data_dir, config, port), *overrides],
        )
        out_file = tmp_path / f"launcher-{len(started)}.out"
        with open(out_file, "w") as f:
            proc = subprocess.Popen(
                [*wrap, "bash", str(script)], cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT
            )
        launch = Launch(proc, tmp_path, script, f"sbg-{getpass.getuser()}-{port}-{proc.pid}", out_file)
        started.append(launch)
        return launch

    yield start
    for launch in started:
        if launch.proc.poll() is None:
            launch.proc.kill()
            launch.proc.wait()
        for pid in tagged_pids(launch.tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
