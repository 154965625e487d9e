"""The rendered training step run for real under bash (out/local.sbatch, stub Slurm commands as in
test_requeue.py), down to the node: the stub srun runs the step's command itself, as node n1 (its options
dropped, its --output honoured), so the batch shell's `export -f node_py`, the staged node program and its
run-trainer run as on a node, around a stub torchrun. What a real Slurm does with them: tests/e2e."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .batch_sandbox import prepare, scontrol_stub, start_job

# stub: the preflight passes; the training step's command runs here, as node n1, its output into --output
SRUN = r"""#!/bin/bash
for a in "$@"; do [[ $a == preflight ]] && exit 0; done
out=/dev/stdout
while [[ ${1-} == -* ]]; do
  case $1 in --output=*) out=${1#--output=}; out=${out//%N/n1} ;; esac
  shift
done
echo $$ >"$STUB_DIR/srun.pid"
export SLURMD_NODENAME=n1
exec "$@" >>"$out" 2>&1
"""

SINFO = "#!/bin/bash\necho 'slurm 22.05.8'\n"
SCONTROL = scontrol_stub("exit 0")

# stub torchrun: notes how it runs (SIGTERM ignored?), then by $STUB_MODE: "own-stop": the trainer stops on
# its own (creates the stop file, acks); "term": waits for the stop file (a SIGTERM to the step), then acks;
# "fails": exits 1. The ack is the trainer's (sbatch_gen/train/signals.py write_ack).
TORCHRUN = f"""#!{sys.executable}
import json, os, signal, sys, time
d, mode, stop = os.environ["STUB_DIR"], os.environ["STUB_MODE"], os.environ["SBATCH_GEN_STOP_FILE"]
ignored = signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
open(os.path.join(d, "torchrun.notes"), "w").write(" ".join(["ignored" if ignored else "default", *sys.argv[1:3]]))
open(os.path.join(d, "torchrun.ready"), "w").close()
if mode == "fails":
    sys.exit(1)
if mode == "own-stop":
    open(stop, "a").close()
deadline = time.monotonic() + 30
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.05)
reason = "stop file: " + open(stop).readline().strip() if os.path.getsize(stop) else "no quorum"
ack = {{"step": 4, "checkpoint": "runs/local/checkpoints/step-4", "reason": reason, "time": 1.0}}
open(stop + ".ack", "w").write(json.dumps(ack) + "\\n")
"""


def _job(tmp_path: Path, mode: str):
    return prepare(tmp_path, {"scontrol": SCONTROL, "srun": SRUN, "sinfo": SINFO, "torchrun": TORCHRUN}, mode)


def _train_log(job: Path) -> str:
    (log,) = (job.parent / "runs" / "local" / "logs").glob("*.attempt-0.n1.log")
    return log.read_text()


def test_the_step_runs_torchrun_under_run_trainer_and_its_ack_requeues(tmp_path):
    job, env, stub_dir = _job(tmp_path, "own-stop")
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=120
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert (stub_dir / "torchrun.notes").read_text().startswith("ignored "), out
    said = "node n1: stopped after step 4 (no quorum): checkpoint runs/local/checkpoints/step-4 complete"
    assert f"] {said}\n" in _train_log(job), _train_log(job)
    assert out.count(f"] {said}\n") == 1, out  # node_lines repeats it in the batch log, once
    assert "trainer checkpointed and asked for a requeue" in out, out
    assert (stub_dir / "calls").read_text() == "requeue 77\n", out


def test_a_sigterm_to_the_step_reaches_run_trainer_which_writes_the_stop_file(tmp_path):
    job, env, stub_dir = _job(tmp_path, "term")
    proc = start_job(job, env)
    deadline = time.monotonic() + 60
    while not (stub_dir / "torchrun.ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    step = int((stub_dir / "srun.pid").read_text())
    # the step's task is the node program itself (bash exec'd it): Slurm's SIGTERM reaches it
    cmdline = Path(f"/proc/{step}/cmdline").read_bytes().split(b"\0")
    assert b"run-trainer" in cmdline and not cmdline[0].endswith(b"bash"), cmdline
    os.kill(step, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    stop_files = list((job.parent / "runs" / "local" / "stop").glob("77.attempt-0"))
    assert [f.read_text() for f in stop_files] == ["SIGTERM to the training step on n1\n"], out
    train_log = _train_log(job)
    assert "] SIGTERM on n1: asking the trainer to checkpoint and stop (runs/local/stop/77.attempt-0)\n" in (
        train_log
    ), train_log
    said = "node n1: stopped after step 4 (stop file: SIGTERM to the training step on n1): checkpoint "
    assert said in train_log and out.count(said) == 1, out
    assert json.loads((job.parent / "runs/local/stop/77.attempt-0.ack").read_text())["step"] == 4
    assert (stub_dir / "calls").read_text() == "requeue 77\n", out


def test_a_failed_step_is_torchruns_status(tmp_path):
    job, env, stub_dir = _job(tmp_path, "fails")
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=120
    )
    out = r.stdout + r.stderr
    assert "training step exited with status 1" in out, out
    assert "node n1:" not in out, out
