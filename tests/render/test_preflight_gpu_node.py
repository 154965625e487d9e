"""The Slurm preflight's GPU-node checks (the node program, sbatch_gen/node_program.py, which
tests/node/test_node_program.py tests check by check), run for real under bash against a fake node
(sbatch_gen/testing/fakenode.py: a /sys and /proc tree under SBATCH_GEN_SYSFS_ROOT, stub nvidia-smi and
numactl on PATH):

- topology.numa_binding: torchrun --numa-binding fails without numactl, or when the job step may use no CPU
  of a GPU's NUMA node (exclusive: fewer physical cores than GPUs on the node; socket: a NUMA node without a
  usable CPU);
- nccl.ib_hca / nccl.ib_link_layer: every adapter exists and its ports have the expected link layer.

First the preflight function of the committed out/eu.sbatch on its own (fast, every case), then the whole
rendered batch script with a stub srun that runs the preflight step here: the profile's values reach the
check and a failure stops the job before training, without a requeue."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sbatch_gen.testing.fakenode import FakeNode, path_without
from sbatch_gen.testing.s3server import free_port

from .batch_sandbox import prepare
from .conftest import REPO, edit_site, sg
from .script_parts import flat, node_library

EU = (REPO / "out" / "eu.sbatch").read_text()

# An HGX-like node scaled down: 8 GPUs, 4 on each of two NUMA nodes; 8 CPUs per node.
NUMA_CPUS = {0: "0-7", 1: "8-15"}
GPU_NUMA = [0, 0, 0, 0, 1, 1, 1, 1]
IB8 = {f"mlx5_{i}": {1: "InfiniBand"} for i in range(8)}
EU_HCAS = "=" + ",".join(IB8)


def _node(tmp_path: Path, **kw) -> FakeNode:
    args = {"gpu_numa": GPU_NUMA, "numa_cpus": NUMA_CPUS, "allowed": "0-15", "hcas": IB8, **kw}
    return FakeNode(tmp_path / "node", **args)


def _functions_and_preflight(text: str) -> str:
    """The shared node checks and preflight(), as srun runs them on a node (export -f)."""
    return node_library(text)


def _preflight(
    tmp_path: Path,
    node: FakeNode,
    *,
    numa: str = "node",
    hcas: str = EU_HCAS,
    link_layer: str = "InfiniBand",
    gpus: int = 8,
    path: str | None = None,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM", "SBATCH_GEN")) and k != "CUDA_VISIBLE_DEVICES"
    }
    env.update(node.env(f"{Path(sys.executable).parent}:{path if path is not None else env['PATH']}"))
    env.update(SLURMD_NODENAME="gpu-n7", PYTHONPATH=str(REPO), **(env_extra or {}))
    args = [
        "module=sbatch_gen.train",
        f"config={REPO / 'configs' / 'tiny.yaml'}",
        "ifname=lo",
        f"gpus={gpus}",
        "gpus_key=slurm.gpus_per_node",
        f"run_dir={run_dir}",
        "rdzv_host=127.0.0.1",
        f"rdzv_port={free_port()}",
        "connect_timeout_s=5",
        f"numa={numa}",
        f"hcas={hcas}",
        f"link_layer={link_layer}",
    ]
    cmd = [
        "bash",
        "-c",
        _functions_and_preflight(EU) + '\npreflight node_id=0 nnodes=1 "$@"',
        "preflight",
        *args,
    ]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)


FAILED = "preflight FAILED on gpu-n7: "


def test_the_committed_eu_render_checks_numa_binding_and_its_hcas():
    lines = flat(EU).splitlines()
    # the NUMA binding checked is torchrun's own: preflight_nodes passes TORCHRUN_ARGS after the settings
    assert "  --numa-binding=node  # topology.numa_binding" in lines
    assert (
        '"${PREFLIGHT_ARGS[@]}" -- "${TORCHRUN_ARGS[@]}"' in (REPO / "out" / "sbatch-gen-job.sh").read_text()
    )
    assert (
        f"  hcas='{EU_HCAS}'  # nccl.ib_hca: the NCCL_IB_HCA checked unless one was given at submit time"
        in lines
    )
    assert "  link_layer=InfiniBand  # nccl.ib_link_layer" in lines


def test_a_healthy_node_passes_and_says_what_it_checked(tmp_path):
    r = _preflight(tmp_path, _node(tmp_path))
    assert r.returncode == 0, r.stderr
    ok = next(x for x in r.stdout.splitlines() if x.startswith("preflight ok on gpu-n7: "))
    assert ", interface lo 127.0.0.1, 8 GPUs, NUMA binding node: numactl " in ok, ok
    assert (
        "; GPU 0,1,2,3 on NUMA node 0 (8 usable CPUs), GPU 4,5,6,7 on NUMA node 1 (8 usable CPUs); job step "
        "CPUs 0-15, HCAs " + " ".join(f"mlx5_{i}:1" for i in range(8)) + ": InfiniBand, run dir "
    ) in ok, ok


# ---- topology.numa_binding ------------------------------------------------------------------------


def test_numactl_missing_fails_naming_the_field(tmp_path):
    node = _node(tmp_path, numactl=False)
    r = _preflight(tmp_path, node, path=path_without("numactl", tmp_path / "shadow"))
    assert r.returncode != 0
    assert (
        FAILED + "topology.numa_binding=node: numactl is not on PATH; torchrun starts every worker under "
        "numactl and fails without it"
    ) in r.stderr, r.stderr


def test_gpus_on_a_numa_node_without_an_allowed_cpu_fail(tmp_path):
    # The step's cpuset holds node 0's CPUs only (e.g. cpus_per_task filled from socket 0).
    r = _preflight(tmp_path, _node(tmp_path, allowed="0-7"))
    assert r.returncode != 0
    assert (
        FAILED + "topology.numa_binding=node: GPU 4,5,6,7 on NUMA node 1 (CPUs 8-15), but this job step "
        "may only run on CPUs 0-7: torchrun fails to start its workers"
    ) in r.stderr, r.stderr


def test_one_allowed_cpu_on_each_gpu_numa_node_is_enough(tmp_path):
    r = _preflight(tmp_path, _node(tmp_path, allowed="0,15"))
    assert r.returncode == 0, r.stderr


def test_only_the_visible_gpus_numa_nodes_count(tmp_path):
    node = _node(tmp_path, allowed="0-7")
    r = _preflight(tmp_path, node, gpus=4, env_extra={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert r.returncode == 0, r.stderr
    # GPU-UUID prefixes name GPUs too
    uuids = ",".join(u[:12] for u in node.gpu_uuids[4:])
    r = _preflight(tmp_path, node, gpus=4, env_extra={"CUDA_VISIBLE_DEVICES": uuids})
    assert r.returncode != 0 and "GPU 4,5,6,7 on NUMA node 1 (CPUs 8-15)" in r.stderr, r.stderr


def test_no_numa_information_counts_as_node_0_as_in_torch(tmp_path):
    node = FakeNode(tmp_path / "node", gpu_numa=[-1, -1], numa_cpus={0: "0-3"}, allowed="0-3", hcas=IB8)
    assert _preflight(tmp_path, node, gpus=2).returncode == 0
    node = FakeNode(
        tmp_path / "node2", gpu_numa=[-1, -1], numa_cpus={0: "0-3", 1: "4-7"}, allowed="4-7", hcas=IB8
    )
    r = _preflight(tmp_path, node, gpus=2)
    assert r.returncode != 0 and "GPU 0,1 on NUMA node 0 (CPUs 0-3)" in r.stderr, r.stderr


def test_exclusive_needs_a_physical_core_per_gpu(tmp_path):
    # Node 1: CPUs 8-11 are 2 cores with 2 threads each (8+9, 10+11) for 4 GPUs.
    node = _node(tmp_path, numa_cpus={0: "0-7", 1: "8-11"}, allowed="0-11", threads_per_core=2)
    assert _preflight(tmp_path, node, numa="node").returncode == 0
    r = _preflight(tmp_path, node, numa="exclusive")
    assert r.returncode != 0
    assert (
        "topology.numa_binding=exclusive: NUMA node 1 has 2 physical cores this job step may use for its 4 GPUs "
        "(4,5,6,7); torch's exclusive mode needs one per GPU"
    ) in r.stderr, r.stderr


def test_socket_needs_a_usable_cpu_on_every_numa_node(tmp_path):
    # A GH200-like node: the GPU's memory is NUMA node 1, which has no CPU.
    node = FakeNode(tmp_path / "node", gpu_numa=[0], numa_cpus={0: "0-71", 1: ""}, allowed="0-71", hcas=IB8)
    assert _preflight(tmp_path, node, numa="node", gpus=1).returncode == 0
    r = _preflight(tmp_path, node, numa="socket", gpus=1)
    assert r.returncode != 0
    assert (
        "topology.numa_binding=socket: NUMA node 1 has no CPU this job step may run on (CPUs: none); torch's "
        "socket mode looks at every NUMA node and fails on it (use node)"
    ) in r.stderr, r.stderr


def test_numa_checks_are_off_without_numa_binding(tmp_path):
    node = _node(tmp_path, allowed="0-7", numactl=False)
    r = _preflight(tmp_path, node, numa="", path=path_without("numactl", tmp_path / "shadow"))
    assert r.returncode == 0, r.stderr
    assert "NUMA binding" not in r.stdout


def test_without_a_fake_root_the_checks_read_this_machines_sys_and_proc(tmp_path):
    """SBATCH_GEN_SYSFS_ROOT unset, as on a real node: a PCI device of this machine stands in for the GPU
    (nvidia-smi is the only stub), and the result is what torch's own reading of /sys gives."""
    devices = sorted(Path("/sys/bus/pci/devices").glob("*/numa_node"))
    if not devices:
        pytest.skip("no PCI devices in /sys on this machine")
    addr = devices[0].parent.name
    numa = max(int(devices[0].read_text()), 0)
    node_cpus = Path(f"/sys/devices/system/node/node{numa}/cpulist")
    node = _node(tmp_path, gpu_numa=[0])
    (node.bin / "gpus.csv").write_text(f"0, {node.gpu_uuids[0]}, 0000{addr.upper()}\n")
    (node.bin / "gpus.L").write_text(f"GPU 0: NVIDIA H200 (UUID: {node.gpu_uuids[0]})\n")
    r = _preflight(tmp_path, node, gpus=1, hcas="", env_extra={"SBATCH_GEN_SYSFS_ROOT": ""})
    usable = node_cpus.exists() and set(_cpulist(node_cpus.read_text())) & os.sched_getaffinity(0)
    if usable:
        assert r.returncode == 0, r.stderr
        assert ", NUMA binding node: numactl " in r.stdout, r.stdout
    else:
        assert r.returncode != 0 and f"on NUMA node {numa}" in r.stderr, r.stderr
    # No RDMA adapter here (or not this one): the HCA check says what the node has.
    r = _preflight(tmp_path, node, gpus=1, hcas="=no_such_hca0", env_extra={"SBATCH_GEN_SYSFS_ROOT": ""})
    assert (
        r.returncode != 0 and FAILED + "nccl.ib_hca: no adapter no_such_hca0 on this node; have: " in r.stderr
    )


