"""How long a crash holds a node: torchrun with the flags a render gives it (stop_protocol sbatch-gen, eu:
--shutdown-timeout=300, the stop budget) frees the node about 30 s after a worker failed, whatever that
flag says: torch 2.13's agent stops the survivors of a failure with its own default (`_stop_workers` calls
`_shutdown()`), not with --shutdown-timeout, which bounds only the shutdowns after a signal it handles.

The survivor here takes SIGTERM as a stop request and then hangs, as a rank of the companion trainer (or a
trainer on the library) hangs in the collective of a stop checkpoint whose peer is gone (NCCL waits for its
own timeout). torchrun runs with SIGTERM ignored, as run-trainer starts it. Should torch start applying the
flag to failures, this test fails (300 s), and the render's value for it must be revisited.

A worker on sbatch-gen's StopRequest (the companion trainer, a trainer on the library) does better: the
launchers write the stop file before they hand SIGTERM on, so a SIGTERM without a stop file within
TERM_WITHOUT_STOP_S is the agent's teardown, and the worker exits at once: the node is free in seconds. A
SIGTERM whose stop file comes within that time (Slurm signals a whole step's processes at once, the
launcher's shell among them) is a stop, however long its checkpoint takes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sbatch_gen.contract import ENV_STOP_FILE, TERM_WITHOUT_STOP_S
from sbatch_gen.launch import SLURM, torchrun_argv
from sbatch_gen.loader import load_site
from sbatch_gen.node_program import TEARDOWN_S

from .conftest import REPO, train_env

pytestmark = pytest.mark.slow  # torchrun and two workers

WORKER = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(1)
    open(sys.argv[1] + ".crash", "w").write(repr(time.time()))
    sys.exit(3)  # the crash
def stop_request(signum, frame):
    open(sys.argv[1], "w").write("stop requested")  # then stuck, as in a collective with a dead peer
signal.signal(signal.SIGTERM, stop_request)
time.sleep(600)
"""


def _flags(site: str) -> list[str]:
    p = load_site(REPO / "sites", site, []).profile
    words = [w for o in torchrun_argv(p, SLURM) for w in o.words if isinstance(w, str)]
    return [w for w in words if w.startswith(("--signals-to-handle", "--shutdown-timeout"))]


# The same crash, the survivor on the library's StopRequest, stuck where no Python handler returns.
LIB_WORKER = """
import os, sys, time
from sbatch_gen.train.api import StopRequest
stop = StopRequest.from_env()
stop.install()
if int(os.environ["RANK"]) == 1:
    time.sleep(1)
    open(sys.argv[1] + ".crash", "w").write(repr(time.time()))
    sys.exit(3)
os.read(os.pipe()[0], 1)  # stuck for good: a handler runs, the read goes on
"""


def _torchrun_crash(
    tmp_path: Path, source: str, env: dict | None = None, wrapped: bool = False
) -> tuple[str, float, int]:
    """torchrun with the eu render's stop flags, SIGTERM ignored as run-trainer starts it (WRAPPED: through the
    node program's torchrun, as run-trainer starts torch's own); rank 1 crashes. Returns (output, seconds from
    the crash to torchrun's exit, its status)."""
    flags = _flags("eu")
    assert "--shutdown-timeout=300" in flags, flags  # eu budgets 300 s for a stop checkpoint
    worker = tmp_path / "worker.py"
    worker.write_text(source)
    marker = tmp_path / "rank0.stop"
    program = [sys.executable, "-I", str(REPO / "sbatch_gen" / "node_program.py"), "torchrun", "--"]
    cmd = [
        *(program if wrapped else [str(Path(sys.executable).parent / "torchrun")]),
        "--standalone",
        "--nproc-per-node=2",
        "--monitor-interval=0.2",
        *flags,
        str(worker),
        str(marker),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=train_env(env),
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN),  # as run-trainer starts it
    )
    try:
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.time()
    text = out.decode(errors="replace")
    return text, ended - float(marker.with_name(marker.name + ".crash").read_text()), proc.returncode


def test_a_crash_frees_the_node_in_torchs_30_s_not_after_the_stop_budget(tmp_path: Path):
    text, took, rc = _torchrun_crash(tmp_path, WORKER)
    assert rc == 1, text
    assert (tmp_path / "rank0.stop").read_text() == "stop requested", text  # got the SIGTERM, hung
    assert 25 < took < 60, f"torchrun freed the node {took:.0f} s after the crash:\n{text}"


