"""The tests' filter for torchrun's exit-barrier race (pytorch#69520): it drops that one log record, and
every other traceback still counts."""

from __future__ import annotations

from sbatch_gen.testing.torchlogs import without_torch_exit_barrier_race

HEAD = "E1204 13:05:10.752000 32343 .venv/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py:1008]"
RACE = "\n".join(
    [
        f"{HEAD} Error waiting on exit barrier. Elapsed: 0.038977861404418945 seconds",
        f"{HEAD} Traceback (most recent call last):",
        f'{HEAD}   File "torch/distributed/elastic/agent/server/api.py", line 994, in _exit_barrier',
        f"{HEAD} torch.distributed.DistNetworkError: failed to recv, got 0 bytes",
    ]
)
OURS = "2026-12-04 13:05:10,592 [rank 1/2] exiting 0: checkpointed at step 6, requeue me"


def test_the_exit_barrier_record_is_dropped_and_nothing_else():
    text = "\n".join([OURS, RACE, "summary: stopped at step 6"])
    assert without_torch_exit_barrier_race(text) == "\n".join([OURS, "summary: stopped at step 6"])


def test_another_traceback_beside_the_race_still_counts():
    other = "\n".join(["Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: ours"])
    left = without_torch_exit_barrier_race("\n".join([RACE, other]))
    assert "Traceback" in left and "ValueError: ours" in left and "exit barrier" not in left


def test_a_log_without_the_race_is_unchanged():
    text = f"{OURS}\nTraceback (most recent call last):\nRuntimeError: boom"
    assert without_torch_exit_barrier_race(text) == text
