"""The rendered SSH launcher, run for real: sshd on 127.0.0.1, two host entries (127.0.0.1 runs node 0
locally, localhost is reached over ssh), torchrun + the real trainer (tiny config, gloo on lo)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from sshkit import pids_with_env, probe_venv, start_sshd, stop_sshd, tagged_pids, tiny_config

pytestmark = pytest.mark.slow


def _summary(launch) -> dict:
    return json.loads((launch.run_dir / "summary.json").read_text())


def _assert_no_tagged(launch) -> None:
    left = tagged_pids(launch.tag)
    assert not left, f"tagged processes left behind: {left}\n{launch.output()}"


def _remote_worker(launch, timeout: float = 60) -> int:
    """PID of node 1's worker (started over ssh): tagged, node rank 1, and a torchrun worker (LOCAL_RANK)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = pids_with_env(launch.tag, SBATCH_GEN_NODE_RANK="1", LOCAL_RANK="0")
        if pids:
            return pids[0]
        time.sleep(0.2)
    raise AssertionError(f"no worker of node 1 found:\n{launch.output()}")


def test_two_hosts_train_to_completion_through_a_sigkilled_remote_worker(ssh_launch, tmp_path):
    """Attempt 1 (--resume none, the profile's) loses node 1's worker to SIGKILL; every host is cleaned
    up and the whole job relaunches with --resume auto, resumes from the last checkpoint and completes."""
    cfg = tiny_config(tmp_path / "tiny.yaml", train__steps=12, checkpoint__every=3)
    launch = ssh_launch("trainer.resume=none", config=cfg)
    launch.wait_for_step(4)
    os.kill(_remote_worker(launch), signal.SIGKILL)
    assert launch.wait() == 0, launch.output()

    exits = launch.exits()
    assert [e for e in exits if e[0] == 1 and e[3] != 0], exits  # attempt 1 failed
    # attempt 2: both nodes finished, in whichever order they happened to end
    assert sorted(e for e in exits if e[0] == 2) == [(2, 0, "127.0.0.1", 0), (2, 1, "localhost", 0)], exits
    out = launch.output()
    assert "attempt 1: started 2 nodes (resume none)" in out
    assert "attempt 1 failed: relaunching with --resume auto" in out
    assert "attempt 2: started 2 nodes (resume auto)" in out and "training complete" in out
    s = _summary(launch)
    assert s["exit"] == "completed" and s["last_step"] == 12 and s["world_size"] == 2
    assert s["resumed_from_step"] is not None and s["resumed_from_step"] >= 3
    # node 1 ran over ssh: pinned interface, rendezvous at node 0's address on it, the launch's tag
    node1 = launch.node_log(1, 1)
    assert f"node 1 host {os.uname().nodename} addr 127.0.0.1 rendezvous 127.0.0.1:" in node1
    assert f"tag {launch.tag}" in node1 and "GLOO_SOCKET_IFNAME=lo" in node1
    # cleanup ran on both hosts after each attempt
    cleanup = (launch.logs / "cleanup.log").read_text()
    assert cleanup.count(launch.tag) >= 4, cleanup  # 2 hosts x 2 attempts
    _assert_no_tagged(launch)


def test_sigint_cleans_up_every_host_and_nothing_else(ssh_launch, tmp_path):
    cfg = tiny_config(tmp_path / "tiny.yaml", train__steps=400)
    launch = ssh_launch(config=cfg)
    # Decoys that cleanup must leave alone: a near-identical tag in the environment, the exact tag in argv.
    decoys = [
        subprocess.Popen(["sleep", "300"], env={**os.environ, "SBATCH_GEN_TAG": launch.tag + "0"}),
        subprocess.Popen(["bash", "-c", "sleep 300; : SBATCH_GEN_TAG=" + launch.tag]),
    ]
    try:
        launch.wait_for_step(2)
        node1 = pids_with_env(launch.tag, SBATCH_GEN_NODE_RANK="1")
        assert node1, "node 1's processes (started over ssh) should be running"
        launch.proc.send_signal(signal.SIGINT)
        assert launch.wait(timeout=120) == 130, launch.output()
        assert "caught SIGINT: stopping every node" in launch.output()
        _assert_no_tagged(launch)
        assert all(d.poll() is None for d in decoys), "cleanup killed an unrelated process"
    finally:
        for d in decoys:
            d.kill()
            d.wait()


