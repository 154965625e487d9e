"""The secrets a profile names and the preflight's bucket check (sbatch_gen/credentials.py), as Python values
and as the SSH launcher's settings (SECRET_ENV, BUCKET_CHECK) that bash reads back. tests/ssh
(test_ssh_credentials.py) sends them to real hosts; tests/node (test_node_bucket.py) runs the check."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from sbatch_gen.credentials import SecretEnv, bucket_check, secret_env
from sbatch_gen.loader import load_site
from sbatch_gen.metrics_options import MetricsOptions
from sbatch_gen.render import render_site
from sbatch_gen.xr_options import CrossRegion

from .conftest import REPO
from .script_parts import flat

CREDS = "cross_region.transport.credentials"


class P:
    """What secret_env reads of a profile."""

    def __init__(self, cross_region: CrossRegion, metrics: MetricsOptions | None = None):
        self.cross_region = cross_region
        self.metrics = metrics


def s3(**credentials) -> CrossRegion:
    return CrossRegion(enabled=True, transport={"kind": "s3", "bucket": "bkt", "credentials": credentials})


KEYS = {"access_key_id_env": "K", "secret_access_key_env": "S"}


def test_s3_keys_and_token_are_required():
    assert secret_env(P(s3(**KEYS, session_token_env="T"))) == [
        SecretEnv("K", f"{CREDS}.access_key_id_env", True),
        SecretEnv("S", f"{CREDS}.secret_access_key_env", True),
        SecretEnv("T", f"{CREDS}.session_token_env", True),
    ]


@pytest.mark.parametrize(
    "xr",
    [
        pytest.param(s3(profile="team_a"), id="shared-credentials-profile"),
        pytest.param(s3(), id="default-chain-instance-role"),
        pytest.param(s3(session_token_env="T"), id="token-without-keys-the-trainer-ignores"),
        pytest.param(CrossRegion(enabled=True), id="fs-transport"),
        pytest.param(
            CrossRegion(enabled=False, transport={"kind": "s3", "bucket": "bkt", "credentials": KEYS}),
            id="disabled",
        ),
    ],
)
def test_nothing_to_send(xr):
    assert secret_env(P(xr)) == []


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("online", [SecretEnv("WK", "metrics.wandb_api_key_env", True)]),
        ("auto", [SecretEnv("WK", "metrics.wandb_api_key_env", False)]),
        ("offline", []),
    ],
)
def test_wandb_key_by_mode(mode, want):
    m = MetricsOptions(sinks=["wandb"], wandb_mode=mode, wandb_api_key_env="WK")
    assert secret_env(P(CrossRegion(), m)) == want


def test_wandb_key_only_with_the_wandb_sink():
    assert secret_env(P(CrossRegion(), MetricsOptions(sinks=["tensorboard"]))) == []
    assert secret_env(P(CrossRegion(), None)) == []


def test_one_variable_named_twice_is_sent_once_and_required_if_either_requires_it():
    m = MetricsOptions(sinks=["wandb"], wandb_mode="auto", wandb_api_key_env="S")
    got = secret_env(P(s3(**KEYS), m))
    assert [s.name for s in got] == ["K", "S"]
    assert got[1].required


def test_bucket_check_settings():
    xr = CrossRegion(
        enabled=True,
        transport={
            "kind": "s3",
            "bucket": "llm-xr-mailbox",
            "prefix": "runs/a",
            "endpoint_url": "https://s3.eu.example:9000",
            "addressing_style": "path",
            "region_name": "eu-central-1",
            "credentials": {**KEYS, "session_token_env": "T"},
        },
    )
    assert bucket_check(xr, 7) == [
        ("s3_bucket", "llm-xr-mailbox"),
        ("s3_prefix", "runs/a"),
        ("s3_endpoint", "https://s3.eu.example:9000"),
        ("s3_addressing", "path"),
        ("s3_region", "eu-central-1"),
        ("s3_key_env", "K"),
        ("s3_secret_env", "S"),
        ("s3_token_env", "T"),
        ("s3_timeout_s", "7"),
    ]
    assert bucket_check(s3(profile="team_a"), 10) == [
        ("s3_bucket", "bkt"),
        ("s3_addressing", "auto"),
        ("s3_profile", "team_a"),
        ("s3_timeout_s", "10"),
    ]
    assert bucket_check(CrossRegion(enabled=True), 10) == []
    assert bucket_check(CrossRegion(), 10) == []


def test_every_preflight_setting_is_the_node_programs():
    from sbatch_gen import node_program

    xr = s3(**KEYS, session_token_env="T")
    xr = xr.model_copy(update={"transport": xr.transport.model_copy(update={"endpoint_url": "http://x:1"})})
    for name, _ in bucket_check(xr, 5):
        assert name in node_program.S3_SETTINGS and name in node_program.PREFLIGHT_SETTINGS


def launcher(*sets: str) -> str:
    (rendered,) = render_site(load_site(REPO / "sites", "ssh-local", list(sets)))
    return rendered.text


def bash_array(text: str, name: str) -> list[str]:
    """The array NAME of a render, as bash reads it."""
    start = text.index(f"\n{name}=(") + 1
    block = text[start : text.index("\n)\n", start) + 2]
    r = subprocess.run(
        ["bash", "-c", f'{block}\nprintf "%s\\0" "${{{name}[@]}}"'],
        capture_output=True,
        timeout=30,
        check=True,
    )
    return r.stdout.decode().split("\0")[:-1]


def test_the_launcher_names_the_secrets_and_the_bucket_check():
    text = launcher(
        "cross_region="
        + json.dumps(
            {
                "enabled": True,
                "transport": {
                    "kind": "s3",
                    "bucket": "llm-xr-mailbox",
                    "endpoint_url": "http://127.0.0.1:9000",
                    "credentials": {**KEYS, "session_token_env": "T"},
                },
            }
        ),
        "metrics=" + json.dumps({"sinks": ["wandb"], "wandb_api_key_env": "WK"}),
        "ssh.connect_timeout_s=7",
    )
    assert bash_array(text, "SECRET_ENV") == [
        "K", f"{CREDS}.access_key_id_env", "1",
        "S", f"{CREDS}.secret_access_key_env", "1",
        "T", f"{CREDS}.session_token_env", "1",
        "WK", "metrics.wandb_api_key_env", "0",
    ]  # fmt: skip
    assert bash_array(text, "BUCKET_CHECK") == [
        "s3_bucket=llm-xr-mailbox",
        "s3_endpoint=http://127.0.0.1:9000",
        "s3_addressing=auto",
        "s3_key_env=K",
        "s3_secret_env=S",
        "s3_token_env=T",
        "s3_timeout_s=7",
    ]


def test_a_site_without_secrets_renders_empty_settings():
    text = launcher()
    assert "\nSECRET_ENV=()  # none named\n" in text
    assert (
        "\nBUCKET_CHECK=()  # none: the preflight checks cross_region's bucket with the s3 transport only\n"
        in text
    )


def test_the_slurm_preflight_runs_the_bucket_check_on_every_node():
    """The Slurm jobs' preflight gets the same s3_* settings (within preflight.connect_timeout_s) as the
    SSH launcher's; a site on the fs transport gets none."""

    def preflight_args(site: str) -> list[str]:
        return bash_array(flat(render_site(load_site(REPO / "sites", site))[0].text), "PREFLIGHT_ARGS")

    eu = preflight_args("eu")
    assert [a for a in eu if a.startswith("s3_")] == [
        "s3_bucket=llm-xr-mailbox",
        "s3_prefix=runs/llm-xr-1",
        "s3_addressing=auto",
        "s3_region=eu-central-1",
        "s3_key_env=XR_S3_ACCESS_KEY_ID",
        "s3_secret_env=XR_S3_SECRET_ACCESS_KEY",
        "s3_timeout_s=60",
    ]
    assert not [a for a in preflight_args("local") if a.startswith("s3_")]


