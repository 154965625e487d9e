"""scripts/gpu-check.sh: its logic, run on the CPU with --smoke (the figures mean nothing here; on a GPU
machine the same phases run the ~125M config under torchrun)."""

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.slow  # the GPU check script in subprocesses

PHASES = ["hbm", "ac-off", "ac-on", "compiled", "async-dcp", "stop", "diloco", "streaming", "fsdp", "codec"]


def _run(repo, *args, env=None, timeout=600):
    return subprocess.run(
        [str(repo / "scripts" / "gpu-check.sh"), *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_smoke_runs_every_phase_and_prints_one_table(repo, tmp_path, clean_env):
    out = tmp_path / "check"
    out.mkdir()
    (out / ".gpu-check").write_text("")  # an earlier check's output: emptied, not appended to
    stale = out / "runs" / "ac-off" / "metrics.jsonl"  # a previous run's leftovers must not be appended to
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"step": 999, "loss": 0.0, "step_time_s": 1.0}) + "\n")
    env = (
        {**clean_env, "PYTHON": str(repo / ".venv" / "bin" / "python")} if (repo / ".venv").exists() else None
    )
    p = _run(repo, "--smoke", "--out", str(out), "--steps", "6", env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert [r["phase"] for r in s["phases"]] == PHASES
    assert all(r["ok"] for r in s["phases"]), s["phases"]
    by = {r["phase"]: r["figures"] for r in s["phases"]}
    assert by["stop"]["stop_exit"] == 0 and by["stop"]["ack"] is True
    assert by["stop"]["max_abs_diff"] == 0.0 and 0 < by["stop"]["resumed_from"] < 6
    assert by["async-dcp"]["complete"] == by["async-dcp"]["saves"] >= 3
    assert "compiled in place" in by["compiled"]["compile"] and by["compiled"]["vs_ac_off"] > 0
    assert by["compiled"]["first_step_s"] > by["compiled"]["step_p50_s"]  # the first step compiled
    assert by["diloco"]["rounds"] >= 2 and by["diloco"]["outer_device"] == "cpu"
    assert by["streaming"]["fragments_seen"] == 4 and by["streaming"]["outer_device"] == "cpu"
    assert by["fsdp"]["stop_max_abs_diff"] == 0.0 and 0 < by["fsdp"]["stop_resumed_from"] < 6
    assert by["fsdp"]["tokens_per_s"] > 0 and by["fsdp"]["offload_tokens_per_s"] > 0
    assert by["codec"]["sparse_same_bytes_as_cpu"] is True and by["codec"]["sparse_1pct_vs_int8"] > 0
    assert by["codec"]["int8_ms_per_M"] > 0 and by["codec"]["sparse_3pct_ms_per_M"] > 0
    # ac-off, ac-on and fsdp (offload off) each profiled ahead of their steady half: a trace with its steps
    for phase in ("ac-off", "ac-on", "fsdp"):
        assert by[phase]["prof_steps"] >= 1 and by[phase]["prof_step_ms"] > 0, by[phase]
        assert (out / by[phase]["profile"]).is_file()
        assert "prof_device_ms" not in by[phase]  # a CPU trace has no device events
    assert "profile" not in by["compiled"] and "profile" not in by["async-dcp"]
    assert by["ac-off"]["steps"] == 6  # only this run's records: the stale file was removed, not appended to
    assert json.loads((out / "runs" / "ac-off" / "metrics.jsonl").read_text().splitlines()[0])["step"] != 999
    table = p.stdout[p.stdout.index("| phase |") :]
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:] if line.startswith("|")] == PHASES
    assert "SMOKE" in p.stdout and (out / "summary.md").read_text().strip() in p.stdout


def test_without_a_gpu_it_says_so(repo, tmp_path, clean_env):
    env = {**clean_env, "CUDA_VISIBLE_DEVICES": ""}
    if (repo / ".venv").exists():
        env["PYTHON"] = str(repo / ".venv" / "bin" / "python")
    p = _run(repo, "--out", str(tmp_path / "x"), env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == "gpu-check: no CUDA device visible (use --smoke to test the script on the CPU)"


@pytest.mark.parametrize("out", ["/", ".", "..", "ELSEWHERE"])
def test_refuses_to_empty_what_it_did_not_make(repo, tmp_path, out):
    if out == "ELSEWHERE":
        out = str(tmp_path)
        (tmp_path / "precious").write_text("x")
    p = _run(repo, "--smoke", "--out", out, env={**os.environ}, timeout=60)
    assert p.returncode == 2 and "refusing to empty it" in p.stderr
    assert out != str(tmp_path) or (tmp_path / "precious").read_text() == "x"


def test_trace_breakdown_of_a_cuda_trace(repo, tmp_path):
    """The device's time per profiled step by kind of kernel, from a Chrome trace shaped as torch's (host
    'step N' ranges; kernels, copies on two streams that overlap), without a GPU."""
    import sys

    sys.path.insert(0, str(repo / "scripts"))
    try:
        from gpu_check import trace_breakdown
    finally:
        sys.path.remove(str(repo / "scripts"))

    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        x("user_annotation", "step 4", -5000, 5000),  # the first profiled step: left out
        x("gpu_user_annotation", "step 4", -4000, 3000),
        x("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", -4000, 3000),
        x("user_annotation", "step 5", 0, 1000),
        x("user_annotation", "step 6", 1000, 1000),
        x("user_annotation", "forward_backward", 0, 800),  # not a step
        x("gpu_user_annotation", "step 5", 100, 650),
        x("gpu_user_annotation", "step 6", 1100, 500),  # the window: 100-1600 us
        x("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 50, 450),  # clipped to the window: 400 us
        x("kernel", "pytorch_flash::flash_fwd_kernel", 500, 100),
        x("kernel", "ncclDevKernel_AllGather_RING_LL", 550, 200),  # another stream: overlaps 550-600
        x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 1100, 100),
        x("kernel", "void at::native::vectorized_elementwise_kernel<4>", 1200, 300),
        x("cpu_op", "aten::mm", 100, 50),  # host op: not the device's time
    ]
    path = tmp_path / "rank0.steps-5-6.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert trace_breakdown(path) == {
        "prof_steps": 3,
        "prof_step_ms": 1.0,  # steps 5 and 6
        "prof_device_ms": 0.525,  # union: 100-750 (650 us) + 1100-1500 (400 us) = 1050 us over 2 steps
        "prof_device_busy": 0.7,  # 1050 us of the window's 1500
        "prof_matmul_ms": 0.2,
        "prof_attention_ms": 0.05,
        "prof_nccl_ms": 0.1,
        "prof_copy_ms": 0.05,
        "prof_other_ms": 0.15,
    }
