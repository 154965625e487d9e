"""(2) Two regions as two separate Slurm jobs (one node each, 2 processes), trained with DiLoCo through
the `fs` mailbox and through `s3` on a real S3-compatible server (moto): both finish with bitwise
identical parameters."""

from __future__ import annotations

import boto3
import numpy as np
import pytest
import yaml
from e2e_lib import REPO, local_job, moto_server
from safetensors.numpy import load_file

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REGIONS = {"a": "n1", "b": "n2"}  # region -> the node its job runs on
ACCESS_KEY, SECRET_KEY = "e2e-access", "e2e-secret"


@pytest.fixture(scope="module")
def xr_config(e2e_root):
    """The tiny config, 20 steps: with H=5 that is 4 outer rounds."""
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["train"]["steps"] = 20
    cfg["checkpoint"]["every"] = 10
    p = e2e_root / "e2e-xr.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def _run_regions(cluster, root, xr_config, transport: dict, env: dict | None = None):
    data = root / "data"
    data.mkdir(parents=True)
    jobs = {}
    for region, node in REGIONS.items():
        sets = {
            "slurm.nodes": 1,
            "slurm.extra_directives": [f"--nodelist={node}"],
            "cross_region": {
                "enabled": True, "run_id": f"e2e-{transport['kind']}", "region": region,
                "regions": sorted(REGIONS), "sync": "diloco", "inner_steps": 5, "outer_lr": 0.7,
                "outer_momentum": 0.9, "timeout_s": 240, "transport": transport,
            },
        }
        jobs[region] = local_job(cluster, root / region, f"xr-{region}", sets, config=xr_config, data=data)
    for job in jobs.values():
        job.submit(env)
    for job in jobs.values():
        info = cluster.wait_done(job.job_id, timeout=300)
        assert info["JobState"] == "COMPLETED", job.describe()
        assert info["NodeList"] == REGIONS[job.name.removeprefix("xr-")]
    return jobs


def _check_identical(jobs):
    a, b = (load_file(str(jobs[r].run_dir / "model.safetensors")) for r in sorted(REGIONS))
    assert sorted(a) == sorted(b)
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not differ, f"parameters differ between the regions: {differ[:5]}"
    for job in jobs.values():
        rounds = [r["xr_round"] for r in job.metrics() if "xr_round" in r]
        assert len(rounds) >= 4, (job.name, rounds)  # every H=5 steps, an outer round with the other region
        assert job.summary()["last_step"] == 20
    # the regions trained on different data in between: their own losses differ
    la, lb = (jobs[r].losses() for r in sorted(REGIONS))
    assert la != lb


def test_two_regions_diloco_over_fs(cluster, e2e_root, xr_config):
    root = e2e_root / "xr-fs"
    mailbox = root / "mailbox"
    jobs = _run_regions(cluster, root, xr_config, {"kind": "fs", "root": str(mailbox)})
    _check_identical(jobs)
    assert any(mailbox.rglob("*")), "nothing went through the fs mailbox"


def test_two_regions_diloco_over_s3(cluster, e2e_root, xr_config):
    root = e2e_root / "xr-s3"
    root.mkdir()
    with moto_server(cluster.host_addr, root / "moto.log") as url:
        s3 = boto3.client("s3", endpoint_url=url, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                          region_name="us-east-1")
        s3.create_bucket(Bucket="e2e-mailbox")
        env = {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": cluster.host_addr, "no_proxy": cluster.host_addr,
        }
        transport = {"kind": "s3", "bucket": "e2e-mailbox", "prefix": "e2e", "endpoint_url": url,
                     "addressing_style": "path"}
        jobs = _run_regions(cluster, root, xr_config, transport, env)
        keys = s3.list_objects_v2(Bucket="e2e-mailbox", Prefix="e2e/").get("KeyCount", 0)
    _check_identical(jobs)
    assert keys > 0, "nothing went through the s3 mailbox"