def test_sigint_through_the_launcher_makes_the_trainer_write_its_stop_checkpoint(ssh_launch, tmp_path):
    """Ctrl-C on the launcher: its SIGTERM reaches the trainer on both hosts, which stop at one agreed step
    and save a complete checkpoint of it before they exit. checkpoint.every is far beyond the run, so no
    periodic checkpoint exists: the only one is the stop checkpoint."""
    from sbatch_gen.train.checkpoint import check_complete, list_step_dirs, read_marker, step_dir

    cfg = tiny_config(tmp_path / "tiny.yaml", train__steps=400, checkpoint__every=100_000)
    launch = ssh_launch("launch.kill_grace_s=120", config=cfg)  # time to save even on a loaded machine
    launch.wait_for_step(3)
    launch.proc.send_signal(signal.SIGINT)
    assert launch.wait(timeout=240) == 130, launch.output()
    out = launch.output()
    assert "caught SIGINT: stopping every node" in out
    s = _summary(launch)
    assert s["exit"] == "stopped", s
    assert s["world_size"] == 2 and 3 <= s["last_step"] < 400, s
    stop_step = s["last_step"]
    ckpt = step_dir(launch.run_dir, stop_step)
    assert (ckpt / "COMPLETE.json").is_file(), f"no stop checkpoint at {ckpt}\n{out}"
    assert check_complete(ckpt) is None and read_marker(ckpt)["step"] == stop_step
    assert [st for st, _ in list_step_dirs(launch.run_dir)] == [stop_step]
    assert max(launch.metrics_steps()) == stop_step
    ranks = []
    for node in (
        0,
        1,
    ):  # each host's trainer took the stop request (SIGTERM), saved, and exited 0: not killed
        node_log = launch.node_log(1, node)
        # its trainer's rank: c10d's rendezvous numbers the nodes in the order they join, not node 0 first
        rank = int(re.findall(r"\[rank (\d)/2\]", node_log)[0])
        ranks.append(rank)
        assert (
            f"[rank {rank}/2] stop requested (SIGTERM): all ranks stop after step {stop_step}" in node_log
        ), node_log
        assert f"[rank {rank}/2] exiting 0: checkpointed at step {stop_step}" in node_log, node_log
        # torchrun ignored the SIGTERM (run-trainer): no traceback; the node says in one line what it holds
        assert "Traceback" not in node_log, node_log
        assert f": stopped after step {stop_step} (SIGTERM): checkpoint " in node_log, node_log
        assert f"/checkpoints/step-{stop_step} complete" in node_log, node_log
        assert f"stopped after step {stop_step} (SIGTERM)" in out, out  # and the launcher's log repeats it
    assert sorted(ranks) == [0, 1], ranks
    assert "SIGKILL to" not in (launch.logs / "cleanup.log").read_text()
    _assert_no_tagged(launch)


def _probe_records(launch, timeout: float = 60) -> list[dict]:
    records = [launch.dir / "probe" / f"node-{r}.json" for r in (0, 1)]
    deadline = time.monotonic() + timeout
    while not all(r.exists() for r in records):
        assert time.monotonic() < deadline and launch.proc.poll() is None, launch.output()
        time.sleep(0.2)
    return [json.loads(r.read_text()) for r in records]


def _beats(launch, rank: int) -> int:
    f = launch.dir / "probe" / f"node-{rank}.beats"
    return int(f.read_text() or 0) if f.exists() else 0


def test_stop_file_ends_the_run_after_the_current_attempt(ssh_launch, tmp_path):
    """The stop file is checked between attempts only: the running attempt goes on until it ends (here
    node 1's worker is killed), then the launcher stops instead of relaunching. (A probe stands in for
    torchrun: this is about the launcher, and it keeps the test fast.)"""
    venv = probe_venv(tmp_path / "probe-venv")
    launch = ssh_launch(
        f"python_env.path={venv}", "extra_env={SBG_PROBE_MODE: run}", "launch.failure_grace_s=2"
    )
    workers = [r["pid"] for r in _probe_records(launch)]
    (launch.run_dir / "STOP").touch()
    seen = _beats(launch, 0)
    deadline = time.monotonic() + 60
    while _beats(launch, 0) < seen + 5:  # the attempt keeps running
        assert time.monotonic() < deadline and launch.proc.poll() is None, launch.output()
        time.sleep(0.2)
    os.kill(workers[1], signal.SIGKILL)
    assert launch.wait() == 4, launch.output()
    out = launch.output()
    assert "STOP exists: not relaunching" in out
    assert "WARNING" not in out  # 127.0.0.1 is this host
    assert {e[0] for e in launch.exits()} == {1}, "no second attempt"
    assert (1, 1, "localhost", 137) in launch.exits()  # the status of the killed process, through ssh
    assert "attempt 1: node 1 (localhost) exited with 137 (SIGKILL)" in out
    _assert_no_tagged(launch)
    # and a stop file left from before makes the next launch refuse to start
    again = ssh_launch(f"python_env.path={venv}")
    assert again.wait(timeout=60) == 2
    assert "remove it to launch" in again.output()


