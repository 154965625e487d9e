"""The rendered batch script's requeue path, run for real under bash with stub Slurm commands.

When a requeue takes, Slurm sends TERM to every process of the job: the batch shell and the
`scontrol requeue` it is still running. A requeue that worked must never be reported as
"scontrol requeue failed; resubmit" (an operator following that starts a second job on the run dir).
The same holds for trainer.stop_protocol none, whose requeue comes while the training step still runs."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .batch_sandbox import prepare, render_local, scontrol_stub, start_job
from .conftest import REPO

# $STUB_MODE selects what `scontrol requeue` does
SCONTROL = scontrol_stub(
    r"""
case $STUB_MODE in
  ok-then-term)  # the requeue takes, then Slurm signals every process of the job (this one too)
    echo 1 >"$STUB_DIR/restarts"
    kill -TERM "$PPID" "$$"
    sleep 0.3
    exit 0 ;;
  took-but-failed)  # the requeue took, but scontrol reports a failure (e.g. killed, timed out)
    echo 1 >"$STUB_DIR/restarts"
    exit 1 ;;
  fails)
    echo "scontrol: error: Requeue of job $2 failed" >&2
    exit 1 ;;
esac
"""
)

SRUN = r"""#!/bin/bash
# stub: the preflight passes, the training step fails (a node failure): the script requeues
for a in "$@"; do [[ $a == preflight ]] && exit 0; done
exit 1
"""

SINFO = "#!/bin/bash\necho 'slurm 22.05.8'\n"


def _run_script(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    job, env, stub_dir = prepare(tmp_path, {"scontrol": SCONTROL, "srun": SRUN, "sinfo": SINFO}, mode)
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=60
    )
    return r, stub_dir


@pytest.mark.parametrize("mode", ["ok-then-term", "took-but-failed"])
def test_a_requeue_that_took_is_never_reported_as_failed(tmp_path, mode):
    r, stub_dir = _run_script(tmp_path, mode)
    out = r.stdout + r.stderr
    assert (stub_dir / "calls").read_text().splitlines() == ["requeue 77"], out
    assert "requeue failed" not in out and "resubmit" not in out, out
    assert "requeued: this attempt is over" in out, out
    assert r.returncode == 0, out


def test_a_failed_requeue_still_says_resubmit(tmp_path):
    r, _ = _run_script(tmp_path, "fails")
    out = r.stdout + r.stderr
    assert "ERROR: scontrol requeue failed (status 1); resubmit" in out, out
    assert r.returncode == 1, out


# stub: the preflight passes; the trainer cannot run (a bad config, the run dir leased by another job): it
# writes why to "<stop file>.fatal" (one line; a second one must not reach the log) and the step fails
SRUN_FATAL = r"""#!/bin/bash
for a in "$@"; do [[ $a == preflight ]] && exit 0; done
printf 'run dir /r is in use by job 12 on host n9 (pid 7)\nsecond line\n' >"$SBATCH_GEN_STOP_FILE.fatal"
exit 1
"""


def test_a_trainer_that_cannot_run_is_not_requeued(tmp_path):
    """Every further attempt would fail the same way after its queue wait: the job fails at once with the
    trainer's one line, and never calls `scontrol requeue` (the local site allows 2 requeues)."""
    job, env, stub_dir = prepare(
        tmp_path, {"scontrol": SCONTROL, "srun": SRUN_FATAL, "sinfo": SINFO}, "fails"
    )
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=60
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert not (stub_dir / "calls").exists(), out  # no requeue was attempted
    errors = [ln for ln in out.splitlines() if "ERROR:" in ln]
    assert len(errors) == 1 and errors[0].endswith(
        "ERROR: the trainer cannot run: run dir /r is in use by job 12 on host n9 (pid 7); not requeueing "
        "(fix it, then resubmit)"
    ), out
    assert "second line" not in out and "requeueing job" not in out, out


# stub: the preflight passes, the training step runs until it is killed (its output to a file, so that a
# step left behind does not hold the test's pipe open)
SRUN_RUNS = r"""#!/bin/bash
for a in "$@"; do [[ $a == preflight ]] && exit 0; done
exec >>"$STUB_DIR/srun.out" 2>&1
echo $$ >"$STUB_DIR/srun.pid"
: >"$STUB_DIR/training"
for ((i = 0; i < 300; i++)); do sleep 0.1; done
"""


