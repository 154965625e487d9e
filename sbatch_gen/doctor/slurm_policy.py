"""``sbatch-gen doctor``, Slurm: the partition's account and QOS lists, the user's associations where the
accounting database enforces them, and the preemption grace against the stop checkpoint. Torch-free.

Which grace a preempted job gets (Slurm's preempt plugins): with ``PreemptType=preempt/partition_prio`` the
partition's PreemptMode and GraceTime, with ``preempt/qos`` the QOS's (PreemptMode ``cluster``: the
cluster's). GraceTime > 0: SIGTERM to the job steps at once, the job ends when the grace is over. GraceTime 0:
SIGTERM, then SIGKILL after KillWait seconds.
"""

from __future__ import annotations

from sbatch_gen.doctor.common import (
    Check,
    CommandMissing,
    error,
    grace_seconds,
    leading_int,
    ok,
    skip,
    split_list,
    warn,
)
from sbatch_gen.doctor.slurm_facts import SlurmDoctor

# ---------------------------------------------------------------------------------------------------
# 4. account and QOS: the partition's lists, the user's associations


def _not_checked_note(d: SlurmDoctor) -> str:
    dbd, _ = d.facts.accounting()
    return "" if dbd else " (without an accounting database this cluster does not apply the list yet)"


def _allow_deny(
    d: SlurmDoctor, check: str, field_name: str, value: str | None, allow_key: str, deny_key: str
) -> Check:
    part = d.part()
    what = {"account": "account", "qos": "QOS"}[check]
    expected = (
        f"{field_name} {value} allowed on {d.partition}" if value else f"{field_name} unset (your default)"
    )
    if part is None:
        return skip(check, expected, f"no partition {d.partition}")
    allow_raw, deny_raw = part.get(allow_key, "ALL"), part.get(deny_key)
    allow = [a.lower() for a in split_list(allow_raw)]
    deny = [a.lower() for a in split_list(deny_raw)]
    restricted = allow and allow != ["all"]
    found = f"{allow_key}={allow_raw}" + (f" {deny_key}={deny_raw}" if deny and not restricted else "")
    if value is None:
        if restricted or deny:
            return warn(
                check,
                expected,
                found,
                f"set {field_name}: partition {d.partition} only takes {allow_key}={allow_raw}"
                if restricted
                else f"set {field_name}: partition {d.partition} refuses {deny_key}={deny_raw}, and the job "
                f"would run with your default {what}",
            )
        return ok(check, expected, found)
    v = value.lower()
    if restricted and v not in allow:
        return error(
            check,
            expected,
            found,
            f"partition {d.partition} does not take {what} {value}: set {field_name} to one of {allow_raw}, or "
            f"ask the administrators to add {value} to {allow_key}" + _not_checked_note(d),
        )
    if not restricted and v in deny:  # (Slurm ignores DenyAccounts/DenyQos when an Allow list is set)
        return error(
            check,
            expected,
            found,
            f"partition {d.partition} refuses {what} {value} ({deny_key}): use another {what} or partition"
            + _not_checked_note(d),
        )
    return ok(check, expected, found)


def check_account(d: SlurmDoctor) -> list[Check]:
    s = d.profile.slurm
    return [
        _allow_deny(d, "account", "slurm.account", s.account, "AllowAccounts", "DenyAccounts"),
        _allow_deny(d, "qos", "slurm.qos", s.qos, "AllowQos", "DenyQos"),
    ]


_ENFORCE_ASSOC = {"associations", "limits", "safe", "qos", "wckeys"}


def check_associations(d: SlurmDoctor) -> list[Check]:
    s = d.profile.slurm
    expected = f"user {d.user} may use " + (f"account {s.account}" if s.account else "a default account")
    if s.qos:
        expected += f" with QOS {s.qos}"
    cfg = d.facts.config()
    dbd, enforce = d.facts.accounting()
    if not dbd:
        return [
            skip(
                "associations",
                expected,
                f"not enforced: {cfg.get('AccountingStorageType', '?')} (no slurmdbd)",
            )
        ]
    if not enforce & _ENFORCE_ASSOC:
        return [
            skip(
                "associations",
                expected,
                f"not enforced: AccountingStorageEnforce={cfg.get('AccountingStorageEnforce', 'none')}",
            )
        ]
    try:
        r = d.runner(["sacctmgr", "-n", "-P", "show", "assoc", f"user={d.user}", "format=account,qos"])
    except CommandMissing:
        return [warn("associations", expected, "sacctmgr not found", "install the Slurm client tools here")]
    if r.rc != 0:
        return [warn("associations", expected, r.message(), f"sacctmgr failed: {r.message()}")]
    assocs: dict[str, set[str]] = {}
    for line in r.out.splitlines():
        cols = line.strip().split("|")
        if cols and cols[0]:
            assocs.setdefault(cols[0].lower(), set()).update(
                q.lower() for q in split_list(cols[1] if len(cols) > 1 else "")
            )
    if not assocs:
        return [
            error(
                "associations",
                expected,
                f"no association for user {d.user}",
                f"ask the administrators to add user {d.user} to an account (sacctmgr add user)",
            )
        ]
    found = "accounts: " + ", ".join(sorted(assocs))
    if s.account and s.account.lower() not in assocs:
        return [
            error(
                "associations",
                expected,
                found,
                f"user {d.user} has no association with account {s.account}: set slurm.account to one of "
                f"{', '.join(sorted(assocs))}, or ask the administrators to add you to {s.account}",
            )
        ]
    if s.qos and "qos" in enforce:
        qos_ok = set().union(*(assocs[a] for a in ([s.account.lower()] if s.account else list(assocs))))
        found += "; QOS: " + (", ".join(sorted(qos_ok)) or "-")
        if qos_ok and s.qos.lower() not in qos_ok:
            return [
                error(
                    "associations",
                    expected,
                    found,
                    f"QOS {s.qos} is not among your association's ({', '.join(sorted(qos_ok))}): set slurm.qos "
                    "to one of them, or ask the administrators for it",
                )
            ]
    return [ok("associations", expected, found)]


