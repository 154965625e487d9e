"""torchrun's exit barrier as the node program runs it (`sbatch-gen-node.py torchrun`, which run-trainer starts
for torch's own torchrun): two real agents on this machine, one per "node" (c10d rendezvous on 127.0.0.1,
is_host given, as the launchers give it), one worker each.

- A node whose workers finished waits for the other node at most --exit-barrier-s (torch's own barrier waits
  300 s, and its command line cannot change that), then says so in one line, not a traceback.
- After a good job neither agent logs a traceback (pytorch/pytorch#69520: the agent hosting the store used to
  leave the barrier while another still read it), and the host leaves only once the other has.
"""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sbatch_gen import node_program

from .conftest import REPO, train_env

pytestmark = pytest.mark.slow  # two torchrun agents

PROGRAM = REPO / "sbatch_gen" / "node_program.py"

# the second node's worker hangs when asked to, after writing that it runs; the other ends at once. A node is
# told by SBG_TEST_NODE, not RANK: the c10d rendezvous orders the agents by address and pid, and pids wrap.
WORKER = """
import os, sys, time
node = os.environ["SBG_TEST_NODE"]
open(os.path.join(sys.argv[1], "node-%s.started" % node), "w").close()
if sys.argv[2] == "hang" and node == "1":
    time.sleep(600)
open(os.path.join(sys.argv[1], "node-%s.done" % node), "w").write(repr(time.time()))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(tmp_path: Path, port: int, node: int, mode: str, barrier_s: int) -> subprocess.Popen:
    args = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-id=exit-barrier"]
    args += [
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-conf=join_timeout=60,is_host={1 if node == 0 else 0}",
    ]
    args += ["--max-restarts=0", "--monitor-interval=0.1", str(tmp_path / "worker.py"), str(tmp_path), mode]
    argv = [sys.executable, "-I", str(PROGRAM), "torchrun", "--exit-barrier-s", str(barrier_s), "--", *args]
    err = open(tmp_path / f"node-{node}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        argv,
        env={**train_env(), "SBG_TEST_NODE": str(node)},
        cwd=tmp_path,
        stdout=err,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _pair(tmp_path: Path, mode: str, barrier_s: int) -> tuple[subprocess.Popen, subprocess.Popen]:
    (tmp_path / "worker.py").write_text(WORKER)
    port = _port()
    return _agent(tmp_path, port, 0, mode, barrier_s), _agent(tmp_path, port, 1, mode, barrier_s)


def test_a_node_done_waits_for_a_hung_one_at_most_the_exit_barrier_then_one_line(tmp_path):
    host, other = _pair(tmp_path, "hang", 3)
    try:
        host.wait(timeout=120)
        left = time.time()
        done = float((tmp_path / "node-0.done").read_text())
        # the host left while node 1's worker still hung (that agent, its store gone, ends soon after: not
        # asserted, it races with this line)
        assert (tmp_path / "node-1.started").exists() and not (tmp_path / "node-1.done").exists()
    finally:
        other.kill()
        other.wait()
    log = (tmp_path / "node-0.log").read_text()
    assert host.returncode == 0, log
    # torch's own barrier would hold it 300 s; this one 3 s (and the agent's own start-up and polling)
    assert 3 <= left - done < 30, (left - done, log)
    said = [line for line in log.splitlines() if "exit barrier" in line and "sbatch-gen" in line]
    assert len(said) == 1 and "the other nodes' did not all within 3 s" in said[0], log
    assert "Traceback" not in log and "Error waiting on exit barrier" not in log, log


def test_a_good_two_node_job_ends_at_once_without_a_traceback(tmp_path):
    """Three good jobs in a row: each agent exits 0 with no traceback in either log, and the host is gone
    within seconds of the other (it waits for the other's hand-over, not for EXIT_HANDOFF_S)."""
    for run in range(3):
        d = tmp_path / f"run-{run}"
        d.mkdir()
        host, other = _pair(d, "end", 60)
        assert other.wait(timeout=120) == 0, (d / "node-1.log").read_text()
        other_left = time.monotonic()
        assert host.wait(timeout=60) == 0, (d / "node-0.log").read_text()
        assert time.monotonic() - other_left < node_program.EXIT_HANDOFF_S / 2, (d / "node-0.log").read_text()
        for node in (0, 1):
            log = (d / f"node-{node}.log").read_text()
            assert "Traceback" not in log and "Error waiting on exit barrier" not in log, log
            assert "did not all within" not in log, log


def test_the_host_stays_until_every_agent_has_left(monkeypatch):
    """The hand-over on the store, without agents: the host's rendezvous shutdown returns once the other agent
    has counted itself out, not before; without the other, after EXIT_HANDOFF_S."""
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from torch.distributed.elastic.utils import store as store_util

    monkeypatch.setattr(api.SimpleElasticAgent, "__init__", api.SimpleElasticAgent.__init__)
    monkeypatch.setattr(api.SimpleElasticAgent, "_exit_barrier", api.SimpleElasticAgent._exit_barrier)
    monkeypatch.setattr(DynamicRendezvousHandler, "shutdown", lambda self: True)
    monkeypatch.setattr(node_program, "EXIT_HANDOFF_S", 2.0)
    node_program._patch_exit_barrier(5.0, True)
    port = _port()
    store = dist.TCPStore(
        "127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    peer = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))

    class Agent:
        _store = store
        _worker_group = type("G", (), {"group_world_size": 2})()
        _exit_barrier_timeout = 5.0

    agent = Agent()
    # the barrier: the other agent arrives from a thread
    other = threading.Thread(
        target=lambda: store_util.barrier(peer, 2, api._TERMINAL_STATE_SYNC_ID, barrier_timeout=5.0)
    )
    other.start()
    api.SimpleElasticAgent._exit_barrier(agent)
    other.join()
    t0 = time.monotonic()
    threading.Timer(1.0, lambda: peer.add(node_program.EXIT_LEFT_KEY, 1)).start()
    assert DynamicRendezvousHandler.shutdown(object()) is True
    assert 0.9 <= time.monotonic() - t0 < 2.0
    store.set(node_program.EXIT_LEFT_KEY, "0")  # nobody else leaves: the bound
    t0 = time.monotonic()
    DynamicRendezvousHandler.shutdown(object())
    assert 2.0 <= time.monotonic() - t0 < 5.0


def test_rank_logs_one_file_per_rank_in_a_folder_per_node(tmp_path):
    """torchrun.rank_logs in a Slurm step: the batch shell gives every node the attempt's --log-dir; the node
    program's torchrun puts this node's under a folder of its own name, torchrun tees each rank's stdout and
    stderr into it, and labels the rank's lines in the node's log."""
    (tmp_path / "w.py").write_text('import os\nprint("hello from local rank", os.environ["LOCAL_RANK"])\n')
    logs = tmp_path / "job-7.attempt-0.ranks"
    argv = [sys.executable, "-I", str(PROGRAM), "torchrun", "--"]
    argv += [
        "--standalone",
        "--nproc-per-node=2",
        "--monitor-interval=0.1",
        f"--log-dir={logs}",
        "--tee=3",
        "w.py",
    ]
    env = train_env({"SLURM_NODEID": "0", "SLURMD_NODENAME": "n7"})
    out = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        (log,) = (logs / "n7").glob(f"*/attempt_0/{rank}/stdout.log")
        assert log.read_text() == f"hello from local rank {rank}\n"
        assert f"[default{rank}]:hello from local rank {rank}" in out.stdout + out.stderr
