"""Peak table, MFU/HFU, the summary and its memory figures (torch-free helpers)."""

import math

import pytest

from sbatch_gen.train.metrics import (
    PEAK_BF16_FLOPS,
    format_summary,
    memory_record,
    peak_flops,
    summarize,
    utilization,
)


@pytest.mark.parametrize(
    "name, tflops",
    [
        # names as torch.cuda.get_device_name() reports them
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA GH200 144G HBM3e", 989),
        ("NVIDIA B200", 2250),
        ("NVIDIA GB200", 2500),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("nvidia h200 nvl", 835),
    ],
)
def test_peak_table_takes_the_most_specific_name(name, tflops):
    assert peak_flops(name) == tflops * 1e12


@pytest.mark.parametrize("name", ["NVIDIA H20", "NVIDIA GeForce RTX 4090", "NVIDIA L40S", "", "NVIDIA B2000"])
def test_unknown_devices_have_no_peak(name):
    assert peak_flops(name) is None


def test_every_key_matches_itself_first():
    """No key is shadowed: each one, as a device name, resolves to its own value."""
    for key, value in PEAK_BF16_FLOPS.items():
        assert peak_flops(f"NVIDIA {key}") == value, key


def test_utilization_formula():
    # 8 ranks together at 80,000 tokens/s: one device does 10,000 tokens/s x 6e9 FLOPs = 6e13 FLOP/s
    assert utilization(80_000.0, 8, 6e9, 989e12) == pytest.approx(6e13 / 989e12)
    assert utilization(80_000.0, 8, 6e9, None) is None
    assert utilization(float("nan"), 8, 6e9, 989e12) is None
    assert utilization(None, 1, 6e9, 989e12) is None


def _summary(step_times, **kw):
    return summarize(
        step_times=step_times,
        tokens_per_step=4096,
        first_step=1,
        last_step=len(step_times),
        resumed_from=None,
        process_start=0.0,
        first_step_done=1.0,
        checkpoint_save_s=[],
        load_s=None,
        exit_reason="completed",
        **kw,
    )


def test_summary_mfu_is_derived_from_the_summary_tokens_per_s():
    """Not the mean of per-step MFUs: the warm-up step is left out like in the step-time figures, and a
    slow step weighs by its time (the mean of per-step rates would overstate the throughput)."""
    times = [30.0, 1.0, 1.0, 2.0]  # the first is the warm-up
    s = _summary(times, world_size=2, flops_per_token=(6e9, 8e9), peak_flops=1e14)
    assert s["tokens_per_s"] == pytest.approx(4096 / (4.0 / 3))
    assert s["mfu"] == pytest.approx(s["tokens_per_s"] / 2 * 6e9 / 1e14)
    assert s["hfu"] == pytest.approx(s["tokens_per_s"] / 2 * 8e9 / 1e14)
    per_step = [4096 / t / 2 * 6e9 / 1e14 for t in times]
    assert s["mfu"] != pytest.approx(sum(per_step) / len(per_step))  # what the summary used to report
    assert s["mfu"] != pytest.approx(sum(per_step[1:]) / 3)
    assert s["peak_flops"] == 1e14 and s["world_size"] == 2
    assert "MFU 0.092 HFU 0.123 (peak 100 TFLOP/s)" in format_summary(s)


def test_summary_without_a_peak_or_steps_has_no_mfu():
    assert _summary([1.0, 1.0], world_size=1, flops_per_token=(6e9, 6e9), peak_flops=None)["mfu"] is None
    s = _summary([], world_size=1, flops_per_token=(6e9, 6e9), peak_flops=1e14)
    assert s["mfu"] is None and math.isnan(s["tokens_per_s"])


def test_memory_fields_on_cpu_and_in_the_printout():
    import torch

    rec = memory_record(torch.device("cpu"))
    assert rec["mem_kind"] == "max_rss" and rec["mem_bytes"] > 0
    assert (
        rec["mem_reserved_bytes"] is None and rec["mem_free_bytes"] is None and rec["mem_total_bytes"] is None
    )
    gib = 2**30
    mem = {
        "max_allocated_bytes": 30 * gib,
        "max_reserved_bytes": 34 * gib,
        "device_free_bytes": 100 * gib,
        "device_total_bytes": 140 * gib,
        "max_rss_bytes": gib,
    }
    text = format_summary(_summary([1.0, 1.0], memory=mem))
    assert (
        "GPU memory: max allocated 30.00 GiB, max reserved 34.00 GiB, device 100.0 of 140.0 GiB free" in text
    )
    assert "GPU memory" not in format_summary(_summary([1.0, 1.0], memory={"max_allocated_bytes": None}))


