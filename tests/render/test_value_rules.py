"""Value rules (issue 12): values that validated but would make the reviewed script mean something other
than what a reviewer reads, or put a credential into out/. Each is refused with exit 2, one line
`file:line: field: message`, no traceback, nothing written."""

from __future__ import annotations

import re

import pytest

from .conftest import edit_site, sg

AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def _refused(work, site: str, field: str, *needles: str, **changes) -> str:
    edit_site(work / "sites" / f"{site}.yaml", **changes)
    r = sg("render", "--site", site, "--out", "o")
    assert r.code == 2, (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.err, r.err
    assert re.match(rf"sbatch-gen: sites/{site}\.yaml:\d+: {re.escape(field)}: \S", lines[0]), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    assert not (work / "o").exists()
    return lines[0]


def _accepted(work, site: str, **changes) -> str:
    edit_site(work / "sites" / f"{site}.yaml", **changes)
    r = sg("render", "--site", site, "--out", "o")
    assert r.code == 0, r.err
    return r.out


# ---- C1 controls and Unicode bidi controls, in every string ---------------------------------------

_INVISIBLE = ["\u202e", "\u2066", "\u200f", "\u061c", "\u0085", "\u009b"]


@pytest.mark.parametrize("char", _INVISIBLE, ids=[f"U+{ord(c):04X}" for c in _INVISIBLE])
@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("description", lambda v: {"description": f"ok {v}"}),
        ("paths.run_dir", lambda v: {"paths.run_dir": f"runs/{v}x"}),
        ("trainer.resume", lambda v: {"trainer.resume": f"ckpt/{v}1"}),
        ("trainer.extra_args[1]", lambda v: {"trainer.extra_args": ["--a", f"b{v}"]}),
        ("extra_env.MY_SETTING", lambda v: {"extra_env": {"MY_SETTING": f"x{v}y"}}),
        (
            "cross_region.transport.root",
            lambda v: {"cross_region.transport": {"kind": "fs", "root": f"mb{v}"}},
        ),
    ],
)
def test_invisible_characters_are_refused_everywhere(work, field, changes, char):
    _refused(work, "local", field, f"U+{ord(char):04X}", "control characters", **changes(char))


def test_invisible_characters_in_an_ssh_host_note(work):
    _refused(
        work,
        "lab",
        "hosts[5].note",
        "U+202E",
        hosts=[
            "lab-gpu01",
            "lab-gpu02",
            "lab-gpu03",
            "lab-gpu04",
            "lab-gpu05",
            {"name": "lab-gpu06", "enabled": False, "note": "GPU 5 \u202eok"},
        ],
    )


# ---- '$' in the mailbox root ----------------------------------------------------------------------


def test_dollar_in_transport_root(work):
    _refused(
        work,
        "local",
        "cross_region.transport.root",
        "contains '$'",
        **{"cross_region.transport": {"kind": "fs", "root": "$SCRATCH/mailbox"}},
    )


# ---- a leading '-' where the value becomes a command's argument ------------------------------------


@pytest.mark.parametrize(
    ("field", "changes", "needle"),
    [
        ("python_env.modules[1]", {"python_env.modules": ["cuda/12.4", "--force"]}, "module load"),
        ("python_env.torch_spec", {"python_env.torch_spec": "-rreq.txt"}, "pip install"),
        ("python_env.python", {"python_env.python": "-i"}, "starts with '-'"),
        ("paths.data", {"paths.data": "-data"}, "write ./-data"),
        ("trainer.config", {"trainer.config": "--help"}, "starts with '-'"),
        ("network.socket_ifname", {"network.socket_ifname": "-eth0"}, "starts with '-'"),
        (
            "cross_region.transport.root",
            {"cross_region.transport": {"kind": "fs", "root": "-mb"}},
            "starts with '-'",
        ),
        (
            "cross_region.transport.prefix",
            {"cross_region.transport": {"kind": "s3", "bucket": "my-bucket", "prefix": "-p"}},
            "starts with '-'",
        ),
    ],
)
def test_leading_dash_is_refused_where_it_would_be_an_option(work, field, changes, needle):
    _refused(work, "local", field, needle, **changes)


def test_leading_dash_in_an_ssh_identity_file(work):
    _refused(
        work, "ssh-local", "ssh.identity_file", "starts with '-'", **{"ssh.identity_file": "-oProxyCommand"}
    )


# ---- extra_env names that change the shell, the loader or the interpreter ---------------------------


@pytest.mark.parametrize(
    "name",
    [
        "SHELLOPTS",
        "BASHOPTS",
        "BASH_ENV",
        "ENV",
        "IFS",
        "PS4",
        "PROMPT_COMMAND",
        "BASH_FUNC_module",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "GLIBC_TUNABLES",
        "PYTHONSTARTUP",
        "PYTHONHOME",
        "CDPATH",
    ],
)
def test_extra_env_names_that_change_how_things_run(work, name):
    _refused(work, "local", f"extra_env.{name}", name, extra_env={name: "x"})


