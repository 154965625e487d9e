"""The command line on the nodes is built once (sbatch_gen/launch.py) for both kinds: a Slurm profile and an
SSH profile with the same paths, trainer and cross_region start the trainer with the same arguments, and
torchrun with the same flags where they mean the same thing. Checked on the lists both templates render
from and on the rendered scripts themselves (their arrays expanded by bash)."""

from __future__ import annotations

import subprocess

import pytest

from sbatch_gen.launch import SLURM, SSH, Concat, Option, Var, torchrun_argv, trainer_argv
from sbatch_gen.loader import load_site
from sbatch_gen.render import render_site, shell_quote

from .conftest import REPO

XR = "cross_region={enabled: true, region: eu, regions: [eu, us], transport: {kind: fs, root: /mnt/xr mail}}"
SHARED = [
    "paths.run_dir=runs/same",
    "trainer.config=configs/tiny.yaml",
    "trainer.resume=auto",
    "torchrun.procs_per_node=2",
    "torchrun.rdzv_timeout_s=300",
    "torchrun.max_restarts=1",
    "torchrun.rdzv_port=29555",
]
VARIANTS = {
    "plain": [],
    "data": ["paths.data=data/shards"],
    "max-steps": ["trainer.max_steps=7"],
    "extra-args": ["trainer.extra_args=[--note, it's $HOME `x`, '', --flag=a b]"],
    "cross-region": [XR],
    "everything": ["paths.data=data/shards", "trainer.max_steps=7", "trainer.extra_args=[--note, x y]", XR],
}


def _profiles(variant: str):
    sets = SHARED + VARIANTS[variant]
    return (load_site(REPO / "sites", "local", sets), load_site(REPO / "sites", "ssh-local", sets))


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_kinds_build_the_same_trainer_argv(variant):
    slurm, ssh = _profiles(variant)
    assert trainer_argv(slurm.profile) == trainer_argv(ssh.profile)


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_kinds_build_the_same_torchrun_flags_where_they_mean_the_same(variant):
    slurm, ssh = _profiles(variant)
    a = {o.words[0]: o for o in torchrun_argv(slurm.profile, SLURM)}
    b = {o.words[0]: o for o in torchrun_argv(ssh.profile, SSH)}
    # The node count and the run id are each launcher's own variables; SSH also names node 0 the store's
    # host (is_host) and binds every node to the pinned interface's address (--local-addr).
    for flag in ("--nproc-per-node", "--rdzv-backend=c10d", "--max-restarts"):
        assert a[flag] == b[flag], flag
    endpoint = [
        w for w in (o.words[0] for o in a.values()) if isinstance(w, Concat) and "--rdzv-endpoint=" in w.parts
    ]
    assert endpoint and endpoint == [
        w for w in (o.words[0] for o in b.values()) if isinstance(w, Concat) and "--rdzv-endpoint=" in w.parts
    ]
    conf_a = next(o for o in a.values() if o.key == "torchrun.rdzv_timeout_s").words[0]
    conf_b = next(o for o in b.values() if o.key == "torchrun.rdzv_timeout_s").words[0]
    assert conf_a == "--rdzv-conf=join_timeout=300"
    assert conf_b == Concat(("--rdzv-conf=", "join_timeout=300,is_host=", Var("IS_HOST")))
    assert a["--nnodes"].words[1] == Var("SLURM_NNODES") and b["--nnodes"].words[1] == Var("NNODES")


# ---- the rendered scripts ------------------------------------------------------------------------------

# The run-time values, the same for both launchers (each under its own variable name where they differ).
RUNTIME = {
    "NPROC_PER_NODE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29555",
    "SLURM_NNODES": "2",
    "NNODES": "2",
    "SLURM_JOB_ID": "77",
    "TAG": "sbg-x-29555-1",
    "ATTEMPT": "1",
    "IS_HOST": "1",
    "NODE_ADDR": "10.0.0.1",
    "RESUME": "auto",
}


def _block(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i : text.index(end, i) + len(end)]


