"""`sbatch-gen doctor --site NAME` against canned command outputs (no Slurm, no ssh): every check's ok and
failing rows, the table and the JSON, the exit codes, and a missing sbatch. The same checks against the real
local Slurm: tests/e2e/test_doctor.py; against a real sshd: tests/ssh/test_ssh_doctor.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sbatch_gen.doctor import Report, format_report, run_doctor
from sbatch_gen.doctor.common import (
    CommandMissing,
    Result,
    SubprocessRunner,
    grace_seconds,
    limit_seconds,
    parse_config,
    parse_oneliner,
)
from sbatch_gen.doctor.slurm import check_requeue
from sbatch_gen.doctor.slurm_facts import SlurmDoctor, SlurmFacts
from sbatch_gen.doctor.slurm_nodes import features_match, node_gpus, node_usable
from sbatch_gen.doctor.ssh import parse_probe, probe_script, ssh_argv
from sbatch_gen.loader import load_site
from sbatch_gen.render import Rendered, render_site

from .conftest import REPO, sg

SITES = REPO / "sites"

# ---------------------------------------------------------------------------------------------------
# A fake Slurm: what the local cluster prints (scripts/local-slurm.sh), as dicts the tests change


def _config(**over: str) -> dict[str, str]:
    cfg = {
        "AccountingStorageEnforce": "none",
        "AccountingStorageType": "accounting_storage/none",
        "JobRequeue": "1",
        "KillWait": "5 sec",
        "PreemptMode": "REQUEUE",
        "PreemptType": "preempt/partition_prio",
        "SlurmctldParameters": "(null)",
        "SLURM_VERSION": "22.05.8",
    }
    cfg.update(over)
    return cfg


def _partition(name: str, **over: str) -> dict[str, str]:
    p = {
        "PartitionName": name,
        "AllowGroups": "ALL",
        "AllowAccounts": "ALL",
        "AllowQos": "ALL",
        "Default": "NO",
        "GraceTime": "120",
        "MaxNodes": "UNLIMITED",
        "MaxTime": "UNLIMITED",
        "Nodes": "n[1-2]",
        "PriorityTier": "1",
        "PreemptMode": "REQUEUE",
        "State": "UP",
        "TotalCPUs": "16",
        "TotalNodes": "2",
        "TRES": "cpu=16,mem=32000M,node=2,billing=16",
    }
    p.update(over)
    return p


def _node(name: str, partitions: str, **over: str) -> dict[str, str]:
    n = {
        "NodeName": name,
        "Arch": "x86_64",
        "CPUAlloc": "0",
        "CPUEfctv": "8",
        "CPUTot": "8",
        "AvailableFeatures": "(null)",
        "ActiveFeatures": "(null)",
        "Gres": "(null)",
        "NodeAddr": "10.200.0.11",
        "Version": "22.05.8",
        "OS": "Linux 6.18.44-fc-v1045 #1 SMP PREEMPT_DYNAMIC @0",
        "RealMemory": "16000",
        "State": "IDLE",
        "Partitions": partitions,
        "CfgTRES": "cpu=8,mem=16000M,billing=8",
    }
    n.update(over)
    return n


def _oneliner(rec: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in rec.items())


GPU_NODES = {
    "g1": {
        "CPUEfctv": "224",
        "CPUTot": "224",
        "Gres": "gpu:h200:8(S:0-1)",
        "AvailableFeatures": "ib,x86_64,h200",
    },
    "g2": {
        "CPUEfctv": "224",
        "CPUTot": "224",
        "Gres": "gpu:h200:8(S:0-1)",
        "AvailableFeatures": "ib,x86_64,h200",
    },
    "gh1": {"CPUEfctv": "72", "CPUTot": "72", "Gres": "gpu:gh200:1", "AvailableFeatures": "aarch64,gh200"},
}


@dataclass
class FakeSlurm:
    """A runner with canned outputs; records every command line (and the script each test-only got)."""

    config: dict[str, str] = field(default_factory=_config)
    partitions: dict[str, dict[str, str]] = field(default_factory=dict)
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    test_only: Result = Result(
        0,
        "",
        "sbatch: Job 7 to start at 2026-12-02T12:00:00 using 4 processors on nodes n[1-2] in partition debug\n",
    )
    assoc: str = ""
    qos: str = ""
    srun_help: str = (
        "Usage: srun [OPTIONS(0)...]\n      --container             Path to OCI container bundle\n"
    )
    missing: set[str] = field(default_factory=set)
    real_python: bool = False  # run the site's python for real (else a canned torch 2.13)
    fail: dict[str, Result] = field(default_factory=dict)
    calls: list[list[str]] = field(default_factory=list)
    scripts: list[str] = field(default_factory=list)
    cwds: list[Path | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.partitions:
            self.partitions = {
                "debug": _partition("debug", Default="YES"),
                "sunk": _partition("sunk", GraceTime="0"),
                "lab": _partition("lab", GraceTime="0", AllowAccounts="lab", AllowQos="normal"),
                "high": _partition("high", GraceTime="0", PriorityTier="10", PreemptMode="OFF"),
                "gpu": _partition("gpu", GraceTime="0", Nodes="g[1-2],gh1", TotalNodes="3"),
            }
        if not self.nodes:
            self.nodes = {
                "n1": _node("n1", "debug,sunk,lab,high"),
                "n2": _node("n2", "debug,sunk,lab,high", NodeAddr="10.200.0.12"),
                **{k: _node(k, "gpu", **v) for k, v in GPU_NODES.items()},
            }

    def __call__(
        self, argv: Sequence[str], *, cwd: Path | None = None, timeout_s: float | None = None
    ) -> Result:
        argv = list(argv)
        self.calls.append(argv)
        if argv[0] in self.missing:
            raise CommandMissing(argv[0])
        key = " ".join(argv[:3])
        for prefix, res in self.fail.items():
            if key.startswith(prefix):
                return res
        if argv[:2] == ["sbatch", "--test-only"]:
            self.scripts.append(Path(argv[2]).read_text())
            self.cwds.append(cwd)
            return self.test_only
        if argv[:3] == ["scontrol", "show", "config"]:
            return Result(
                0,
                "Configuration data as of 2026-12-02T12:00:00\n"
                + "".join(f"{k:23} = {v}\n" for k, v in self.config.items())
                + "\nSlurmctld(primary) at localhost is UP\n",
            )
        if argv[:4] == ["scontrol", "-o", "show", "partition"]:
            return Result(0, "".join(_oneliner(p) + "\n" for p in self.partitions.values()))
        if argv[:4] == ["scontrol", "-o", "show", "node"]:
            return Result(0, "".join(_oneliner(n) + "\n" for n in self.nodes.values()))
        if argv[:2] == ["scontrol", "version"]:
            return Result(0, f"slurm {self.config.get('SLURM_VERSION', '22.05.8')}\n")
        if argv[:4] == ["sacctmgr", "-n", "-P", "show"] and argv[4] == "assoc":
            return Result(0, self.assoc)
        if argv[:4] == ["sacctmgr", "-n", "-P", "show"] and argv[4] == "qos":
            return Result(0, self.qos)
        if argv[:2] == ["srun", "--help"]:
            return Result(0, self.srun_help)
        if argv[0].endswith("/bin/python"):  # the site's own python (the torch row)
            if not self.real_python:  # a torch that has every flag
                flags = "--numa-binding --signals-to-handle --shutdown-timeout"
                return Result(0, json.dumps({"found": {"torch": True}, "run_py": flags, "version": "2.13.0"}))
            r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)
            return Result(r.returncode, r.stdout, r.stderr)
        raise AssertionError(f"unexpected command {argv}")


def doctor(fake: FakeSlurm, site: str = "local", *overrides: str, cwd: Path | None = None) -> Report:
    return run_doctor(load_site(SITES, site, overrides), fake, cwd=cwd)


def row(report: Report, check: str):
    (r,) = [c for c in report.checks if c.check == check]
    return r


def verdicts(report: Report) -> dict[str, str]:
    return {c.check: c.verdict for c in report.checks}


# ---------------------------------------------------------------------------------------------------
# Parsers


def test_parse_oneliner_keeps_values_with_spaces_and_equals():
    rec = parse_oneliner(
        "NodeName=n1 OS=Linux 6.1 #1 SMP @0 TRES=cpu=16,mem=32G Gres=gpu:h200:8(S:0-1) State=IDLE+DRAIN"
    )
    assert rec["OS"] == "Linux 6.1 #1 SMP @0"
    assert rec["TRES"] == "cpu=16,mem=32G"
    assert rec["Gres"] == "gpu:h200:8(S:0-1)"
    assert rec["State"] == "IDLE+DRAIN"


def test_parse_config_and_times():
    cfg = parse_config(
        "Configuration data as of x\nKillWait                = 30 sec\nSlurmctldParameters = a,b\n\nCgroup Support:\n"
    )
    assert cfg == {"KillWait": "30 sec", "SlurmctldParameters": "a,b"}
    assert limit_seconds("UNLIMITED") == limit_seconds("INFINITE") == float("inf")
    assert limit_seconds("2-00:00:00") == 172800
    assert limit_seconds("04:00:00") == 14400
    assert limit_seconds("30") == 1800  # minutes
    assert limit_seconds("soon") is None
    assert grace_seconds("120") == 120
    assert grace_seconds("00:05:00") == 300
    assert grace_seconds("00:00:00") == grace_seconds("") == 0


def test_gres_features_and_node_states():
    assert node_gpus("gpu:h200:8(S:0-1)", "h200") == 8
    assert node_gpus("gpu:h200:8(S:0-1)", "H200") == 8
    assert node_gpus("gpu:h200:8(S:0-1)", "a100") == 0
    assert node_gpus("gpu:a100:4,gpu:v100:2,nic:1", None) == 6
    assert node_gpus("gpu:4", None) == 4
    assert node_gpus("gpu:4", "h200") == 0  # an untyped GRES cannot be asked for by type
    assert node_gpus("(null)", None) == 0
    assert features_match("ib&h200", ["ib", "x86_64", "h200"]) is True
    assert features_match("ib", ["aarch64"]) is False
    assert features_match("ib|nvme", ["nvme"]) is True
    assert features_match("[rack1|rack2]", ["rack1"]) is None  # not evaluated: the test-only row checks it
    assert node_usable({"State": "MIXED"}) and node_usable({"State": "IDLE~"})
    assert not node_usable({"State": "IDLE+DRAIN"}) and not node_usable({"State": "DOWN*"})
    assert not node_usable({"State": "IDLE*"})


# ---------------------------------------------------------------------------------------------------
# The committed local profile on the fake local cluster: clean


def test_local_profile_is_clean_and_test_only_gets_a_fresh_render(tmp_path):
    fake = FakeSlurm()
    rep = doctor(fake, cwd=tmp_path)
    assert rep.ok, format_report(rep)
    assert {c.verdict for c in rep.checks} <= {"ok", "skip"}, format_report(rep)
    v = verdicts(rep)
    for c in (
        "test-only local.sbatch",
        "test-only local.setup.sbatch",
        "partition",
        "time limit",
        "cpus",
        "nodes",
    ):
        assert v[c] == "ok", c
    assert v["gpus"] == v["pyxis"] == v["associations"] == "skip"
    # both scripts, as rendered now, from the directory the user is in
    rendered = render_site(load_site(SITES, "local"))
    assert fake.scripts == [r.text for r in rendered]
    assert fake.cwds == [tmp_path, tmp_path]
    assert "would start 2026-12-02T12:00:00 on n[1-2]" in row(rep, "test-only local.sbatch").found
    pre = row(rep, "preemption")
    assert pre.verdict == "ok" and "GraceTime=120 s" in pre.found and ">= 30 s" in pre.expected
    # read-only: nothing but show/version/help/--test-only
    for argv in fake.calls:
        assert argv[:2] == ["sbatch", "--test-only"] or argv[0] in ("scontrol", "sacctmgr", "srun")
        assert "update" not in argv and "requeue" not in argv


# ---------------------------------------------------------------------------------------------------
# 1. test-only


def test_test_only_refused_is_an_error_with_slurms_message():
    fake = FakeSlurm(
        test_only=Result(1, "", "allocation failure: Requested node configuration is not available\n")
    )
    rep = doctor(fake)
    r = row(rep, "test-only local.sbatch")
    assert r.verdict == "error" and "Requested node configuration is not available" in r.found
    assert "Requested node configuration" in (r.hint or "")
    assert not rep.ok


# ---------------------------------------------------------------------------------------------------
# 2. partition and time limit


def test_unknown_partition_names_the_partitions_and_skips_what_depends_on_it():
    rep = doctor(FakeSlurm(), "local", "slurm.partition=debgu")
    r = row(rep, "partition")
    assert r.verdict == "error"
    assert "debug, gpu, high, lab, sunk" in r.found and "did you mean 'debug'" in (r.hint or "")
    v = verdicts(rep)
    assert v["time limit"] == v["cpus"] == v["nodes"] == v["preemption"] == v["account"] == "skip"


def test_partition_down_is_an_error():
    fake = FakeSlurm()
    fake.partitions["debug"]["State"] = "DOWN"
    r = row(doctor(fake), "partition")
    assert r.verdict == "error" and r.found == "State=DOWN"


@pytest.mark.parametrize(
    "max_time, verdict",
    [("UNLIMITED", "ok"), ("1-00:00:00", "ok"), ("00:30:00", "ok"), ("00:20:00", "error")],
)
def test_time_limit_against_max_time(max_time, verdict):
    fake = FakeSlurm()
    fake.partitions["debug"]["MaxTime"] = max_time
    r = row(doctor(fake), "time limit")
    assert r.verdict == verdict, r
    assert f"MaxTime={max_time}" in r.found
    if verdict == "error":
        assert "lower slurm.time to at most 00:20:00" in (r.hint or "")


# ---------------------------------------------------------------------------------------------------
# 3. nodes: GPUs, CPUs, memory, features, count


def test_gpu_site_on_the_gpu_nodes():
    rep = doctor(FakeSlurm(), "eu", "slurm.partition=gpu")
    v = verdicts(rep)
    assert v["gpus"] == v["cpus"] == v["constraint"] == v["nodes"] == "ok", format_report(rep)
    assert "2 of 3 nodes: g1, g2" in row(rep, "gpus").found
    assert v["memory"] == "skip"  # mem: 0


def test_gpu_type_the_nodes_lack():
    rep = doctor(FakeSlurm(), "eu", "slurm.partition=gpu", "slurm.gpu_type=a100")
    r = row(rep, "gpus")
    assert r.verdict == "error" and "gpu:h200:8(S:0-1) (g1, g2)" in r.found and "gpu:gh200:1 (gh1)" in r.found
    assert "gpu:a100:8" in (r.hint or "")
    assert row(rep, "nodes").verdict == "error"


def test_gpu_site_on_cpu_nodes():
    rep = doctor(FakeSlurm(), "eu", "slurm.partition=debug")
    assert row(rep, "gpus").verdict == "error"
    assert row(rep, "cpus").verdict == "error" and "at most 8 CPUs" in row(rep, "cpus").found
    assert row(rep, "constraint").verdict == "error"


def test_cpus_memory_and_node_count():
    rep = doctor(FakeSlurm(), "local", "slurm.cpus_per_task=16")
    assert row(rep, "cpus").verdict == "error" and "cpus_per_task to at most 8" in (
        row(rep, "cpus").hint or ""
    )
    rep = doctor(FakeSlurm(), "local", "slurm.mem=32G")
    assert row(rep, "memory").verdict == "error" and "RealMemory=16000" in row(rep, "memory").found
    assert row(doctor(FakeSlurm(), "local", "slurm.mem=8G"), "memory").verdict == "ok"
    rep = doctor(FakeSlurm(), "local", "slurm.nodes=3")
    assert row(rep, "nodes").verdict == "error" and "2 of 2 nodes" in row(rep, "nodes").found


def test_a_drained_node_is_a_warning_and_max_nodes_an_error():
    fake = FakeSlurm()
    fake.nodes["n2"]["State"] = "IDLE+DRAIN"
    r = row(doctor(fake), "nodes")
    assert r.verdict == "warn" and "IDLE+DRAIN (n2)" in r.found
    fake = FakeSlurm()
    fake.partitions["debug"]["MaxNodes"] = "1"
    r = row(doctor(fake), "nodes")
    assert r.verdict == "error" and "MaxNodes=1" in r.found


# ---------------------------------------------------------------------------------------------------
# 4. account, QOS, associations


def test_account_and_qos_against_the_partition_lists():
    rep = doctor(FakeSlurm(), "local", "slurm.partition=lab", "slurm.account=nope")
    r = row(rep, "account")
    assert r.verdict == "error" and r.found == "AllowAccounts=lab"
    assert "set slurm.account to one of lab" in (r.hint or "") and "accounting database" in (r.hint or "")
    rep = doctor(FakeSlurm(), "local", "slurm.partition=lab", "slurm.account=lab", "slurm.qos=normal")
    assert row(rep, "account").verdict == row(rep, "qos").verdict == "ok"
    rep = doctor(FakeSlurm(), "local", "slurm.partition=lab", "slurm.account=lab", "slurm.qos=high")
    assert row(rep, "qos").verdict == "error" and "AllowQos=normal" in row(rep, "qos").found
    rep = doctor(
        FakeSlurm(), "local", "slurm.partition=lab"
    )  # no account: the partition may refuse the default
    assert row(rep, "account").verdict == "warn"
    fake = FakeSlurm()
    fake.partitions["debug"]["DenyAccounts"] = "banned"
    assert row(doctor(fake, "local", "slurm.account=banned"), "account").verdict == "error"
    assert row(doctor(fake, "local", "slurm.account=fine"), "account").verdict == "ok"


def test_associations_not_enforced_without_slurmdbd_or_enforce():
    r = row(doctor(FakeSlurm()), "associations")
    assert r.verdict == "skip" and "not enforced" in r.found and "accounting_storage/none" in r.found
    fake = FakeSlurm(config=_config(AccountingStorageType="accounting_storage/slurmdbd"))
    r = row(doctor(fake), "associations")
    assert r.verdict == "skip" and "AccountingStorageEnforce=none" in r.found
    assert not any(c[0] == "sacctmgr" for c in fake.calls)


def _dbd(**over: str) -> FakeSlurm:
    return FakeSlurm(
        config=_config(
            AccountingStorageType="accounting_storage/slurmdbd",
            AccountingStorageEnforce="associations,limits,qos",
        ),
        **over,
    )


def test_associations_with_slurmdbd():
    fake = _dbd(assoc="lab|normal,high\nother|normal\n")
    r = row(doctor(fake, "local", "slurm.account=lab", "slurm.qos=high"), "associations")
    assert r.verdict == "ok" and "accounts: lab, other" in r.found, r
    (call,) = [c for c in fake.calls if c[:1] == ["sacctmgr"] and "assoc" in c]
    assert call[-1] == "format=account,qos" and call[-2].startswith("user=")
    r = row(doctor(_dbd(assoc="lab|normal\n"), "local", "slurm.account=nope"), "associations")
    assert r.verdict == "error" and "no association with account nope" in (r.hint or "")
    r = row(
        doctor(_dbd(assoc="lab|normal\n"), "local", "slurm.account=lab", "slurm.qos=high"), "associations"
    )
    assert r.verdict == "error" and "QOS high" in (r.hint or "")
    r = row(doctor(_dbd(assoc="")), "associations")
    assert r.verdict == "error" and "no association for user" in r.found
    fake = _dbd(fail={"sacctmgr -n -P": Result(1, "", "sacctmgr: error: slurmdbd: Connection refused\n")})
    r = row(doctor(fake), "associations")
    assert r.verdict == "warn" and "Connection refused" in r.found
    r = row(doctor(_dbd(missing={"sacctmgr"})), "associations")
    assert r.verdict == "warn" and r.found == "sacctmgr not found"


# ---------------------------------------------------------------------------------------------------
# 5. version


@pytest.mark.parametrize(
    "profile, running, verdict",
    [
        ("22.05", "22.05.8", "ok"),
        ("22.05.8", "22.05.8", "ok"),
        ("22.05.7", "22.05.8", "warn"),
        ("23.11", "22.05.8", "warn"),
    ],
)
def test_version(profile, running, verdict):
    rep = doctor(FakeSlurm(config=_config(SLURM_VERSION=running)), "local", f"slurm.version={profile}")
    r = row(rep, "version")
    assert r.verdict == verdict and r.found == f"Slurm {running}"
    if verdict == "warn":
        assert rep.ok  # a warning does not fail the doctor
        assert "set slurm.version to '22.05'" in (r.hint or "")


def test_version_from_scontrol_version_when_the_config_lacks_it():
    cfg = _config()
    del cfg["SLURM_VERSION"]
    assert row(doctor(FakeSlurm(config=cfg)), "version").found == "Slurm 22.05.8"


# ---------------------------------------------------------------------------------------------------
# 6. preemption


def test_preemption_grace_time_zero_leaves_kill_wait():
    """SUNK: GraceTime 0, KillWait 30 (here 5): shorter than checkpoint_s + margin_s = 30 s: a warning that
    says what to ask for."""
    rep = doctor(FakeSlurm(), "local", "slurm.partition=sunk")
    r = row(rep, "preemption")
    assert r.verdict == "warn" and "GraceTime=0: KillWait=5 s" in r.found
    assert "GraceTime of at least 30 s on partition sunk" in (r.hint or "")
    assert "preempt_send_user_signal" in (r.hint or "")
    assert rep.ok
    # KillWait 30 (SUNK's default) is just enough for 10 + 20
    r = row(
        doctor(FakeSlurm(config=_config(KillWait="30 sec")), "local", "slurm.partition=sunk"), "preemption"
    )
    assert r.verdict == "ok", r


def test_preemption_grace_time_short():
    fake = FakeSlurm()
    fake.partitions["debug"]["GraceTime"] = "20"
    r = row(doctor(fake), "preemption")
    assert r.verdict == "warn" and "a preemption leaves 20 s" in (r.hint or "")
    fake = FakeSlurm(config=_config(SlurmctldParameters="enable_configless,preempt_send_user_signal"))
    fake.partitions["debug"]["GraceTime"] = "20"
    r = row(doctor(fake), "preemption")
    assert "preempt_send_user_signal" in r.found and "also sends" not in (r.hint or "")


def test_preemption_off_none_suspend_cancel():
    r = row(doctor(FakeSlurm(), "local", "slurm.partition=high"), "preemption")
    assert r.verdict == "ok" and "not preempted" in r.found
    r = row(doctor(FakeSlurm(config=_config(PreemptType="preempt/none"))), "preemption")
    assert r.verdict == "ok" and "does not preempt" in r.found
    fake = FakeSlurm()
    fake.partitions["debug"]["PreemptMode"] = "SUSPEND,GANG"
    r = row(doctor(fake), "preemption")
    assert r.verdict == "warn" and "suspended job keeps its GPUs" in (r.hint or "")
    fake = FakeSlurm()
    fake.partitions["debug"]["PreemptMode"] = "CANCEL"
    r = row(doctor(fake), "preemption")
    assert r.verdict == "warn" and "not requeued" in (r.hint or "")


def _by_qos(qos: str, dbd: bool = True) -> FakeSlurm:
    acct = "accounting_storage/slurmdbd" if dbd else "accounting_storage/none"
    return FakeSlurm(qos=qos, config=_config(PreemptType="preempt/qos", AccountingStorageType=acct))


SIGNAL90 = ("trainer.stop_protocol=signal", "trainer.stop_grace_s=90", "preemption.lead_time_s=150")


def test_preemption_grace_is_what_the_stop_protocol_needs():
    """stop_protocol signal: torchrun gives the workers trainer.stop_grace_s; the grace must cover that, not
    preemption.checkpoint_s + margin_s. none: no stop checkpoint, no grace needed."""
    fake = FakeSlurm()
    fake.partitions["debug"]["GraceTime"] = "60"  # local: checkpoint_s 10 + margin_s 20 = 30 s fits
    assert row(doctor(fake), "preemption").verdict == "ok"
    r = row(doctor(fake, "local", *SIGNAL90), "preemption")
    assert r.verdict == "warn" and r.expected == "grace >= 90 s (trainer.stop_grace_s)", r
    assert "lower trainer.stop_grace_s to at most 60 s" in (r.hint or ""), r
    r = row(doctor(fake, "local", "trainer.stop_protocol=none"), "preemption")
    assert r.verdict == "ok" and "no stop checkpoint" in r.expected, r


def test_preemption_by_qos():
    """preempt/qos: the QOS's PreemptMode and GraceTime, from the accounting database."""
    fake = _by_qos("normal|requeue|00:05:00\n")
    r = row(doctor(fake, "local", "slurm.qos=normal"), "preemption")
    assert r.verdict == "ok" and "QOS normal" in r.found and "GraceTime=300 s" in r.found, r
    assert [
        "sacctmgr",
        "-n",
        "-P",
        "show",
        "qos",
        "normal",
        "format=name,preemptmode,gracetime",
    ] in fake.calls
    # PreemptMode cluster: the cluster's; a 10 s grace is too short
    r = row(doctor(_by_qos("normal|cluster|00:00:10\n"), "local", "slurm.qos=normal"), "preemption")
    assert r.verdict == "warn" and "on QOS normal" in (r.hint or "") and "PreemptMode=REQUEUE" in r.found
    # no accounting database, or no qos in the profile: the QOS cannot be read
    r = row(doctor(_by_qos("", dbd=False), "local", "slurm.qos=normal"), "preemption")
    assert r.verdict == "warn" and "cannot be read" in r.found
    r = row(doctor(_by_qos("")), "preemption")
    assert r.verdict == "warn" and "slurm.qos is unset" in r.found
    r = row(doctor(_by_qos(""), "local", "slurm.qos=gone"), "preemption")
    assert r.verdict == "error" and "no QOS gone" in r.found


