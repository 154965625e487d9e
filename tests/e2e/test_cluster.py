"""The local cluster itself: it runs a 2-node torchrun job, and Slurm's signals and requeue behave the way
the rendered scripts rely on. Plain hand-written sbatch scripts here; the rendered ones are tested in the
other e2e modules."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _daemon_pids(cluster) -> dict[str, str]:
    pids = {}
    nodes = cluster.nodes + cluster.info["SBATCH_GEN_SLURM_GPU_NODES"].split(",")
    for name in ["slurmctld", *(f"slurmd-{n}" for n in nodes)]:
        pids[name] = (cluster.state / f"{name}.pid").read_text().strip()
    return pids


def test_start_twice_is_harmless(cluster):
    before = _daemon_pids(cluster)
    p = cluster.script("start", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "already running" in p.stderr
    assert _daemon_pids(cluster) == before
    st = cluster.script("status", timeout=60)
    assert st.returncode == 0, st.stdout + st.stderr
    sinfo = cluster.run("sinfo", "-h", "-N", "-p", cluster.partition, "-o", "%N %t").stdout.split("\n")
    assert sorted(line for line in sinfo if line) == [f"{n} idle" for n in cluster.nodes]


ALLREDUCE = """\
import json, os, socket, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
rec = {
    "rank": dist.get_rank(), "world": dist.get_world_size(), "group_rank": int(os.environ["GROUP_RANK"]),
    "local_rank": int(os.environ["LOCAL_RANK"]), "host": socket.gethostname(), "sum": t.item(),
    "master": os.environ["MASTER_ADDR"], "node": os.environ["SLURMD_NODENAME"],
}
with open(os.path.join(sys.argv[1], f"rank-{rec['rank']}.json"), "w") as f:
    json.dump(rec, f)