def test_second_sigint_kills_at_once_what_ignores_sigterm(ssh_launch, tmp_path):
    """Workers that ignore SIGTERM (a probe in place of torchrun) survive the first Ctrl-C for the kill
    grace; a second Ctrl-C SIGKILLs them on every host at once."""
    venv = probe_venv(tmp_path / "probe-venv")
    launch = ssh_launch(
        f"python_env.path={venv}", "extra_env={SBG_PROBE_MODE: hang}", "launch.kill_grace_s=600"
    )
    workers = [r["pid"] for r in _probe_records(launch)]
    launch.proc.send_signal(signal.SIGINT)
    cleanup_log = launch.logs / "cleanup.log"
    deadline = time.monotonic() + 60
    while not (cleanup_log.exists() and "SIGTERM to" in cleanup_log.read_text()):
        assert time.monotonic() < deadline, launch.output()
        time.sleep(0.2)
    time.sleep(1)
    assert launch.proc.poll() is None, "the first SIGINT waits for the kill grace"
    assert set(workers) <= set(tagged_pids(launch.tag)), "SIGTERM-ignoring workers are still there"
    launch.proc.send_signal(signal.SIGINT)
    assert launch.wait(timeout=120) == 130, launch.output()
    assert "second signal: SIGKILL to every tagged process now" in launch.output()
    _assert_no_tagged(launch)


