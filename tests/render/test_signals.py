"""The rendered batch script's signal plan and start-up warnings, run for real under bash with stub
Slurm commands (srun, scontrol, sinfo) first on PATH, as in test_requeue.py.

- SIGTERM creates the stop file; what follows is what Slurm's record of the job says (scontrol): a scancel
  ends the run in one line, Slurm's own requeue is not doubled, the time limit submits a continuation job;
- a trap whose stop file cannot be written logs it and the flow goes on;
- after the preemption signal (USR1) the script waits up to ack_timeout_s for `<stop file>.ack`, says
  so when it never comes, and requeues either way;
- a cluster whose Slurm is not `slurm.version` gets a WARNING line;
- trainer.stop_protocol signal: USR1 goes on to srun (which forwards it to torchrun on the nodes), the
  script waits for the step to end, at most the stop grace, then requeues; it creates no stop file;
- trainer.stop_protocol none: USR1 requeues at once, with the training step still running;
- with either, SIGTERM (scancel, the time limit) is passed on to nobody (Slurm signals the step itself)
  and never requeues."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from .batch_sandbox import prepare, render_local, scontrol_stub, start_job
from .conftest import REPO

pytestmark = pytest.mark.slow  # waits out ack timeouts and stop graces in real time (seconds per test)

SCONTROL = scontrol_stub('echo 1 >"$STUB_DIR/restarts"')

# The preflight passes. The training step (the trainer, as far as the batch script can tell): `finish`
# exits 0; otherwise it waits for the stop file like the trainer, then exits 42 with the .ack written
# before (ack-now), 1.5 s after it exits (ack-late: a slow filesystem) or never (no-ack); without a stop
# file it exits 3 after 30 s, or once the test creates $STUB_DIR/end (as Slurm's TERM ends it). Slurm's record
# changes as the step starts when the test says so: $STUB_DIR/<fields|restarts>.<preflight|training>
# become $STUB_DIR/fields and restarts then (a preemption during that step).
SRUN = r"""#!/bin/bash
phase=training
for a in "$@"; do [[ $a == preflight ]] && phase=preflight; done
for f in fields restarts; do
  [[ ! -e $STUB_DIR/$f.$phase ]] || mv -f -- "$STUB_DIR/$f.$phase" "$STUB_DIR/$f"
done
[[ $phase == training ]] || exit 0
: >"$STUB_DIR/training"
[[ $STUB_MODE == finish ]] && exit 0
for ((i = 0; i < 300; i++)); do [[ -e $SBATCH_GEN_STOP_FILE || -e $STUB_DIR/end ]] && break; sleep 0.1; done
[[ -e $SBATCH_GEN_STOP_FILE ]] || exit 3
case $STUB_MODE in
  ack-now) echo "step 7" >"$SBATCH_GEN_STOP_FILE.ack" ;;
  ack-late) (sleep 1.5; echo "step 7" >"$SBATCH_GEN_STOP_FILE.ack") </dev/null >/dev/null 2>&1 & ;;
