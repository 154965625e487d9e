"""The job's environment on the real cluster: what a rendered job takes from the submitting shell is what its
#SBATCH --export line names (PATH, sbatch-gen's switches, the profile's defaults, slurm.export), its job
steps take the batch script's whole environment (SLURM_EXPORT_ENV=ALL), and the secrets it names are read
on the node from slurm.secrets_file: their values reach every rank and appear in no file under the run dir
or the log dir, nor in Slurm's records of the job (its state directory, the accounting database, scontrol,
sacct --env-vars where the cluster stores the job's environment: local-slurm.sh sets
AccountingStoreFlags=job_env)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from e2e_lib import REPO, files_holding, local_job, secrets_file

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Every rank writes its environment (the trainer of one's own: trainer.script, trainer.args) and exits 0.
DUMP = """\
import json, os, sys
with open(os.path.join(sys.argv[1], "env-" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(dict(os.environ), f)
"""


def test_the_job_takes_what_its_export_line_names_and_reads_its_secrets_on_the_node(cluster, e2e_root):
    root = e2e_root / "job-env"
    dumps = root / "dumps"
    dumps.mkdir(parents=True)
    data = root / "data"
    data.mkdir()
    script = root / "envdump.py"
    script.write_text(DUMP)
    token = f"e2e-token-{os.urandom(8).hex()}"  # the file's: the job's secret
    submitted = f"e2e-submitted-{os.urandom(8).hex()}"  # the same variable in the submitting shell
    keys = secrets_file(root / "secrets.env", {"E2E_TOKEN": token})
    job = local_job(
        cluster,
        root,
        "jobenv",
        {
            "trainer.module": None,
            "trainer.script": str(script),
            "trainer.args": [str(dumps)],
            "extra_env": {"E2E_DEFAULT": "profile"},
            "slurm.secrets": ["E2E_TOKEN"],
            "slurm.secrets_file": str(keys),
        },
        config=None,
        data=data,
    )
    # as `E2E_DEFAULT=submitted OMP_NUM_THREADS=3 PYTHONPATH=/stray ... sbatch --hold job.sbatch` from a
    # shell that holds stray variables and the secret itself
    env = {
        "E2E_DEFAULT": "submitted",
        "OMP_NUM_THREADS": "3",
        "PYTHONPATH": "/stray",
        "CUDA_VISIBLE_DEVICES": "7",
        "NCCL_ALGO": "Tree",
        "E2E_UNLISTED": "x",
        "E2E_TOKEN": submitted,
    }
    job_id = cluster.sbatch(job.script, "--hold", cwd=REPO, env=env)
    job.job_id = job_id
    # Slurm's record of the held job holds what it was submitted with: the named variables, no other
    records = list((cluster.state / "state").glob(f"hash.*/job.{job_id}/environment"))
    assert len(records) == 1, records
    record = records[0].read_bytes().split(b"\0")
    assert b"E2E_DEFAULT=submitted" in record and b"OMP_NUM_THREADS=3" in record
    for name in (b"PYTHONPATH", b"CUDA_VISIBLE_DEVICES", b"NCCL_ALGO", b"E2E_UNLISTED", b"E2E_TOKEN"):
        assert not [x for x in record if x.startswith(name + b"=")], name
    cluster.run("scontrol", "release", str(job_id))
    info = cluster.wait_done(job_id, timeout=180)
    assert info["JobState"] == "COMPLETED", job.describe()

    ranks = [json.loads((dumps / f"env-{r}.json").read_text()) for r in range(4)]
    nodes = {r["SLURMD_NODENAME"] for r in ranks}
    assert nodes == set(cluster.nodes), nodes
    for r in ranks:
        assert r["E2E_DEFAULT"] == "submitted" and r["OMP_NUM_THREADS"] == "3"  # submit-time values win
        assert r["E2E_TOKEN"] == token  # the file's, read on the node; not the submitting shell's
        assert "/stray" not in r.get("PYTHONPATH", "")
        assert not {"CUDA_VISIBLE_DEVICES", "NCCL_ALGO", "E2E_UNLISTED"} & set(r)
        assert r["SLURM_EXPORT_ENV"] == "ALL"
    log = job.batch_log()
    assert f"secrets from {keys} (slurm.secrets_file): E2E_TOKEN" in log
    assert "at its start" not in log  # the submitting shell's value never reached the job

    # the values: in no file of the run or its logs, and nowhere in Slurm's records
    for where in (job.run_dir, job.log_dir):
        assert files_holding(where, [token, submitted]) == []
    for cmd in (["scontrol", "show", "job", "-d", str(job_id)], ["sacct", "-j", str(job_id), "--env-vars"]):
        out = cluster.run(*cmd, check=False).stdout
        assert token not in out and submitted not in out, cmd
    flags = cluster.run("scontrol", "show", "config").stdout
    if "job_env" in next((x for x in flags.splitlines() if x.startswith("AccountingStoreFlags")), ""):
        # the database has the job's environment: what it was submitted with, and no secret
        deadline = time.monotonic() + 30
        while "E2E_DEFAULT=submitted" not in (
            stored := cluster.run("sacct", "-j", str(job_id), "--env-vars", check=False).stdout
        ):
            assert time.monotonic() < deadline, stored
            time.sleep(1)
        assert "E2E_TOKEN" not in stored
    assert files_holding(cluster.state, [token, submitted]) == []  # state, spool, logs, the database's files
    assert files_holding(Path(dumps), [submitted]) == []