def _expand(code: str, arrays: list[str]) -> dict[str, list[str]]:
    """Run code under bash and print each array NUL-separated."""
    sets = "".join(f"{k}={shell_quote(v)}\n" for k, v in RUNTIME.items())
    prints = "".join(f"printf '%s\\0' \"${{{a}[@]}}\"; printf '\\1\\0'\n" for a in arrays)
    r = subprocess.run(
        ["bash", "-c", "set -eu\n" + sets + code + "\n" + prints], capture_output=True, timeout=30
    )
    assert r.returncode == 0, r.stderr.decode()
    words = r.stdout.decode().split("\0")[:-1]
    out, cur = {}, []
    names = iter(arrays)
    for w in words:
        if w == "\1":
            out[next(names)] = cur
            cur = []
        else:
            cur.append(w)
    return out


def _rendered_argv(variant: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    slurm, ssh = _profiles(variant)
    sb = render_site(slurm)[0].text
    sh = render_site(ssh)[0].text
    s_settings = _block(sb, "# ---- settings from the profile", "# ---- environment of every job step")
    s_arrays = _block(sb, "\nTORCHRUN_ARGS=(\n", "\n)\n") + _block(sb, "\nTRAINER_ARGS=(\n", "\n)\n")
    h_settings = _block(sh, "\nHOSTS=(", "\nSITE=")
    h_arrays = _block(sh, "  local -a torchrun_args=(\n", "\n  )\n  torchrun ").replace(
        "local -a ", "declare -a "
    )
    h_arrays = h_arrays[: -len("  torchrun ")]
    a = _expand(s_settings + s_arrays, ["TORCHRUN_ARGS", "TRAINER_ARGS"])
    b = _expand(h_settings + h_arrays, ["torchrun_args", "trainer_args"])
    return (
        {"torchrun": a["TORCHRUN_ARGS"], "trainer": a["TRAINER_ARGS"]},
        {"torchrun": b["torchrun_args"], "trainer": b["trainer_args"]},
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_rendered_scripts_start_the_trainer_with_the_same_arguments(variant):
    slurm, ssh = _rendered_argv(variant)
    assert slurm["trainer"] == ssh["trainer"]
    assert slurm["trainer"][:6] == [
        "--config",
        "configs/tiny.yaml",
        "--run-dir",
        "runs/same",
        "--resume",
        "auto",
    ]
    if variant == "extra-args":
        assert slurm["trainer"][-4:] == ["--note", "it's $HOME `x`", "", "--flag=a b"]
    if variant == "everything":
        assert ["--data-path", "data/shards", "--max-steps", "7"] == slurm["trainer"][6:10]
        assert "/mnt/xr mail" in slurm["trainer"] and slurm["trainer"][-2:] == ["--note", "x y"]


@pytest.mark.parametrize("variant", ["plain", "everything"])
def test_the_rendered_torchrun_flags_agree(variant):
    slurm, ssh = _rendered_argv(variant)
    assert slurm["torchrun"] == [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend=c10d",
        "--rdzv-id=77",
        "--rdzv-endpoint=10.0.0.1:29555",
        "--rdzv-conf=join_timeout=300",
        "--max-restarts",
        "1",
    ]
    assert ssh["torchrun"] == [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend=c10d",
        "--rdzv-id=sbg-x-29555-1.1",
        "--rdzv-endpoint=10.0.0.1:29555",
        "--rdzv-conf=join_timeout=300,is_host=1",
        "--local-addr=10.0.0.1",
        "--max-restarts",
        "1",
    ]


def test_run_time_values_render_as_quoted_expansions():
    assert shell_quote(Var("RUN_DIR")) == '"$RUN_DIR"'
    assert shell_quote(Concat(("--rdzv-id=", Var("TAG"), ".", Var("ATTEMPT")))) == '--rdzv-id="$TAG.$ATTEMPT"'
    assert shell_quote(Concat((Var("A"), '_b $`"\\'))) == '"${A}_b \\$\\`\\"\\\\"'
    with pytest.raises(ValueError):
        Var("not a name")
    with pytest.raises(ValueError):
        Concat(("no variable",))
    assert Option(("--max-steps", "7"), "trainer.max_steps").key == "trainer.max_steps"