esac
exit 42
"""

SINFO = r"""#!/bin/bash
[[ -n ${FAKE_SLURM:-} ]] || exit 1
echo "slurm $FAKE_SLURM"
"""

STOP_FILE = "runs/local/stop/77.attempt-0"


def _start(
    tmp_path: Path, mode: str, *, ack_timeout_s: int | None = None, slurm: str = "22.05.8"
) -> tuple[subprocess.Popen, Path, Path]:
    script = (REPO / "out" / "local.sbatch").read_text()
    if ack_timeout_s is not None:
        line = "ACK_TIMEOUT_S=30  # preemption.ack_timeout_s\n"
        assert line in script
        script = script.replace(line, f"ACK_TIMEOUT_S={ack_timeout_s}  # preemption.ack_timeout_s\n")
    job, env, stub_dir = prepare(
        tmp_path,
        {"scontrol": SCONTROL, "srun": SRUN, "sinfo": SINFO},
        mode,
        script=script,
        env={"FAKE_SLURM": slurm},
    )
    proc = start_job(job, env)
    return proc, job.parent, stub_dir


def _signal_when_training(proc: subprocess.Popen, stub_dir: Path, sig: int) -> None:
    deadline = time.monotonic() + 30
    while not (stub_dir / "training").exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the training step never started"
        time.sleep(0.05)
    time.sleep(0.2)  # the shell is in `wait` by now
    proc.send_signal(sig)


def _finish(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _requeues(stub_dir: Path) -> list[str]:
    calls = stub_dir / "calls"
    return calls.read_text().splitlines() if calls.exists() else []


def test_sigterm_creates_the_stop_file_and_does_not_requeue(tmp_path):
    proc, work, stub_dir = _start(tmp_path, "ack-now")
    _signal_when_training(proc, stub_dir, signal.SIGTERM)
    out = _finish(proc)
    assert (work / STOP_FILE).exists(), out
    assert f"SIGTERM received: asking the trainer to checkpoint and stop ({STOP_FILE})" in out, out
    assert "SIGTERM to the batch shell: the job was cancelled (scancel); not requeueing" in out, out
    assert _requeues(stub_dir) == [], out
    assert "requeueing" not in out.replace("not requeueing", ""), out
    assert proc.returncode == 143, out


@pytest.mark.parametrize("mode", ["ack-now", "ack-late"])
def test_usr1_waits_for_the_ack_then_requeues(tmp_path, mode):
    proc, work, stub_dir = _start(tmp_path, mode, ack_timeout_s=15)
    _signal_when_training(proc, stub_dir, signal.SIGUSR1)
    t0 = time.monotonic()
    out = _finish(proc)
    assert (work / STOP_FILE).exists(), out
    assert "trainer checkpointed: step 7" in out, out
    assert "WARNING" not in out, out
    assert _requeues(stub_dir) == ["requeue 77"], out
    assert "requeued: this attempt is over" in out, out
    assert proc.returncode == 0, out
    assert time.monotonic() - t0 < 10, "waited for the whole ack timeout although the .ack came"


def test_usr1_without_an_ack_warns_after_the_timeout_and_requeues(tmp_path):
    proc, work, stub_dir = _start(tmp_path, "no-ack", ack_timeout_s=2)
    _signal_when_training(proc, stub_dir, signal.SIGUSR1)
    t0 = time.monotonic()
    out = _finish(proc)
    assert time.monotonic() - t0 >= 1.5, out
    assert (
        f"WARNING: no {STOP_FILE}.ack within 2 s; --resume auto uses the last complete checkpoint" in out
    ), out
    assert "trainer checkpointed" not in out, out
    assert _requeues(stub_dir) == ["requeue 77"], out
    assert proc.returncode == 0, out


@pytest.mark.parametrize(
    "running, shown",
    [("22.05.8", None), ("22.05", None), ("23.11.1", "23.11.1"), ("22.050.1", "22.050.1"), ("", "unknown")],
    ids=["same-patch", "same", "other", "prefix-only", "no-sinfo"],
)
def test_slurm_version_warning(tmp_path, running, shown):
    proc, _, _ = _start(tmp_path, "finish", slurm=running)
    out = _finish(proc)
    assert "training finished" in out and proc.returncode == 0, out
    warning = "WARNING: the profile says Slurm 22.05 (slurm.version), this cluster runs "
    if shown is None:
        assert warning not in out, out
    else:
        assert f"{warning}{shown}\n" in out, out


# ---- trainer.stop_protocol signal and none ---------------------------------------------------------------

# `scontrol requeue` also ends the training step, as Slurm does (SIGKILL: the stub srun traps TERM).
SCONTROL_KILLS = scontrol_stub(
    r"""