# ---------------------------------------------------------------------------------------------------
# 7. requeue, 8. pyxis


def test_requeue():
    r = row(doctor(FakeSlurm(config=_config(JobRequeue="0"))), "requeue")
    assert r.verdict == "ok" and "JobRequeue=0; the render has #SBATCH --requeue" in r.found
    site = load_site(SITES, "local")
    fake = FakeSlurm(config=_config(JobRequeue="0"))
    bare = Rendered("local.sbatch", "#!/bin/bash\n#SBATCH --partition=debug\n", "slurm.sbatch.j2")
    d = SlurmDoctor(site, site.profile, [bare], SlurmFacts(fake), fake, Path.cwd(), "u")  # type: ignore[arg-type]
    (r,) = check_requeue(d)
    assert r.verdict == "error" and "lacks" in r.found


CONTAINER = ["container={image: 'nvcr.io#nvidia/pytorch:24.10-py3'}", "python_env={kind: none}"]


def test_pyxis():
    assert row(doctor(FakeSlurm()), "pyxis").verdict == "skip"
    r = row(doctor(FakeSlurm(), "local", *CONTAINER), "pyxis")
    assert r.verdict == "error" and "no --container-image" in r.found
    fake = FakeSlurm(srun_help="      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH\n")
    assert row(doctor(fake, "local", *CONTAINER), "pyxis").verdict == "ok"
    r = row(doctor(FakeSlurm(missing={"srun"}), "local", *CONTAINER), "pyxis")
    assert r.verdict == "error" and r.found == "srun not found"


