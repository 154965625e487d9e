"""The SSH launcher's GPU-node checks (topology.numa_binding; nccl.ib_hca with nccl.ib_link_layer), run
locally under bash against a fake node (sbatch_gen/testing/fakenode.py: /sys and /proc under
SBATCH_GEN_SYSFS_ROOT, stub nvidia-smi and numactl on PATH). The same node program runs in the Slurm
preflight (sbatch_gen/node_program.py; tests/node/test_node_program.py has every case, and
tests/render/test_preflight_gpu_node.py runs them through the Slurm job): here, that preflight_main runs it,
as shipped in NODE_PROGRAM, with the launcher's settings and names each problem in its one FAILED line, and
that preflight_all names the node and the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sshkit import free_port, launcher_lib, run_lib, scrubbed_env

from sbatch_gen.testing.fakenode import FakeNode, path_without

pytestmark = pytest.mark.slow  # runs the launcher's preflight on a fake node (iproute2's ip: make install)

IB = {"mlx5_0": {1: "InfiniBand"}, "mlx5_1": {1: "InfiniBand"}}


def _launcher_lib(tmp_path: Path, *overrides: str) -> Path:
    """ssh-local as a 2-GPU site with NUMA binding and two HCAs, without its last line (`main "$@"`)."""
    return launcher_lib(
        tmp_path,
        free_port(),
        "node.gpus=2",
        "torchrun.procs_per_node=null",
        "topology.numa_binding=node",
        "nccl.ib_hca=[mlx5_0, mlx5_1]",
        *overrides,
    )


def _bash(lib: Path, node: FakeNode, code: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = scrubbed_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(node.env(f"{Path(sys.executable).parent}:{path if path is not None else env['PATH']}"))
    return run_lib(lib, code, env)


def _preflight_node0(lib: Path, node: FakeNode, path: str | None = None) -> subprocess.CompletedProcess:
    return _bash(lib, node, 'bash -c "$NODE_PROGRAM" sbatch-gen-node preflight_main 0', path)


def _failed(r: subprocess.CompletedProcess) -> str:
    """The problems of the node's one "preflight FAILED on HOST: ..." line, "; "-separated."""
    assert r.returncode != 0, r.stdout + r.stderr
    line = next((x for x in r.stderr.splitlines() if x.startswith("preflight FAILED on ")), None)
    assert line is not None, r.stdout + r.stderr
    return line.split(": ", 1)[1]


def _ok(r: subprocess.CompletedProcess) -> str:
    """What the node's one "preflight ok on HOST: ..." line says it found."""
    assert r.returncode == 0, r.stdout + r.stderr
    return next(x for x in r.stdout.splitlines() if x.startswith("preflight ok on ")).split(": ", 1)[1]


def _node(tmp_path: Path, **kw) -> FakeNode:
    args = {"gpu_numa": [0, 1], "numa_cpus": {0: "0-3", 1: "4-7"}, "allowed": "0-7", "hcas": IB, **kw}
    return FakeNode(tmp_path / "node", **args)


def test_a_healthy_gpu_node_passes(tmp_path):
    ok = _ok(_preflight_node0(_launcher_lib(tmp_path), _node(tmp_path)))
    assert ", 2 GPUs, NUMA binding node: numactl " in ok, ok
    assert (
        "; GPU 0 on NUMA node 0 (4 usable CPUs), GPU 1 on NUMA node 1 (4 usable CPUs); job step CPUs 0-7, "
        in ok
    )
    assert ", HCAs mlx5_0:1 mlx5_1:1: InfiniBand, " in ok, ok


def test_numactl_missing_fails(tmp_path):
    node = _node(tmp_path, numactl=False)
    r = _preflight_node0(_launcher_lib(tmp_path), node, path=path_without("numactl", tmp_path / "shadow"))
    assert _failed(r).startswith(
        "topology.numa_binding=node: numactl is not on PATH; torchrun starts every worker"
    )


