"""Every way a job ends, in the phases the other end-to-end tests do not reach, on the real local Slurm
(scripts/local-slurm.sh; partition debug: GraceTime 120 s, KillWait 5 s):

- a preemption (GraceTime) before the preflight, while the batch shell activates the environment: Slurm
  signals the job steps only, and none runs; the shell reads Slurm's record before it starts one: no step
  in that attempt; then a SIGTERM while it runs `scontrol requeue`: not a failure, requeued once, every
  step trained once (the preemption during the preflight: test_preemption.py);
- a user's scancel while training: CANCELLED, one line, no requeue;
- before and during the preflight, each of a user's scancel, `scontrol requeue`, a SUNK preemption (no
  GraceTime) and a preemption with preempt_send_user_signal (one parametrized test: each says its line while the slow program still runs);
- a run of 2 stops (the time-limit signal, sent exactly with `scancel --signal=USR1 --batch`) with a budget
  of 1 requeue without progress: every attempt checkpointed, so the run completes;
- a stop checkpoint slower than what is left before the time limit: the job ends TIMEOUT, which Slurm never
  requeues; its continuation job resumes from the newest complete checkpoint, naming the redone steps;
- a node whose preflight fails (preflight.health_check, a marker the test controls): the next attempt
  excludes it and names it; with too few nodes left the job stops in one line;
- a node that breaks during the training step: checked again after the failed step, left behind;
- a node lost for real (slurmd killed, node DOWN: NODE_FAIL), the batch script's own: Slurm requeues the job
  elsewhere, the old attempt stops once the new one holds the run dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from e2e_lib import (
    E2E_EXPORTS,
    REPO,
    SHORT_STEPS,
    TERMINAL,
    WITH_FAULTS,
    LocalJob,
    cluster_set,
    git_checkout,
    local_job,
    preempt,
    report,
    trainer_workers,
)

from sbatch_gen.proc import pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _steps(job: LocalJob) -> Counter:
    return Counter(r["step"] for r in job.metrics() if "loss" in r and "step" in r)


def _logs(job: LocalJob, *job_ids: int) -> dict[str, str]:
    out = {}
    for j in job_ids or (job.job_id,):
        p = job.log_dir / f"{job.name}-{j}.out"
        out[p.name] = p.read_text(errors="replace") if p.exists() else ""
        for q in sorted(job.log_dir.glob(f"{job.name}-{j}.attempt-*.log")):
            out[q.name] = q.read_text(errors="replace")
    return out


def _assert_no_traceback(job: LocalJob, *job_ids: int) -> None:
    for name, text in _logs(job, *job_ids).items():
        assert "Traceback" not in text, f"{name}:\n{text[-4000:]}"


# A witness in the job's process tree while `scontrol requeue` runs: it takes SIGTERM (which the batch shell and
# its children ignore from the requeue on), writes "TERM" to the file argv[1] and exits; after 60 s without it,
# it exits too (the test then fails on the missing file). It says it waits by creating the file argv[2].
_WITNESS = (
    "import signal, sys, time\n"
    "def took(*_):\n"
    "    open(sys.argv[1], 'w').write('TERM')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, took)\n"
    "open(sys.argv[2], 'w').close()\n"
    "time.sleep(60)\n"
)


def _slow_module_load(root: Path, inside: Path, hold: Path) -> tuple[dict, dict]:
    """A `module load` that takes a while, as on a loaded shared filesystem, with the real Lmod (make
    system-deps): a modulefile that creates ``inside``, then waits for ``hold`` to go. The profile's settings
    and the environment to submit with (MODULEPATH, which the job takes through slurm.export). The batch shell
    runs Lmod's program in the background and waits for it, so a signal to the batch shell is trapped at once."""
    mods = root / "modules"
    (mods / "slow-site-module").mkdir(parents=True, exist_ok=True)
    (mods / "slow-site-module" / "1.0.lua").write_text(
        'setenv("SLOW_SITE_MODULE", "loaded")\n'
        f'os.execute("touch {inside}; while [ -e {hold} ]; do sleep 0.2; done")\n'
    )
    sets = {"python_env.modules": ["slow-site-module"], "slurm.export": [*E2E_EXPORTS, "MODULEPATH"]}
    return sets, {"MODULEPATH": str(mods)}


