"""sbatch_gen/node_program.py, the node program, check by check: no Slurm, no ssh, no bash around it.

Each check runs in this process against a fake node (sbatch_gen/testing/fakenode.py: a /sys and /proc tree
under SBATCH_GEN_SYSFS_ROOT, stub nvidia-smi and numactl on PATH) or tmp files; the whole program runs as a
subprocess the way the nodes run it (`python -I sbatch-gen-node.py preflight ...`), from a copy outside the
package, to show it needs nothing but the standard library. tests/render (test_shell, test_preflight_*) and
tests/ssh run it through the rendered scripts."""

from __future__ import annotations

import ast
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sbatch_gen import node_program as np
from sbatch_gen.testing.fakenode import FakeNode, path_without
from sbatch_gen.testing.s3server import free_port

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "sbatch_gen" / "node_program.py"
NUMA_CPUS = {0: "0-7", 1: "8-15"}
GPU_NUMA = [0, 0, 0, 0, 1, 1, 1, 1]
IB2 = {"mlx5_0": {1: "InfiniBand"}, "mlx5_1": {1: "InfiniBand"}}


def _bin(tmp_path: Path, name: str, text: str) -> Path:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    (d / name).write_text(text)
    (d / name).chmod(0o755)
    return d


def env_bin(tmp_path: Path) -> Path:
    """A directory with `python` (this interpreter) and a stub `torchrun`, as an activated environment has."""
    _bin(tmp_path, "python", f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    return _bin(tmp_path, "torchrun", "#!/bin/sh\nexit 0\n")


def checks(ok: list[str]) -> list[str]:
    """What passed after the environment's python and torchrun (env_bin), which every preflight names first."""
    assert ok[0].endswith(f" python {platform.python_version()} {ok[0].split()[-1]}"), ok
    assert ok[1].startswith("torchrun "), ok
    return ok[2:]


@pytest.fixture
def node_env(monkeypatch, tmp_path):
    """A clean environment for one check: no Slurm or sbatch-gen variables, no CUDA_VISIBLE_DEVICES, the
    current directory tmp_path, and on PATH only env_bin's python; returns a function that puts a fake node
    in it (its sysfs root, its stubs first on PATH)."""
    for k in list(os.environ):
        if k.startswith(("SLURM", "SBATCH_GEN")) or k == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(k)
    monkeypatch.setenv("PATH", f"{env_bin(tmp_path)}:{path_without('python', tmp_path / 'shadow')}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))

    def use(node: FakeNode, path: str | None = None) -> FakeNode:
        for k, v in node.env(path).items():
            monkeypatch.setenv(k, v)
        return node

    return use


def _node(tmp_path: Path, **kw) -> FakeNode:
    args = {"gpu_numa": GPU_NUMA, "numa_cpus": NUMA_CPUS, "allowed": "0-15", "hcas": IB2, **kw}
    return FakeNode(tmp_path / "node", **args)


# ---- the program itself ---------------------------------------------------------------------------


def test_it_imports_the_standard_library_only():
    """...but in torchrun's wrapper (torchrun_main, _patch_exit_barrier), which runs torchrun in this process:
    the node's torch is there whenever its torchrun is."""
    tree = ast.parse(PROGRAM.read_text())
    names = set()
    shims = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef)
        and n.name in ("torchrun_main", "_patch_exit_barrier", "_patch_teardown")
    ]
    assert len(shims) == 3
    in_shim = {id(n) for shim in shims for n in ast.walk(shim)}
    for n in ast.walk(tree):
        if id(n) in in_shim:
            continue
        if isinstance(n, ast.Import):
            names |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            assert n.level == 0, "a relative import"
            names.add((n.module or "").split(".")[0])
    assert names - {"__future__"} <= sys.stdlib_module_names, names - sys.stdlib_module_names


def test_its_syntax_is_python_3_8s():
    """Old container images: the program must parse on Python 3.8 (it was also run there by hand)."""
    ast.parse(PROGRAM.read_text(), feature_version=(3, 8))


