"""Run the rendered `out/local.sbatch` for real under bash, with stub Slurm commands first on PATH.

The script activates the submit directory's `.venv` (its `bin/python` runs this test's interpreter) and
puts its `bin` first on PATH, so stubs for `scontrol`, `srun` and `sinfo` placed there stand in for Slurm;
`$STUB_MODE` tells them what to do and they keep notes under `$STUB_DIR` (calls, the restart count).
Shared by test_requeue.py and test_signals.py; :func:`render_local` renders the same site with overrides
(e.g. another trainer.stop_protocol) for them."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from sbatch_gen.loader import load_site
from sbatch_gen.render import render_site

from .conftest import REPO

# Stubs for a job whose training step only records its environment (in $STUB_DIR/step.env): the preflight
# passes, scontrol names two nodes and a job that may be requeued, sinfo a Slurm version.
ENV_DUMP_STUBS = {
    "srun": r"""#!/bin/bash
for a in "$@"; do [[ $a == preflight ]] && exit 0; done
env -0 >"$STUB_DIR/step.env"
""",
    "scontrol": r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") echo n1; echo n2 ;;
  "show job") echo "JobId=$3 JobName=x"; echo "   Requeue=1 Restarts=0 BatchFlag=1" ;;
esac
""",
    "sinfo": "#!/bin/bash\necho 'slurm 22.05.8'\n",
}


def render_local(*sets: str) -> str:
    """The training script of the `local` site rendered with ``--set`` overrides (as out/local.sbatch is)."""
    return render_site(load_site(REPO / "sites", "local", list(sets)))[0].text


def scontrol_stub(on_requeue: str) -> str:
    """A `scontrol` stub: `show hostnames` names n1 and n2, `show job` reports the restart count kept in
    `$STUB_DIR/restarts` and the fields in `$STUB_DIR/fields` (e.g. `Reason=TimeLimit`; `Reason=None` without it), and `requeue` notes the call in `$STUB_DIR/calls`, then runs ``on_requeue`` (bash
    lines: what the requeue does in the test); exit status 0 unless those lines exit otherwise."""
    body = "".join(f"    {line}\n" for line in on_requeue.strip("\n").splitlines())
    return (
        "#!/bin/bash\n"
        "[[ $1 != -o ]] || shift  # one line per record: the same fields\n"
        'case "$1 $2" in\n'
        '  "show hostnames") echo n1; echo n2 ;;\n'
        '  "show job") echo "JobId=$3 JobName=x Requeue=1 Restarts=$(cat "$STUB_DIR/restarts") BatchFlag=1 $(cat "$STUB_DIR/fields" 2>/dev/null || echo Reason=None)" ;;\n'
        "  requeue*)\n"
        '    echo "requeue $2" >>"$STUB_DIR/calls"\n'
        f"{body}"
        "    ;;\n"
        "esac\n"
        "exit 0\n"
    )


def prepare(
    tmp_path: Path,
    stubs: dict[str, str],
    mode: str,
    *,
    script: str | None = None,
    env: dict[str, str] | None = None,
) -> tuple[Path, dict[str, str], Path]:
    """(the job script to run with bash from its directory, its environment, the stubs' note directory)."""
    work = tmp_path / "submit"
    bindir = work / ".venv" / "bin"
    bindir.mkdir(parents=True)
    # the venv's python (the script activates python_env.path=.venv): this test run's interpreter
    stubs = {"python": f'#!/bin/sh\nexec {sys.executable} "$@"\n', **stubs}
    for name, text in stubs.items():
        p = bindir / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    (stub_dir / "restarts").write_text("0\n")
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SBATCH_GEN"))}
    full.update(
        PATH=f"{bindir}:{full['PATH']}",
        STUB_MODE=mode,
        STUB_DIR=str(stub_dir),
        SLURM_SUBMIT_DIR=str(work),
        SLURM_JOB_ID="77",
        SLURM_JOB_NAME="sbatch-gen-local",
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_NNODES="2",
        SLURM_RESTART_COUNT="0",
    )
    full.update(env or {})  # may replace the defaults above
    job = work / "job.sbatch"
    job.write_text(script if script is not None else (REPO / "out" / "local.sbatch").read_text())
    # the node program and the job library the job runs, where a checkout has them (the job looks in out/)
    (work / "out").mkdir()
    for name in ("sbatch-gen-node.py", "sbatch-gen-job.sh"):
        shutil.copy(REPO / "out" / name, work / "out" / name)
    # the submit directory is a git checkout, as a user's is: the job pins its code (paths.pin_code)
    (work / ".gitignore").write_text(".venv/\nruns/\n")
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "job"], check=True)
    return job, full, stub_dir


def start_job(job: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """Run the prepared batch script in the background (stdout and stderr together, as text), as sbatch would."""
    return subprocess.Popen(
        ["bash", str(job)],
        cwd=job.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