def test_loader_variables_need_an_explicit_opt_in(work):
    line = _refused(
        work,
        "local",
        "extra_env.LD_LIBRARY_PATH",
        "extra_env_allow: [LD_LIBRARY_PATH]",
        extra_env={"LD_LIBRARY_PATH": "/opt/nccl/lib"},
    )
    assert "dynamic loader" in line
    _accepted(
        work, "local", extra_env={"LD_LIBRARY_PATH": "/opt/nccl/lib"}, extra_env_allow=["LD_LIBRARY_PATH"]
    )
    assert (
        "\nexport LD_LIBRARY_PATH=/opt/nccl/lib  # extra_env, the loader's (extra_env_allow) (always)\n"
        in ((work / "o" / "local.sbatch").read_text())
    )  # always set


def test_an_opt_in_for_an_unset_variable_is_refused(work):
    _refused(work, "local", "extra_env_allow[0]", "does not set it", extra_env_allow=["LD_PRELOAD"])


def test_ld_audit_cannot_be_opted_in(work):
    _refused(
        work,
        "local",
        "extra_env_allow[0]",
        "LD_LIBRARY_PATH",
        extra_env={"LD_AUDIT": "x"},
        extra_env_allow=["LD_AUDIT"],
    )


# ---- abbreviated long options in slurm.extra_directives --------------------------------------------


@pytest.mark.parametrize(
    ("directive", "managed", "instead"),
    [
        ("--outp=x.log", "--output", "set paths.log_dir"),
        ("--output=x.log", None, "set paths.log_dir"),
        ("--sig=USR1@60", "--signal", "set preemption.signal and preemption.lead_time_s"),
        ("--no-req", "--no-requeue", "preemption.max_requeues_without_progress"),
        ("--part=debug", "--partition", "set slurm.partition"),
        ("--account=x", None, "set slurm.account"),
        ("--mem=4G", None, "set slurm.mem"),
        ("--tasks=4", None, "slurm.gpus_per_node (torchrun.procs_per_node on a CPU site)"),
        ("--workdir=/tmp", None, "the directory it is submitted from"),
        ("--export=NONE", None, "extra_env"),
        (
            "--gpus-per-n=2",
            "--gpus-per-node",
            "set slurm.gpus_per_node, slurm.gpu_type and slurm.gpu_request",
        ),
        ("--gres=gpu:2", None, "set slurm.gpus_per_node, slurm.gpu_type and slurm.gpu_request"),
    ],
)
def test_managed_directives_are_refused_naming_the_field_that_sets_them(work, directive, managed, instead):
    line = _refused(work, "local", "slurm.extra_directives[0]", **{"slurm.extra_directives": [directive]})
    name = directive.split("=")[0]
    assert (
        f"sbatch-gen sets {name} itself: " in line
        if managed is None
        else f"abbreviation of {managed}" in line
    )
    assert instead in line, line


def test_abbreviated_directives_must_be_written_out(work):
    _refused(
        work,
        "local",
        "slurm.extra_directives[1]",
        "--mail-type",
        "in full",
        **{"slurm.extra_directives": ["--mail-type=FAIL", "--mail-t=END"]},
    )
    _accepted(work, "local", **{"slurm.extra_directives": ["--mail-type=FAIL", "--comment=x"]})
    assert "#SBATCH --mail-type=FAIL\n" in (work / "o" / "local.sbatch").read_text()


# ---- integers are integers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("site", "field", "value"),
    [
        ("local", "slurm.nodes", True),
        ("local", "slurm.nodes", "2"),
        ("local", "slurm.cpus_per_task", 2.0),
        ("eu", "slurm.gpus_per_node", True),
        ("local", "torchrun.max_restarts", False),
        ("local", "preemption.max_requeues_without_progress", True),
        ("lab", "launch.max_attempts", True),
        ("lab", "node.cpus", True),
        ("local", "cross_region.inner_steps", True),
        ("local", "cross_region.min_regions", True),
        ("local", "cross_region.outer_lr", True),
    ],
)
def test_yaml_booleans_and_strings_are_not_integers(work, site, field, value):
    _refused(work, site, field, "got", **{field: value})


def test_nodes_yes_in_yaml(work):
    local = work / "sites" / "local.yaml"
    local.write_text(local.read_text().replace("  nodes: 2\n", "  nodes: yes\n"))
    r = sg("render", "--site", "local", "--out", "o")
    line = 1 + local.read_text().splitlines().index("  nodes: yes")
    assert r.code == 2 and f"sites/local.yaml:{line}: slurm.nodes: " in r.err and "YAML boolean" in r.err, (
        r.err
    )
    assert not (work / "o").exists()


# ---- credentials ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "WANDB_API_KEY",
        "GITHUB_TOKEN",
        "GH_TOKEN",
        "MY_SERVICE_PASSWORD",
        "OPENAI_API_KEY",
    ],
)
def test_credential_variables_are_refused_in_extra_env(work, name):
    line = _refused(
        work, "local", f"extra_env.{name}", "credential", "<redacted>", extra_env={name: "s3cr3t-value"}
    )
    assert "s3cr3t-value" not in line


