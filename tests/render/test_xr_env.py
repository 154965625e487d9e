"""cross_region as environment variables: for a trainer whose own command line (trainer.args without
{xr_args}) cannot take the --xr-* flags, the job exports the same options as SBATCH_GEN_XR_* variables
(sbatch_gen/xr_options.py: to_env / from_env; sbatch_gen/profiles/environment.py: the job environment of
both kinds). Checked as Python values, on the rendered blocks as bash evaluates them, on a whole Slurm job
run under bash with stub Slurm commands (batch_sandbox.py), and with shellcheck."""

from __future__ import annotations

import argparse
import re
import subprocess

import pytest
from pydantic import ValidationError

from sbatch_gen import xr_options
from sbatch_gen.errors import UserError
from sbatch_gen.launch import SLURM, trainer_argv
from sbatch_gen.loader import load_site
from sbatch_gen.profiles import container_env_names, job_environment
from sbatch_gen.render import render_site
from sbatch_gen.xr_options import CrossRegion, from_env, from_namespace, to_argv, to_env

from .batch_sandbox import ENV_DUMP_STUBS, prepare
from .conftest import REPO, sg

# A mailbox directory with what a shell would mangle: spaces, both quotes, backquote, backslash, glob
# characters, ';' and '&&', a non-ASCII letter ('$' and a leading '~' or '-' are refused by the model).
HOSTILE_ROOT = '/mnt/xr mail/it\'s "q" `x` \\ * ? [a] ; && é'

CASES = {
    "fs-defaults": CrossRegion(enabled=True),
    "fs-hostile-elastic": CrossRegion(
        enabled=True,
        run_id="r-1.x_y",
        region="us",
        regions=["eu", "us", "ap"],
        min_regions=2,
        grace_s=12.5,
        timeout_s=600,
        heartbeat_s=None,
        transport={"kind": "fs", "root": HOSTILE_ROOT},
    ),
    "fs-grad-switches": CrossRegion(
        enabled=True,
        region="b",
        regions=["a", "b"],
        sync="grad",
        inner_steps=1,
        outer_lr=0.1,
        outer_momentum=0.0,
        payload_dtype="fp32",
        shard_mb=0,
        threads=3,
        node_leaders=False,
        serialization="torch_save",
        outer_device="cpu",
        outer_device_max_gib=0.25,
        heartbeat_s=0.5,
        transport={"kind": "fs", "root": "relative/mailbox"},
    ),
    "s3-key-names": CrossRegion(
        enabled=True,
        region="eu",
        regions=["eu", "us"],
        transport={
            "kind": "s3",
            "bucket": "my.bucket-1",
            "prefix": "runs/x/",
            "endpoint_url": "http://127.0.0.1:9000/base",
            "addressing_style": "path",
            "region_name": "eu-central-1",
            "credentials": {
                "access_key_id_env": "MY_KEY_ID",
                "secret_access_key_env": "MY_SECRET",
                "session_token_env": "MY_TOKEN",
            },
        },
    ),
    "s3-profile": CrossRegion(
        enabled=True,
        transport={"kind": "s3", "bucket": "bkt", "credentials": {"profile": "team_a"}},
    ),
    "s3-default-chain": CrossRegion(enabled=True, transport={"kind": "s3", "bucket": "bkt", "prefix": ""}),
}


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    xr_options.add_arguments(parser)
    return parser.parse_args(argv)


# ---- to_env / from_env ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_environment_and_flags_round_trip_to_the_same_options(case):
    xr = CASES[case]
    assert from_env(to_env(xr)) == xr == from_namespace(_parse(to_argv(xr)))


@pytest.mark.parametrize("case", CASES)
def test_the_environment_says_what_the_flags_say_in_their_order(case):
    argv = to_argv(CASES[case])
    assert argv[0] == "--xr-enabled"
    pairs = list(zip(argv[1::2], argv[2::2], strict=True))
    expected = [("SBATCH_GEN_XR_ENABLED", "1")] + [
        ("SBATCH_GEN_XR_" + flag.removeprefix("--xr-").replace("-", "_").upper(), value)
        for flag, value in pairs
    ]
    assert list(to_env(CASES[case]).items()) == expected


