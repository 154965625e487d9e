"""The trainer with FSDP2 and CPU offload in a cross-region run, and what ``sbatch-gen status`` and
``sbatch-gen report`` make of its mailbox (manifest FORMAT 3, payload cut where each rank's shards end) and
run directories: one real tiny run (module fixture), read by three tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from xr.conftest import data_dir  # noqa: F401 - fixture, reused
from xr.test_multiproc import assert_same_params, metrics, train_regions

from .conftest import sg, write_site

pytestmark = pytest.mark.slow  # torchrun regions: the multi-process tier

REGIONS = ["eu", "us"]
SHAPES = {"eu": ({"kind": "fsdp", "cpu_offload": True}, 2), "us": ({"kind": "fsdp"}, 1)}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, repo, data_dir) -> Path:  # noqa: F811 - the fixture
    """eu: FSDP over 2 ranks with CPU offload; us: FSDP over 1 rank; DiLoCo over a directory mailbox, 12
    steps, H=4 (3 rounds), a snapshot every 2 rounds. Returns the directory holding ``mailbox``, ``eu``
    and ``us``."""
    d = tmp_path_factory.mktemp("fsdp-run")
    train_regions(d, repo, data_dir, SHAPES, snapshot_every=2)
    return d


def test_an_fsdp_region_with_cpu_offload_trains_the_same_model_as_its_peer(fsdp_run):
    """Offloaded parameters and optimizer state (FSDP's CPUOffloadPolicy) beside a region of another shape:
    the same rounds, and both end on the same exported bytes."""
    assert "(cpu offload on)" in (fsdp_run / "eu.log").read_text()
    assert_same_params(fsdp_run / "eu", fsdp_run / "us")
    for r in REGIONS:
        assert [x["xr_round"] for x in metrics(fsdp_run / r) if "xr_round" in x] == [1, 2, 3]


def test_status_reads_a_mailbox_written_by_sharded_regions(fsdp_run, tmp_path, monkeypatch):
    """``sbatch-gen status`` on the run's mailbox: the newest round, who took part, the snapshot eu's two
    ranks published, each region's newest round; as JSON and as the screen."""
    monkeypatch.chdir(fsdp_run)  # an fs mailbox path is relative to the current directory, as for the job
    sites = tmp_path / "sites"
    write_site(
        sites,
        "eu",
        "enabled: true\nrun_id: mp\nregion: eu\nregions: [eu, us]\ntransport:\n  kind: fs\n  root: mailbox\n",
    )
    code, out, err = sg("status", "--site", "eu", "--json", "--sites-dir", str(sites))
    assert code == 0, err
    st = json.loads(out)
    assert st["exists"] and st["newest_commit"]["round"] == 3 and st["newest_commit"]["members"] == REGIONS
    assert st["newest_snapshot"] == 2
    got = {r["region"]: (r["last_published"], r["behind"], r["presence"]) for r in st["regions"]}
    assert got == {r: (3, 0, "leaving") for r in REGIONS}  # both finished: a planned leave
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert "committed: round 3 (step 12)" in out and "snapshot:  round 2" in out, out
    assert re.search(r"^eu \*\s+round 3\s+leaving \(round 3\)\s+0\s+yes", out, re.M), out


def test_report_reads_the_runs_of_sharded_regions(fsdp_run, tmp_path):
    """``sbatch-gen report`` on both regions' run directories: the sync section and its phases, a baseline
    per region with its rounds and bytes."""
    out = tmp_path / "report"
    code, stdout, err = sg("report", str(fsdp_run / "eu"), str(fsdp_run / "us"), "--out", str(out))
    assert code == 0, err
    md = (out / "report.md").read_text()
    assert "## Cross-region sync" in md and "| upload |" in md and "| outer step |" in md
    # the regions' parallelism, and FSDP's in-region comm: its collectives, timed on gloo
    assert "| eu | " in md and " | 2 | cpu | fsdp + cpu offload | off | AdamW foreach | completed |" in md
    assert " | 1 | cpu | fsdp | off | AdamW foreach | completed |" in md
    assert "did not time" not in md
    base = json.loads((out / "slo.json").read_text())
    assert set(base) == set(REGIONS)
    for r in base.values():
        assert 0 <= r["in_region_comm_fraction"] < r["comm_fraction"] < 1
        assert 0 < r["cross_region_sync_fraction"] < 1
        assert r["sync_rounds"] == 3 and r["bytes_across_regions"] > 0 and r["last_step"] == 12
    assert base["eu"]["in_region_comm_fraction"] > 0  # its 2 ranks' all-gathers and reduce-scatters