def test_report_shows_absent_in_region_comm_as_na_and_the_gpu_memory(tmp_path):
    """A GPU run over NCCL writes comm_time_s None (not measurable from the host): the report's in-region
    comm fraction is n/a, not 0%; the summary's HFU and GPU memory appear in the SLO table."""
    import json

    from sbatch_gen.report import build, load_run, slo

    d = tmp_path / "run"
    d.mkdir()
    recs = [{"step": s, "loss": 3.0, "step_time_s": 0.2, "comm_time_s": None} for s in range(1, 5)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    gib = 2**30
    (d / "summary.json").write_text(
        json.dumps(
            {
                "mfu": 0.41,
                "hfu": 0.55,
                "tokens_per_s": 1e5,
                "exit": "completed",
                "device": "cuda:0",
                "world_size": 8,
                "memory": {
                    "max_allocated_bytes": 20 * gib,
                    "max_reserved_bytes": 24 * gib,
                    "device_free_bytes": 110 * gib,
                    "device_total_bytes": 140 * gib,
                    "max_rss_bytes": gib,
                },
            }
        )
    )
    run = load_run(d)
    s = slo(run)
    assert math.isnan(s["in_region_comm_fraction"]) and math.isnan(s["comm_fraction"])
    assert s["hfu"] == 0.55 and s["gpu_mem_max_reserved_gib"] == 24.0 and s["gpu_mem_total_gib"] == 140.0
    md, _ = build([run])
    assert (
        "| comm fraction: in-region (DDP all-reduce or FSDP collectives, + per-step collective) | n/a |" in md
    )
    assert "| GPU memory, max reserved (rank 0) | 24 GiB |" in md and "| HFU (GPU only) | 0.55 |" in md
    # CPU runs measure it (gloo span + the agreement wait): a number, and no GPU memory
    for r in recs:
        r["comm_time_s"] = 0.05
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "summary.json").write_text(
        json.dumps({"exit": "completed", "memory": {"max_allocated_bytes": None}})
    )
    s = slo(load_run(d))
    assert s["in_region_comm_fraction"] == pytest.approx(0.25) and s["gpu_mem_max_allocated_gib"] is None
    # an FSDP region whose trainer did not time its collectives (no fsdp_all_gather_s): its comm_time_s (the
    # agreement wait alone) is not its comm
    (d / "summary.json").write_text(json.dumps({"exit": "completed", "parallelism": "fsdp + cpu offload"}))
    run = load_run(d)
    s = slo(run)
    assert math.isnan(s["in_region_comm_fraction"]) and math.isnan(s["comm_fraction"])
    md, _ = build([run])
    assert "| n/a | fsdp + cpu offload | n/a | n/a | completed |" in md  # no compile or optimizer recorded
    assert (
        "| comm fraction: in-region (DDP all-reduce or FSDP collectives, + per-step collective) | n/a |" in md
    )
    assert "FSDP (fsdp + cpu offload): its trainer did not time the in-region collectives" in md
    # timed (this trainer, on gloo: comm_time_s holds them): a number again, and no note
    for r in recs:
        r.update(fsdp_all_gather_s=0.02, fsdp_reduce_scatter_s=0.01)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(d)
    assert slo(run)["in_region_comm_fraction"] == pytest.approx(0.25)
    assert "did not time" not in build([run])[0]


def test_report_where_the_time_goes_is_na_where_a_share_is_not_measured(tmp_path):
    """A GPU run over NCCL writes time_share_comm None: its row and "other" are n/a, the rest are means
    over the logged steps without the process's first (warm-up) step; records from before the shares give
    no table."""
    import json

    from sbatch_gen.report import build, load_run, time_shares

    d = tmp_path / "run"
    d.mkdir()
    recs = [
        {
            "step": s,
            "loss": 3.0,
            "step_time_s": 0.2,
            "time_share_fwd_bwd": 0.9 if s == 1 else 0.7,
            "time_share_optimizer": 0.1,
            "time_share_data": 0.05,
            "time_share_comm": None,
            "time_share_xr": 0.0,
        }
        for s in range(1, 4)
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(d)
    shares = time_shares(run)
    assert shares is not None and shares["time_share_fwd_bwd"] == pytest.approx(0.7)
    assert shares["time_share_comm"] is None and shares["other"] is None
    md, _ = build([run])
    assert "| forward + backward | 70.0% |" in md and "| data (host batch preparation) | 5.0% |" in md
    assert "| in-region communication (waited for) | n/a |" in md and "| other (not attributed) | n/a |" in md
    for r in recs:
        for k in [k for k in r if k.startswith("time_share_")]:
            del r[k]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert time_shares(load_run(d)) is None and "Where the time goes" not in build([load_run(d)])[0]