def test_a_preemption_before_the_preflight_and_a_sigterm_during_its_requeue(
    cluster, e2e_root, train_config, data_dir
):
    """Two phases no step runs in, in one job.

    A preemption with GraceTime while the batch shell activates the environment (a `module load` that takes
    a while, as on a loaded shared filesystem: the test's own `module`, a program first on the job's PATH, waits
    for a marker): Slurm signals the job steps, and there are none yet. The batch shell reads Slurm's record
    before it starts one: no preflight, no training in this attempt; it requeues.

    While it runs `scontrol requeue` (a slow slurmctld: the test's scontrol on the job's PATH holds the
    first requeue until a witness process beside it has taken the signal, then runs the real one), a
    SIGTERM to the batch shell and its children (`scancel --signal=TERM --full`): the requeue takes once and
    nothing says it failed. The next attempt trains every step once."""
    root = e2e_root / "preempt-early"
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    inside, hold = root / "in-module-load", root / "hold"
    waiting, took = root / "witness-waits", root / "witness-took"
    hold.touch()
    real = shutil.which("scontrol", path=cluster.env["PATH"])
    assert real, cluster.env["PATH"]
    (root / "witness.py").write_text(_WITNESS)
    wrapper = bin_dir / "scontrol"
    wrapper.write_text(
        "#!/bin/bash\n"
        f"if [[ $1 == requeue && ! -e {took} ]]; then\n"
        f"  {REPO / '.venv' / 'bin' / 'python'} {root / 'witness.py'} {took} {waiting}\n"
        "fi\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    sets, module_env = _slow_module_load(root, inside, hold)
    job = local_job(
        cluster,
        root,
        "pearly",
        {**sets, "trainer.max_steps": SHORT_STEPS},
        config=train_config,
        data=data_dir,
    )
    job.submit({"PATH": f"{bin_dir}:{cluster.env['PATH']}", **module_env})
    deadline = time.monotonic() + 120
    while not inside.exists():
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.2)
    preempt(cluster)
    deadline = time.monotonic() + 60
    while not cluster.job(job.job_id).get("PreemptTime", "None")[:1].isdigit():
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.2)
    hold.unlink()
    deadline = time.monotonic() + 60
    while not waiting.exists():
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.1)
    assert cluster.job(job.job_id)["JobState"] == "RUNNING", job.describe()
    cluster.run("scancel", "--signal=TERM", "--full", str(job.job_id))
    info = cluster.wait_done(job.job_id, timeout=300)
    assert took.read_text() == "TERM", "the SIGTERM did not reach the job while it requeued"
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    log = job.batch_log()
    first = log[: log.index(f"job {job.job_id}, attempt 1")]
    assert "preflight on" not in first and "training;" not in first, first
    assert "preempted before training started" in first and "requeued: this attempt is over" in first, first
    assert "requeue failed" not in log and "ERROR" not in log and "cancelled" not in log, log
    assert log.count("requeueing job") == 1, log
    counts = _steps(job)
    assert sorted(counts) == list(range(1, SHORT_STEPS + 1)) and set(counts.values()) == {1}, counts
    _assert_no_traceback(job)


def test_a_users_scancel_ends_the_run_in_one_line(cluster, e2e_root, train_config, data_dir):
    job = local_job(cluster, e2e_root / "scancel", "scancel", WITH_FAULTS, config=train_config, data=data_dir)
    job.submit({"SBATCH_GEN_TEST_STEP_SLEEP_S": "0.3"})
    job.wait_step(6)
    cluster.run("scancel", str(job.job_id))
    info = cluster.wait_done(job.job_id, timeout=120)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", job.describe()
    log = job.batch_log()
    said = "SIGTERM to the batch shell: the job was cancelled (scancel); not requeueing"
    assert log.count(said) == 1, log
    assert "requeueing job" not in log and "ERROR" not in log, log
    _assert_no_traceback(job)


# Every way a job ends, while the job cannot train yet: what the batch log says (once), how Slurm's record ends,
# its Restarts (at most one requeue per stop). usr1: a preemption (GraceTime) with preempt_send_user_signal, the
# profile's USR1 to the batch shell: the script requeues; sunk: a preemption without GraceTime (partition sunk),
# TERM to everything: Slurm requeues; requeue: an administrator's `scontrol requeue`, the same; scancel: ended.
_EARLY_ENDINGS = {
    "scancel": (
        "CANCELLED",
        "0",
        "SIGTERM to the batch shell: the job was cancelled (scancel); not requeueing",
    ),
    "requeue": (
        "COMPLETED",
        "1",
        "SIGTERM to the batch shell: Slurm requeues this job itself; this attempt is over",
    ),
    "sunk": (
        "COMPLETED",
        "1",
        "SIGTERM to the batch shell: Slurm requeues this job itself; this attempt is over",
    ),
    "usr1": ("COMPLETED", "1", "SIGUSR1 received: asking the trainer to checkpoint and stop"),
}


