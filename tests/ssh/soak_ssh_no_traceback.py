"""The SSH half of the soak, run by `make soak` (not by `make test`): SOAK_RUNS (default 20) launches of the
rendered SSH launcher in a row, two hosts over the test's sshd on 127.0.0.1, every other one stopped on purpose,
and not one Traceback in the launcher's output or any log of the run dir, read unfiltered.

Even runs train to the end (12 steps; torchrun's exit barrier on both hosts, the rendezvous host leaving
last); odd runs get SIGINT (Ctrl-C) on the launcher once training is under way: every host's trainer saves
its stop checkpoint and exits, the launcher ends 130. Each run starts from an empty run dir."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
from sshkit import tiny_config

from sbatch_gen.testing.logscan import tracebacks

pytestmark = pytest.mark.slow

RUNS = int(os.environ.get("SOAK_RUNS", "20"))


@pytest.mark.timeout(240 * RUNS)
def test_ssh_launches_end_without_a_traceback(ssh_launch, tmp_path):
    to_end = tiny_config(tmp_path / "to-end.yaml", train__steps=12, checkpoint__every=4)
    stopped = tiny_config(tmp_path / "stopped.yaml", train__steps=400, checkpoint__every=100_000)
    rows, failed = [], []
    for i in range(RUNS):
        stop = i % 2 == 1
        t0 = time.monotonic()
        launch = ssh_launch("launch.kill_grace_s=120", config=stopped if stop else to_end)
        if stop:
            launch.wait_for_step(3)
            launch.proc.send_signal(signal.SIGINT)
        rc = launch.wait(timeout=240)
        assert rc == (130 if stop else 0), launch.output()
        found = tracebacks(launch.out_file, launch.run_dir)
        kind = "Ctrl-C, stop checkpoint" if stop else "to the end"
        rows.append(f"run {i + 1:2d}  {kind:24s} {time.monotonic() - t0:5.0f} s  tracebacks {len(found)}")
        failed += found
        if not found:
            shutil.rmtree(launch.run_dir)  # the next run starts afresh (a failed one's stays, for reading)
        else:
            os.rename(launch.run_dir, launch.run_dir.with_name(f"failed-{i}"))
    print(f"\nsoak (SSH): {RUNS} two-host launches, {len(failed)} tracebacks\n  " + "\n  ".join(rows))
    assert not failed, "\n\n".join(failed)
