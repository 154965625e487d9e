"""metrics.jsonl, summary.json, MFU/HFU and memory.

rank 0 appends one JSON object per logged step to ``<run-dir>/metrics.jsonl`` (line-buffered, so a
crash loses at most the line being written). Floats are written with ``repr`` precision: two runs'
losses can be compared bitwise.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import resource
import sys
import time
from pathlib import Path

from ..fsutil import write_atomic
from ..metrics_options import MetricsOptions
from .sinkproc import SinkProcess

log = logging.getLogger("sbatch_gen.train")

# Dense BF16 tensor-core peaks (FLOP/s) per GPU, without 2:4 sparsity. NVIDIA's data sheets print the
# sparse figure ("with sparsity"); the dense one is half of it:
#   A100 data sheet: 312 TFLOPS dense (SXM and PCIe alike).
#   H100 data sheet: SXM 1,979, PCIe 1,513, NVL 1,671 TFLOPS with sparsity -> 989, 756, 835 dense.
#   H200 data sheet: SXM 1,979, NVL 1,671 TFLOPS with sparsity -> 989, 835 dense.
#   GH200 data sheet: the Hopper GPU at 1,979 TFLOPS with sparsity -> 989 dense.
#   HGX B200: 4.5 PFLOPS with sparsity per GPU -> 2,250 dense; GB200 NVL72: 5 PFLOPS with sparsity per
#   GPU -> 2,500 dense (the GB200's GPUs run at a higher power limit than the HGX B200's).
# Keys match torch.cuda.get_device_name() (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H200 NVL",
# "NVIDIA GH200 480GB", "NVIDIA GB200") as whole words, the longest matching key wins: "H200 NVL" beats
# "H200", and "H200" never matches inside "GH200" nor "B200" inside "GB200".
PEAK_BF16_FLOPS: dict[str, float] = {
    "A100": 312e12,
    "H100": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "GB200": 2500e12,
}


def peak_flops(device_name: str) -> float | None:
    """The dense BF16 peak of the GPU named ``device_name`` (most specific key), or None if unknown."""
    best: str | None = None
    for key in PEAK_BF16_FLOPS:
        pattern = r"(?<![A-Za-z0-9])" + re.escape(key) + r"(?![A-Za-z0-9])"
        if re.search(pattern, device_name, flags=re.IGNORECASE) and (best is None or len(key) > len(best)):
            best = key
    return PEAK_BF16_FLOPS[best] if best is not None else None


def utilization(
    tokens_per_s: float | None, world_size: int, flops_per_token: float, peak: float | None
) -> float | None:
    """MFU (or HFU, given hardware FLOPs per token): the FLOP/s one device sustains over its peak.

    ``tokens_per_s`` is the whole group's rate (every rank's tokens), so one device does
    ``tokens_per_s / world_size * flops_per_token`` FLOP/s. None without a peak or a finite rate."""
    if not peak or tokens_per_s is None or not math.isfinite(tokens_per_s) or world_size < 1:
        return None
    return tokens_per_s / world_size * flops_per_token / peak


def max_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def memory_record(device) -> dict:
    """The memory fields of a metrics record.

    CUDA: ``mem_bytes`` is the caching allocator's peak of allocated tensor memory
    (``torch.cuda.max_memory_allocated``), ``mem_reserved_bytes`` its peak of memory held from the driver
    (``max_memory_reserved``: what the process really occupies, fragmentation included), and
    ``mem_free_bytes``/``mem_total_bytes`` the device's free and total memory now (``mem_get_info``: every
    process on the GPU counts). CPU: ``mem_bytes`` is the process's max RSS and the three CUDA fields are
    None."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return {
            "mem_bytes": int(torch.cuda.max_memory_allocated(device)),
            "mem_kind": "cuda_max_allocated",
            "mem_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "mem_free_bytes": int(free),
            "mem_total_bytes": int(total),
        }
    return {
        "mem_bytes": max_rss_bytes(),
        "mem_kind": "max_rss",
        "mem_reserved_bytes": None,
        "mem_free_bytes": None,
        "mem_total_bytes": None,
    }