@pytest.mark.parametrize(
    ("field", "changes", "secret"),
    [
        ("extra_env.MY_SETTING", {"extra_env": {"MY_SETTING": AWS_SECRET}}, AWS_SECRET),
        ("extra_env.MY_SETTING", {"extra_env": {"MY_SETTING": f"id={AWS_KEY_ID}"}}, AWS_KEY_ID),
        (
            "trainer.extra_args[1]",
            {"trainer.extra_args": ["--token", "hf_" + "aB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gI3"]},
            "hf_aB3",
        ),
        ("paths.data", {"paths.data": f"/data/{AWS_KEY_ID}"}, AWS_KEY_ID),
        (
            "cross_region.transport.credentials.access_key_id_env",
            {
                "cross_region.transport": {
                    "kind": "s3",
                    "bucket": "my-bucket",
                    "credentials": {"access_key_id_env": AWS_KEY_ID, "secret_access_key_env": "XR_SECRET"},
                }
            },
            AWS_KEY_ID,
        ),
        (
            "cross_region.transport.credentials.secret_access_key_env",
            {
                "cross_region.transport": {
                    "kind": "s3",
                    "bucket": "my-bucket",
                    "credentials": {
                        "access_key_id_env": "XR_KEY_ID",
                        "secret_access_key_env": "wJalrXUtnFEMI7K7MDENG0bPxRfiCYEXAMPLEKEY",
                    },
                }
            },
            "wJalrXUtnFEMI7K7",
        ),
        ("slurm.partition", {"slurm.partition": AWS_KEY_ID}, AWS_KEY_ID),
        ("slurm.nodes", {"slurm.nodes": AWS_KEY_ID}, AWS_KEY_ID),
    ],
)
def test_key_shaped_values_are_refused_without_echoing_them(work, field, changes, secret):
    line = _refused(work, "local", field, "<redacted>", "looks like", **changes)
    assert secret not in line


def test_a_password_in_a_urls_user_part_is_refused_by_name(work):
    line = _refused(
        work,
        "local",
        "cross_region.transport.endpoint_url",
        "<redacted>",
        "a URL with a password in its user part",
        **{
            "cross_region.transport": {
                "kind": "s3",
                "bucket": "my-bucket",
                "endpoint_url": "https://alice:hunter2secret@s3.example.org",
            }
        },
    )
    assert "hunter2secret" not in line and "alice" not in line


def test_every_bad_field_is_reported_in_one_run_none_echoing_a_credential(work):
    """A credential-shaped value no longer hides the profile's other problems: each is one line, in one run;
    the placeholder that stands in for the refused value adds no line of its own."""
    edit_site(
        work / "sites" / "local.yaml",
        **{
            "slurm.partition": "bad partition!",
            "cross_region.transport": {
                "kind": "s3",
                "bucket": "b",
                "endpoint_url": "https://user:pa55word@host",
                "credentials": {"access_key_id_env": "XR_KEY_ID", "secret_access_key_env": AWS_SECRET},
            },
        },
    )
    r = sg("validate")
    assert r.code == 2 and "Traceback" not in r.err, r.err
    lines = [ln for ln in r.err.splitlines() if "sites/local.yaml" in ln]
    fields = [re.match(r"sbatch-gen: sites/local\.yaml:\d+: (\S+):", ln).group(1) for ln in lines]
    assert fields == [
        "slurm.partition",
        "cross_region.transport.bucket",
        "cross_region.transport.endpoint_url",
        "cross_region.transport.credentials.secret_access_key_env",
    ], r.err
    assert "pa55word" not in r.err and AWS_SECRET not in r.err and "redacted" in lines[2]


def test_credential_lookalikes_that_are_not_keys_pass(work):
    # A git commit id (40 hex digits), a long path and the *names* of the variables holding the keys.
    _accepted(
        work,
        "local",
        **{
            "trainer.extra_args": ["--git-rev", "0123456789abcdef0123456789abcdef01234567"],
            "paths.data": "/Data/Users2/projects/myproject/datasets",
            "cross_region.transport": {
                "kind": "s3",
                "bucket": "my-bucket",
                "credentials": {
                    "access_key_id_env": "XR_S3_ACCESS_KEY_ID",
                    "secret_access_key_env": "XR_S3_SECRET_ACCESS_KEY",
                },
            },
        },
    )


# ---- GPU counts the hardware cannot have -----------------------------------------------------------


@pytest.mark.parametrize(("gpu_type", "count", "most"), [("h200", 9, 8), ("H100", 16, 8), ("gh200", 5, 4)])
def test_more_gpus_than_the_gpu_type_has_per_node(work, gpu_type, count, most):
    _refused(
        work,
        "eu",
        "slurm.gpus_per_node",
        f"at most {most}",
        **{"slurm.gpu_type": gpu_type, "slurm.gpus_per_node": count, "nccl.ib_hca": []},
    )


def test_gpu_types_not_in_the_table_keep_the_general_limit(work):
    _accepted(work, "eu", **{"slurm.gpu_type": "l40s", "slurm.gpus_per_node": 10})
