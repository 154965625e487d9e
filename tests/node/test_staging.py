"""How the renders get sbatch-gen's files to the nodes, run under bash from the committed renders: find_pinned
(the sha256 each render pins), pinned_library (the SSH launcher's library), stage_pinned (the Slurm job's copies
of the job library, which the script pins, and of the node program, which the job library pins, in the run dir,
kept across a checkout that changes) and preflight, the shell call of the program's preflight (a node without any
python still answers in one line)."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sbatch_gen.render import git_blob

REPO = Path(__file__).resolve().parents[2]
EU = (REPO / "out" / "eu.sbatch").read_text()
LAB = (REPO / "out" / "lab.sh").read_text()
PROGRAM = REPO / "out" / "sbatch-gen-node.py"
SHA = hashlib.sha256(PROGRAM.read_bytes()).hexdigest()


JOB_LIB = REPO / "out" / "sbatch-gen-job.sh"
LIB_SHA = hashlib.sha256(JOB_LIB.read_bytes()).hexdigest()
LIB_GIT = git_blob(JOB_LIB.read_text())
SSH_LIB = REPO / "out" / "sbatch-gen-ssh.sh"
SSH_LIB_SHA = hashlib.sha256(SSH_LIB.read_bytes()).hexdigest()


def _functions() -> str:
    """The Slurm training script's bootstrap (after main) and the job library it sources."""
    bootstrap = EU[EU.index("\n}\n", EU.index("\nmain() {\n")) + 3 : EU.rindex('\nmain "$@"')]
    return bootstrap + "\n" + JOB_LIB.read_text()


def _bash(code: str, cwd: Path, path: str = "/usr/bin:/bin") -> subprocess.CompletedProcess:
    """CODE after the bootstrap's and the job library's functions, as in a job (SLURM_JOB_ID; no scontrol on
    PATH: the script's directory is taken to be the working directory) of run dir runs/x."""
    prog = f"set -euo pipefail\nNODE_PY_SHA256={SHA}\nRUN_DIR=runs/x SLURM_JOB_ID=7\n{_functions()}\n{code}"
    return subprocess.run(
        ["bash", "-c", prog], cwd=cwd, env={"PATH": path}, capture_output=True, text=True, timeout=30
    )


def test_every_render_that_runs_it_pins_the_committed_program():
    """The SSH launcher in its settings; a Slurm script through the job library it pins, which pins the
    program (sha256 and git blob id)."""
    assert f"\nNODE_PY_SHA256={SHA}  # " in LAB
    assert f"\nJOB_LIB_SHA256={LIB_SHA}  # " in EU and f"\nJOB_LIB_GIT={LIB_GIT}  # " in EU
    assert "NODE_PY_SHA256" not in EU
    blob = git_blob(PROGRAM.read_text())
    assert f"stage_pinned SBATCH_GEN_NODE_PY sbatch-gen-node.py {SHA} {blob} " in JOB_LIB.read_text()
    if shutil.which("git"):
        assert subprocess.run(
            ["git", "hash-object", str(PROGRAM)], capture_output=True, text=True
        ).stdout == (f"{blob}\n")
    assert PROGRAM.read_bytes() == (REPO / "sbatch_gen" / "node_program.py").read_bytes()
    assert (REPO / "examples" / "out" / "sbatch-gen-node.py").read_bytes() == PROGRAM.read_bytes()


def _function(text: str, name: str) -> str:
    start = text.index(f"\n{name}() {{\n")
    return text[start : text.index("\n}\n", start) + 3]


def _lab_find_pinned() -> str:
    """The SSH library's find_pinned (the launcher ships the program it finds; a Slurm job stages it:
    stage_pinned)."""
    return _function(SSH_LIB.read_text(), "find_pinned")


