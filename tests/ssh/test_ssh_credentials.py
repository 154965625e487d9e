"""The SSH launcher's secrets (sbatch_gen/credentials.py, SECRET_ENV in templates/ssh-launcher.sh.j2): the
values of the variables a profile names reach torchrun's trainer on every host, over ssh's stdin, and no
command line, file or log; a missing one stops the launch before anything starts; the preflight lists the
run's bucket with them on every host. A real sshd, a real torchrun and a real S3-compatible server that
checks signatures (nanio: a wrong key is refused with 403; moto accepts any)."""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from pathlib import Path

import pytest

from bench.servers import NanioServer

pytestmark = pytest.mark.slow  # a real sshd, a real S3 server, torchrun on two "hosts"

BUCKET = "llm-xr-mailbox"
KEY_VAR, SECRET_VAR, TOKEN_VAR, WANDB_VAR = "SBG_T_KEY_ID", "SBG_T_SECRET", "SBG_T_TOKEN", "SBG_T_WANDB"
OWN_VAR = "SBG_T_HF_TOKEN"  # a secret of the trainer's own (launch.secrets), like HF_TOKEN
NAMES = (KEY_VAR, SECRET_VAR, TOKEN_VAR, WANDB_VAR, OWN_VAR)

# The trainer: records, per node, whether each variable is set and the sha256 of its value (never the value),
# then stays a moment so that the test sees its processes run (the ArgvWatch scans /proc every 0.05 s).
RECORDER = """import hashlib, json, os, time
rank = os.environ["SBATCH_GEN_NODE_RANK"]
seen = {{n: hashlib.sha256(os.environ[n].encode()).hexdigest() if n in os.environ else None for n in {names!r}}}
os.makedirs("seen", exist_ok=True)
with open(f"seen/node-{{rank}}.json.tmp", "w") as f:
    json.dump(seen, f)
os.replace(f"seen/node-{{rank}}.json.tmp", f"seen/node-{{rank}}.json")
time.sleep(1)
"""


@pytest.fixture(scope="module")
def keys() -> dict[str, str]:
    """Fresh values for this module's secrets: the S3 pair nanio accepts, a session token, a W&B key, a
    secret of the trainer's own."""
    return {
        KEY_VAR: "AKSBG" + secrets.token_hex(8).upper(),
        SECRET_VAR: "sbgsecret-" + secrets.token_hex(16),
        TOKEN_VAR: "sbgtoken-" + secrets.token_hex(16),
        WANDB_VAR: "sbgwandb-" + secrets.token_hex(16),
        OWN_VAR: "hf_sbg" + secrets.token_hex(16),
    }


@pytest.fixture(scope="module")
def s3(keys):
    server = NanioServer(access_key=keys[KEY_VAR], secret_key=keys[SECRET_VAR]).start()
    try:
        import boto3

        boto3.session.Session(
            aws_access_key_id=keys[KEY_VAR], aws_secret_access_key=keys[SECRET_VAR], region_name="us-east-1"
        ).client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


def xr_overrides(s3, tmp_path: Path, token: bool = True, wandb: bool = True) -> list[str]:
    creds = {"access_key_id_env": KEY_VAR, "secret_access_key_env": SECRET_VAR}
    if token:
        creds["session_token_env"] = TOKEN_VAR
    xr = {
        "enabled": True,
        "transport": {
            "kind": "s3",
            "bucket": BUCKET,
            "prefix": "runs/secrets",
            "endpoint_url": s3.endpoint_url,
            "addressing_style": "path",
            "region_name": "us-east-1",
            "credentials": creds,
        },
    }
    script = tmp_path / "record_env.py"
    script.write_text(RECORDER.format(names=NAMES))
    out = [
        "cross_region=" + json.dumps(xr),
        f"trainer.script={script}",
        "trainer.module=null",
        "ssh.connect_timeout_s=5",
    ]
    if wandb:
        out.append(
            "metrics="
            + json.dumps({"sinks": ["wandb"], "wandb_mode": "online", "wandb_api_key_env": WANDB_VAR})
        )
    return out


@pytest.fixture
def secret_env(monkeypatch, keys):
    """The launcher's environment holds the secrets (and no proxy for the loopback server)."""
    for k, v in keys.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    return keys