@pytest.mark.parametrize("mode", ["ok-then-term", "took-but-failed"])
def test_none_protocol_a_requeue_that_took_while_training_ran_is_not_reported_as_failed(tmp_path, mode):
    job, env, stub_dir = prepare(
        tmp_path,
        {"scontrol": SCONTROL, "srun": SRUN_RUNS, "sinfo": SINFO},
        mode,
        script=render_local("trainer.stop_protocol=none"),
    )
    proc = start_job(job, env)
    try:
        deadline = time.monotonic() + 30
        while not (stub_dir / "training").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        time.sleep(0.2)  # the shell is in `wait` by now
        proc.send_signal(signal.SIGUSR1)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # the training step: Slurm would end it
            os.kill(int((stub_dir / "srun.pid").read_text()), signal.SIGKILL)
    assert (stub_dir / "calls").read_text().splitlines() == ["requeue 77"], out
    assert "no graceful stop (trainer.stop_protocol none)" in out, out
    assert "requeue failed" not in out and "resubmit" not in out, out
    assert "requeued: this attempt is over" in out, out
    assert proc.returncode == 0, out


# stub: the first preflight passes; the training step fails; the preflight after it fails on n2 (its health
# check: the GPU it lost during the step). Every call is noted.
SRUN_NODE_BROKE = r"""#!/bin/bash
for a in "$@"; do
  if [[ $a == preflight ]]; then
    echo preflight >>"$STUB_DIR/calls"
    if [[ -e $STUB_DIR/trained ]]; then
      echo "preflight ok on n1: 2 CPU procs"
      echo "preflight FAILED on n2: health check failed: GPU 3 fell off the bus (preflight.health_check)" >&2
      exit 1
    fi
    exit 0
  fi
done
echo train >>"$STUB_DIR/calls"
: >"$STUB_DIR/trained"
exit 1
"""
SCONTROL_NOTES = r"""#!/bin/bash
[[ $1 != -o ]] || shift
case "$1 $2" in
  "show hostnames") echo n1; echo n2 ;;
  "show job") echo "JobId=$3 JobName=x Restarts=0 ExcNodeList=(null) Reason=None" ;;
  *) echo "scontrol $*" >>"$STUB_DIR/calls" ;;
esac
"""
SINFO_3 = r"""#!/bin/bash
if [[ $1 == --version ]]; then echo 'slurm 22.05.8'; else printf 'n1\nn2\nn3\n'; fi
"""


@pytest.mark.parametrize("sick", [True, False])
def test_a_node_that_fails_its_check_after_a_failed_step_is_left_behind(tmp_path, sick):
    """After a failed training step every node is checked again: one that fails (here n2's health check)
    is left behind (requeuehold, ExcNodeList, release) and named; when all pass, a plain requeue."""
    srun = SRUN_NODE_BROKE if sick else SRUN_NODE_BROKE.replace("exit 1\n    fi", "exit 0\n    fi")
    job, env, stub_dir = prepare(
        tmp_path,
        {"scontrol": SCONTROL_NOTES, "srun": srun, "sinfo": SINFO_3},
        "-",
        env={"SLURM_JOB_PARTITION": "debug"},
    )
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=60
    )
    out = r.stdout + r.stderr
    calls = (stub_dir / "calls").read_text().splitlines()
    assert r.returncode == 0, out
    assert "training step failed with status 1: checking the nodes again (preflight)" in out, out
    if sick:
        assert calls == [
            "preflight",
            "train",
            "preflight",
            "scontrol requeuehold 77",
            "scontrol update JobId=77 ExcNodeList=n2",
            "scontrol release 77",
        ], out
        assert (
            "leaving n2 behind (its preflight failed after the training step failed with status 1): "
            "the next attempt excludes n2" in out
        ), out
    else:
        assert calls == ["preflight", "train", "preflight", "scontrol requeue 77"], out
        assert "requeueing job 77" in out and "training step failed with status 1 (node failure" in out, out


SRUN_OK = r"""#!/bin/bash
for a in "$@"; do [[ $a == preflight ]] && exit 0; done
echo train >>"$STUB_DIR/calls"
exit 0
"""


