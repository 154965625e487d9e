"""The public library (sbatch_gen.train.api): what it imports, the stop request, the --xr-* parsing, the
DiLoCo wrapper on plain torch (regions as threads, no process group), and that the companion trainer
reaches the stop hand-off and the cross-region sync only through it."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from sbatch_gen.train import api
from sbatch_gen.train.api import (
    CrossRegion,
    CrossRegionError,
    DiLoCo,
    StopRequest,
    cross_region_from_args,
)
from sbatch_gen.train.dist import DistInfo, dist_info_from_process_group

pytestmark = pytest.mark.slow  # imports the library in a fresh interpreter; trains two threads' regions

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_library_pulls_in_neither_the_renderer_nor_torch():
    code = (
        "import sys\n"
        "import sbatch_gen.train.api as api\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jinja2', 'numpy')\n"
        "             or m in ('sbatch_gen.render', 'sbatch_gen.cli', 'sbatch_gen.launch')\n"
        "             or m.startswith('sbatch_gen.profiles'))\n"
        "print(bad)\n"
        "print(sorted(api.__all__))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    loaded, names = r.stdout.splitlines()
    assert loaded == "[]"
    for name in ("DiLoCo", "StopRequest", "EXIT_REQUEUE", "cross_region_from_args", "XRNoQuorum"):
        assert name in names


def test_exit_process_runs_what_a_normal_exit_runs_then_skips_the_teardown(tmp_path):
    code = (
        "import atexit, sys, threading, time\n"
        "from sbatch_gen.train.api import exit_process\n"
        "class Global:\n"
        "    def __del__(self):\n"
        "        print('teardown ran', flush=True)\n"  # a gloo worker thread's abort would come here
        "kept = Global()\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread joined'))).start()\n"
        "sys.stdout.write('buffered, no newline')\n"
        "exit_process(7)\n"
        "print('not reached')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 7, r.stderr
    assert r.stdout == "buffered, no newlinethread joined\natexit ran\n", r.stdout


# -- the stop request ---------------------------------------------------------------------------------------
def test_the_stop_file_comes_from_the_flag_else_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SBATCH_GEN_STOP_FILE", str(tmp_path / "env.stop"))
    assert StopRequest.from_env().stop_file == tmp_path / "env.stop"
    assert StopRequest.from_env(tmp_path / "flag.stop").stop_file == tmp_path / "flag.stop"
    monkeypatch.delenv("SBATCH_GEN_STOP_FILE")
    assert StopRequest.from_env().stop_file is None


def test_a_signal_or_the_stop_file_is_a_request_and_the_handlers_are_put_back(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopRequest(tmp_path / "stop")
    with stop:
        assert not stop.local() and not stop.agree()  # no process group: agree() is local()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal changes nothing
        assert stop.local() and stop.agree()
        assert stop.reason() == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before
    by_file = StopRequest(tmp_path / "stop")
    assert not by_file.local()
    (tmp_path / "stop").touch()
    assert by_file.local() and by_file.reason() == f"stop file {tmp_path / 'stop'}"


def test_only_the_named_signals_are_handled():
    stop = StopRequest(signals=[signal.SIGTERM])
    before = signal.getsignal(signal.SIGUSR1)
    with stop:
        assert signal.getsignal(signal.SIGUSR1) is before
        assert signal.getsignal(signal.SIGTERM) == stop._handler


def test_rank_0_writes_the_ack_and_an_acked_attempt_exits_before_any_work(tmp_path, monkeypatch):
    stop_file = tmp_path / "d" / "stop"
    stop = StopRequest(stop_file)
    monkeypatch.setenv("RANK", "1")
    assert stop.acknowledge(7, tmp_path / "ckpt-7") is None
    assert not list(tmp_path.rglob("*.ack"))
    monkeypatch.setenv("RANK", "0")
    ack = stop.acknowledge(7, tmp_path / "ckpt-7", reason="SIGUSR1")
    assert ack == tmp_path / "d" / "stop.ack"
    rec = json.loads(ack.read_text())
    assert (rec["step"], rec["checkpoint"], rec["reason"]) == (7, str(tmp_path / "ckpt-7"), "SIGUSR1")
    # nothing had created the stop file (a stop of the trainer's own): the ack creates it, so that workers
    # torchrun restarts in this attempt exit at once
    assert stop_file.exists()
    with pytest.raises(SystemExit) as e:
        stop.exit_if_acked()
    assert e.value.code == 0  # the ack says "checkpointed": torchrun must not print a failure
    stop_file.unlink()  # the next attempt's stop file is another one: start normally
    stop.exit_if_acked()
    assert StopRequest().acknowledge(1) is None  # signals only: nobody to tell


def test_rank_0_writes_why_it_cannot_run_on_one_line_and_never_fails_for_it(tmp_path, monkeypatch, capsys):
    """<stop file>.fatal: "no requeue can fix this" for the batch shell. A reason of several lines becomes one;
    other ranks and a trainer without a stop file write nothing; an unwritable place is said, not raised (the
    error being reported must stay the one the user sees)."""
    stop = StopRequest(tmp_path / "d" / "stop")
    monkeypatch.setenv("RANK", "1")
    assert stop.fatal("bad") is None and not (tmp_path / "d").exists()
    monkeypatch.setenv("RANK", "0")
    path = stop.fatal("config error:\n  a.yaml:3: lr: must be > 0\n\n  a.yaml:4: steps: must be >= 1\n")
    assert path == tmp_path / "d" / "stop.fatal"
    assert path.read_text() == "config error: a.yaml:3: lr: must be > 0; a.yaml:4: steps: must be >= 1\n"
    assert StopRequest().fatal("bad") is None
    (tmp_path / "file").write_text("")
    assert StopRequest(tmp_path / "file" / "stop").fatal("bad") is None  # its directory is a file
    assert "cannot write" in capsys.readouterr().err


# -- the --xr-* flags ---------------------------------------------------------------------------------------
def test_the_xr_flags_are_taken_out_and_the_rest_stays_in_order(tmp_path):
    argv = ["--lr", "0.1", "--xr-enabled", "--xr-region", "eu", "--xr-regions", "eu,us", "pos"]
    argv += ["--xr-run-id", "r1", "--xr-root", str(tmp_path), "--steps=5"]
    xr, rest = cross_region_from_args(argv, environ={})
    assert rest == ["--lr", "0.1", "pos", "--steps=5"]
    assert (xr.enabled, xr.region, xr.regions, xr.run_id) == (True, "eu", ["eu", "us"], "r1")
    assert xr.transport.kind == "fs" and Path(xr.transport.root) == tmp_path


def test_a_bad_xr_flag_names_the_flag():
    argv = ["--xr-enabled", "--xr-region", "eu", "--xr-regions", "eu,us", "--xr-inner-steps", "zero"]
    with pytest.raises(CrossRegionError, match=r"--xr-inner-steps: "):
        cross_region_from_args(argv, environ={})


def test_a_bad_transport_value_names_the_flag_or_variable_the_user_set():
    argv = ["--xr-enabled", "--xr-region", "eu", "--xr-regions", "eu,us", "--xr-root", "~/mail"]
    with pytest.raises(CrossRegionError, match=r"^--xr-root: "):
        cross_region_from_args(argv, environ={})
    env = {"SBATCH_GEN_XR_ENABLED": "1", "SBATCH_GEN_XR_REGION": "eu", "SBATCH_GEN_XR_REGIONS": "eu,us"}
    with pytest.raises(CrossRegionError, match=r"^SBATCH_GEN_XR_ROOT: "):
        cross_region_from_args([], environ={**env, "SBATCH_GEN_XR_ROOT": "~/mail"})
    with pytest.raises(CrossRegionError, match=r"^SBATCH_GEN_XR_\* variables: .*not in regions"):
        cross_region_from_args([], environ={**env, "SBATCH_GEN_XR_REGION": "ap"})


def test_a_misspelt_xr_flag_is_refused_not_passed_on():
    with pytest.raises(
        CrossRegionError, match=r"--xr-inner-step: unknown cross-region flag; did you mean --xr-inner-steps\?"
    ):
        cross_region_from_args(["--xr-enabled", "--xr-inner-step=3", "--lr", "1"], environ={})


def test_a_parser_of_your_own_can_carry_the_flags():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float)
    api.add_cross_region_arguments(ap)
    ns = ap.parse_args(["--lr", "1", "--xr-enabled", "--xr-region", "us", "--xr-regions", "eu,us"])
    xr, rest = cross_region_from_args(namespace=ns, environ={})
    assert xr.enabled and xr.region == "us" and rest == []


def test_without_flags_the_environment_is_read_and_without_either_it_is_disabled():
    env = {"SBATCH_GEN_XR_ENABLED": "1", "SBATCH_GEN_XR_REGION": "us", "SBATCH_GEN_XR_REGIONS": "eu,us"}
    xr, rest = cross_region_from_args(["--lr", "1"], environ=env)
    assert xr.enabled and xr.region == "us" and rest == ["--lr", "1"]
    xr, _ = cross_region_from_args([], environ={"UNRELATED": "x"})
    assert not xr.enabled
    with pytest.raises(CrossRegionError, match="SBATCH_GEN_XR_INNER_STEPS"):
        cross_region_from_args([], environ={**env, "SBATCH_GEN_XR_INNER_STEPS": "zero"})


# -- DiLoCo on plain torch ------------------------------------------------------------------------------------
REGIONS = ["eu", "us"]


def _xr(region: str, root: Path, **kw) -> CrossRegion:
    args = ["--xr-enabled", "--xr-region", region, "--xr-regions", ",".join(REGIONS), "--xr-run-id", "api"]
    args += [
        "--xr-root",
        str(root),
        "--xr-inner-steps",
        "3",
        "--xr-timeout-s",
        "60",
        "--xr-shard-mb",
        "0.001",
    ]
    for k, v in kw.items():
        args += [f"--xr-{k.replace('_', '-')}", str(v)]
    return cross_region_from_args(args, environ={})[0]


_INIT = threading.Lock()  # regions are threads of this process; nn.Linear draws from torch's global RNG


def _model(seed: int) -> nn.Module:
    with _INIT:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(region: str, step: int):
    g = torch.Generator().manual_seed(1000 * REGIONS.index(region) + step)
    x = torch.randn(16, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True) * (1.0 if region == "eu" else -0.5)


def _train(
    region: str,
    root: Path,
    steps: int,
    state: dict | None = None,
    stop_at: int | None = None,
    xr: dict | None = None,
):
    """A user's loop around the wrapper: plain model, plain AdamW, the wrapper's calls only (``xr``: more
    --xr-* flags)."""
    model = _model(seed=REGIONS.index(region) + 1)  # different inits: start() aligns them to eu's theta0
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    step, records = 0, []
    with DiLoCo(model, _xr(region, root, **(xr or {}))) as diloco:
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            diloco.load_state_dict(state["diloco"])
            step = state["step"]
        step = diloco.start(step)
        while step < steps:
            step += 1
            x, y = _batch(region, step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            diloco.before_optimizer_step(step, tokens=16)
            opt.step()
            rec = diloco.after_step(step, tokens=16)
            if rec is not None:
                records.append(rec)
                step = rec.get("xr_adopted_step", step)
            if step == stop_at:
                diloco.leave(step, "test stop")
                saved = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
                saved["diloco"] = diloco.state_dict()
                return saved, records, diloco.round
        diloco.leave(step, "finished")
        return model, records, diloco.round


def _in_threads(fn):
    out, errs = {}, []

    def go(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    ts = [threading.Thread(target=go, args=(r,)) for r in REGIONS]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    if errs:
        raise errs[0]
    return out


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


# the payloads a user's trainer gets as the companion trainer does: dense bf16 (the default) and sparse (its
# error-feedback buffer travels in the wrapper's state_dict)
PAYLOADS = {"bf16": {}, "sparse": {"payload_dtype": "sparse", "sparse_chunk": 64, "sparse_density": 0.1}}


@pytest.mark.parametrize("payload", PAYLOADS)
def test_diloco_around_a_plain_model_ends_bitwise_equal_in_every_region(tmp_path, payload):
    out = _in_threads(lambda r: _train(r, tmp_path, steps=9, xr=PAYLOADS[payload]))
    eu, us = out["eu"][0], out["us"][0]
    assert torch.equal(_flat(eu), _flat(us))
    assert [rec["xr_round"] for rec in out["eu"][1]] == [1, 2, 3] and out["us"][2] == 3
    assert out["eu"][1][0]["xr_members"] == REGIONS
    assert out["eu"][1][0].get("xr_sparse_density") == (6 / 64 if payload == "sparse" else None)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_resume_from_the_users_checkpoint_ends_like_the_uninterrupted_run(tmp_path, payload):
    xr = PAYLOADS[payload]
    whole = _in_threads(lambda r: _train(r, tmp_path / "whole", steps=9, xr=xr))
    first = _in_threads(lambda r: _train(r, tmp_path / "split", steps=9, stop_at=6, xr=xr))
    assert all(round_ == 2 for _, _, round_ in first.values())
    second = _in_threads(lambda r: _train(r, tmp_path / "split", steps=9, state=first[r][0], xr=xr))
    for r in REGIONS:
        assert torch.equal(_flat(second[r][0]), _flat(whole[r][0])), r
        assert [rec["xr_round"] for rec in second[r][1]] == [3]


def test_the_wrapper_refuses_a_disabled_xr_and_a_bad_checkpoint(tmp_path):
    with pytest.raises(CrossRegionError, match="disabled"):
        DiLoCo(_model(1), CrossRegion())
    xr = _xr("eu", tmp_path, regions="eu")
    with DiLoCo(_model(1), xr) as diloco:
        bad = diloco.state_dict()
        bad["momentum"] = torch.zeros(3)
        with pytest.raises(api.XRError, match="momentum"):
            diloco.load_state_dict(bad)


def test_the_wrappers_clip_is_the_canonical_norm(tmp_path):
    """``DiLoCo.clip_grad_norm_`` clips by the norm of sbatch_gen.train.gradnorm (the same bits whatever a
    region's sharding), within rounding of torch's, and returns it."""
    from sbatch_gen.train.gradnorm import canonical_grad_norm

    model = _model(1)
    model(torch.randn(3, 4)).square().sum().backward()
    want = canonical_grad_norm(list(model.parameters()), torch.device("cpu"))
    torch_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    with DiLoCo(model, _xr("eu", tmp_path, regions="eu", sync="grad")) as diloco:
        got = diloco.clip_grad_norm_(want.item() / 4)
    assert torch.equal(got, want) and abs(got.item() - torch_norm.item()) <= 1e-6 * torch_norm.item()
    after = canonical_grad_norm(list(model.parameters()), torch.device("cpu"))
    assert abs(after.item() - want.item() / 4) <= 1e-5 * want.item()


def test_without_a_process_group_the_wrapper_sees_one_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert dist_info_from_process_group() == DistInfo()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        dist_info_from_process_group()


# -- the companion trainer uses the library, nothing beside it ------------------------------------------------
# The companion trainer's own modules (sbatch_gen/train/): the loop by concern, on the library.
COMPANION_TRAINER = (
    "trainer.py",
    "loop.py",
    "agreement.py",
    "record.py",
    "resume.py",
    "state.py",
    "finish.py",
    "ddp.py",
    "optim.py",
)


def test_the_companion_trainer_reaches_stops_and_the_sync_only_through_the_public_api():
    """The companion trainer's modules and __main__.py import the stop request and the cross-region sync
    from .api alone."""
    train = REPO / "sbatch_gen" / "train"
    names = (*COMPANION_TRAINER, "__main__.py")
    for name in names:
        tree = ast.parse((train / name).read_text())
        imported = {
            (node.module or "") + ":" + alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        private = sorted(i for i in imported if i.split(":")[0] in ("signals", "xr", "xr.sync", "xr.diloco"))
        assert private == [], (name, private)
    for name in ("trainer.py", "loop.py", "finish.py", "__main__.py"):
        assert any(
            n.module == "api"
            for n in ast.walk(ast.parse((train / name).read_text()))
            if isinstance(n, ast.ImportFrom)
        ), name
    src = "".join((train / name).read_text() for name in COMPANION_TRAINER)
    for call in ("DiLoCo(", ".start(", ".after_step(", ".acknowledge("):
        assert call in src


def test_a_tensor_parallel_model_is_refused_naming_the_parameter(tmp_path):
    """A DTensor placed other than FSDP2's Shard(0) (tensor parallelism: Replicate or Shard(1)) is not one
    contiguous range of the parameter: the wrapper refuses it in one line naming the parameter."""
    from sbatch_gen.testing.s3server import free_port

    code = f"""
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from sbatch_gen.train.api import DiLoCo, cross_region_from_args
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
m[1].weight = nn.Parameter(distribute_tensor(m[1].weight.detach(), init_device_mesh("cpu", (1,)), [Replicate()]))
xr, _ = cross_region_from_args(["--xr-enabled", "--xr-region", "eu", "--xr-regions", "eu",
                                "--xr-root", {str(tmp_path)!r}], environ={{}})
try:
    DiLoCo(m, xr)
except ValueError as e:
    print("refused:", e)
dist.destroy_process_group()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        "refused: parameter 1.weight is a DTensor placed as [Replicate()] on a 1-D mesh: only FSDP2's Shard(0) "
        "on a 1-D mesh over the whole region is supported (no tensor or pipeline parallelism)"
    ), r.stdout