def _run_copy(tmp_path: Path, *args: str, env: dict | None = None, cwd: Path | None = None):
    """The program copied out of the package and run as the nodes run it: python -I (no PYTHONPATH, no
    current directory on sys.path) and -S (no site-packages: the standard library only)."""
    copy = tmp_path / "copy" / "sbatch-gen-node.py"
    copy.parent.mkdir(exist_ok=True)
    shutil.copy(PROGRAM, copy)
    env = env if env is not None else {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    return subprocess.run(
        [sys.executable, "-I", "-S", str(copy), *args],
        env=env,
        cwd=cwd or tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_it_runs_from_a_copy_with_the_standard_library_only(tmp_path):
    env = {"PATH": f"{env_bin(tmp_path)}:{os.environ['PATH']}", "SLURMD_NODENAME": "n9"}
    r = _run_copy(tmp_path, "preflight", f"config={PROGRAM}", f"run_dir={tmp_path / 'run'}", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("preflight ok on n9: ") and r.stdout.count("\n") == 1, r.stdout
    assert f", train config {PROGRAM}, run dir {tmp_path / 'run'} writable\n" in r.stdout, r.stdout


def test_a_failure_is_one_line_on_stderr_with_status_1(tmp_path):
    env = {"PATH": f"{env_bin(tmp_path)}:{os.environ['PATH']}", "SLURMD_NODENAME": "n9"}
    r = _run_copy(tmp_path, "preflight", "config=no-such.yaml", "data=/no/such/data", env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (
        f"preflight FAILED on n9: train config no-such.yaml not readable from {tmp_path} (trainer.config); "
        "data path /no/such/data does not exist (paths.data)\n"
    )


def test_an_unknown_setting_or_command_is_refused(tmp_path):
    r = _run_copy(tmp_path, "preflight", "gpu=8")
    assert r.returncode == 2 and r.stderr == "preflight: unknown setting 'gpu=8'\n"
    r = _run_copy(tmp_path, "preflight", "justaword")
    assert r.returncode == 2 and "unknown setting 'justaword'" in r.stderr
    r = _run_copy(tmp_path, "run-everything")
    assert r.returncode == 2 and r.stderr.startswith(
        "usage: sbatch-gen-node.py {preflight,fingerprint,run-trainer,torchrun,omp-threads} "
    )


def test_the_node_is_slurms_name_else_the_host_name(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-n7")
    assert np.node_name() == "gpu-n7"
    monkeypatch.delenv("SLURMD_NODENAME")
    assert np.node_name() == socket.gethostname()


# ---- small readers --------------------------------------------------------------------------------


def test_cpulist_and_read_line(tmp_path):
    assert np.cpulist_cpus("0-3,8, 10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert np.cpulist_cpus("") == [] and np.cpulist_cpus("x,2") == [2]
    f = tmp_path / "f"
    assert np.read_line(str(f)) is None
    f.write_text("")
    assert np.read_line(str(f)) is None  # empty: nothing to read, as bash's read saw it
    f.write_text("4: ACTIVE\nmore\n")
    assert np.read_line(str(f)) == "4: ACTIVE"
    f.write_text("no newline")
    assert np.read_line(str(f)) == "no newline"


# ---- topology.numa_binding ------------------------------------------------------------------------

FIELD = "topology.numa_binding="


def test_numa_a_healthy_node_says_what_it_found(tmp_path, node_env):
    node_env(_node(tmp_path))
    passed, lines = np.check_numa_binding("node")
    assert passed, lines
    assert lines == [
        f"numactl {tmp_path / 'node' / 'stub-bin' / 'numactl'}; GPU 0,1,2,3 on NUMA node 0 (8 usable CPUs), "
        "GPU 4,5,6,7 on NUMA node 1 (8 usable CPUs); job step CPUs 0-15"
    ]


def test_numa_without_numactl_fails_and_still_checks_the_rest(tmp_path, node_env):
    node_env(_node(tmp_path, numactl=False, allowed="0-7"), path_without("numactl", tmp_path / "shadow"))
    passed, lines = np.check_numa_binding("node")
    assert not passed
    assert lines[0] == (
        f"{FIELD}node: numactl is not on PATH; torchrun starts every worker under numactl and fails without it "
        "(install numactl on the node or in the image, or unset topology.numa_binding)"
    )
    assert lines[1] == (
        f"{FIELD}node: GPU 4,5,6,7 on NUMA node 1 (CPUs 8-15), but this job step may only run on CPUs 0-7: "
        "torchrun fails to start its workers (give the step CPUs on every GPU's NUMA node, e.g. more "
        "slurm.cpus_per_task, or unset topology.numa_binding)"
    )


def test_numa_only_the_visible_gpus_count(tmp_path, node_env, monkeypatch, capsys):
    node = node_env(_node(tmp_path, allowed="0-7"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0, 1,2,3")
    assert np.check_numa_binding("node")[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(u[:12] for u in node.gpu_uuids[4:]))
    passed, lines = np.check_numa_binding("node")
    assert not passed and "GPU 4,5,6,7 on NUMA node 1 (CPUs 8-15)" in lines[0], lines
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,17,MIG-x")
    assert np.check_numa_binding("node")[0]
    err = capsys.readouterr().err
    assert "note: CUDA_VISIBLE_DEVICES entry 17 is no GPU that nvidia-smi lists" in err, err
    assert "note: CUDA_VISIBLE_DEVICES entry MIG-x is no GPU" in err, err


def test_numa_no_information_counts_as_node_0(tmp_path, node_env):
    node_env(FakeNode(tmp_path / "a", gpu_numa=[-1, -1], numa_cpus={0: "0-3", 1: "4-7"}, allowed="4-7"))
    passed, lines = np.check_numa_binding("node")
    assert not passed and "GPU 0,1 on NUMA node 0 (CPUs 0-3)" in lines[0], lines


def test_numa_exclusive_needs_a_physical_core_per_gpu(tmp_path, node_env):
    node_env(_node(tmp_path, numa_cpus={0: "0-7", 1: "8-11"}, allowed="0-11", threads_per_core=2))
    assert np.check_numa_binding("node")[0]
    passed, lines = np.check_numa_binding("exclusive")
    assert lines == [
        f"{FIELD}exclusive: NUMA node 1 has 2 physical cores this job step may use for its 4 GPUs (4,5,6,7); "
        "torch's exclusive mode needs one per GPU (use node, or give the step more CPUs)"
    ]


def test_numa_exclusive_names_an_unreadable_core(tmp_path, node_env):
    node = node_env(_node(tmp_path))
    siblings = node.root / "sys/devices/system/cpu/cpu9/topology/thread_siblings_list"
    siblings.unlink()
    passed, lines = np.check_numa_binding("exclusive")
    assert not passed
    assert lines == [
        f"{FIELD}exclusive: cannot read the physical core of CPU 9 from {siblings} (torch's exclusive mode "
        "reads it)"
    ]


def test_numa_socket_needs_a_usable_cpu_on_every_numa_node(tmp_path, node_env):
    node_env(FakeNode(tmp_path / "gh", gpu_numa=[0], numa_cpus={0: "0-71", 1: ""}, allowed="0-71"))
    assert np.check_numa_binding("node")[0]
    passed, lines = np.check_numa_binding("socket")
    assert lines == [
        f"{FIELD}socket: NUMA node 1 has no CPU this job step may run on (CPUs: none); torch's socket mode "
        "looks at every NUMA node and fails on it (use node)"
    ]


def test_numa_unreadable_inputs_are_named(tmp_path, node_env):
    node = node_env(_node(tmp_path))
    numa_file = node.root / "sys/bus/pci/devices/0000:18:00.0/numa_node"
    numa_file.write_text("unknown\n")
    (node.root / "sys/devices/system/node/node1/cpulist").unlink()
    passed, lines = np.check_numa_binding("node")
    assert lines == [
        f"{FIELD}node: GPU 0 (0000:18:00.0): cannot read its NUMA node from {numa_file}, where torch reads it",
        f"{FIELD}node: GPU 4,5,6,7 on NUMA node 1, but {node.root}/sys/devices/system/node/node1/cpulist cannot "
        "be read (torch reads the node's CPUs there)",
    ]
    (node.bin / "gpus.csv").write_text("0, GPU-1, bogus\n")
    assert np.check_numa_binding("node")[1] == [
        f"{FIELD}node: GPU 0: cannot read its PCI address from nvidia-smi's pci.bus_id 'bogus'"
    ]
    (node.root / "proc/self/status").write_text("Name:\tx\n")
    assert np.check_numa_binding("node")[1] == [
        f"{FIELD}node: cannot read Cpus_allowed_list from {node.root}/proc/self/status"
    ]


def test_numa_a_failing_nvidia_smi_is_named(tmp_path, node_env):
    node = node_env(_node(tmp_path))
    (node.bin / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed'\nexit 9\n")
    assert np.check_numa_binding("node") == (
        False,
        [f"{FIELD}node: nvidia-smi --query-gpu=index,uuid,pci.bus_id failed: NVIDIA-SMI has failed"],
    )


# ---- nccl.ib_hca / nccl.ib_link_layer -------------------------------------------------------------


def test_hcas_pass_with_the_ports_checked(tmp_path, node_env):
    node_env(_node(tmp_path))
    assert np.check_ib_hcas("=mlx5_0,mlx5_1", "InfiniBand") == (True, ["mlx5_0:1 mlx5_1:1: InfiniBand"])
    assert np.check_ib_hcas("mlx5", "InfiniBand") == (True, ["mlx5_0:1 mlx5_1:1: InfiniBand"])


def test_hcas_a_missing_adapter_lists_what_the_node_has(tmp_path, node_env):
    node_env(_node(tmp_path, hcas={"mlx5_0": {1: "InfiniBand"}, "mlx5_8": {1: "Ethernet", 2: "Ethernet"}}))
    assert np.check_ib_hcas("=mlx5_0,mlx5_1", "InfiniBand")[1] == [
        "nccl.ib_hca: no adapter mlx5_1 on this node; have: mlx5_0 (port 1:InfiniBand), "
        "mlx5_8 (port 1:Ethernet 2:Ethernet)"
    ]
    assert np.check_ib_hcas("mlx4", "InfiniBand")[1][0].startswith(
        "nccl.ib_hca: no adapter starting with mlx4 (nccl.ib_hca_exact is false) on this node; have: "
    )


def test_hcas_without_any_adapter(tmp_path, node_env):
    node_env(_node(tmp_path, hcas={}))
    assert np.check_ib_hcas("=mlx5_0", "InfiniBand")[1] == [
        "nccl.ib_hca: no adapter mlx5_0 on this node; have: none (no RDMA driver loaded?)"
    ]


def test_hcas_the_wrong_link_layer_and_a_named_port(tmp_path, node_env):
    node_env(_node(tmp_path, hcas={"mlx5_0": {1: "InfiniBand", 2: "Ethernet"}}))
    assert np.check_ib_hcas("=mlx5_0", "InfiniBand")[1] == [
        "nccl.ib_hca: mlx5_0 port 2 has link layer Ethernet, but nccl.ib_link_layer is InfiniBand: NCCL would "
        "send training traffic over it (take it out of nccl.ib_hca, name the right port as mlx5_0:N, or set "
        "nccl.ib_link_layer)"
    ]
    assert np.check_ib_hcas("=mlx5_0:1", "InfiniBand")[0]
    assert np.check_ib_hcas("=mlx5_0:2", "Ethernet") == (True, ["mlx5_0:2: Ethernet"])
    root = tmp_path / "node" / "sys/class/infiniband"
    assert np.check_ib_hcas("=mlx5_0:3", "InfiniBand")[1] == [
        f"nccl.ib_hca: adapter mlx5_0 has no port 3 ({root}/mlx5_0/ports/3/link_layer cannot be read)"
    ]


def test_hcas_a_port_that_is_not_active(tmp_path, node_env):
    node = node_env(_node(tmp_path, port_state={"mlx5_1:1": "1: DOWN"}))
    (node.root / "sys/class/infiniband/mlx5_0/ports/1/state").unlink()
    passed, lines = np.check_ib_hcas("=mlx5_0,mlx5_1", "InfiniBand")
    assert not passed
    assert lines[0].startswith(
        "nccl.ib_hca: mlx5_0 port 1 is not active (state: unreadable): NCCL leaves out"
    )
    assert lines[1] == (
        "nccl.ib_hca: mlx5_1 port 1 is not active (state: 1: DOWN): NCCL leaves out a port that is not ACTIVE, "
        "so this node would train on fewer links than the others (bring the link up or drain the node)"
    )


def test_hcas_an_adapter_without_ports(tmp_path, node_env):
    node = node_env(_node(tmp_path, hcas={}))
    (node.root / "sys/class/infiniband/mlx5_0").mkdir()
    assert np.check_ib_hcas("=mlx5_0", "InfiniBand")[1] == [
        f"nccl.ib_hca: adapter mlx5_0 has no ports in {node.root}/sys/class/infiniband/mlx5_0/ports"
    ]


# ---- the rendezvous -------------------------------------------------------------------------------


def test_rendezvous_node0_alone_tries_its_port():
    port = free_port()
    assert np.check_rendezvous("", port, 0, 1, 5) == (True, f"rendezvous port {port} free")


def test_rendezvous_a_busy_port_fails_on_node0():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        passed, said = np.check_rendezvous("127.0.0.1", port, 0, 2, 5)
    assert not passed
    assert said == (
        f"cannot listen on rendezvous port {port}: Address already in use (torchrun.rdzv_port; another launch?)"
    )


def test_rendezvous_the_other_nodes_reach_node0():
    port = free_port()
    results = {}

    def node(i):
        results[i] = np.check_rendezvous("127.0.0.1", port, i, 3, 10)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == (True, f"rendezvous port {port} free, 2 other nodes reached 127.0.0.1")
    assert results[1] == results[2] == (True, f"rendezvous 127.0.0.1:{port} reached")


def test_rendezvous_timeouts_and_names():
    port = free_port()
    passed, said = np.check_rendezvous("127.0.0.1", port, 1, 2, 0.2)
    assert not passed and said.startswith(
        f"rendezvous endpoint 127.0.0.1:{port} not reachable within 0.2 s: "
    )
    passed, said = np.check_rendezvous("127.0.0.1", port, 0, 2, 1)
    assert (passed, said) == (False, f"only 0 of 1 other nodes reached 127.0.0.1:{port} within 1 s")
    passed, said = np.check_rendezvous("no-such-host.invalid", port, 1, 2, 1)
    assert not passed and said.startswith("rendezvous host no-such-host.invalid does not resolve: ")


# ---- the preflight: every check, in the node's one line -------------------------------------------


def _settings(**kw: str) -> dict[str, str]:
    return {**np.PREFLIGHT_SETTINGS, **kw}


@pytest.fixture
def env_python(tmp_path, monkeypatch, node_env):
    """node_env with the checkout on PYTHONPATH (torch and sbatch_gen importable); the python on PATH."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return tmp_path / "bin" / "python"


def test_preflight_says_what_it_found_in_order(tmp_path, env_python):
    (tmp_path / "data").mkdir()
    ok, bad = np.preflight(
        _settings(module="sbatch_gen.train", config=str(PROGRAM), data="data", ifname="lo", run_dir="run")
    )
    assert bad == []
    assert ok[0].endswith(f" python {sys.version.split()[0]} {env_python}")
    assert ok[1:] == [
        f"torchrun {env_python.parent / 'torchrun'}",
        "sbatch_gen.train and torch importable",
        f"train config {PROGRAM}",
        "data path data",
        "interface lo 127.0.0.1",
        "run dir run writable",
    ]
    assert (tmp_path / "run").is_dir() and not list((tmp_path / "run").iterdir())


def test_preflight_without_python_checks_what_needs_no_python(tmp_path, monkeypatch, node_env):
    (tmp_path / "bin" / "python").unlink()
    ok, bad = np.preflight(_settings(module="sbatch_gen.train", config="c.yaml", rdzv_port=str(free_port())))
    assert ok == []
    assert bad == [
        "python not found on PATH (python_env)",
        f"train config c.yaml not readable from {tmp_path} (trainer.config)",
    ]


def test_preflight_a_setup_error_comes_first_and_skips_the_environments_checks(tmp_path, env_python):
    ok, bad = np.preflight(
        _settings(
            setup_error="venv x not found: no x/bin/python (python_env.path)", module="no.such", script="t.py"
        )
    )
    assert bad == [
        "venv x not found: no x/bin/python (python_env.path)",
        f"trainer script t.py not readable from {tmp_path} (trainer.script)",
    ]


def test_preflight_a_missing_module_torch_and_torchrun(tmp_path, env_python, monkeypatch):
    (env_python.parent / "torchrun").unlink()
    no_site = env_python.parent / "python"
    no_site.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n')  # no torch reachable
    monkeypatch.setenv("PYTHONPATH", "")
    ok, bad = np.preflight(_settings(module="sbatch_gen.train"))
    assert bad == [
        "torchrun not found on PATH (python_env)",
        f"trainer module sbatch_gen.train not importable by {no_site} from {tmp_path} (trainer.module, python_env)",
        f"torch not importable by {no_site} from {tmp_path} (python_env)",
    ]
    ok, bad = np.preflight(_settings(script=str(PROGRAM)))
    assert f"trainer script {PROGRAM}" in ok
    assert bad[1:] == [f"torch not importable by {no_site} from {tmp_path} (python_env)"]


def test_preflight_the_module_is_found_from_the_current_directory_as_torchrun_finds_it(tmp_path, env_python):
    (tmp_path / "mytrainer").mkdir()
    (tmp_path / "mytrainer" / "__init__.py").write_text("")
    (tmp_path / "mytrainer" / "train.py").write_text("raise SystemExit('imported')\n")
    ok, bad = np.preflight(_settings(module="mytrainer.train"))
    assert bad == [] and "mytrainer.train and torch importable" in ok


def _fake_torch(root: Path, version: str, run_py: str) -> Path:
    (root / "torch" / "distributed").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("")
    (root / "torch" / "version.py").write_text(f"__version__ = '{version}'\n")
    (root / "torch" / "distributed" / "run.py").write_text(run_py)
    return root


def test_preflight_torchrun_flags_the_nodes_torch_lacks(tmp_path, env_python, monkeypatch):
    old = _fake_torch(tmp_path / "old", "2.4.1", 'p.add_argument("--shutdown_timeout")\n')
    monkeypatch.setenv("PYTHONPATH", str(old))
    flags = "--signals-to-handle,--shutdown-timeout"
    # the first torch that has each flag, and the field that puts it there (TORCHRUN_FLAG_SINCE, _KEY)
    assert np.preflight(_settings(torchrun_flags=flags, stop_protocol="signal"))[1] == [
        "torchrun of torch 2.4.1 has no --signals-to-handle (trainer.stop_protocol: signal): use torch >= 2.10"
    ]
    # stop_protocol sbatch-gen: run-trainer's compat shim does without them, and the preflight says so
    ok, bad = np.preflight(_settings(torchrun_flags=flags, stop_protocol="sbatch-gen"))
    assert bad == [] and any("through run-trainer's compat shim" in x for x in ok), ok
    # a flag the node program has no table entry for: named, a newer torch asked for
    assert np.preflight(_settings(torchrun_flags="--future-flag", stop_protocol="signal"))[1] == [
        "torchrun of torch 2.4.1 has no --future-flag (--future-flag): use a newer torch"
    ]
    # no torch at all: the torch check says so, not the flag check
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "nothing"))
    env_python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n')
    assert np.preflight(_settings(torchrun_flags=flags, stop_protocol="signal"))[1] == []


def test_preflight_takes_the_flags_and_the_numa_binding_from_torchruns_arguments(monkeypatch):
    """preflight_main: the settings, then `--` and torchrun's arguments (the Slurm job's TORCHRUN_ARGS): the
    flags checked (those of TORCHRUN_FLAG_SINCE it gives) and the NUMA binding are torchrun's own."""
    seen = {}
    monkeypatch.setattr(np, "preflight", lambda s: (seen.update(s), ([], []))[1])
    monkeypatch.setattr(np, "node_name", lambda: "n1")
    argv = ["--nnodes", "2", "--numa-binding=node", "--signals-to-handle=SIGINT", "--rdzv-conf=a=b"]
    assert np.preflight_main(["gpus=8", "stop_protocol=signal", "--", *argv]) == 0
    assert seen["torchrun_flags"] == "--numa-binding,--signals-to-handle" and seen["numa"] == "node"
    assert seen["gpus"] == "8" and seen["stop_protocol"] == "signal"
    seen.clear()  # the two-word form, and no torchrun arguments at all: nothing derived
    assert np.preflight_main(["--", "--numa-binding", "socket"]) == 0 and seen["numa"] == "socket"
    seen.clear()
    assert np.preflight_main(["numa=node"]) == 0 and seen["torchrun_flags"] == "" and seen["numa"] == "node"
    assert np.preflight_main(["torchrun_flag=--x"]) == 2  # a setting it does not know


def test_preflight_an_interface_that_is_missing_or_has_no_address(tmp_path, node_env, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = np.preflight(_settings(ifname="sbgt9"))[1]
    assert bad[-1].startswith("network interface sbgt9 does not exist (network.socket_ifname); have: ")
    assert " lo" in bad[-1] or ": lo" in bad[-1]
    monkeypatch.setattr(np, "iface_ipv4", lambda name: None)
    assert np.preflight(_settings(ifname="lo"))[1][-1] == (
        "network interface lo has no IPv4 address (network.socket_ifname)"
    )


@pytest.mark.parametrize(
    ("listed", "cvd", "expected", "problem"),
    [
        (8, "", 8, None),
        (7, "", 8, "7 GPUs visible, the profile expects 8 (slurm.gpus_per_node)"),
        (8, "0,1,2,3", 4, None),
        (8, "0,1", 4, "2 GPUs visible, the profile expects 4 (slurm.gpus_per_node)"),
    ],
)
def test_preflight_counts_the_visible_gpus(tmp_path, node_env, monkeypatch, listed, cvd, expected, problem):
    node_env(_node(tmp_path, gpu_numa=[0] * listed))
    if cvd:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    monkeypatch.chdir(tmp_path)
    ok, bad = np.preflight(_settings(gpus=str(expected), gpus_key="slurm.gpus_per_node"))
    if problem is None:
        assert f"{expected} GPUs" in ok and not [b for b in bad if "GPU" in b]
    else:
        assert problem in bad


def test_preflight_a_gpu_site_without_nvidia_smi(tmp_path, node_env, monkeypatch):
    monkeypatch.setenv("PATH", path_without("nvidia-smi", tmp_path / "shadow"))
    monkeypatch.chdir(tmp_path)
    assert (
        "nvidia-smi not found, but the site has 8 GPUs per node (node.gpus)"
        in np.preflight(_settings(gpus="8", gpus_key="node.gpus"))[1]
    )


def test_preflight_logs_the_topology_before_its_line(tmp_path, node_env, monkeypatch, capsys):
    node_env(_node(tmp_path))
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-n7")
    monkeypatch.chdir(tmp_path)
    assert np.preflight_main(["gpus=8", "log_topology=1"]) in (0, 1)
    out = capsys.readouterr().out
    assert out.startswith("[gpu-n7 topo] GPU0 X\n"), out


def test_preflight_the_numa_and_hca_checks_in_the_line(tmp_path, node_env, monkeypatch):
    node_env(_node(tmp_path, hcas={"mlx5_0": {1: "Ethernet"}}))
    monkeypatch.chdir(tmp_path)
    ok, bad = np.preflight(_settings(numa="node", hcas="=mlx5_0,mlx5_1", link_layer="InfiniBand"))
    assert checks(ok)[0].startswith("NUMA binding node: numactl "), ok
    assert len(bad) == 2, bad
    assert bad[0].startswith("nccl.ib_hca: mlx5_0 port 1 has link layer Ethernet, but nccl.ib_link_layer is ")
    assert bad[1].startswith("nccl.ib_hca: no adapter mlx5_1 on this node; have: mlx5_0 (port 1:Ethernet)")


def test_preflight_the_run_dir_and_node0s_marker(tmp_path, node_env, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    marker = run / ".sbatch-gen-shared.1.0"
    s = _settings(run_dir=str(run), shared_marker=str(marker), node_id="1", nnodes="2")
    ok, bad = np.preflight(s)
    assert checks(ok) == [f"run dir {run} writable"]
    assert bad == [
        f"run dir {run} is not the one node 0 sees (checkpoints need a filesystem all nodes share)"
    ]
    marker.write_text("")
    ok, bad = np.preflight(s)
    assert (checks(ok), bad) == ([f"run dir {run} writable", "run dir shared with node 0"], [])
    assert checks(np.preflight({**s, "node_id": "0"})[0]) == [f"run dir {run} writable"]  # node 0 wrote it
    (tmp_path / "file").write_text("")
    assert np.preflight(_settings(run_dir=str(tmp_path / "file" / "run")))[1] == [
        f"run dir {tmp_path / 'file' / 'run'} cannot be created or is not writable (paths.run_dir)"
    ]


def test_preflight_runs_the_health_check_with_bash(tmp_path, node_env, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert checks(np.preflight(_settings(health_check="test -d /"))[0]) == ["health check passed"]
    ok, bad = np.preflight(_settings(health_check="echo checking; echo 'GPU 3: ECC errors' >&2; exit 4"))
    assert bad == ["health check failed: GPU 3: ECC errors (preflight.health_check)"]
    ok, bad = np.preflight(_settings(health_check="read -r x; exit 1"))  # stdin is /dev/null: no hang
    assert bad == ["health check failed (preflight.health_check)"]
    ok, bad = np.preflight(_settings(health_check=f"printf '%s\\n' {'x' * 400}; exit 1"))
    assert bad == [f"health check failed: {'x' * 300} (preflight.health_check)"]


def test_preflight_after_a_failure_only_node0s_port_is_tried(tmp_path, env_python, monkeypatch):
    port = free_port()
    seen = []
    monkeypatch.setattr(np, "check_rendezvous", lambda *a: seen.append(a) or (True, ""))
    np.preflight(
        _settings(config="missing.yaml", rdzv_port=str(port), rdzv_host="n1", node_id="0", nnodes="2")
    )
    assert seen == [("", port, 0, 2, 60.0)]
    seen.clear()
    np.preflight(
        _settings(rdzv_port=str(port), rdzv_host="n1", node_id="1", nnodes="2", connect_timeout_s="5")
    )
    assert seen == [("n1", port, 1, 2, 5.0)]


def test_preflight_main_waits_before_a_failure_under_srun(tmp_path, node_env, monkeypatch, capsys):
    slept = []
    monkeypatch.setattr(np.time, "sleep", slept.append)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    assert np.preflight_main(["data=/no/such"]) == 1
    assert slept == []
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert np.preflight_main(["data=/no/such"]) == 1
    assert slept == [1]
    err = capsys.readouterr().err
    assert err == "preflight FAILED on n3: data path /no/such does not exist (paths.data)\n" * 2


def test_a_bug_in_a_check_is_still_the_nodes_one_line(tmp_path, node_env, monkeypatch, capsys):
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    assert np.preflight_main(["gpus=eight"]) == 1
    assert capsys.readouterr().err == (
        "preflight FAILED on n3: the preflight itself failed: ValueError: invalid literal for int() with base "
        "10: 'eight' (sbatch-gen-node.py)\n"
    )


def test_the_environments_fingerprint_is_one_line_and_the_same_from_a_copy(tmp_path):
    """paths.pin_code: the batch shell records `fingerprint` for a new submission; the copy on a node, run
    with -I on the same environment's python, must say exactly the same."""
    here = np.env_fingerprint()
    assert re.fullmatch(r"torch \S+, Python 3\.\d+\.\d+ on \S+, \d+ packages \([0-9a-f]{16}\)", here), here
    copy = tmp_path / "sbatch-gen-node.py"
    shutil.copy(PROGRAM, copy)
    r = subprocess.run(
        [sys.executable, "-I", str(copy), "fingerprint"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout == here + "\n", r.stderr


def test_preflight_a_node_whose_environment_is_not_the_runs(tmp_path, node_env, monkeypatch):
    monkeypatch.setattr(
        np, "env_fingerprint", lambda: "torch 2.13.0, Python 3.11.7 on x86_64, 9 packages (b)"
    )
    ok, bad = np.preflight(_settings(env_fingerprint="torch 2.13.0, Python 3.11.7 on x86_64, 9 packages (b)"))
    assert "python_env as the run started (paths.pin_code)" in checks(ok) and bad == []
    ok, bad = np.preflight(_settings(env_fingerprint="torch 2.12.1, Python 3.11.7 on x86_64, 9 packages (a)"))
    assert bad == [
        "python_env is not the one the run started with: it is torch 2.13.0, Python 3.11.7 on x86_64, 9 "
        "packages (b), the run's is torch 2.12.1, Python 3.11.7 on x86_64, 9 packages (a) (paths.pin_code)"
    ]


def _cpu_topology(root: Path, siblings: dict[int, str]) -> None:
    """A fake /sys/devices/system/cpu: CPU -> its core's thread_siblings_list."""
    for cpu, threads in siblings.items():
        top = root / "sys" / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        top.mkdir(parents=True)
        (top / "thread_siblings_list").write_text(f"{threads}\n")


@pytest.mark.parametrize(
    ("siblings", "cpus", "procs", "want"),
    [
        ({c: str(c) for c in range(8)}, 112, 8, 14),  # no SMT: CPUs / processes
        ({c: f"{c % 4},{c % 4 + 4}" for c in range(8)}, 112, 8, 7),  # two threads per core (0,4 share core 0)
        ({c: f"{c - c % 2}-{c - c % 2 + 1}" for c in range(8)}, 8, 2, 2),  # the siblings as a range
        ({0: "0-1", 1: "0-1"}, 2, 8, 1),  # fewer cores than processes: 1
    ],
)
def test_omp_threads_is_an_even_share_of_the_physical_cores(
    tmp_path, monkeypatch, siblings, cpus, procs, want
):
    """Slurm counts hardware threads as CPUs: OMP_NUM_THREADS counts the cores behind them."""
    monkeypatch.setenv("SBATCH_GEN_SYSFS_ROOT", str(tmp_path))
    _cpu_topology(tmp_path, siblings)
    assert np.omp_threads(cpus, procs, sorted(siblings)) == want


def test_omp_threads_without_a_topology_counts_every_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SBATCH_GEN_SYSFS_ROOT", str(tmp_path))  # nothing under it
    assert np.omp_threads(112, 8, [0, 1]) == 14
    r = subprocess.run(
        [sys.executable, "-I", str(PROGRAM), "omp-threads", "8", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "usage: sbatch-gen-node.py omp-threads CPUS PROCS" in r.stderr