def _cpulist(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.strip().split(",")):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


# ---- nccl.ib_hca / nccl.ib_link_layer ---------------------------------------------------------------


def test_a_missing_hca_fails_and_lists_what_the_node_has(tmp_path):
    node = _node(tmp_path, hcas={"mlx5_0": {1: "InfiniBand"}, "mlx5_8": {1: "Ethernet"}})
    r = _preflight(tmp_path, node, hcas="=mlx5_0,mlx5_1")
    assert r.returncode != 0
    assert (
        FAILED + "nccl.ib_hca: no adapter mlx5_1 on this node; have: mlx5_0 (port 1:InfiniBand), "
        "mlx5_8 (port 1:Ethernet)\n"
    ) in r.stderr, r.stderr


def test_an_hca_with_the_wrong_link_layer_fails(tmp_path):
    node = _node(tmp_path, hcas={**IB8, "mlx5_8": {1: "Ethernet"}})
    r = _preflight(tmp_path, node, hcas=EU_HCAS + ",mlx5_8")
    assert r.returncode != 0
    assert (
        FAILED + "nccl.ib_hca: mlx5_8 port 1 has link layer Ethernet, but nccl.ib_link_layer is InfiniBand: "
        "NCCL would send training traffic over it"
    ) in r.stderr, r.stderr
    # RoCE: the same adapter is right when the profile expects Ethernet, and the InfiniBand ones are wrong
    r = _preflight(tmp_path, node, hcas="=mlx5_8", link_layer="Ethernet")
    assert r.returncode == 0, r.stderr
    assert "HCAs mlx5_8:1: Ethernet" in r.stdout