class ArgvWatch:
    """Reads every process's /proc/<pid>/cmdline while the launch runs: any secret value in one is recorded."""

    def __init__(self, values: list[str]):
        self.values = [v.encode() for v in values]
        self.hits: list[str] = []
        self.scans = 0
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for d in Path("/proc").iterdir():
                if not d.name.isdigit():
                    continue
                try:
                    argv = (d / "cmdline").read_bytes()
                except OSError:
                    continue
                self.pids.add(int(d.name))
                for v in self.values:
                    if v in argv:
                        self.hits.append(f"pid {d.name}: {argv[:200]!r}")
            self.scans += 1
            time.sleep(0.05)

    def __enter__(self) -> ArgvWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def files_holding(root: Path, values: list[str]) -> list[str]:
    """Files under ``root`` whose bytes contain any of ``values``."""
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            hits += [f"{p}: holds the value of a secret" for v in values if v.encode() in data]
    return hits


def test_secrets_reach_every_host_and_no_argv_or_file(ssh_launch, s3, secret_env, tmp_path):
    """Both hosts' trainers (node 0 under env -i, node 1 over ssh, where sshd starts a fresh environment)
    see every secret with the launcher's value, launch.secrets' own one included; the preflight listed the
    bucket on both; no process's argv and no file under the launch directory (run dir, log dir, renders)
    holds a value."""
    values = list(secret_env.values())
    with ArgvWatch(values) as watch:
        launch = ssh_launch(*xr_overrides(s3, tmp_path), f"launch.secrets=[{OWN_VAR}]")
        rc = launch.wait(240)
    out = launch.output()
    assert rc == 0, out
    want = {n: hashlib.sha256(v.encode()).hexdigest() for n, v in secret_env.items()}
    for rank in (0, 1):
        seen = json.loads((tmp_path / "seen" / f"node-{rank}.json").read_text())
        assert seen == want, (rank, seen)
    for rank, host in ((0, "127.0.0.1"), (1, "localhost")):
        said = (launch.logs / f"preflight.attempt-1.node-{rank}.log").read_text()
        assert f"s3 bucket {BUCKET} at {s3.endpoint_url} reachable" in said, (host, said)
    assert watch.scans > 10 and len(watch.pids) > 5  # it watched while the launch ran
    assert watch.hits == []
    assert files_holding(tmp_path, values) == []
    assert not any(v in out for v in values)
    assert launch.run_dir.exists() and launch.logs.exists()


def test_missing_secret_stops_before_anything_starts(ssh_launch, s3, secret_env, tmp_path, monkeypatch):
    """A required variable unset (or empty) on the launching host: exit 2 naming it and the profile field,
    before the logs, the preflight or any host."""
    monkeypatch.delenv(SECRET_VAR)
    monkeypatch.delenv(OWN_VAR)
    monkeypatch.setenv(TOKEN_VAR, "")
    launch = ssh_launch(*xr_overrides(s3, tmp_path), f"launch.secrets=[{OWN_VAR}]")
    rc = launch.wait(60)
    out = launch.output()
    assert rc == 2, out
    assert f"{SECRET_VAR} (cross_region.transport.credentials.secret_access_key_env)" in out, out
    assert f"{TOKEN_VAR} (cross_region.transport.credentials.session_token_env)" in out, out
    assert f"{OWN_VAR} (launch.secrets[0])" in out, out
    assert KEY_VAR not in out.split("ERROR:", 1)[1]  # the one that is set is not named
    assert not launch.logs.exists()
    assert not (tmp_path / "seen").exists()


def test_preflight_names_host_endpoint_and_field_when_the_key_is_wrong(
    ssh_launch, s3, secret_env, tmp_path, monkeypatch
):
    """The S3 server refuses the launcher's key: the preflight fails on every host, exit 3, each line naming
    the host, the bucket, the endpoint, the server's error and the profile field; nothing was started. The
    wrong value is in no argv or file either."""
    wrong = "wrong-" + secrets.token_hex(16)
    monkeypatch.setenv(SECRET_VAR, wrong)
    with ArgvWatch([wrong, secret_env[TOKEN_VAR]]) as watch:
        launch = ssh_launch(*xr_overrides(s3, tmp_path, wandb=False))
        rc = launch.wait(120)
    out = launch.output()
    assert rc == 3, out
    for label in ("node 0 (127.0.0.1)", "node 1 (localhost)"):
        line = next((x for x in out.splitlines() if f"preflight FAILED on {label}:" in x), None)
        assert line is not None, out
        assert f"cannot reach s3 bucket {BUCKET} at {s3.endpoint_url}: 403 " in line, line
        assert line.endswith("(cross_region.transport.credentials)"), line
    assert not (tmp_path / "seen").exists()
    assert watch.hits == []
    assert files_holding(tmp_path, [wrong, secret_env[TOKEN_VAR]]) == []