dist.destroy_process_group()
"""


def test_torchrun_two_nodes_two_procs(cluster, venv_bin, tmp_path):
    (tmp_path / "allreduce.py").write_text(ALLREDUCE)
    job = tmp_path / "job.sbatch"
    job.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --job-name=allreduce --nodes=2 --ntasks-per-node=1 --output=job-%j.out
        set -euo pipefail
        head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
        srun --kill-on-bad-exit=1 {venv_bin}/torchrun --nnodes 2 --nproc-per-node 2 \\
            --rdzv-backend=c10d --rdzv-id="$SLURM_JOB_ID" --rdzv-endpoint="$head:29511" \\
            allreduce.py "$PWD"
        """)
    )
    jid = cluster.sbatch(job)
    info = cluster.wait_done(jid, timeout=180)
    log = (tmp_path / f"job-{jid}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    assert {r["world"] for r in ranks} == {4}
    assert {r["sum"] for r in ranks} == {10.0}  # 1+2+3+4 arrived everywhere
    # two processes on each node, each node one torchrun group. The node a rank ran on is the slurmd
    # that started its task (SLURMD_NODENAME, inherited through torchrun): in the loopback layout every
    # node has this host's name, so the host name alone cannot tell them apart.
    by_node: dict[str, list] = {}
    for r in ranks:
        by_node.setdefault(r["node"], []).append(r)
    assert sorted(by_node) == sorted(cluster.nodes), ranks
    assert all(len(v) == 2 for v in by_node.values()), ranks
    groups = {n: {r["group_rank"] for r in v} for n, v in by_node.items()}
    assert sorted(tuple(g) for g in groups.values()) == [(0,), (1,)], groups
    assert sorted((r["group_rank"], r["local_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    if cluster.layout == "netns":  # there each node has its own host name too
        assert all(r["host"] == r["node"] for r in ranks), ranks


def test_job_processes_are_seen_on_their_nodes_and_gone_after_the_job(cluster, tmp_path):
    """What the fixture's "no job processes left" check relies on: while a 2-node job runs, each node's
    processes (slurmd, the steps' slurmstepd, the batch script, the tasks) are found on that node, in
    either layout; after the job nothing of it is found; a node that cannot be looked at is an error."""
    job = tmp_path / "job.sbatch"
    job.write_text(
        textwrap.dedent("""\
        #!/bin/bash
        #SBATCH --job-name=procs --nodes=2 --ntasks-per-node=1 --output=job-%j.out
        srun bash -c 'echo "$SLURMD_NODENAME $$" >"task-$SLURM_PROCID"; exec sleep 300' &
        wait
        """)
    )
    jid = cluster.sbatch(job)
    cluster.wait_state(jid, {"RUNNING"}, timeout=60)
    assert _wait_files(tmp_path, ["task-0", "task-1"], 60), "the step's tasks did not start"
    tasks = dict(p.read_text().split() for p in sorted(tmp_path.glob("task-*")))  # node -> pid of its sleep
    assert sorted(tasks) == sorted(cluster.nodes), tasks
    for node in cluster.nodes:
        mine = cluster.node_pids(node)
        assert int(tasks[node]) in mine, f"{node}'s task {tasks[node]} not among its processes {mine}"
        others = [tasks[n] for n in cluster.nodes if n != node]
        assert not any(int(p) in mine for p in others), f"another node's task among {node}'s processes"
        found = cluster.job_processes(node)
        assert any(f"slurmstepd: [{jid}." in c for c in found), found
        assert any(c.split(" ", 1)[1] == "sleep 300" for c in found), found
    assert any("slurm_script" in c for c in cluster.job_processes(cluster.nodes[0]))  # the batch script
    cluster.run("scancel", str(jid))
    cluster.wait_done(jid, timeout=60)
    cluster.wait_no_job_processes()
    with pytest.raises(AssertionError, match=r"no slurmd of node n9|cannot list the processes of node n9"):
        cluster.node_pids("n9")


def test_usr1_to_batch_shell_requeue_and_restart_count(cluster, tmp_path):
    """`scancel --signal=USR1 --batch` reaches the batch shell only (not the step's tasks); a requeue from
    its trap restarts the job with SLURM_RESTART_COUNT=1; --open-mode=append keeps attempt 1's log.

    Once the requeue takes, Slurm TERMs every process of the attempt and SIGKILLs it KillWait later, maybe
    before `scontrol` has even returned: nothing the shell prints after `scontrol requeue` is asserted."""
    job = tmp_path / "job.sbatch"
    job.write_text(
        textwrap.dedent("""\
        #!/bin/bash
        #SBATCH --job-name=requeue --nodes=2 --ntasks-per-node=1 --output=job-%j.out --open-mode=append
        set -uo pipefail
        attempt=${SLURM_RESTART_COUNT:-0}
        echo "ATTEMPT $attempt"
        on_usr1() {
            echo "BATCH_GOT_USR1 $attempt"
            if [ "$attempt" -lt 1 ]; then trap '' TERM; echo "REQUEUEING"; scontrol requeue "$SLURM_JOB_ID"; fi
        }
        trap on_usr1 USR1
        # every task records a USR1 it receives; otherwise it runs until the step ends
        srun bash -c 'trap "touch step-got-usr1-$SLURM_PROCID" USR1; touch "step-up-$SLURM_PROCID";
                      for i in $(seq 1 $1); do sleep 0.2; done' _ "$([ "$attempt" -lt 1 ] && echo 300 || echo 5)" &
        wait
        wait
        echo "END $attempt"
        """)
    )
    jid = cluster.sbatch(job)
    cluster.wait_state(jid, {"RUNNING"}, timeout=60)
    assert _wait_files(tmp_path, ["step-up-0", "step-up-1"], 60), "the step's tasks did not start"
    cluster.run("scancel", "--signal=USR1", "--batch", str(jid))
    info = cluster.wait_done(jid, timeout=180)
    log = (tmp_path / f"job-{jid}.out").read_text()
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}"
    assert info["Restarts"] == "1", info
    # attempt 0's lines are still in the file (append), followed by attempt 1's ("END 0" may or may not
    # make it out before the requeue kills attempt 0's shell)
    lines = [
        ln
        for ln in log.splitlines()
        if ln.split(" ")[0] in ("ATTEMPT", "BATCH_GOT_USR1", "REQUEUEING", "END")
    ]
    lines = [ln for ln in lines if ln != "END 0"]
    assert lines == ["ATTEMPT 0", "BATCH_GOT_USR1 0", "REQUEUEING", "ATTEMPT 1", "END 1"], log
    assert not list(tmp_path.glob("step-got-usr1-*")), "USR1 reached the step's tasks"


def _wait_files(d: Path, names: list[str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((d / n).exists() for n in names):
            return True
        time.sleep(0.2)
    return False
