"""Every rendered script passes bash -n and shellcheck (no findings at any severity), including renders
that use every optional feature; the preflight function behaves as documented when run for real."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sbatch_gen.render import JOB_LIBRARY_FILE
from sbatch_gen.testing.s3server import free_port

from .conftest import REPO, edit_site, python_without_torch, sg
from .script_parts import SCRIPT_SUFFIXES, function_text, node_library

pytestmark = pytest.mark.slow  # shellcheck and bash on every render

OUT_FILES = sorted(p for p in (REPO / "out").iterdir() if p.is_file() and p.name.endswith(SCRIPT_SUFFIXES))


def lint(path: Path) -> None:
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, f"bash -n {path}:\n{r.stderr}"
    assert shutil.which("shellcheck"), "shellcheck is not installed (make system-deps installs it)"
    r = subprocess.run(["shellcheck", "-x", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, f"shellcheck {path}:\n{r.stdout}{r.stderr}"


def test_out_is_not_empty():
    assert {"eu.sbatch", "us.sbatch", "local.sbatch", "eu.setup.sbatch"} <= {p.name for p in OUT_FILES}


@pytest.mark.parametrize("path", OUT_FILES, ids=[p.name for p in OUT_FILES])
def test_committed_render_passes_bash_n_and_shellcheck(path):
    lint(path)


def test_every_option_renders_lint_clean(work):
    eu = work / "sites" / "eu.yaml"
    edit_site(
        eu,
        **{
            "slurm.reservation": "maint-window",
            "slurm.gpu_request": "gpus-per-node",
            "slurm.extra_directives": ["--mail-type=FAIL", "--comment=xr"],
            "python_env": {"kind": "none", "modules": ["cuda/12.4", "nccl/2.21"]},
            "container": {
                "image": "nvcr.io#nvidia/pytorch:24.10-py3",
                "mounts": ["/lustre/eu:/lustre/eu:ro"],
                "mount_home": False,
            },
            "trainer.extra_args": ["--note", 'it\'s a "test" with $HOME and `date` *'],
            "trainer.max_steps": 100,
            "extra_env": {"FI_PROVIDER": "efa", "WEIRD": "a b;c|d'e\"f$g`h`"},
            "nccl.ib_gid_index": 3,
            "nccl.debug_subsys": "INIT,NET",
            "topology.nccl_topo_file": "/etc/nccl/topo h200.xml",
        },
    )
    us = work / "sites" / "us.yaml"
    edit_site(
        us,
        python_env={
            "kind": "conda",
            "conda_sh": "/opt/conda/etc/profile.d/conda.sh",
            "name": "xr",
            "modules": ["cuda/12.4"],
        },
    )
    local = work / "sites" / "local.yaml"
    edit_site(
        local,
        **{
            "python_env": {
                "kind": "conda",
                "conda_sh": "/opt/conda/etc/profile.d/conda.sh",
                "prefix": "/opt/envs/x y",
            },
            "preflight.enabled": False,
            "network.socket_ifname": "lo",
        },
    )
    r = sg("render", "--site", "eu", "--site", "us", "--site", "local", "--out", "o")
    assert r.code == 0, r.err
    eu_text = (work / "o" / "eu.sbatch").read_text()
    assert "--container-image='nvcr.io#nvidia/pytorch:24.10-py3'" in eu_text
    assert "#SBATCH --gpus-per-node=h200:8" in eu_text
    assert "#SBATCH --reservation=maint-window" in eu_text
    assert "MODULES=(cuda/12.4 nccl/2.21)  # python_env.modules" in eu_text
    env_line = next(line for line in eu_text.splitlines() if line.startswith("  --container-env="))
    assert 'export NCCL_TOPO_FILE="${NCCL_TOPO_FILE-/etc/nccl/topo h200.xml}"' in eu_text
    for name in (
        "NCCL_TOPO_FILE",
        "NCCL_IB_HCA",
        "NCCL_DEBUG_SUBSYS",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
        "FI_PROVIDER",
        "WEIRD",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SBATCH_GEN_STOP_FILE",
        "OMP_NUM_THREADS",
        "PYTHONPATH",
    ):
        assert name in env_line
    for p in sorted((work / "o").iterdir()):
        if p.name.endswith(SCRIPT_SUFFIXES):
            lint(p)


# ---------------------------------------------------------------------------------------------------
# The preflight function, run for real on this machine (no Slurm needed: it is plain bash + python).


def _preflight_script(text: str) -> str:
    """The preflight and the functions it calls, as srun ships them to the nodes (export -f)."""
    return node_library(text)


# What srun runs on every node: each node adds its rank and the node count (templates/slurm.sbatch.j2).
SRUN_PREFLIGHT = '\npreflight node_id="$SLURM_NODEID" nnodes="$SLURM_NNODES" "$@"'


def _run_preflight(
    tmp_path,
    *,
    module="sbatch_gen.train",
    config=None,
    data="",
    ifname="lo",
    gpus="0",
    node_id="0",
    nnodes="1",
    port=None,
    timeout="5",
    run_dir=None,
    marker="",
    extra_path=None,
    env_extra=None,
    background=False,
):
    text = (REPO / "out" / "local.sbatch").read_text()
    config = config or str(REPO / "configs" / "tiny.yaml")
    port = str(port or free_port())
    if run_dir is None:
        run_dir = tmp_path / "run"
        run_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM") and k != "CUDA_VISIBLE_DEVICES"}
    path = f"{Path(sys.executable).parent}:{env['PATH']}"
    if extra_path is not None:  # stub commands (a fake nvidia-smi) come first
        path = f"{extra_path}:{path}"
    env.update(
        PATH=path,
        SLURMD_NODENAME=f"node{node_id}",
        SLURM_NODEID=node_id,
        SLURM_NNODES=nnodes,
        PYTHONPATH=str(REPO),
    )
    env.update(env_extra or {})
    args = [
        f"module={module}",
        f"config={config}",
        f"data={data}",
        f"ifname={ifname}",
        f"gpus={gpus}",
        "gpus_key=slurm.gpus_per_node",
        "log_topology=0",
        f"run_dir={run_dir}",
        f"shared_marker={marker}",
        "rdzv_host=127.0.0.1",
        f"rdzv_port={port}",
        f"connect_timeout_s={timeout}",
    ]
    cmd = ["bash", "-c", _preflight_script(text) + SRUN_PREFLIGHT, "preflight", *args]
    if background:
        return subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_preflight_ok_on_one_node(tmp_path):
    r = _run_preflight(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "preflight ok on node0" in r.stdout


def _python_on_path() -> str:
    """What `command -v python` prints in the preflight (the PATH _run_preflight gives it)."""
    found = shutil.which("python", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    assert found, "no python on PATH"
    return found


# The whole reason, up to and including the profile field it names (docs/slurm.md promises the field).
@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (
            {"module": "no_such_trainer_module"},
            "trainer module no_such_trainer_module not importable by {python} from {repo} (trainer.module, python_env)\n",
        ),
        (
            {"ifname": "nosuchif0"},
            "network interface nosuchif0 does not exist (network.socket_ifname); have: ",
        ),
        (
            {"config": "/nonexistent/train.yaml"},
            "train config /nonexistent/train.yaml not readable from {repo} (trainer.config)",
        ),
        (
            {"data": "/nonexistent/shard.bin"},
            "data path /nonexistent/shard.bin does not exist (paths.data)\n",
        ),
        (
            {"node_id": "1", "nnodes": "2", "timeout": "1"},
            "rendezvous endpoint 127.0.0.1:{port} not reachable within 1 s: ",
        ),
    ],
    ids=["module", "interface", "config", "data", "rendezvous"],
)
def test_preflight_fails_fast_naming_the_node_and_field(tmp_path, kwargs, reason):
    port = free_port()
    t0 = time.monotonic()
    r = _run_preflight(tmp_path, port=port, **kwargs)
    assert r.returncode != 0
    node = f"node{kwargs.get('node_id', '0')}"
    reason = reason.format(python=_python_on_path(), repo=REPO, port=port)
    assert f"preflight FAILED on {node}: {reason}" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30


def test_preflight_accepts_a_data_path_that_exists(tmp_path):
    shard = tmp_path / "local.bin"
    shard.write_bytes(b"x")
    r = _run_preflight(tmp_path, data=str(shard))
    assert r.returncode == 0, r.stderr
    assert "preflight ok on node0" in r.stdout


def test_preflight_fails_when_the_run_dir_cannot_be_created(tmp_path):
    # Tests run as root, so a chmod 0555 directory would still be writable: use a path nothing can create.
    (tmp_path / "a-file").write_text("")
    run_dir = tmp_path / "a-file" / "run"
    r = _run_preflight(tmp_path, run_dir=run_dir)
    assert r.returncode != 0
    assert (
        f"preflight FAILED on node0: run dir {run_dir} cannot be created or is not writable (paths.run_dir)\n"
        in r.stderr
    ), r.stderr
    assert not list(tmp_path.glob("**/.preflight.*"))


def test_preflight_creates_a_missing_run_dir(tmp_path):
    run_dir = tmp_path / "no-such-dir" / "run"
    r = _run_preflight(tmp_path, run_dir=run_dir)
    assert r.returncode == 0, r.stderr
    assert f", run dir {run_dir} writable" in r.stdout, r.stdout
    assert run_dir.is_dir() and not list(run_dir.iterdir())


def test_preflight_fails_on_a_node_that_does_not_see_node0s_run_dir(tmp_path):
    """The batch shell (node 0) writes the marker into the run dir; a node with another filesystem there does
    not see it. Node 0 itself does not look."""
    marker = tmp_path / "run" / ".sbatch-gen-shared.77.0"
    port = free_port()
    r = _run_preflight(tmp_path, node_id="1", nnodes="2", port=port, timeout="1", marker=str(marker))
    assert r.returncode != 0
    assert (
        f"preflight FAILED on node1: run dir {tmp_path / 'run'} is not the one node 0 sees (checkpoints need a "
        "filesystem all nodes share)\n"
    ) in r.stderr, r.stderr
    assert _run_preflight(tmp_path, node_id="0", nnodes="1", marker=str(marker)).returncode == 0
    (tmp_path / "run").mkdir(exist_ok=True)
    marker.write_text("")
    server = _run_preflight(tmp_path, node_id="0", nnodes="2", port=port, timeout="20", background=True)
    client = _run_preflight(tmp_path, node_id="1", nnodes="2", port=port, timeout="20", marker=str(marker))
    server.communicate(timeout=60)
    assert client.returncode == 0, client.stderr
    assert ", run dir shared with node 0" in client.stdout, client.stdout


def test_preflight_names_every_problem_of_the_node_in_one_line(tmp_path):
    r = _run_preflight(tmp_path, config="/nonexistent/train.yaml", data="/nonexistent/shard.bin")
    assert r.returncode != 0
    failed = [x for x in r.stderr.splitlines() if x.startswith("preflight FAILED on node0: ")]
    assert failed == [
        "preflight FAILED on node0: train config /nonexistent/train.yaml not readable from "
        f"{REPO} (trainer.config); data path /nonexistent/shard.bin does not exist (paths.data)"
    ], r.stderr


def test_preflight_fails_without_torch(tmp_path):
    bindir = python_without_torch(tmp_path / "no-torch").parent
    r = _run_preflight(tmp_path, extra_path=bindir)
    assert r.returncode != 0
    assert (
        f"preflight FAILED on node0: torch not importable by {bindir / 'python'} from {REPO} (python_env)"
        in r.stderr
    ), r.stderr


def test_preflight_fails_when_the_rendezvous_port_is_busy_on_node0(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = _run_preflight(tmp_path, port=port)
    assert r.returncode != 0
    assert (
        f"preflight FAILED on node0: cannot listen on rendezvous port {port}: Address already in use "
        "(torchrun.rdzv_port; another launch?)\n"
    ) in r.stderr, r.stderr


# ---- GPU count: a fake nvidia-smi on PATH (this machine has no GPUs) -------------------------------

NVIDIA_SMI = r"""#!/bin/bash
# stub: `nvidia-smi -L` lists $FAKE_GPUS GPUs; `nvidia-smi topo -m` prints a line
if [[ $1 == -L ]]; then
  for ((i = 0; i < FAKE_GPUS; i++)); do
    echo "GPU $i: NVIDIA H200 (UUID: GPU-0000000$i-1111-2222-3333-444444444444)"
  done
  exit 0