echo 1 >"$STUB_DIR/restarts"
if [[ -e $STUB_DIR/srun.pid ]]; then kill -KILL "$(cat "$STUB_DIR/srun.pid")" 2>/dev/null || true; fi
"""
)

# The training step as the batch script sees it with a trainer that stops on a signal: srun notes every
# signal it gets (srun.signals) and, by $STUB_MODE: save: on USR1 saves for 1 s (saved), then exits 1
# (torchrun's status after a handled signal); stuck: never ends by itself; ends-soon: exits 3 after 1 s.
# Output to a file: a step the script leaves behind must not hold the test's pipe open.
SRUN_SIGNAL = r"""#!/bin/bash
for a in "$@"; do [[ $a == preflight ]] && exit 0; done
exec >>"$STUB_DIR/srun.out" 2>&1
echo $$ >"$STUB_DIR/srun.pid"
got=''
trap 'got=USR1; echo USR1 >>"$STUB_DIR/srun.signals"' USR1
trap 'echo TERM >>"$STUB_DIR/srun.signals"' TERM
: >"$STUB_DIR/training"
case $STUB_MODE in
  ends-soon) sleep 1; exit 3 ;;
  save)
    for ((i = 0; i < 300; i++)); do [[ -n $got ]] && break; sleep 0.1; done
    [[ -n $got ]] || exit 4
    sleep 1
    : >"$STUB_DIR/saved"
    exit 1 ;;
