"""``bench elastic``: the run sizes (full and ``--quick``) and the timing constants of the schedule."""

from __future__ import annotations

from dataclasses import dataclass

POLL_S = 1.0  # OuterSync's poll_max_s: the longest sleep between two polls of the mailbox ("one poll")
Q_GRACE_S = (
    60.0  # quality runs: a returning b that has joined is always waited for (rounds never close on time)
)
Q_WITHHOLD_GRACE_S = 2.0  # the control: a closes the rounds b withholds after this (b is there, just silent)


@dataclass(frozen=True)
class Sizes:
    # part 3: quality
    q_steps: int
    q_h: int
    q_first: int  # rounds both regions train before b leaves
    q_absent: tuple[int, ...]  # rounds b misses, one variant each (0 = always present)
    q_alone: bool  # also a 1-region run (b absent from every round)
    q_end: int  # also b leaving for good this many rounds before the end (0: skip)
    q_withhold: int  # control: b stays but publishes nothing in this many rounds from q_first+1 (0: skip)
    q_seeds: tuple[
        int, ...
    ]  # always present, ~25% away and the control run once per seed (the rest: the first)
    q_model: dict
    q_batch: int
    q_eval_windows: int
    # parts 1 and 2: idle and goodput
    g_steps: int
    g_h: int
    g_sleep_s: float  # per-step pacing (stands in for compute)
    g_leave_round: int  # b goes once this round is committed
    g_away_s: float  # ... and is started again this long after
    g_grace_s: float
    g_heartbeat_s: float  # the elastic variants' heartbeat_s (crash detection)
    g_no_heartbeat: bool  # also the crash with heartbeats off
    g_stop: bool  # also the planned-stop run
    g_baseline: bool  # also a run in which b never leaves
    g_strict_timeout_s: float
    g_ckpt_every: int
    g_snapshot_every: int
    g_keep_rounds: int
    g_model: dict
    g_batch: int


FULL = Sizes(
    q_steps=600,
    q_h=30,
    q_first=5,
    q_absent=(0, 5, 10),
    q_alone=True,
    q_end=5,
    q_withhold=5,
    q_seeds=(1234, 99),
    q_model={"n_layers": 2, "d_model": 128, "n_heads": 4, "seq_len": 64},
    q_batch=8,
    q_eval_windows=1024,
    g_steps=360,
    g_h=20,
    g_sleep_s=0.2,
    g_leave_round=4,
    g_away_s=22.0,
    g_grace_s=2.7,
    g_heartbeat_s=0.45,
    g_no_heartbeat=True,
    g_stop=True,
    g_baseline=True,
    g_strict_timeout_s=20.0,
    g_ckpt_every=60,
    g_snapshot_every=5,
    g_keep_rounds=4,
    g_model={"n_layers": 1, "d_model": 64, "n_heads": 2, "seq_len": 32},
    g_batch=4,
)
QUICK = Sizes(
    q_steps=12,
    q_h=2,
    q_first=1,
    q_absent=(0, 3),
    q_alone=False,
    q_end=0,
    q_withhold=2,
    q_seeds=(1234,),
    q_model={"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16},
    q_batch=2,
    q_eval_windows=32,
    g_steps=40,
    g_h=4,
    g_sleep_s=0.05,
    g_leave_round=2,
    # under the floor of a's training after b leaves (about 30 steps of g_sleep_s: 1.5 s), so that b is always
    # restarted before a finishes (2.0 s was not: a unloaded machine finished a first)
    g_away_s=1.0,
    g_grace_s=0.5,
    g_heartbeat_s=0.1,
    g_no_heartbeat=False,
    g_stop=False,
    g_baseline=False,
    g_strict_timeout_s=30.0,
    g_ckpt_every=4,
    g_snapshot_every=2,
    g_keep_rounds=1,
    g_model={"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16},
    g_batch=2,
)
