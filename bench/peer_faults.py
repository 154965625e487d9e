"""``bench peer``: the faults, the same schedule on both sides (:data:`FAULTS`): one fault run injects
its fault when replica a has logged ``fault_step`` (a kill, or the coordinator lost), restores what it
took after ``away_s`` / ``outage_s``, and reads from the records as they appeared the survivors' stall and
how the restarted replica came back."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from sbatch_gen.testing.regions import RegionRun

from .common import median
from .finalmodel import distance, heldout_loss
from .peer_launch import launch
from .peer_net import Net
from .peer_sizes import TIMEOUT, Sizes, V
from .regionruns import HELDOUT, REGIONS
from .rundir import Watch, read_summary

FAULTS = {
    "one": "replica b killed (SIGKILL of its torchrun and workers; ours: run-trainer, the job step's "
    "supervisor, lives on and announces the leave) mid-round, started again {away:g} s later",
    "both": "both replicas killed (as above) mid-round, both started again {away:g} s later",
    "coordinator": "the coordinator lost for {outage:g} s (torchft: its lighthouse killed, then started "
    "again on the same address; ours: the S3 store unreachable, its packets dropped in the hub)",
}


SURVIVORS = {"one": {"a"}, "both": set(), "coordinator": set(REGIONS)}  # who trains on through each fault


def fault_run(
    net: Net,
    work: Path,
    cfg: Path,
    data: Path,
    sz: Sizes,
    system: str,
    fault: str,
    *,
    whole_replica: bool = False,
) -> dict:
    """One fault run: both replicas train, elastic (torchft: lighthouse ``--min_replicas 1``; ours:
    ``min_regions: 1``, grace and heartbeat at their defaults), without overlap; when a has logged
    ``fault_step`` the fault comes, and the schedule goes on. Nothing here raises for how a replica ended:
    a crash is a result. ``whole_replica``: a kill takes ours' run-trainer too (a node lost: nothing
    announces the leave, the heartbeat tells; ``bench.goals40_diag heartbeat``)."""
    f = _FaultRun(net, work, cfg, data, sz, system, fault)
    f.whole_replica = whole_replica
    f.start()
    try:
        f.deadline = time.monotonic() + TIMEOUT
        f.until_fault_step()
        killed = f.inject()
        f.restore(killed)
        f.until_exits()
    except TimeoutError:
        for r in REGIONS:
            f.rcs.setdefault(r, "timeout")
    finally:
        f.clean_up()
    out = f.result()
    print(
        f"  peer fault {fault}: {system}: exits {out['rcs']}, survivor stall {out['stall_s']} at "
        f"{out.get('stall_at')}, back {out['back_s']}, rejoined {out['rejoin_s']}, rounds closed without a "
        f"region {out.get('closed_without', '-')}, held-out {out['heldout']} ({out['took_s']:.0f} s)",
        flush=True,
    )
    return out


class _FaultRun:
    """One fault run's replicas, the schedule's times, and how each replica ended."""

    def __init__(
        self, net: Net, work: Path, cfg: Path, data: Path, sz: Sizes, system: str, fault: str
    ) -> None:
        self.net, self.cfg, self.data, self.sz = net, cfg, data, sz
        self.system, self.fault = system, fault
        self.v = V(system, "gloo", "fp32") if system == "torchft" else V(system, "s3", "bf16")
        self.root = work / f"fault-{fault}-{system}"
        log = "rank0.jsonl" if system == "torchft" else "metrics.jsonl"
        self.watch = {r: Watch(self.root / r / log) for r in REGIONS}
        self.runs: dict[str, RegionRun] = {}
        self.started: list[RegionRun] = []
        self.t0 = 0.0
        self.t_fault = self.t_back = float("nan")
        self.rcs: dict[str, int | str] = {}
        self.ended: dict[str, float] = {}  # seconds after the fault each replica's (last) process exited
        self.coordinator_down = False
        self.deadline = 0.0
        self.whole_replica = False

    def start(self) -> None:
        if self.system == "torchft":
            self.net.start_lighthouse(1)
        self.runs = {r: self._launch(r) for r in REGIONS}
        self.started = list(self.runs.values())
        self.t0 = time.time()

    def _launch(self, r: str, restart: bool = False) -> RegionRun:
        return launch(
            self.net, self.root, self.cfg, self.data, self.sz, self.v, r, restart=restart, elastic=True
        )

    def poll(self) -> None:
        for w in self.watch.values():
            w.poll()
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"fault {self.fault} {self.system}: not done in {TIMEOUT} s")

    def until_fault_step(self) -> None:
        while not any(rec["step"] >= self.sz.fault_step for _, rec in self.watch["a"].seen):
            if any(r.poll()[0] is not None for r in self.runs.values()):
                raise RuntimeError(
                    f"fault {self.fault} {self.system}: a replica exited before the fault:\n{self.runs['a'].tail()}"
                )
            self.poll()
            time.sleep(0.02)

    def inject(self) -> list[str]:
        """The fault: kill the replicas it names, or take the coordinator away; the replicas killed."""
        self.t_fault = time.time()
        killed = {"one": ["b"], "both": list(REGIONS)}.get(self.fault, [])
        for r in killed:
            # the training processes: torchft's bare torchrun and workers; ours the same under run-trainer,
            # which outlives them as a job step does (RegionRun.kill_trainer)
            if self.whole_replica:
                self.runs[r].kill()
            else:
                self.runs[r].kill_trainer()
        if self.fault == "coordinator":
            self.coordinator_down = True
            if self.system == "torchft":
                self.net.stop_lighthouse(kill=True)
            else:
                self.net.cut_s3("moto", True)
        return killed

    def restore(self, killed: list[str]) -> None:
        """After away_s (outage_s): the coordinator back, the killed replicas started again."""
        until = self.t_fault + (self.sz.outage_s if self.fault == "coordinator" else self.sz.away_s)
        while time.time() < until:
            self.poll()
            time.sleep(0.02)
        if self.fault == "coordinator":
            if self.system == "torchft":
                self.net.start_lighthouse()
            else:
                self.net.cut_s3("moto", False)
            self.coordinator_down = False
        for r in killed:
            self.runs[r] = self._launch(r, restart=True)
            self.started.append(self.runs[r])
        self.t_back = time.time()

    def until_exits(self) -> None:
        while len(self.rcs) < len(REGIONS):
            for r, run_ in self.runs.items():
                if r not in self.rcs and run_.poll()[0] is not None:
                    self.rcs[r] = run_.poll()[0]
                    self.ended[r] = time.time() - self.t_fault
            self.poll()
            time.sleep(0.05)

    def clean_up(self) -> None:
        for run_ in self.started:
            if run_.poll()[0] is None:
                run_.kill()
        if self.system == "torchft":
            self.net.stop_lighthouse()
        if self.coordinator_down and self.system == "ours":
            self.net.cut_s3("moto", False)
        for w in self.watch.values():
            w.poll()

    def result(self) -> dict:
        root, sz = self.root, self.sz
        rcs = {r: self.rcs[r] for r in REGIONS}
        out = {
            "system": self.system,
            "fault": self.fault,
            "rcs": rcs,
            "took_s": time.time() - self.t0,
            # a replica that failed: when, and the last error its log names
            "failed": {
                r: (self.ended.get(r), _last_error(self.runs[r].tail())) for r in REGIONS if rcs[r] != 0
            },
        }
        resumed = None
        if self.system == "ours" and (root / "b" / "summary.json").is_file():
            resumed = read_summary(root / "b").get("resumed_from_step")
        out.update(
            _fault_figures(self.watch, sz, self.system, self.fault, self.t_fault, self.t_back, resumed)
        )
        models = {r: root / r / "model.safetensors" for r in REGIONS}
        out["heldout"] = {
            r: heldout_loss(m, {**sz.model, "dropout": 0.0}, self.data / f"{HELDOUT}.bin", sz.eval_windows)
            for r, m in models.items()
            if m.is_file() and rcs.get(r) == 0
        }
        out["same"] = distance(*models.values())[0] if len(out["heldout"]) == len(REGIONS) else None
        shutil.rmtree(root, ignore_errors=True)
        return out


def _last_error(log: str) -> str:
    """The last line of a failed replica's log that names an exception (torchrun's own wrapper left out)."""
    hits = [
        x
        for x in log.splitlines()
        if re.search(r"\w+(Error|Exception|Timeout)\b", x) and "ChildFailed" not in x
    ]
    return hits[-1].strip()[-300:] if hits else "(no error in the log)"


def _closed_without(watch: dict, t_fault: float) -> dict[str, dict[str, int]]:
    """Ours: per region, its rounds that closed without a region, counted by ``<before|after> the fault:
    <absent regions> <close reason>`` (``leave``: a leave record, announced by run-trainer for a crash;
    ``stale``: a heartbeat gone stale; ``grace``: grace_s ran out). A round closed without a region before
    the fault would be a region wrongly seen gone."""
    out: dict[str, dict[str, int]] = {}
    for r, w in watch.items():
        for t, rec in w.records:
            if rec.get("xr_absent"):
                when = "after" if t > t_fault else "before"
                key = f"{when}: {'+'.join(rec['xr_absent'])} {rec.get('xr_close_reason', '?')}"
                out.setdefault(r, {})
                out[r][key] = out[r].get(key, 0) + 1
    return out


def _fault_figures(
    watch: dict, sz: Sizes, system: str, fault: str, t_fault: float, t_back: float, resumed: int | None
) -> dict:
    """From the records as they appeared: the survivors' longest step after the fault beyond their usual
    step (the stall), when the restarted replica b stepped again and rejoined the group, and how (ours:
    ``resumed``, the checkpoint step its summary names)."""
    normal = median([rec["step_time_s"] for t, rec in watch["a"].seen if t < t_fault][1:])
    survivors = SURVIVORS[fault]
    stall = max(
        (rec["step_time_s"] - normal for r in survivors for t, rec in watch[r].seen if t > t_fault),
        default=None,
    )
    out: dict = {"stall_s": stall, "back_s": None, "rejoin_s": None, "path": "-", "killed_at": None}
    # where the stall was: the step, when it was logged (seconds after the fault), ours' round record there
    after = [(rec["step_time_s"], t, rec) for r in survivors for t, rec in watch[r].seen if t > t_fault]
    if after:
        _, t, rec = max(after, key=lambda x: x[0])
        keys = ("xr_round", "xr_close_reason", "xr_absent", "xr_wait_s", "xr_total_s")
        out["stall_at"] = {
            "step": rec["step"],
            "after_fault_s": round(t - t_fault, 2),
            **{k: rec[k] for k in keys if k in rec},
        }
    if system == "ours":
        out["closed_without"] = _closed_without(watch, t_fault)
    if fault == "coordinator":
        # steps trained while the coordinator was down, and the last step before it came back
        out["steps_during"] = {
            r: sum(1 for t, rec in watch[r].seen if t_fault < t < t_fault + sz.outage_s) for r in REGIONS
        }
        return out
    r = "b"
    before = [rec["step"] for t, rec in watch[r].seen if t < t_fault]
    after = [(t, rec) for t, rec in watch[r].seen if t > t_back]
    out["killed_at"] = max(before, default=0)
    if after:
        out["back_s"] = after[0][0] - t_back
    events = [(t, rec) for t, rec in watch[r].records if t > t_back and "event" in rec]
    if system == "torchft":
        healed = [(t, rec) for t, rec in events if rec["event"] == "healed"]
        if healed:
            out["rejoin_s"] = healed[0][0] - t_back
            out["path"] = f"healed from a's live state to step {healed[0][1]['to_step']}"
        elif after:
            out["path"] = f"started again at step {after[0][1]['step']} (no live peer to heal from)"
    else:
        rejoin = [(t, rec) for t, rec in events if rec["event"] == "xr_rejoin"]
        how = "started afresh" if resumed is None else f"resumed its checkpoint of step {resumed}"
        if rejoin:
            t, rec = rejoin[0]
            out["rejoin_s"] = t - t_back
            via = "+".join(rec.get("via") or ["rounds"])
            out["path"] = (
                f"{how}; caught up {rec['replayed']} rounds from the mailbox ({via}) to step {rec['adopted_step']}"
            )
        else:
            out["path"] = f"{how}; nothing to catch up"
            out["rejoin_s"] = out["back_s"]
    return out