def test_every_attempt_runs_in_the_environment_the_run_started_with(tmp_path):
    """paths.pin_code: a new submission records python_env's fingerprint (torch, Python, the architecture,
    every package's version); a requeue finds the same and says so; a requeue that finds another ends in
    one line before anything runs."""
    job, env, stub_dir = prepare(tmp_path, {"scontrol": SCONTROL, "srun": SRUN_OK, "sinfo": SINFO}, "-")

    def attempt(n: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(job)],
            cwd=job.parent,
            env={**env, "SLURM_RESTART_COUNT": str(n)},
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = attempt(0)
    assert r.returncode == 0, r.stderr
    [record] = job.parent.glob("**/code/77.env")
    pinned = record.read_text().strip()
    assert re.fullmatch(r"torch \S+, Python 3\.\d+\.\d+ on \S+, \d+ packages \([0-9a-f]{16}\)", pinned), (
        pinned
    )
    assert f"environment pinned for the run: {pinned}" in r.stderr, r.stderr
    r = attempt(1)
    assert r.returncode == 0 and f"running in the environment the run started with: {pinned}" in r.stderr
    record.write_text("torch 2.1.0, Python 3.11.7 on x86_64, 120 packages (0123456789abcdef)\n")
    r = attempt(2)
    errors = [ln for ln in r.stderr.splitlines() if "ERROR" in ln]
    assert r.returncode == 1 and len(errors) == 1, r.stderr
    assert errors[0].endswith(
        "ERROR: python_env changed since the run started: it was torch 2.1.0, Python 3.11.7 on x86_64, "
        f"120 packages (0123456789abcdef), it is {pinned}; not resuming the run under other versions "
        "(paths.pin_code): restore the environment, or submit anew to go on with these versions"
    ), r.stderr
    assert (stub_dir / "calls").read_text().splitlines() == ["train", "train"]  # nothing ran the third time


