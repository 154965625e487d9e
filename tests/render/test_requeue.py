"""The rendered batch script's requeue path, run for real under bash with stub Slurm commands.

When a requeue takes, Slurm sends TERM to every process of the job: the batch shell and the
`scontrol requeue` it is still running. A requeue that worked must never be reported as
"scontrol requeue failed; resubmit" (an operator following that starts a second job on the run dir)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .batch_sandbox import prepare

SCONTROL = r"""#!/bin/bash
# stub: $STUB_MODE selects what `scontrol requeue` does
case "$1 $2" in
  "show hostnames") echo n1; echo n2 ;;
  "show job") echo "JobId=$3 JobName=x"; echo "   Requeue=1 Restarts=$(cat "$STUB_DIR/restarts") BatchFlag=1" ;;
  requeue*)
    echo "requeue $2" >>"$STUB_DIR/calls"
    case $STUB_MODE in
      ok-then-term)  # the requeue takes, then Slurm signals every process of the job (this one too)
        echo 1 >"$STUB_DIR/restarts"
        kill -TERM "$PPID" "$$"
        sleep 0.3
        exit 0 ;;
      took-but-failed)  # the requeue took, but scontrol reports a failure (e.g. killed, timed out)
        echo 1 >"$STUB_DIR/restarts"
        exit 1 ;;
      fails)
        echo "scontrol: error: Requeue of job $2 failed" >&2
        exit 1 ;;
    esac ;;
  *) exit 0 ;;
esac
"""

SRUN = r"""#!/bin/bash
# stub: the preflight passes, the training step fails (a node failure): the script requeues
for a in "$@"; do [[ $a == preflight ]] && exit 0; done
exit 1
"""

SINFO = "#!/bin/bash\necho 'slurm 22.05.8'\n"


def _run_script(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    job, env, stub_dir = prepare(tmp_path, {"scontrol": SCONTROL, "srun": SRUN, "sinfo": SINFO}, mode)
    r = subprocess.run(
        ["bash", str(job)], cwd=job.parent, env=env, capture_output=True, text=True, timeout=60
    )
    return r, stub_dir


@pytest.mark.parametrize("mode", ["ok-then-term", "took-but-failed"])
def test_a_requeue_that_took_is_never_reported_as_failed(tmp_path, mode):
    r, stub_dir = _run_script(tmp_path, mode)
    out = r.stdout + r.stderr
    assert (stub_dir / "calls").read_text().splitlines() == ["requeue 77"], out
    assert "requeue failed" not in out and "resubmit" not in out, out
    assert "requeued: this attempt is over" in out, out
    assert r.returncode == 0, out


def test_a_failed_requeue_still_says_resubmit(tmp_path):
    r, _ = _run_script(tmp_path, "fails")
    out = r.stdout + r.stderr
    assert "ERROR: scontrol requeue failed (status 1); resubmit" in out, out
    assert r.returncode == 1, out