def test_a_port_that_is_not_active_fails(tmp_path):
    """NCCL leaves out a port that is not ACTIVE: the node would train a link short of the others."""
    node = _node(tmp_path, port_state={"mlx5_3:1": "1: DOWN", "mlx5_5:1": "2: INIT"})
    (node.root / "sys/class/infiniband/mlx5_6/ports/1/state").unlink()
    r = _preflight(tmp_path, node)
    assert r.returncode != 0
    assert (
        FAILED + "nccl.ib_hca: mlx5_3 port 1 is not active (state: 1: DOWN): NCCL leaves out a port that is "
        "not ACTIVE, so this node would train on fewer links than the others (bring the link up or drain the "
        "node); nccl.ib_hca: mlx5_5 port 1 is not active (state: 2: INIT)"
    ) in r.stderr, r.stderr
    assert "nccl.ib_hca: mlx5_6 port 1 is not active (state: unreadable)" in r.stderr, r.stderr
    # the adapters not in nccl.ib_hca are not checked
    hcas = "=" + ",".join(h for h in IB8 if h not in ("mlx5_3", "mlx5_5", "mlx5_6"))
    assert _preflight(tmp_path, node, hcas=hcas).returncode == 0


def test_the_hcas_checked_are_those_the_training_step_gets(tmp_path):
    """The profile's NCCL_IB_HCA is a default: a value given at submit time (NCCL_IB_HCA=... sbatch, here in the
    preflight's environment as srun passes it on) is what NCCL reads, so it is what the preflight checks, and
    its messages say so. A user leaving a port that is down out of the list is not failed by the profile's
    list; NCCL_IB_DISABLE=1, an empty value and a '^' list check nothing."""
    node = _node(tmp_path, port_state={"mlx5_3:1": "1: DOWN"})
    assert _preflight(tmp_path, node).returncode != 0  # the profile's list: mlx5_3 is down
    without = "=" + ",".join(h for h in IB8 if h != "mlx5_3")
    r = _preflight(tmp_path, node, env_extra={"NCCL_IB_HCA": without})
    assert r.returncode == 0, r.stderr
    assert f"(NCCL_IB_HCA={without} from the environment, not nccl.ib_hca's {EU_HCAS})" in r.stdout, r.stdout
    r = _preflight(tmp_path, node, env_extra={"NCCL_IB_HCA": "=mlx5_3"})
    assert r.returncode != 0
    assert (
        FAILED
        + f"NCCL_IB_HCA==mlx5_3 from the environment, not nccl.ib_hca's {EU_HCAS}: mlx5_3 port 1 is not "
        "active (state: 1: DOWN)"
    ) in r.stderr, r.stderr
    for env, said in (
        ({"NCCL_IB_DISABLE": "1"}, "NCCL_IB_DISABLE=1 in the environment: HCAs not checked"),
        (
            {"NCCL_IB_HCA": ""},
            "NCCL_IB_HCA empty in the environment (NCCL picks the adapters): HCAs not checked",
        ),
        (
            {"NCCL_IB_HCA": "^mlx5_3"},
            "NCCL_IB_HCA=^mlx5_3 in the environment (adapters left out): HCAs not checked",
        ),
    ):
        r = _preflight(tmp_path, node, env_extra=env)
        assert r.returncode == 0 and said in r.stdout, (env, r.stdout, r.stderr)
    # the profile's own value, set in the environment as the render exports it: named as nccl.ib_hca's
    r = _preflight(tmp_path, node, env_extra={"NCCL_IB_HCA": EU_HCAS})
    assert r.returncode != 0 and FAILED + "nccl.ib_hca: mlx5_3 port 1 is not active" in r.stderr, r.stderr