def test_shared_profile_sends_nothing(ssh_launch, s3, tmp_path, monkeypatch):
    """credentials.profile: nothing to send; each host's own shared-credentials file is used (here one file
    both "hosts" read through AWS_SHARED_CREDENTIALS_FILE, which sshd does not pass: it is in extra_env)."""
    keys_file = tmp_path / "aws-credentials"
    # the server's pair, in a file of the test's own (the hosts' ~/.aws in real life)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    keys_file.write_text(
        f"[sbg]\naws_access_key_id = {s3.access_key}\naws_secret_access_key = {s3.secret_key}\n"
    )
    xr = {
        "enabled": True,
        "transport": {
            "kind": "s3",
            "bucket": BUCKET,
            "endpoint_url": s3.endpoint_url,
            "addressing_style": "path",
            "region_name": "us-east-1",
            "credentials": {"profile": "sbg"},
        },
    }
    script = tmp_path / "record_env.py"
    script.write_text(RECORDER.format(names=NAMES))
    launch = ssh_launch(
        "cross_region=" + json.dumps(xr),
        f"trainer.script={script}",
        "trainer.module=null",
        "extra_env=" + json.dumps({"AWS_SHARED_CREDENTIALS_FILE": str(keys_file), "NO_PROXY": "127.0.0.1"}),
    )
    rc = launch.wait(240)
    out = launch.output()
    assert rc == 0, out
    assert "SECRET_ENV=()  # none named" in launch.script.read_text()
    said = (launch.logs / "preflight.attempt-1.node-1.log").read_text()
    assert f"s3 bucket {BUCKET} at {s3.endpoint_url} reachable" in said, said


# Values a shell or a record format could mangle: newlines, '=', both quotes, '$(...)', backslashes, spaces.
HOSTILE = {
    "SBG_H_A": "line1\nline2=x",
    "SBG_H_B": 'it\'s "q" $(touch /tmp/sbg-pwned) `id` \\ * ',
    "SBG_H_C": "=starts-with-equals",
}