def test_cleanup_command_after_the_launcher_was_sigkilled(ssh_launch, tmp_path):
    """SIGKILL of the launcher leaves its workers running (nothing can trap it); they keep their tag,
    and `out/<site>.sh cleanup TAG` kills them on every host."""
    venv = probe_venv(tmp_path / "probe-venv")
    launch = ssh_launch(f"python_env.path={venv}", "extra_env={SBG_PROBE_MODE: run}")
    workers = [r["pid"] for r in _probe_records(launch)]
    launch.proc.kill()
    launch.proc.wait()
    assert set(workers) <= set(tagged_pids(launch.tag))
    r = subprocess.run(
        ["bash", str(launch.script), "cleanup", launch.tag],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"no process tagged {launch.tag} is left" in r.stderr
    _assert_no_tagged(launch)


def test_a_host_lost_between_attempts_fails_preflight_and_counts_as_an_attempt(ssh_launch, tmp_path):
    """Node 1's sshd goes away during attempt 1 and its worker dies: the relaunches' preflights fail on
    node 1 and count as failed attempts (the host may come back in a cool-down) until none are left."""
    server = start_sshd(tmp_path / "sshd-lost")
    venv = probe_venv(tmp_path / "probe-venv")
    try:
        launch = ssh_launch(
            f"python_env.path={venv}",
            "extra_env={SBG_PROBE_MODE: run}",
            "launch.failure_grace_s=2",
            server=server,
        )
        workers = [r["pid"] for r in _probe_records(launch)]
    finally:
        stop_sshd(server)
    os.kill(workers[1], signal.SIGKILL)
    assert launch.wait() == 1, launch.output()
    out = launch.output()
    for attempt in (2, 3):
        assert (
            f"attempt {attempt}: preflight failed, nothing was started; it counts as a failed attempt" in out
        )
    assert "preflight FAILED on node 1 (localhost): ssh cannot reach it" in out
    assert "attempt 3 failed and no attempts are left (max 3)" in out
    assert {e[0] for e in launch.exits()} == {1}
    _assert_no_tagged(launch)


def test_warns_when_not_started_on_the_first_host(ssh_launch, tmp_path):
    """Node 0 always runs where the launcher runs; a hosts[0] that is not this host is worth a warning."""
    venv = probe_venv(tmp_path / "probe-venv")
    launch = ssh_launch(f"python_env.path={venv}", "hosts=[elsewhere.invalid, localhost]")
    assert launch.wait(timeout=120) == 0, launch.output()
    assert "WARNING: node 0 is hosts[0] = elsewhere.invalid" in launch.output()
    assert (tmp_path / "probe" / "node-1.json").exists()


def test_a_host_that_hangs_after_the_other_finished_is_ended_within_the_bound(ssh_launch, repo, tmp_path):
    """Node 1's worker hangs after node 0's finished (the stop probe, tests/probes): node 0's torchrun waits
    launch.failure_grace_s for it (the exit barrier, set through the node program: torch's is 300 s), then the
    launcher gives node 1 that long again and ends it; the next attempt completes. No traceback."""
    grace = 5
    launch = ssh_launch(
        f"paths.code_dir={repo / 'tests' / 'probes'}",
        "trainer.module=sbg_stop_probe",
        'trainer.extra_args=["--probe-mode", "end", "--probe-hang-nodes", "1", "--probe-max-s", "300"]',
        f"launch.failure_grace_s={grace}",
    )
    assert launch.wait(timeout=240) == 0, launch.output()
    out = launch.output()
    probe = launch.run_dir / "probe"
    # (the rendezvous, not the launch, orders the ranks: node 1's worker may be rank 0 or 1)
    (done_file,) = probe.glob("done.attempt-1.rank-*")
    done = float(done_file.read_text())
    (hung,) = probe.glob("hung.node-*")
    hung = json.loads(hung.read_text())
    assert hung["attempt"] == 1 and str(hung["rank"]) != done_file.name.split("-")[-1], out
    # attempt 1: node 0 finished after its exit barrier; node 1 was ended by the launcher
    assert (
        f"attempt 1: 1 node(s) still running {grace}s after one finished (launch.failure_grace_s): killing them"
        in out
    )
    ended = [e for e in launch.exits() if e[0] == 1]
    assert sorted(e[1] for e in ended) == [0, 1] and ended[0][1] == 0 and ended[0][3] == 0, ended
    node0 = launch.node_log(1, 0)
    assert f"did not all within {grace} s (the exit barrier" in node0, node0
    # the launcher saw attempt 1 over within the barrier, its grace, cleanup and polling of the done rank
    starts = sorted(probe.glob("start.attempt-2.rank-*.json"))
    assert len(starts) == 2 and all(json.loads(p.read_text())["version"] == "as-submitted" for p in starts)
    assert min(p.stat().st_mtime for p in starts) - done < 2 * grace + 40
    # ... and completed: node 1 hangs once, whichever ranks the next rendezvous gives it
    assert not list(probe.glob("start.attempt-3.*")), out
    assert "Traceback" not in out and "Traceback" not in node0, out
    _assert_no_tagged(launch)


def test_every_host_gets_only_what_is_named_not_the_launching_shells_environment(
    ssh_launch, tmp_path, monkeypatch
):
    """Node 0 runs where the launcher runs, yet it starts from what an ssh login gives node 1 (HOME, USER,
    PATH, ...), not the launching shell's whole environment: a stray variable, PYTHONPATH or
    CUDA_VISIBLE_DEVICES of that shell reaches no host. What is named reaches both: the profile's exports
    (the launching shell's value of one wins, on every host) and extra_env."""
    monkeypatch.setenv("SBG_STRAY", "from-the-launching-shell")
    given = os.environ.get("PYTHONPATH")  # (the test's own, for the render it runs, stays after the stray)
    monkeypatch.setenv("PYTHONPATH", "/stray/pythonpath" + (f":{given}" if given else ""))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # a profile default: the launcher's value is named, and wins
    venv = probe_venv(tmp_path / "probe-venv")
    launch = ssh_launch(f"python_env.path={venv}", "extra_env={SBG_NAMED: named}")
    records = _probe_records(launch)
    assert launch.wait(120) == 0, launch.output()
    for rank, rec in enumerate(records):
        env = rec["env"]
        assert "SBG_STRAY" not in env and "CUDA_VISIBLE_DEVICES" not in env, (rank, env)
        assert "/stray/pythonpath" not in env.get("PYTHONPATH", ""), (rank, env["PYTHONPATH"])
        assert env["OMP_NUM_THREADS"] == "5" and env["SBG_NAMED"] == "named", (rank, env)
        assert env["HOME"] == os.environ["HOME"] and env["SBATCH_GEN_NODE_RANK"] == str(rank)