# ---------------------------------------------------------------------------------------------------
# 9. torch


def _venv_with_torch(root: Path, version: str, run_py: str) -> Path:
    """root/.venv/bin/python: this python, seeing a torch of VERSION whose torchrun has RUN_PY."""
    pkg = root / "faketorch" / "torch"
    (pkg / "distributed").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text(f"__version__ = '{version}'\n")
    (pkg / "distributed" / "run.py").write_text(run_py)
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={root / "faketorch"} exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    return python


def test_torch_of_the_sites_venv_against_the_renders_torchrun_flags(tmp_path):
    """The login node sees the venv: its torch must have every torchrun flag the render cannot do without."""
    r = row(doctor(FakeSlurm(real_python=True), cwd=REPO), "torch")  # this checkout's venv: torch 2.13
    assert r.verdict == "ok" and r.found.startswith("torch 2.13") and "shim" not in r.found, r
    assert r.expected == "torch importable (python_env)", r  # sbatch-gen: any torch (the compat shim)
    _venv_with_torch(tmp_path, "2.4.1", "p.add_argument('--rdzv-backend')\n")
    # stop_protocol sbatch-gen: an older torchrun runs through run-trainer's compat shim
    r = row(doctor(FakeSlurm(real_python=True), cwd=tmp_path), "torch")
    assert r.verdict == "ok", r
    assert r.found.endswith(
        "without --signals-to-handle, --shutdown-timeout: torchrun through the compat shim"
    ), r
    # stop_protocol signal: torchrun must forward the signal itself
    r = row(doctor(FakeSlurm(real_python=True), "local", *SIGNAL90, cwd=tmp_path), "torch")
    assert r.verdict == "error" and r.found.startswith("torch 2.4.1 ("), r
    assert r.expected == "torch >= 2.12 (torchrun --shutdown-timeout)", r
    assert (
        "torchrun of torch 2.4.1 has no --signals-to-handle (trainer.stop_protocol: signal): use torch >= 2.10"
        in (r.hint or "")
    ), r
    assert "docs/slurm.md#an-older-torch" in (r.hint or "")
    # numa_binding has no stand-in (eu binds)
    r = row(doctor(FakeSlurm(real_python=True), "eu", "python_env.path=.venv", cwd=tmp_path), "torch")
    assert r.verdict == "error" and r.expected == "torch >= 2.9 (torchrun --numa-binding)", r