def test_a_named_port_is_the_only_one_checked(tmp_path):
    node = _node(tmp_path, hcas={"mlx5_0": {1: "InfiniBand", 2: "Ethernet"}})
    r = _preflight(tmp_path, node, hcas="=mlx5_0")
    assert r.returncode != 0 and "mlx5_0 port 2 has link layer Ethernet" in r.stderr, r.stderr
    assert _preflight(tmp_path, node, hcas="=mlx5_0:1").returncode == 0
    r = _preflight(tmp_path, node, hcas="=mlx5_0:3")
    assert r.returncode != 0 and FAILED + "nccl.ib_hca: adapter mlx5_0 has no port 3" in r.stderr, r.stderr


def test_prefixes_need_a_match_and_every_match_must_be_right(tmp_path):
    """nccl.ib_hca_exact false: NCCL uses every adapter whose name starts with a listed name."""
    node = _node(tmp_path, hcas={**IB8, "mlx5_bond_0": {1: "Ethernet"}})
    r = _preflight(tmp_path, node, hcas="mlx4")
    assert r.returncode != 0
    assert (
        FAILED + "nccl.ib_hca: no adapter starting with mlx4 (nccl.ib_hca_exact is false) on this node"
        in r.stderr
    )
    r = _preflight(tmp_path, node, hcas="mlx5")
    assert r.returncode != 0 and "mlx5_bond_0 port 1 has link layer Ethernet" in r.stderr, r.stderr
    r = _preflight(tmp_path, node, hcas="mlx5_0,mlx5_1")
    assert r.returncode == 0, r.stderr


