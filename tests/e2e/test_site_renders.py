"""The production renders (EU: 2 x 8 H200; US: 1 x GH200) against the local controller: every #SBATCH line
they carry is one Slurm accepts, checked with `sbatch --test-only` after overriding only the partition.

The local cluster has nodes shaped like those sites in its `gpu` partition (g1, g2: 224 CPUs, 8 fake H200
GPUs, feature ib; gh1: 72 CPUs, 1 fake GH200), so GPU gres with types, --constraint, --mem=0 and
--exclusive are all really evaluated by the scheduler.
"""

from __future__ import annotations

import difflib
import re

import pytest
from e2e_lib import REPO, render

pytestmark = [pytest.mark.e2e]

EXPECT_NODES = {"eu": "g[1-2]", "us": "gh1"}  # after the cluster's node prefix


def _changed_lines(a: str, b: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


@pytest.mark.parametrize("site", ["eu", "us"])
def test_site_render_accepted_by_slurm(cluster, tmp_path, site):
    partition = cluster.info["SBATCH_GEN_SLURM_GPU_PARTITION"]
    out = tmp_path / "out"
    render(out, site, {"slurm.partition": partition})
    for name in (f"{site}.sbatch", f"{site}.setup.sbatch"):
        script = out / name
        # the override changed the partition and nothing else (the header names the override and hashes
        # the inputs)
        changed = _changed_lines((REPO / "out" / name).read_text(), script.read_text())
        assert any(line.startswith("+#SBATCH --partition=") for line in changed), changed
        assert all(re.search(r"--partition=|^[-+]#\s+(inputs sha256|override):", line) for line in changed), (
            changed
        )
        directives = [ln for ln in script.read_text().splitlines() if ln.startswith("#SBATCH ")]
        assert len(directives) >= 8, directives
        p = cluster.run("sbatch", "--test-only", str(script), check=False, cwd=tmp_path)
        assert p.returncode == 0, f"{name}: Slurm rejects it:\n{p.stderr}"
        m = re.search(
            r"Job \d+ to start at \S+ using (\d+) processors on nodes (\S+) in partition (\S+)", p.stderr
        )
        assert m, p.stderr
        if name == f"{site}.sbatch":
            assert m.group(2) == cluster.node_prefix + EXPECT_NODES[site], p.stderr
        assert m.group(3) == partition


def test_test_only_rejects_what_the_nodes_cannot_give(cluster, tmp_path):
    """The check above can fail: a request beyond the EU nodes (4096 CPUs per task; 9 GPUs per node an
    H200 node cannot have is refused by validate already) is refused."""
    out = tmp_path / "out"
    render(
        out,
        "eu",
        {"slurm.partition": cluster.info["SBATCH_GEN_SLURM_GPU_PARTITION"], "slurm.cpus_per_task": 4096},
    )
    p = cluster.run("sbatch", "--test-only", str(out / "eu.sbatch"), check=False, cwd=tmp_path)
    assert p.returncode != 0 and "Requested node configuration is not available" in p.stderr, p.stderr