# Why the batch shell runs the slow programs before the preflight in the background (run_waited): while it
# waits for a program in the foreground (Lmod's under `module load`, pin_code's copy, pin_env's python), its TERM
# trap waits too (bash runs traps only between commands), and Slurm's TERM does not reach that program. Measured
# here before the change: a user's scancel ended the job with no line at all; `scontrol requeue` or a SUNK
# preemption said its line only if the program returned before KillWait (5 s). Minimal sbatch scripts with
# `trap ... TERM`, scancelled: a foreground `bash -c 'trap "echo child got TERM" TERM; while :; do sleep 0.2;
# done'` -> ExitCode 0:9, neither trap ran; the same program started with `&` and `wait`ed -> the trap ran 7 ms
# after the scancel, 0:0.


@pytest.mark.parametrize("way", list(_EARLY_ENDINGS))
@pytest.mark.parametrize("phase", ["before", "during"])
def test_every_way_a_job_ends_before_and_during_the_preflight(
    cluster, e2e_root, train_config, data_dir, phase, way
):
    """The job held before the preflight (a slow `module load` while the batch shell activates the
    environment: Lmod and a slow modulefile) or during it (a slow preflight.health_check on both nodes),
    until the way it ends has reached the batch shell: a user's scancel ends it in one line, no requeue, no
    step; any other way requeues it exactly once (the script for USR1, Slurm itself for a TERM it sends
    before requeueing), never as a failed preflight, and the next attempt trains every step once."""
    root = e2e_root / f"early-{phase}-{way}"
    root.mkdir(parents=True)
    hold = root / "hold"
    hold.touch()
    sets: dict = {"trainer.max_steps": SHORT_STEPS}
    env: dict = {}
    if phase == "before":
        held = [root / "in-module-load"]
        more, env = _slow_module_load(root, held[0], hold)
        sets.update(more)
    else:
        held = [root / "in-preflight.0", root / "in-preflight.1"]
        sets["preflight.health_check"] = (
            f'touch {root}/in-preflight."$SLURM_NODEID"; while [ -e {hold} ]; do sleep 0.2; done'
        )
    if way == "sunk":
        sets["slurm.partition"] = cluster.info["SBATCH_GEN_SLURM_SUNK_PARTITION"]
    state, restarts, said = _EARLY_ENDINGS[way]
    job = local_job(cluster, root, f"e{phase[0]}{way}", sets, config=train_config, data=data_dir)
    with (
        cluster_set(cluster, "preempt-signal", "on", back="off")
        if way == "usr1"
        else contextlib.nullcontext()
    ):
        t0 = time.monotonic()
        job.submit(env)
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in held):
            assert time.monotonic() < deadline, job.describe()
            time.sleep(0.2)
        if way == "scancel":
            cluster.run("scancel", str(job.job_id))
        elif way == "requeue":
            cluster.run("scontrol", "requeue", str(job.job_id))
        else:
            preempt(cluster)
        deadline = time.monotonic() + 60
        while said not in job.batch_log():  # the batch shell has heard of it while the program still holds
            assert time.monotonic() < deadline, job.describe()
            time.sleep(0.1)
        hold.unlink(missing_ok=True)
        info = cluster.wait_done(job.job_id, timeout=300)
    report(
        f"{phase} the preflight, {way}: job {job.job_id} {info['JobState']} in {time.monotonic() - t0:.0f} s"
    )
    assert info["JobState"] == state and info["Restarts"] == restarts, job.describe()
    log = job.batch_log()
    nxt = log.find(f"job {job.job_id}, attempt 1")
    first = log[: nxt if nxt >= 0 else len(log)]
    assert ("preflight on" in first) == (phase == "during") and "training;" not in first, first
    assert "preflight failed" not in log.lower() and "ERROR" not in log, log
    if way == "usr1":
        why = (
            "stop requested before training started" if phase == "before" else "stopped during the preflight"
        )
        assert f"): {why}" in first and log.count("requeueing job") == 1, log
    else:
        assert "requeueing job" not in log, log
    counts = _steps(job)
    if state == "CANCELLED":
        assert not counts and nxt < 0, (counts, log)
    else:
        assert sorted(counts) == list(range(1, SHORT_STEPS + 1)) and set(counts.values()) == {1}, counts
        assert "training finished" in log[nxt:], log
    _assert_no_traceback(job)
    assert log.count(said) == 1 and said in first, log
    if phase == "before":  # said while `module load` held: before the attempt's line, if that came at all
        at = first.find(f"job {job.job_id}, attempt 0")
        assert at < 0 or first.index(said) < at, first
    else:
        assert first.index(said) > first.index("preflight on"), first
    assert ("cancelled" in log) == (way == "scancel"), log


