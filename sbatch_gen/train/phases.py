"""Where a step's time goes: marks around its forward+backward and its optimizer step, and the shares of the
step's time (``time_share_*`` in metrics.jsonl) computed from them and from the step's other timings.

A mark is the host clock (``time.perf_counter``) on the CPU, and a CUDA timing event recorded on the current
stream on CUDA: recording it costs the host nothing and never waits for the device. The events are read
(``elapsed_time``) only when the step's record is built, one step later, after the host has waited for the
device to finish that step anyway (the agreement's read), so the hot path gains no synchronisation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

SHARES = ("fwd_bwd", "optimizer", "data", "comm", "xr")  # time_share_<name> in a step record


class PhaseClock:
    """Marks of a step's phases on ``device``: host clock readings on the CPU, CUDA timing events on CUDA."""

    def __init__(self, device) -> None:
        self.cuda = getattr(device, "type", "cpu") == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            import torch

            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()


def seconds(a: Any, b: Any) -> float:
    """Seconds between two marks of a :class:`PhaseClock` (CUDA events: their elapsed device time)."""
    if isinstance(a, float):
        return max(0.0, b - a)
    return max(0.0, a.elapsed_time(b) / 1000.0)


@dataclass
class Marks:
    """One step's marks: before the first micro-batch's forward, after the last backward, before the
    gradient clipping and after the optimizer step (its ``zero_grad`` included). Between the second and the
    third: the cross-region grad-mode exchange, counted as cross-region sync."""

    fwd_start: Any
    fwd_end: Any
    opt_start: Any
    opt_end: Any

    def fwd_bwd_s(self) -> float:
        return seconds(self.fwd_start, self.fwd_end)

    def optimizer_s(self) -> float:
        return seconds(self.opt_start, self.opt_end)


def xr_exposed(*records: dict | None) -> float:
    """Seconds the step waited for cross-region rounds: each record's ``xr_exposed_s`` (else ``xr_total_s``);
    0 without a round."""
    total = 0.0
    for rec in records:
        if rec:
            v = rec.get("xr_exposed_s", rec.get("xr_total_s"))
            if isinstance(v, int | float) and not isinstance(v, bool):
                total += float(v)
    return total


def time_shares(
    *,
    step_s: float,
    fwd_bwd_s: float,
    optimizer_s: float,
    data_s: float,
    comm_s: float | None,
    xr_s: float,
) -> dict[str, float | None]:
    """``time_share_<name>`` of a step record: each part's seconds over ``step_s``. ``comm_s`` None (CUDA:
    NCCL's collectives are not visible from the host) gives a None share."""
    if step_s <= 0:
        return {f"time_share_{k}": None for k in SHARES}
    parts = {"fwd_bwd": fwd_bwd_s, "optimizer": optimizer_s, "data": data_s, "comm": comm_s, "xr": xr_s}
    return {f"time_share_{k}": (None if v is None else v / step_s) for k, v in parts.items()}