def memory_summary(device) -> dict:
    """The summary's ``memory``: the CUDA peaks and the device's free/total (None on CPU), and max RSS."""
    rec = memory_record(device)
    cuda = rec["mem_kind"] == "cuda_max_allocated"
    return {
        "max_allocated_bytes": rec["mem_bytes"] if cuda else None,
        "max_reserved_bytes": rec["mem_reserved_bytes"],
        "device_free_bytes": rec["mem_free_bytes"],
        "device_total_bytes": rec["mem_total_bytes"],
        "max_rss_bytes": max_rss_bytes(),
    }


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def drop_cut_record(path: Path) -> int:
    """Cut ``path`` back to its last complete line: a process killed mid-write (SIGKILL, node failure) leaves
    its last record without a newline, and the next attempt's first record would be appended onto it, one
    line that is no JSON. Returns the bytes dropped (0: the file ends with a newline, is empty or absent)."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with f:
        end = pos = f.seek(0, os.SEEK_END)
        if end == 0:
            return 0
        while pos > 0:
            step = min(pos, 1 << 16)
            f.seek(pos - step)
            chunk = f.read(step)
            if pos == end and chunk.endswith(b"\n"):
                return 0
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                pos = pos - step + nl + 1
                break
            pos -= step
        f.truncate(pos)
    log.warning(
        "metrics: %s: dropped a cut last record (%d bytes) left by a process killed mid-write",
        path,
        end - pos,
    )
    return end - pos


class MetricsWriter:
    """rank 0's metrics.jsonl (``path``; None on the other ranks: a no-op), and the process that feeds the
    metric sinks from it (:mod:`.sinkproc`) once :meth:`open_sinks` started it."""

    def __init__(self, path: Path | None):
        self.path = path
        self._f = None
        self.sinks: SinkProcess | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            drop_cut_record(path)
            self._f = open(path, "a", buffering=1)

    def open_sinks(self, opts: MetricsOptions, *, run_id: str, region: str, first_step: int) -> None:
        """Start the process of the sinks ``opts`` lists (rank 0; before this attempt's first step record):
        it follows metrics.jsonl from here on."""
        if self._f is not None and self.path is not None and opts.sinks:
            self._f.flush()
            self.sinks = SinkProcess(
                opts,
                self.path,
                run_id=run_id,
                region=region,
                first_step=first_step,
                start=os.fstat(self._f.fileno()).st_size,
            )

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, allow_nan=True) + "\n")

    def close(self) -> None:
        """Close metrics.jsonl, then wait (bounded) for the sinks to write its last records."""
        if self._f is not None:
            self._f.close()
            self._f = None
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None


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
    world_size: int = 1,
    flops_per_token: tuple[float, float] | None = None,
    peak_flops: float | None = None,
    memory: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """The run's summary. MFU and HFU come from the summary's own tokens/s (``flops_per_token`` is
    (model, hardware) FLOPs per token), so they describe the same steps as the step-time figures:
    warm-up excluded, every step weighted by its time, not an average of per-step ratios."""
    # The first step of a process includes warm-up (allocations, DDP bucket rebuild): leave it out of
    # the distribution when there are others.
    times = step_times[1:] if len(step_times) > 1 else step_times
    mean = sum(times) / len(times) if times else float("nan")
    tokens_per_s = tokens_per_step / mean if times and mean > 0 else float("nan")
    model_f, hw_f = flops_per_token if flops_per_token is not None else (None, None)
    s = {
        "exit": exit_reason,
        "steps_this_process": len(step_times),
        "first_step": first_step,
        "last_step": last_step,
        "resumed_from_step": resumed_from,
        "step_time_s": _step_time_stats(times, mean),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "world_size": world_size,
        "mfu": utilization(tokens_per_s, world_size, model_f, peak_flops) if model_f else None,
        "hfu": utilization(tokens_per_s, world_size, hw_f, peak_flops) if hw_f else None,
        "peak_flops": peak_flops,
        "memory": memory,
        "checkpoint_save_s": _save_stats(checkpoint_save_s),
        "checkpoint_load_s": load_s,
        # Process start to the end of the first step this process trained.
        "startup_to_first_step_s": (first_step_done - process_start) if first_step_done else None,
        "resume_time_s": (first_step_done - process_start)
        if (first_step_done and resumed_from is not None)
        else None,
        "restarts_seen": restarts_seen(),
        "time": time.time(),
    }
    if extra:
        s.update(extra)
    return s


def _step_time_stats(times: list[float], mean: float) -> dict:
    return {
        "mean": mean,
        "p50": percentile(times, 50),
        "p99": percentile(times, 99),
        "max": max(times) if times else float("nan"),
    }


def _save_stats(save_s: list[float]) -> dict:
    return {
        "count": len(save_s),
        "mean": sum(save_s) / len(save_s) if save_s else None,
        "max": max(save_s) if save_s else None,
    }


def write_json_atomic(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=2, allow_nan=True) + "\n")


def format_summary(s: dict) -> str:
    st = s["step_time_s"]
    lines = [
        f"summary: {s['exit']} at step {s['last_step']} ({s['steps_this_process']} steps in this process"
        + (f", resumed from {s['resumed_from_step']}" if s["resumed_from_step"] is not None else "")
        + ")",
        f"  step time mean {st['mean']:.4f}s p50 {st['p50']:.4f}s p99 {st['p99']:.4f}s; "
        f"{s['tokens_per_s']:.0f} tokens/s",
    ]
    if s.get("optimizer") or s.get("compile"):
        lines.append(f"  optimizer {s.get('optimizer')}; compile {s.get('compile')}")
    if s.get("mfu") is not None:
        lines.append(f"  MFU {s['mfu']:.3f} HFU {s['hfu']:.3f} (peak {s['peak_flops'] / 1e12:.0f} TFLOP/s)")
    mem = s.get("memory") or {}
    if mem.get("max_allocated_bytes") is not None:
        gib = 2.0**30
        line = (
            f"  GPU memory: max allocated {mem['max_allocated_bytes'] / gib:.2f} GiB, max reserved "
            f"{mem['max_reserved_bytes'] / gib:.2f} GiB"
        )
        if mem.get("device_total_bytes"):
            line += f", device {mem['device_free_bytes'] / gib:.1f} of {mem['device_total_bytes'] / gib:.1f} GiB free"
        lines.append(line)
    c = s["checkpoint_save_s"]
    if c["count"]:
        lines.append(f"  checkpoint saves {c['count']}, mean {c['mean']:.2f}s, max {c['max']:.2f}s")
    if s["resume_time_s"] is not None:
        lines.append(f"  resume time (process start -> first new step) {s['resume_time_s']:.2f}s")
    if s["restarts_seen"]:
        lines.append("  restarts seen " + ", ".join(f"{k}={v}" for k, v in s["restarts_seen"].items()))
    return "\n".join(lines)