esac
for ((i = 0; i < 600; i++)); do sleep 0.1; done
exit 5
"""


def _start_protocol(tmp_path: Path, mode: str, *sets: str) -> tuple[subprocess.Popen, Path, Path]:
    job, env, stub_dir = prepare(
        tmp_path,
        {"scontrol": SCONTROL_KILLS, "srun": SRUN_SIGNAL, "sinfo": SINFO},
        mode,
        script=render_local(*sets),
        env={"FAKE_SLURM": "22.05.8"},
    )
    proc = start_job(job, env)
    return proc, job.parent, stub_dir


def _srun_signals(stub_dir: Path) -> list[str]:
    f = stub_dir / "srun.signals"
    return f.read_text().split() if f.exists() else []


def test_signal_protocol_forwards_usr1_to_srun_and_requeues_once_the_step_ended(tmp_path):
    proc, work, stub_dir = _start_protocol(
        tmp_path, "save", "trainer.stop_protocol=signal", "trainer.stop_grace_s=20"
    )
    _signal_when_training(proc, stub_dir, signal.SIGUSR1)
    t0 = time.monotonic()
    out = _finish(proc)
    assert _srun_signals(stub_dir) == ["USR1"], out
    assert (stub_dir / "saved").exists(), out
    assert "SIGUSR1 received (trainer.stop_protocol signal)" in out, out
    assert "SIGUSR1 to torchrun on every node (through srun); waiting up to 20 s" in out, out
    assert "training step exited with status 1" in out, out
    assert _requeues(stub_dir) == ["requeue 77"], out
    assert "requeued: this attempt is over" in out and proc.returncode == 0, out
    assert time.monotonic() - t0 < 10, "waited for the whole grace although the step had ended"
    assert not (work / "runs/local/stop/77.attempt-0").exists(), "no stop file with the signal protocol"
    assert "WARNING" not in out, out


def test_signal_protocol_requeues_after_the_grace_when_the_step_does_not_end(tmp_path):
    proc, _, stub_dir = _start_protocol(
        tmp_path, "stuck", "trainer.stop_protocol=signal", "trainer.stop_grace_s=2"
    )
    _signal_when_training(proc, stub_dir, signal.SIGUSR1)
    t0 = time.monotonic()
    out = _finish(proc)
    waited = time.monotonic() - t0
    assert _srun_signals(stub_dir) == ["USR1"], out
    assert "WARNING: the training step still runs after 2 s; the requeue kills it" in out, out
    assert _requeues(stub_dir) == ["requeue 77"] and proc.returncode == 0, out
    assert 1.5 <= waited < 10, f"waited {waited:.1f} s for a grace of 2 s"


def test_none_protocol_requeues_at_once_and_signals_nothing(tmp_path):
    proc, work, stub_dir = _start_protocol(tmp_path, "stuck", "trainer.stop_protocol=none")
    _signal_when_training(proc, stub_dir, signal.SIGUSR1)
    t0 = time.monotonic()
    out = _finish(proc)
    assert time.monotonic() - t0 < 5, out
    assert "SIGUSR1 received (trainer.stop_protocol none)" in out, out
    assert "SIGUSR1: no graceful stop (trainer.stop_protocol none)" in out, out
    assert _requeues(stub_dir) == ["requeue 77"] and proc.returncode == 0, out
    assert _srun_signals(stub_dir) == [], "the training step is not told: the requeue ends it"
    assert not (work / "runs/local/stop/77.attempt-0").exists(), out
    assert "training step exited" not in out, out


@pytest.mark.parametrize("protocol", ["signal", "none"])
def test_sigterm_is_passed_on_to_nobody_and_never_requeues(tmp_path, protocol):
    proc, work, stub_dir = _start_protocol(tmp_path, "ends-soon", f"trainer.stop_protocol={protocol}")
    _signal_when_training(proc, stub_dir, signal.SIGTERM)
    out = _finish(proc)
    assert f"SIGTERM received (trainer.stop_protocol {protocol})" in out, out
    assert "the job was cancelled (scancel); not requeueing" in out, out
    assert _srun_signals(stub_dir) == [] and _requeues(stub_dir) == [], out
    assert not (work / "runs/local/stop/77.attempt-0").exists(), out
    assert proc.returncode == 143, out


SBATCH = r"""#!/bin/bash
printf '%s\n' "$*" >"$STUB_DIR/sbatch.args"
printf '%s\n' "${SBATCH_GEN_CONTINUES-unset} ${SBATCH_GEN_RUN_JOB-unset} ${SLURM_JOB_ID-unset}" >"$STUB_DIR/sbatch.env"
echo 78
"""


def _start_with(tmp_path: Path, mode: str, fields: str | None, restarts_on_signal: bool = False):
    job, env, stub_dir = prepare(
        tmp_path,
        {"scontrol": SCONTROL, "srun": SRUN, "sinfo": SINFO, "sbatch": SBATCH},
        mode,
        env={"FAKE_SLURM": "22.05.8"},
    )
    if fields is not None:
        (stub_dir / "fields").write_text(fields)
    return start_job(job, env), job.parent, stub_dir


def test_sigterm_at_the_time_limit_submits_a_continuation_and_does_not_requeue(tmp_path):
    """Slurm never requeues a TIMEOUT: the stop that the limit cut short is continued by a new job that
    starts once this one has ended, with this job's script (kept in the run dir) and limits."""
    proc, work, stub_dir = _start_with(
        tmp_path,
        "no-ack",
        "Partition=debug Account=lab QOS=normal TimeLimit=00:01:00 ExcNodeList=(null) Reason=TimeLimit",
    )
    _signal_when_training(proc, stub_dir, signal.SIGTERM)
    out = _finish(proc)
    assert _requeues(stub_dir) == [], out
    args = (stub_dir / "sbatch.args").read_text().split()
    assert args == [
        "--parsable",
        "--job-name=sbatch-gen-local",
        "--dependency=afterany:77",
        "--partition=debug",
        "--account=lab",
        "--qos=normal",
        "--time=00:01:00",
        "runs/local/stop/77.sbatch",
    ], args
    # the continuation knows which attempt and which run (submission) it continues; this job's own Slurm
    # variables are not passed on
    assert (stub_dir / "sbatch.env").read_text().split() == ["77.attempt-0", "77", "unset"]
    assert (work / "runs/local/stop/77.sbatch").read_text() == (work / "job.sbatch").read_text()
    assert (
        "the time limit ended this job (Slurm does not requeue a TIMEOUT): continuation job 78 submitted"
        in out
    )
    assert proc.returncode == 143, out


def test_sigterm_of_slurms_own_requeue_is_not_requeued_again(tmp_path):
    """An administrator's `scontrol requeue` (or a preemption without GraceTime): Restarts has grown by the
    time the shell looks; it says so and leaves the requeue to Slurm."""
    proc, work, stub_dir = _start_with(tmp_path, "ack-now", None)
    (stub_dir / "restarts.training").write_text("1\n")
    _signal_when_training(proc, stub_dir, signal.SIGTERM)
    out = _finish(proc)
    assert "SIGTERM to the batch shell: Slurm requeues this job itself; this attempt is over" in out, out
    assert _requeues(stub_dir) == [] and not (stub_dir / "sbatch.args").exists(), out