fi
echo "GPU0 X"
"""


def _fake_nvidia_smi(tmp_path) -> Path:
    bindir = tmp_path / "stub-bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "nvidia-smi").write_text(NVIDIA_SMI)
    (bindir / "nvidia-smi").chmod(0o755)
    return bindir


@pytest.mark.parametrize(
    "listed, cuda_visible, visible",
    [(2, None, 2), (9, None, 9), (0, None, 0), (8, "0,1", 2), (8, "0,1,2,3,4,5,6,7,8", 9)],
    ids=["smi-fewer", "smi-more", "smi-none", "cvd-fewer", "cvd-more"],
)
def test_preflight_gpu_count_mismatch_fails(tmp_path, listed, cuda_visible, visible):
    env = {"FAKE_GPUS": str(listed)}
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    r = _run_preflight(tmp_path, gpus="8", extra_path=_fake_nvidia_smi(tmp_path), env_extra=env)
    assert r.returncode != 0
    assert (
        f"preflight FAILED on node0: {visible} GPUs visible, the profile expects 8 (slurm.gpus_per_node)\n"
    ) in r.stderr, r.stderr


@pytest.mark.parametrize("listed, cuda_visible", [(8, None), (16, "0,1,2,3,4,5,6,7")], ids=["smi", "cvd"])
def test_preflight_gpu_count_match_passes(tmp_path, listed, cuda_visible):
    env = {"FAKE_GPUS": str(listed)}
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    r = _run_preflight(tmp_path, gpus="8", extra_path=_fake_nvidia_smi(tmp_path), env_extra=env)
    assert r.returncode == 0, r.stderr
    assert "preflight ok on node0: " in r.stdout and ", interface lo 127.0.0.1, 8 GPUs, " in r.stdout, (
        r.stdout
    )


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_preflight_gpu_site_without_nvidia_smi_fails(tmp_path):
    r = _run_preflight(tmp_path, gpus="8")
    assert r.returncode != 0
    assert (
        "preflight FAILED on node0: nvidia-smi not found, but the site has 8 GPUs per node "
        "(slurm.gpus_per_node)\n"
    ) in r.stderr, r.stderr


def test_preflight_rendezvous_between_two_nodes(tmp_path):
    port = free_port()
    server = _run_preflight(tmp_path, node_id="0", nnodes="2", port=port, timeout="20", background=True)
    client = _run_preflight(tmp_path, node_id="1", nnodes="2", port=port, timeout="20")
    out, err = server.communicate(timeout=60)
    assert client.returncode == 0, client.stderr
    assert server.returncode == 0, err
    assert "preflight ok on node0" in out and "preflight ok on node1" in client.stdout


# ---- the node-side logic is written once (templates/_node.j2) --------------------------------------------


@pytest.mark.parametrize("name", ["log", "die", "load_modules", "activate_env", "preflight"])
def test_every_launcher_renders_the_same_node_function(name):
    found = {p.name: function_text(p.read_text(), name) for p in OUT_FILES}
    found = {k: v for k, v in found.items() if v is not None}
    # Slurm's (a setup script, or the job library a training script sources) and the SSH launchers'
    kinds = {"slurm" if k.endswith(".sbatch") or k == JOB_LIBRARY_FILE else "ssh" for k in found}
    assert kinds == {"slurm", "ssh"}, sorted(found)
    assert len(set(found.values())) == 1, f"{name}() differs between {sorted(found)}"