def test_spelled_out_values():
    env = to_env(CASES["fs-hostile-elastic"])
    assert env["SBATCH_GEN_XR_REGIONS"] == "eu,us,ap"
    assert env["SBATCH_GEN_XR_HEARTBEAT_S"] == "none"
    assert env["SBATCH_GEN_XR_GRACE_S"] == "12.5"
    assert env["SBATCH_GEN_XR_ROOT"] == HOSTILE_ROOT
    assert to_env(CASES["s3-default-chain"])["SBATCH_GEN_XR_PREFIX"] == ""
    assert to_env(CASES["fs-grad-switches"])["SBATCH_GEN_XR_NODE_LEADERS"] == "false"
    assert set(to_env(CASES["s3-key-names"])) <= set(xr_options.env_names())


def test_disabled_is_no_environment_and_no_environment_is_disabled():
    off = CrossRegion(enabled=False, region="b", regions=["a", "b"], inner_steps=7)
    assert to_env(off) == {} and to_argv(off) == []
    assert from_env({}) == CrossRegion() and not from_env({}).enabled
    assert from_env({"PATH": "/bin", "SBATCH_GEN_STOP_FILE": "/x"}) == CrossRegion()


def test_other_names_are_ignored():
    env = {**to_env(CASES["fs-defaults"]), "PATH": "/usr/bin", "sbatch_gen_xr_region": "lower case"}
    assert from_env(env) == CASES["fs-defaults"]


@pytest.mark.parametrize(
    "value, enabled",
    [("1", True), ("true", True), ("yes", True), ("TRUE", True), ("0", False), ("false", False), ("no", False),
     ("", False)],
)  # fmt: skip
def test_enabled_spellings(value, enabled):
    env = {"SBATCH_GEN_XR_ENABLED": value, "SBATCH_GEN_XR_REGION": "b", "SBATCH_GEN_XR_REGIONS": "a,b"}
    xr = from_env(env)
    assert xr.enabled is enabled and xr.region == "b" and xr.regions == ["a", "b"]


@pytest.mark.parametrize("value", ["2", "on", "maybe", " 1"])
def test_enabled_that_is_not_a_boolean_is_an_error(value):
    with pytest.raises(ValueError) as e:
        from_env({"SBATCH_GEN_XR_ENABLED": value})
    assert not isinstance(e.value, ValidationError)
    assert str(e.value) == (
        f"SBATCH_GEN_XR_ENABLED: {value!r} is not a boolean (1, true or yes; 0, false, no or empty)"
    )


def test_an_unknown_name_is_an_error_with_a_suggestion_and_the_valid_names():
    with pytest.raises(ValueError) as e:
        from_env({"SBATCH_GEN_XR_ENABLED": "1", "SBATCH_GEN_XR_INNER_STEP": "5"})
    msg = str(e.value)
    known = ", ".join(xr_options.env_names())
    assert msg == (
        f"SBATCH_GEN_XR_INNER_STEP: unknown cross-region variable (did you mean SBATCH_GEN_XR_INNER_STEPS? "
        f"known: {known})"
    )
    assert "SBATCH_GEN_XR_ENABLED, SBATCH_GEN_XR_RUN_ID," in known and "SBATCH_GEN_XR_AWS_PROFILE" in known
    with pytest.raises(
        ValueError, match=r"^SBATCH_GEN_XR_QQQQQQQQQQQQQQQQQQ: unknown cross-region variable \(known: "
    ):
        from_env({"SBATCH_GEN_XR_QQQQQQQQQQQQQQQQQQ": "1"})


@pytest.mark.parametrize(
    "extra, loc",
    [
        ({"SBATCH_GEN_XR_INNER_STEPS": "zero"}, ("inner_steps",)),
        ({"SBATCH_GEN_XR_INNER_STEPS": "0"}, ("inner_steps",)),
        ({"SBATCH_GEN_XR_ROOT": "-x"}, ("transport", "fs", "root")),
        ({"SBATCH_GEN_XR_ROOT": "/a/$HOME"}, ("transport", "fs", "root")),
        ({"SBATCH_GEN_XR_TRANSPORT": "ftp"}, ("transport",)),
        (
            {"SBATCH_GEN_XR_TRANSPORT": "s3", "SBATCH_GEN_XR_BUCKET": "Bad_Bucket"},
            ("transport", "s3", "bucket"),
        ),
        ({"SBATCH_GEN_XR_HEARTBEAT_S": "nothing"}, ("heartbeat_s",)),
        ({"SBATCH_GEN_XR_REGIONS": "a,b c"}, ("regions", 1)),
        ({"SBATCH_GEN_XR_REGION": "zz"}, ()),  # not in regions: a check between fields
    ],
)
def test_a_bad_value_is_a_validation_error(extra, loc):
    with pytest.raises(ValidationError) as e:
        from_env({"SBATCH_GEN_XR_ENABLED": "1", **extra})
    assert e.value.errors()[0]["loc"] == loc
    # the flags say the same
    argv = ["--xr-enabled"]
    for name, value in extra.items():
        argv.append("--xr-" + name.removeprefix("SBATCH_GEN_XR_").lower().replace("_", "-") + "=" + value)
    with pytest.raises(ValidationError) as f:
        from_namespace(_parse(argv))
    plain = {"include_url": False, "include_context": False}
    assert f.value.errors(**plain) == e.value.errors(**plain)