def test_a_new_submission_keeps_the_newest_pinned_code_copies_and_removes_the_rest(tmp_path):
    """paths.pin_code_keep (default 3): a new submission that pinned its code removes
    the copies and records of the submissions beyond the newest 3, one line each; its requeues remove
    nothing; a submission's copy is never removed by its own attempts."""
    job, env, stub_dir = prepare(tmp_path, {"scontrol": SCONTROL, "srun": SRUN_OK, "sinfo": SINFO}, "-")

    def submit(job_id: str, restarts: int = 0) -> subprocess.CompletedProcess:
        r = subprocess.run(
            ["bash", str(job)],
            cwd=job.parent,
            env={**env, "SLURM_JOB_ID": job_id, "SLURM_RESTART_COUNT": str(restarts)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        return r

    submit("77")
    (code,) = {p.parent for p in job.parent.glob("**/code/77.pin")}
    # three earlier submissions, older than 77: 10 oldest (one of them had only its environment recorded)
    for age, old in ((300, "10"), (200, "20"), (100, "30")):
        (code / old).mkdir()
        (code / old / "train.py").write_text("old code\n")
        for suffix in (".pin", ".env"):
            (code / f"{old}{suffix}").write_text("x\n")
            os.utime(code / f"{old}{suffix}", (time.time() - age, time.time() - age))
    (code / "10.tmp").mkdir()  # a copy that an earlier submission never finished
    # sbatch-gen's files staged by earlier submissions' renders (other sha256s), least recently used first
    node = code.parent / "node"
    current = sorted(p.name for p in node.iterdir())
    assert [n.split(".")[0] for n in current] == ["sbatch-gen-job", "sbatch-gen-node"]
    for age, sha in ((300, "aaaa"), (200, "bbbb"), (100, "cccc")):
        for name in (f"sbatch-gen-job.{sha}.sh", f"sbatch-gen-node.{sha}.py"):
            (node / name).write_text("old\n")
            os.utime(node / name, (time.time() - age, time.time() - age))
    r = submit("78")
    assert sorted(p.name for p in code.iterdir()) == [
        "30",
        "30.env",
        "30.pin",
        "77",
        "77.env",
        "77.pin",
        "78",
        "78.env",
        "78.pin",
    ], r.stderr
    removed = [ln for ln in r.stderr.splitlines() if "removed the pinned code" in ln]
    assert [ln.split("] ", 1)[1] for ln in removed] == [
        "removed the pinned code of submission 20 (paths.pin_code_keep: the newest 3 are kept)",
        "removed the pinned code of submission 10 (paths.pin_code_keep: the newest 3 are kept)",
    ], r.stderr
    # of each kind this job's and the 2 most recently used others are kept
    assert sorted(p.name for p in node.iterdir()) == sorted(
        [
            *current,
            *(
                f"sbatch-gen-{k}.{sha}.{ext}"
                for sha in ("bbbb", "cccc")
                for k, ext in (("job", "sh"), ("node", "py"))
            ),
        ]
    ), r.stderr
    removed = [ln.split("] ", 1)[1] for ln in r.stderr.splitlines() if "staged by an earlier" in ln]
    assert removed == [
        f"removed sbatch-gen-{k}.aaaa.{ext}, staged by an earlier submission (paths.pin_code_keep: the 3 most "
        "recently used are kept)"
        for k, ext in (("job", "sh"), ("node", "py"))
    ], r.stderr
    # a requeue of 78 (and a continuation) pins nothing anew and removes nothing
    r = submit("78", restarts=1)
    assert "removed the pinned code" not in r.stderr and (code / "30").is_dir(), r.stderr
    r = submit("79")
    assert sorted(p.name for p in code.iterdir() if p.is_dir()) == ["77", "78", "79"], r.stderr


# stub: pip notes its arguments (and `freeze` lists two packages); anything else is this test's interpreter
PYTHON_PIP_NOTES = rf"""#!/bin/bash
if [[ $1 == -m && $2 == pip ]]; then
  echo "pip ${{*:3}}" >>"$STUB_DIR/calls"
  [[ $3 != freeze ]] || printf 'numpy==2.1.0\ntorch==2.13.0+cpu\n'
  exit 0
fi
exec {sys.executable} "$@"
"""


@pytest.mark.slow  # the setup job runs its probe twice with the real python: two imports of torch
def test_the_setup_job_installs_the_shared_lock_and_writes_it_when_there_is_none(tmp_path):
    """python_env.lock_dir: the first set-up of an architecture installs the newest versions allowed and
    writes them to locks/<arch>.txt (for the user to commit); every later one installs exactly those."""
    setup = (REPO / "out" / "local.setup.sbatch").read_text()
    job, env, stub_dir = prepare(tmp_path, {"python": PYTHON_PIP_NOTES, "sinfo": SINFO}, "-", script=setup)
    arch = os.uname().machine
    lock = job.parent / "locks" / f"{arch}.txt"

    def run() -> tuple[str, list[str]]:
        (stub_dir / "calls").unlink(missing_ok=True)
        r = subprocess.run(
            ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stderr, (stub_dir / "calls").read_text().splitlines()

    log, calls = run()
    assert calls == [
        "pip install --upgrade pip",
        "pip install torch",
        "pip install -e .[train,s3]",
        "pip freeze --exclude-editable",
    ], log
    assert lock.read_text() == "numpy==2.1.0\ntorch==2.13.0+cpu\n"
    assert f"wrote locks/{arch}.txt (2 packages): commit it, so that every region of {arch}" in log, log
    log, calls = run()
    assert calls == [
        "pip install --upgrade pip",
        f"pip install -c locks/{arch}.txt torch",
        f"pip install -c locks/{arch}.txt -e .[train,s3]",
    ], log
    assert f"installing the versions of locks/{arch}.txt (python_env.lock_dir)" in log, log


def test_a_stop_before_the_preflight_requeues_without_a_step(tmp_path):
    """The traps are set before anything slow (pin_code's copy of the checkout, the activation): SIGUSR1
    while the code is being pinned (a preemption with preempt_send_user_signal at the job's start) is a stop
    request: no preflight, no training step, one requeue. Before, it killed the batch shell (USR1's default
    action), and the job ended FAILED."""
    git = shutil.which("git")
    # the first git call lasts until the test has sent the signal (30 s at most), the others as long as git
    slow_git = (
        '#!/bin/bash\nif [[ ! -e $STUB_DIR/git-slow ]]; then\n  : >"$STUB_DIR/git-slow"\n'
        "  for ((i = 0; i < 300; i++)); do [[ -e $STUB_DIR/signalled ]] && break; sleep 0.1; done\n"
        f'fi\nexec {git} "$@"\n'
    )
    srun = '#!/bin/bash\necho "srun $*" >>"$STUB_DIR/calls"\nexit 0\n'
    job, env, stub_dir = prepare(
        tmp_path, {"scontrol": SCONTROL_NOTES, "srun": srun, "sinfo": SINFO, "git": slow_git}, "-"
    )
    proc = start_job(job, env)
    deadline = time.monotonic() + 30
    while not (stub_dir / "git-slow").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    (stub_dir / "signalled").touch()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert (stub_dir / "calls").read_text().splitlines() == ["scontrol requeue 77"], out
    assert "requeueing job 77" in out and "stop requested before training started" in out, out