def test_a_stop_that_reached_only_the_step_is_a_preemption_even_when_the_trainer_exits_0(tmp_path):
    """A preemption with GraceTime signals the job steps only; a trainer of one's own saves on its SIGTERM
    and exits 0 without an .ack. Slurm's record says PreemptTime: requeued, not taken for finished."""
    proc, work, stub_dir = _start_with(tmp_path, "finish", None)
    (stub_dir / "fields.training").write_text("PreemptTime=2026-12-06T04:45:09 Reason=None")
    out = _finish(proc)
    assert "training finished" not in out, out
    assert "exited with status 0 after a stop reached the training step" in out, out
    assert _requeues(stub_dir) == ["requeue 77"] and proc.returncode == 0, out


@pytest.mark.parametrize("when", ["start", "preflight"])
@pytest.mark.parametrize(
    "record, said, requeues",
    [
        ("fields", "preempted before training started", ["requeue 77"]),
        ("restarts", "requeued before training started (Slurm's record of the job", []),
    ],
)
def test_slurm_ending_the_job_before_training_starts_no_training_step(tmp_path, when, record, said, requeues):
    """A preemption with GraceTime signals the job steps only: one that comes while no step runs (as the job
    starts, or during the preflight when it has passed) reaches nobody, and a training step started later
    would never hear of it. The shell reads Slurm's record before the training step: PreemptTime set, it
    requeues without starting it; Restarts grown (Slurm's own requeue), it leaves the requeue to Slurm."""
    proc, work, stub_dir = _start_with(tmp_path, "finish", None)
    value = "PreemptTime=2026-12-06T04:45:09 Reason=None\n" if record == "fields" else "1\n"
    (stub_dir / (record if when == "start" else f"{record}.preflight")).write_text(value)
    out = _finish(proc)
    assert said in out, out
    assert not (stub_dir / "training").exists() and _requeues(stub_dir) == requeues, out
    assert ("preflight ok" in out or "preflight on" in out) == (when == "preflight"), out
    assert "ERROR" not in out and proc.returncode == 0, out


def test_a_preemption_before_training_does_not_use_up_the_budget(tmp_path):
    """The count of requeues in a row without progress stops crash loops: an attempt that Slurm preempted
    (PreemptTime) before it trained a step leaves it where it was, even at its bound; it is requeued."""
    job, env, stub_dir = prepare(
        tmp_path,
        {"scontrol": SCONTROL, "srun": SRUN, "sinfo": SINFO, "sbatch": SBATCH},
        "finish",
        env={"FAKE_SLURM": "22.05.8"},
    )
    count = job.parent / "runs" / "local" / "stop" / "77.requeues-without-progress"
    count.parent.mkdir(parents=True, exist_ok=True)
    count.write_text("2\n")  # the local profile's preemption.max_requeues_without_progress
    (stub_dir / "fields").write_text("PreemptTime=2026-12-06T04:45:09 Reason=None\n")
    env["SLURM_RESTART_COUNT"] = "2"  # a requeued attempt: a new submission starts its count at 0
    proc = start_job(job, env)
    out = _finish(proc)
    assert "preempted before training started" in out, out
    assert "requeues in a row without progress: 2 of at most 2" in out, out
    assert _requeues(stub_dir) == ["requeue 77"] and proc.returncode == 0, out
    assert count.read_text() == "2\n"