def test_torch_not_visible_from_the_login_node_is_a_skip(tmp_path):
    r = row(doctor(FakeSlurm(), cwd=tmp_path), "torch")  # no .venv here
    assert r.verdict == "skip" and "run the setup job" in r.found, r
    r = row(doctor(FakeSlurm(), "local", *CONTAINER), "torch")
    assert r.verdict == "skip" and "the setup job probes it" in r.found, r


# ---------------------------------------------------------------------------------------------------
# Failing commands


def test_an_unreachable_controller_is_one_row_not_one_per_check(tmp_path):
    """A login node whose slurmctld cannot be reached (a DNS failure): every check that asks it would fail the
    same way; one row says so, and what to do. What this host shows alone is still checked: python_env's
    torch and the secrets file."""
    err = Result(1, "", "scontrol: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n")
    rep = doctor(
        FakeSlurm(fail={"scontrol show config": err, "scontrol -o show": err, "sbatch": err}), cwd=tmp_path
    )
    assert [(r.check, r.verdict) for r in rep.checks] == [
        ("controller", "error"),
        ("torch", "skip"),  # no .venv here
        ("secrets", "skip"),  # the local profile names none
    ], rep.checks
    hint = rep.checks[0].hint or ""
    assert (
        "Unknown host" in rep.checks[0].found
        and "only what this host shows was checked (torch, secrets)" in hint
    )
    assert not rep.ok
    # a secrets file the job would stop on is still said
    fake = FakeSlurm(fail={"scontrol show config": err, "scontrol -o show": err, "sbatch": err})
    rep = doctor(fake, "local", *SECRET_SETS, f"slurm.secrets_file={tmp_path / 'none.env'}", cwd=tmp_path)
    r = row(rep, "secrets")
    assert r.verdict == "error" and r.found == f"no {tmp_path / 'none.env'}", r


