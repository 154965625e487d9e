"""trainer.stop_protocol with the SSH launcher, run for real (sshd on 127.0.0.1, real torchrun on both
"hosts"), with a probe trainer in place of the companion one (tests/probes/sbg_stop_probe.py):

- signal: Ctrl-C on the launcher sends SIGTERM to torchrun only, once per node; torchrun forwards it to its
  worker and waits for it (--shutdown-timeout): the probe saves slowly and exits on its own, nothing is
  SIGKILLed;
- none: Ctrl-C SIGKILLs every tagged process at once, whatever launch.kill_grace_s says; the trainer keeps
  only its own periodic checkpoints."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from sshkit import tagged_pids

pytestmark = pytest.mark.slow

PROBES = Path(__file__).resolve().parents[1] / "probes"


def _probe(*args: str) -> list[str]:
    """Overrides that make sbg_stop_probe the trainer, with these arguments."""
    return [
        f"paths.code_dir={PROBES}",
        "trainer.module=sbg_stop_probe",
        "trainer.extra_args=" + json.dumps(list(args)),
    ]


def _wait_for(launch, paths: list[Path], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline and launch.proc.poll() is None, launch.output()
        time.sleep(0.2)


def test_signal_protocol_torchrun_forwards_the_sigterm_once_and_waits_for_the_save(ssh_launch):
    launch = ssh_launch(
        *_probe("--probe-mode", "signal", "--probe-save-s", "3"),
        "trainer.stop_protocol=signal",
        "trainer.stop_grace_s=60",
    )
    probe = launch.run_dir / "probe"
    _wait_for(launch, [probe / f"start.attempt-1.rank-{r}.json" for r in (0, 1)])
    time.sleep(1)  # torchrun installs its signal handlers when it starts the workers: they run by now
    launch.proc.send_signal(signal.SIGINT)
    assert launch.wait(timeout=120) == 130, launch.output()
    out = launch.output()
    assert (
        "caught SIGINT: stopping every node (SIGTERM to torchrun, which forwards it to the workers; " in out
    )
    for rank in (0, 1):
        saved = json.loads((probe / f"saved.rank-{rank}").read_text())
        assert saved["signal"] == "SIGTERM" and saved["save_s"] >= 3, saved
        # one SIGTERM: from torchrun; the launcher signalled torchrun only (once per node)
        assert (probe / f"signals.rank-{rank}").read_text().splitlines() == ["1 SIGTERM"]
        log = launch.node_log(1, rank)
        # torchrun's agent handled it (torch logs the number: SIGTERM is 15) and sent it on
        assert re.search(
            rf"Received ({signal.SIGTERM.value}|\S*SIGTERM) death signal, shutting down workers", log
        )
        assert re.search(r"Sending process \d+ closing signal SIGTERM", log), log
    cleanup = (launch.logs / "cleanup.log").read_text()
    assert "(torchrun forwards it to its workers)" in cleanup, cleanup
    assert "SIGKILL to" not in cleanup, cleanup
    assert not tagged_pids(launch.tag)


def test_none_protocol_sigkills_at_once(ssh_launch):
    launch = ssh_launch(
        *_probe("--probe-mode", "none", "--probe-step-s", "0.1"),
        "trainer.stop_protocol=none",
        "launch.kill_grace_s=600",  # unused with none
    )
    probe = launch.run_dir / "probe"
    _wait_for(launch, [probe / f"ckpt.rank-{r}" for r in (0, 1)])
    time.sleep(1)
    t0 = time.monotonic()
    launch.proc.send_signal(signal.SIGINT)
    assert launch.wait(timeout=120) == 130, launch.output()
    assert time.monotonic() - t0 < 60, "waited for launch.kill_grace_s"
    assert "caught SIGINT: stopping every node (SIGKILL now: trainer.stop_protocol none)" in launch.output()
    cleanup = (launch.logs / "cleanup.log").read_text()
    assert "SIGTERM" not in cleanup and "SIGKILL to" in cleanup, cleanup
    for rank in (0, 1):
        assert "death signal" not in launch.node_log(1, rank)  # torchrun got no SIGTERM to forward
        assert (
            int((probe / f"ckpt.rank-{rank}").read_text()) >= 1
        )  # its own periodic checkpoint is all there is
    assert not tagged_pids(launch.tag)
