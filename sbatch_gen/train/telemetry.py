"""GPU telemetry beside the metrics: each rank's GPU utilisation, memory used, power and temperature, read
through NVML (the ``pynvml`` module of nvidia-ml-py, when it imports) and named as DCGM's exporter names them.

Sampled at the steps whose record is due by their number (every ``train.log_every``-th, the process's first
and the last) and carried in the per-step row every rank already gathers (:mod:`.agreement`); rank 0 writes
one list per field, one entry per rank. On the CPU there are no such columns; on CUDA without NVML (no
pynvml, no driver library) they are NaN and the record leaves the fields out, after one line at start.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from typing import Any

log = logging.getLogger("sbatch_gen.train")

# (DCGM exporter name, what it is, unit): DCGM_FI_DEV_GPU_UTIL in %, DCGM_FI_DEV_FB_USED in MiB,
# DCGM_FI_DEV_POWER_USAGE in W, DCGM_FI_DEV_GPU_TEMP in degrees C, as DCGM's exporter reports them.
FIELDS = (
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_GPU_TEMP",
)
NAN = float("nan")


class GpuTelemetry:
    """One GPU's NVML handle and the four readings of :data:`FIELDS` (NaN for one that fails)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle

    @classmethod
    def open(cls, device, nvml: Any = None, say: bool = True) -> GpuTelemetry | None:
        """The telemetry of CUDA ``device`` (``nvml``: the pynvml module, imported when not given); None on
        the CPU, and None with one warning (when ``say``: rank 0) where NVML cannot be used."""
        if getattr(device, "type", "cpu") != "cuda":
            return None
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")  # nvidia-ml-py
            except ImportError:
                if say:
                    log.warning("GPU telemetry: off: pynvml does not import (pip install nvidia-ml-py)")
                return None
        try:
            nvml.nvmlInit()
            handle = _handle(nvml, device)
        except Exception as e:  # noqa: BLE001 - no driver library, no such GPU: telemetry off, training on
            if say:
                log.warning("GPU telemetry: off: NVML: %s", str(e) or type(e).__name__)
            return None
        if say:
            log.info("GPU telemetry: NVML (%s)", ", ".join(FIELDS))
        return cls(nvml, handle)

    def sample(self) -> list[float]:
        """[utilisation %, framebuffer used MiB, power W, temperature C]."""
        nv, h = self.nvml, self.handle
        return [
            _read(lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
            _read(lambda: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20),
            _read(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),  # milliwatts
            _read(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        ]


def _read(f) -> float:
    try:
        return float(f())
    except Exception:  # noqa: BLE001 - a query this GPU does not support: that field is absent
        return NAN


def _handle(nvml: Any, device) -> Any:
    """NVML's handle of torch's CUDA ``device``: by its UUID (NVML numbers every GPU of the node, torch only
    the visible ones), else by its index in CUDA_VISIBLE_DEVICES, else by torch's index."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        for key in (f"GPU-{uuid}", f"GPU-{uuid}".encode()):  # newer pynvml takes str, older bytes
            try:
                return nvml.nvmlDeviceGetHandleByUUID(key)
            except Exception:  # noqa: BLE001, S112 - a MIG instance, another pynvml: the next way
                continue
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].isdigit():
        index = int(visible[index])
    return nvml.nvmlDeviceGetHandleByIndex(index)


class TelemetryRow:
    """The telemetry columns of this rank's per-step row: the latest sample, refreshed at the steps whose
    record is due by their number. ``columns`` is :data:`FIELDS` on CUDA (NaN without NVML: every rank's
    row has the same length), empty on the CPU."""

    def __init__(self, device, telemetry: GpuTelemetry | None, log_every: int) -> None:
        self.columns: tuple[str, ...] = FIELDS if getattr(device, "type", "cpu") == "cuda" else ()
        self.telemetry, self.log_every = telemetry, log_every
        self.last = [NAN] * len(self.columns)

    def values(self, step: int, first_step: int, end_step: int) -> list[float]:
        if self.telemetry is not None and (step % self.log_every == 0 or step in (first_step, end_step)):
            self.last = self.telemetry.sample()
        return self.last


def record_fields(columns: tuple[str, ...], col: dict) -> dict:
    """The record's telemetry: per field, one value per rank (None where that rank's reading failed); a
    field no rank read is left out."""
    out = {}
    for name in columns:
        vals = [float(v) for v in col[name]]
        if not all(math.isnan(v) for v in vals):
            out[name] = [None if math.isnan(v) else v for v in vals]
    return out