def test_several_problems_are_one_line(tmp_path):
    node = _node(tmp_path, hcas={"mlx5_0": {1: "Ethernet"}})
    r = _preflight(tmp_path, node, hcas="=mlx5_0,mlx5_1")
    failed = [x for x in r.stderr.splitlines() if x.startswith(FAILED)]
    assert len(failed) == 1 and "mlx5_0 port 1 has link layer Ethernet" in failed[0], r.stderr
    assert "; nccl.ib_hca: no adapter mlx5_1 on this node" in failed[0], r.stderr


# ---- the whole batch script: the profile's values reach the preflight -------------------------------

SRUN = r"""#!/bin/bash
# stub srun: runs the preflight step here, as node gpu-n7; notes the training step and succeeds
for a in "$@"; do
  if [[ $a == preflight ]]; then
    while [[ $1 == --* ]]; do shift; done
    SLURMD_NODENAME=gpu-n7 SLURM_NODEID=0 exec "$@"
  fi
done
echo "training" >>"$STUB_DIR/calls"
"""
# stub scontrol: the first node is localhost, which the preflight's rendezvous check can resolve and reach
SCONTROL = "#!/bin/bash\nif [[ \"$1 $2\" == 'show hostnames' ]]; then echo localhost; fi\n"
SINFO = "#!/bin/bash\necho 'slurm 23.11.4'\n"


def _eu_job(
    tmp_path: Path, node: FakeNode, *sets: str, path: str | None = None, node_program: str | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    """The eu job on the fake node; ``node_program``: the text of the submit directory's
    out/sbatch-gen-node.py instead of the committed one."""
    out = tmp_path / "render"
    overrides = [
        "slurm.nodes=1",
        "cross_region.enabled=false",
        "paths.data=null",
        f"paths.code_dir={REPO}",
        f"paths.run_dir={tmp_path / 'run'}",
        f"paths.log_dir={tmp_path / 'logs'}",
        "python_env.path=.venv",
        f"trainer.config={REPO / 'configs' / 'tiny.yaml'}",
        "network.socket_ifname=lo",
        f"torchrun.rdzv_port={free_port()}",
        "preflight.connect_timeout_s=5",
        *sets,
    ]
    r = sg("render", "--site", "eu", "--out", str(out), *[a for o in overrides for a in ("--set", o)])
    assert r.code == 0, r.err
    job, env, stub_dir = prepare(
        tmp_path,
        {"srun": SRUN, "scontrol": SCONTROL, "sinfo": SINFO},
        "gpu",
        script=(out / "eu.sbatch").read_text(),
        env={"SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu-n7"},
    )
    if node_program is not None:  # and a checkout whose history never held the pinned one
        (job.parent / "out" / "sbatch-gen-node.py").write_text(node_program)
        shutil.rmtree(job.parent / ".git")
    # Slurm stubs, then the fake node's nvidia-smi (and numactl), then python: what a GPU node's PATH has.
    rest = f"{Path(sys.executable).parent}:{path if path is not None else os.environ['PATH']}"
    env.update(node.env(rest))
    env["PATH"] = f"{job.parent / '.venv' / 'bin'}:{env['PATH']}"
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=120
    )
    return r, stub_dir