def _config(path, metrics: dict | None) -> str:
    """configs/tiny.yaml with ``metrics`` as its metrics section (None: without one), written to ``path``."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg.pop("metrics", None)
    if metrics is not None:
        cfg["metrics"] = metrics
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def test_the_launcher_sends_the_wandb_key_the_train_config_names(tmp_path):
    """A W&B key named only in the train config's metrics section (the profile has none, so that section
    decides the sinks) is in SECRET_ENV, named by its field and file; the profile's section wins over it, a
    trainer.args of its own or wandb_mode offline sends nothing; the section is an input of the render."""
    cfg = _config(
        tmp_path / "cfg.yaml", {"sinks": ["wandb"], "wandb_mode": "online", "wandb_api_key_env": "CK"}
    )
    text = launcher(f"trainer.config={cfg}")
    assert bash_array(text, "SECRET_ENV") == ["CK", f"metrics.wandb_api_key_env of trainer.config {cfg}", "1"]
    auto = _config(tmp_path / "auto.yaml", {"sinks": ["wandb", "tensorboard"]})
    assert bash_array(launcher(f"trainer.config={auto}"), "SECRET_ENV")[::2] == ["WANDB_API_KEY", "0"]
    profile = "metrics=" + json.dumps({"sinks": ["wandb"], "wandb_api_key_env": "WK"})
    assert bash_array(launcher(f"trainer.config={cfg}", profile), "SECRET_ENV")[0] == "WK"
    for quiet in (
        _config(tmp_path / "offline.yaml", {"sinks": ["wandb"], "wandb_mode": "offline"}),
        _config(tmp_path / "none.yaml", None),
    ):
        assert "\nSECRET_ENV=()  # none named\n" in launcher(f"trainer.config={quiet}")
    # the header's inputs sha256 covers the section: another key's name, another sha
    other = _config(
        tmp_path / "other.yaml", {"sinks": ["wandb"], "wandb_mode": "online", "wandb_api_key_env": "OK"}
    )
    sha = [
        re.search(r"inputs sha256: (\w+)", t).group(1) for t in (text, launcher(f"trainer.config={other}"))
    ]
    assert sha[0] != sha[1]


def test_validate_warns_where_the_train_configs_wandb_key_cannot_be_known_or_is_not_read(work, tmp_path):
    """An SSH site whose train config is not readable where validate (and render) run: its W&B key cannot be
    known, said in the warning's one line. A Slurm site whose readable config names a W&B key the job does not
    read (not in slurm.secrets, no profile metrics section): one warning line naming the variable."""
    from .conftest import sg

    r = sg("validate", "--site", "ssh-local", "--set", "trainer.config=configs/nowhere.yaml")
    assert r.code == 0, r.err
    (line,) = [x for x in r.err.splitlines() if "nowhere.yaml" in x]
    assert "a W&B key its metrics section names is not sent to the hosts" in line, line
    cfg = _config(
        work / "wandb.yaml", {"sinks": ["wandb"], "wandb_mode": "online", "wandb_api_key_env": "CK"}
    )
    r = sg("validate", "--site", "local", "--set", f"trainer.config={cfg}")
    assert r.code == 0, r.err
    (line,) = [x for x in r.err.splitlines() if "W&B" in x]
    assert line.startswith("note --set trainer.config=") and "warning: trainer.config:" in line, line
    assert "with the key in CK (its metrics.wandb_api_key_env), which the job does not read" in line, line
    named = ("--set", "slurm.secrets=[CK]", "--set", "slurm.secrets_file=~/.config/sbatch-gen/t.env")
    r = sg("validate", "--site", "local", "--set", f"trainer.config={cfg}", *named)
    assert r.code == 0 and "W&B" not in r.err, r.err
    assert "W&B" not in sg("validate", "--site", "ssh-local", "--set", f"trainer.config={cfg}").err


def test_launch_secrets_are_sent_required_after_the_ones_the_profile_names():
    """launch.secrets (a trainer of one's own's HF_TOKEN): in SECRET_ENV after the S3 keys and the W&B key,
    each required (1) and named by its field; a name the profile names already is sent once, as that field's."""
    xr = {"enabled": True, "transport": {"kind": "s3", "bucket": "bkt", "credentials": KEYS}}
    text = launcher(
        "cross_region=" + json.dumps(xr),
        "metrics=" + json.dumps({"sinks": ["wandb"], "wandb_api_key_env": "WK"}),
        "launch.secrets=[HF_TOKEN, K, SBG_OWN]",
    )
    assert bash_array(text, "SECRET_ENV") == [
        "K", f"{CREDS}.access_key_id_env", "1",
        "S", f"{CREDS}.secret_access_key_env", "1",
        "WK", "metrics.wandb_api_key_env", "0",
        "HF_TOKEN", "launch.secrets[0]", "1",
        "SBG_OWN", "launch.secrets[2]", "1",
    ]  # fmt: skip
    assert bash_array(launcher("launch.secrets=[HF_TOKEN]"), "SECRET_ENV") == [
        "HF_TOKEN", "launch.secrets[0]", "1",
    ]  # fmt: skip
    profile = load_site(REPO / "sites", "ssh-local", ["launch.secrets=[HF_TOKEN]"]).profile
    assert profile.secret_env() == [SecretEnv("HF_TOKEN", "launch.secrets[0]", True)]
