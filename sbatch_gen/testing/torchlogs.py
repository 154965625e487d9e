"""Reading the logs of torchrun jobs in tests: what torch itself logs that is not ours to count."""

from __future__ import annotations

import re

_EXIT_BARRIER = re.compile(r"^([EW]\d{4} [\d:.]+ \d+ \S+:\d+\]) Error waiting on exit barrier", re.M)


def without_torch_exit_barrier_race(text: str) -> str:
    """``text`` without torchrun's own exit-barrier error: after the workers have finished, an agent that
    reaches the barrier while the agent hosting the rendezvous store (node 0) is already leaving gets a
    closed connection and logs it with a traceback (pytorch/pytorch#69520; torch 2.13 still has it). It is
    torch's, after the job's outcome is decided; every other traceback still counts. The error is one log
    record: each of its lines starts with the same header."""
    heads = tuple({m.group(1) for m in _EXIT_BARRIER.finditer(text)})
    if not heads:
        return text
    return "\n".join(line for line in text.splitlines() if not line.startswith(heads))