def test_a_gpu_numa_node_without_an_allowed_cpu_fails(tmp_path):
    r = _preflight_node0(_launcher_lib(tmp_path), _node(tmp_path, allowed="0-3"))
    assert _failed(r).startswith(
        "topology.numa_binding=node: GPU 1 on NUMA node 1 (CPUs 4-7), but this job step "
        "may only run on CPUs 0-3: torchrun fails to start its workers"
    ), r.stderr


def test_numa_binding_unset_checks_nothing(tmp_path):
    lib = _launcher_lib(tmp_path, "topology.numa_binding=null")
    node = _node(tmp_path, allowed="0-3", numactl=False)
    r = _preflight_node0(lib, node, path=path_without("numactl", tmp_path / "shadow"))
    assert "NUMA" not in _ok(r)


def test_a_missing_hca_fails(tmp_path):
    r = _preflight_node0(_launcher_lib(tmp_path), _node(tmp_path, hcas={"mlx5_0": {1: "InfiniBand"}}))
    assert _failed(r) == "nccl.ib_hca: no adapter mlx5_1 on this node; have: mlx5_0 (port 1:InfiniBand)", (
        r.stderr
    )


def test_an_hca_with_the_wrong_link_layer_fails_and_roce_accepts_it(tmp_path):
    node = _node(tmp_path, hcas={"mlx5_0": {1: "InfiniBand"}, "mlx5_1": {1: "Ethernet"}})
    r = _preflight_node0(_launcher_lib(tmp_path), node)
    assert _failed(r).startswith(
        "nccl.ib_hca: mlx5_1 port 1 has link layer Ethernet, but nccl.ib_link_layer is "
        "InfiniBand: NCCL would send training traffic over it"
    ), r.stderr
    lib = _launcher_lib(tmp_path / "roce", "nccl.ib_hca=[mlx5_1]", "nccl.ib_link_layer=Ethernet")
    assert ", HCAs mlx5_1:1: Ethernet, " in _ok(_preflight_node0(lib, node))


def test_preflight_all_names_the_node_and_every_problem(tmp_path):
    lib = _launcher_lib(tmp_path, "hosts=[127.0.0.1]")
    node = _node(tmp_path, allowed="0-3", hcas={"mlx5_0": {1: "InfiniBand"}})
    # node 0 starts from LOCAL_ENV, not this shell's whole environment: the fake /sys goes there, as a login's
    code = 'LOCAL_ENV+=("SBATCH_GEN_SYSFS_ROOT=$SBATCH_GEN_SYSFS_ROOT"); mkdir -p -- "$LOGS"; ATTEMPT=1; preflight_all'
    r = _bash(lib, node, code)
    assert r.returncode != 0
    line = next(x for x in r.stderr.splitlines() if "preflight FAILED on node 0 (127.0.0.1): " in x)
    assert "topology.numa_binding=node: GPU 1 on NUMA node 1" in line, line
    assert "; nccl.ib_hca: no adapter mlx5_1 on this node" in line, line


def test_the_gpu_count_must_match_exactly(tmp_path):
    """One rule for both kinds (templates/_node.j2): exactly node.gpus GPUs visible. A host with more GPUs
    than the profile says fails too (the extra ones would idle, unnoticed)."""
    node = _node(tmp_path, gpu_numa=[0, 1, 1], numa_cpus={0: "0-3", 1: "4-7"})
    assert (
        _failed(_preflight_node0(_launcher_lib(tmp_path), node))
        == "3 GPUs visible, the profile expects 2 (node.gpus)"
    )
    node = _node(tmp_path / "one", gpu_numa=[0])
    assert _failed(_preflight_node0(_launcher_lib(tmp_path / "one"), node)).startswith(
        "1 GPUs visible, the profile expects 2 (node.gpus)"
    )


def test_cuda_visible_devices_from_extra_env_counts(tmp_path):
    """The preflight sees the environment torchrun gets: extra_env's CUDA_VISIBLE_DEVICES picks 2 of 3."""
    node = _node(tmp_path, gpu_numa=[0, 1, 1], numa_cpus={0: "0-3", 1: "4-7"})
    lib = _launcher_lib(tmp_path, "extra_env={CUDA_VISIBLE_DEVICES: '0,1'}")
    assert ", 2 GPUs, " in _ok(_preflight_node0(lib, node))
