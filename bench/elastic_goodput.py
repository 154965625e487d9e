"""``bench elastic``, parts 1 and 2: one goodput variant, the scripted absence of region b.

Both regions start; once round ``g_leave_round`` is committed b is SIGKILLed (crash) or its stop file is
created (planned stop), and ``g_away_s`` later it is started again with ``--resume auto``. Strict runs
(``min_regions: all``) requeue a region whose round found no quorum at once, until b is back. The
survivor a's figures come from :func:`.elastic_figures.goodput_stats`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from sbatch_gen.testing.faults import ENV_START_TOGETHER
from sbatch_gen.testing.regions import RegionRun
from sbatch_gen.train.signals import ack_path
from sbatch_gen.train.xr.protocol import round_tag
from sbatch_gen.xr_options import CrossRegion, FsTransport

from .elastic_figures import goodput_stats
from .elastic_sizes import Sizes
from .regionruns import OUTER_LR, OUTER_MOMENTUM, REGIONS, TIMEOUT, launch_region
from .rundir import Watch, read_records, read_summary, step_records


def goodput_variant(
    work: Path, data: Path, cfg: Path, sz: Sizes, mode: str, grace_s: float, heartbeat_s: float | None
) -> dict:
    """mode: none (b stays), crash | stop (elastic, min_regions 1), or strict (min_regions all, b crashes)."""
    s = _Absence(work, data, cfg, sz, mode, grace_s, heartbeat_s)
    s.start()
    try:
        if mode == "none":
            s.live = {"a": s.started[0], "b": s.started[1]}
            s.back = True
        else:
            s.b_leaves()
        s.until_done()
    finally:
        for r in s.started:
            if r.poll()[0] is None:
                r.kill()
    s.watch.poll()
    return s.figures()


class _Absence:
    """One goodput run: its regions' processes, the schedule's times, who is running."""

    def __init__(
        self,
        work: Path,
        data: Path,
        cfg: Path,
        sz: Sizes,
        mode: str,
        grace_s: float,
        heartbeat_s: float | None,
    ) -> None:
        self.name = f"g-{mode}-{grace_s:g}-{heartbeat_s or 0:g}".replace(".", "_")
        self.root = work / self.name
        self.data, self.cfg, self.sz = data, cfg, sz
        self.mode, self.grace_s, self.heartbeat_s = mode, grace_s, heartbeat_s
        self.strict = mode == "strict"
        self.stop = self.root / "b.stop"
        self.presence = self.root / "mailbox" / self.name / "_presence" / "b.json"
        self.env = {"SBATCH_GEN_TEST_STEP_SLEEP_S": repr(sz.g_sleep_s)}
        self.watch = Watch(self.root / "a" / "metrics.jsonl")
        self.rounds = self.root / "mailbox" / self.name
        self.attempts = {"a": 1, "b": 1}
        self.t_gone = self.t_back = self.t_joined = float("nan")
        self.started: list[RegionRun] = []
        self.live: dict[str, RegionRun] = {}  # region -> its running process
        self.back = False
        self.deadline = 0.0

    def launch(self, region: str, resume: str, env: dict | None = None) -> RegionRun:
        sz = self.sz
        xr = CrossRegion(
            enabled=True,
            run_id=self.name,
            region=region,
            regions=REGIONS,
            sync="diloco",
            inner_steps=sz.g_h,
            outer_lr=OUTER_LR,
            outer_momentum=OUTER_MOMENTUM,
            transport=FsTransport(root=str(self.root / "mailbox")),
            threads=4,
            min_regions="all" if self.strict else 1,
            grace_s=self.grace_s,
            heartbeat_s=self.heartbeat_s,
            timeout_s=sz.g_strict_timeout_s if self.strict else 600,
            snapshot_every=sz.g_snapshot_every,
            keep_rounds=sz.g_keep_rounds,
        )
        extra = ["--stop-file", str(self.stop)] if (region == "b" and self.mode == "stop") else []
        return launch_region(
            xr,
            config=self.cfg,
            run_dir=self.root / region,
            data=self.data,
            resume=resume,
            env={**self.env, **(env or {})},
            log_dir=self.root / "logs",
            extra=extra,
            module="sbatch_gen.testing.faults",
        )

    def start(self) -> None:
        """Both regions, their first steps together (a fresh run's a would otherwise train on alone while b
        still starts up, and under load pass the round b is to leave after before b has joined)."""
        together = {ENV_START_TOGETHER: f"{self.root / 'started'}:2"}
        self.started = [self.launch("a", "none", together), self.launch("b", "none", together)]
        self.deadline = time.monotonic() + TIMEOUT

    def b_leaves(self) -> None:
        """Wait for round g_leave_round's commit, then b crashes (SIGKILL) or stops (its stop file)."""
        a, b = self.started
        while not self._committed(self.sz.g_leave_round):
            for r in (a, b):
                if r.poll()[0] is not None:
                    raise RuntimeError(
                        f"{self.name}: {r.region} exited before round {self.sz.g_leave_round}:\n{r.tail()}"
                    )
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"{self.name}: round {self.sz.g_leave_round} never committed")
            self.watch.poll()
            time.sleep(0.01)
        self.t_gone = time.time()
        if self.mode == "stop":
            self.stop.touch()
        else:
            b.kill()
        self.t_back = self.t_gone + self.sz.g_away_s
        self.live = {"a": a}
        self.back = False

    def _committed(self, r: int) -> bool:
        """Round ``r`` or a later one has committed (keep_rounds prunes a round's folder soon after)."""
        try:
            tags = [p.name for p in self.rounds.iterdir() if p.name >= round_tag(r)]
        except OSError:
            return False
        return any((self.rounds / t / "_commit.json").exists() for t in tags if t[:1] == "r")

    def until_done(self) -> None:
        """Restart b when its time away is up, note when it has joined again, requeue strict regions that
        found no quorum, until every running region has completed."""
        while True:
            self.watch.poll()
            if not self.back and time.time() >= self.t_back:
                self._b_returns()
            if self.back and self.t_joined != self.t_joined:
                self._joined()
            self._reap()
            if not self.live:
                if not self.back:
                    raise RuntimeError(
                        f"{self.name}: a finished before b was restarted: lengthen the run or shorten away_s"
                    )
                break
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"{self.name}: the regions did not finish in {TIMEOUT} s")
            time.sleep(0.05)

    def _b_returns(self) -> None:
        if self.mode == "stop":
            b = self.started[1]
            b.wait(TIMEOUT)
            if read_summary(self.root / "b").get("exit") != "stopped":
                raise RuntimeError(f"{self.name}: b did not stop through its stop file:\n{b.tail()}")
            self.stop.unlink()
            ack_path(self.stop).unlink(missing_ok=True)
        self.live["b"] = self.launch("b", "auto")
        self.started.append(self.live["b"])
        self.back = True

    def _joined(self) -> None:
        """b's presence record says it has joined the run again."""
        try:
            p = json.loads(self.presence.read_text())
            if p.get("state") == "joined" and p["time"] > self.t_gone:
                self.t_joined = p["time"]
        except (OSError, ValueError, KeyError):
            pass

    def _reap(self) -> None:
        for region, r in list(self.live.items()):
            rc = r.poll()[0]
            if rc is None:
                continue
            ex = read_summary(self.root / region).get("exit")
            if self.strict and ex == "no_quorum" and self.attempts[region] < 30:
                self.live[region] = self.launch(region, "auto")  # requeued at once (no queue wait)
                self.started.append(self.live[region])
                self.attempts[region] += 1
            elif rc == 0 and ex == "completed":
                del self.live[region]
            else:
                raise RuntimeError(f"{self.name}: {region} exited {rc} ({ex}):\n{r.tail()}")

    def figures(self) -> dict:
        sz, root = self.sz, self.root
        g = goodput_stats(self.name, read_records(root / "a"), self.watch)
        b_recs = read_records(root / "b")
        b_rounds = [r for r in step_records(b_recs) if "xr_round" in r]
        rejoin = [r["time"] for r in b_recs if r.get("event") == "xr_rejoin" and r["time"] > self.t_gone]
        if rejoin:  # b's own record of its fast-forward (its presence says "joined" right after)
            self.t_joined = rejoin[0]
        g.update(
            mode=self.mode,
            grace_s=self.grace_s,
            heartbeat_s=self.heartbeat_s,
            requeues=(self.attempts["a"] - 1, self.attempts["b"] - 1),
            away_s=self.t_joined - self.t_gone,
            gone_at=self.t_gone - g["t0"],
            restart_at=self.t_back - g["t0"],
            back_at=self.t_joined - g["t0"],
            b_late=sum(1 for r in b_rounds if r.get("xr_late") and r["xr_round"] > sz.g_leave_round),
        )
        g["away_share"] = g["away_s"] / g["wall_s"]
        return g
