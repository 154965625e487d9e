"""A fake GPU node for the preflight tests: the /sys and /proc files the node checks read, under a root
the launchers' preflight takes from ``SBATCH_GEN_SYSFS_ROOT``, and stub ``nvidia-smi`` / ``numactl`` commands
to put first on PATH. Torch-free; standard library only.

    node = FakeNode(tmp_path / "node", gpu_numa=[0, 0, 1, 1], numa_cpus={0: "0-3", 1: "4-7"}, allowed="0-7",
                    hcas={"mlx5_0": {1: "InfiniBand"}, "mlx5_1": {1: "Ethernet"}})
    env = {**os.environ, **node.env()}   # SBATCH_GEN_SYSFS_ROOT and PATH (stubs first)

The layout follows the kernel's: /sys/bus/pci/devices/<0000:bb:00.0>/numa_node,
/sys/devices/system/node/{possible,node<N>/cpulist}, /sys/devices/system/cpu/cpu<N>/topology/
thread_siblings_list, /sys/class/infiniband/<hca>/ports/<port>/{link_layer,state} and /proc/self/status
(Cpus_allowed_list). nvidia-smi answers ``-L``, ``--query-gpu=index,uuid,pci.bus_id --format=csv,noheader``
and ``topo -m`` the way the real one does.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

_NVIDIA_SMI = """#!/bin/bash
# stub nvidia-smi for a fake node (sbatch_gen/testing/fakenode.py)
case "$*" in
  -L) cat "$(dirname "$0")/gpus.L" ;;
  "--query-gpu=index,uuid,pci.bus_id --format=csv,noheader") cat "$(dirname "$0")/gpus.csv" ;;
  "topo -m") echo "GPU0 X" ;;
  *) echo "stub nvidia-smi: unsupported arguments: $*" >&2; exit 2 ;;
esac
"""

# Takes numactl's options and runs the command, as `numactl --physcpubind=...` does on a real node.
_NUMACTL = """#!/bin/bash
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""


def _cpus(cpulist: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, cpulist.replace(" ", "").split(",")):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


class FakeNode:
    """A node with ``len(gpu_numa)`` GPUs; GPU i sits on NUMA node ``gpu_numa[i]`` (-1: no NUMA information).

    ``numa_cpus`` maps each NUMA node to its cpulist ("" for a memory-only node); ``allowed`` is the
    process's Cpus_allowed_list; ``threads_per_core`` consecutive CPUs make one physical core (CPUs 8 and 9
    with 2); ``hcas`` maps an adapter to {port: link_layer}; every port's state is ``4: ACTIVE`` unless
    ``port_state`` says otherwise ({"mlx5_3:1": "1: DOWN"}). ``numactl`` False leaves the stub out.
    """

    def __init__(
        self,
        root: Path,
        *,
        gpu_numa: list[int],
        numa_cpus: dict[int, str],
        allowed: str,
        threads_per_core: int = 1,
        hcas: dict[str, dict[int, str]] | None = None,
        port_state: dict[str, str] | None = None,
        numactl: bool = True,
    ):
        self.root = root
        self.bin = root / "stub-bin"
        self.bin.mkdir(parents=True)
        self.gpu_buses = [f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(len(gpu_numa))]
        self.gpu_uuids = [f"GPU-{i:08x}-1111-2222-3333-444444444444" for i in range(len(gpu_numa))]
        _executable(self.bin / "nvidia-smi", _NVIDIA_SMI)
        (self.bin / "gpus.L").write_text(
            "".join(f"GPU {i}: NVIDIA H200 (UUID: {u})\n" for i, u in enumerate(self.gpu_uuids))
        )
        (self.bin / "gpus.csv").write_text(
            "".join(
                f"{i}, {u}, {b}\n"
                for i, (u, b) in enumerate(zip(self.gpu_uuids, self.gpu_buses, strict=True))
            )
        )
        if numactl:
            _executable(self.bin / "numactl", _NUMACTL)
        for bus, numa in zip(self.gpu_buses, gpu_numa, strict=True):
            dev = root / "sys/bus/pci/devices" / ("0000:" + bus.split(":", 1)[1].lower())
            dev.mkdir(parents=True)
            (dev / "numa_node").write_text(f"{numa}\n")
        nodes = root / "sys/devices/system/node"
        nodes.mkdir(parents=True)
        (nodes / "possible").write_text(f"0-{max(numa_cpus)}\n" if len(numa_cpus) > 1 else "0\n")
        for n, cpulist in numa_cpus.items():
            (nodes / f"node{n}").mkdir()
            (nodes / f"node{n}" / "cpulist").write_text(cpulist + "\n")
        every = sorted(c for cpulist in numa_cpus.values() for c in _cpus(cpulist))
        for c in every:
            topo = root / f"sys/devices/system/cpu/cpu{c}/topology"
            topo.mkdir(parents=True)
            first = c - c % threads_per_core
            last = first + threads_per_core - 1
            (topo / "thread_siblings_list").write_text(f"{first}-{last}\n" if last > first else f"{first}\n")
        (root / "proc/self").mkdir(parents=True)
        (root / "proc/self/status").write_text(
            f"Name:\tbash\nState:\tR (running)\nCpus_allowed:\tff\nCpus_allowed_list:\t{allowed}\n"
            "Mems_allowed_list:\t0-1\n"
        )
        ib = root / "sys/class/infiniband"
        ib.mkdir(parents=True)
        for hca, ports in (hcas or {}).items():
            for port, link_layer in ports.items():
                d = ib / hca / "ports" / str(port)
                d.mkdir(parents=True)
                (d / "link_layer").write_text(link_layer + "\n")
                (d / "state").write_text((port_state or {}).get(f"{hca}:{port}", "4: ACTIVE") + "\n")

    def env(self, path: str | None = None) -> dict[str, str]:
        """SBATCH_GEN_SYSFS_ROOT and PATH with the stubs first (``path``: the rest, default this PATH)."""
        return {
            "SBATCH_GEN_SYSFS_ROOT": str(self.root),
            "PATH": f"{self.bin}:{path if path is not None else os.environ['PATH']}",
        }


def path_without(command: str, shadow: Path, path: str | None = None) -> str:
    """``path`` (default: this PATH) with ``command`` gone: each directory that has it is replaced by a
    directory under ``shadow`` with links to everything else in it."""
    dirs = []
    for i, d in enumerate((path if path is not None else os.environ["PATH"]).split(os.pathsep)):
        if not d or not (Path(d) / command).exists():
            dirs.append(d)
            continue
        copy = shadow / f"{i}"
        copy.mkdir(parents=True)
        for entry in Path(d).iterdir():
            if entry.name != command:
                (copy / entry.name).symlink_to(entry)
        dirs.append(str(copy))
    assert shutil.which(command, path=os.pathsep.join(dirs)) is None
    return os.pathsep.join(dirs)
