"""(2, elastic) Two regions as two Slurm jobs with elastic rounds (min_regions 1), and one of them preempted
mid-run with `scancel --signal=USR1 --batch`: the other keeps training with no stall beyond grace_s, the
requeued job rejoins (fast-forward from the mailbox), and both end COMPLETED with identical parameters."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from e2e_lib import (
    REPO,
    TERMINAL,
    WITH_FAULTS,
    assert_regions_completed,
    assert_same_final_params,
    local_job,
    region_jobs,
    report,
    s3_mailbox,
    s3_secrets,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

H = 5  # inner steps per outer round
STEPS = 100  # 20 outer rounds
GRACE_S = 3.0
# "one poll": the membership polls commits/manifests with a back-off up to poll_max_s (1 s) and the
# presence records every min(1 s, grace_s / 4); a wait may overshoot grace_s by up to that
POLL_SLACK_S = 1.0
# per step, on every rank of both regions: the run lasts long enough for b's preemption, requeue (about
# 10 s from the stop to the second attempt on this cluster), restart (torchrun and the trainer's start-up:
# 8-30 s measured on 2 shared cores) and fast-forward to happen while a still has rounds to go. Measured:
# b away 20-44 s (44 s with another CPU-heavy job on the machine), while a alone takes about 0.7 s per
# step, so b was back between step 40 and 70 of 100.
STEP_SLEEP_S = "0.6"


@pytest.fixture(scope="module")
def elastic_config(e2e_root):
    """The tiny config, STEPS steps (STEPS / H outer rounds), a checkpoint every 10 steps."""
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["train"]["steps"] = STEPS
    cfg["checkpoint"]["every"] = 10
    p = e2e_root / "e2e-elastic.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def _rounds(job) -> list[dict]:
    return [x for x in job.metrics() if "xr_round" in x and "xr_members" in x]


def _events(job, name: str) -> list[dict]:
    return [x for x in job.metrics() if x.get("event") == name]


def _wait_round(job, r: int, others, timeout: float = 180) -> None:
    """Until ``job`` has logged outer round ``r`` (or later); every job in ``others`` must still run."""
    deadline = time.monotonic() + timeout
    while not any(x["xr_round"] >= r for x in _rounds(job)):
        for j in others:
            state = j.cluster.job(j.job_id)["JobState"]
            assert state not in TERMINAL, f"{j.name} ended ({state}) before round {r}\n{j.describe()}"
        assert time.monotonic() < deadline, f"{job.name}: no round {r} within {timeout} s\n{job.describe()}"
        time.sleep(0.2)


# One transport on the cluster: S3 (the production one). The fs mailbox's elastic paths (leave, rejoin
# through rounds and snapshots) are the same code above the transport and run in
# tests/xr/test_elastic_multiproc.py; what this test adds is Slurm's side (USR1, requeue, a second attempt).
def test_preempted_region_rejoins_and_the_other_never_stalls(cluster, e2e_root, elastic_config):
    """Both regions train; once b has taken part in round 2 it gets `scancel --signal=USR1 --batch`: it
    checkpoints, announces a planned leave and is requeued by its batch script. a goes on alone: the rounds
    b misses close without waiting for it. b's second attempt resumes from its stop checkpoint,
    fast-forwards (outer snapshot and/or committed rounds) to the run's round, takes part in the rounds
    after that, and both jobs end COMPLETED with bitwise identical final parameters."""
    root = e2e_root / "xr-elastic-s3"
    root.mkdir()
    with s3_mailbox(cluster, root, "e2e-elastic") as (transport, env, s3):

        def count(suffix: str) -> int:
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket="e2e-elastic", Prefix="e2e/")
            return sum(1 for page in pages for o in page.get("Contents", []) if o["Key"].endswith(suffix))

        _run_and_check(cluster, root, elastic_config, transport, env, count)


def _run_and_check(cluster, root, elastic_config, transport, env, count):
    data = root / "data"
    data.mkdir()
    jobs = region_jobs(
        cluster,
        root,
        "xre",
        {
            "run_id": "e2e-elastic",
            "sync": "diloco",
            "inner_steps": H,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "timeout_s": 240,
            "min_regions": 1,
            "grace_s": GRACE_S,
            # a snapshot every 4 rounds and only 2 rounds kept behind: b, away for several rounds,
            # finds the rounds it missed partly cleaned up and fast-forwards through a snapshot
            "snapshot_every": 4,
            "keep_rounds": 2,
            "transport": transport,
        },
        config=elastic_config,
        data=data,
        sets={**s3_secrets(root), **WITH_FAULTS},  # the keys read on the node; the per-step sleep
    )
    a, b = jobs["a"], jobs["b"]
    env = {**env, "SBATCH_GEN_TEST_STEP_SLEEP_S": STEP_SLEEP_S}
    for job in jobs.values():
        job.submit(env)

    # b takes part in round 2 (its outer state is in its stop checkpoint), then is preempted
    _wait_round(b, 2, [a, b])
    t_sig = time.monotonic()
    cluster.run("scancel", "--signal=USR1", "--batch", str(b.job_id))
    # b checkpoints, leaves, acks and is requeued by its batch script; a goes on meanwhile
    info_a = cluster.wait_done(a.job_id, timeout=300)
    t_a_done = time.monotonic() - t_sig
    info_b = cluster.wait_done(b.job_id, timeout=300)
    assert_regions_completed({"a": a, "b": b}, {"a": info_a, "b": info_b}, restarts={"a": 0, "b": 1})

    # b: stopped on USR1 at an agreed step, checkpointed, announced its leave, was requeued and resumed
    ack = json.loads((b.run_dir / "stop" / f"{b.job_id}.attempt-0.ack").read_text())
    stop_step = ack["step"]
    assert 2 * H <= stop_step < STEPS, ack
    log = b.batch_log()
    assert (
        log.index("SIGUSR1 received") < log.index("requeueing job") < log.index(f"job {b.job_id}, attempt 1")
    )
    assert "training finished" in log[log.index(f"job {b.job_id}, attempt 1") :], log
    leave = _events(b, "xr_leave")
    # (the batch shell's USR1 trap hands the request to the trainer through the stop file)
    assert leave and leave[0]["step"] == stop_step and leave[0]["round"] == stop_step // H, leave
    assert leave[0]["reason"] == "stop file: SIGUSR1 to the batch shell", leave
    assert b.summary()["resumed_from_step"] == stop_step, b.summary()

    # b rejoined: fast-forwarded from its round at the stop to the run's round, adopting the run's step
    rejoin = _events(b, "xr_rejoin")
    assert len(rejoin) == 1, rejoin
    rj = rejoin[0]
    assert rj["from_round"] == stop_step // H and rj["to_round"] > rj["from_round"], rj
    assert rj["adopted_step"] == rj["to_round"] * H + rj["steps_into_round"] and rj["steps_into_round"] < H, (
        rj
    )
    back = rj["to_round"]
    # through the newest outer snapshot when the rounds it missed were cleaned up (keep_rounds 2), then
    # replaying the committed rounds after it; else replaying every round it missed
    if rj["via"] == ["rounds"]:
        assert rj["replayed"] == back - rj["from_round"], rj
    else:
        assert len(rj["via"]) == 1 and rj["via"][0].startswith("snapshot r"), rj
        snap = int(rj["via"][0].removeprefix("snapshot r"))
        assert rj["from_round"] < snap <= back and snap % 4 == 0 and rj["replayed"] == back - snap, rj

    # a never stalled: every round b missed closed within grace_s (plus one poll) of a's arrival
    ra = _rounds(a)
    assert [x["xr_round"] for x in ra] == list(range(1, STEPS // H + 1)), [x["xr_round"] for x in ra]
    missed = [x for x in ra if "b" in x["xr_absent"]]
    assert missed, "b was never absent from a round of a"
    assert all(x["xr_members"] == ["a"] for x in missed), missed
    worst = max(x["xr_wait_s"] for x in missed)
    timeline = [(x["xr_round"], x["xr_close_reason"], round(x["xr_wait_s"], 2)) for x in missed]
    assert worst <= GRACE_S + POLL_SLACK_S, timeline
    assert {x["xr_close_reason"] for x in missed} <= {"leave", "grace"}, timeline
    # While b was away with its leave announced, every round closed at once ("leave", no grace wait): all
    # rounds after the one b left in, up to the one it fast-forwarded to. "grace" is possible only where b
    # was not known to be away: the round it left in (had its leave been written more than grace_s after a
    # published), a start-up round (b's job starting later than a's), or its first round back (if it
    # published that one more than grace_s after a: then it obeys a's commit as a late region).
    left_in = stop_step // H + 1
    away = [x for x in missed if left_in < x["xr_round"] <= back]
    assert [x["xr_round"] for x in away] == list(range(left_in + 1, back + 1)), timeline
    assert all(x["xr_close_reason"] == "leave" and x["xr_wait_s"] < POLL_SLACK_S for x in away), timeline
    grace = [x["xr_round"] for x in missed if x["xr_close_reason"] == "grace"]
    assert all(r <= left_in or r > back for r in grace), (back, timeline)

    # after its return b took part in rounds again, and both regions applied the same rounds
    rb = {x["xr_round"]: x for x in _rounds(b)}
    after = [rb[r] for r in sorted(rb) if r > back]
    assert after and any("b" in x["xr_members"] for x in after), (
        f"b came back at round {back} of {STEPS // H} and took part in none after it: the run was too short "
        f"for b's requeue and restart on this machine (raise STEPS or STEP_SLEEP_S)",
        [(x["xr_round"], x["xr_members"]) for x in after],
    )
    by_round = {x["xr_round"]: x for x in ra}
    for x in after:
        assert by_round[x["xr_round"]]["xr_members"] == x["xr_members"], (x, by_round[x["xr_round"]])
    assert b.summary()["last_step"] == STEPS and a.summary()["last_step"] == STEPS
    assert_same_final_params(jobs)
    assert count("/_commit.json") > 0, "no round commit in the S3 mailbox"

    away_s = rj["time"] - leave[0]["time"]
    report(
        f"elastic regions (s3): b left at step {stop_step}, rejoined {away_s:.0f} s later at round {back} "
        f"via {rj['via']} (fast-forward {rj['seconds']} s); a finished {t_a_done:.0f} s after the USR1; "
        f"rounds a closed without b (round, reason, wait s): {timeline}"
    )


def test_no_quorum_checkpoints_and_the_batch_script_requeues_it(cluster, e2e_root, elastic_config):
    """A strict run (min_regions: all) whose region b never comes: a's round 1 finds no quorum within
    timeout_s. The trainer checkpoints, logs one line naming b and exits with the requeue code; the batch
    log names the trainer's request and requeues (its stop checkpoint of step 5 is progress); the second
    attempt resumes
    from that checkpoint, retries the pending round, finds no quorum again, and the budget ends the job."""
    root = e2e_root / "xr-no-quorum"
    data = root / "data"
    data.mkdir(parents=True)
    sets = {
        "slurm.nodes": 1,
        "slurm.extra_directives": [f"--nodelist={cluster.nodes[0]}"],
        "preemption.max_requeues_without_progress": 0,
        "cross_region": {
            "enabled": True,
            "run_id": "e2e-no-quorum",
            "region": "a",
            "regions": ["a", "b"],
            "sync": "diloco",
            "inner_steps": H,
            "timeout_s": 5,
            "transport": {"kind": "fs", "root": str(root / "mailbox")},
        },
    }
    job = local_job(cluster, root / "a", "xr-noq", sets, config=elastic_config, data=data)
    job.submit()
    info = cluster.wait_done(job.job_id, timeout=300)
    log = job.batch_log()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", job.describe()
    asked = [ln for ln in log.splitlines() if "trainer checkpointed and asked for a requeue" in ln]
    assert len(asked) == 2 and all('"reason": "no quorum"' in ln and '"step": 5' in ln for ln in asked), log
    assert (
        "requeueing job" in log
        and (
            "not requeueing: 1 attempt(s) in a row saved no newer checkpoint, more than "
            "preemption.max_requeues_without_progress (0)"
        )
        in log
    ), log
    for attempt in (0, 1):
        train = job.train_log(attempt, cluster.nodes[0]).read_text(errors="replace")
        line = [ln for ln in train.splitlines() if "no cross-region quorum" in ln]
        assert line and "missing: b" in line[0] and "checkpointed at step 5" in line[0], train[-3000:]
        assert 'File "' not in train.split("no cross-region quorum")[0], train[
            -3000:
        ]  # no traceback before it
    assert (job.run_dir / "checkpoints" / "step-5").exists()
    report(f"no quorum: job {job.job_id} ran 2 attempts, each checkpointed at step 5 and asked for a requeue")
