"""``bench elastic``, part 3: one quality variant, b absent from a share of the rounds (or the control,
or a alone). Its loss on the held-out shard is taken by the caller."""

from __future__ import annotations

import time
from pathlib import Path

from sbatch_gen.testing.regions import RegionRun
from sbatch_gen.train.xr.protocol import round_tag
from sbatch_gen.xr_options import CrossRegion, FsTransport

from .elastic_figures import quality_figures
from .elastic_sizes import Q_GRACE_S, Q_WITHHOLD_GRACE_S, Sizes
from .regionruns import OUTER_LR, OUTER_MOMENTUM, REGIONS, TIMEOUT, finish, launch_region
from .rundir import read_summary


def quality_variant(
    work: Path,
    data: Path,
    cfg: Path,
    sz: Sizes,
    absent: int | None,
    at_end: bool = False,
    seed: int = 0,
    withhold: bool = False,
) -> dict:
    """absent: rounds b is to miss from round q_first+1 on, or None for a 1-region run of a; ``at_end``: b
    misses the last ``absent`` rounds instead (it leaves for good, no return); ``withhold``: the control, b
    stays in the run and trains every step but publishes nothing in those rounds
    (``sbatch_gen.testing.faults``), so its tokens there are lost as if it were away, without a leave, a
    restart or a rejoin. ``seed``: the config's train.seed (for the name; ``cfg`` carries it).

    One process of a trains the whole run (min_regions 1, grace_s 60: while b is in the run, every round
    waits for it). b ends after round q_first (``--max-steps``: its leave is on record, a's rounds close at
    once without it) and is started again (``--resume auto``) timed so that it joins during round
    q_first+absent: then it fast-forwards to the run's step, finishes that round with a, and takes part
    from the next. Which round it first takes part in depends on its start-up time (+-1 round); the rounds
    it really missed are read from a's metrics."""
    q = _QualityRun(work, data, cfg, sz, absent, at_end, seed, withhold)
    q.train()
    withheld = list(range(sz.q_first + 1, sz.q_first + absent + 1)) if withhold else []
    return quality_figures(q.root, q.name, q.n_rounds, absent, at_end, seed, withheld)


class _QualityRun:
    def __init__(
        self,
        work: Path,
        data: Path,
        cfg: Path,
        sz: Sizes,
        absent: int | None,
        at_end: bool,
        seed: int,
        withhold: bool,
    ) -> None:
        name = (
            "q-alone"
            if absent is None
            else f"q-{'end-' if at_end else ''}{'withhold-' if withhold else ''}{absent}"
        )
        self.name = name + (f"-s{seed}" if seed else "")
        self.root = work / self.name
        self.data, self.cfg, self.sz = data, cfg, sz
        self.absent, self.at_end, self.withhold = absent, at_end, withhold
        self.n_rounds = sz.q_steps // sz.q_h
        self.regions = ["a"] if absent is None else REGIONS

    def launch(self, region: str, max_steps: int | None = None, resume: str = "none") -> RegionRun:
        sz, root = self.sz, self.root
        xr = CrossRegion(
            enabled=True,
            run_id=self.name,
            region=region,
            regions=self.regions,
            sync="diloco",
            inner_steps=sz.q_h,
            outer_lr=OUTER_LR,
            outer_momentum=OUTER_MOMENTUM,
            transport=FsTransport(root=str(root / "mailbox")),
            threads=4,
            min_regions=1 if len(self.regions) > 1 else "all",
            grace_s=Q_WITHHOLD_GRACE_S if self.withhold else Q_GRACE_S,
            timeout_s=600,
            snapshot_every=5 if self.n_rounds >= 5 else 1,
            keep_rounds=4,
        )
        env, module = None, "sbatch_gen.train"
        if self.withhold and region == "b":  # the trainer with the fault installed from outside
            from sbatch_gen.testing.faults import ENV_WITHHOLD_ROUNDS

            rounds = range(sz.q_first + 1, sz.q_first + self.absent + 1)
            env = {ENV_WITHHOLD_ROUNDS: f"{region}:" + ",".join(map(str, rounds))}
            module = "sbatch_gen.testing.faults"
        return launch_region(
            xr,
            config=self.cfg,
            run_dir=root / region,
            data=self.data,
            max_steps=max_steps,
            resume=resume,
            log_dir=root / "logs",
            env=env,
            module=module,
        )

    def train(self) -> None:
        """Run the variant to its end: a alone, both throughout, b leaving for good, or b away and back."""
        name, h, absent = self.name, self.sz.q_h, self.absent
        if absent is None:
            finish([self.launch("a")], name)
        elif not absent or self.withhold:
            finish([self.launch("a"), self.launch("b")], name)
        elif self.at_end:
            finish([self.launch("a"), self.launch("b", max_steps=(self.n_rounds - absent) * h)], name)
        else:
            self._away_and_back(absent)

    def _away_and_back(self, absent: int) -> None:
        """b trains q_first rounds, ends, and is started again timed to rejoin during round q_first+absent."""
        name, r1 = self.name, self.sz.q_first
        a = self.launch("a")
        try:
            finish([self.launch("b", max_steps=r1 * self.sz.q_h)], name)
            startup = float(read_summary(self.root / "b").get("startup_to_first_step_s") or 0.0)
            self._wait_for_rejoin_round(a, r1, r1 + absent, startup)
            finish([a, self.launch("b", resume="auto")], name)
        finally:
            if a.poll()[0] is None:
                a.kill()

    def _wait_for_rejoin_round(self, a: RegionRun, r1: int, r2: int, startup: float) -> None:
        """Follow a's round commits until b, started now, would join during round r2 (from a's pace alone
        and b's start-up time), or a has finished."""
        seen: dict[int, float] = {}  # round -> when its commit appeared
        deadline = time.monotonic() + TIMEOUT
        while True:
            if a.poll()[0] is not None:  # a has finished (tiny --quick runs): b comes back to a finished run
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: a's rounds did not advance")
            for r in range(max(seen, default=r1) + 1, self.n_rounds + 1):
                if not (self.root / "mailbox" / self.name / round_tag(r) / "_commit.json").exists():
                    break
                seen[r] = time.monotonic()
            latest = max(seen, default=r1)
            if len(seen) >= 2:  # a's pace alone -> how many rounds b's start-up takes
                round_s = (seen[latest] - seen[min(seen)]) / (latest - min(seen))
                if latest >= r2 - int(startup / max(round_s, 1e-3)):
                    break
            elif latest >= r2 - 1:
                break
            time.sleep(0.01)
