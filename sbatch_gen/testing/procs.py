"""Process helpers for tests and benchmarks. Torch-free."""

from __future__ import annotations

import signal
import subprocess


def terminate(p: subprocess.Popen | None, timeout_s: float = 10) -> None:
    """Stop a process we started, by its own PID: SIGTERM, then SIGKILL after ``timeout_s``."""
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=timeout_s)
