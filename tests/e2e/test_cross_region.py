"""(2) Two regions as two separate Slurm jobs (one node each, 2 processes), trained with DiLoCo (every round
with both regions) through `s3` on a real S3-compatible server (moto): both finish with bitwise identical
parameters. The same over the `fs` mailbox on Slurm: test_example_trainer.py (every round with both regions,
the example script) and test_elastic_regions.py (the companion trainer, with a preemption and a rejoin)."""

from __future__ import annotations

import pytest
import yaml
from e2e_lib import (
    REPO,
    S3_ACCESS_KEY,
    S3_SECRET_KEY,
    assert_same_final_params,
    files_holding,
    region_jobs,
    region_nodes,
    s3_mailbox,
    secrets_file,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def xr_config(e2e_root):
    """The tiny config, 20 steps: with H=5 that is 4 outer rounds."""
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["train"]["steps"] = 20
    cfg["checkpoint"]["every"] = 10
    p = e2e_root / "e2e-xr.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def _run_regions(
    cluster,
    root,
    xr_config,
    transport: dict,
    env: dict | None = None,
    own: dict[str, tuple[dict, dict]] | None = None,
    sets: dict | None = None,
):
    """own[region]: (that region's transport fields, its job's environment instead of ``env``)."""
    data = root / "data"
    data.mkdir(parents=True)
    jobs = region_jobs(
        cluster,
        root,
        "xr",
        {
            "run_id": f"e2e-{transport['kind']}",
            "sync": "diloco",
            "inner_steps": 5,
            "snapshot_every": 4,  # within the run's rounds (validate's check, which render makes too)
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "timeout_s": 240,
            "transport": transport,
        },
        config=xr_config,
        data=data,
        sets=sets,
        transport_of={r: t for r, (t, _) in (own or {}).items()},
    )
    for region, job in jobs.items():
        job.submit(own[region][1] if own and region in own else env)
    for region, job in jobs.items():
        info = cluster.wait_done(job.job_id, timeout=300)
        assert info["JobState"] == "COMPLETED", job.describe()
        assert info["NodeList"] == region_nodes(cluster)[region]
    return jobs


def _check_identical(jobs):
    assert_same_final_params(jobs)
    for job in jobs.values():
        rounds = [r["xr_round"] for r in job.metrics() if "xr_round" in r]
        assert len(rounds) >= 4, (job.name, rounds)  # every H=5 steps, an outer round with the other region
        assert job.summary()["last_step"] == 20
    # the regions trained on different data in between: their own losses differ
    la, lb = (jobs[r].losses() for r in sorted(jobs))
    assert la != lb


def test_two_regions_diloco_over_s3(cluster, e2e_root, xr_config):
    """Region a names its keys (cross_region.transport.credentials) and its job reads them on the node from
    slurm.secrets_file; region b takes them from a shared-credentials file of its own, through an AWS
    profile, with no key in its job's environment (regions differ in how they reach the bucket: validate
    lets them). The secret key appears in no file under either job's run dir or log dir, nor anywhere in
    Slurm's records of the jobs (its state directory, the accounting database, scontrol, sacct)."""
    root = e2e_root / "xr-s3"
    root.mkdir()
    with s3_mailbox(cluster, root, "e2e-mailbox") as (transport, env, s3):
        keys = secrets_file(
            root / "keys-a.env", {"E2E_S3_KEY_ID": S3_ACCESS_KEY, "E2E_S3_SECRET": S3_SECRET_KEY}
        )
        own_a = (
            {"credentials": {"access_key_id_env": "E2E_S3_KEY_ID", "secret_access_key_env": "E2E_S3_SECRET"}},
            env,
        )
        creds = root / "aws-credentials-b"
        creds.write_text(
            f"[e2e-b]\naws_access_key_id = {S3_ACCESS_KEY}\naws_secret_access_key = {S3_SECRET_KEY}\n"
        )
        creds.chmod(0o600)
        env_b = {**env, "AWS_SHARED_CREDENTIALS_FILE": str(creds)}
        # b's job has no key but the file's: without the profile, boto3 could not sign a request
        assert not {k for k in cluster.env if k.startswith(("AWS_ACCESS", "AWS_SECRET", "AWS_PROFILE"))}
        own_b = ({"credentials": {"profile": "e2e-b"}}, env_b)
        jobs = _run_regions(
            cluster,
            root,
            xr_config,
            transport,
            own={"a": own_a, "b": own_b},
            sets={"slurm.secrets_file": str(keys)},
        )
        count = s3.list_objects_v2(Bucket="e2e-mailbox", Prefix="e2e/").get("KeyCount", 0)
    _check_identical(jobs)
    assert count > 0, "nothing went through the s3 mailbox"
    a = jobs["a"]
    assert f"secrets from {keys} (slurm.secrets_file): E2E_S3_KEY_ID E2E_S3_SECRET" in a.batch_log()
    assert "s3 bucket e2e-mailbox at " in a.batch_log()  # the preflight checked it with those keys
    for job in jobs.values():
        assert files_holding(job.run_dir, [S3_SECRET_KEY]) == []
        assert files_holding(job.log_dir, [S3_SECRET_KEY]) == []
        for cmd in (
            ["scontrol", "show", "job", "-d", str(job.job_id)],
            ["sacct", "-j", str(job.job_id), "--env-vars"],
        ):
            assert S3_SECRET_KEY not in cluster.run(*cmd, check=False).stdout
    assert files_holding(cluster.state, [S3_SECRET_KEY]) == []  # slurmctld's state, the spool, the database