def test_many_stops_that_checkpointed_never_use_up_the_budget(cluster, e2e_root, train_config, data_dir):
    """2 time-limit stops (USR1 to the batch shell, as `--signal=B:USR1@...` sends it) with a budget of 1
    requeue without progress: each attempt saved a stop checkpoint, so the run completes (were a stop counted
    as no progress, the second would exceed the budget)."""
    job = local_job(
        cluster,
        e2e_root / "slices",
        "slices",
        {"preemption.max_requeues_without_progress": 1, **WITH_FAULTS},
        config=train_config,
        data=data_dir,
    )
    # paced while the stops land; the last attempt, which only has to finish, trains at its own pace
    pace = e2e_root / "slices-pace"
    pace.touch()
    job.submit({"SBATCH_GEN_TEST_STEP_SLEEP_S": "0.2", "SBATCH_GEN_TEST_STEP_SLEEP_WHILE": str(pace)})
    for attempt in range(2):
        cluster.wait_state(job.job_id, {"RUNNING"}, timeout=120)
        assert cluster.job(job.job_id)["Restarts"] == str(attempt), job.describe()
        job.wait_step(job.last_step() + 3)
        cluster.run("scancel", "--signal=USR1", "--batch", str(job.job_id))
        deadline = time.monotonic() + 120
        while cluster.job(job.job_id)["Restarts"] == str(attempt):
            assert time.monotonic() < deadline, job.describe()
            time.sleep(0.3)
    pace.unlink()  # both stops done: attempt 1 is over, attempt 2 has not started
    info = cluster.wait_done(job.job_id, timeout=300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", job.describe()
    log = job.batch_log()
    assert log.count("requeues in a row without progress: 0 of at most 1): stop requested by SIGUSR1") == 2, (
        log
    )
    counts = _steps(job)
    assert sorted(counts) == list(range(1, 41)) and set(counts.values()) == {1}, counts
    _assert_no_traceback(job)


def test_a_stop_that_overruns_the_time_limit_is_continued_by_a_new_job(
    cluster, e2e_root, train_config, data_dir
):
    """slurm.time 1 minute, lead_time_s 30: USR1 comes at most 30 s before the limit and the stop checkpoint
    takes 300 s. The limit ends the job (TIMEOUT); the batch shell has submitted a continuation job
    (afterany), which resumes from the newest periodic checkpoint and names the steps it redoes.
    The trainer waits at a step boundary (SBATCH_GEN_TEST_STEP_GATE) until USR1 has come, whenever Slurm
    sends it (or the test, where Slurm's is late); the continuation finds the gate gone and trains on at its
    pace."""
    root = e2e_root / "overrun"
    job = local_job(
        cluster,
        root,
        "overrun",
        {
            "slurm.time": "00:01:00",
            "preemption.lead_time_s": 30,
            "preemption.checkpoint_s": 20,
            "preemption.margin_s": 5,
            **WITH_FAULTS,
        },
        config=train_config,
        data=data_dir,
    )
    gate, pace = root / "gate", root / "pace"
    pace.touch()  # removed once job 1 has ended: the continuation trains at its own pace
    env = {
        "SBATCH_GEN_TEST_STOP_SAVE_HOLD_S": "300",
        "SBATCH_GEN_TEST_STEP_SLEEP_S": "0.3",
        "SBATCH_GEN_TEST_STEP_SLEEP_WHILE": str(pace),
    }
    first = job.submit({**env, "SBATCH_GEN_TEST_STEP_GATE": str(gate)})
    # Slurm sends USR1 at its first limit check (every 30 s) with lead_time_s + 30 s or less left: 0-30 s
    # in. The gate closes past the periodic checkpoint of step 5 (34 steps, 10 s at least, before the end),
    # or when USR1 came first (then the stop redoes every step it trained). On a loaded machine slurmctld's
    # check can come late (CI: no USR1 in the job's 60 s): the test then sends it as Slurm would, to the
    # batch shell only; Slurm's own, if it comes later, is a second request for the same stop
    cluster.wait_state(first, {"RUNNING"}, timeout=120)
    deadline = time.monotonic() + 180

    def wait(until):
        while not until():
            assert time.monotonic() < deadline and cluster.job(first)["JobState"] not in TERMINAL, (
                job.describe()
            )
            time.sleep(0.1)

    wait(lambda: job.last_step() >= 6 or "SIGUSR1 received" in job.batch_log())
    gate.touch()
    if "SIGUSR1 received" not in job.batch_log():
        cluster.run("scancel", "--signal=USR1", "--batch", str(first))
    wait(lambda: "SIGUSR1 received" in job.batch_log())
    gate.unlink()  # the stop: its checkpoint is held past the limit
    info = cluster.wait_done(first, timeout=240)
    assert info["JobState"] == "TIMEOUT", job.describe()
    pace.unlink()  # (not before: a USR1 before training started requeues job 1, whose next attempt is paced)
    log = job.batch_log()
    m = re.search(r"continuation job (\d+) submitted", log)
    assert m, log
    second = int(m.group(1))
    cluster.submitted.add(second)
    # the continuation inherits the 1-minute limit: give it room (it is held by its dependency until now)
    cluster.run("scontrol", "update", f"JobId={second}", "TimeLimit=10")
    info2 = cluster.wait_done(second, timeout=300)
    job.job_id = second
    assert info2["JobState"] == "COMPLETED", job.describe()
    log2 = job.batch_log()
    assert f"(continues job {first})" in log2, log2
    redone = re.search(
        rf"WARNING: {first}\.attempt-0 was ended before its stop checkpoint completed: .*redoes steps (\d+)-(\d+)",
        log2,
    )
    assert redone, log2
    counts = _steps(job)
    assert sorted(counts) == list(range(1, 41)), counts
    again = {s for s, n in counts.items() if n > 1}
    assert again == set(range(int(redone.group(1)), int(redone.group(2)) + 1)), (again, redone.group(0))
    _assert_no_traceback(job, first, second)


def _bad_first_node_check(root: Path) -> str:
    """A health check that fails on the first node that runs it, and on that one only, from then on."""
    first = root / "first-node"
    return (
        f'[ -e {first} ] || echo "$SLURMD_NODENAME" >{first}; '
        f'[ "$(cat {first})" != "$SLURMD_NODENAME" ] || {{ echo "GPU 3 fell off the bus (test marker)"; exit 1; }}'
    )


def test_a_node_that_fails_its_preflight_is_left_behind(cluster, e2e_root, train_config, data_dir):
    root = e2e_root / "bad-node"
    job = local_job(
        cluster,
        root,
        "badnode",
        {
            "slurm.nodes": 1,
            "preflight.health_check": _bad_first_node_check(root),
            "trainer.max_steps": SHORT_STEPS,
        },
        config=train_config,
        data=data_dir,
    )
    job.submit()
    info = cluster.wait_done(job.job_id, timeout=300)
    bad = (root / "first-node").read_text().strip()
    good = (set(cluster.nodes) - {bad}).pop()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    assert info["NodeList"] == good and info["ExcNodeList"] == bad, info
    log = job.batch_log()
    assert f"preflight FAILED on {bad}: health check failed: GPU 3 fell off the bus (test marker)" in log, log
    assert f"leaving {bad} behind (its preflight failed): the next attempt excludes {bad}" in log, log
    assert sorted(_steps(job)) == list(range(1, SHORT_STEPS + 1))
    _assert_no_traceback(job)


def test_a_node_that_breaks_during_the_step_is_left_behind(cluster, e2e_root, train_config, data_dir):
    """The step fails on a node that broke (its workers killed; its health check fails from then on, a
    marker the test controls): the nodes are checked again, and the next attempt runs without it."""
    root = e2e_root / "broke"
    sick = root / "sick"
    check = f'test ! -e {sick}.$SLURMD_NODENAME || {{ echo "GPU 3 fell off the bus (test marker)"; exit 1; }}'
    job = local_job(
        cluster,
        root,
        "broke",
        {"slurm.nodes": 1, "preflight.health_check": check},
        config=train_config,
        data=data_dir,
    )
    job.submit()
    job.wait_step(7)  # past the checkpoint at step 5
    node = cluster.job(job.job_id)["NodeList"]
    Path(f"{sick}.{node}").touch()
    victims = trainer_workers(cluster, node)
    assert victims, job.describe()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    info = cluster.wait_done(job.job_id, timeout=300)
    other = (set(cluster.nodes) - {node}).pop()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    assert info["NodeList"] == other and info["ExcNodeList"] == node, info
    log = job.batch_log()
    assert "training step failed with status 1: checking the nodes again (preflight)" in log, log
    assert f"preflight FAILED on {node}: health check failed: GPU 3 fell off the bus (test marker)" in log, (
        log
    )
    assert (
        f"leaving {node} behind (its preflight failed after the training step failed with status 1): "
        f"the next attempt excludes {node}" in log
    ), log
    assert sorted(_steps(job)) == list(range(1, 41))


def test_a_node_lost_for_real_the_batch_node_included(cluster, e2e_root, train_config, data_dir):
    """NODE_FAIL: the node that runs the batch script and the trainer loses its slurmd and is set DOWN, while
    its processes run on (a node cut off from the controller). Slurm requeues the job onto the other node;
    the requeued attempt takes the run dir over and the old one stops at once (its lease was taken over),
    the old batch shell sees the requeue and neither checks nor requeues; the run completes. Once the node
    is back, nothing of the job is left on it."""
    job = local_job(
        cluster,
        e2e_root / "lost",
        "lost",
        {"slurm.nodes": 1, **WITH_FAULTS},
        config=train_config,
        data=data_dir,
    )
    job.submit({"SBATCH_GEN_TEST_STEP_SLEEP_S": "0.3", "SBATCH_GEN_TEST_LEASE_PERIOD_S": "1"})
    job.wait_step(7)  # past the checkpoint at step 5
    lost = cluster.job(job.job_id)["NodeList"]
    other = (set(cluster.nodes) - {lost}).pop()
    # the old attempt's workers make no progress until the new attempt holds the run dir (a node cut off
    # for a while), so that they cannot finish the run first however long the requeue takes
    zombies = trainer_workers(cluster, lost)
    assert zombies, job.describe()
    lease = job.run_dir / "lease.json"
    for pid in zombies:
        os.kill(pid, signal.SIGSTOP)
    old_token = json.loads(lease.read_text())["token"]
    try:
        r = cluster.script("node-fail", lost)
        assert r.returncode == 0, r.stdout + r.stderr
        deadline = time.monotonic() + 180
        while not lease.exists() or json.loads(lease.read_text() or "{}").get("token") == old_token:
            assert time.monotonic() < deadline, job.describe()
            time.sleep(0.2)
        for pid in zombies:
            os.kill(pid, signal.SIGCONT)
        info = cluster.wait_done(job.job_id, timeout=300)
        fenced = job.train_log(0, lost).read_text(errors="replace")
    finally:
        for pid in zombies:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        back = cluster.script("node-back", lost)
    assert back.returncode == 0, back.stdout + back.stderr
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    assert info["NodeList"] == other, info
    assert "stopping: another attempt trains in this run directory now" in fenced, fenced[-3000:]
    log = job.batch_log()
    assert "Slurm requeues this job itself; this attempt is over" in log, log
    assert "checking the nodes again" not in log and "requeueing job" not in log, log
    assert sorted(_steps(job)) == list(range(1, 41))
    cluster.wait_no_job_processes(timeout=60)


def test_too_few_nodes_left_stops_the_job_in_one_line(cluster, e2e_root, train_config, data_dir):
    root = e2e_root / "bad-node-2"
    job = local_job(
        cluster,
        root,
        "badnode2",
        {"preflight.health_check": _bad_first_node_check(root)},
        config=train_config,
        data=data_dir,
    )
    job.submit()
    info = cluster.wait_done(job.job_id, timeout=180)
    bad = (root / "first-node").read_text().strip()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", job.describe()
    log = job.batch_log()
    assert (
        f"ERROR: preflight failed on {bad}: without {bad} partition debug has 1 nodes, the job needs 2; "
        "not requeueing" in log
    ), log


@pytest.mark.parametrize("protocol", ["sbatch-gen", "signal", "none"])
def test_a_trainer_of_ones_own_that_exits_0_on_sigterm_is_preempted_not_finished(
    cluster, e2e_root, train_config, data_dir, protocol
):
    """A preemption with GraceTime signals the job steps only. A trainer not written for sbatch-gen
    (tests/probes/sbg_stop_probe.py --probe-mode signal) saves on its SIGTERM and exits 0 without an .ack:
    every rank gets the SIGTERM (run-trainer hands it on to torchrun's workers, which Slurm's own does not
    reach under process-group tracking), the job is requeued as a preemption, not taken for finished, and no
    process of the first attempt is alive once the second starts."""
    probe = e2e_root / f"own-{protocol}" / "run" / "probe"
    job = local_job(
        cluster,
        e2e_root / f"own-{protocol}",
        f"own{protocol[:3]}",
        {
            "paths.code_dir": str(Path(__file__).resolve().parents[1] / "probes"),
            "trainer.module": "sbg_stop_probe",
            "trainer.extra_args": ["--probe-mode", "signal", "--probe-save-s", "2", "--probe-max-s", "200"],
            "trainer.stop_protocol": protocol,
        },
        config=train_config,
        data=data_dir,
    )
    job.submit()
    starts0 = [probe / f"start.attempt-0.rank-{r}.json" for r in range(4)]
    deadline = time.monotonic() + 180
    while not all(p.exists() for p in starts0):
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.2)
    pids0 = [json.loads(p.read_text())["pid"] for p in starts0]
    preempt(cluster)
    starts1 = [probe / f"start.attempt-1.rank-{r}.json" for r in range(4)]
    deadline = time.monotonic() + 240
    while not any(p.exists() for p in starts1):
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.1)
    assert not [p for p in pids0 if pid_alive(p)], "a process of the first attempt outlived it"
    info = cluster.wait_done(job.job_id, timeout=240)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    for r in range(4):
        assert "0 SIGTERM" in (probe / f"signals.rank-{r}").read_text(), f"rank {r} never got the SIGTERM"
        assert json.loads((probe / f"saved.rank-{r}").read_text())["attempt"] == 0
    log = job.batch_log()
    first = log[: log.index(f"job {job.job_id}, attempt 1")]
    assert "a preemption, not the end of training" in first and "requeueing job" in first, first
    assert "training finished" not in first and "training finished" in log, log