def test_flag_of_an_error_location():
    assert xr_options.flag_of(("inner_steps",)) == "--xr-inner-steps"
    assert xr_options.flag_of(("regions", 1)) == "--xr-regions"
    assert xr_options.flag_of(("transport",)) == "--xr-transport"
    assert xr_options.flag_of(("transport", "fs", "root")) == "--xr-root"
    assert xr_options.flag_of(("transport", "s3", "region_name")) == "--xr-s3-region"
    assert xr_options.flag_of(("transport", "s3", "credentials", "profile")) == "--xr-aws-profile"
    assert xr_options.flag_of(("transport", "s3", "credentials")) is None  # between the credentials
    assert xr_options.flag_of(()) is None
    assert xr_options.env_name("--xr-s3-region") == "SBATCH_GEN_XR_S3_REGION"


# ---- the render -------------------------------------------------------------------------------------

XR_SET = (
    "cross_region={enabled: true, run_id: r-7, region: us, regions: [eu, us], min_regions: 1, heartbeat_s: null, "
    "grace_s: 30, transport: {kind: fs, root: '" + HOSTILE_ROOT.replace("'", "''") + "'}}"
)
OWN_ARGS = "trainer={script: bin/my train.py, args: [--cfg, conf.toml, '--out={run_dir}/x']}"
COMMENT = "cross_region, for the trainer as variables: trainer.args has no {xr_args}"


def _sites(*sets: str):
    return tuple(load_site(REPO / "sites", site, list(sets)) for site in ("local", "ssh-local"))


def _profiles(*sets: str):
    return tuple(s.profile for s in _sites(*sets))


def _xr_vars(p) -> list[tuple[str, str]]:
    return [(n, v) for b in job_environment(p) for n, v in b.vars if n.startswith("SBATCH_GEN_XR_")]


def test_the_profile_loads_and_the_options_go_to_the_environment_not_the_argv():
    for p in _profiles(OWN_ARGS, XR_SET):
        assert p.cross_region.transport.root == HOSTILE_ROOT
        blocks = [b for b in job_environment(p) if b.key == COMMENT]
        assert len(blocks) == 1 and list(blocks[0].vars) == list(to_env(p.cross_region).items())
        assert not any(str(w).startswith("--xr-") for w in trainer_argv(p, SLURM, "x"))
    slurm, _ = _profiles(OWN_ARGS, XR_SET)
    assert set(to_env(slurm.cross_region)) <= set(container_env_names(slurm))


@pytest.mark.parametrize(
    "sets",
    [
        [XR_SET],  # the fixed flags carry --xr-*
        ["trainer={script: t.py, args: [--x, '{xr_args}']}", XR_SET],
        [OWN_ARGS],  # cross_region disabled
    ],
)
def test_no_variables_when_the_flags_carry_the_options_or_it_is_disabled(sets):
    for p in _profiles(*sets):
        assert _xr_vars(p) == []
        assert all(b.key != COMMENT for b in job_environment(p))