# ---------------------------------------------------------------------------------------------------
# 6. preemption: is there time for the stop checkpoint?


def _modes(raw: str) -> set[str]:
    return {m.strip().upper() for m in raw.split(",") if m.strip()} - {"GANG", "WITHIN"}


def check_preemption(d: SlurmDoctor) -> list[Check]:
    pre = d.profile.preemption
    protocol = d.profile.trainer.stop_protocol
    # what a preempted job must be given: the stop checkpoint's budget, or under stop_protocol signal the
    # grace torchrun gives the workers (trainer.stop_grace_s when set)
    need, fields = d.profile.stop_grace() if protocol == "signal" else d.profile.stop_budget()
    if protocol == "none":
        need, fields = 0, "trainer.stop_protocol none: no stop checkpoint"
    expected = f"grace >= {need} s ({fields})"
    part = d.part()
    if part is None:
        return [skip("preemption", expected, f"no partition {d.partition}")]
    cfg = d.facts.config()
    ptype = cfg.get("PreemptType", "preempt/none")
    kill_wait = leading_int(cfg.get("KillWait")) or 0
    user_signal = "preempt_send_user_signal" in split_list(cfg.get("SlurmctldParameters"))
    if ptype in ("preempt/none", "", "(null)"):
        return [
            ok(
                "preemption",
                expected,
                f"PreemptType={ptype or 'preempt/none'}: this cluster does not preempt",
            )
        ]
    qos = d.profile.slurm.qos
    if ptype == "preempt/qos":
        dbd, _ = d.facts.accounting()
        if not qos or not dbd:
            why = "slurm.qos is unset" if not qos else "there is no accounting database to read it from"
            return [
                warn(
                    "preemption",
                    expected,
                    f"PreemptType=preempt/qos; the QOS cannot be read: {why}",
                    "with preempt/qos the job's QOS sets PreemptMode and GraceTime: set slurm.qos, and ask "
                    f"the administrators for a GraceTime of at least {need} s on it",
                )
            ]
        rec = d.facts.qos(qos)
        if rec is None:
            return [
                error(
                    "preemption",
                    expected,
                    f"no QOS {qos} in the accounting database",
                    "set slurm.qos to a QOS that exists (sacctmgr show qos)",
                )
            ]
        qmode, qgrace = rec
        mode = qmode if qmode and qmode.lower() != "cluster" else cfg.get("PreemptMode", "OFF")
        grace, source = qgrace, f"QOS {qos}"
    else:  # preempt/partition_prio: the partition's mode and grace
        mode = part.get("PreemptMode") or cfg.get("PreemptMode", "OFF")
        grace, source = grace_seconds(part.get("GraceTime")), f"partition {d.partition}"
    modes = _modes(mode)
    found = f"PreemptMode={mode} ({source})"
    if not modes or "OFF" in modes:
        return [ok("preemption", expected, found + ": this partition is not preempted")]
    if "SUSPEND" in modes:
        return [
            warn(
                "preemption",
                expected,
                found,
                "a suspended job keeps its GPUs (and their memory) and the trainer does not checkpoint on a "
                f"suspend: ask the administrators for PreemptMode REQUEUE with a GraceTime of at least {need} s "
                f"on {source}",
            )
        ]
    if grace is None:
        return [
            warn("preemption", expected, found, f"cannot read the GraceTime of {source}; check it by hand")
        ]
    if grace > 0:
        left, how = grace, f"GraceTime={grace} s"
    else:
        left, how = kill_wait, f"GraceTime=0: KillWait={kill_wait} s"
    found += f", {how}" + (", preempt_send_user_signal" if user_signal else "")
    hints = []
    if left < need:
        hints.append(
            f"a preemption leaves {left} s ({how}), the stop checkpoint needs {need} s: ask the administrators for a "
            f"GraceTime of at least {need} s on {source}"
            + (
                ""
                if user_signal
                else "; SlurmctldParameters=preempt_send_user_signal also sends the job's "
                f"--signal ({pre.signal}) to the batch shell on a preemption"
            )
            + f"; or, if checkpoints are that fast, lower {fields.split(' (')[0]} to at most {left} s"
        )
    if "CANCEL" in modes and "REQUEUE" not in modes:
        hints.append(
            "PreemptMode CANCEL: a preempted job is not requeued; resubmit it (it resumes from its checkpoint)"
        )
    if hints:
        return [warn("preemption", expected, found, "; ".join(hints))]
    return [ok("preemption", expected, found)]