def test_through_the_node_program_a_crash_frees_the_node_in_its_teardown_bound(tmp_path: Path):
    """The same survivor (a trainer of one's own that hangs after SIGTERM) under the node program's torchrun,
    as run-trainer starts torch's: SIGKILLed TEARDOWN_S after the SIGTERM, not torch's 30 s."""
    text, took, rc = _torchrun_crash(tmp_path, WORKER, wrapped=True)
    assert rc == 1, text
    assert (tmp_path / "rank0.stop").read_text() == "stop requested", text
    assert TEARDOWN_S - 1 < took < TEARDOWN_S + 12, (
        f"torchrun freed the node {took:.0f} s after the crash:\n{text}"
    )


def test_a_crash_frees_the_node_in_seconds_when_the_survivor_runs_the_library(tmp_path: Path):
    stop_file = tmp_path / "stop" / "job.attempt-0"  # set, never created: nobody asked to stop
    text, took, rc = _torchrun_crash(
        tmp_path, LIB_WORKER, {ENV_STOP_FILE: str(stop_file), "SLURM_STEP_ID": "0"}
    )
    assert rc == 1, text
    assert "exitcode  : 3" in text, text  # torchrun still names the crash as the cause
    line = f"rank 0: SIGTERM and no stop file within {TERM_WITHOUT_STOP_S:g} s: torchrun is stopping"
    assert text.count(line) == 1, text
    assert took < TERM_WITHOUT_STOP_S + 10, f"torchrun freed the node {took:.0f} s after the crash:\n{text}"


# A worker on the library, as torchrun starts it (TORCHELASTIC_RUN_ID set), checkpointing CKPT_S once asked.
STOPPING_WORKER = """
import sys, time
from sbatch_gen.train.api import StopRequest
stop = StopRequest.from_env()
stop.install()
print("ready", flush=True)
while not stop.local():
    time.sleep(0.05)
print("stopping:", stop.reason(), flush=True)
time.sleep(float(sys.argv[1]))  # the stop checkpoint, longer than the teardown window
print("saved", flush=True)
"""


def _stopping_worker(tmp_path: Path, ckpt_s: float, **extra: str) -> tuple[subprocess.Popen, Path]:
    """The worker, as torchrun starts it under a Slurm job step (SLURM_STEP_ID; ``extra`` replaces it)."""
    extra = {"SLURM_STEP_ID": "0", **extra}
    (tmp_path / "w.py").write_text(STOPPING_WORKER)
    stop_file = tmp_path / "stop" / "job.attempt-0"
    stop_file.parent.mkdir()
    env = train_env({ENV_STOP_FILE: str(stop_file), "TORCHELASTIC_RUN_ID": "t", "RANK": "0", **extra})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "w.py"), str(ckpt_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc, stop_file


def test_a_sigterm_whose_stop_file_comes_in_time_is_a_stop_however_long_the_save(tmp_path: Path):
    """Slurm signals every process of a step at once: the worker may get SIGTERM a moment before the
    launcher's shell has written the stop file. That is a stop; the save outlasts the window."""
    proc, stop_file = _stopping_worker(tmp_path, ckpt_s=TERM_WITHOUT_STOP_S + 2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    stop_file.write_text("SIGTERM to the training step on n1\n")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "stopping: SIGTERM" in out, out
    assert out.rstrip().endswith("saved"), out


def test_outside_a_slurm_step_a_sigterm_without_a_stop_file_stays_a_stop(tmp_path: Path):
    """The SSH launcher's stop signals the workers directly, without a stop file: a stop, not a teardown."""
    proc, _ = _stopping_worker(tmp_path, ckpt_s=TERM_WITHOUT_STOP_S + 2, SLURM_STEP_ID="")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.rstrip().endswith("saved"), out


def test_a_sigterm_without_a_stop_file_exits_after_the_window(tmp_path: Path):
    proc, _ = _stopping_worker(tmp_path, ckpt_s=60)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "rank 0: SIGTERM and no stop file within" in out and "saved" not in out, out
    assert TERM_WITHOUT_STOP_S - 0.5 < took < TERM_WITHOUT_STOP_S + 10, took
