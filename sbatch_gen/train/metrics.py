"""metrics.jsonl, summary.json, MFU/HFU and memory.

rank 0 appends one JSON object per logged step to ``<run-dir>/metrics.jsonl`` (line-buffered, so a
crash loses at most the line being written). Floats are written with ``repr`` precision: two runs'
losses can be compared bitwise.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path

# Dense BF16 tensor-core peaks (FLOP/s), no sparsity, from the vendors' data sheets. Matched against
# torch.cuda.get_device_name() in this order (the first substring that occurs wins).
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
]


def peak_flops(device_name: str) -> float | None:
    for key, peak in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def max_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


class MetricsWriter:
    def __init__(self, path: Path | None):
        self.path = path
        self._f = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, allow_nan=True) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def restarts_seen() -> dict[str, int]:
    out = {}
    for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        v = os.environ.get(k)
        if v and v.isdigit():
            out[k] = int(v)
    return out


def summarize(
    *,
    step_times: list[float],
    tokens_per_step: int,
    first_step: int,
    last_step: int,
    resumed_from: int | None,
    process_start: float,
    first_step_done: float | None,
    checkpoint_save_s: list[float],
    load_s: float | None,
    exit_reason: str,
    extra: dict | None = None,
) -> dict:
    # The first step of a process includes warm-up (allocations, DDP bucket rebuild): leave it out of
    # the distribution when there are others.
    times = step_times[1:] if len(step_times) > 1 else step_times
    mean = sum(times) / len(times) if times else float("nan")
    s = {
        "exit": exit_reason,
        "steps_this_process": len(step_times),
        "first_step": first_step,
        "last_step": last_step,
        "resumed_from_step": resumed_from,
        "step_time_s": {"mean": mean, "p50": percentile(times, 50), "p99": percentile(times, 99),
                        "max": max(times) if times else float("nan")},
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / mean if times and mean > 0 else float("nan"),
        "checkpoint_save_s": {
            "count": len(checkpoint_save_s),
            "mean": sum(checkpoint_save_s) / len(checkpoint_save_s) if checkpoint_save_s else None,
            "max": max(checkpoint_save_s) if checkpoint_save_s else None,
        },
        "checkpoint_load_s": load_s,
        # Process start to the end of the first step this process trained.
        "startup_to_first_step_s": (first_step_done - process_start) if first_step_done else None,
        "resume_time_s": (first_step_done - process_start) if (first_step_done and resumed_from is not None) else None,
        "restarts_seen": restarts_seen(),
        "time": time.time(),
    }
    if extra:
        s.update(extra)
    return s


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, allow_nan=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def format_summary(s: dict) -> str:
    st = s["step_time_s"]
    lines = [
        f"summary: {s['exit']} at step {s['last_step']} ({s['steps_this_process']} steps in this process"
        + (f", resumed from {s['resumed_from_step']}" if s["resumed_from_step"] is not None else "") + ")",
        f"  step time mean {st['mean']:.4f}s p50 {st['p50']:.4f}s p99 {st['p99']:.4f}s; "
        f"{s['tokens_per_s']:.0f} tokens/s",
    ]
    if s.get("mfu") is not None:
        lines.append(f"  MFU {s['mfu']:.3f} HFU {s['hfu']:.3f} (peak {s['peak_flops'] / 1e12:.0f} TFLOP/s)")
    c = s["checkpoint_save_s"]
    if c["count"]:
        lines.append(f"  checkpoint saves {c['count']}, mean {c['mean']:.2f}s, max {c['max']:.2f}s")
    if s["resume_time_s"] is not None:
        lines.append(f"  resume time (process start -> first new step) {s['resume_time_s']:.2f}s")
    if s["restarts_seen"]:
        lines.append("  restarts seen " + ", ".join(f"{k}={v}" for k, v in s["restarts_seen"].items()))
    return "\n".join(lines)