def test_controller_down_is_an_error_row_not_a_traceback():
    err = Result(1, "", "slurm_load_partitions: Unable to contact slurm controller (connect failure)\n")
    rep = doctor(FakeSlurm(fail={"scontrol -o show": err}))
    r = row(rep, "partition")
    assert r.verdict == "error" and "Unable to contact slurm controller" in r.found
    assert not rep.ok


@pytest.mark.parametrize("missing", ["sbatch", "scontrol"])
def test_missing_slurm_command_stops_with_one_line(monkeypatch, missing):
    fake = FakeSlurm(missing={missing})
    monkeypatch.setattr("sbatch_gen.doctor.SubprocessRunner", lambda timeout_s: fake)
    code, out, err = sg("doctor", "--site", "local", "--sites-dir", str(SITES))
    assert code == 2 and out == ""
    assert err == f"sbatch-gen: {missing} not found: run doctor on the cluster's login node\n"


def test_missing_sbatch_binary_for_real(tmp_path):
    """The real runner, with a PATH that has no Slurm: one line, exit 2 (scontrol: the first command it
    runs, to reach the controller)."""
    r = subprocess.run(
        [sys.executable, "-m", "sbatch_gen.cli", "doctor", "--site", "local", "--sites-dir", str(SITES)],
        env={"PATH": str(tmp_path), "HOME": str(tmp_path)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr == "sbatch-gen: scontrol not found: run doctor on the cluster's login node\n"


def test_subprocess_runner_timeout_and_missing(tmp_path):
    run = SubprocessRunner(timeout_s=0.3)
    res = run(["sleep", "5"])
    assert res.rc == 124 and "did not answer within 0.3 s" in res.err
    with pytest.raises(CommandMissing) as e:
        run([str(tmp_path / "no-such-program")])
    assert e.value.name.endswith("no-such-program")
    res = run(["sh", "-c", "echo out; echo err >&2; exit 3"], cwd=tmp_path)
    assert (res.rc, res.out, res.err) == (3, "out\n", "err\n")


# ---------------------------------------------------------------------------------------------------
# The CLI: table, JSON, exit codes


def test_cli_table_hints_and_exit_codes(monkeypatch):
    fake = FakeSlurm()
    monkeypatch.setattr("sbatch_gen.doctor.SubprocessRunner", lambda timeout_s: fake)
    code, out, err = sg("doctor", "--site", "local", "--sites-dir", str(SITES))
    assert code == 0, out + err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("check "))
    assert lines[header].split() == ["check", "expected", "found", "verdict"]
    col = lines[header].index("verdict")
    assert all(
        line[col:].split()[0] in ("ok", "skip") for line in lines[header + 2 : header + 2 + 16] if line
    )
    assert "what to do:" not in out and lines[-1].startswith("0 error(s), 0 warning(s)")
    # a warning: exit 0, its hint under the table
    code, out, _ = sg("doctor", "--site", "local", "--sites-dir", str(SITES), "--set", "slurm.partition=sunk")
    assert code == 0
    assert "what to do:\n  warn preemption: a preemption leaves 5 s" in out
    # an error: exit 1
    code, out, _ = sg("doctor", "--site", "local", "--sites-dir", str(SITES), "--set", "slurm.partition=nope")
    assert code == 1 and "  error partition: set slurm.partition to one of debug, gpu, high, lab, sunk" in out
    assert out.splitlines()[-1].endswith("fix the errors first")


def test_cli_json(monkeypatch):
    fake = FakeSlurm()
    monkeypatch.setattr("sbatch_gen.doctor.SubprocessRunner", lambda timeout_s: fake)
    code, out, _ = sg(
        "doctor", "--site", "local", "--sites-dir", str(SITES), "--json", "--set", "slurm.version=23.11"
    )
    assert code == 0
    doc = json.loads(out)
    assert set(doc) == {"site", "kind", "checks", "ok"}
    assert doc["site"] == "local" and doc["kind"] == "slurm" and doc["ok"] is True
    for c in doc["checks"]:
        assert set(c) == {"check", "expected", "found", "verdict", "hint"}
        assert c["verdict"] in ("ok", "warn", "error", "skip")
        assert (c["hint"] is not None) == (c["verdict"] in ("warn", "error"))
    (v,) = [c for c in doc["checks"] if c["check"] == "version"]
    assert v["verdict"] == "warn" and v["found"] == "Slurm 22.05.8"
    code, out, _ = sg(
        "doctor", "--site", "local", "--sites-dir", str(SITES), "--json", "--set", "slurm.partition=x"
    )
    assert code == 1 and json.loads(out)["ok"] is False


def test_cli_bad_input_is_exit_2():
    code, _, err = sg("doctor", "--site", "nope", "--sites-dir", str(SITES))
    assert code == 2 and err.startswith("sbatch-gen: unknown site 'nope'")
    code, _, err = sg("doctor", "--site", "local", "--sites-dir", str(SITES), "--set", "slurm.time=x")
    assert code == 2 and "slurm.time" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------------------------------------------
# kind: ssh, with canned probe outputs


@dataclass
class FakeHosts:
    """Answers the doctor's probe per host: node 0 runs `bash -c` here, the others `ssh ... -- HOST ...`."""

    answers: dict[str, Result]
    calls: list[list[str]] = field(default_factory=list)

    def __call__(
        self, argv: Sequence[str], *, cwd: Path | None = None, timeout_s: float | None = None
    ) -> Result:
        argv = list(argv)
        self.calls.append(argv)
        if argv[0] == "bash":
            return self.answers["local"]
        assert argv[0] == "ssh"
        return self.answers[argv[argv.index("--") + 1]]


GOOD = "SBG_DIR=ok\nSBG_TORCH=2.5.1+cpu 0\nSBG_PY=/venv/bin/python\nSBG_RUN=writable\n"


def test_ssh_hosts_ok_and_failing():
    hosts = FakeHosts(
        {
            "local": Result(0, GOOD),
            "localhost": Result(255, "", "ssh: connect to host localhost port 2222: Connection refused\n"),
        }
    )
    rep = run_doctor(load_site(SITES, "ssh-local"), hosts)
    v = verdicts(rep)
    assert v["ssh 127.0.0.1"] == "skip" and v["torch 127.0.0.1"] == v["run dir 127.0.0.1"] == "ok"
    assert v["gpus 127.0.0.1"] == "skip"  # a CPU site
    assert "torch 2.5.1+cpu" in row(rep, "torch 127.0.0.1").found
    r = row(rep, "ssh localhost")
    assert (
        r.verdict == "error" and "Connection refused" in r.found and "ssh -o BatchMode=yes" in (r.hint or "")
    )
    assert v["torch localhost"] == v["run dir localhost"] == "skip"
    assert not rep.ok
    # the launcher's own ssh options
    (ssh,) = [c for c in hosts.calls if c[0] == "ssh"]
    p = load_site(SITES, "ssh-local").profile
    assert ssh[: ssh.index("--")] == ssh_argv(p, "localhost", "x")[: ssh.index("--")]
    assert ["-o", "BatchMode=yes"] == ssh[1:3] and "-p" in ssh and ssh[ssh.index("-p") + 1] == "2222"


def test_ssh_secrets_are_checked_in_the_launching_shell_never_shown(monkeypatch):
    """The secrets the SSH launcher sends to every host (launch.secrets, the profile's credentials) come from
    the shell that runs it, where the doctor runs: a required one unset is an error (the launch would exit 2),
    an optional one a warning; set, ok; no value is ever shown."""
    hosts = FakeHosts({"local": Result(0, GOOD), "localhost": Result(0, GOOD)})
    site = load_site(SITES, "ssh-local", ["launch.secrets=[SBG_TOKEN]"])
    monkeypatch.delenv("SBG_TOKEN", raising=False)
    r = row(run_doctor(site, hosts), "secrets")
    assert r.verdict == "error" and r.found == "unset or empty here: SBG_TOKEN", r
    assert "export it in the shell" in (r.hint or ""), r
    assert r.expected == "SBG_TOKEN set in the launching shell" and "launch.secrets[0]" in (r.hint or ""), r
    monkeypatch.setenv("SBG_TOKEN", "tok-value-1")
    rep = run_doctor(site, hosts)
    r = row(rep, "secrets")
    assert r.verdict == "ok" and "over ssh's stdin" in r.found, r
    assert "tok-value-1" not in format_report(rep)
    assert row(run_doctor(load_site(SITES, "ssh-local"), hosts), "secrets").verdict == "skip"


def test_ssh_no_answer_and_a_probe_that_does_not_run():
    hosts = FakeHosts(
        {"local": Result(0, GOOD), "localhost": Result(124, "", "ssh did not answer within 60 s")}
    )
    rep = run_doctor(load_site(SITES, "ssh-local"), hosts)
    assert (
        row(rep, "ssh localhost").verdict == "error" and "did not answer" in row(rep, "ssh localhost").found
    )
    hosts = FakeHosts({"local": Result(0, GOOD), "localhost": Result(127, "", "bash: command not found\n")})
    rep = run_doctor(load_site(SITES, "ssh-local"), hosts)
    assert row(rep, "ssh localhost").verdict == "ok"
    r = row(rep, "probe localhost")
    assert r.verdict == "error" and "bash: command not found" in r.found
    assert row(rep, "torch localhost").verdict == "skip"
    # a launch directory the host lacks
    hosts = FakeHosts({"local": Result(0, GOOD), "localhost": Result(0, "SBG_DIR=missing\n")})
    rep = run_doctor(load_site(SITES, "ssh-local"), hosts)
    assert row(rep, "launch dir localhost").verdict == "error"
    assert row(rep, "run dir localhost").verdict == "skip"


def test_ssh_torch_gpus_and_run_dir_problems():
    hosts = FakeHosts(
        {
            "local": Result(
                0, "SBG_DIR=ok\nSBG_ENV=no .venv/bin/python (python_env.path)\nSBG_RUN=not-writable\n"
            ),
            "localhost": Result(0, "SBG_DIR=ok\nSBG_TORCH=2.5.1 1\nSBG_SMI=1\nSBG_RUN=creatable /data\n"),
        }
    )
    rep = run_doctor(load_site(SITES, "ssh-local", ["node.gpus=2", "torchrun.procs_per_node=null"]), hosts)
    r = row(rep, "torch 127.0.0.1")
    assert r.verdict == "error" and "no .venv/bin/python" in r.found
    assert row(rep, "gpus 127.0.0.1").verdict == "error"  # no nvidia-smi, no torch: 0 GPUs
    assert row(rep, "run dir 127.0.0.1").verdict == "error"
    assert row(rep, "ssh localhost").verdict == "ok"
    r = row(rep, "gpus localhost")
    assert r.verdict == "error" and r.found == "1 (nvidia-smi -L)" and "the profile says 2" in (r.hint or "")
    assert (
        row(rep, "run dir localhost").verdict == "ok"
        and "/data is writable" in row(rep, "run dir localhost").found
    )


def test_ssh_probe_script_runs_here(tmp_path):
    """The probe itself, run by bash on this machine (its python a stand-in that answers like torch would): a
    run dir that can be created, then one that exists, then a launch directory that does not."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\necho '2.5.1+cpu 0'\n")
    (venv / "bin" / "python").chmod(0o755)
    p = load_site(
        SITES, "ssh-local", [f"python_env.path={venv}", f"paths.run_dir={tmp_path / 'runs' / 'x'}"]
    ).profile
    r = subprocess.run(
        ["bash", "-c", probe_script(p, str(tmp_path))], capture_output=True, text=True, timeout=120
    )
    facts = parse_probe(r.stdout)
    assert facts["DIR"] == "ok" and facts["PY"] == str(venv / "bin" / "python")
    assert facts["TORCH"] == "2.5.1+cpu 0"
    assert facts["RUN"] == f"creatable {tmp_path}"
    (tmp_path / "runs" / "x").mkdir(parents=True)
    r = subprocess.run(
        ["bash", "-c", probe_script(p, str(tmp_path))], capture_output=True, text=True, timeout=120
    )
    assert parse_probe(r.stdout)["RUN"] == "writable"
    assert not list((tmp_path / "runs" / "x").iterdir())  # its test file is gone
    r = subprocess.run(
        ["bash", "-c", probe_script(p, str(tmp_path / "gone"))], capture_output=True, text=True
    )
    assert parse_probe(r.stdout) == {"DIR": "missing"}


# ---------------------------------------------------------------------------------------------------
# 10. the secrets file (slurm.secrets_file), where this host sees it

SECRET_SETS = ("slurm.secrets=[SBG_TOKEN]", "metrics.sinks=[wandb]", "metrics.wandb_api_key_env=SBG_WANDB")


def _secrets_row(tmp_path: Path, text: str | None, mode: int = 0o600, *sets: str):
    f = tmp_path / "job.env"
    if text is not None:
        f.write_text(text)
        f.chmod(mode)
    return row(
        doctor(FakeSlurm(), "local", *SECRET_SETS, f"slurm.secrets_file={f}", *sets, cwd=tmp_path), "secrets"
    )


def test_secrets_file_read_as_the_job_reads_it_never_showing_a_value(tmp_path):
    r = _secrets_row(tmp_path, "# keys\nexport SBG_TOKEN='tok-value-1'\n\nSBG_WANDB=\"w-value-2\"\nOTHER=x")
    assert r.verdict == "ok" and r.found.startswith(
        f"{tmp_path}/job.env (mode 600) has SBG_WANDB, SBG_TOKEN"
    ), r
    assert r.expected == "SBG_WANDB, SBG_TOKEN in slurm.secrets_file, mode 0600, yours"
    r = _secrets_row(tmp_path, "SBG_TOKEN=tok-value-1\n")  # wandb_mode auto: the W&B key is optional
    assert r.verdict == "warn" and r.hint == "SBG_WANDB unset: optional", r
    assert "value" not in json.dumps(r.to_dict())


@pytest.mark.parametrize(
    ("text", "mode", "found", "hint"),
    [
        (None, 0o600, "no {f}", "write NAME=value lines for SBG_TOKEN (slurm.secrets[0]) into it, chmod 600"),
        ("SBG_TOKEN=t\n", 0o644, "{f} is mode 644", "others may read it: chmod 600 {f}"),
        (
            "SBG_TOKEN=\nSBG_WANDB=w\n",
            0o600,
            "{f} (mode 600) has SBG_WANDB",
            "the job stops without SBG_TOKEN",
        ),
        ("SBG_TOKEN=t\nthe-token-itself\n", 0o400, "{f}: line 2 is not NAME=value", "the job stops on it"),
    ],
)
def test_secrets_file_that_would_stop_the_job_is_an_error(tmp_path, text, mode, found, hint):
    r = _secrets_row(tmp_path, text, mode)
    f = tmp_path / "job.env"
    assert r.verdict == "error" and r.found == found.format(f=f), r
    assert (r.hint or "").startswith(hint.format(f=f)), r
    assert "the-token-itself" not in json.dumps(r.to_dict())


def test_secrets_file_under_the_home_directory_and_none_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "s.env").write_text("SBG_TOKEN=t\nSBG_WANDB=w\n")
    (tmp_path / "s.env").chmod(0o600)
    rep = doctor(FakeSlurm(), "local", *SECRET_SETS, "slurm.secrets_file=~/s.env", cwd=REPO)
    assert row(rep, "secrets").verdict == "ok" and row(rep, "secrets").found.startswith(f"{tmp_path}/s.env ")
    assert row(doctor(FakeSlurm(), cwd=tmp_path), "secrets").verdict == "skip"  # local names no secret
