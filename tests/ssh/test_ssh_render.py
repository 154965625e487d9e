"""kind: ssh profiles: golden renders, lint, determinism, validation errors with file:line:field, and
hostile values that reach torchrun on every host exactly as written (through bash and ssh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from sshkit import free_port, probe_venv

pytestmark = pytest.mark.slow  # shellcheck on every render

REPO = Path(__file__).resolve().parents[2]
SG = str(REPO / ".venv" / "bin" / "sbatch-gen")
SSH_SITES = ["lab", "ssh-local"]


def sg(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([SG, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def lint(path: Path) -> None:
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["shellcheck", "-x", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, f"shellcheck {path}:\n{r.stdout}{r.stderr}"


@pytest.fixture
def sites(tmp_path) -> Path:
    """A copy of sites/ to edit."""
    d = tmp_path / "sites"
    shutil.copytree(REPO / "sites", d)
    return d


def edit(path: Path, **changes) -> None:
    """Set dotted keys (a__b -> a.b) in a YAML site file."""
    data = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        *parents, last = key.split("__")
        cur = data
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[last] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


# ---- golden renders and lint ---------------------------------------------------------------------


def test_committed_ssh_renders_are_current_and_lint_clean():
    r = sg("diff", *[a for s in SSH_SITES for a in ("--site", s)])
    assert r.returncode == 0, r.stdout + r.stderr
    for s in SSH_SITES:
        lint(REPO / "out" / f"{s}.sh")


def test_lab_launcher_pins_the_interface_and_disables_p2p_and_ib():
    text = (REPO / "out" / "lab.sh").read_text()
    for line in (
        # the profile's values are defaults a submit-time value overrides
        '"NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME-bond0}"',
        '"GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME-bond0}"',
        '"NCCL_P2P_DISABLE=${NCCL_P2P_DISABLE-1}"',
        '"NCCL_IB_DISABLE=${NCCL_IB_DISABLE-1}"',
        '"TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING-1}"',
        '"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC-300}"',
        "IFNAME=bond0",
        "NPROC_PER_NODE=8",
        "COOLDOWN_S=900",
    ):
        assert line in text, line
    hosts = text[text.index("HOSTS=(") : text.index("\n)", text.index("HOSTS=("))]
    assert [h.split()[0] for h in hosts.splitlines()[1:]] == [f"lab-gpu0{i}" for i in range(1, 6)]
    assert "# hosts[5] left out (enabled: false): lab-gpu06" in text


def test_every_option_renders_lint_clean_and_deterministic(sites, tmp_path):
    f = sites / "ssh-local.yaml"
    edit(
        f,
        python_env={
            "kind": "conda",
            "conda_sh": "/opt/conda/etc/profile.d/conda.sh",
            "name": "xr",
            "modules": ["cuda/12.4", "nccl/2.21"],
        },
        node__gpus=4,
        topology={"numa_binding": "node"},
        nccl={"ib_hca": ["mlx5_0", "mlx5_1"], "ib_gid_index": 3, "debug_subsys": "INIT,NET"},
        ssh__user="train",
        ssh__options=["ProxyJump=bastion", "SetEnv=NOTE=a`b`$c"],
        trainer__extra_args=["--note", 'it\'s a "test" with $HOME and `date` *'],
        trainer__max_steps=5,
        extra_env={"WEIRD": "a b;c|d'e\"f$g`h`"},
        paths__data="/data/it's here",
        cross_region={
            "enabled": True,
            "region": "eu",
            "regions": ["eu", "us"],
            "transport": {"kind": "fs", "root": "/mnt/x r/mail box"},
        },
    )
    data = yaml.safe_load(f.read_text())
    del data["torchrun"]["procs_per_node"]
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    outs = []
    for n in range(2):
        r = sg("render", "--sites-dir", str(sites), "--site", "ssh-local", "--out", str(tmp_path / f"o{n}"))
        assert r.returncode == 0, r.stderr
        outs.append((tmp_path / f"o{n}" / "ssh-local.sh").read_bytes())
    assert outs[0] == outs[1]
    lint(tmp_path / "o0" / "ssh-local.sh")
    text = outs[0].decode()
    assert "MODULES=(cuda/12.4 nccl/2.21)" in text
    assert "NUMA_BINDING=node" in text and '"NCCL_IB_HCA=${NCCL_IB_HCA-=mlx5_0,mlx5_1}"' in text


def test_one_field_changes_only_its_line(sites, tmp_path):
    a = sg("render", "--sites-dir", str(sites), "--site", "lab", "--out", str(tmp_path / "a"))
    edit(sites / "lab.yaml", launch__cooldown_s=60)
    b = sg("render", "--sites-dir", str(sites), "--site", "lab", "--out", str(tmp_path / "b"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    old = (tmp_path / "a" / "lab.sh").read_text().splitlines()
    new = (tmp_path / "b" / "lab.sh").read_text().splitlines()
    changed = [(x, y) for x, y in zip(old, new, strict=True) if x != y]
    assert [y for _, y in changed][1:] == ["COOLDOWN_S=60  # launch.cooldown_s"]
    assert changed[0][1].startswith("#   inputs sha256: ")


# ---- validation errors: file, line, field ------------------------------------------------------------

BASE = """kind: ssh
hosts: [a, b]
node: {gpus: 0, cpus: 2}
network: {socket_ifname: lo}
paths: {run_dir: runs/x}
trainer: {config: c.yaml}
torchrun: {procs_per_node: 1}
"""


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            BASE.replace("hosts: [a, b]", "hosts:\n  - a\n  - a"),
            "sites/bad.yaml:4: hosts[1].name: host 'a' is listed twice",
        ),
        (
            BASE.replace("hosts: [a, b]", "hosts:\n  - name: a\n    enabled: false\n  - b"),
            "sites/bad.yaml:4: hosts[0].enabled: the first host runs the launcher and node 0",
        ),
        (
            BASE.replace("hosts: [a, b]", "hosts: [a, '-oProxyCommand=x']"),
            "sites/bad.yaml:2: hosts[1].name: invalid host name",
        ),
        (
            BASE.replace("network: {socket_ifname: lo}\n", ""),
            "sites/bad.yaml:1: network.socket_ifname: required for kind ssh",
        ),
        (
            BASE + "ssh:\n  options: [Port=2222]\n",
            "sites/bad.yaml:9: ssh.options[0]: ssh option Port: set ssh.port",
        ),
        (
            BASE + "ssh:\n  prot: 22\n",
            "sites/bad.yaml:9: ssh.prot: unknown key 'prot' (valid keys: user, port",
        ),
        (
            BASE + "launch:\n  cooldown_s: soon\n",
            "sites/bad.yaml:9: launch.cooldown_s: Input should be a valid integer",
        ),
        (
            BASE.replace("torchrun: {procs_per_node: 1}\n", ""),
            "sites/bad.yaml:1: torchrun.procs_per_node: required on a CPU site",
        ),
        # launch.secrets: slurm.secrets' name rules, by the same validator
        (
            BASE + "launch:\n  secrets: [HF_TOKEN, 1HF]\n",
            "sites/bad.yaml:9: launch.secrets[1]: invalid environment variable name '1HF'",
        ),
        (
            BASE + "launch:\n  secrets: [HF_TOKEN, SBATCH_GEN_TAG]\n",
            "sites/bad.yaml:9: launch.secrets[1]: SBATCH_GEN_TAG: the launcher sets it",
        ),
        (
            BASE + "launch:\n  secrets: [OMP_NUM_THREADS]\n",
            "sites/bad.yaml:9: launch.secrets[0]: OMP_NUM_THREADS: the profile sets it",
        ),
        (
            BASE + "launch:\n  secrets: [HF_TOKEN, HF_TOKEN]\n",
            "sites/bad.yaml:9: launch.secrets[1]: HF_TOKEN is named twice (first at launch.secrets[0])",
        ),
        # extra_env refuses a credential, pointing to this kind's own key
        (
            BASE + "extra_env:\n  HF_TOKEN: x\n",
            "sites/bad.yaml:9: extra_env.HF_TOKEN: HF_TOKEN holds a credential (value <redacted>): it would be "
            "written into out/, which is committed; the SSH launcher sends it to every host over ssh's stdin "
            "instead: name it in launch.secrets (its value in the launching shell's environment)",
        ),
    ],
)
def test_bad_profiles_name_file_line_and_field(tmp_path, body, expected):
    from sbatch_gen.errors import UserError
    from sbatch_gen.loader import load_site

    (tmp_path / "sites").mkdir()
    (tmp_path / "sites" / "bad.yaml").write_text(body)
    with pytest.raises(UserError) as e:
        load_site(tmp_path / "sites", "bad")
    msg = "\n".join(e.value.messages)
    assert expected.replace("sites/bad.yaml", str(tmp_path / "sites" / "bad.yaml")) in msg, msg


def test_bad_profile_exits_2_without_traceback(tmp_path):
    (tmp_path / "sites").mkdir()
    (tmp_path / "sites" / "bad.yaml").write_text(BASE.replace("hosts: [a, b]", "hosts: [a, a]"))
    r = sg("validate", "--sites-dir", "sites", "--site", "bad", cwd=tmp_path)
    assert r.returncode == 2
    assert "sites/bad.yaml:2: hosts[1].name: host 'a' is listed twice" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ---- hostile values, end to end through bash and ssh -------------------------------------------------


def test_hostile_values_reach_torchrun_on_every_host_exactly(sshd, tmp_path, clean_env):
    from sbatch_gen.loader import load_site
    from sbatch_gen.xr_options import to_argv

    sites = tmp_path / "sites"
    sites.mkdir()
    shutil.copy(REPO / "sites" / "ssh-local.yaml", sites)
    hostile = 'it\'s a "test" with $HOME, `date`, * and \\ ;|&'
    venv = probe_venv(tmp_path / "probe venv")
    port = free_port()
    edit(
        sites / "ssh-local.yaml",
        ssh__port=sshd.port,
        ssh__identity_file=str(sshd.identity),
        ssh__options=sshd.options(),
        python_env__path=str(venv),
        paths__code_dir=str(REPO),
        torchrun__rdzv_port=port,
        paths__run_dir="runs/it's `here`",
        paths__data="data `x` y",
        trainer__config="cfg `1`.yaml",
        trainer__extra_args=["--note", hostile, ""],
        trainer__max_steps=7,
        extra_env={"WEIRD": hostile, "EMPTY": ""},
        launch__stop_file="STOP it's",
        cross_region={
            "enabled": True,
            "region": "eu",
            "regions": ["eu", "us"],
            "transport": {"kind": "fs", "root": "/mnt/x r/mail box `y`"},
        },
    )
    r = sg("render", "--sites-dir", str(sites), "--site", "ssh-local", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    script = tmp_path / "out" / "ssh-local.sh"
    lint(script)
    launch_dir = tmp_path / "launch dir"
    launch_dir.mkdir()
    (launch_dir / "cfg `1`.yaml").write_text("{}\n")  # the preflight checks both exist
    (launch_dir / "data `x` y").mkdir()
    p = subprocess.run(["bash", str(script)], cwd=launch_dir, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr

    xr = to_argv(load_site(sites, "ssh-local").profile.cross_region)
    tag = next(line.split("tag ")[1] for line in p.stderr.splitlines() if ", tag " in line)
    for rank in (0, 1):
        rec = json.loads((launch_dir / "probe" / f"node-{rank}.json").read_text())
        assert rec["cwd"] == str(launch_dir.resolve())
        assert rec["argv"] == [
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend=c10d",
            f"--rdzv-id={tag}.1",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-conf=join_timeout=120,is_host={1 - rank}",
            "--local-addr=127.0.0.1",
            "--max-restarts",
            "0",
            "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",
            "--shutdown-timeout=10",
            "-m",
            "sbatch_gen.train",
            "--config",
            "cfg `1`.yaml",
            "--run-dir",
            "runs/it's `here`",
            "--resume",
            "auto",
            "--data-path",
            "data `x` y",
            "--max-steps",
            "7",
            *xr,
            "--note",
            hostile,
            "",
        ]
        env = rec["env"]
        assert env["WEIRD"] == hostile and env["EMPTY"] == ""
        assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["OMP_NUM_THREADS"] == "2"
        assert env["SBATCH_GEN_TAG"] == tag and env["SBATCH_GEN_NODE_RANK"] == str(rank)
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO.resolve())
        assert env["PATH"].split(os.pathsep)[0] == str(venv.resolve() / "bin")
    assert "--xr-root" in xr and "/mnt/x r/mail box `y`" in xr


def test_help_and_bad_arguments(tmp_path):
    """--help: the usage on stdout, status 0; an unknown argument: the usage as an error, status 2. Both from a
    directory without out/: the launcher finds its library beside itself."""
    for args, code in ((["--help"], 0), (["-h"], 0), (["bogus"], 2), (["cleanup", "not-a-tag"], 2)):
        r = subprocess.run(
            ["bash", str(REPO / "out" / "ssh-local.sh"), *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == code, (args, r.stderr)
        usage = r.stdout if code == 0 else r.stderr
        assert "usage: " in usage and " cleanup TAG " in usage, (args, r.stdout, r.stderr)
        assert ("ERROR" in r.stderr) == (code != 0), (args, r.stderr)
    assert not (tmp_path / "runs").exists()  # nothing was started, nor a log written