def test_records_survive_hostile_values_and_only_named_variables_are_kept(tmp_path):
    """send_secrets | receive_secrets, as run_on pipes them: every value arrives byte for byte; a record
    for a name SECRET_ENV does not list is dropped; nothing is exported before export_secrets; cleanup_main
    gets no records; env_without_secrets hides a host's own value."""
    from sshkit import launcher_lib, run_lib, scrubbed_env

    creds = {
        "access_key_id_env": "SBG_H_A",
        "secret_access_key_env": "SBG_H_B",
        "session_token_env": "SBG_H_C",
    }
    xr = {"enabled": True, "transport": {"kind": "s3", "bucket": BUCKET, "credentials": creds}}
    lib = launcher_lib(tmp_path, 29999, "cross_region=" + json.dumps(xr))
    dump = "import json, os; print(json.dumps({k: os.environ.get(k) for k in ('SBG_H_A', 'SBG_H_B', 'SBG_H_C', 'PATH')}))"
    code = f"""
set -euo pipefail
before=$( {{ send_secrets node_main; printf 'PATH=/evil\\0'; }} | {{
  unset SBG_H_A SBG_H_B SBG_H_C
  receive_secrets
  python3 -c {json.dumps(dump)}
  export_secrets
  python3 -c {json.dumps(dump)}
}} )
printf '%s\\n' "$before"
printf 'cleanup:%s\\n' "$(send_secrets cleanup_main | od -An -c | tr -d ' \\n')"
SBG_H_A=own env_without_secrets | grep -c '^SBG_H_' || true
"""
    env = {**scrubbed_env(), **HOSTILE}
    r = run_lib(lib, code, env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    unexported, exported = json.loads(lines[0]), json.loads(lines[1])
    assert {k: unexported[k] for k in HOSTILE} == dict.fromkeys(HOSTILE)
    assert unexported["PATH"] != "/evil"
    assert {k: exported[k] for k in HOSTILE} == HOSTILE
    assert exported["PATH"] != "/evil"
    assert lines[2] == "cleanup:"
    assert lines[3] == "0"
    assert not Path("/tmp/sbg-pwned").exists()


def test_the_real_trainer_trains_through_the_bucket_and_leaves_no_secret(
    ssh_launch, s3, secret_env, tmp_path
):
    """The companion trainer on both hosts, cross_region through the S3 mailbox with the delivered keys
    (node_leaders: each node's leader talks to the bucket, node 1's over ssh): it trains to completion, the
    rounds are in the bucket, and no file of the run dir, the log dir or the launch dir holds a value."""
    from sshkit import tiny_config

    cfg = tiny_config(tmp_path / "tiny.yaml", train__steps=8, checkpoint__every=4)
    xr = {
        "enabled": True,
        "run_id": "secrets",
        "inner_steps": 4,
        "snapshot_every": 2,  # within the run's 2 rounds (validate's check, which render makes too)
        "timeout_s": 120,
        "transport": {
            "kind": "s3",
            "bucket": BUCKET,
            "prefix": "runs/real",
            "endpoint_url": s3.endpoint_url,
            "addressing_style": "path",
            "region_name": "us-east-1",
            "credentials": {"access_key_id_env": KEY_VAR, "secret_access_key_env": SECRET_VAR},
        },
    }
    values = [secret_env[KEY_VAR], secret_env[SECRET_VAR]]
    with ArgvWatch(values) as watch:
        launch = ssh_launch("cross_region=" + json.dumps(xr), config=cfg)
        rc = launch.wait(300)
    out = launch.output()
    assert rc == 0, out + launch.node_log(1, 1)[-3000:]
    import boto3

    keys = [
        o["Key"]
        for o in boto3.session.Session(
            aws_access_key_id=values[0], aws_secret_access_key=values[1], region_name="us-east-1"
        )
        .client("s3", endpoint_url=s3.endpoint_url)
        .list_objects_v2(Bucket=BUCKET, Prefix="runs/real/")
        .get("Contents", [])
    ]
    assert keys, "nothing in the bucket"
    assert watch.hits == []
    assert files_holding(tmp_path, values) == []


def test_a_wandb_key_named_only_in_the_train_config_reaches_every_host(
    ssh_launch, secret_env, tmp_path, monkeypatch
):
    """The profile has no metrics section, so the train config's decides the sinks: the W&B key's variable it
    names is sent like the profile's (the render reads the section), and both hosts' trainers see the
    launching host's value (node 1 over ssh, where sshd starts a fresh environment); with wandb_mode online
    an unset key stops the launch before anything starts, naming the variable, the field and the file."""
    import yaml
    from sshkit import tiny_config

    config = tiny_config(tmp_path / "wandb.yaml")
    cfg = yaml.safe_load(config.read_text())
    cfg["metrics"] = {"sinks": ["wandb"], "wandb_mode": "online", "wandb_api_key_env": WANDB_VAR}
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    script = tmp_path / "record_env.py"
    script.write_text(RECORDER.format(names=NAMES))
    own = (f"trainer.script={script}", "trainer.module=null")
    with ArgvWatch([secret_env[WANDB_VAR]]) as watch:
        launch = ssh_launch(*own, config=config)
        rc = launch.wait(240)
    assert rc == 0, launch.output()
    want = hashlib.sha256(secret_env[WANDB_VAR].encode()).hexdigest()
    for rank in (0, 1):
        seen = json.loads((tmp_path / "seen" / f"node-{rank}.json").read_text())
        assert seen[WANDB_VAR] == want, (rank, seen)
    assert watch.hits == [] and files_holding(tmp_path, [secret_env[WANDB_VAR]]) == []
    monkeypatch.delenv(WANDB_VAR)
    launch = ssh_launch(*own, config=config)
    assert launch.wait(60) == 2, launch.output()
    assert f"{WANDB_VAR} (metrics.wandb_api_key_env of trainer.config {config})" in launch.output()