def test_an_ssh_launcher_sources_only_the_library_it_pins(tmp_path):
    """pinned_library DIR: the library beside the launcher (DIR), else in out/, only with the sha256 the
    launcher pins; else one line naming what it found where, and status 1 (main exits 2)."""
    assert f"\nSSH_LIB_SHA256={SSH_LIB_SHA}  # " in LAB
    find = f"SSH_LIB_SHA256={SSH_LIB_SHA}\n{_function(LAB, 'pinned_library')}\npinned_library here"
    (tmp_path / "here").mkdir()
    (tmp_path / "out").mkdir()
    shutil.copy(SSH_LIB, tmp_path / "out" / SSH_LIB.name)
    r = _bash(find, tmp_path)
    assert r.returncode == 0 and r.stdout == f"out/{SSH_LIB.name}\n", r.stderr
    (tmp_path / "here" / SSH_LIB.name).write_text(SSH_LIB.read_text())
    r = _bash(find, tmp_path)
    assert r.returncode == 0 and r.stdout == f"here/{SSH_LIB.name}\n", r.stderr
    (tmp_path / "here" / SSH_LIB.name).write_text("# another version\n")
    (tmp_path / "out" / SSH_LIB.name).unlink()
    r = _bash(find, tmp_path)
    other = hashlib.sha256(b"# another version\n").hexdigest()
    assert r.returncode == 1 and r.stdout == ""
    assert re.fullmatch(
        rf"\[sbatch-gen [0-9T:-]+Z\] ERROR: the {SSH_LIB.name} this script pins \(sha256 {SSH_LIB_SHA}\) is not "
        rf"there: here/{SSH_LIB.name} has sha256 {other}; no out/{SSH_LIB.name}, in {tmp_path} \(sbatch-gen "
        r"render writes it beside the renders, with sbatch-gen-node.py: render again, or copy both beside this "
        r"script\)\n",
        r.stderr,
    ), r.stderr


def test_find_pinned_takes_the_first_file_with_the_pinned_sha256(tmp_path):
    (tmp_path / "old.py").write_text("print('an older node program')\n")
    shutil.copy(PROGRAM, tmp_path / "good.py")
    find = _lab_find_pinned() + '\nfind_pinned sbatch-gen-node.py "$NODE_PY_SHA256"'
    r = _bash(f'{find} missing.py old.py good.py; echo "$PINNED_FOUND"', tmp_path)
    assert r.returncode == 0 and r.stdout == "good.py\n", r.stderr
    r = _bash(f'{find} missing.py old.py || echo "$NODE_ERROR"', tmp_path)
    old = hashlib.sha256(b"print('an older node program')\n").hexdigest()
    assert r.stdout == (
        f"the sbatch-gen-node.py this script pins (sha256 {SHA}) is not there: no missing.py; "
        f"old.py has sha256 {old} (sbatch-gen render writes it beside the renders: render again and review "
        "the diff)\n"
    )


# How a job stages each: the script the job library, the job library the node program.
STAGE = {
    "sbatch-gen-job.sh": f'stage_pinned JOB_LIB sbatch-gen-job.sh {LIB_SHA} {LIB_GIT}; echo "$JOB_LIB"',
    "sbatch-gen-node.py": 'stage_node_program; echo "$SBATCH_GEN_NODE_PY"',
}


@pytest.mark.parametrize(
    "name, source, sha",
    [("sbatch-gen-node.py", PROGRAM, SHA), ("sbatch-gen-job.sh", JOB_LIB, LIB_SHA)],
    ids=["node program", "job library"],
)
def test_stage_pinned_copies_it_into_the_run_dir_once(tmp_path, name, source, sha):
    (tmp_path / "out").mkdir()
    shutil.copy(source, tmp_path / "out" / name)
    stem, ext = name.rsplit(".", 1)
    staged = f"runs/x/node/{stem}.{sha[:16]}.{ext}"
    r = _bash(STAGE[name], tmp_path)
    assert r.returncode == 0 and r.stdout == f"{staged}\n", r.stderr
    assert (tmp_path / staged).read_bytes() == source.read_bytes()
    # a requeue after `git pull` changed out/: the run keeps the file it started with
    (tmp_path / "out" / name).write_text("changed\n")
    r = _bash(STAGE[name], tmp_path)
    assert r.returncode == 0 and r.stdout == f"{staged}\n", r.stderr
    assert (tmp_path / staged).read_bytes() == source.read_bytes()
    # a new run dir with the changed checkout (no git): the job stops before any step, naming the file
    r = _bash(f'RUN_DIR=runs/y; {STAGE[name].split(";")[0]} || echo "$NODE_ERROR"', tmp_path)
    changed = hashlib.sha256(b"changed\n").hexdigest()
    assert r.stdout == (
        f"the {name} this job pins (sha256 {sha}) is not beside its script (.), in out/ or in git's objects "
        f"(out/{name} has sha256 {changed}) (sbatch-gen render writes it "
        "beside the renders: render again, review the diff and resubmit)\n"
    ), r.stdout
    assert not list((tmp_path / "runs/y/node").iterdir())