def test_every_attempt_runs_the_code_the_run_was_submitted_with(cluster, e2e_root, train_config, data_dir):
    """paths.pin_code: the trainer (the stop probe, in a git checkout of its own) is changed and committed
    while attempt 0 runs, as a `git pull` would; attempt 1, after a stop, runs the pinned copy and the
    batch log names the commit it runs and the one the checkout is at."""
    code = e2e_root / "pinned-code"
    code.mkdir()
    probe = code / "sbg_stop_probe.py"
    probe.write_text((Path(__file__).resolve().parents[1] / "probes" / "sbg_stop_probe.py").read_text())
    commit = git_checkout(cluster, code)
    first = commit("as submitted")
    job = local_job(
        cluster,
        e2e_root / "pin",
        "pin",
        {
            "paths.code_dir": str(code),
            "trainer.module": "sbg_stop_probe",
            "trainer.extra_args": ["--probe-mode", "signal", "--probe-save-s", "1", "--probe-max-s", "200"],
            "trainer.stop_protocol": "signal",
        },
        config=train_config,
        data=data_dir,
    )
    job.submit()
    out = job.run_dir / "probe"
    deadline = time.monotonic() + 180
    while not (out / "start.attempt-0.rank-0.json").exists():
        assert time.monotonic() < deadline, job.describe()
        time.sleep(0.2)
    probe.write_text(probe.read_text().replace('VERSION = "as-submitted"', 'VERSION = "pulled"'))
    pulled = commit("a git pull")
    cluster.run("scancel", "--signal=USR1", "--batch", str(job.job_id))
    info = cluster.wait_done(job.job_id, timeout=240)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    for r in range(4):
        for attempt in (0, 1):
            start = json.loads((out / f"start.attempt-{attempt}.rank-{r}.json").read_text())
            assert start["version"] == "as-submitted", (attempt, r, start)
    log = job.batch_log()
    assert f"code pinned for the run: {code} at commit {first} (clean)" in log, log
    assert (
        f"running the code pinned when the run was submitted: commit {first} (clean) from "
        f"{job.run_dir}/code/{job.job_id}; the checkout is at {pulled} now" in log
    ), log