def test_a_trap_that_cannot_write_the_stop_file_does_not_end_the_shell(tmp_path):
    """The stop directory is gone when USR1 comes: the trap logs it, and the flow goes on to the requeue."""
    proc, work, stub_dir = _start(tmp_path, "no-ack", ack_timeout_s=1)
    deadline = time.monotonic() + 30
    while not (stub_dir / "training").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    time.sleep(0.2)
    (work / "runs/local/stop").rename(work / "runs/local/stop-gone")
    proc.send_signal(signal.SIGUSR1)
    lines = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # until the shell exits: the step ends on its own at the latest 30 s in
            lines.append(line)
            if f"WARNING: cannot write {STOP_FILE}" in line:
                (stub_dir / "end").touch()  # the trap has run: the step ends without a stop file, as before
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines)
    assert f"WARNING: cannot write {STOP_FILE}" in out, out
    assert _requeues(stub_dir) == ["requeue 77"] and proc.returncode == 0, out


# The preflight runs until it is killed (a slow health check on every node); the training step never runs.
SRUN_SLOW_PREFLIGHT = r"""#!/bin/bash
for a in "$@"; do
  if [[ $a == preflight ]]; then
    : >"$STUB_DIR/preflight"
    for ((i = 0; i < 300; i++)); do sleep 0.1; done
    exit 0
  fi
done
: >"$STUB_DIR/training"
exit 0
"""


@pytest.mark.parametrize(
    "how, restarts, said, requeues, rc",
    [
        # preempt_send_user_signal: the preemption signal reaches the batch shell
        (
            "usr1",
            0,
            "requeueing job 77 (requeues in a row without progress: 1 of at most 2): stopped during "
            "the preflight",
            ["requeue 77"],
            0,
        ),
        # a preemption without GraceTime (SUNK), an administrator's requeue: Slurm requeues the job itself
        ("term", 1, "SIGTERM to the batch shell: Slurm requeues this job itself", [], 143),
        # a scancel
        ("term", 0, "the job was cancelled (scancel); not requeueing", [], 143),
    ],
)
def test_a_stop_during_the_preflight_is_a_stop_not_a_failed_node(tmp_path, how, restarts, said, requeues, rc):
    job, env, stub_dir = prepare(
        tmp_path, {"scontrol": SCONTROL, "srun": SRUN_SLOW_PREFLIGHT, "sinfo": SINFO}, "-"
    )
    proc = start_job(job, env)
    deadline = time.monotonic() + 30
    while not (stub_dir / "preflight").exists():
        assert proc.poll() is None and time.monotonic() < deadline, _finish(proc)
        time.sleep(0.05)
    time.sleep(0.2)  # the shell is in `wait`
    (stub_dir / "restarts").write_text(f"{restarts}\n")
    proc.send_signal(signal.SIGUSR1 if how == "usr1" else signal.SIGTERM)
    out = _finish(proc)
    assert said in out, out
    assert "preflight FAILED" not in out and "ERROR" not in out, out
    assert not (stub_dir / "training").exists(), out
    assert _requeues(stub_dir) == requeues and proc.returncode == rc, out


def test_a_signal_before_the_traps_are_set_is_kept_and_requeues(tmp_path):
    """USR1 while main still stages its pinned files (before the job library, with the traps' handler, is
    sourced): kept, handed on once the traps are set, and the job requeues before any step; its default
    action would have ended the shell."""
    early = (
        "#!/bin/bash\n"
        "# the first `scontrol -o show job` is the staging's: USR1 to the batch shell (its command\n"
        "# substitution's parent) right then\n"
        'if [[ "$1 $2 $3" == "-o show job" && ! -e "$STUB_DIR/signalled" ]]; then\n'
        '  : >"$STUB_DIR/signalled"\n'
        '  kill -USR1 "$(ps -o ppid= -p "$PPID" | tr -d " ")"\n'
        "  sleep 0.2\n"
        "fi\n"
    ) + SCONTROL.split("\n", 1)[1]
    job, env, stub_dir = prepare(
        tmp_path, {"scontrol": early, "srun": SRUN, "sinfo": SINFO}, "ack-now", env={"FAKE_SLURM": "22.05.8"}
    )
    out = _finish(start_job(job, env))
    assert (stub_dir / "signalled").exists()
    assert "SIGUSR1 received: asking the trainer to checkpoint and stop" in out, out
    assert "stop requested before training started" in out, out
    assert _requeues(stub_dir) == ["requeue 77"] and not (stub_dir / "training").exists(), out