def _bash_env(code: str) -> dict[str, str]:
    """The environment after bash runs ``code`` from an empty one."""
    r = subprocess.run(
        ["env", "-i", "PATH=/usr/bin:/bin", "bash", "-c", "set -eu\n" + code + "\nenv -0"],
        capture_output=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr.decode()
    return dict(x.split("=", 1) for x in r.stdout.decode().split("\0") if x)


def _only_xr(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("SBATCH_GEN_XR_")}


def test_bash_reads_the_rendered_blocks_back_as_the_profiles_options():
    slurm_site, ssh_site = _sites(OWN_ARGS, XR_SET)
    slurm, ssh = slurm_site.profile, ssh_site.profile
    assert slurm.cross_region == ssh.cross_region
    sb, sh = render_site(slurm_site)[0].text, render_site(ssh_site)[0].text
    start = "# ---- environment of every job step"
    s_block = sb[sb.index(start) : sb.index("\n# ---- python_env", sb.index(start))]
    assert f"\n# {COMMENT} (always)\nexport SBATCH_GEN_XR_ENABLED=1\n" in s_block
    h_block = sh[sh.index("\nNODE_ENV=(\n") : sh.index("\n)\n", sh.index("\nNODE_ENV=(\n")) + 3]
    assert f"\n  # {COMMENT} (always)\n  'SBATCH_GEN_XR_ENABLED=1'\n" in h_block
    # the SSH launcher exports the array on every node before torchrun, as the template does
    for env in (_bash_env(s_block), _bash_env(h_block + 'export "${NODE_ENV[@]}"')):
        got = _only_xr(env)
        assert got == to_env(slurm.cross_region)
        assert got["SBATCH_GEN_XR_ROOT"] == HOSTILE_ROOT
        assert from_env(got) == slurm.cross_region


def test_a_slurm_job_step_gets_the_options_in_its_environment(tmp_path):
    site, _ = _sites(OWN_ARGS, XR_SET)
    slurm = site.profile
    job, env, stub_dir = prepare(
        tmp_path,
        ENV_DUMP_STUBS,
        "ok",
        script=render_site(site)[0].text,
    )
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    step = dict(x.split("=", 1) for x in (stub_dir / "step.env").read_bytes().decode().split("\0") if x)
    assert _only_xr(step) == to_env(slurm.cross_region)
    assert from_env(step) == slurm.cross_region


@pytest.mark.slow  # shellcheck on the renders
def test_the_renders_pass_bash_n_and_both_shellchecks(work):
    from .test_stop_protocol_lint import SHELLCHECKS

    r = sg(
        "render", "--site", "local", "--site", "ssh-local", "--out", "o", "--set", OWN_ARGS, "--set", XR_SET
    )
    assert r.code == 0, r.err
    assert len(SHELLCHECKS) == 2, SHELLCHECKS
    for name in ("local.sbatch", "ssh-local.sh"):
        path = work / "o" / name
        assert "SBATCH_GEN_XR_ROOT=" in path.read_text()
        p = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert p.returncode == 0, f"bash -n {path}:\n{p.stderr}"
        for sc in SHELLCHECKS:
            p = subprocess.run([sc, "-x", str(path)], capture_output=True, text=True)
            assert p.returncode == 0, f"{sc} {path}:\n{p.stdout}{p.stderr}"


# ---- extra_env and the schema -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["SBATCH_GEN_XR_REGION", "SBATCH_GEN_XR_ENABLED", "SBATCH_GEN_XR_ANYTHING"])
def test_extra_env_may_not_set_the_variables(work, name):
    local = work / "sites" / "local.yaml"
    local.write_text(local.read_text() + f"\nextra_env:\n  {name}: x\n")
    line = next(i for i, t in enumerate(local.read_text().splitlines(), 1) if t.startswith(f"  {name}:"))
    r = sg("render", "--site", "local", "--out", "o")
    assert r.code == 2 and "Traceback" not in r.err
    assert r.err == (
        f"sbatch-gen: sites/local.yaml:{line}: extra_env.{name}: {name}: SBATCH_GEN_XR_* variables are set by "
        "sbatch-gen from cross_region; set it there\n"
    )


def test_extra_env_may_set_none_of_the_names_to_env_writes():
    for name in xr_options.env_names():
        with pytest.raises(UserError) as e:
            load_site(REPO / "sites", "local", [f"extra_env={{{name}: x}}"])
        assert f"{name}: SBATCH_GEN_XR_* variables are set by sbatch-gen from cross_region" in str(e.value)


def test_the_schema_says_what_happens_without_xr_args(work):
    import json

    r = sg("schema")
    assert r.code == 0
    doc = json.loads(r.out)["$defs"]["Trainer"]["properties"]["args"]["description"]
    assert re.search(r"With cross_region enabled and no \{xr_args\}, the job exports the same options", doc)
    assert "SBATCH_GEN_XR_FOO_BAR=VALUE" in doc and "cross_region_from_env" in doc
