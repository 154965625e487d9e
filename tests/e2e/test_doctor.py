"""`sbatch-gen doctor` against the real local Slurm (scripts/local-slurm.sh): the committed local profile is
clean, and each check fails with its own row when its field is wrong. Only `sbatch --test-only` and read-only
scontrol: no job is submitted.

What the local cluster has (docs/local-slurm.md): debug (GraceTime 120, PreemptMode REQUEUE), sunk (GraceTime
0, so KillWait 5 s), lab (AllowAccounts=lab AllowQos=normal), short (MaxTime 00:10:00), high (PreemptMode
OFF), gpu (g1, g2: gpu:h200:8; gh1: gpu:gh200:1); Slurm 22.05; slurmdbd enforcing associations and QOS:
root may use accounts sbgen (its default), lab and llm-xr with QOS normal and urgent.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from e2e_lib import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # the real Slurm controller, several CLI runs

SITES = REPO / "sites"


def doctor(cluster, tmp_path, site: str = "local", *sets: str, as_json: bool = True):
    """`sbatch-gen doctor` from a directory of its own (where a user would submit from): (exit code, rows by
    check name, JSON document or table text)."""
    cmd = [str(REPO / ".venv" / "bin" / "sbatch-gen"), "doctor", "--site", site, "--sites-dir", str(SITES)]
    for s in sets:
        cmd += ["--set", s]
    if as_json:
        cmd.append("--json")
    p = subprocess.run(cmd, env=cluster.env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert p.returncode in (0, 1), f"exit {p.returncode}:\n{p.stdout}\n{p.stderr}"
    if not as_json:
        return p.returncode, {}, p.stdout
    doc = json.loads(p.stdout)
    assert doc["ok"] == (p.returncode == 0)
    return p.returncode, {c["check"]: c for c in doc["checks"]}, doc


def test_local_profile_is_clean(cluster, tmp_path):
    code, rows, doc = doctor(cluster, tmp_path)
    assert code == 0, json.dumps(doc, indent=1)
    assert doc["site"] == "local" and doc["kind"] == "slurm"
    bad = {k: r for k, r in rows.items() if r["verdict"] in ("error", "warn")}
    assert not bad, bad
    for check in (
        "test-only local.sbatch",
        "test-only local.setup.sbatch",
        "partition",
        "cpus",
        "nodes",
        "version",
    ):
        assert rows[check]["verdict"] == "ok", rows[check]
    assert "on n[1-2]" in rows["test-only local.sbatch"]["found"]  # Slurm's own plan: both nodes
    assert rows["version"]["found"].startswith("Slurm 22.05.")
    pre = rows["preemption"]
    grace = cluster.info["SBATCH_GEN_SLURM_GRACE_S"]
    assert pre["verdict"] == "ok" and f"GraceTime={grace} s" in pre["found"] and ">= 30 s" in pre["expected"]
    assoc = rows["associations"]
    assert assoc["verdict"] == "ok" and "sbgen" in assoc["found"] and "llm-xr" in assoc["found"], assoc
    assert rows["requeue"]["verdict"] == "ok"
    # the table: the same rows, aligned, nothing to do
    code, _, text = doctor(cluster, tmp_path, as_json=False)
    assert code == 0 and "what to do:" not in text
    assert text.splitlines()[-1].startswith("0 error(s), 0 warning(s)")


def test_unknown_partition(cluster, tmp_path):
    code, rows, _ = doctor(cluster, tmp_path, "local", "slurm.partition=nope")
    assert code == 1
    r = rows["partition"]
    assert r["verdict"] == "error" and "no partition nope" in r["found"]
    assert cluster.partition in r["hint"] and cluster.info["SBATCH_GEN_SLURM_GPU_PARTITION"] in r["hint"]
    # Slurm itself refuses the render too, in its own words
    t = rows["test-only local.sbatch"]
    assert t["verdict"] == "error" and "Invalid partition name specified" in t["hint"]
    assert rows["nodes"]["verdict"] == rows["preemption"]["verdict"] == "skip"


def test_gpu_site_on_a_cpu_partition(cluster, tmp_path):
    code, rows, _ = doctor(cluster, tmp_path, "eu", f"slurm.partition={cluster.partition}")
    assert code == 1
    assert rows["gpus"]["verdict"] == "error" and "gpu:h200:8" in rows["gpus"]["hint"]
    assert rows["test-only eu.sbatch"]["verdict"] == "error"


def test_gpu_type_the_gpu_nodes_lack(cluster, tmp_path):
    gpu = cluster.info["SBATCH_GEN_SLURM_GPU_PARTITION"]
    # first the right type: the GPU rows pass on the fake H200 nodes
    code, rows, doc = doctor(cluster, tmp_path, "eu", f"slurm.partition={gpu}")
    assert rows["gpus"]["verdict"] == rows["nodes"]["verdict"] == rows["constraint"]["verdict"] == "ok", doc
    assert f"{cluster.node_prefix}g1, {cluster.node_prefix}g2" in rows["gpus"]["found"]
    assert rows["test-only eu.sbatch"]["verdict"] == "ok"
    code, rows, _ = doctor(cluster, tmp_path, "eu", f"slurm.partition={gpu}", "slurm.gpu_type=a100")
    assert code == 1
    r = rows["gpus"]
    assert r["verdict"] == "error" and "gpu:h200:8" in r["found"] and "gpu:gh200:1" in r["found"]
    assert rows["nodes"]["verdict"] == "error"


def test_account_the_partition_does_not_allow(cluster, tmp_path):
    lab = cluster.info["SBATCH_GEN_SLURM_ACCOUNTS_PARTITION"]
    code, rows, _ = doctor(cluster, tmp_path, "local", f"slurm.partition={lab}", "slurm.account=nope")
    assert code == 1
    r = rows["account"]
    assert r["verdict"] == "error" and r["found"] == "AllowAccounts=lab"
    assert "set slurm.account to one of lab" in r["hint"]
    # the accounting database enforces it: Slurm refuses the render too, and the user has no such account
    assert rows["test-only local.sbatch"]["verdict"] == "error"
    assert "account" in rows["test-only local.sbatch"]["hint"].lower()
    assert rows["associations"]["verdict"] == "error"
    code, rows, _ = doctor(
        cluster, tmp_path, "local", f"slurm.partition={lab}", "slurm.account=lab", "slurm.qos=normal"
    )
    assert rows["account"]["verdict"] == rows["qos"]["verdict"] == "ok"


def test_account_without_an_association(cluster, tmp_path):
    """An account that exists nowhere, on a partition that allows every account: only the association check
    (and Slurm's own --test-only) catch it."""
    code, rows, _ = doctor(cluster, tmp_path, "local", "slurm.account=nope")
    assert code == 1
    r = rows["associations"]
    assert r["verdict"] == "error" and "no association with account nope" in r["hint"]
    assert "sbgen" in r["hint"] and "llm-xr" in r["hint"]
    assert rows["account"]["verdict"] != "error"  # the partition has no AllowAccounts list
    assert rows["test-only local.sbatch"]["verdict"] == "error"


def test_qos_the_user_may_not_use(cluster, tmp_path):
    code, rows, _ = doctor(cluster, tmp_path, "local", "slurm.qos=nope")
    assert code == 1
    r = rows["associations"]
    assert r["verdict"] == "error" and "QOS nope is not among your association's" in r["hint"], r
    assert "normal" in r["hint"]
    assert rows["test-only local.sbatch"]["verdict"] == "error"


def test_time_beyond_the_partitions_max_time(cluster, tmp_path):
    """The short partition ends jobs after 00:10:00; the local profile asks for 00:30:00."""
    short = cluster.info["SBATCH_GEN_SLURM_SHORT_PARTITION"]
    max_time = cluster.info["SBATCH_GEN_SLURM_SHORT_MAXTIME"]
    code, rows, _ = doctor(cluster, tmp_path, "local", f"slurm.partition={short}")
    assert code == 1
    r = rows["time limit"]
    assert r["verdict"] == "error" and f"MaxTime={max_time}" in r["found"], r
    assert f"lower slurm.time to at most {max_time}" in r["hint"]
    # Slurm accepts it (EnforcePartLimits=NO, its default): the job would pend for ever (PartitionTimeLimit)
    assert rows["test-only local.sbatch"]["verdict"] == "ok"
    code, rows, _ = doctor(cluster, tmp_path, "local", f"slurm.partition={short}", "slurm.time=00:10:00")
    assert rows["time limit"]["verdict"] == "ok" and rows["test-only local.sbatch"]["verdict"] == "ok"


def test_version_mismatch_is_a_warning(cluster, tmp_path):
    code, rows, _ = doctor(cluster, tmp_path, "local", "slurm.version=23.11")
    assert code == 0
    r = rows["version"]
    assert r["verdict"] == "warn" and r["found"].startswith("Slurm 22.05.")
    assert "set slurm.version to '22.05'" in r["hint"]
    assert [k for k, v in rows.items() if v["verdict"] == "warn"] == ["version"]
    code, _, text = doctor(cluster, tmp_path, "local", "slurm.version=23.11", as_json=False)
    assert code == 0 and "  warn version: the cluster runs Slurm 22.05." in text


def test_grace_time_zero_leaves_only_kill_wait(cluster, tmp_path):
    """The sunk partition is what SUNK does by default: GraceTime 0, so a preemption gives KillWait seconds
    (5 here, 30 on SUNK) between SIGTERM and SIGKILL; checkpoint_s + margin_s is 10 + 20."""
    sunk = cluster.info["SBATCH_GEN_SLURM_SUNK_PARTITION"]
    kill_wait = cluster.info["SBATCH_GEN_SLURM_KILLWAIT_S"]
    code, rows, _ = doctor(cluster, tmp_path, "local", f"slurm.partition={sunk}")
    assert code == 0  # a warning
    r = rows["preemption"]
    assert r["verdict"] == "warn" and f"GraceTime=0: KillWait={kill_wait} s" in r["found"]
    assert f"GraceTime of at least 30 s on partition {sunk}" in r["hint"]
    # named in the hint, or in found when the cluster has it (`local-slurm.sh preempt-signal on`, which other
    # end-to-end tests turn on for a while)
    assert "preempt_send_user_signal" in r["hint"] + r["found"]


def test_partition_without_preemption(cluster, tmp_path):
    """The high partition is PreemptMode OFF (doctor only reads it: no job goes there)."""
    high = cluster.info["SBATCH_GEN_SLURM_PREEMPTOR_PARTITION"]
    code, rows, _ = doctor(cluster, tmp_path, "local", f"slurm.partition={high}")
    r = rows["preemption"]
    assert r["verdict"] == "ok" and "not preempted" in r["found"]
