"""scripts/gpu-check.sh: its logic, run on the CPU with --smoke (the figures mean nothing here; on a GPU
machine the same phases run the ~125M config under torchrun)."""

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.slow  # the GPU check script in subprocesses

PHASES = ["hbm", "ac-off", "ac-on", "compiled", "async-dcp", "stop", "diloco", "streaming", "fsdp"]


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
    assert by["diloco"]["rounds"] >= 2 and by["diloco"]["outer_device"] == "cpu"
    assert by["streaming"]["fragments_seen"] == 4 and by["streaming"]["outer_device"] == "cpu"
    assert by["fsdp"]["stop_max_abs_diff"] == 0.0 and 0 < by["fsdp"]["stop_resumed_from"] < 6
    assert by["fsdp"]["tokens_per_s"] > 0 and by["fsdp"]["offload_tokens_per_s"] > 0
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