def test_a_file_that_changes_while_it_is_copied_is_never_staged(tmp_path):
    """stage_pinned hashes its copy, not the file: a `git pull` or a new render that rewrites out/ while it
    is copied stops the job (here a cat that adds to what it copies stands in for the file changing)."""
    (tmp_path / "out").mkdir()
    shutil.copy(JOB_LIB, tmp_path / "out" / "sbatch-gen-job.sh")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "cat").write_text('#!/bin/bash\n/bin/cat "$@" && echo "# changed"\n')
    (stubs / "cat").chmod(0o755)
    r = _bash(
        f'stage_pinned JOB_LIB sbatch-gen-job.sh {LIB_SHA} {LIB_GIT} || echo "$NODE_ERROR"',
        tmp_path,
        path=f"{stubs}:/usr/bin:/bin",
    )
    assert r.stdout.startswith(
        f"the sbatch-gen-job.sh this job pins (sha256 {LIB_SHA}) is not beside its script"
    ), r.stdout
    assert not list((tmp_path / "runs/x/node").iterdir())  # nothing staged, no temp file left


def test_the_preflight_runs_the_staged_program(tmp_path):
    shutil.copy(PROGRAM, tmp_path / "prog.py")
    code = (
        "SBATCH_GEN_NODE_PY=prog.py\nexport SBATCH_GEN_NODE_PY\n"
        "SLURMD_NODENAME=n1 preflight data=/no/such || echo status $?"
    )
    r = _bash(
        code, tmp_path, path=f"{Path(shutil.which('python3') or '/usr/bin/python3').parent}:/usr/bin:/bin"
    )
    assert r.stderr.endswith("data path /no/such does not exist (paths.data)\n"), r.stderr
    assert r.stderr.startswith("preflight FAILED on n1: ") and r.stdout == "status 1\n"


def test_a_node_without_python_still_answers_in_one_line(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "hostname"):
        (bindir / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    r = _bash('SLURMD_NODENAME=n1 preflight data=x || echo "status $?"', tmp_path, path=str(bindir))
    assert r.stderr == "preflight FAILED on n1: python not found on PATH (python_env)\n"
    assert r.stdout == "status 1\n"
    r = _bash(
        "SLURMD_NODENAME=n1 preflight setup_error='launch directory /x does not exist' node_id=1 || true",
        tmp_path,
        path=str(bindir),
    )
    assert r.stderr == "preflight FAILED on n1: launch directory /x does not exist\n"


# ---- the training step: node_py runs the node program's run-trainer ----------------------------------

# torchrun's stand-in for the step: says it runs, waits for the stop file, then acks as the trainer does.
STEP = """\
import json, os, time
open("ready", "w").close()
while not os.path.exists("stop"):
    time.sleep(0.05)
open("stop.ack", "w").write(json.dumps({"step": 4, "checkpoint": "ck/step-4", "reason": "stop file: x"}))
"""


def test_the_slurm_training_step_is_the_node_program_itself(tmp_path):
    """srun runs `bash -c 'node_py --exec "$@"' node_py run-trainer ...` (eu.sbatch): the shell becomes the
    node program (Slurm's SIGTERM reaches it, not a shell it would end), which takes the SIGTERM as the stop
    request, waits for torchrun and exits 0 on the ack."""
    srun_words = (
        """bash -c 'node_py --exec "$@"' node_py run-trainer --stop-file "$STOP_FILE" --stopped-rc 0 \\\n"""
    )
    srun_words += """      --exit-barrier-s "$EXIT_WAIT_S" --local-ifname "$PINNED_IFNAME" -- \\\n"""
    assert srun_words in EU
    shutil.copy(PROGRAM, tmp_path / "prog.py")
    (tmp_path / "step.py").write_text(STEP)
    code = (
        "export SBATCH_GEN_NODE_PY=prog.py SLURMD_NODENAME=n1 STOP_FILE=stop\n"
        "export -f node_py\n"
        """bash -c 'node_py --exec "$@"' node_py run-trainer --stop-file "$STOP_FILE" --stopped-rc 0 """
        "--exit-barrier-s 60 --local-ifname '' -- "
        "python3 step.py &\n"
        "pid=$!\n"
        "while [[ ! -e ready ]]; do sleep 0.05; done\n"
        """tr '\\0' ' ' </proc/$pid/cmdline; echo\n"""
        "kill -TERM $pid\n"
        'wait $pid && echo "status $?"'
    )
    r = _bash(
        code, tmp_path, path=f"{Path(shutil.which('python3') or '/usr/bin/python3').parent}:/usr/bin:/bin"
    )
    cmdline, status = r.stdout.splitlines()
    assert (
        " -I prog.py run-trainer --stop-file stop --stopped-rc 0 --exit-barrier-s 60 --local-ifname  -- python3 step.py"
        in (cmdline)
    ), r.stdout
    assert Path(cmdline.split()[0]).name.startswith("python"), cmdline  # the shell is gone: exec
    assert status == "status 0", r.stderr
    assert (tmp_path / "stop").read_text() == "SIGTERM to the training step on n1\n"
    said = [line.split("] ", 1)[1] for line in r.stderr.splitlines()]
    assert said == [
        "SIGTERM on n1: asking the trainer to checkpoint and stop (stop)",
        "node n1: stopped after step 4 (stop file: x): checkpoint ck/step-4 complete",
    ], r.stderr


def test_node_py_runs_the_shipped_text_and_says_when_there_is_no_python(tmp_path):
    py_dir = Path(shutil.which("python3") or "/usr/bin/python3").parent
    # the SSH launcher ships the program as text (NODE_PY_SRC)
    shipped = (
        f"NODE_PY_SRC=$(cat {PROGRAM})\nnode_py run-trainer --stop-file s --stopped-rc 42 -- sh -c 'exit 3'"
    )
    r = _bash(shipped + ' || echo "status $?"', tmp_path, path=f"{py_dir}:/usr/bin:/bin")
    assert r.stdout == "status 3\n" and r.stderr == "", r.stderr
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    r = _bash('SLURMD_NODENAME=n1 node_py run-trainer x || echo "status $?"', tmp_path, path=str(bindir))
    assert r.stdout == "status 127\n" and r.stderr == ""  # the caller says it (the preflight: its line)
    r = _bash(
        'SLURMD_NODENAME=n1 node_py --exec run-trainer x || echo "status $?"', tmp_path, path=str(bindir)
    )
    assert r.stdout == "status 127\n"
    assert (
        r.stderr
        == "sbatch-gen: no python on PATH on n1 (python_env): cannot run the node program (run-trainer)\n"
    )


def test_stage_pinned_finds_a_queued_jobs_version_in_gits_objects(tmp_path):
    """A job submitted, then the checkout pulled and rendered again before it started: out/ holds a newer
    library, git's objects the one the job pins (by its blob id). It is staged from there, and the log says
    so; a file git never saw still stops the job, saying to resubmit."""
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "out").mkdir()
    lib = tmp_path / "out" / "sbatch-gen-job.sh"
    lib.write_bytes(JOB_LIB.read_bytes())
    subprocess.run([*git, "add", "out"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "the render the job was submitted with"], check=True)
    lib.write_text("# rendered again after a git pull\n")
    subprocess.run([*git, "commit", "-q", "-am", "a newer render"], check=True)
    r = _bash(STAGE["sbatch-gen-job.sh"], tmp_path)
    staged = f"runs/x/node/sbatch-gen-job.{LIB_SHA[:16]}.sh"
    assert r.returncode == 0 and r.stdout == f"{staged}\n", r.stderr
    assert (tmp_path / staged).read_bytes() == JOB_LIB.read_bytes()
    assert f"not in the checkout any more: staged from git's objects (blob {LIB_GIT})" in r.stderr, r.stderr
    assert [p.name for p in (tmp_path / "runs/x/node").iterdir()] == [
        staged.rsplit("/", 1)[1]
    ]  # no temp file
    r = _bash(f'stage_pinned J sbatch-gen-job.sh {"0" * 64} {"0" * 40} || echo "$NODE_ERROR"', tmp_path)
    assert "out/sbatch-gen-job.sh has sha256 " in r.stdout and "review the diff and resubmit" in r.stdout, (
        r.stdout
    )