def test_eu_job_trains_on_a_healthy_node(tmp_path):
    r, stub_dir = _eu_job(tmp_path, _node(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    # the preflight ran the node program the render pins, from its copy in the run dir
    (staged,) = (tmp_path / "run" / "node").glob("sbatch-gen-node.*.py")
    assert staged.read_bytes() == (REPO / "out" / "sbatch-gen-node.py").read_bytes()
    (staged,) = (tmp_path / "run" / "node").glob("sbatch-gen-job.*.sh")  # and the job library it sourced
    assert staged.read_bytes() == (REPO / "out" / "sbatch-gen-job.sh").read_bytes()
    assert ", NUMA binding node: numactl " in r.stdout and ", HCAs mlx5_0:1 " in r.stdout, r.stdout
    # paths.pin_code: the node's python_env is the one the batch shell pinned for the run
    assert ", python_env as the run started (paths.pin_code)" in r.stdout, r.stdout
    assert (stub_dir / "calls").read_text() == "training\n"


@pytest.mark.parametrize(
    "sets, node_kw, reason",
    [
        ((), {"allowed": "0-7"}, "topology.numa_binding=node: GPU 4,5,6,7 on NUMA node 1"),
        (
            ("topology.numa_binding=exclusive",),
            {"numa_cpus": {0: "0-7", 1: "8-9"}},
            "topology.numa_binding=exclusive: NUMA node 1 has 2 physical cores",
        ),
        (
            (),
            {"hcas": {**IB8, "mlx5_7": {1: "Ethernet"}}},
            "nccl.ib_hca: mlx5_7 port 1 has link layer Ethernet",
        ),
        (
            ("nccl.ib_link_layer=Ethernet",),
            {},
            "nccl.ib_hca: mlx5_0 port 1 has link layer InfiniBand, but nccl.ib_link_layer is Ethernet",
        ),
    ],
    ids=["numa-cpus", "exclusive", "hca-link-layer", "roce-expected"],
)
def test_eu_job_stops_before_training_naming_node_and_field(tmp_path, sets, node_kw, reason):
    r, stub_dir = _eu_job(tmp_path, _node(tmp_path, **node_kw), *sets)
    assert r.returncode == 1, r.stdout + r.stderr
    assert FAILED + reason in r.stderr, r.stderr
    assert (
        "preflight failed (see the preflight FAILED lines above); not starting training and not requeueing"
        in r.stderr
    )
    assert not (stub_dir / "calls").exists()


def test_eu_job_without_the_pinned_node_program_stops_before_any_step(tmp_path):
    r, stub_dir = _eu_job(tmp_path, _node(tmp_path), node_program="print('another node program')\n")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ERROR: the sbatch-gen-node.py this job pins (sha256 " in r.stderr, r.stderr
    assert "out/sbatch-gen-node.py has sha256 " in r.stderr and "preflight" not in r.stdout
    assert not (stub_dir / "calls").exists()


def test_eu_job_without_numactl_stops_before_training(tmp_path):
    node = _node(tmp_path, numactl=False)
    r, stub_dir = _eu_job(tmp_path, node, path=path_without("numactl", tmp_path / "shadow"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert FAILED + "topology.numa_binding=node: numactl is not on PATH" in r.stderr, r.stderr
    assert not (stub_dir / "calls").exists()


# ---- the profile fields -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "site, changes, field, message",
    [
        (
            "local",
            {"topology.numa_binding": "node"},
            "topology.numa_binding",
            "this site has no GPUs, and torchrun binds each worker to its GPU's NUMA node",
        ),
        ("ssh-local", {"topology.numa_binding": "socket"}, "topology.numa_binding", "this site has no GPUs"),
        (
            "us",
            {"nccl.ib_link_layer": "Ethernet"},
            "nccl.ib_link_layer",
            "ib_link_layer is set but ib_disable is true, so no adapter is checked",
        ),
        (
            "eu",
            {"nccl.ib_hca": [], "nccl.ib_link_layer": "InfiniBand"},
            "nccl.ib_link_layer",
            "ib_link_layer is set but ib_hca is empty",
        ),
        (
            "eu",
            {"nccl.ib_link_layer": "RoCE"},
            "nccl.ib_link_layer",
            "Input should be 'InfiniBand' or 'Ethernet'",
        ),
    ],
    ids=["numa-cpu-slurm", "numa-cpu-ssh", "link-layer-ib-disabled", "link-layer-no-hca", "link-layer-value"],
)
def test_profile_fields_are_refused_where_they_cannot_work(work, site, changes, field, message):
    edit_site(work / "sites" / f"{site}.yaml", **changes)
    r = sg("render", "--site", site, "--out", "o")
    assert r.code == 2, (r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and re.match(
        rf"sbatch-gen: sites/{site}\.yaml:\d+: {re.escape(field)}: ", lines[0]
    ), r.err
    assert message in lines[0], lines[0]


def test_ib_disable_turns_the_hca_check_off(work):
    edit_site(work / "sites" / "eu.yaml", **{"nccl.ib_disable": True})
    r = sg("render", "--site", "eu", "--out", "o")
    assert r.code == 0, r.err
    # no HCA to check: neither the HCAs nor their link layer is in the preflight's settings (a CPU site's too)
    lines = flat((work / "o" / "eu.sbatch").read_text()).splitlines()
    assert not [line for line in lines if line.lstrip().startswith(("hcas=", "link_layer="))], lines
