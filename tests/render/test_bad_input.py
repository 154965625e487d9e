"""Bad input, table-driven: every case is one line. The contract: exit 2, exactly one line on stderr,
`sbatch-gen: file:line: field: message` (or `--set KEY=VALUE: field: message` for an override), no
traceback, values cut, credentials masked, nothing written.

A case is (name, edit, --set overrides, exit code, regex of the line after "sbatch-gen: "). The edit
works on a copy of sites/ (see the small edit helpers below); the command is
`sbatch-gen render --site local --out out [--set ...]`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from sbatch_gen.errors import MAX_MESSAGE_CHARS
from sbatch_gen.yamlload import parse_yaml

from .conftest import REPO, sg

LOCAL = (REPO / "sites" / "local.yaml").read_text()
N = len(LOCAL.splitlines())  # appended text starts at line N + 1


def ln(needle: str) -> int:
    """The line of `needle` in sites/local.yaml."""
    return next(i for i, line in enumerate(LOCAL.splitlines(), 1) if needle in line)


# ---- edits: each takes the sites directory and may return the site to render instead of `local`

Edit = Callable[[Path], "str | None"]


def add(text: str) -> Edit:  # append to local.yaml
    return lambda d: (d / "local.yaml").write_text((d / "local.yaml").read_text() + text) and None


def pre(text: str) -> Edit:  # prepend to local.yaml
    return lambda d: (d / "local.yaml").write_text(text + (d / "local.yaml").read_text()) and None


def sub(old: str, new: str) -> Edit:  # replace the first `old` in local.yaml
    def f(d: Path) -> None:
        text = (d / "local.yaml").read_text()
        assert old in text, old
        (d / "local.yaml").write_text(text.replace(old, new, 1))

    return f


def put(name: str, data: str | bytes) -> Edit:  # write a file (relative to sites/)
    def f(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())

    return f


def link(name: str, target: str) -> Edit:  # a symbolic link sites/NAME -> TARGET
    return lambda d: os.symlink(target, d / name)


def site(name: str) -> Edit:  # render this site instead
    return lambda d: name


def seq(*edits: Edit) -> Edit:
    def f(d: Path) -> str | None:
        chosen = None
        for e in edits:
            chosen = e(d) or chosen
        return chosen

    return f


def _bomb(levels: int, width: int = 10) -> str:
    """A "billion laughs": level k is `width` aliases of level k-1."""
    out = [f"x0: &a0 [{', '.join(['lol'] * width)}]"]
    for k in range(1, levels):
        out.append(f"x{k}: &a{k} [{', '.join([f'*a{k - 1}'] * width)}]")
    return "\n".join(out) + "\n"


def _merge_bomb(levels: int, width: int = 10) -> str:
    out = ["m0: &m0 {k: lol}"]
    for k in range(1, levels):
        out.append(f"m{k}: &m{k} {{<<: [{', '.join([f'*m{k - 1}'] * width)}]}}")
    return "\n".join(out) + "\n"


BOMB = _bomb(6)  # 10^6 values once expanded
FLOW_BOMB = (
    "[" + ", ".join(f"&a{k} [{', '.join([f'*a{k - 1}'] * 10) if k else 'lol'}]" for k in range(6)) + "]"
)
DEEP = "[" * 10_000 + "]" * 10_000
BIG = "x" * 100_000
AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
T = "sites/local\\.yaml"

CASES = [
    # --- moved here from test_errors.py
    (
        "unknown top-level key",
        add("preemtion:\n  max_requeues: 2\n"),
        (),
        2,
        rf"{T}:{N + 1}: preemtion: unknown key 'preemtion' .*; did you mean 'preemption'\?$",
    ),
    ("wrong type", sub("  nodes: 2", "  nodes: two"), (), 2, rf"{T}:{ln('nodes:')}: slurm\.nodes: .*integer"),
    (
        "missing field",
        sub("  partition: debug\n", ""),
        (),
        2,
        rf"{T}:{ln('slurm:')}: slurm\.partition: required field is missing$",
    ),
    *[
        (
            f"bad time {bad}",
            sub('time: "00:30:00"', f'time: "{bad}"'),
            (),
            2,
            rf"{T}:{ln('time:')}: slurm\.time: invalid time '{re.escape(bad)}'",
        )
        for bad in ("25:00:00x", "1-25:00:00", "00:61:00", "soon", "-5")
    ],
    ("broken YAML", sub("  nodes: 2\n", "  nodes: [2\n"), (), 2, rf"{T}:\d+: invalid YAML: "),
    (
        "duplicate key",
        sub("  nodes: 2\n", "  nodes: 2\n  nodes: 3\n"),
        (),
        2,
        rf"{T}:{ln('nodes:') + 1}: slurm\.nodes: duplicate key \(first at line {ln('nodes:')}\)$",
    ),
    (
        "signal plan",
        sub("checkpoint_s: 10", "checkpoint_s: 50"),
        (),
        2,
        rf"{T}:{ln('lead_time_s')}: preemption\.lead_time_s: .*shorter than checkpoint_s \+ margin_s",
    ),
    ("unknown kind", pre("kind: pbs\n"), (), 2, rf"{T}:1: kind: unknown kind 'pbs' \(valid kinds: slurm"),
    (
        "kind: ssh forgotten",
        seq(
            put("lab2.yaml", (REPO / "sites" / "lab.yaml").read_text().replace("\nkind: ssh\n", "\n")),
            site("lab2"),
        ),
        (),
        2,
        r"sites/lab2\.yaml:1: kind: missing: the profile has kind ssh's sections \(hosts, node, ssh, launch\) and "
        r"none of kind slurm's \(slurm, .*\).*: did you mean kind: ssh\?$",
    ),
    ("unknown site", site("eur"), (), 2, r"unknown site 'eur'.*did you mean 'eu'\?$"),
    (
        "extends: missing",
        pre("extends: _base/nope.yaml\n"),
        (),
        2,
        rf"{T}:1: extends: '_base/nope\.yaml' not found",
    ),
    (
        "extends: cycle",
        seq(put("_base/a.yaml", "extends: ../local.yaml\n"), pre("extends: _base/a.yaml\n")),
        (),
        2,
        r"sites/_base/a\.yaml:1: extends: cycle: sites/local\.yaml -> sites/_base/a\.yaml -> sites/local\.yaml$",
    ),
    (
        "override: hostile path",
        None,
        ("paths.run_dir=$SCRATCH/run",),
        2,
        r"--set paths\.run_dir=\$SCRATCH/run: paths\.run_dir: path '\$SCRATCH/run' contains '\$'",
    ),
    ("override: no =", None, ("slurm.nodes",), 2, r"--set slurm\.nodes: expected dotted\.key=value$"),
    (
        "override: rendered directive",
        None,
        ("slurm.extra_directives=[--output=x]",),
        2,
        r"--set slurm\.extra_directives=\[--output=x\]: slurm\.extra_directives\[0\]: '--output=x': "
        r"sbatch-gen sets --output itself: .*set paths\.log_dir$",
    ),
    # --- the export policy (slurm.export) and the secrets read on the node (slurm.secrets_file)
    (
        "export: a secret the profile names",
        None,
        ("metrics.sinks=[wandb]", "metrics.wandb_api_key_env=SBG_W", "slurm.export=[SBG_W]"),
        2,
        r"--set slurm\.export=\[SBG_W\]: slurm\.export\[0\]: SBG_W is a secret \(metrics\.wandb_api_key_env "
        r"names it\): the job reads it on the node from slurm\.secrets_file, never from the submitting shell: "
        r"Slurm would keep its value in the job's record; remove it from slurm\.export$",
    ),
    (
        "export: a credential's name",
        None,
        ("slurm.export=[HF_HOME, HF_TOKEN]",),
        2,
        r"--set slurm\.export=\[HF_HOME, HF_TOKEN\]: slurm\.export\[1\]: HF_TOKEN is a secret: .*slurm\.secrets_file "
        r"\(name it in slurm\.secrets\)",
    ),
    (
        "export: ALL",
        None,
        ("slurm.export=[ALL]",),
        2,
        r"--set slurm\.export=\[ALL\]: slurm\.export\[0\]: ALL: --export's own word: the job takes only the names listed; remove it",
    ),
    (
        "export: a name the job always sets",
        None,
        ("slurm.export=[TORCH_DISABLE_SHARE_RDZV_TCP_STORE]",),
        2,
        r"--set slurm\.export=\[TORCH_DISABLE_SHARE_RDZV_TCP_STORE\]: slurm\.export\[0\]: TORCH_DISABLE_SHARE_RDZV_TCP_STORE: the job sets it whatever the submitting shell "
        r"holds",
    ),
    (
        "export: a name the job sets at run time",
        None,
        ("slurm.export=[PYTHONPATH]",),
        2,
        r"--set slurm\.export=\[PYTHONPATH\]: slurm\.export\[0\]: PYTHONPATH: the job sets it whatever the submitting shell holds",
    ),
    (
        "export: the loader's or bash's startup",
        None,
        ("slurm.export=[HF_HOME, LD_PRELOAD]",),
        2,
        r".*slurm\.export\[1\]: LD_PRELOAD: it changes how every program or bash in the job starts",
    ),
    (
        "export: Slurm's own, and the GPUs Slurm binds",
        None,
        ("slurm.export=[CUDA_VISIBLE_DEVICES]",),
        2,
        r".*slurm\.export\[0\]: CUDA_VISIBLE_DEVICES: Slurm sets it in every step from the GPUs it allocated",
    ),
    (
        "export: what the job takes anyway",
        None,
        ("slurm.export=[PATH]",),
        2,
        r".*slurm\.export\[0\]: PATH: the job takes it already",
    ),
    (
        "secrets: a name the job sets",
        None,
        ("slurm.secrets=[HF_TOKEN, PATH]", "slurm.secrets_file=/tmp/s.env"),
        2,
        r".*slurm\.secrets\[1\]: PATH: the job sets it whatever the submitting shell holds; a secret is a variable of its own",
    ),
    (
        "secrets over SSH: a name the launcher sets, in the launcher's words",
        lambda sites: "ssh-local",
        ("launch.secrets=[HF_TOKEN, MASTER_ADDR]",),
        2,
        r".*launch\.secrets\[1\]: MASTER_ADDR: the launcher sets it whatever the launching shell holds; a secret is",
    ),
    (
        "secrets over SSH: a Slurm variable",
        lambda sites: "ssh-local",
        ("launch.secrets=[SLURM_NODEID]",),
        2,
        r".*launch\.secrets\[0\]: SLURM_NODEID: a Slurm variable: on a host that had one, the node program",
    ),
    (
        "secrets: a refused name is its one error (no secrets file asked for it)",
        None,
        ("slurm.secrets=[SLURM_JOB_ID]",),
        2,
        r".*slurm\.secrets\[0\]: SLURM_JOB_ID: Slurm's own: Slurm sets the job's SLURM_\* variables; a secret is",
    ),
    (
        "paths.pin_code_keep without pin_code: nothing to keep",
        None,
        ("paths.pin_code=false", "paths.pin_code_keep=5"),
        2,
        r".*paths\.pin_code_keep: pin_code_keep is set but pin_code is false: no submission's code is pinned, so it keeps and removes nothing",
    ),
    (
        "secrets: one the profile sets as a variable",
        None,
        ("slurm.secrets=[OMP_NUM_THREADS]", "slurm.secrets_file=/tmp/s.env"),
        2,
        r".*slurm\.secrets\[0\]: OMP_NUM_THREADS: the profile sets it",
    ),
    (
        "extra_env: a credential, pointing to slurm.secrets",
        None,
        ("extra_env={HF_TOKEN: x}",),
        2,
        r"--set extra_env=\{HF_TOKEN: x\}: extra_env\.HF_TOKEN: HF_TOKEN holds a credential \(value <redacted>\): "
        r"it would be written into out/, which is committed; a Slurm job reads it on the node instead: name it in "
        r"slurm\.secrets \(its value in slurm\.secrets_file\)$",
    ),
    (
        "secrets: named twice",
        None,
        ("slurm.secrets=[HF_TOKEN, HF_TOKEN]", "slurm.secrets_file=/tmp/s.env"),
        2,
        r".*slurm\.secrets\[1\]: HF_TOKEN is named twice \(first at slurm\.secrets\[0\]\)",
    ),
    (
        "export: as an extra directive",
        None,
        ("slurm.extra_directives=[--export=ALL]",),
        2,
        r"--set slurm\.extra_directives=\[--export=ALL\]: slurm\.extra_directives\[0\]: '--export=ALL': sbatch-gen sets --export itself: set slurm\.export",
    ),
    (
        "a required secret and no file to read it from",
        None,
        ("metrics.sinks=[wandb]", "metrics.wandb_mode=online"),
        2,
        rf"{T}:{ln('slurm:')}: slurm\.secrets_file: the profile names secrets the job needs: WANDB_API_KEY "
        r"\(metrics\.wandb_api_key_env\); set slurm\.secrets_file to a file",
    ),
    (
        "a secrets file under another user's home",
        None,
        ("slurm.secrets_file=~root/x",),
        2,
        r"--set slurm\.secrets_file=~root/x: slurm\.secrets_file: path '~root/x': of '~' only ~/ \(the home "
        r"directory on the node\) is expanded",
    ),
    # --- a number or a boolean where a string is meant: quote it
    (
        "integer in extra_env",
        add("extra_env:\n  NCCL_NET_GDR_LEVEL: 2\n"),
        (),
        2,
        rf"{T}:{N + 2}: extra_env\.NCCL_NET_GDR_LEVEL: .*got the integer 2: quote it as written \('2'\)",
    ),
    (
        "float in extra_env",
        add("extra_env:\n  X: 1.10\n"),
        (),
        2,
        rf"{T}:{N + 2}: extra_env\.X: .*got the number 1\.1 \(as YAML reads it\): quote it as written",
    ),
    (
        "boolean in extra_env",
        add("extra_env:\n  X: yes\n"),
        (),
        2,
        rf"{T}:{N + 2}: extra_env\.X: .*got the YAML boolean true .*: quote it as written",
    ),
    (
        "integer in --set of a string field",
        None,
        ("slurm.partition=2",),
        2,
        r"--set slurm\.partition=2: slurm\.partition: .*got the integer 2: quote it as written \('2'\)",
    ),
    # --- 1. aliases that expand without bound
    (
        "alias bomb in a file",
        add(BOMB),
        (),
        2,
        rf"{T}:{N + 4}: x3\[\d+\]: aliases expand to more than 10000 values",
    ),
    (
        "merge-key bomb in a file",
        add(_merge_bomb(6)),
        (),
        2,
        rf"{T}:{N + 5}: m4\.<<\[\d+\]: aliases expand to more than 10000 values",
    ),
    (
        "alias bomb in --set",
        None,
        (f"extra_env.X={FLOW_BOMB}",),
        2,
        r"--set extra_env\.X=\[&a0 .*…: \[4\]\[\d+\]: aliases expand to more than 10000 values",
    ),
    (
        "recursive alias",
        add("x: &a [*a]\n"),
        (),
        2,
        rf"{T}:{N + 1}: x\[0\]: alias \*a refers to a value that contains it",
    ),
    ("undefined alias", add("x: *nope\n"), (), 2, rf"{T}:{N + 1}: x: alias \*nope has no anchor"),
    # --- 2. tags, nesting
    (
        "python tag",
        add("extra_env:\n  X: !!python/name:os.system\n"),
        (),
        2,
        rf"{T}:{N + 2}: extra_env\.X: YAML tag '!!python/name:os\.system' is not allowed",
    ),
    (
        "python tag on a list",
        add("x: !!python/object/apply:os.system [id]\n"),
        (),
        2,
        rf"{T}:{N + 1}: x: YAML tag '!!python/object/apply:os\.system' is not allowed",
    ),
    (
        "local tag",
        add("extra_env:\n  X: !evil foo\n"),
        (),
        2,
        rf"{T}:{N + 2}: extra_env\.X: YAML tag '!evil' is not allowed",
    ),
    (
        "tag in --set",
        None,
        ("extra_env.X=!evil foo",),
        2,
        r"--set extra_env\.X=!evil foo: \(top level\): YAML tag '!evil' is not allowed",
    ),
    (
        "value not of its tag",
        add("extra_env:\n  X: !!int abc\n"),
        (),
        2,
        rf"{T}:{N + 2}: extra_env\.X: cannot read 'abc' as !!int$",
    ),
    (
        "deep nesting in a file",
        add(f"extra_env:\n  X: {DEEP}\n"),
        (),
        2,
        rf"{T}:{N + 2}: extra_env\.X(\[0\])+…: nested more than 50 levels deep$",
    ),
    (
        "deep nesting in --set",
        None,
        (f"extra_env.X={DEEP}",),
        2,
        r"--set extra_env\.X=\[+…: [\[\]0]+…: nested more than 50 levels deep$",
    ),
    # --- 3. control characters; --set keys and paths
    (
        "NUL byte",
        add("extra_env:\n  X: a\x00b\n"),
        (),
        2,
        rf"{T}:{N + 2}: invalid YAML: character U\+0000 \(NUL\) is not allowed",
    ),
    (
        "ESC byte",
        sub("partition: debug", "partition: de\x1bbug"),
        (),
        2,
        rf"{T}:{ln('  partition:')}: invalid YAML: character U\+001B \(ESC\) is not allowed",
    ),
    (
        "not UTF-8",
        put("local.yaml", LOCAL.encode().replace(b"partition: debug", b"partition: deb\xffug", 1)),
        (),
        2,
        rf"{T}:{ln('  partition:')}: not UTF-8 text \(byte 0xff\)$",
    ),
    (
        "ESC in --set value",
        None,
        ("slurm.partition=de\x1bbug",),
        2,
        r"--set slurm\.partition=de\\x1bbug: invalid YAML: character U\+001B \(ESC\)",
    ),
    (
        "newline in --set key",
        None,
        ("slurm.no\ndes=1",),
        2,
        r"--set slurm\.no\\ndes=1: invalid key segment 'no\\ndes'",
    ),
    ("--set path into a scalar", None, ("slurm.nodes.x=1",), 2, r"--set slurm\.nodes\.x=1: slurm\.nodes: "),
    (
        "--set path into a string",
        None,
        ("trainer.resume.x=1",),
        2,
        r"--set trainer\.resume\.x=1: trainer\.resume: ",
    ),
    # --- 4. long values are cut, credentials masked
    (
        "100k value in a file",
        sub("partition: debug", f"partition: {BIG}"),
        (),
        2,
        rf"{T}:{ln('  partition:')}: slurm\.partition: .*'x{{80}}…'",
    ),
    (
        "100k value with spaces",
        sub("partition: debug", f"partition: '{'a ' * 50_000}'"),
        (),
        2,
        rf"{T}:{ln('  partition:')}: slurm\.partition: .*'(a ){{40}}…'",
    ),
    (
        "100k value in --set",
        None,
        (f"slurm.partition={BIG}",),
        2,
        r"--set slurm\.partition=x{64}…: slurm\.partition: .*'x{80}…'",
    ),
    (
        "AWS key id in a file",
        sub("  nodes: 2", f"  nodes: {AWS_KEY_ID}"),
        (),
        2,
        rf"(?!.*AKIA){T}:{ln('nodes:')}: slurm\.nodes: .*<redacted>",
    ),
    (
        "AWS key id in --set",
        None,
        (f"slurm.nodes={AWS_KEY_ID}",),
        2,
        r"(?!.*(AKIA|EXAMPLE))--set slurm\.nodes=<redacted>: slurm\.nodes: ",
    ),
    (
        "40-char secret in --set",
        None,
        (f"slurm.nodes={AWS_SECRET}",),
        2,
        r"(?!.*(wJalr|EXAMPLEKEY))--set slurm\.nodes=<redacted>: slurm\.nodes: ",
    ),
    (
        "password in --set",
        None,
        ("extra_env.DB_PASSWORD=hunter2\n",),
        2,
        r"(?!.*hunter2)--set extra_env\.DB_PASSWORD=<redacted>: the value spans lines: a --set value is one line$",
    ),
    # --- 5. extends: and symlinks stay inside the sites directory
    (
        "extends: ../",
        seq(put("../outside.yaml", "slurm: {nodes: 1}\n"), pre("extends: ../outside.yaml\n")),
        (),
        2,
        rf"{T}:1: extends: '\.\./outside\.yaml' is outside the sites directory sites \(bases are paths relative",
    ),
    (
        "extends: absolute",
        pre("extends: /etc/hosts\n"),
        (),
        2,
        rf"{T}:1: extends: '/etc/hosts' is outside the sites directory sites",
    ),
    (
        "extends: a symlink out",
        seq(
            put("../outside.yaml", "slurm: {nodes: 1}\n"),
            link("_base/evil.yaml", "../../outside.yaml"),
            pre("extends: _base/evil.yaml\n"),
        ),
        (),
        2,
        rf"{T}:1: extends: '_base/evil\.yaml' is outside the sites directory sites \(a symbolic link leads out of it\)$",
    ),
    (
        "extends: via a linked dir",
        seq(
            put("../outside.yaml", "slurm: {nodes: 1}\n"), link("up", ".."), pre("extends: up/outside.yaml\n")
        ),
        (),
        2,
        rf"{T}:1: extends: 'up/outside\.yaml' is outside the sites directory sites \(a symbolic link",
    ),
    (
        "site file is a symlink out",
        seq(put("../evil.yaml", LOCAL), link("evil.yaml", "../evil.yaml"), site("evil")),
        (),
        2,
        r"sites/evil\.yaml: a symbolic link out of the sites directory sites: profiles must live inside it$",
    ),
]


@pytest.mark.parametrize("name, edit, sets, code, rx", CASES, ids=[c[0] for c in CASES])
def test_bad_input(work, name, edit, sets, code, rx):
    sites = work / "sites"
    chosen = edit(sites) if edit is not None else None
    args = ["render", "--site", chosen or "local", "--out", "out"]
    for s in sets:
        args += ["--set", s]
    r = sg(*args)
    assert r.code == code, (r.code, r.out, r.err[:2000])
    assert "Traceback" not in r.err
    lines = r.err.splitlines()
    assert len(lines) == 1, r.err[:2000]
    assert len(lines[0]) <= MAX_MESSAGE_CHARS + len("sbatch-gen: "), lines[0][:200]
    assert re.match("sbatch-gen: " + rx, lines[0]), lines[0]
    assert not (work / "out").exists()


def test_anchors_aliases_and_merge_keys_within_the_bound_still_work():
    data, where = parse_yaml("a: &a {x: 1, y: [1, 2]}\nb:\n  <<: *a\n  z: 3\nc: [*a, *a]\n", "f.yaml")
    assert data["b"] == {"x": 1, "y": [1, 2], "z": 3}
    assert data["c"] == [data["a"], data["a"]]
    assert str(where[("b", "z")]) == "f.yaml:4"
    data, where = parse_yaml("a: &a {x: 1, y: 2}\nc: &c {x: 3, w: 4}\nb:\n  <<: [*a, *c]\n  y: 5\n", "f.yaml")
    assert data["b"] == {"x": 1, "y": 5, "w": 4}  # the first merged mapping wins; the mapping's own keys win
    assert str(where[("b", "y")]) == "f.yaml:5"