def test_the_rendezvous_address_is_named_only_where_the_site_names_an_interface():
    """network.socket_ifname set (eu: ib0): run-trainer gets --local-ifname, the address torchrun's
    rendezvous names; unset (a CPU site): no `--local-ifname ''` in the render."""
    assert '--local-ifname "$PINNED_IFNAME"' in EU
    assert "--local-ifname" not in (REPO / "out" / "local.sbatch").read_text()


def test_a_script_submitted_from_out_names_each_file_it_found_once(tmp_path):
    """`sbatch out/eu.sbatch` from the checkout: Slurm's record of the job (Command=) puts the script in out/,
    so beside it and out/ are one place, looked at and named once."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sbatch-gen-job.sh").write_text("changed\n")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text(f"#!/bin/sh\necho 'JobId=7 Command={tmp_path}/out/eu.sbatch Foo=1'\n")
    (stubs / "scontrol").chmod(0o755)
    r = _bash(
        f'stage_pinned J sbatch-gen-job.sh {LIB_SHA} {LIB_GIT} || echo "$NODE_ERROR"',
        tmp_path,
        path=f"{stubs}:/usr/bin:/bin",
    )
    changed = hashlib.sha256(b"changed\n").hexdigest()
    assert f"is not beside its script ({tmp_path}/out), in out/ or in git's objects (" in r.stdout, r.stdout
    assert r.stdout.count(" has sha256 ") == 1 and f"out/sbatch-gen-job.sh has sha256 {changed})" in r.stdout
