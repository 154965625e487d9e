"""GPU telemetry (sbatch_gen/train/telemetry.py): NVML readings named and scaled as DCGM's exporter has them,
given a stand-in NVML module; what the record and the sinks make of them; nothing on the CPU."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

from sbatch_gen.metrics_options import MetricsOptions
from sbatch_gen.train.sinks import PrometheusSink, scalars
from sbatch_gen.train.telemetry import FIELDS, GpuTelemetry, TelemetryRow, record_fields


class FakeNVML:
    """The few pynvml calls the telemetry makes, returning fixed readings in NVML's own units."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, fail_init: bool = False, fail_power: bool = False) -> None:
        self.fail_init, self.fail_power, self.queries = fail_init, fail_power, 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlDeviceGetUtilizationRates(self, h):
        self.queries += 1
        return SimpleNamespace(gpu=87, memory=40)  # percent

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=80 * 2**30, used=3 * 2**30 + 2**19, free=0)  # bytes

    def nvmlDeviceGetPowerUsage(self, h):
        if self.fail_power:
            raise self.NVMLError("Not Supported")
        return 412_345  # milliwatts

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 61  # degrees C


def test_readings_come_out_in_dcgm_units():
    assert FIELDS == (
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_GPU_TEMP",
    )
    util, fb_mib, watts, temp = GpuTelemetry(FakeNVML(), "h0").sample()
    assert (util, fb_mib, watts, temp) == (87.0, 3072.5, 412.345, 61.0)
    # a query this GPU does not support: that field alone is NaN
    vals = GpuTelemetry(FakeNVML(fail_power=True), "h0").sample()
    assert math.isnan(vals[2]) and vals[3] == 61.0


def test_no_telemetry_on_the_cpu_and_one_line_where_nvml_fails(caplog):
    cpu, cuda = SimpleNamespace(type="cpu", index=None), SimpleNamespace(type="cuda", index=0)
    with caplog.at_level(logging.INFO, logger="sbatch_gen.train"):
        assert GpuTelemetry.open(cpu, FakeNVML()) is None
        assert not caplog.records  # the CPU: not a word
        assert GpuTelemetry.open(cuda, FakeNVML(fail_init=True)) is None
    assert [r.getMessage() for r in caplog.records] == [
        "GPU telemetry: off: NVML: NVML Shared Library Not Found"
    ]
    row = TelemetryRow(cpu, None, log_every=1)
    assert row.columns == () and row.values(1, 1, 10) == []


def test_the_row_samples_at_the_steps_whose_record_is_due_and_the_record_lists_them_per_rank():
    nvml = FakeNVML()
    cuda = SimpleNamespace(type="cuda", index=0)
    row = TelemetryRow(cuda, GpuTelemetry(nvml, "h0"), log_every=5)
    assert row.columns == FIELDS
    for step in range(3, 13):  # first step 3, end 12: sampled at 3, 5, 10, 12
        row.values(step, 3, 12)
    assert nvml.queries == 4
    # without NVML on a GPU: the columns are there (every rank's row has the same length), NaN
    off = TelemetryRow(cuda, None, log_every=1)
    assert off.columns == FIELDS and all(math.isnan(v) for v in off.values(1, 1, 2))
    nan = float("nan")
    col = {
        "DCGM_FI_DEV_GPU_UTIL": [87.0, 90.0],
        "DCGM_FI_DEV_FB_USED": [3072.5, 3000.0],
        "DCGM_FI_DEV_POWER_USAGE": [412.345, nan],  # rank 1's power query failed
        "DCGM_FI_DEV_GPU_TEMP": [nan, nan],  # no rank read it: left out
    }
    assert record_fields(FIELDS, col) == {
        "DCGM_FI_DEV_GPU_UTIL": [87.0, 90.0],
        "DCGM_FI_DEV_FB_USED": [3072.5, 3000.0],
        "DCGM_FI_DEV_POWER_USAGE": [412.345, None],
    }
    assert record_fields((), col) == {}


def test_sinks_carry_the_fields_per_rank_and_prometheus_labels_the_rank(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    rec = {
        "step": 4,
        "loss": 3.0,
        "DCGM_FI_DEV_GPU_UTIL": [87.0, 90.0],
        "DCGM_FI_DEV_POWER_USAGE": [412.345, None],
    }
    step, vals = scalars(rec)
    assert step == 4
    assert vals == {
        "loss": 3.0,
        "DCGM_FI_DEV_GPU_UTIL/rank0": 87.0,
        "DCGM_FI_DEV_GPU_UTIL/rank1": 90.0,
        "DCGM_FI_DEV_POWER_USAGE/rank0": 412.345,
    }
    sink = PrometheusSink(MetricsOptions(sinks=["prometheus"]), tmp_path, "run", "eu")
    sink.write(step, vals)
    sink.close()
    samples = {
        (s.name, s.labels.get("rank")): (s.labels, s.value)
        for fam in text_string_to_metric_families(sink.path.read_text())
        for s in fam.samples
    }
    assert samples[("sbatch_gen_DCGM_FI_DEV_GPU_UTIL", "1")] == (
        {"run_id": "run", "region": "eu", "rank": "1"},
        90.0,
    )
    assert samples[("sbatch_gen_DCGM_FI_DEV_GPU_UTIL", "0")][1] == 87.0
    assert samples[("sbatch_gen_DCGM_FI_DEV_POWER_USAGE", "0")][1] == 412.345
    assert ("sbatch_gen_DCGM_FI_DEV_POWER_USAGE", "1") not in samples
    assert samples[("sbatch_gen_loss", None)][1] == 3.0


def test_the_gpu_is_found_by_its_uuid_else_by_its_visible_index(monkeypatch):
    """NVML numbers every GPU of the node, torch the visible ones: the UUID (str, else bytes for an older
    pynvml) names the same GPU; without one, CUDA_VISIBLE_DEVICES maps torch's index to NVML's."""
    import torch

    from sbatch_gen.train.telemetry import _handle

    class ByUUID(FakeNVML):
        def nvmlDeviceGetHandleByUUID(self, key):
            if not isinstance(key, bytes):  # an older pynvml
                raise TypeError("bytes expected")
            return ("uuid", key)

        def nvmlDeviceGetHandleByIndex(self, i):
            return ("index", i)

    props = {0: SimpleNamespace(uuid="1111-aaaa"), 1: SimpleNamespace()}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert _handle(ByUUID(), SimpleNamespace(type="cuda", index=0)) == ("uuid", b"GPU-1111-aaaa")
    assert _handle(ByUUID(), SimpleNamespace(type="cuda", index=1)) == ("index", 3)
