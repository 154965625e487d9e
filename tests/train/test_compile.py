"""``train.compile``: every transformer block compiled in place (inductor, on the CPU here). A compiled run
trains to an eager run's losses (here to 1e-5 relative: deterministic mode draws dropout as eager does),
stops and resumes bitwise, keeps the eager parameter names (checkpoints and the cross-region flat vector are
the same), and works under DDP and FSDP2 with two torchrun ranks. The first compile of a fresh machine takes
about a minute; inductor's cache makes the others take seconds."""

from __future__ import annotations

import json
import subprocess

import pytest

from sbatch_gen.train.cli import parse_args
from sbatch_gen.train.spec import RunSpec
from sbatch_gen.train.trainer import run

from .conftest import REPO, losses, same_weights, torchrun_cmd, train_env, write_config

pytestmark = pytest.mark.slow  # inductor compiles C++ for the CPU

SECTIONS = {
    "train": {"steps": 8, "grad_accum": 2},
    "model": {"activation_checkpointing": True},  # and tiny's dropout 0.1
    "checkpoint": {"every": 4, "keep_last": 3},
}
TOLERANCE = 1e-5  # relative, per step's loss


def _train(cfg, run_dir, data_dir, *extra) -> int:
    args = parse_args(["--config", str(cfg), "--run-dir", str(run_dir), "--data-path", str(data_dir), *extra])
    return run(RunSpec.from_args(args))


def _close(a: dict[int, float], b: dict[int, float]) -> bool:
    return sorted(a) == sorted(b) and all(abs(a[s] - b[s]) <= TOLERANCE * abs(b[s]) for s in a)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    eager = write_config(d / "eager.yaml", **SECTIONS)
    compiled = write_config(
        d / "compiled.yaml", **{**SECTIONS, "train": {**SECTIONS["train"], "compile": True}}
    )
    return eager, compiled


def test_a_compiled_run_trains_to_the_eager_losses_and_resumes_bitwise(
    configs, tmp_path, data_dir, clean_env, capfd
):
    eager, compiled = configs
    assert _train(eager, tmp_path / "eager", data_dir) == 0
    assert _train(compiled, tmp_path / "whole", data_dir) == 0
    assert "train.compile: 2 blocks compiled in place" in capfd.readouterr().err
    whole = losses(tmp_path / "whole")
    assert _close(whole, losses(tmp_path / "eager")), (whole, losses(tmp_path / "eager"))
    # the summary says what ran: the blocks compiled and the mode, AdamW's kernel (foreach off CUDA), and
    # the first step's time (the compilation's, left out of step_time_s)
    done = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert (done["compile"], done["optimizer"]) == ("2 blocks, mode default", "AdamW foreach")
    eager_done = json.loads((tmp_path / "eager" / "summary.json").read_text())
    assert eager_done["compile"] == "off" and eager_done["optimizer"] == "AdamW foreach"
    assert done["first_step_s"] > done["step_time_s"]["max"]
    print(
        f"compiled vs eager: largest relative loss difference "
        f"{max(abs(whole[s] - losses(tmp_path / 'eager')[s]) / abs(whole[s]) for s in whole):.3g}; "
        f"first step {done['first_step_s']:.1f} s compiled, {eager_done['first_step_s']:.2f} s eager"
    )
    # stopped after step 4, resumed: bitwise the uninterrupted compiled run
    part = tmp_path / "part"
    assert _train(compiled, part, data_dir, "--max-steps", "4") == 0
    assert _train(compiled, part, data_dir) == 0
    assert losses(part) == whole
    assert same_weights(part / "model.safetensors", tmp_path / "whole" / "model.safetensors")
    # parameter names as eager: the export (and every checkpoint) has the same tensors
    from safetensors import safe_open

    with (
        safe_open(tmp_path / "whole" / "model.safetensors", "pt") as a,
        safe_open(tmp_path / "eager" / "model.safetensors", "pt") as b,
    ):
        assert sorted(a.keys()) == sorted(b.keys())
        assert not [k for k in a.keys() if "_orig_mod" in k]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_ranks_compiled_under_ddp_and_fsdp_train_to_the_eager_losses(kind, configs, tmp_path, data_dir):
    eager, compiled = configs
    got = {}
    for name, cfg in (("eager", eager), ("compiled", compiled)):
        run_dir = tmp_path / name
        cmd = torchrun_cmd(cfg, run_dir, data_dir)
        if kind == "fsdp":
            cfg_k = tmp_path / f"{name}-fsdp.yaml"
            cfg_k.write_text(cfg.read_text() + "parallelism:\n  kind: fsdp\n")
            cmd = torchrun_cmd(cfg_k, run_dir, data_dir)
        p = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        got[name] = losses(run_dir)
        if name == "compiled":
            assert "train.compile: 2 blocks compiled in place" in p.stdout + p.stderr
    assert _close(got["compiled"], got["eager"]), got


def test_where_the_backend_cannot_compile_it_says_so_in_one_line_and_trains_eager(
    configs, tmp_path, data_dir, clean_env, capfd, monkeypatch
):
    """No C++ compiler on the CPU: one warning, then the eager model."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert _train(configs[1], tmp_path / "run", data_dir, "--max-steps", "2") == 0
    said = [line.split("] ", 1)[1] for line in capfd.readouterr().err.splitlines() if "train.compile" in line]
    assert said == [
        "train.compile: off: inductor needs a C++ compiler on the CPU and no-such-compiler is not on PATH (set CXX)"
    ]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["compile"] == (
        "off (the backend cannot compile here)"
    )


def test_the_mode_reaches_torch_compile_for_every_block(monkeypatch, caplog):
    """``train.compile.mode`` is torch.compile's, per block (stand-in blocks: nothing is compiled here)."""
    import torch

    from sbatch_gen.train import compiling

    calls = []

    class Block(torch.nn.Module):
        def compile(self, **kw):
            calls.append(kw)

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block(), Block(), Block()])
    monkeypatch.setattr(compiling, "compile_blocker", lambda device: None)
    with caplog.at_level("INFO", logger="sbatch_gen.train"):
        assert compiling.compile_blocks(model, torch.device("cpu"), False, "max-autotune-no-cudagraphs")
    assert calls == [{"fullgraph": True, "mode": "max-autotune-no-cudagraphs"}] * 3
    assert "3 blocks compiled in place, mode max-autotune-no-cudagraphs" in caplog.text
